"""Shipped training sets (data/shipped.py): pack and load, refusals, `train.py data=shipped`, and the set that ships
with the toolkit checked token by token against the embedded verifier."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from data.prompts import Conversation, load_conversations
from data.selfdistill import build_sharegpt
from data.shipped import MANIFEST, load_shipped, pack, read_manifest, verify
from data.shipped import ROOT as SHIPPED
from helpers import ROOT, varied_llama
from runtime.errors import UserError, VerifierMismatchError

DEFAULT_SET = "smollm2-selfdistill-v1"
GEMMA3_SET = "gemma3-selfdistill-v1"


def _small_set(verifier, n: int = 24):
    """Real conversations through the verifier's chat template, assistant-only masks, a source per row."""
    convs = load_conversations("builtin", split="train", limit=n)
    convs = [Conversation(c.id, c.category, [{"role": "user", "content": c.user_turns[0]},
                                             {"role": "assistant", "content": f"Answer {i}: " + c.user_turns[0][::-1]}])
             for i, c in enumerate(convs)]
    ds = build_sharegpt(verifier, convs, max_length=256)
    return ds.add_column("source", ["builtin" if i % 3 else "other" for i in range(len(ds))])


@pytest.fixture
def packed(tiny, tmp_path):
    ds = _small_set(tiny)
    manifest = pack(ds, tmp_path / "set", tiny, {"generation": {"test": True}}, rows_per_part=10)
    return ds, tmp_path / "set", manifest


def test_pack_and_load_round_trip(tiny, packed):
    ds, folder, manifest = packed
    assert [e["rows"] for e in manifest["files"]] == [10, 10, 4]
    assert manifest["counts"] == {"conversations": 24, "assistant_tokens": sum(map(sum, ds["loss_mask"])),
                                  "tokens": sum(map(len, ds["input_ids"]))}
    assert manifest["by_source"]["other"]["conversations"] == 8
    back = load_shipped(folder, tiny)
    assert back["input_ids"] == ds["input_ids"] and back["loss_mask"] == ds["loss_mask"]
    assert back["id"] == ds["id"] and back["source"] == ds["source"]
    assert back.features["input_ids"].feature.dtype == "int32" and back.features["loss_mask"].feature.dtype == "int8"
    # The same files give the same fingerprint (the hidden-state cache's key), a changed set another.
    assert load_shipped(folder, tiny)._fingerprint == back._fingerprint


def test_a_damaged_copy_is_refused(tiny, packed):
    _, folder, manifest = packed
    part = folder / manifest["files"][1]["path"]
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"part-00001.parquet is damaged .*git checkout"):
        load_shipped(folder, tiny)
    part.unlink()
    with pytest.raises(UserError, match="part-00001.parquet is missing"):
        load_shipped(folder, tiny)
    (folder / MANIFEST).write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_shipped(folder, tiny)


def test_another_verifier_or_chat_template_is_refused(tiny, packed):
    _, folder, _ = packed
    with pytest.raises(VerifierMismatchError, match="different verifier"):
        load_shipped(folder, varied_llama())
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["chat_template_sha256"] = "0" * 64
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="another chat template"):
        load_shipped(folder, tiny)


def test_an_unknown_set_names_the_ones_there(tmp_path):
    with pytest.raises(UserError, match=r"no shipped set there .*Sets in this checkout"):
        load_shipped(tmp_path / "nothing", None)


def test_nested_subsets_read_the_whole_sets_hidden_state_cache(tiny, packed, tmp_path):
    """`data.limit` on a shipped set takes the first rows of one fixed permutation (nested: 8 rows hold the first 4),
    and in offline mode every subset reads the whole set's one cache, building only the shards that hold its rows
    (the leading ones) until a run of the whole set finishes it: each row's cached states are those of its own ids,
    computed afresh."""
    import torch

    from data.datamodule import DistillDataModule
    from data.hidden_cache import load_hidden

    _, folder, _ = packed

    def module(limit):
        dm = DistillDataModule(tiny, str(tmp_path / "cache"), mode="shipped", shipped=str(folder), limit=limit,
                               cache_hidden_states=True, val_fraction=0.25, cache_shard_rows=2)
        dm.setup()
        return dm

    shards = lambda dm: sorted(p.name for p in dm.hidden_path.iterdir() if p.is_dir())
    four = module(4)
    assert shards(four) == ["00000", "00001"] and not (four.hidden_path / "done.json").exists()
    eight = module(8)
    assert shards(eight) == ["00000", "00001", "00002", "00003"] and not (eight.hidden_path / "done.json").exists()
    whole = module(None)
    assert len(shards(whole)) == -(-(len(whole.train_set) + len(whole.val_set)) // 2)  # every shard, 2 rows each
    assert (whole.hidden_path / "done.json").is_file()
    assert whole.hidden_path == eight.hidden_path == four.hidden_path
    assert len(list((tmp_path / "cache" / "hidden").iterdir())) == 1
    rows = lambda dm: {r["id"]: r["row"] for r in [*dm.train_set, *dm.val_set]}
    assert len(rows(eight)) == 8 and rows(four).items() <= rows(eight).items()
    by_row = {r["row"]: r["input_ids"] for r in [*whole.train_set, *whole.val_set]}
    decoder = tiny.model.get_decoder()
    for r in [*four.train_set, *four.val_set]:
        assert r["input_ids"] == by_row[r["row"]]
        with torch.no_grad():
            want = decoder(input_ids=torch.tensor([r["input_ids"]]), output_hidden_states=True).hidden_states[-1][0]
        got = load_hidden(four.hidden_path, r["row"])[0].float()
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_train_cli_trains_from_a_shipped_set_and_generates_nothing(tiny, packed, tmp_path):
    """The real command line: `data=shipped` on a set packed for the tiny verifier trains and exports; the cache gets
    no self-distillation folder (nothing was generated)."""
    _, folder, _ = packed
    cache = tmp_path / "cache"
    env = dict(os.environ, SPECDRAFT_CACHE=str(cache))
    proc = subprocess.run([sys.executable, "train.py", "verifier=tiny", "data=shipped", f"data.shipped={folder}",
                           "data.batch_size=4", "data.val_fraction=0.2", "trainer.max_steps=3", "logger=csv",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == f"export: {tmp_path / 'run' / 'export'}"
    assert "19 train / 5 val conversations" in proc.stdout
    assert not (cache / "selfdistill").exists() and not (cache / "selfdistill-shards").exists()
    # A set for another verifier stops the command with one message, no traceback.
    proc = subprocess.run([sys.executable, "train.py", "data=shipped", f"data.shipped={folder}", "trainer.max_steps=1",
                           f"hydra.run.dir={tmp_path / 'run2'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 2 and "different verifier" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(not (SHIPPED / DEFAULT_SET / MANIFEST).is_file(), reason="the shipped set is not in this checkout")
def test_the_shipped_set_is_the_default_verifiers_and_holds_what_its_manifest_says(smollm2):
    """The set that ships: intact, for the embedded verifier and its template, >= 10k conversations and >= 2M
    assistant tokens in <= 20 MB, every row a prompt in the chat template followed by the verifier's answer (the loss
    mask on exactly the answer), no prompt twice and none matching an evaluation prompt."""
    from data.chat import prompt_ids
    from data.filters import EvalGuard
    from data.prompts import eval_prompt_texts

    folder = SHIPPED / DEFAULT_SET
    manifest = read_manifest(folder)
    verify(folder, manifest)
    assert manifest["counts"]["conversations"] >= 10_000 and manifest["counts"]["assistant_tokens"] >= 2_000_000
    assert sum(e["bytes"] for e in manifest["files"]) <= 20 * 2**20
    ds = load_shipped(DEFAULT_SET, smollm2)
    tok = smollm2.tokenizer
    header = prompt_ids(tok, [{"role": "user", "content": "x"}])
    header = header[header.index(tok.convert_tokens_to_ids("x")) + 1:]  # end of turn + assistant header
    eos, cap = tok.eos_token_id, manifest["generation"]["max_new_tokens"]
    prompts, answers, users, two_turn = set(), 0, [], 0
    for row_id, ids, mask in zip(ds["id"], ds["input_ids"], ds["loss_mask"]):
        # The answers' spans: one, or two on a "+turn2" row (the first answer, then the verifier's own follow-up
        # turn unmasked, then the second answer to the end of the row).
        spans, j = [], 0
        while 1 in mask[j:]:
            a = mask.index(1, j)
            b = mask.index(0, a) if 0 in mask[a:] else len(mask)
            spans.append((a, b))
            j = b
        assert len(spans) == (2 if row_id.endswith("+turn2") else 1), row_id
        assert spans[-1][1] == len(ids)  # the last answer runs to the end of the row
        for a, _b in spans:
            assert ids[a - len(header):a] == header
        if len(spans) == 2:
            two_turn += 1
            assert ids[spans[0][1] - 1] == eos  # the follow-up comes after a finished first answer
        start = spans[-1][0]
        assert ids[-1] == eos or len(ids) - start == cap or len(ids) == manifest["generation"]["max_length"]
        assert tuple(ids[:start]) not in prompts
        prompts.add(tuple(ids[:start]))
        answers += sum(b - a for a, b in spans)
        for a, _ in spans:
            text = tok.decode(ids[:a])
            users.append(text[text.rfind("<|im_start|>user\n") + len("<|im_start|>user\n"):text.rfind("<|im_end|>")])
    assert two_turn == sum(c["conversations"] for k, c in manifest["by_source"].items() if k.endswith("+turn2")) > 0
    assert answers == manifest["counts"]["assistant_tokens"]
    guard = EvalGuard(eval_prompt_texts())
    contaminated = [u for u in users if guard.contaminated(u)]
    assert not contaminated, contaminated[:3]


def test_second_turns_extend_the_verifiers_own_ids(smollm2, tmp_path, monkeypatch):
    """A row [prompt, a1] gives a new row [prompt, a1, the template's next user turn, a2]: a1's ids as generated,
    the turn rendered by the chat template exactly as a two-turn chat has it, a2 the verifier's greedy answer, the
    loss mask on a1 and a2 only; a rerun reads its cache and generates nothing."""
    import datasets
    import torch

    import data.multiturn as mt
    from data.chat import prompt_ids
    from data.generate import generate_refill
    from data.selfdistill import FEATURES

    tok, eos = smollm2.tokenizer, smollm2.tokenizer.eos_token_id
    questions = ["Name three fruits.", "What is the capital of France?", "Say hello in Spanish.", "Count to five."]
    prompts = [prompt_ids(tok, [{"role": "user", "content": q}]) for q in questions]
    answers = generate_refill(smollm2, prompts, 40, 0.0, 1.0, 4, 0)
    rows = {"id": [f"r{i}" for i in range(4)], "category": ["x"] * 4,
            "input_ids": [p + a for p, a in zip(prompts, answers)],
            "loss_mask": [[0] * len(p) + [1] * len(a) for p, a in zip(prompts, answers)]}
    ds = datasets.Dataset.from_dict(rows, features=FEATURES)
    finished = [i for i, a in enumerate(answers) if a[-1] == eos]
    assert len(finished) >= 2
    quality = {"min_words": 1, "english": False, "min_latin": 0.0, "max_repeat": 1.0}
    out = mt.second_turn_rows(smollm2, ds, 2, tmp_path, seed=0, max_length=512, max_new_tokens=24, user_tokens=64,
                              batch_size=4, quality=quality)
    assert 1 <= len(out) <= 2 and all(i.endswith("+turn2") for i in out["id"])
    for row in out:
        j = ds["id"].index(row["id"].removesuffix("+turn2"))
        assert j in finished
        ids, mask = row["input_ids"], row["loss_mask"]
        first = ds[j]["input_ids"]
        assert ids[: len(first)] == first and mask[: len(first)] == ds[j]["loss_mask"]
        second = mask.index(1, len(first))
        opener = mt.user_opener_ids(tok)
        assert ids[len(first): len(first) + len(opener)] == opener
        text = tok.decode(ids[len(first) + len(opener): second])
        user = text[: text.index("<|im_end|>")]
        assert ids[len(first): second] == mt.continuation_ids(tok, user)
        assert mask[second:] == [1] * (len(ids) - second) and set(mask[len(first): second]) == {0}
        # a2 is the verifier's greedy answer to the two-turn prompt
        with torch.no_grad():
            ref = smollm2.model.generate(torch.tensor([ids[:second]]), max_new_tokens=8, do_sample=False)
        assert ids[second: second + 8] == ref[0, second:].tolist()[: len(ids) - second]
    monkeypatch.setattr(mt, "generate_refill", lambda *a, **k: (_ for _ in ()).throw(AssertionError("regenerated")))
    again = mt.second_turn_rows(smollm2, ds, 2, tmp_path, seed=0, max_length=512, max_new_tokens=24, user_tokens=64,
                                batch_size=4, quality=quality)
    assert again["input_ids"] == out["input_ids"]


def test_a_row_count_takes_the_sets_replay_sample(tiny, packed):
    """`name@N` (data.shipped) is the set's first N rows of the fixed permutation data.limit=N takes, joined beside a
    whole set as a replay sample of an older set; its own fingerprint (cache key); a bad count is one message."""
    import numpy as np

    ds, folder, _ = packed
    whole = load_shipped(folder, tiny)
    five = load_shipped(f"{folder}@5", tiny)
    assert five["id"] == [ds["id"][i] for i in np.random.default_rng(0).permutation(len(ds))[:5]]
    assert five["input_ids"] == [ds["input_ids"][ds["id"].index(i)] for i in five["id"]]
    assert len({whole._fingerprint, five._fingerprint, load_shipped(f"{folder}@6", tiny)._fingerprint}) == 3
    assert load_shipped(f"{folder}@5", tiny)._fingerprint == five._fingerprint
    joined = load_shipped([f"{folder}@5", str(folder)], tiny)
    assert list(joined["id"]) == list(five["id"]) + list(whole["id"])
    for bad, match in ((f"{folder}@0", "asks for 0 rows of a set of 24"), (f"{folder}@25", "asks for 25 rows"),
                       (f"{folder}@x", "not a row count")):
        with pytest.raises(UserError, match=match):
            load_shipped(bad, tiny)


def test_a_plain_rendered_set_packs_without_a_chat_template_and_loads_only_as_plain(tiny, cache_dir, tmp_path):
    """A base model (Gemma 3) has no chat template: its set records `rendering: plain` and no template hash (packing
    one raised 'no chat template'); a chat-rendering verifier is refused it, and a plain one a chat-rendered set."""
    from models.verifiers.tiny import build_tiny

    plain = build_tiny(cache_dir=cache_dir, rendering="plain")
    plain.tokenizer.chat_template = None  # as a base model's tokenizer
    ds = _small_set(tiny, 6)
    manifest = pack(ds, tmp_path / "plain", plain, {}, rows_per_part=10)
    assert manifest["rendering"] == "plain" and manifest["chat_template_sha256"] is None
    assert load_shipped(tmp_path / "plain", plain)["input_ids"] == ds["input_ids"]
    with pytest.raises(UserError, match="was rendered plain but the verifier renders chat"):
        load_shipped(tmp_path / "plain", tiny)
    pack(ds, tmp_path / "chat", tiny, {}, rows_per_part=10)
    with pytest.raises(UserError, match="was rendered chat but the verifier renders plain"):
        load_shipped(tmp_path / "chat", plain)


@pytest.mark.skipif(not (SHIPPED / GEMMA3_SET / MANIFEST).is_file(), reason="the Gemma 3 set is not in this checkout")
def test_the_gemma3_set_is_the_base_models_plain_continuations(gemma3):
    """The set the shipped Gemma 3 drafter trained on: intact, for Gemma 3 270M with plain rendering (no chat
    template: `<bos>`, the prompt's messages joined by a blank line, a blank line, then the model's continuation with
    the loss mask on exactly it), each answer run to `<eos>` or the answer cap, no prompt twice and none matching an
    evaluation prompt."""
    from data.chat import PLAIN_SEPARATOR
    from data.filters import EvalGuard
    from data.prompts import eval_prompt_texts

    folder = SHIPPED / GEMMA3_SET
    manifest = read_manifest(folder)
    verify(folder, manifest)
    assert manifest["verifier"] == {"loader": "gemma3", "rendering": "plain"}
    assert manifest["rendering"] == "plain" and manifest["chat_template_sha256"] is None
    ds = load_shipped(GEMMA3_SET, gemma3)
    tok = gemma3.tokenizer
    cap, longest = manifest["generation"]["max_new_tokens"], manifest["generation"]["max_length"]
    prompts, answers, texts = set(), 0, []
    for ids, mask in zip(ds["input_ids"], ds["loss_mask"]):
        start = mask.index(1)
        assert all(mask[start:]) and not any(mask[:start])  # one answer, to the end of the row
        assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:start]
        prompt = tok.decode(ids[1:start])
        assert prompt.endswith(PLAIN_SEPARATOR) and "<start_of_turn>" not in prompt
        assert ids[-1] == tok.eos_token_id or len(ids) - start == cap or len(ids) == longest
        assert tuple(ids[:start]) not in prompts
        prompts.add(tuple(ids[:start]))
        answers += len(ids) - start
        texts.append(prompt)
    assert len(ds) == manifest["counts"]["conversations"] and answers == manifest["counts"]["assistant_tokens"]
    guard = EvalGuard(eval_prompt_texts())
    # A row's prompt is its messages joined by blank lines: each message is checked (a system line before the user's)
    contaminated = [t for t in texts if guard.contaminated(t.strip())
                    or any(guard.contaminated(m) for m in t.split(PLAIN_SEPARATOR) if m.strip())]
    assert not contaminated, contaminated[:3]
