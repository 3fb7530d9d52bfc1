"""The datasets users bring, checked token by token: ShareGPT, `messages` JSONL, Parquet files and folders of data
files (what `datasets.load_dataset` reads, as for a Hub id), multi-turn, through the verifier's chat template with
assistant-only loss masks; a Qwen3-style reasoning template that drops earlier turns' `<think>` blocks, with the
reasoning trained on or masked; bad records refused with one message."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import datasets
import pytest

from data.chat import encode_turns, mask_reasoning, render, rewrites_earlier_turns
from data.prompts import load_conversations
from data.selfdistill import build_sharegpt
from runtime.errors import UserError

# A Qwen3-style template (ChatML plus reasoning): an assistant turn's reasoning (`reasoning_content`, or a
# <think>...</think> block at the start of its content) is rendered only for turns after the last user turn.
REASONING_TEMPLATE = """\
{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}
{%- for message in messages[::-1] %}
{%- if not ns.found and message.role == 'user' %}{%- set ns.found = true %}{%- set ns.last_query_index = messages|length - 1 - loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = message.content %}
{%- if message.role == 'assistant' %}
{%- set reasoning = '' %}
{%- if message.reasoning_content is string %}{%- set reasoning = message.reasoning_content %}
{%- elif '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query_index %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""  # noqa: E501 (the template verbatim)

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "<think>\nTwo plus three.\n</think>\n\n5."},
    {"role": "user", "content": "And times 4?"},
    {"role": "assistant", "content": "20.", "reasoning_content": "Five times four is twenty."},
]


@pytest.fixture(scope="module")
def chatml(tiny):
    return tiny.tokenizer  # SmolLM2's ChatML template: prefixes render as prefixes


@pytest.fixture(scope="module")
def reasoner(tiny):
    tok = copy.deepcopy(tiny.tokenizer)
    tok.chat_template = REASONING_TEMPLATE
    return tok


def _split(tok, ids, mask):
    """(the text of the masked-in tokens, the text of the others), each token decoded in order."""
    on = tok.decode([t for t, m in zip(ids, mask) if m])
    off = tok.decode([t for t, m in zip(ids, mask) if not m])
    return on, off


def test_a_chatml_conversation_is_one_row_with_every_assistant_turn_in_its_mask(chatml):
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in CONVERSATION]
    assert not rewrites_earlier_turns(chatml)
    ((ids, mask),) = encode_turns(chatml, plain, 4096)
    assert ids == render(chatml, plain, add_generation_prompt=False)
    on, off = _split(chatml, ids, mask)
    assert on == "<think>\nTwo plus three.\n</think>\n\n5.<|im_end|>\n20.<|im_end|>\n"
    assert off == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
                   "<|im_start|>assistant\n<|im_start|>user\nAnd times 4?<|im_end|>\n<|im_start|>assistant\n")


def test_a_reasoning_template_gives_one_row_per_turn_as_the_verifier_sees_it(reasoner):
    """Turn 1's row holds its reasoning; turn 2's row holds turn 1 as the template renders it then (no reasoning)
    as context, and turn 2 with its reasoning as the only target."""
    assert rewrites_earlier_turns(reasoner)
    (ids1, mask1), (ids2, mask2) = encode_turns(reasoner, CONVERSATION, 4096)
    on1, off1 = _split(reasoner, ids1, mask1)
    assert on1 == "<think>\nTwo plus three.\n</think>\n\n5.<|im_end|>\n"
    assert off1 == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    on2, off2 = _split(reasoner, ids2, mask2)
    assert on2 == "<think>\nFive times four is twenty.\n</think>\n\n20.<|im_end|>\n"
    assert off2 == off1 + "5.<|im_end|>\n<|im_start|>user\nAnd times 4?<|im_end|>\n<|im_start|>assistant\n"
    assert ids2 == render(reasoner, CONVERSATION, add_generation_prompt=False)


def test_reasoning_masked_leaves_the_answers_as_the_only_targets(reasoner):
    """data.reasoning=mask: every token that overlaps a <think> block is context (loss 0), every token of the answer
    after it stays a target. The tags here are split over several tokens (not special tokens)."""
    assert len(reasoner("<think>", add_special_tokens=False)["input_ids"]) > 1
    for (ids, mask), answer in zip(encode_turns(reasoner, CONVERSATION, 4096), ["5.", "20."]):
        kept = mask_reasoning(reasoner, ids, mask)
        on, _ = _split(reasoner, ids, kept)
        assert on.lstrip("\n") == f"{answer}<|im_end|>\n"
        assert all(k <= m for k, m in zip(kept, mask))  # nothing outside an assistant span is switched on
        block = reasoner.decode([t for t, m, k in zip(ids, mask, kept) if m and not k])
        assert block.startswith("<think>\n") and "</think>" in block and answer not in block


def test_an_unclosed_reasoning_block_is_masked_to_the_end_of_its_span(reasoner):
    ids = render(reasoner, CONVERSATION[:2], add_generation_prompt=True)
    tail = reasoner("<think>\ncut off here", add_special_tokens=False)["input_ids"]
    mask = [0] * len(ids) + [1] * len(tail)
    assert mask_reasoning(reasoner, ids + tail, mask) == [0] * len(mask)


def _write_layouts(tmp_path: Path) -> dict[str, str]:
    """The same two conversations as ShareGPT JSON, `messages` JSONL, a Parquet file and a folder of Parquet data
    files (read by datasets.load_dataset, as a Hub id is)."""
    convs = [CONVERSATION, [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]]
    sharegpt_roles = {"user": "human", "assistant": "gpt", "system": "system"}
    sharegpt = [{"id": f"r{i}", "conversations": [{"from": sharegpt_roles[m["role"]],
                                                    "value": m["content"] if "reasoning_content" not in m else
                                                    f"<think>\n{m['reasoning_content']}\n</think>\n\n{m['content']}"}
                                                   for m in c]} for i, c in enumerate(convs)]
    (tmp_path / "sharegpt.json").write_text(json.dumps(sharegpt))
    rows = [{"id": f"r{i}", "messages": [{"role": m["role"], "content": m["content"],
                                          "reasoning_content": m.get("reasoning_content")} for m in c]}
            for i, c in enumerate(convs)]
    (tmp_path / "messages.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "messages.parquet"))
    (tmp_path / "hub").mkdir()
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "hub" / "train-00000-of-00001.parquet"))
    return {"sharegpt": str(tmp_path / "sharegpt.json"), "messages": str(tmp_path / "messages.jsonl"),
            "parquet": str(tmp_path / "messages.parquet"), "folder": str(tmp_path / "hub")}


@pytest.mark.parametrize("layout", ["sharegpt", "messages", "parquet", "folder"])
def test_every_layout_gives_the_same_rows_token_by_token(layout, tiny, reasoner, tmp_path, monkeypatch):
    monkeypatch.setattr(tiny, "tokenizer", reasoner)
    source = _write_layouts(tmp_path)[layout]
    ds = build_sharegpt(tiny, load_conversations(source), max_length=4096)
    assert ds["id"] == ["r0#turn1", "r0#turn2", "r1"]
    expected = [*encode_turns(reasoner, CONVERSATION, 4096),
                *encode_turns(reasoner, [{"role": "user", "content": "Name a colour."},
                                         {"role": "assistant", "content": "Blue."}], 4096)]
    assert [(list(i), list(m)) for i, m in zip(ds["input_ids"], ds["loss_mask"])] == expected


def test_a_record_with_no_assistant_turn_or_an_unknown_role_is_refused(tiny, tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"id": "q7", "messages": [{"role": "user", "content": "Hi"}]}))
    with pytest.raises(UserError, match=r"conversation 'q7': the conversation has no assistant turn.*data=selfdistill"):
        build_sharegpt(tiny, load_conversations(str(tmp_path / "a.jsonl")))
    (tmp_path / "b.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                                               {"role": "bot", "content": "Hello"}]}))
    with pytest.raises(UserError, match=r"record 0, message 1: unknown role 'bot'; expected one of"):
        load_conversations(str(tmp_path / "b.jsonl"))


def test_train_py_masks_reasoning_when_asked(tiny, reasoner, tmp_path, monkeypatch):
    """data.reasoning=mask through the data module: the rows' masks are mask_reasoning's, in every mode."""
    from data.datamodule import DistillDataModule

    monkeypatch.setattr(tiny, "tokenizer", reasoner)
    source = _write_layouts(tmp_path)["messages"]
    kw = dict(verifier=tiny, cache_dir=str(tmp_path / "cache"), mode="sharegpt", source=source, decontaminate=False)
    trained = DistillDataModule(**kw).build()
    masked = DistillDataModule(**kw, reasoning="mask").build()
    assert masked["input_ids"] == trained["input_ids"]
    assert masked["loss_mask"] == [mask_reasoning(reasoner, i, m) for i, m in zip(trained["input_ids"],
                                                                               trained["loss_mask"])]
    assert sum(map(sum, masked["loss_mask"])) < sum(map(sum, trained["loss_mask"]))
    with pytest.raises(UserError, match="data.reasoning='skip' is not one of"):
        DistillDataModule(**kw, reasoning="skip")


@pytest.mark.slow
def test_second_turns_under_a_reasoning_template_render_the_first_turn_as_the_template_does(smollm2, tmp_path,
                                                                                            monkeypatch):
    """Regeneration of a second turn where the template drops the first answer's reasoning: a2's context is the
    template's rendering of [prompt, a1 without its <think> block, user turn 2], its mask on a2 only, and a2 the
    verifier's greedy answer to exactly that context."""
    import torch

    import data.multiturn as mt
    from data.generate import generate_refill
    from data.selfdistill import FEATURES

    tok = copy.deepcopy(smollm2.tokenizer)
    tok.chat_template = REASONING_TEMPLATE
    monkeypatch.setattr(smollm2, "tokenizer", tok)
    questions = ["Name three fruits.", "What is the capital of France?", "Say hello in Spanish.", "Count to five."]
    firsts = [[{"role": "user", "content": q}] for q in questions]
    prompts = [render(tok, m, add_generation_prompt=True) for m in firsts]
    think = tok("<think>\nA short answer.\n</think>\n\n", add_special_tokens=False)["input_ids"]
    answers = generate_refill(smollm2, [p + think for p in prompts], 40, 0.0, 1.0, 4, 0)
    rows = {"id": [f"r{i}" for i in range(4)], "category": ["x"] * 4,
            "input_ids": [p + think + a for p, a in zip(prompts, answers)],
            "loss_mask": [[0] * len(p) + [1] * (len(think) + len(a)) for p, a in zip(prompts, answers)]}
    ds = datasets.Dataset.from_dict(rows, features=FEATURES)
    quality = {"min_words": 1, "english": False, "min_latin": 0.0, "max_repeat": 1.0}
    with pytest.raises(UserError, match="rewrites earlier turns.*Pass messages="):
        mt.second_turn_rows(smollm2, ds, 2, tmp_path, seed=0, max_length=512, max_new_tokens=24, user_tokens=64,
                            batch_size=4, quality=quality)
    out = mt.second_turn_rows(smollm2, ds, 2, tmp_path, seed=0, max_length=512, max_new_tokens=24, user_tokens=64,
                              batch_size=4, quality=quality, messages=dict(zip(rows["id"], firsts)))
    assert len(out) >= 1
    eos = tok.eos_token_id
    for row in out:
        j = rows["id"].index(row["id"].removesuffix("+turn2"))
        ids, mask = row["input_ids"], row["loss_mask"]
        second = mask.index(1)
        assert set(mask[second:]) == {1}
        a1 = tok.decode([t for t in rows["input_ids"][j][len(prompts[j]):] if t != eos])
        context = tok.decode(ids[:second])
        user = context.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]
        assert ids[:second] == render(tok, [*firsts[j], {"role": "assistant", "content": a1},
                                            {"role": "user", "content": user}], add_generation_prompt=True)
        assert "<think>" not in context and a1.split("</think>")[-1].strip() in context
        with torch.no_grad():
            ref = smollm2.model.generate(torch.tensor([ids[:second]]), max_new_tokens=8, do_sample=False)
        assert ids[second: second + 8] == ref[0, second:].tolist()[: len(ids) - second]
