"""An export's weights read once per run: `load_export` as models.exports.io has it, except that inside
`once_per_run()` (what `python -m eval` runs in) each export directory is loaded once for a verifier and the loaded
Export is handed to every drafter built from it (a probe and the planned drafter, a combination and its part alone;
the drafters share the network, and a drafter_dtype cast works on a copy: eval.drafters.build.make_drafter).
Outside a run every call loads, as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from models.exports import io as formats
from models.exports.io import Export, ExportInfo
from models.verifiers.core import Verifier

_LOADED: ContextVar[dict[tuple[str, int], Export] | None] = ContextVar("loaded_exports", default=None)


@contextmanager
def once_per_run() -> Iterator[None]:
    """Within this block, each export directory's weights are read once per verifier; forgotten on leaving it."""
    token = _LOADED.set({})
    try:
        yield
    finally:
        _LOADED.reset(token)


def load_export(path: str | Path | ExportInfo, verifier: Verifier, kind: str | None = None) -> Export:
    """models.exports.io.load_export, memoised within `once_per_run` (its refusals unchanged: an export of
    another kind than `kind` goes through the loader, which says so)."""
    loaded = _LOADED.get()
    if loaded is None:
        return formats.load_export(path, verifier, kind)
    folder = path.path if isinstance(path, ExportInfo) else Path(path).expanduser()
    key = (str(folder.resolve()), id(verifier))
    if key not in loaded:
        loaded[key] = formats.load_export(path, verifier, kind)
    elif kind is not None and loaded[key].kind != kind:
        return formats.load_export(path, verifier, kind)
    return loaded[key]
