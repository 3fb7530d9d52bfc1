"""Errors a user can act on.

Every exception here carries a message that says what was wrong, the value seen, and what to do.
Entry points (train.py, python -m eval) print the message alone instead of a traceback (`exit_on_user_error`).
"""

from __future__ import annotations

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
