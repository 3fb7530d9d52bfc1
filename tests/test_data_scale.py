"""Training data at scale: refill generation, self-generated prompts, filters, Hub-style datasets, resumable shards."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from data.chat import prompt_ids, render
from data.filters import EvalGuard, QualityFilter, apply_filters, near_duplicates
from data.generate import generate_refill
from data.prompts import load_conversations
from data.selfdistill import build_selfdistill
from data.selfgen import selfgen_conversations, user_header
from helpers import varied_llama


@pytest.mark.parametrize("slots", [True, False], ids=["slot-cache", "dynamic-cache"])
def test_refill_generation_equals_one_prompt_at_a_time(one_thread, slots):
    """Rows stop at different steps (a stop token per row), leave, and queued prompts join a running batch with a
    longer cache: every answer must still be the verifier's own greedy answer for that prompt alone. Both decode
    paths: the preallocated slot cache (rows moved into the holes finished rows leave) and HF's DynamicCache."""
    from data.generate import MIN_SHARED_PREFIX, _common_prefix, _slot_decoder

    v = varied_llama()
    assert _slot_decoder(v.model) is not None  # the slot path really runs on this model
    convs = load_conversations("builtin", split="train", limit=10)
    prompts = [prompt_ids(v.tokenizer, c.messages) for c in convs]
    prompts[3] = prompts[3] + prompts[3][-20:]  # one long prompt: padding differs between groups
    assert _common_prefix(prompts) >= MIN_SHARED_PREFIX  # the template's system turn is computed once
    alone = []
    for p in prompts:
        out = v.model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, top_k=None, top_p=None,
                               pad_token_id=0)
        alone.append(out[0, len(p):].tolist())
    stops = {a[k] for a, k in zip(alone, [2, 5, 9, 3, 12, 7, 4, 15, 6, 8])}
    expected = []
    for a in alone:
        cut = next((j for j, t in enumerate(a) if t in stops), None)
        expected.append(a if cut is None else a[: cut + 1])
    assert len({len(e) for e in expected}) >= 4  # rows really leave at different steps
    got = generate_refill(v, prompts, 16, batch_size=4, refill_at=1, stop_ids=sorted(stops), slots=slots)
    assert got == expected


def test_sampled_answers_do_not_depend_on_the_queue(one_thread):
    """Each prompt samples from its own stream, keyed by (seed, key): a run over part of the list, in another
    order (keys = the prompts' indices), writes what the whole run wrote for them; another seed differs (control).
    One row a batch, so the rounding is the same in both runs and only the streams are compared (across batch
    sizes the matmuls' rounding differs, and a near-flat distribution can turn on it)."""
    v = varied_llama()
    convs = load_conversations("builtin", split="train", limit=7)
    prompts = [prompt_ids(v.tokenizer, c.messages) for c in convs]
    kw = dict(temperature=1.0, top_p=0.9, seed=3, batch_size=1)
    whole = generate_refill(v, prompts, 10, **kw)
    part = generate_refill(v, prompts[4:] + prompts[:2], 10, keys=[4, 5, 6, 0, 1], order="given", **kw)
    assert part == whole[4:] + whole[:2]
    other = generate_refill(v, prompts, 10, **(kw | {"seed": 4}))
    assert sum(a != b for a, b in zip(other, whole)) >= 5
    same_prompt = generate_refill(v, [prompts[0]] * 4, 10, **kw)  # what selfgen asks: one header, many turns
    assert len({tuple(a) for a in same_prompt}) == 4 and same_prompt[0] == whole[0]


def test_sampling_follows_the_nucleus_distribution():
    """`sample` with one stream per row: 6,000 draws from fixed logits match the top-p renormalised softmax
    (chi-square, fixed seeds); the full softmax, which the cut changes, is rejected (negative control)."""
    from scipy.stats import chisquare

    from data.generate import row_generator, sample

    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0])
    p = torch.softmax(logits / 0.8, -1)
    keep = (p.cumsum(0) - p) <= 0.85  # the smallest prefix (p is sorted) reaching 0.85
    nucleus = torch.where(keep, p, torch.zeros_like(p))
    nucleus /= nucleus.sum()
    draws = torch.cat([sample(logits.expand(500, 6), 0.8, 0.85, [row_generator(11, 500 * c + r) for r in range(500)])
                       for c in range(12)])
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[~keep].sum() == 0  # nothing outside the nucleus
    n = counts.sum().item()

    def expected(q: torch.Tensor) -> object:
        q = q.double() + 1e-12
        return (q / q.sum() * n).numpy()

    assert chisquare(counts[keep].numpy(), expected(nucleus[keep])).pvalue > 0.01
    assert chisquare(counts.numpy(), expected(p)).pvalue < 1e-6  # the uncut softmax: rejected
    # temperature 0 is the argmax, and rows do not share a stream
    assert sample(torch.tensor([[0.1, 3.0, 0.2]]), 0.0, 1.0, None).tolist() == [1]


def test_user_header_is_the_template_up_to_the_user_turn(tiny):
    tok = tiny.tokenizer
    prefix, stops = user_header(tok)
    assert tok.decode(prefix).endswith("<|im_start|>user\n")
    full = render(tok, [{"role": "user", "content": "Plan a picnic."}], add_generation_prompt=False)
    body = tok("Plan a picnic.", add_special_tokens=False)["input_ids"]
    assert full[: len(prefix) + len(body) + 1] == prefix + body + [full[len(prefix) + len(body)]]
    assert full[len(prefix) + len(body)] in stops  # <|im_end|> ends a sampled user turn
    steered, _ = user_header(tok, "You are a helpful AI assistant. The user asks you about cooking.")
    assert "cooking" in tok.decode(steered) and tok.decode(steered).endswith("<|im_start|>user\n")


def test_filters_drop_degenerate_contaminated_and_near_duplicate_prompts():
    texts = ["How do I bake sourdough bread at home with a simple starter?",   # kept
             "How do I bake sourdough bread at home with a simple starter please?",  # near-duplicate of 0
             "Hi",                                                              # too short
             "I want to go go go go go go go go go go go go go",                # repeated n-grams
             "Объясните, пожалуйста, как работает фотосинтез в растениях",      # non-Latin
             "Qual è la ricetta migliore per preparare una pizza napoletana",   # not English
             "What is the capital of France, and why did it become the capital?",  # eval prompt
             "Write a short poem about the sea at night."]                      # kept
    guard = EvalGuard(["What is the capital of France and why did it become the capital?"])
    kept = apply_filters(texts, QualityFilter(), guard, 0.7, "test")
    assert kept == [0, 7]
    assert near_duplicates(texts[:2], threshold=0.99) == [0, 1]  # below the threshold both stay


def test_selfgen_prompts_are_sampled_filtered_and_cached(tmp_path, capsys):
    v = varied_llama()
    kw = dict(num=12, temperature=1.0, top_p=0.95, max_new_tokens=24, batch_size=6, seed=0, shard_size=5,
              quality={"min_words": 1, "max_words": 1000, "max_repeat": 1.0, "min_latin": 0.0, "english": False},
              dedup_threshold=None, unfinished=True, topics=["cooking", "law"])
    convs = selfgen_conversations(v, tmp_path, **kw)
    out = capsys.readouterr().out
    assert "filter selfgen: 12 in, 12 kept" in out and len(convs) == 12
    assert {c.category for c in convs} == {"selfgen/cooking", "selfgen/law"}
    assert all(c.messages[0]["role"] == "user" and c.messages[0]["content"] for c in convs)
    assert len({c.messages[0]["content"] for c in convs}) > 6  # sampled, not one greedy string
    (entry,) = list((tmp_path / "selfgen").iterdir())
    assert sorted(p.name for p in entry.iterdir()) == ["00000-5.jsonl", "00001-5.jsonl", "00002-2.jsonl"]
    (entry / "00001-5.jsonl").unlink()  # a lost shard is regenerated, the others are read back
    again = selfgen_conversations(v, tmp_path, **kw)
    assert [c.messages for c in again] == [c.messages for c in convs]


def test_hub_style_dataset_through_load_dataset(tmp_path):
    """A folder of data files goes through datasets.load_dataset, the same path a Hub id takes (the Hub itself was
    not reached in tests): UltraChat `messages` rows and ShareGPT `conversations` rows."""
    folder = tmp_path / "ultra"
    folder.mkdir()
    rows = [{"prompt_id": "a", "messages": [{"role": "user", "content": "Name three rivers."},
                                            {"role": "assistant", "content": "Nile, Amazon, Danube."}]},
            {"prompt_id": "b", "messages": [{"role": "user", "content": "What is 2+2?"},
                                            {"role": "assistant", "content": "4"}]}]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    convs = load_conversations(str(folder), hub_split="train")
    assert [c.user_turns for c in convs] == [["Name three rivers."], ["What is 2+2?"]]
    assert convs[0].messages[1] == {"role": "assistant", "content": "Nile, Amazon, Danube."}


KILL_AFTER_TWO_SHARDS = textwrap.dedent("""
    import os, signal
    import data.selfdistill as sd
    from data.prompts import load_conversations
    from models.verifiers.tiny import build_tiny
    written = [0]
    real = sd.atomic_dir
    from contextlib import contextmanager
    @contextmanager
    def dying_atomic_dir(path):
        with real(path) as tmp:
            yield tmp
        written[0] += 1
        if written[0] == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # killed between shard 2 and shard 3
    sd.atomic_dir = dying_atomic_dir
    v = build_tiny(cache_dir=os.environ["SPECDRAFT_CACHE"], dtype="float32", device="cpu")
    convs = load_conversations("builtin", split="train", limit=7)
    sd.build_selfdistill(v, convs, {cache!r}, max_new_tokens=6, temperature=1.0, batch_size=3, shard_size=3)
""")


def test_killed_selfdistill_resumes_from_its_shards(tiny, tmp_path, capsys):
    convs = load_conversations("builtin", split="train", limit=7)
    kw = dict(max_new_tokens=6, temperature=1.0, batch_size=3, shard_size=3)
    whole = build_selfdistill(tiny, convs, tmp_path / "whole", **kw)
    cache = tmp_path / "killed"
    child = subprocess.run([sys.executable, "-c", KILL_AFTER_TWO_SHARDS.format(cache=str(cache))],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == -9, child.stderr[-2000:]
    finished = [p for p in (cache / "selfdistill-shards").iterdir() if not p.name.startswith(".")]
    assert len(finished) == 2 and all((p / "dataset_info.json").is_file() for p in finished)
    resumed = build_selfdistill(tiny, convs, cache, **kw)
    assert "resuming, 2 of 3 shards" in capsys.readouterr().out
    assert resumed["input_ids"] == whole["input_ids"] and resumed["id"] == whole["id"]


def test_a_source_added_later_reuses_the_first_sources_shards(tiny, tmp_path, capsys):
    """Shards are named by their own prompts, and never straddle two sources: a build with a second source after
    the first reuses every shard of the first, and its first rows are the first build's rows."""
    first = load_conversations("builtin", split="train", limit=7)
    second = load_conversations("builtin", split="train")[20:24]
    kw = dict(max_new_tokens=6, temperature=1.0, batch_size=3, shard_size=3)
    alone = build_selfdistill(tiny, first, tmp_path, groups=[7], **kw)
    capsys.readouterr()
    both = build_selfdistill(tiny, first + second, tmp_path, groups=[7, 4], **kw)
    assert "resuming, 3 of 5 shards" in capsys.readouterr().out  # 7 -> 3+3+1, 4 -> 3+1
    assert both["input_ids"][:7] == alone["input_ids"] and len(both) == 11


KILL_HIDDEN_AFTER_ONE_SHARD = textwrap.dedent("""
    import os, signal
    import data.hidden_cache as hc
    import datasets
    from models.verifiers.tiny import build_tiny
    from contextlib import contextmanager
    real = hc.atomic_dir
    @contextmanager
    def dying_atomic_dir(path):
        with real(path) as tmp:
            yield tmp
        os.kill(os.getpid(), signal.SIGKILL)  # killed right after the first shard
    hc.atomic_dir = dying_atomic_dir
    v = build_tiny(cache_dir=os.environ["SPECDRAFT_CACHE"], dtype="float32", device="cpu")
    ds = datasets.load_from_disk({data!r})
    hc.build_hidden_cache(v, ds, [0, -1], {cache!r}, shard_rows=2)
""")


def test_killed_hidden_cache_resumes(tiny, tmp_path, capsys):
    from data.hidden_cache import build_hidden_cache, load_hidden

    convs = load_conversations("builtin", split="train", limit=5)
    ds = build_selfdistill(tiny, convs, tmp_path / "sd", max_new_tokens=4, batch_size=5)
    ds.save_to_disk(str(tmp_path / "ds"))
    ds = __import__("datasets").load_from_disk(str(tmp_path / "ds"))
    child = subprocess.run([sys.executable, "-c", KILL_HIDDEN_AFTER_ONE_SHARD.format(
        data=str(tmp_path / "ds"), cache=str(tmp_path / "killed"))],
        capture_output=True, text=True, timeout=300)
    assert child.returncode == -9, child.stderr[-2000:]
    assert "GiB" in child.stdout  # the size is printed before any work
    (entry,) = list((tmp_path / "killed" / "hidden").iterdir())
    first = entry / "00000" / "0.safetensors"
    before = first.stat().st_mtime_ns
    resumed = build_hidden_cache(tiny, ds, [0, -1], tmp_path / "killed", shard_rows=2)
    assert "resuming, 1 of 3 shards" in capsys.readouterr().out
    assert first.stat().st_mtime_ns == before  # the finished shard was kept, not recomputed
    whole = build_hidden_cache(tiny, ds, [0, -1], tmp_path / "whole", shard_rows=2)
    for row in range(len(ds)):
        a, b = load_hidden(resumed, row), load_hidden(whole, row)
        assert a.shape == (2, len(ds[row]["input_ids"]), tiny.hidden_size) and torch.equal(a, b)


def test_argmax_cache_is_the_heads_argmax_and_resumes(tiny, tmp_path, capsys, monkeypatch):
    """M_q's greedy token per position, cached beside the hidden states (EAGLE-3's targets read it): the head's
    argmax over each row's cached final states, written per group of rows; a missing group (a killed build) is
    computed again and the finished ones are kept."""
    import data.hidden_cache as hc

    convs = load_conversations("builtin", split="train", limit=5)
    ds = build_selfdistill(tiny, convs, tmp_path / "sd", max_new_tokens=4, batch_size=5)
    path = hc.build_hidden_cache(tiny, ds, [0, -1], tmp_path / "cache", shard_rows=2)
    monkeypatch.setattr(hc, "ARGMAX_ROWS", 2)
    hc.build_argmax_cache(tiny, path, len(ds), final_index=1, rows=[0, 1])  # a subset: only the group that holds it
    assert [g.name for g in (path / "argmax").iterdir()] == ["00000"]
    hc.build_argmax_cache(tiny, path, len(ds), final_index=1)
    groups = sorted((path / "argmax").iterdir())
    assert [g.name for g in groups] == ["00000", "00001", "00002"]
    kept = (groups[0] / "argmax.safetensors").stat().st_mtime_ns
    __import__("shutil").rmtree(groups[1])
    hc._argmax_group.cache_clear()
    capsys.readouterr()
    hc.build_argmax_cache(tiny, path, len(ds), final_index=1)
    assert "2 of 3 groups already written" in capsys.readouterr().out
    assert (groups[0] / "argmax.safetensors").stat().st_mtime_ns == kept
    for row in range(len(ds)):
        final = hc.load_hidden(path, row)[1].float()
        assert torch.equal(hc.load_argmax(path, row).long(), tiny.lm_head(final).argmax(-1)), row


def test_registry_licences_and_chat_prompts(tmp_path):
    """The evals wheel's LICENSE.md marks non-commercial data folders; those are left out by default."""
    import zipfile

    from scripts.tools.registry_prompts import evals_prompts

    licence = ("MIT License\n\n### Dataset Licenses\n\n#### Free\n- **Location**: evals/registry/data/free\n"
               "    - **License**: MIT License\n\n#### Tom\n- **Location**: evals/registry/data/tom\n"
               "    - **License**: Creative Commons Attribution-NonCommercial 4.0 International\n"
               "    - **License**: Creative Commons Attribution 4.0\n")
    wheel = tmp_path / "evals.whl"
    chat = {"input": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]}
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("evals-3.0.1.post1.dist-info/LICENSE.md", licence)
        z.writestr("evals/registry/data/free/samples.jsonl", "\n".join(json.dumps(chat) for _ in range(5)))
        z.writestr("evals/registry/data/tom/samples.jsonl", json.dumps({"input": "Where is the ball?"}))
        z.writestr("evals/registry/data/plain/samples.jsonl", json.dumps({"input": "Say hi.", "ideal": "hi"}))
    rows, info = evals_prompts(wheel, per_set=3, include_nc=False)
    assert info["noncommercial_folders"] == ["tom"]
    assert [r["category"] for r in rows] == ["evals/free"] * 3 + ["evals/plain"]
    assert rows[0]["messages"] == chat["input"] and rows[0]["licence"] == "MIT License"
    rows, _ = evals_prompts(wheel, per_set=3, include_nc=True)
    assert "evals/tom" in {r["category"] for r in rows}


def test_training_sources_are_concatenated_and_decontaminated(tiny, tmp_path, capsys):
    from data.datamodule import DistillDataModule

    eval_prompt = load_conversations("builtin", split="eval")[0].user_turns[0]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps({"prompt": "Describe a quiet morning in a small fishing village."}) + "\n"
                 + json.dumps({"prompt": eval_prompt + " "}) + "\n")  # an eval prompt, one space apart
    b.write_text(json.dumps({"prompt": "List three uses of baking soda around the house."}) + "\n")
    mt = tmp_path / "question.jsonl"
    mt.write_text(json.dumps({"question_id": 1, "turns": ["List three uses of baking soda around the house!"]}) + "\n")
    dm = DistillDataModule(tiny, str(tmp_path), source=[str(a), str(b)], eval_prompts=[str(mt)])
    convs = dm.conversations()
    assert [c.user_turns[0] for c in convs] == ["Describe a quiet morning in a small fishing village."]
    out = capsys.readouterr().out  # counted per source
    assert "a.jsonl against the eval prompts: 2 in, 1 kept (matches an eval prompt: 1)" in out
    assert "b.jsonl against the eval prompts: 1 in, 0 kept (matches an eval prompt: 1)" in out


def test_decode_attention_equals_sdpa_for_one_token_queries():
    """The data builder's one-token attention (grouped matmuls) against PyTorch SDPA with the KV heads repeated:
    GQA head grouping, a left-padding mask (bool and additive) and no mask; longer queries go to SDPA itself."""
    from data.generate import decode_attention

    class Attn(torch.nn.Module):
        num_key_value_groups, is_causal = 3, True

    g = torch.Generator().manual_seed(0)
    bsz, heads, kv_heads, dim, keys = 4, 6, 2, 16, 11
    q = torch.randn(bsz, heads, 1, dim, generator=g)
    k, v = torch.randn(bsz, kv_heads, keys, dim, generator=g), torch.randn(bsz, kv_heads, keys, dim, generator=g)
    pad = torch.ones(bsz, 1, 1, keys, dtype=torch.bool)
    pad[1, ..., :3] = False  # row 1 is left-padded by 3, row 3 by 7
    pad[3, ..., :7] = False
    rep = lambda t: t.repeat_interleave(3, dim=1)  # noqa: E731 - head h reads KV head h // 3
    for mask in (None, pad, torch.zeros(pad.shape).masked_fill(~pad, float("-inf"))):
        ref = torch.nn.functional.scaled_dot_product_attention(q, rep(k), rep(v), attn_mask=mask, scale=0.3)
        out, _ = decode_attention(Attn(), q, k, v, mask, scaling=0.3)
        assert out.shape == (bsz, 1, heads, dim)
        torch.testing.assert_close(out.transpose(1, 2), ref, atol=1e-5, rtol=1e-5)
    long_q = torch.randn(bsz, heads, 5, dim, generator=g)
    causal = torch.ones(5, keys, dtype=torch.bool).tril(keys - 5)[None, None].expand(bsz, 1, 5, keys)
    out, _ = decode_attention(Attn(), long_q, k, v, causal, scaling=0.3)
    ref = torch.nn.functional.scaled_dot_product_attention(long_q, rep(k), rep(v), attn_mask=causal, scale=0.3)
    torch.testing.assert_close(out.transpose(1, 2), ref, atol=1e-5, rtol=1e-5)


def test_decode_attention_inside_the_model_keeps_the_logits(one_thread):
    """A left-padded batch's decode step on the varied verifier: the logits under `decode_attention_for` equal the
    model's own SDPA logits (HF's mask format reaches the function as it expects); its own attention after."""
    from transformers import DynamicCache

    from data.generate import decode_attention_for

    v = varied_llama()
    lengths = [9, 4, 13]
    ids = torch.zeros(3, 13, dtype=torch.long)
    mask = torch.zeros(3, 13, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, 13 - n :] = torch.arange(5, 5 + n) * (r + 3) % 200
        mask[r, 13 - n :] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)

    def step() -> torch.Tensor:
        cache = DynamicCache(config=v.model.config)
        out = v.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        full = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
        pos = torch.tensor(lengths)[:, None]
        return v.model(input_ids=nxt, attention_mask=full, position_ids=pos, cache=out.past_key_values).logits

    with torch.no_grad():
        ref = step()
        with decode_attention_for(v.model):
            assert v.model.config._attn_implementation == "specdraft_decode"
            got = step()
    assert v.model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_prompts_longer_than_max_length_are_left_out_not_prefilled(tiny, tmp_path, capsys):
    """A prompt with no room for an answer in max_length is neither answered nor kept (a 47k-token registry prompt
    once took a batched prefill past the machine's memory); the others are built as usual."""
    from dataclasses import replace

    convs = load_conversations("builtin", split="train", limit=4)
    convs[2] = replace(convs[2], messages=[{"role": "user", "content": "word " * 400}])
    ds = build_selfdistill(tiny, convs, tmp_path, max_new_tokens=4, batch_size=2, shard_size=2, max_length=96)
    assert "1 of 4 prompts have max_length=96 tokens or more" in capsys.readouterr().out
    assert ds["id"] == [convs[i].id for i in (0, 1, 3)]
    assert all(sum(m) > 0 for m in ds["loss_mask"])


def test_refill_through_prepacked_linears_gives_the_same_answers(one_thread):
    """bf16 on a CPU: `generate_refill` runs every linear through a prepacked copy (models.packed) and answers with
    the tokens F.linear gives; inside `packed_linears` the logits are bitwise F.linear's, and the modules are their
    own again after it."""
    from models.packed import can_pack, packed_linears

    v = varied_llama()
    v.model.to(torch.bfloat16)
    linears = [m for m in v.model.modules() if isinstance(m, torch.nn.Linear)]
    if not can_pack(linears[0].weight):
        pytest.skip("no oneDNN prepacked linear on this build")
    convs = load_conversations("builtin", split="train", limit=8)
    prompts = [prompt_ids(v.tokenizer, c.messages) for c in convs]
    ids = torch.tensor([prompts[0][:12], prompts[1][:12]])
    with torch.no_grad():
        ref = v.model(input_ids=ids).logits
        with packed_linears(v.model) as patched:
            assert patched == len(linears) and all("forward" in m.__dict__ for m in linears)
            got = v.model(input_ids=ids).logits
        assert not any("forward" in m.__dict__ for m in linears)
    assert torch.equal(got, ref)
    packed = generate_refill(v, prompts, 12, batch_size=3, refill_at=1)
    plain = generate_refill(v, prompts, 12, batch_size=3, refill_at=1, pack=False)
    assert packed == plain and len({tuple(a) for a in packed}) > 1


def test_a_cache_of_more_layers_serves_fewer(tiny, tmp_path, capsys):
    """One hidden-state build serves every drafter: a finished cache of the same verifier and data holding more
    layers (EAGLE-3's) is read for fewer (EAGLE-1's and Medusa's [-1]), layer by layer in the asked order, with the
    bits an exact cache of those layers has; other data, or a cache that lacks a layer, is not taken."""
    import datasets as hf_datasets

    from data.datamodule import collate
    from data.hidden_cache import build_hidden_cache, cache_layers, load_hidden

    convs = load_conversations("builtin", split="train", limit=5)
    ds = build_selfdistill(tiny, convs, tmp_path / "sd", max_new_tokens=4, batch_size=5)
    wide = build_hidden_cache(tiny, ds, [0, 1, -1], tmp_path / "c", shard_rows=2)
    capsys.readouterr()
    for layers in ([-1], [1, 0], [-1, 0]):
        assert build_hidden_cache(tiny, ds, layers, tmp_path / "c", shard_rows=2) == wide
        assert "nothing to build" in capsys.readouterr().out
        exact = build_hidden_cache(tiny, ds, layers, tmp_path / f"exact{len(layers)}{layers[0]}", shard_rows=2)
        assert cache_layers(exact) == layers
        for row in range(len(ds)):
            assert torch.equal(load_hidden(wide, row, layers), load_hidden(exact, row))
        rows = [{"input_ids": ds[r]["input_ids"], "loss_mask": ds[r]["loss_mask"], "row": r} for r in range(3)]
        assert torch.equal(collate(rows, 0, wide, hidden_layers=layers)["hidden"],
                           collate(rows, 0, exact)["hidden"])
    assert len(list((tmp_path / "c" / "hidden").iterdir())) == 1  # nothing else was built there
    other = hf_datasets.Dataset.from_dict(ds[:3])  # other data: its own cache
    assert build_hidden_cache(tiny, other, [-1], tmp_path / "c", shard_rows=2) != wide
    assert build_hidden_cache(tiny, ds, [0, 2], tmp_path / "c", shard_rows=2) != wide  # layer 2 is not in it


def _small_set(tiny, tmp_path, n=7):
    convs = load_conversations("builtin", split="train", limit=n)
    return build_selfdistill(tiny, convs, tmp_path / "sd", max_new_tokens=4, batch_size=n)


def test_hidden_cache_shards_split_over_processes_and_a_missing_share_is_resumed(tiny, tmp_path, capsys):
    """Rank 1 of 2 writes shards 1 and 3 only and, without rank 0's shards, stops with a message; a later run with
    one process computes 0 and 2 only (rank 1's are kept as they are), and the result equals a one-process build."""
    import json

    from data.hidden_cache import build_hidden_cache, load_hidden
    from runtime.errors import UserError

    ds = _small_set(tiny, tmp_path)
    with pytest.raises(UserError, match=r"lacks 2 of 4 shards \(e\.g\. \[0, 2\]\).*Run again"):
        build_hidden_cache(tiny, ds, [0, -1], tmp_path / "c", shard_rows=2, rank=1, world=2)
    (path,) = list((tmp_path / "c" / "hidden").iterdir())
    assert sorted(p.name for p in path.iterdir() if p.is_dir()) == ["00001", "00003"]
    kept = {p: p.stat().st_mtime_ns for p in path.glob("0000[13]/*.safetensors")}
    assert json.loads((path / "00001" / "shard.json").read_text())["rank"] == 1
    capsys.readouterr()
    assert build_hidden_cache(tiny, ds, [0, -1], tmp_path / "c", shard_rows=2) == path
    assert "resuming, 2 of 4 shards" in capsys.readouterr().out
    assert all(p.stat().st_mtime_ns == t for p, t in kept.items())
    assert json.loads((path / "00002" / "shard.json").read_text())["rank"] == 0
    whole = build_hidden_cache(tiny, ds, [0, -1], tmp_path / "whole", shard_rows=2)
    for row in range(len(ds)):
        assert torch.equal(load_hidden(path, row), load_hidden(whole, row))


def test_a_hidden_cache_shard_of_another_layer_set_or_verifier_is_refused(tiny, tmp_path):
    import json
    import shutil

    from data.hidden_cache import build_hidden_cache
    from runtime.errors import UserError

    ds = _small_set(tiny, tmp_path)
    with pytest.raises(UserError):
        build_hidden_cache(tiny, ds, [0, -1], tmp_path / "c", shard_rows=2, rank=1, world=2)
    (path,) = list((tmp_path / "c" / "hidden").iterdir())
    other = build_hidden_cache(tiny, ds, [1, -1], tmp_path / "o", shard_rows=2)
    shutil.rmtree(path / "00001")
    shutil.copytree(other / "00001", path / "00001")  # a shard copied from a cache of other layers
    with pytest.raises(UserError, match=r"00001 was written with layers=\[1, -1\].*for layers=\[0, -1\].*Delete"):
        build_hidden_cache(tiny, ds, [0, -1], tmp_path / "c", shard_rows=2)
    info = json.loads((other / "00001" / "shard.json").read_text())
    (path / "00001" / "shard.json").write_text(json.dumps(info | {"layers": [0, -1], "verifier": "another"}))
    with pytest.raises(UserError, match=r"verifier='another'.*copied from another cache"):
        build_hidden_cache(tiny, ds, [0, -1], tmp_path / "c", shard_rows=2)


def test_a_hidden_cache_that_cannot_fit_the_free_disk_is_refused_before_any_work(tiny, tmp_path, monkeypatch):
    import shutil

    import data.hidden_cache as hc
    from runtime.errors import UserError

    ds = _small_set(tiny, tmp_path)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(hc.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    with pytest.raises(UserError, match=r"needs 0\.\d+ GiB more in .* has 0\.00 GiB free.*cache_dir="):
        hc.build_hidden_cache(tiny, ds, [0, -1], tmp_path / "c", shard_rows=2)
    assert not any((tmp_path / "c").glob("hidden/*/0000*"))


@pytest.mark.parametrize("damage", ["truncated", "folder deleted"])
def test_a_damaged_finished_hidden_cache_is_refused_naming_the_shard_and_the_rebuild(tiny, tmp_path, damage):
    """A finished cache (done.json) with a truncated row file or a deleted shard folder is refused before training
    reads it (sizes and headers only), naming the shard and the command that rebuilds it; that command computes the
    damaged shard again and keeps the good ones, and the rebuilt cache equals a fresh one."""
    import os
    import shutil

    from data.hidden_cache import build_hidden_cache, load_hidden
    from runtime.errors import UserError

    ds = _small_set(tiny, tmp_path, n=5)
    path = build_hidden_cache(tiny, ds, [0, -1], tmp_path / "c", shard_rows=2)
    shard = path / "00001"
    if damage == "truncated":
        file = shard / "3.safetensors"
        os.truncate(file, file.stat().st_size // 2)
        said = r"shard 00001 3\.safetensors has \d+ bytes, \d+ when it was written"
    else:
        shutil.rmtree(shard)
        said = r"shard 00001 is missing"
    with pytest.raises(UserError, match=said) as err:
        build_hidden_cache(tiny, ds, [0, -1], tmp_path / "c", shard_rows=2)
    message = str(err.value)
    assert "damaged: shard 00001" in message and "keeps the other 2" in message
    command = message.split("Rebuild just it: ")[1].split(", then")[0]
    subprocess.run(command, shell=True, check=True)  # the command the message gives
    kept = (path / "00000" / "0.safetensors").stat().st_mtime_ns
    assert build_hidden_cache(tiny, ds, [0, -1], tmp_path / "c", shard_rows=2) == path
    assert (path / "00000" / "0.safetensors").stat().st_mtime_ns == kept and (path / "done.json").is_file()
    fresh = build_hidden_cache(tiny, ds, [0, -1], tmp_path / "fresh", shard_rows=2)
    for row in range(len(ds)):
        assert torch.equal(load_hidden(path, row), load_hidden(fresh, row))


def test_a_damaged_shard_found_while_building_is_computed_again(tiny, tmp_path, capsys):
    """With no done.json (a resumed build), a shard whose file was cut is treated as missing: computed again."""
    import os

    from data.hidden_cache import build_hidden_cache, load_hidden

    ds = _small_set(tiny, tmp_path, n=5)
    path = build_hidden_cache(tiny, ds, [0, -1], tmp_path / "c", shard_rows=2)
    (path / "done.json").unlink()
    file = path / "00002" / "4.safetensors"
    os.truncate(file, 20)
    capsys.readouterr()
    build_hidden_cache(tiny, ds, [0, -1], tmp_path / "c", shard_rows=2)
    out = capsys.readouterr().out
    assert "shard 00002 4.safetensors has 20 bytes" in out and "computing it again" in out
    assert load_hidden(path, 4).shape == (2, len(ds[4]["input_ids"]), tiny.hidden_size)
