"""No server of ours outlives the command that started it (issue 78): `python -m serve` killed with SIGKILL, SIGHUP or
SIGTERM once serving, Ctrl-C while it starts, and `python -m eval ... engine_concurrency=[...]` sent SIGTERM in its
sweep each leave no process of vLLM's group and no listener on its port (runtime/lifetime.py's watchdog leads the
group and takes it down the moment its starter ends).

The first two tests run the watchdog on a small server of their own (a process and the child it forks, holding a
port), with a control that the same group started without the watchdog does outlive its starter; the engine tests
start the real vLLM server (they skip without its virtualenv, and fail under CI=true).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from helpers import ROOT

MEDUSA = ROOT / "pretrained" / "medusa-smollm2"
EAGLE3 = ROOT / "pretrained" / "eagle3-smollm2"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _processes() -> list[tuple[int, str, int, int]]:
    """(pid, state, parent, group) of every process, from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                state, ppid, pgrp = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[:3]
            except (OSError, ValueError):
                continue
            out.append((int(entry), state, int(ppid), int(pgrp)))
    return out


def _members(pgid: int) -> list[int]:
    """The live processes of group `pgid` (zombies, already ended, left out)."""
    return [pid for pid, state, _, group in _processes() if group == pgid and state != "Z"]


def _children(pid: int) -> list[int]:
    return [child for child, _, parent, _ in _processes() if parent == pid]


def _gone(pgid: int, port: int | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _members(pgid) and (port is None or not _listening(port)):
            return True
        time.sleep(0.5)
    return False


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# -- the watchdog on a server of the test's own --------------------------------------------------------------------

STARTER = textwrap.dedent("""
    import subprocess, sys, time
    sys.path.insert(0, sys.argv[1])
    from runtime.lifetime import watched
    server = [sys.executable, "-c", '''
    import os, socket, sys, time
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
    if os.fork() == 0:  # an engine process of its own, holding the socket too
        time.sleep(600)
    time.sleep(600)
    ''', sys.argv[2]]
    argv = watched(server) if sys.argv[3] == "watched" else server
    proc = subprocess.Popen(argv, start_new_session=True)
    print(proc.pid, flush=True)
    time.sleep(600)
""")


def _start(port: int, how: str) -> tuple[subprocess.Popen[str], int]:
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(ROOT), str(port), how], stdout=subprocess.PIPE,
                               text=True)
    assert starter.stdout is not None
    pgid = int(starter.stdout.readline())
    deadline = time.monotonic() + 30
    while not (_listening(port) and len(_members(pgid)) >= (3 if how == "watched" else 2)):
        assert time.monotonic() < deadline, "the test's server did not start"
        time.sleep(0.2)
    return starter, pgid


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_the_watchdog_takes_the_group_down_when_its_starter_dies(sig):
    port = _port()
    starter, pgid = _start(port, "watched")
    try:
        starter.send_signal(sig)  # a starter with no handler of its own: it dies at once, running no clean-up
        starter.wait(10)
        assert _gone(pgid, port, 30), f"group {pgid} still has {_members(pgid)} after the starter's {sig.name}"
    finally:
        _kill_group(pgid)


def test_without_the_watchdog_the_same_group_outlives_its_starter():
    """The control: what the check above would see with the server started as it was before (its own session, no
    watchdog), so the check can fail."""
    port = _port()
    starter, pgid = _start(port, "bare")
    try:
        starter.kill()
        starter.wait(10)
        assert not _gone(pgid, port, 5) and _listening(port)
    finally:
        _kill_group(pgid)


def test_the_watchdog_exits_with_its_commands_status():
    from runtime.lifetime import watched

    done = subprocess.run(watched([sys.executable, "-c", "import sys; sys.exit(7)"]), start_new_session=True,
                          timeout=30)
    assert done.returncode == 7


# -- the real server -----------------------------------------------------------------------------------------------

def _env() -> dict[str, str]:
    # the `vllm` fixture runs vLLM's engine core in-process for the offline tests; the server keeps its default
    return {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}


def _serve(port: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "serve", str(MEDUSA), "--port", str(port), "--dtype", "float32",
                             "--max-num-seqs", "1", "--max-model-len", "256"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env())


def _wait_for(proc: subprocess.Popen[str], lines: list[str], done: object, timeout: float) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while not done():  # type: ignore[operator]
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-30:])
        if select.select([proc.stdout], [], [], 1)[0]:
            lines.append(proc.stdout.readline())


@contextmanager
def _cleaned_up(proc: subprocess.Popen[str]) -> Iterator[list[int]]:
    """Whatever a test asserts, `proc` and the server groups it appends (its children's) are killed after it."""
    groups: list[int] = []
    try:
        yield groups
    finally:
        proc.kill()
        for pgid in groups:
            _kill_group(pgid)


def _group_of(pid: int, timeout: float = 120) -> int:
    """The process group the process `pid` started its server in (its child that leads a group of its own)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in _children(pid):
            try:
                if os.getpgid(child) == child:
                    return child
            except ProcessLookupError:
                continue
        time.sleep(0.2)
    raise AssertionError(f"process {pid} started no server group within {timeout:.0f} s")


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP, signal.SIGTERM], ids=lambda s: s.name)
def test_python_m_serve_killed_once_serving_leaves_no_server(vllm, sig):
    port = _port()
    proc = _serve(port)
    lines: list[str] = []
    with _cleaned_up(proc) as groups:
        _wait_for(proc, lines, lambda: any("ready at" in ln for ln in lines), 600)
        pgid = _group_of(proc.pid)
        groups.append(pgid)
        assert _listening(port) and len(_members(pgid)) >= 3  # the watchdog, vLLM's API server, its engine
        proc.send_signal(sig)
        out = proc.communicate(timeout=120)[0]
        assert _gone(pgid, port, 60), f"{sig.name}: group {pgid} left {_members(pgid)}; port {port} " \
                                      f"{'still' if _listening(port) else 'not'} listening"
        if sig != signal.SIGKILL:  # a signal it can handle: the stop is said, with no traceback
            assert proc.returncode == 0 and f"[serve] stopped ({sig.name})" in out and "Traceback" not in out
            ready = next(ln for ln in lines if "ready at" in ln)
            log = Path(ready.split("log: ")[1].split(")")[0])
            assert log.parent.name.startswith("specdraft-serve-") and not log.parent.exists()  # its temporary folder


@pytest.mark.engine
@pytest.mark.slow
def test_ctrl_c_while_python_m_serve_starts_stops_vllm_with_one_line(vllm):
    port = _port()
    proc = _serve(port)
    lines: list[str] = []
    with _cleaned_up(proc) as groups:
        _wait_for(proc, lines, lambda: any("[serve] starting" in ln for ln in lines), 600)
        pgid = _group_of(proc.pid)
        groups.append(pgid)
        time.sleep(3)  # vLLM's API server is importing
        assert _members(pgid) and not any("ready at" in ln for ln in lines)
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 130 and "[serve] stopped (SIGINT) while starting" in out
        assert "Traceback" not in out and "KeyboardInterrupt" not in out
        assert _gone(pgid, port, 60), f"group {pgid} left {_members(pgid)}"


@pytest.mark.engine
@pytest.mark.slow
def test_sigterm_to_python_m_eval_in_its_load_sweep_leaves_no_server(vllm, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "eval", f"checkpoint={EAGLE3}", "drafter=export", "alone=false",
                             "tree=chain", "tree.depth=1", "engine_peers=[vllm]", "engine_concurrency=[1]",
                             "engine_peer_tokens=[1]", "num_prompts=1", "max_new_tokens=4", "warmup=false",
                             "wandb.mode=disabled", "threads=2", f"output_dir={tmp_path}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    lines: list[str] = []
    with _cleaned_up(proc) as groups:
        _wait_for(proc, lines, lambda: any("[load] vLLM" in ln for ln in lines), 600)
        pgid = _group_of(proc.pid)
        groups.append(pgid)
        cmdline = Path(f"/proc/{pgid}/cmdline").read_bytes().split(b"\0")  # the server's command, its port
        port = int(cmdline[cmdline.index(b"--port") + 1])
        _wait_for(proc, lines, lambda: _listening(port), 600)  # the sweep's server is up
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 130 and "[eval] stopped (SIGTERM)" in out and "Traceback" not in out
        assert _gone(pgid, port, 60), f"group {pgid} left {_members(pgid)}"
