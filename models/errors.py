"""Errors a user can act on.

Every exception here carries a message that says what was wrong, the value seen, and what to do.
Entry points (train.py, python -m eval) print the message alone instead of a traceback.
"""


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
