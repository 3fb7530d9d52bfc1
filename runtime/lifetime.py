"""No server of ours outlives the command that started it, however that command ends.

A vLLM server (serve/server.py) or worker (serve/vllm_engine.py) runs as a process group of its own: its API process
and the engine processes it forks. Its starter may end in ways that run no clean-up of its own: SIGKILL, a SIGTERM
or SIGHUP with no handler, a crash. So the group is led by a watchdog, this file run as a script in the starter's
interpreter (the standard library only, nothing of the project imported):

    python runtime/lifetime.py PARENT_PID -- COMMAND...

It starts COMMAND in its own group, and takes the whole group down (SIGTERM, then SIGKILL after `GRACE` seconds) the
moment PARENT_PID is no longer its parent (the kernel's parent-death signal, and a poll for the platforms without
it), or when it is itself told to stop (SIGTERM, SIGHUP, SIGINT). When COMMAND ends by itself, the watchdog takes
down what COMMAND left in the group and exits with COMMAND's status, so the starter sees COMMAND's own exit.

`watched(argv)` is the command line that runs `argv` so; `stop_on_signals()` makes SIGTERM and SIGHUP end an entry
point as Ctrl-C does (a KeyboardInterrupt), so its `finally` and context managers stop what it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

GRACE = 20.0  # seconds a group is given to end on SIGTERM (vLLM shuts its engine down) before SIGKILL
POLL = 0.2


def watched(argv: list[str], parent: int | None = None) -> list[str]:
    """The command line that runs `argv` under the watchdog, tied to `parent` (default: this process). Start it with
    `start_new_session=True`: the watchdog then leads the group that `os.killpg(proc.pid, ...)` stops."""
    return [sys.executable, os.path.abspath(__file__), str(parent or os.getpid()), "--", *argv]


def stop_on_signals() -> None:
    """SIGTERM (`kill`, a service manager) and SIGHUP (a closed terminal or SSH session) end this process as Ctrl-C
    does, raising KeyboardInterrupt where it is, so what it started is stopped on the way out; SIGINT is set too,
    since Python leaves it ignored when the process started with it ignored (a `&` job in a non-interactive shell)."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)


def _die_with_parent() -> None:
    """Linux's PR_SET_PDEATHSIG: SIGTERM to this process when its parent ends (the poll in `_watch` covers where
    it is not available)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _group_members(pgid: int) -> list[int]:
    """The processes of group `pgid` but this one (from /proc; empty where there is no /proc)."""
    out = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields after the name: state, ppid, pgrp
            out.append(int(entry))
    return out


def _take_down(child: subprocess.Popen[bytes]) -> None:
    """SIGTERM to every process of the group but the watchdog, SIGKILL to those left after GRACE seconds."""
    pgid = os.getpgid(0)
    for sig, wait in ((signal.SIGTERM, GRACE), (signal.SIGKILL, 5.0)):
        for pid in _group_members(pgid) or ([child.pid] if child.poll() is None else []):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            child.poll()  # reap it, so it is not counted as a member
            if not _group_members(pgid) and child.poll() is not None:
                return
            time.sleep(POLL)


def _watch(parent: int, argv: list[str]) -> int:
    stopping: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        stopping.append(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, stop)
    _die_with_parent()
    if os.getppid() != parent:  # the starter ended before the parent-death signal was set
        return 1
    child = subprocess.Popen(argv)  # in this group: the watchdog leads it
    while child.poll() is None and not stopping and os.getppid() == parent:
        time.sleep(POLL)
    code = child.poll()
    _take_down(child)  # the child's leftovers, or the child itself when the parent is gone or we were told to stop
    if code is None:
        code = child.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        sys.exit("usage: python runtime/lifetime.py PARENT_PID -- COMMAND...")
    sys.exit(_watch(int(sys.argv[1]), sys.argv[3:]))
