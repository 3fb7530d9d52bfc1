"""Long-input training tasks: prompts that carry a document (prose, a reference section, a code file) and ask for
an answer that draws on it, as users' prompts do (summarise, answer from a passage, pick the passage that answers,
rewrite, translate, extract; explain, document or edit code). The verifier answers them itself (self-distillation);
this module only writes the user turns.

Documents come from what is installed, legal to ship and needs no download (`DocumentSource`s, each with its licence):
- `reference`: sections of the Python language and library reference (`pydoc_data.topics`, PSF-2.0);
- `stdlib`: standard-library module source files (PSF-2.0);
- `packages`: installed packages' long descriptions (the README in their METADATA), only those whose licence is
  permissive (MIT, BSD, Apache-2.0, PSF, ISC), the package's name, version and licence recorded per prompt.

The built-in eval split's long-context category (scripts/tools/long_prompts.py) is built from the same Python
text: every document it names (its records' `source`) is left out here, and every passage is also checked against
the evaluation texts on its own (`build_tasks(guard=...)`), so a passage hidden among others is still caught.

    from data.long_tasks import build_tasks, default_documents
    records, dropped = build_tasks(default_documents(), num=1200, seed=0)
"""

from __future__ import annotations

import importlib.metadata
import json
import pkgutil
import random
import re
import sys
import sysconfig
import textwrap
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.filters import EvalGuard, MinHashIndex, shingles, words
from data.prompts import BUILTIN_PATH

PERMISSIVE = re.compile(r"\b(MIT|BSD|Apache|PSF|Python Software Foundation|ISC)\b", re.IGNORECASE)
LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese")
# Characters per chunk: about 450-900 tokens of SmolLM2's tokenizer for prose (~4 characters a token), a little
# more tokens for code (~3.3). A prompt stays under ~1,100 tokens so an answer of 384 fits in 1,536.
PROSE_CHARS, CODE_CHARS, MIN_CHARS = (1800, 3400), (1600, 2900), 1200


@dataclass(frozen=True)
class Document:
    """One text a prompt can carry: `title` names it in questions, `origin` says where it came from (recorded per
    prompt), `kind` is `prose` or `code`."""

    title: str
    text: str
    kind: str
    origin: str
    licence: str


def _version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def eval_document_names(path: Path = BUILTIN_PATH) -> set[str]:
    """The documents the built-in eval split's long-context prompts are made from, as the `origin`s this module
    gives them (`python 3.11 pydoc_data.topics['with']`, `python 3.11 standard library heapq.py`)."""
    names = set()
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if rec.get("split") == "eval" and rec.get("source"):
                names.add(str(rec["source"]))
    return names


def reference_documents(exclude: AbstractSet[str] = frozenset()) -> list[Document]:
    """Sections of the Python reference, as `help()` shows them."""
    import pydoc_data.topics

    docs = []
    for name, text in sorted(pydoc_data.topics.topics.items()):
        origin = f"python {_version()} pydoc_data.topics[{name!r}]"
        if origin not in exclude and len(text) >= MIN_CHARS:
            title = text.strip().splitlines()[0].strip()
            docs.append(Document(title, text, "prose", origin, "PSF-2.0"))
    return docs


def stdlib_documents(exclude: AbstractSet[str] = frozenset(), limit: int | None = None) -> list[Document]:
    """Pure-Python standard-library modules (top level, not tests, not private), read as files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for info in sorted(pkgutil.iter_modules([str(root)]), key=lambda m: m.name):
        path = root / f"{info.name}.py"
        origin = f"python {_version()} standard library {info.name}.py"
        if info.name.startswith(("_", "test")) or not path.is_file() or origin in exclude:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) >= MIN_CHARS and "\t" not in text[:2000]:
            docs.append(Document(f"{info.name}.py", text, "code", origin, "PSF-2.0"))
        if limit is not None and len(docs) >= limit:
            break
    return docs


def _clean_readme(text: str) -> str:
    """A README without badge/image/HTML lines and with runs of blank lines squeezed."""
    keep = [line for line in text.splitlines()
            if not re.search(r"<img|<a |<p |</?div|<picture|<source|!\[|\[!\[|^\s*\.\. (image|raw)::|^\s*:target:",
                             line)]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(keep)).strip()


def package_documents(names: Iterable[str] | None = None) -> list[Document]:
    """Installed packages' long descriptions whose licence is permissive (or all of `names` that are)."""
    wanted = None if names is None else set(names)
    docs, seen = [], set()
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: str(d.metadata["Name"]).lower()):
        meta: Any = dist.metadata  # an email.message.Message underneath: .get, .get_all, .get_payload
        name = str(meta["Name"])
        if name.lower() in seen or (wanted is not None and name not in wanted) or name == "specdraft":
            continue
        seen.add(name.lower())
        licence = " ".join([str(meta.get("License-Expression") or ""), str(meta.get("License") or "")[:80]]
                           + [c for c in meta.get_all("Classifier") or [] if c.startswith("License")])
        body = _clean_readme(meta.get_payload() or str(meta.get("Description") or ""))
        if not PERMISSIVE.search(licence) or re.search(r"\bGPL\b|AGPL|LGPL", licence) or len(body) < MIN_CHARS:
            continue
        short = PERMISSIVE.search(licence)
        docs.append(Document(f"the README of {name}", body, "prose", f"{name} {dist.version} README (METADATA)",
                             short.group(1) if short else licence.strip()))
    return docs


def default_documents(exclude: AbstractSet[str] | None = None) -> list[Document]:
    """Every document source, less the documents the built-in eval split is made from."""
    exclude = eval_document_names() if exclude is None else exclude
    return reference_documents(exclude) + stdlib_documents(exclude) + package_documents()


_CODE_START = re.compile(r"^(    )?(async def |def |class |@)")


def chunks(doc: Document, rng: random.Random) -> list[str]:
    """`doc` cut on line boundaries into pieces of a random size in the kind's range. Prose is cut where a
    paragraph ends; code where a function, class or method starts (its indentation removed), so a piece does not
    start or stop mid-paragraph or mid-function."""
    lo, hi = CODE_CHARS if doc.kind == "code" else PROSE_CHARS
    out: list[str] = []
    cur: list[str] = []
    size, target = 0, rng.randint(lo, hi)

    def close() -> None:
        nonlocal cur, size, target
        if size >= MIN_CHARS:
            out.append(textwrap.dedent("\n".join(cur)).strip())
        cur, size, target = [], 0, rng.randint(lo, hi)

    for line in doc.text.splitlines():
        boundary = _CODE_START.match(line) is not None if doc.kind == "code" else not line.strip()
        if size + len(line) > hi and size >= MIN_CHARS and doc.kind == "prose":
            close()
        elif boundary and size >= target:
            close()
        elif doc.kind == "code" and size + len(line) > hi * 1.5:
            cur, size = [], 0  # a function too long to keep whole: dropped, the next piece starts at a boundary
            continue
        if doc.kind == "code" and not cur and not _CODE_START.match(line):
            continue  # a code piece starts at a definition
        cur.append(line)
        size += len(line) + 1
    close()
    return [c for c in out if MIN_CHARS <= len(c) <= hi * 1.5]


_IDENT = re.compile(r"`([^`\n]{3,40})`|\b([a-z_]+\.[a-z_][\w.]*\(?\)?|[a-z]+_[a-z_]+)\b")
_DEF = re.compile(r"^\s*(?:async\s+)?(def|class)\s+([A-Za-z_]\w*)", re.MULTILINE)


def _terms(text: str) -> list[str]:
    """Terms a question about `text` can name: `code` spans and dotted or snake_case names, most frequent first."""
    count: dict[str, int] = {}
    for m in _IDENT.finditer(text):
        t = (m.group(1) or m.group(2)).strip()
        if len(t) >= 4 and not t.startswith(("http", "www")):
            count[t] = count.get(t, 0) + 1
    return sorted(count, key=lambda t: -count[t])


def _defs(code: str) -> list[str]:
    return [m.group(2) for m in _DEF.finditer(code) if not m.group(2).startswith("__")]


# Each task: (category, kind of document, how many passages, template). A template gets the passages (text, title)
# and a random stream and returns the prompt, or None where the passage does not fit it (no term to ask about).
Template = Callable[[list[tuple[str, str]], random.Random], "str | None"]


def _ask_of_text(asks: Sequence[str], lead: str = "") -> Template:
    """A template that asks one of `asks` (picked at random), then gives the first passage (after `lead`)."""

    def template(p: list[tuple[str, str]], rng: random.Random) -> str:
        return f"{rng.choice(asks)}\n\n{lead}{p[0][0]}"

    return template


_summarise = _ask_of_text([
    "Summarise the following text in five bullet points, keeping its own terms.",
    "Write a one-paragraph summary of the text below for someone who has not read it.",
    "Give a short summary of this document, then list the three points a reader most needs to remember.",
    "TL;DR the following, then give the key details as a short list.",
])


def _qa(p: list[tuple[str, str]], rng: random.Random) -> str | None:
    terms = _terms(p[0][0])
    if not terms:
        return None
    term = rng.choice(terms[:5])
    ask = rng.choice([
        f"According to the passage, what is `{term}` and how is it used? Quote the sentences you rely on.",
        f"Using only the passage, explain what it says about `{term}`.",
        f"What does the passage say about `{term}`? Answer in two or three sentences, citing the passage.",
    ])
    return f"Read the passage, then answer the question.\n\nPassage:\n{p[0][0]}\n\nQuestion: {ask}"


def _retrieval(p: list[tuple[str, str]], rng: random.Random) -> str | None:
    target = rng.randrange(len(p))
    terms = _terms(p[target][0])
    if not terms:
        return None
    term = rng.choice(terms[:3])
    passages = "\n\n".join(f"[{i + 1}] {text}" for i, (text, _) in enumerate(p))
    return (f"Below are {len(p)} passages. Find the one that explains `{term}`, give its number, and answer from "
            f"it: what does it say about `{term}`? Quote the relevant sentence.\n\n{passages}")


_rewrite = _ask_of_text([
    "Rewrite the following text in plain, simple English for a beginner, keeping every fact.",
    "Rewrite this text as a numbered list of its main points.",
    "Turn the following documentation into a short email to a colleague explaining what it covers.",
    "Proofread and rewrite the first paragraphs of the text below so they read more clearly.",
])


def _translate(p: list[tuple[str, str]], rng: random.Random) -> str:
    lang = rng.choice(LANGUAGES)
    ask = rng.choice([f"Translate the first paragraph of the following text into {lang}.",
                      f"Translate the following text into {lang}, starting from the beginning.",
                      f"Give a {lang} translation of the opening sentences of this document."])
    return f"{ask}\n\n{p[0][0]}"


_extract = _ask_of_text([
    "List every function, class, option or command named in the document below, one per line, each with a few "
    "words on what it is.",
    "Extract the key terms from this document as a glossary: each term, then its meaning as the text gives it.",
    "From the document below, extract every example (code or command) it shows, and say what each one does.",
], lead="Document:\n")


def _python(ask: str, p: list[tuple[str, str]]) -> str:
    """The request `ask`, then the passage's code in a Python block."""
    return f"{ask}\n\n```python\n{p[0][0]}\n```"


def _about_a_def(p: list[tuple[str, str]], rng: random.Random, asks: Callable[[str], list[str]]) -> str | None:
    """A request about one function or class the code defines (picked at random; `asks(name)` the phrasings to pick
    from); None where it defines none."""
    defs = _defs(p[0][0])
    if not defs:
        return None
    return _python(rng.choice(asks(rng.choice(defs))), p)


def _code_explain(p: list[tuple[str, str]], rng: random.Random) -> str:
    ask = rng.choice([f"Explain what this part of {p[0][1]} does, function by function.",
                      "Walk me through the following Python code: what each function or class is for and how they "
                      "fit together.",
                      "Review this Python code: describe what it does, then point out anything that could be "
                      "simplified or might be a bug."])
    return _python(ask, p)


def _code_document(p: list[tuple[str, str]], rng: random.Random) -> str | None:
    return _about_a_def(p, rng, lambda name: [
        f"Write a docstring for `{name}` in the code below (arguments, return value, errors), and show the function "
        f"with it.",
        "Write Markdown documentation for the functions and classes in the code below: a heading and a short "
        "description for each.",
        f"Add comments to `{name}` below explaining each step, and return the commented function."])


def _code_edit(p: list[tuple[str, str]], rng: random.Random) -> str | None:
    return _about_a_def(p, rng, lambda name: [
        f"Add type hints to `{name}` in the code below and return the edited function.",
        f"Rewrite `{name}` from the code below to be easier to read, keeping its behaviour.",
        f"Write a pytest test for `{name}` from the code below.",
        f"Rename the local variables of `{name}` below to clearer names and return the function."])


TASKS: dict[str, tuple[str, int, Template]] = {
    "long_summarise": ("prose", 1, _summarise),
    "long_qa": ("prose", 1, _qa),
    "long_retrieval": ("prose", 3, _retrieval),
    "long_rewrite": ("prose", 1, _rewrite),
    "long_translate": ("prose", 1, _translate),
    "long_extract": ("prose", 1, _extract),
    "long_code_explain": ("code", 1, _code_explain),
    "long_code_document": ("code", 1, _code_document),
    "long_code_edit": ("code", 1, _code_edit),
}


def _short(text: str, n: int) -> str:
    """The first n characters of `text` (a retrieval passage is shorter, so three fit the budget)."""
    if len(text) <= n:
        return text
    cut = text[:n]
    return cut[: cut.rfind("\n")] if "\n" in cut[n // 2:] else cut


def build_tasks(docs: Sequence[Document], num: int, seed: int = 0, guard: EvalGuard | None = None,
                dedup_threshold: float = 0.5, tasks: dict[str, tuple[str, int, Template]] | None = None,
                ) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """`num` long-input prompts, task kinds (`tasks`, default TASKS) taken in turn, each from a chunk never used
    before (so no two prompts share a passage). A prompt is dropped when its text or any one of its passages
    matches an evaluation text of `guard` (exact or near-duplicate), when a passage and an evaluation text share
    70% of either's word 3-grams (a cut of a benchmark article, a benchmark question inside a document:
    EvalGuard.overlaps), or when a passage is a near-duplicate (word 3-gram Jaccard >= `dedup_threshold`) of an
    earlier prompt's passage. Returns (records in the built-in set's format plus `source` and `licence`, the
    count dropped per reason)."""
    rng = random.Random(seed)
    pools: dict[str, list[tuple[str, Document]]] = {"prose": [], "code": []}
    for doc in docs:
        pools[doc.kind] += [(c, doc) for c in chunks(doc, rng)]
    for pool in pools.values():
        rng.shuffle(pool)
    records: list[dict[str, Any]] = []
    dropped: dict[str, int] = {}
    seen = MinHashIndex(seed=2)
    tasks = TASKS if tasks is None else tasks
    names = list(tasks)
    turn = 0
    while len(records) < num and any(pools.values()):
        category = names[turn % len(names)]
        turn += 1
        kind, n, template = tasks[category]
        if len(pools[kind]) < n:
            if not any(len(pools[tasks[c][0]]) >= tasks[c][1] for c in names):
                break
            continue
        picked = [pools[kind].pop() for _ in range(n)]
        passages = [(_short(c, PROSE_CHARS[0] * 2 // 3) if n > 1 else c, d.title) for c, d in picked]
        prompt = template(passages, rng)
        why = None
        if guard is not None and (any(guard.contaminated(t) or guard.overlaps(t) for t, _ in passages)
                                  or (prompt is not None and guard.contaminated(prompt))):
            why = "matches an evaluation text"
        elif prompt is None:
            why = "no term or definition to ask about"
        elif any(seen.query(shingles(t), dedup_threshold) is not None for t, _ in passages):
            why = "near-duplicate of an earlier passage"
        if why is not None:
            dropped[why] = dropped.get(why, 0) + 1
            continue
        for t, _ in passages:
            seen.add(shingles(t))
        records.append({"id": f"lt{len(records):05d}", "category": category, "prompt": prompt,
                        "source": "; ".join(d.origin for _, d in picked),
                        "licence": "; ".join(sorted({d.licence for _, d in picked}))})
    return records, dropped


def copy_share(prompt: Sequence[Any], answer: Sequence[Any], n: int = 4) -> float:
    """Share of the answer's n-grams (tokens or words) that occur in the prompt: how much an answer draws on its
    input. 0 for an answer shorter than n."""
    grams = {tuple(prompt[i:i + n]) for i in range(len(prompt) - n + 1)}
    ans = [tuple(answer[i:i + n]) for i in range(len(answer) - n + 1)]
    return sum(g in grams for g in ans) / len(ans) if ans else 0.0


def word_copy_share(prompt: str, answer: str, n: int = 4) -> float:
    return copy_share(words(prompt), words(answer), n)

