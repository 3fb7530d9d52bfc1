"""Build the built-in set's long-context category (`long_context`, eval split): prompts of 700+ tokens after the
default verifier's chat template, from text that ships with Python itself, so anyone can rebuild them:

- summarise: a section of the Python language reference (`pydoc_data.topics`, the text `help()` shows);
- answer from a passage: another reference section, then a question only the passage answers;
- continue a code file: the first part of a standard-library module's source.

    python -m scripts.tools.long_prompts [--write]     # print the table; --write replaces the category in builtin.jsonl

Each prompt is checked against the training prompts (the built-in train split) with the data pipeline's own
decontamination filter, and the set against itself for near-duplicates; the source of each is recorded.
"""

from __future__ import annotations

import argparse
import inspect
import json
import pydoc_data.topics
import sys
from pathlib import Path

from data.chat import prompt_ids
from data.filters import EvalGuard, near_duplicates
from data.prompts import BUILTIN_PATH, load_conversations
from models.verifiers.embedded import load_smollm2

CATEGORY = "long_context"
MIN_TOKENS, MAX_TOKENS = 700, 1600  # after the chat template
SUMMARISE = ("assignment", "execmodel", "compound", "customization", "function", "import", "calls", "specialnames")
PASSAGES = {
    "attribute-access": "According to the passage, what does a class do to customise what happens when an "
                        "attribute is looked up but not found, and how does that differ from the method called on "
                        "every lookup?",
    "typesmapping": "According to the passage, what does dict.setdefault return, and when does it insert a key?",
    "binary": "According to the passage, which operators does it describe, and what does the % operator do with "
              "strings?",
    "comparisons": "According to the passage, how are chained comparisons like a < b < c evaluated?",
    "formatstrings": "According to the passage, what can follow the colon in a replacement field, and what does "
                     "the '!r' conversion do?",
    "raise": "According to the passage, what does 'raise ... from ...' set on the new exception, and what does "
             "'from None' do?",
    "try": "According to the passage, in which order do the except, else and finally clauses run?",
    "with": "According to the passage, which two methods does the context manager need, and when is each called?",
}
MODULES = ("textwrap", "fnmatch", "shlex", "glob", "calendar", "string", "heapq", "queue")


def _cut(tok, text: str, budget: int) -> str:
    """`text` cut on a line boundary to at most `budget` tokens of its own."""
    out, used = [], 0
    for line in text.splitlines(keepends=True):
        n = len(tok(line, add_special_tokens=False).input_ids)
        if used + n > budget:
            break
        out.append(line)
        used += n
    return "".join(out).rstrip()


def build(tok) -> list[dict[str, str]]:
    """The category's records, in the built-in set's format plus `source`."""
    topics = pydoc_data.topics.topics
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    made: list[tuple[str, str]] = []
    for name in SUMMARISE:
        text = _cut(tok, topics[name], MAX_TOKENS - 120)
        made.append((f"Summarise the following section of the Python language reference for a programmer who "
                     f"knows another language. Give five short bullet points, then one sentence on the most common "
                     f"mistake it warns about.\n\n{text}", f"python {version} pydoc_data.topics[{name!r}]"))
    for name, question in PASSAGES.items():
        text = _cut(tok, topics[name], MAX_TOKENS - 160)
        made.append((f"Read the passage, then answer the question using only what the passage says; quote the "
                     f"sentences you rely on.\n\nPassage:\n{text}\n\nQuestion: {question}",
                     f"python {version} pydoc_data.topics[{name!r}]"))
    for name in MODULES:
        source = _cut(tok, inspect.getsource(__import__(name)), 1000)
        made.append((f"Here is the beginning of a Python module. Continue the file from where it stops, in the "
                     f"same style, with the next function or class it needs.\n\n```python\n{source}\n```",
                     f"python {version} standard library {name}.py"))
    return [{"id": f"l{i:04d}", "category": CATEGORY, "split": "eval", "prompt": p, "source": s}
            for i, (p, s) in enumerate(made, 1)]


def check(records: list[dict[str, str]], tok) -> list[int]:
    """Tokens per prompt after the chat template; refuses a prompt out of range, one that matches a training prompt,
    and near-duplicates within the set."""
    train = [t for c in load_conversations("builtin", split="train") for t in c.user_turns]
    guard = EvalGuard(train)
    lengths = [len(prompt_ids(tok, [{"role": "user", "content": r["prompt"]}])) for r in records]
    bad = [(r["id"], n) for r, n in zip(records, lengths) if not MIN_TOKENS <= n <= MAX_TOKENS]
    if bad:
        raise SystemExit(f"prompts out of {MIN_TOKENS}..{MAX_TOKENS} tokens: {bad}")
    if any(guard.contaminated(r["prompt"]) for r in records):
        raise SystemExit("a long prompt matches a training prompt")
    if len(near_duplicates([r["prompt"] for r in records], 0.7)) != len(records):
        raise SystemExit("near-duplicate long prompts")
    return lengths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help=f"replace the {CATEGORY} records of {BUILTIN_PATH.name}")
    args = ap.parse_args()
    tok = load_smollm2(dtype="float32", device="cpu").tokenizer
    records = build(tok)
    lengths = check(records, tok)
    for r, n in zip(records, lengths):
        print(f"{r['id']}  {n:5d} tokens  {r['source']}")
    print(f"{len(records)} prompts, {min(lengths)}..{max(lengths)} tokens after the chat template")
    if args.write:
        kept = [line for line in Path(BUILTIN_PATH).read_text().splitlines()
                if line.strip() and json.loads(line)["category"] != CATEGORY]
        Path(BUILTIN_PATH).write_text("\n".join(kept + [json.dumps(r) for r in records]) + "\n")
        print(f"wrote {len(records)} {CATEGORY} records into {BUILTIN_PATH}")


if __name__ == "__main__":
    main()
