"""Errors a user can act on.

Every exception here carries a message that says what was wrong, the value seen, and what to do.
Entry points (train.py, python -m eval) print the message alone instead of a traceback (`exit_on_user_error`).
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class UserError(Exception):
    """Bad input from the user: a path, a file, a config value. The message says how to fix it."""


class VerifierMismatchError(UserError):
    """A checkpoint or cache was made for a different verifier than the one given."""


class NonFiniteLossError(UserError):
    """Training produced a NaN or infinite loss; the message says which settings to change."""


def disk_full(exc: BaseException | None) -> bool:
    """Whether `exc`, or an exception behind it, is a full disk (ENOSPC) or a full quota (EDQUOT). Some say it in
    their message only: safetensors (`I/O error: No space left on device (os error 28)`), shutil.copytree (a
    shutil.Error listing each file's `[Errno 28] ...`)."""
    codes = (errno.ENOSPC, errno.EDQUOT)
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in codes:
            return True
        if any(f"(os error {code})" in str(exc) or f"[Errno {code}]" in str(exc) for code in codes):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def disk_full_error(folder: str | os.PathLike, doing: str, kept: str) -> UserError:
    """The message for a full disk met while `doing` (e.g. "writing report.json") in `folder`: what is `kept` (what
    was finished, what still holds its previous version), and what to do."""
    return UserError(f"no space left on the disk that holds {os.fspath(folder)} while {doing}. {kept} Free space "
                     f"there (df -h {os.fspath(folder)}) and run the command again.")


def user_error(exc: BaseException | None) -> UserError | None:
    """The UserError behind `exc`, if any: entry points print it alone (Hydra wraps errors raised in instantiate)."""
    while exc is not None:
        if isinstance(exc, UserError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def exit_on_user_error(fn: Callable[[], T]) -> T:
    """Run an entry point's body: a user error prints `error: <message>` to stderr and exits with status 2;
    anything else propagates with its traceback."""
    try:
        return fn()
    except Exception as exc:
        err = user_error(exc)
        if err is None:
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
