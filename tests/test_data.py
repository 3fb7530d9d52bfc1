"""Prompt sources, assistant-only loss masks, self-distillation caching, and bad-input messages."""

from __future__ import annotations

import json

import datasets
import pytest

from data.chat import encode_conversation, prompt_ids
from data.prompts import load_conversations
from data.selfdistill import build_selfdistill, check_has_targets
from runtime.errors import UserError


def test_builtin_split_is_fixed_and_disjoint():
    train = load_conversations("builtin", split="train")
    held_out = load_conversations("builtin", split="eval")
    assert len(train) >= 300 and len(held_out) >= 50
    assert not {c.id for c in train} & {c.id for c in held_out}
    assert not {c.user_turns[0] for c in train} & {c.user_turns[0] for c in held_out}
    categories = {c.category for c in train}
    assert {"writing", "math", "coding", "reasoning", "translation", "roleplay"} <= categories
    # every training category is held out too; long_context (eval only) measures long prompts, nothing trains on it
    assert {c.category for c in held_out} == categories | {"long_context"}


def test_mtbench_question_jsonl(tmp_path):
    path = tmp_path / "question.jsonl"
    rows = [{"question_id": 81, "category": "writing", "turns": ["Write a blog post.", "Rewrite it as a poem."]},
            {"question_id": 101, "category": "reasoning", "turns": ["Why is the sky blue?"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    convs = load_conversations(str(path))
    assert [c.id for c in convs] == ["81", "101"] and convs[0].category == "writing"
    assert convs[0].user_turns == ["Write a blog post.", "Rewrite it as a poem."]


def test_sharegpt_json_and_jsonl(tmp_path):
    rec = {"id": "x1", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}
    (tmp_path / "a.json").write_text(json.dumps([rec]))
    (tmp_path / "b.jsonl").write_text(json.dumps(rec) + "\n")
    for name in ("a.json", "b.jsonl"):
        (conv,) = load_conversations(str(tmp_path / name))
        assert conv.messages == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]


def test_plain_prompt_jsonl_and_datasets_dir(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "Name three rivers."}\n')
    assert load_conversations(str(tmp_path / "p.jsonl"))[0].user_turns == ["Name three rivers."]
    datasets.Dataset.from_dict({"prompt": ["One?", "Two?"], "category": ["a", "b"]}).save_to_disk(str(tmp_path / "ds"))
    convs = load_conversations(str(tmp_path / "ds"))
    assert [c.user_turns[0] for c in convs] == ["One?", "Two?"] and convs[1].category == "b"


@pytest.mark.parametrize(
    "content, message",
    [("", "is empty"), ('{"prompt": "ok"}\n{not json\n', "line 2"), ('{"text": "no prompt key"}\n', "no prompt found"),
     ('{"turns": []}\n', "non-empty list")],
)
def test_bad_prompt_files(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(UserError, match=message):
        load_conversations(str(path))
    with pytest.raises(UserError, match="does not exist"):
        load_conversations(str(tmp_path / "missing.jsonl"))


def test_loss_mask_covers_assistant_tokens_only(tiny):
    tok = tiny.tokenizer
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."},
                {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "It is 6."}]
    ids, mask = encode_conversation(tok, messages, max_length=4096)
    assert len(ids) == len(mask)
    masked = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(masked) == "It is 4.<|im_end|>\nIt is 6.<|im_end|>\n"
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert "What is 2+2?" in unmasked and "And 3+3?" in unmasked and "It is" not in unmasked
    # The prompt part equals what the verifier sees before answering.
    assert ids[: len(prompt_ids(tok, messages[:1]))] == prompt_ids(tok, messages[:1])
    short_ids, short_mask = encode_conversation(tok, messages, max_length=10)
    assert len(short_ids) == 10 and sum(short_mask) == 0


def test_selfdistill_answers_with_the_verifiers_tokens_and_caches(tiny, tmp_path):
    convs = load_conversations("builtin", split="train", limit=6)
    ds = build_selfdistill(tiny, convs, tmp_path, max_new_tokens=6, batch_size=4)
    assert len(ds) == 6 and set(ds.column_names) == {"id", "category", "input_ids", "loss_mask"}
    for row, conv in zip(ds, convs):
        p = prompt_ids(tiny.tokenizer, conv.messages)
        assert row["input_ids"][: len(p)] == p
        assert row["loss_mask"] == [0] * len(p) + [1] * (len(row["input_ids"]) - len(p))
        assert 1 <= sum(row["loss_mask"]) <= 6
    # The answers are the verifier's greedy continuation, token for token.
    import torch

    first = ds[0]
    p = prompt_ids(tiny.tokenizer, convs[0].messages)
    out = tiny.model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, top_k=None, top_p=None)
    assert first["input_ids"][len(p):] == out[0, len(p):].tolist()[: len(first["input_ids"]) - len(p)]
    # Cached: one directory, and the same settings load it instead of generating again.
    (entry,) = list((tmp_path / "selfdistill").iterdir())
    again = build_selfdistill(tiny, convs, tmp_path, max_new_tokens=6, batch_size=4)
    assert all(f["filename"].startswith(str(entry)) for f in again.cache_files)
    assert again["input_ids"] == ds["input_ids"]
    build_selfdistill(tiny, convs, tmp_path, max_new_tokens=5, batch_size=4)  # other settings: another entry
    assert len(list((tmp_path / "selfdistill").iterdir())) == 2


def test_no_assistant_tokens_is_refused(tiny, tmp_path):
    convs = load_conversations("builtin", split="train", limit=2)
    with pytest.raises(UserError, match="no row would have assistant tokens. Raise data.max_length"):
        build_selfdistill(tiny, convs, tmp_path, max_new_tokens=4, max_length=20)  # prompts alone exceed 20 tokens
    import datasets

    ds = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7], [5, 6, 7, 8]], "loss_mask": [[0, 1, 1], [0, 0, 1, 0]]})
    check_has_targets(ds, 2, "builtin")  # position 2 of row 0 is an assistant token
    with pytest.raises(UserError, match="no assistant tokens"):
        check_has_targets(ds, 3, "builtin")  # none 3 positions in


def test_humaneval_is_not_a_training_source(tiny, tmp_path):
    from data.datamodule import DistillDataModule

    with pytest.raises(UserError, match="HumanEval is kept for evaluation"):
        DistillDataModule(tiny, str(tmp_path), source="humaneval")


def test_limit_takes_every_category():
    """The built-in set is stored sorted by category: `limit` must not train on the first few categories only."""
    from collections import Counter

    counts = Counter(c.category for c in load_conversations("builtin", split="train", limit=200))
    assert len(counts) == 10 and set(counts.values()) == {20}


def test_limit_below_one_is_refused():
    with pytest.raises(UserError, match="at least 1"):
        load_conversations("builtin", split="train", limit=0)


def test_group_by_length_batches_pad_less_and_cover_every_row_once(tiny, tmp_path):
    from data.datamodule import DistillDataModule

    rng = __import__("random").Random(0)
    recs = [{"id": str(i), "conversations": [{"from": "human", "value": "Say it."},
                                             {"from": "gpt", "value": " ".join(["word"] * rng.randint(1, 300))}]}
            for i in range(320)]
    (tmp_path / "sg.json").write_text(json.dumps(recs))

    def epoch(group: bool) -> tuple[float, list[list[int]]]:
        dm = DistillDataModule(tiny, str(tmp_path), mode="sharegpt", source=str(tmp_path / "sg.json"), batch_size=4,
                               val_fraction=0.1, group_by_length=group)
        dm.setup("fit")
        real = padded = 0
        rows = []
        for batch in dm.train_dataloader():
            real += int(batch["attention_mask"].sum())
            padded += batch["attention_mask"].numel()
            rows.append(sorted(batch["attention_mask"].sum(1).tolist()))
        return real / padded, rows

    plain, plain_rows = epoch(False)
    grouped, grouped_rows = epoch(True)
    assert grouped > 0.85 and plain < 0.7, (grouped, plain)
    flat = lambda rows: sorted(x for r in rows for x in r)
    assert flat(grouped_rows) == flat(plain_rows) and len(flat(grouped_rows)) == 288  # every train row once
