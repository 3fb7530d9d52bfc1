"""A served record: what `python -m serve EXPORT --record DIR` keeps of the requests it serves, to train on.

The folder (`DIR`):

    manifest.json    what it is: the verifier's fingerprint, its rendering and chat template's sha256, the EOS id,
                     and one entry per serving session (the export served, the command's time, vLLM's version)
    records.jsonl    one line per finished request, appended by the server as each response ends
                     (serve/engine_side/specdraft_record.py): the prompt's token ids as vLLM tokenised them (for chat,
                     the chat template's rendering of the messages), each choice's answer ids and finish reason, the
                     messages or prompt as sent, the rendered prompt text, the sampling settings and the time

`open_record` makes or reopens the folder for a server (a record of another verifier or chat template is refused, a
folder holding anything else is refused, nothing in it is ever deleted); `read_record` checks one against the verifier
and reads its lines. data/served.py turns it into the trainer's rows (`python train.py data=served data.source=DIR`).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from models.verifiers.core import Verifier, template_sha256
from runtime.errors import UserError, VerifierMismatchError

FORMAT = "specdraft-served-record"
VERSION = 1
MANIFEST = "manifest.json"
RECORDS = "records.jsonl"


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's record manifest, None when it has none; a damaged one or another format is refused."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not readable JSON ({e}): the record's manifest is damaged. Restore it, or record "
                        f"into a new folder.") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        what = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise UserError(f"{folder} holds a {MANIFEST} that is not a served record's (format {what!r}, expected "
                        f"{FORMAT!r}): record into a new or empty folder.")
    if manifest.get("version") != VERSION:
        raise UserError(f"{path}: version {manifest.get('version')!r}; this toolkit reads version {VERSION}.")
    return manifest


def check_folder(folder: str | Path) -> Path:
    """Before anything loads: `folder` is new, empty, or a served record (nothing else, so a user's folder is never
    written into by mistake)."""
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--record {folder}: it is a file, not a folder; give a new folder (it is made) or a served "
                        f"record to append to.")
    if not folder.is_dir():
        return folder
    if read_manifest(folder) is None:
        entries = sorted(e.name for e in folder.iterdir())
        if entries:
            raise UserError(f"--record {folder}: the folder holds {entries[:4]}{' ...' if len(entries) > 4 else ''} "
                            f"and no served record ({MANIFEST}); record into a new or empty folder, or into a "
                            f"record `python -m serve --record` made, to append to it.")
    return folder


def check_verifier(folder: Path, manifest: dict[str, Any], verifier: Verifier, fix: str) -> None:
    """The record was made by `verifier`, rendering as it renders, with its chat template."""
    expected, actual = manifest.get("verifier_fingerprint") or {}, verifier.fingerprint
    diff = [f"{k}: {expected.get(k)!r} (record) vs {actual[k]!r} (verifier)" for k in actual
            if expected.get(k) != actual[k]]
    if diff:
        raise VerifierMismatchError(f"served record {folder} was recorded from a different verifier "
                                    f"({manifest.get('verifier_name')!r}) than {verifier.name!r}: {', '.join(diff)}. "
                                    f"{fix}")
    if manifest.get("rendering") != verifier.rendering:
        raise UserError(f"served record {folder} was rendered {manifest.get('rendering')} but the verifier renders "
                        f"{verifier.rendering}: its prompt ids are not what this verifier sees. {fix}")
    template = template_sha256(verifier.tokenizer) if verifier.rendering == "chat" else None
    if manifest.get("chat_template_sha256") != template:
        raise UserError(f"served record {folder} was rendered with another chat template (sha256 "
                        f"{str(manifest.get('chat_template_sha256'))[:16]}...) than the verifier's tokenizer has "
                        f"({str(template)[:16]}...): its prompt ids would not match this verifier's turns. {fix}")


def open_record(folder: str | Path, verifier: Verifier, export: str | Path, vllm_version: str) -> Path:
    """Make `folder` a served record of `verifier` (or reopen one of the same verifier to append to), and note this
    serving session in its manifest. Returns the folder. Another verifier's or chat template's record is refused."""
    folder = check_folder(folder)
    manifest = read_manifest(folder) if folder.is_dir() else None
    fix = ("Record into a new folder for this verifier (--record NEW_DIR), or serve the verifier that made this "
           "record.")
    if manifest is not None:
        check_verifier(folder, manifest, verifier, fix)
    else:
        folder.mkdir(parents=True, exist_ok=True)
        manifest = {"format": FORMAT, "version": VERSION, "verifier": verifier.source, "verifier_name": verifier.name,
                    "verifier_fingerprint": verifier.fingerprint, "rendering": verifier.rendering,
                    "chat_template_sha256": template_sha256(verifier.tokenizer) if verifier.rendering == "chat"
                    else None, "eos_token_id": verifier.tokenizer.eos_token_id, "records": RECORDS, "sessions": []}
    manifest["sessions"].append({"export": str(Path(export).resolve()),
                                 "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                 "vllm": vllm_version})
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    tmp.replace(folder / MANIFEST)
    (folder / RECORDS).touch()
    return folder


def read_records(folder: Path) -> tuple[list[dict[str, Any]], int]:
    """(the records, the number of lines that could not be read: a line cut by a kill mid-write)."""
    records, damaged = [], 0
    path = folder / RECORDS
    if not path.is_file():
        return [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
                assert isinstance(record, dict) and isinstance(record.get("choices"), list)
                records.append(record)
            except (ValueError, AssertionError):
                damaged += 1
    return records, damaged


def read_record(where: str | Path, verifier: Verifier) -> tuple[Path, list[dict[str, Any]], int]:
    """(the folder, its records, the lines that could not be read) of the served record at `where`, after checking it
    was made by `verifier` (its fingerprint, rendering and chat template)."""
    folder = Path(where).expanduser()
    manifest = read_manifest(folder) if folder.is_dir() else None
    if manifest is None:
        raise UserError(f"data.source={str(where)!r}: no served record there (no {MANIFEST} from `python -m serve "
                        f"EXPORT --record DIR`). Give the folder a server recorded into.")
    check_verifier(folder, manifest, verifier, "Train with the verifier that served it (verifier=...), or record "
                                               "with this one.")
    return (folder, *read_records(folder))
