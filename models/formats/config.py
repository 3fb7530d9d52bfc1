"""A family's export config as a typed, validated class: one field per config.json key the family writes, each with
its description (`help`) and bounds, written by `to_config` and read back by `from_config`, the one place that says
what the key may hold. Each family declares its class beside its layout (models/medusa.py, models/formats/eagle.py,
models/dflash.py); the keys every export shares (the verifier's, the draft layer's) are checked where they are shared.

    @dataclass(frozen=True)
    class MedusaConfig(ExportConfig):
        num_heads: int = field(metadata={"help": "the heads, one per drafted token", "min": 1})

Field metadata: `help` (what the key is, for messages and readers), `min` / `max` (inclusive bounds of a number or of
each item of a list), `choices` (the values allowed). A field with a default may be missing or null in a config.json
(the default is used); one without is required. Types: int (a bool is refused), float (an int is taken), bool, str,
dict, `list[int]`, `X | None`, and a nested ExportConfig (a JSON object).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, TypeVar, Union

from runtime.errors import UserError

C = TypeVar("C", bound="ExportConfig")


def _describe(kind: Any) -> str:
    """A type as a user reads it in a message."""
    if kind is int:
        return "a whole number"
    if kind is float:
        return "a number"
    if kind is bool:
        return "true or false"
    if kind is str:
        return "a string"
    if kind is dict:
        return "an object"
    if typing.get_origin(kind) in (list, tuple):
        return f"a list of {_describe(typing.get_args(kind)[0]).removeprefix('a ')}s"
    if isinstance(kind, type) and issubclass(kind, ExportConfig):
        return f"an object with {', '.join(f.name for f in dataclasses.fields(kind))}"
    return str(kind)


def _is(value: Any, kind: Any) -> bool:
    """Whether a JSON value is of `kind` (a bool is no number)."""
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    if kind is dict:
        return isinstance(value, dict)
    if typing.get_origin(kind) in (list, tuple):
        item = typing.get_args(kind)[0]
        return isinstance(value, (list, tuple)) and all(_is(v, item) for v in value)
    return False


def _optional(kind: Any) -> tuple[Any, bool]:
    """(the type inside `X | None`, True), or (kind, False)."""
    if typing.get_origin(kind) in (Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return kind, False


@dataclass(frozen=True)
class ExportConfig:
    """The base of a family's export config class (see the module doc)."""

    @classmethod
    def from_config(cls: type[C], config: dict[str, Any], file: str | Path, prefix: str = "") -> C:
        """The family's keys of a config.json (`file`) as this class, each checked against its field: a missing
        required key, a value of the wrong type or out of bounds refused naming the file, the key, the value seen
        and the fix. Keys the class does not declare (the verifier's, the draft layer's) are left to their readers."""
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            key = f"{prefix}{f.name}"
            kind, optional = _optional(hints[f.name])
            has_default = f.default is not MISSING or f.default_factory is not MISSING
            value = config.get(f.name)
            what = f.metadata.get("help", f.name)
            if value is None:
                if f.name in config and optional:
                    values[f.name] = None
                elif not has_default:
                    raise UserError(f"{file}: {key} is missing ({what}). Re-export the drafter, or set {key} to "
                                    f"{_describe(kind)}.")
                continue
            if isinstance(kind, type) and issubclass(kind, ExportConfig):
                if not isinstance(value, dict):
                    raise UserError(f"{file}: {key}={value!r}: give {_describe(kind)} ({what}). Re-export the "
                                    f"drafter, or fix {key}.")
                values[f.name] = kind.from_config(value, file, f"{key}.")
                continue
            if not _is(value, kind):
                raise UserError(f"{file}: {key}={value!r}: give {_describe(kind)} ({what}). Re-export the drafter, "
                                f"or fix {key}.")
            items = value if isinstance(value, (list, tuple)) else [value]
            low, high, choices = f.metadata.get("min"), f.metadata.get("max"), f.metadata.get("choices")
            bad = next((v for v in items if (low is not None and v < low) or (high is not None and v > high)
                        or (choices is not None and v not in choices)), None)
            if bad is not None:
                bounds = (f"one of {list(choices)}" if choices is not None else
                          " and ".join(s for s in (f">= {low}" if low is not None else "",
                                                    f"<= {high}" if high is not None else "") if s))
                which = f"{key}={value!r} holds {bad!r}" if isinstance(value, (list, tuple)) else f"{key}={value!r}"
                raise UserError(f"{file}: {which}: give {bounds} ({what}). Re-export the drafter, or fix {key}.")
            values[f.name] = list(value) if isinstance(value, (list, tuple)) else value
        return cls(**values)

    def to_config(self) -> dict[str, Any]:
        """The config.json keys, in field order (nested classes as objects; lists as lists)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, ExportConfig):
                value = value.to_config()
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def help(cls) -> dict[str, str]:
        """key -> its description."""
        return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}
