"""EAGLE-1 / EAGLE-3 training: input/target shifts, the training-time-test mask, the draft vocabulary, export
layouts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import compose_train
from models.eagle import build_eagle, step_inputs, unroll_mask
from models.exports.io import load_export, read_config, save_export
from runtime.errors import UserError
from train.verifier_fed import draft_vocab_from_counts, validation_summary, validation_tallies

TINY = ["verifier=tiny", "data.limit=12", "data.max_new_tokens=12", "data.gen_batch_size=12", "data.batch_size=4",
        "data.val_fraction=0.25", "model.draft_vocab_size=256"]


def test_step_inputs_and_targets_are_shifted():
    ids = torch.arange(100, 107)[None]  # x_0..x_6
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1]])  # assistant tokens from x_2
    tok0, valid0 = step_inputs(ids, mask, 0)
    assert tok0.tolist() == [[101, 102, 103, 104, 105, 106]]  # step 0 at t reads x_{t+1}
    assert valid0.tolist() == [[True, True, True, True, True, False]]  # and predicts x_{t+2}
    tok2, valid2 = step_inputs(ids, mask, 2)
    assert tok2.tolist() == [[103, 104, 105, 106, 0, 0]]  # step 2 at t reads x_{t+3}
    assert valid2.tolist() == [[True, True, True, False, False, False]]  # and predicts x_{t+4}


def test_training_time_test_mask():
    valid = torch.tensor([[True, True, True]])
    m0 = unroll_mask(valid, 0)[0, 0].int().tolist()
    assert m0 == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    m2 = unroll_mask(valid, 2)[0, 0].int()
    # Step 2 at t sees step-0 keys s <= t, then its own position in steps 1 and 2.
    assert m2.tolist() == [[1, 0, 0, 1, 0, 0, 1, 0, 0],
                           [1, 1, 0, 0, 1, 0, 0, 1, 0],
                           [1, 1, 1, 0, 0, 1, 0, 0, 1]]
    padded = unroll_mask(torch.tensor([[True, True, False]]), 1)[0, 0].int()
    assert padded[2, :3].tolist() == [1, 1, 0]  # padding keys are never attended


def test_validation_tallies_condition_each_depth_on_the_chain_reaching_it():
    # 3 unrolled steps over 4 positions; rank 0 = the draft's top-1, 100 = no target.
    valid = torch.tensor([[[1, 1, 1, 1]], [[1, 1, 1, 0]], [[1, 1, 0, 0]]], dtype=torch.bool)
    rank = torch.tensor([[[0, 0, 2, 0]], [[0, 1, 0, 100]], [[3, 0, 100, 100]]])
    correct = (rank == 0) & valid
    out = validation_summary(validation_tallies(correct, valid, rank, topk=3))
    assert out["val_step_top1"] == pytest.approx([3 / 4, 2 / 3, 1 / 2])  # every valid target of the step
    assert out["estimated_tau"] == pytest.approx(1 + (2 + 1 + 0 + 1) / 4)  # accepted chains 2, 1, 0, 1
    # The chain reaches step 1 at positions 0 and 1 (step 0 right there), step 2 at position 0 only.
    table = torch.tensor(out["eagle_topk_accuracy"])
    assert torch.allclose(table, torch.tensor([[3 / 4, 3 / 4, 1.0], [1 / 2, 1.0, 1.0], [0.0, 0.0, 0.0]]))


def test_draft_vocab_round_trip(tiny):
    net = build_eagle("eagle3", tiny, draft_vocab_size=5, aux_layer_ids=[0, 1])
    counts = torch.zeros(tiny.vocab_size)
    counts[[7, 3, 900, 42, 11, 5]] = torch.tensor([50.0, 40, 30, 20, 10, 1])
    top, coverage = draft_vocab_from_counts(counts, 5)
    assert coverage == pytest.approx(150 / 151)
    net.set_draft_vocab(top)
    assert net.draft_to_target(torch.arange(5)).tolist() == [3, 7, 11, 42, 900]
    assert net.t2d.sum() == 5 and net.t2d[[3, 7, 11, 42, 900]].all()
    assert (net.d2t == torch.tensor([3, 7, 11, 42, 900]) - torch.arange(5)).all()


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_export_round_trip_and_layout(tiny, tmp_path, kind):
    net = build_eagle(kind, tiny, draft_vocab_size=64, aux_layer_ids=[0, 1] if kind == "eagle3" else None)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(std=0.02)
    if kind == "eagle3":
        net.set_draft_vocab(torch.randperm(tiny.vocab_size)[:64])
    save_export(net, tiny, tmp_path / kind)
    cfg = json.loads((tmp_path / kind / "config.json").read_text())
    tensors = load_file(str(tmp_path / kind / "model.safetensors"))
    h, hd, kvh, inter = 64, 16, 2, 256
    if kind == "eagle":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle", "EagleLlamaForCausalLM"]
        assert cfg["num_hidden_layers"] == 1 and "bias" not in cfg
        assert tensors["fc.weight"].shape == (h, 2 * h)
        assert tensors["fc.bias"].shape == (h,) and not tensors["fc.bias"].any()  # SGLang / EAGLE repo build one
        assert tensors["layers.0.self_attn.q_proj.weight"].shape == (4 * hd, h)
        assert "layers.0.input_layernorm.weight" not in tensors  # EAGLE-1 layer 0 has no input norm
        prefix = "layers.0."
    else:
        assert cfg["speculators_model_type"] == "eagle3" and cfg["draft_vocab_size"] == 64  # vLLM's own format
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [0, 1]  # vLLM: input of layer k
        flat = read_config(tmp_path / kind)  # the flat layout to-reference writes for SGLang
        assert flat["architectures"] == ["LlamaForCausalLMEagle3"]
        assert flat["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 0]  # SGLang: output of layer k
        assert tensors["fc.weight"].shape == (h, 2 * h)
        assert tensors["midlayer.self_attn.q_proj.weight"].shape == (4 * hd, 2 * h)  # cat(embeds, hidden) in
        assert tensors["norm.weight"].shape == (h,) and tensors["lm_head.weight"].shape == (64, h)
        assert tensors["d2t"].shape == (64,) and tensors["t2d"].shape == (tiny.vocab_size,)
        assert tensors["t2d"].dtype == torch.bool
        prefix = "midlayer."
    k_proj = tensors[prefix + "self_attn.k_proj.weight"]
    assert k_proj.shape == (kvh * hd, k_proj.shape[1])
    assert tensors[prefix + "mlp.gate_proj.weight"].shape == (inter, h)
    assert cfg["verifier_fingerprint"] == tiny.fingerprint and cfg["torch_dtype"] == "bfloat16"
    loaded = load_export(tmp_path / kind, tiny, kind)

    loaded = loaded.net
    for name, tensor in net.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_bad_eagle_exports(tiny, tmp_path):
    save_export(build_eagle("eagle", tiny), tiny, tmp_path / "e1")
    with pytest.raises(UserError, match="EAGLE-1 export .* given as EAGLE-3"):
        load_export(tmp_path / "e1", tiny, "eagle3")
    save_export(build_eagle("eagle3", tiny, draft_vocab_size=32, aux_layer_ids=[0, 1]), tiny, tmp_path / "e3")
    with pytest.raises(UserError, match="EAGLE-3 export .* given as EAGLE-1"):
        load_export(tmp_path / "e3", tiny, "eagle")
    weights = tmp_path / "e3" / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["t2d"] = tensors["t2d"][:1000]  # a draft vocabulary made for a smaller vocabulary
    save_file(tensors, str(weights))
    with pytest.raises(UserError, match="does not fit"):
        load_export(tmp_path / "e3", tiny)
    with pytest.raises(UserError, match="out of range"):
        build_eagle("eagle3", tiny, aux_layer_ids=[0, 1, 9])
    with pytest.raises(UserError, match="out of range"):
        build_eagle("eagle3", tiny, aux_layer_ids=[0, 2])  # hidden_states[L]: no engine feeds HF's normed output
    with pytest.raises(UserError, match="not strictly increasing"):
        build_eagle("eagle3", tiny, aux_layer_ids=[1, 0])
    with pytest.raises(UserError, match="only 2 layers"):
        build_eagle("eagle3", tiny)  # the default [2, L//2, L-3] would be [2, 1, -1]


@pytest.mark.parametrize("model", ["eagle", "eagle3"])
def test_fast_dev_run(train_script, tmp_path, tiny, model):
    cfg = compose_train([*TINY, f"model={model}", "logger=csv", "+trainer.fast_dev_run=true",
                         *(["model.aux_layer_ids=[0,1]"] if model == "eagle3" else [])], tmp_path)
    export = train_script.run(cfg)
    loaded = load_export(export, tiny, model)

    net, config = loaded.net, loaded.config
    assert net.kind == model and config["trained_steps"] == 1
    # the training data it saw, for learning curves: assistant tokens of the training split
    from hydra.utils import instantiate

    dm = instantiate(cfg.data, verifier=tiny)
    dm.setup("fit")
    assert config["train_tokens"] == sum(sum(m) for m in dm.train_set["loss_mask"]) > 0
    assert config["train_sequences"] == len(dm.train_set)


def test_eagle3_learns_and_logs_step_accuracies(train_script, tmp_path):
    # A tiny verifier with peaked next-token distributions, so there is something to learn beyond q's entropy.
    cfg = compose_train([*TINY, "+verifier.initializer_range=0.3", "model=eagle3", "model.aux_layer_ids=[0,1]",
                         "logger=csv", "trainer.max_epochs=8", "trainer.log_every_n_steps=1",
                         "model.optimizer.lr=1e-2", "model.ttt_steps=3", "model.val_steps=4"], tmp_path)
    export = train_script.run(cfg)
    config = json.loads((export / "config.json").read_text())
    assert len(config["val_step_top1"]) == 4 and 1.0 <= config["estimated_tau"] <= 5.0
    table = config["eagle_topk_accuracy"]  # per depth, top-1..top-10 where the chain reaches it
    assert len(table) == 4 and all(len(row) == 10 for row in table)
    assert all(0 <= a <= b <= 1 for row in table for a, b in zip(row, row[1:]))
    assert table[0][0] == pytest.approx(config["val_step_top1"][0], abs=1e-6)  # depth 1: every valid position
    assert 0 < config["draft_vocab_coverage"] <= 1
    import csv

    rows = list(csv.DictReader(open(next((tmp_path / "csv").glob("version_*/metrics.csv")))))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert sum(losses[-3:]) < 0.7 * sum(losses[:3]), losses
    assert any(r.get("val/step3_top1") for r in rows) and any(r.get("val/estimated_tau") for r in rows)
    epochs = [float(r["train/epoch_depth1_top1"]) for r in rows if r.get("train/epoch_depth1_top1")]
    assert len(epochs) == 8 and config["train_depth1_top1"] == pytest.approx(epochs[-1]) and epochs[-1] > epochs[0]


def test_offline_hidden_state_cache_matches_online(tiny, tmp_path, capsys):
    from hydra.utils import instantiate

    cfg = compose_train([*TINY, "model=eagle3", "model.aux_layer_ids=[0,1]", "data.cache_hidden_states=true",
                         f"cache_dir={tmp_path}"], tmp_path)
    module = instantiate(cfg.model, verifier=tiny)
    dm = instantiate(cfg.data, verifier=tiny)
    dm.hidden_layers = module.hidden_layers
    dm.verifier_argmax = module.uses_verifier_argmax  # as train.py sets them
    dm.prepare_data()
    dm.setup("fit")
    assert "GiB in" in capsys.readouterr().out  # the disk size is announced before caching
    assert len(list(dm.hidden_path.glob("0*/*.safetensors"))) == 12  # one file per sequence, in shard folders
    assert len(list(dm.hidden_path.glob("argmax/*/argmax.safetensors"))) == 1  # M_q's argmax, beside them
    batch = next(iter(dm.train_dataloader()))
    assert batch["hidden"].shape[:3] == (4, len(module.hidden_layers), batch["input_ids"].shape[1])
    # The cached argmax is the head's over the cached final states, position by position; -1 on padding.
    real = batch["attention_mask"].bool()
    final = batch["hidden"][:, module.hidden_layers.index(-1)].float()
    expect = torch.stack([tiny.lm_head(f).argmax(-1) for f in final])
    assert torch.equal(batch["verifier_argmax"][real], expect[real])
    assert bool((batch["verifier_argmax"][~real] == -1).all())
    torch.manual_seed(0)
    cached = module.model_step(batch, 3, train=False)["losses"]
    online = {k: v for k, v in batch.items() if k not in ("hidden", "verifier_argmax")}
    fresh = module.model_step(online, 3, train=False)["losses"]
    for a, b in zip(cached, fresh):  # the cache stores bf16; the online path runs fp32 and projects the full head
        assert torch.allclose(a, b, rtol=2e-2), (a, b)


@pytest.mark.parametrize("cached_argmax", [False, True], ids=["full-head", "cached-argmax"])
def test_eagle3_targets_once_per_batch_match_each_step(tiny, cached_argmax):
    """EAGLE-3 computes q once per batch and every unrolled step reads it shifted: each (step, position) the loss
    uses must get exactly M_q's distribution at t+j+1, restricted to the draft vocabulary. With M_q's argmax from
    the offline cache, q comes from the draft vocabulary's rows of the head alone, and must be the same."""
    from train.eagle import EagleModule

    torch.manual_seed(0)
    module = EagleModule(tiny, optimizer=torch.optim.AdamW, kind="eagle3", ttt_steps=3, draft_vocab_size=64,
                         aux_layer_ids=[0, 1])
    module.net.set_draft_vocab(torch.randperm(tiny.lm_head.weight.shape[0])[:64])
    ids = torch.randint(5, 200, (2, 12))
    loss_mask = torch.tensor([[0] * 4 + [1] * 8, [0] * 6 + [1] * 5 + [0]]).bool()
    with torch.no_grad():
        final = tiny.model.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    greedy = tiny.lm_head(final).argmax(-1) if cached_argmax else None  # what the argmax cache holds
    targets = module.draft_vocab_targets(final, loss_mask, greedy)
    checked = 0
    for j in range(3):
        _, valid = step_inputs(ids, loss_mask, j)
        for b, t in valid.nonzero().tolist():
            row = int(targets["row"][b, t + j + 1])
            assert row >= 0
            logits = tiny.lm_head(final[b, t + j + 1]).float()
            assert int(targets["arg"][row]) == int(logits.argmax())
            assert torch.allclose(targets["q"][row], logits[module.net.t2d].softmax(-1), atol=1e-6)
            checked += 1
    assert checked == 3 * (8 + 5)  # every step: 8 targets in row 0, 5 in row 1


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_validation_ranks_agree_with_top1_hits(tiny, kind):
    """The ranks and confidences validation returns (read by scripts/tools/drafter_accuracy.py): rank 0 exactly where
    the draft's top-1 is M_q's argmax, the vocabulary size where there is no target, a probability in (0, 1]."""
    from train.eagle import EagleModule

    torch.manual_seed(0)
    module = EagleModule(tiny, optimizer=torch.optim.AdamW, kind=kind,
                         draft_vocab_size=64 if kind == "eagle3" else None,
                         aux_layer_ids=[0, 1] if kind == "eagle3" else None)
    if kind == "eagle3":
        module.net.set_draft_vocab(torch.arange(64))  # the ids the batch uses, so some targets are in it
    ids = torch.randint(0, 64, (2, 10))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "loss_mask": torch.tensor([[0] * 3 + [1] * 7, [0] * 5 + [1] * 5])}
    with torch.no_grad():
        res = module.model_step(batch, 3, train=False)
    rank, valid, correct, conf = res["rank"], res["valid"], res["correct"], res["confidence"]
    assert torch.equal((rank == 0) & valid, correct & valid)
    vocab = tiny.lm_head.weight.shape[0]
    assert (rank[~valid] == vocab).all()
    if kind == "eagle":  # every target has a rank in the full vocabulary
        assert (rank[valid] < vocab).all()
    else:  # a target outside the 64-token draft vocabulary gets the vocabulary size, the others a rank below 64
        assert ((rank[valid] < 64) | (rank[valid] == vocab)).all()
    assert ((conf[valid] > 0) & (conf[valid] <= 1)).all()
    assert "confidence" not in module.model_step(batch, 1, train=True)  # training skips the extra softmax


@pytest.mark.parametrize("flash", [False, True], ids=["factored", "flash"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_factored_unroll_attention_equals_the_dense_mask(flash, is_causal, monkeypatch):
    """Training-time-test attention through UnrollMask (a step-0 block plus each query's own keys of later steps)
    gives the outputs and gradients of SDPA under the dense `unroll_mask`, with GQA and a right-padded row: through
    autograd (`factored`, the path off the CPU) and through the fused flash kernel with its hand-written backward
    (`flash`), under the mask or causal (`is_causal`, right padding), at every valid query (a padded query's
    output is unspecified with `is_causal`, and the loss weighs it 0)."""
    import models.eagle_layers as layers
    from models.eagle_layers import DraftAttention, UnrollMask

    if not flash:  # what runs on a GPU
        monkeypatch.setattr(layers, "unrolled_attention", lambda *a: layers.factored_attention(*a))
    torch.manual_seed(0)
    attn = DraftAttention(in_dim=12, hidden_size=12, num_heads=4, num_kv_heads=2, head_dim=6, rope_theta=10000.0)
    bsz, n = 2, 7
    valid = torch.ones(bsz, n, dtype=torch.bool)
    valid[1, 5:] = False
    positions = torch.arange(n)[None].expand(bsz, n)
    causal = unroll_mask(valid, 0)
    x0 = torch.randn(bsz, n, 12, requires_grad=True)
    _, k0, v0 = attn(x0, positions, UnrollMask(causal, 0, is_causal))
    past_k, past_v = [k0], [v0]
    for step in range(4):
        x = torch.randn(bsz, n, 12, requires_grad=True)
        inputs = [x, x0] if step else [x]
        weight = torch.randn(bsz, n, 12) * valid[..., None]  # a weighted loss over the valid queries
        dense_k = torch.cat(past_k[:step], dim=2) if step else None
        dense_v = torch.cat(past_v[:step], dim=2) if step else None
        dense, _, _ = attn(x, positions + step, unroll_mask(valid, step), dense_k, dense_v)
        gd = torch.autograd.grad((dense * weight).sum(), inputs, retain_graph=True)
        mask = UnrollMask(causal, step, is_causal and step == 0)
        factored, k, v = attn(x, positions + step, mask, past_k[:step] or None, past_v[:step] or None)
        gf = torch.autograd.grad((factored * weight).sum(), inputs, retain_graph=True)
        torch.testing.assert_close(factored * valid[..., None], dense * valid[..., None], atol=1e-5, rtol=1e-5)
        for a, b in zip(gf, gd):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        if step == 0:
            past_k, past_v = [k0], [v0]
        else:
            past_k.append(k)
            past_v.append(v)


@pytest.mark.parametrize("v31", [False, True], ids=["eagle3", "eagle3.1"])
@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
def test_unroll_equals_steps_under_the_dense_mask(tiny, left, v31):
    """`unroll` (step 0 over every position, later steps over the window of positions their targets need, factored
    masks, the fused causal kernel where rows are right-padded) gives, at every target of every step, the outputs
    and the gradients the drafter's steps give over every position under the dense `unroll_mask`. Prompts and
    padding of different lengths per row, so the window starts at a different position in each. With a left-padded
    row the causal kernel would let its valid queries see the padding, so unroll must notice and not take it."""
    from models.eagle import unroll

    torch.manual_seed(0)
    net = build_eagle("eagle3", tiny, draft_vocab_size=64, aux_layer_ids=[0, 1], fc_norm=v31, norm_output=v31)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.3)
    bsz, n, steps = 3, 12, 4
    ids = torch.randint(0, 64, (bsz, n + 1))
    attn = torch.ones(bsz, n + 1, dtype=torch.long)
    loss_mask = torch.zeros(bsz, n + 1, dtype=torch.long)
    loss_mask[0, 4:] = 1  # prompt of 4, answer to the end
    loss_mask[2, 2:6] = loss_mask[2, 9:11] = 1  # two answers, then two unmasked tokens
    if left:
        attn[1, :3] = 0
        loss_mask[1, 8:] = 1  # no target's chain starts on padding: x_8 is 3 steps past the first real token
    else:
        attn[1, 9:] = 0
        loss_mask[1, 7:9] = 1
    feats = torch.randn(bsz, n, tiny.config.hidden_size, requires_grad=True)
    embed = tiny.model.get_input_embeddings()
    valid_keys = attn[:, :n].bool()
    positions = torch.arange(n)[None].expand(bsz, n)
    got, ref, hidden, past_k, past_v = [], [], feats, None, None
    for j, st in enumerate(unroll(net, feats, ids, attn, loss_mask, embed, steps)):
        tok, valid = step_inputs(ids, loss_mask, j)
        assert torch.equal(st.valid, valid) and valid.any()
        out, k, v = net.step(hidden, embed(tok), positions + j, unroll_mask(valid_keys, j), past_k, past_v)
        past_k = k if past_k is None else torch.cat([past_k, k], dim=2)
        past_v = v if past_v is None else torch.cat([past_v, v], dim=2)
        hidden = net.norm(out) if v31 else out  # EAGLE-3.1's norm_output feeds the final-normed output on
        assert torch.equal(st.position, valid.nonzero()[:, 1])
        got.append(st.at_targets)
        ref.append(out[valid])
    if not left:
        assert st.out.shape[1] < n  # the later steps ran over a window, not every position
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    weights = [torch.randn_like(r) for r in ref]
    params = [feats, *net.parameters()]
    g_got = torch.autograd.grad(sum((a * w).sum() for a, w in zip(got, weights)), params, allow_unused=True)
    g_ref = torch.autograd.grad(sum((b * w).sum() for b, w in zip(ref, weights)), params, allow_unused=True)
    for a, b in zip(g_got, g_ref):
        if b is not None:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_unroll_with_no_later_targets_trains(tiny):
    """Answers of one or two tokens leave the later unrolled steps no target (an empty window): the step still
    runs, its loss is finite and its gradient reaches the drafter."""
    from train.eagle import EagleModule

    torch.manual_seed(0)
    module = EagleModule(tiny, optimizer=torch.optim.AdamW, kind="eagle3", ttt_steps=4, draft_vocab_size=64,
                         aux_layer_ids=[0, 1])
    module.net.set_draft_vocab(torch.arange(64))
    ids = torch.randint(0, 64, (2, 3))
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 2] = 1  # one answer token: step 0 predicts it from position 0, no later step has a target
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
    res = module.model_step(batch, 4, train=True)
    assert res["valid"][0].sum() == 2 and not res["valid"][1:].any()
    loss = module._loss(res["losses"])
    loss.backward()
    assert torch.isfinite(loss) and module.net.fc.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_unrolled_attention_in_bf16_follows_fp32(is_causal):
    """The fused kernel's path with bf16 inputs, as training runs it under autocast: outputs and gradients within
    bf16 rounding of the fp32 dense reference computed on the same (bf16) inputs and weights."""
    from models.eagle_layers import DraftAttention, UnrollMask

    torch.manual_seed(0)
    ref = DraftAttention(in_dim=64, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0)
    for p in ref.parameters():
        p.data = p.data.bfloat16().float()
    low = DraftAttention(in_dim=64, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0)
    low.load_state_dict(ref.state_dict())
    low = low.bfloat16()
    bsz, n, steps = 2, 40, 3
    valid = torch.ones(bsz, n, dtype=torch.bool)
    valid[1, 30:] = False
    positions = torch.arange(n)[None].expand(bsz, n)
    causal = unroll_mask(valid, 0)
    xs = [torch.randn(bsz, n, 64).bfloat16().float() for _ in range(steps)]
    weight = torch.randn(bsz, n, 64) * valid[..., None]

    def run(module, dtype, dense):
        x = [t.to(dtype).requires_grad_(True) for t in xs]
        ks, vs = [], []
        for j in range(steps):
            if dense:
                mask = unroll_mask(valid, j)
                pk = torch.cat(ks, dim=2) if ks else None
                pv = torch.cat(vs, dim=2) if vs else None
            else:
                mask, pk, pv = UnrollMask(causal, j, is_causal and j == 0), ks or None, vs or None
            out, k, v = module(x[j], positions + j, mask, pk, pv)
            ks.append(k)
            vs.append(v)
        loss = (out.float() * weight).sum()
        return out.float() * valid[..., None], torch.autograd.grad(loss, x)

    want, gw = run(ref, torch.float32, True)
    got, gg = run(low, torch.bfloat16, False)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=0)  # measured: 0.0023 at most, outputs up to 0.73
    for a, b in zip(gg, gw):  # measured: 0.4-0.55% relative error per step's input gradient
        assert float((a.float() - b).norm() / b.norm()) < 0.015


def test_eagle1_and_medusa_train_from_eagle3s_hidden_cache(train_script, tmp_path, tiny, capsys):
    """Offline mode, the 1M-token workflow: EAGLE-3's hidden-state cache (its feature layers and -1) is built once;
    EAGLE-1 and Medusa then train from it (they read layer -1 alone) instead of building their own."""
    common = [*[o for o in TINY if not o.startswith("model.")], "logger=csv", "+trainer.fast_dev_run=true",
              "data.cache_hidden_states=true", f"cache_dir={tmp_path / 'cache'}"]
    train_script.run(compose_train([*common, "model=eagle3", "model.aux_layer_ids=[0,1]",
                                    "model.draft_vocab_size=256"], tmp_path / "e3"))
    (built,) = list((tmp_path / "cache" / "hidden").iterdir())
    capsys.readouterr()
    for model in ("eagle", "medusa"):
        export = train_script.run(compose_train([*common, f"model={model}"], tmp_path / model))
        assert "nothing to build" in capsys.readouterr().out
        assert load_export(export, tiny, model).config["trained_steps"] == 1
    assert list((tmp_path / "cache" / "hidden").iterdir()) == [built]
