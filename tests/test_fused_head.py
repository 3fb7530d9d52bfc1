"""The fused, chunked cross-entropy through a frozen head (train/fused_head.py) against plain autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from train.fused_head import frozen_head_ce, soft_target_ce


@pytest.mark.parametrize("chunk", [3, 64])  # several chunks, and one
def test_loss_and_gradient_equal_autograd_for_labels_and_for_a_teacher(chunk):
    g = torch.Generator().manual_seed(0)
    n, d, v = 10, 8, 37
    weight = torch.randn(v, d, generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    teacher = torch.randn(n, d, generator=g)
    for kind in ("labels", "teacher"):
        h1 = torch.randn(n, d, generator=g, requires_grad=True)
        h2 = h1.detach().clone().requires_grad_(True)
        w = torch.rand(n, generator=g)  # a weighted sum, so a wrong backward scale shows
        logits = h1 @ weight.T
        if kind == "labels":
            ref = F.cross_entropy(logits, labels, reduction="none")
            got, arg, target = frozen_head_ce(h2, weight, labels=labels, chunk=chunk)
            assert torch.equal(target, labels)
        else:
            q = (teacher @ weight.T).softmax(-1)
            ref = -(q * logits.log_softmax(-1)).sum(-1)
            got, arg, target = frozen_head_ce(h2, weight, teacher=teacher, chunk=chunk)
            assert torch.equal(target, q.argmax(-1))
        (ref * w).sum().backward()
        (got * w).sum().backward()
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h2.grad, h1.grad, atol=1e-5, rtol=1e-5)
        assert torch.equal(arg, logits.argmax(-1))


@pytest.mark.parametrize("chunk", [3, 64])  # several chunks, and one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_target_ce_equals_autograd_with_gathered_rows(chunk, dtype):
    """The fused soft-target cross-entropy (EAGLE-3's and EAGLE-1's loss against q) gives autograd's per-row loss
    and gradient through a weighted sum, reads row index[i] of q for logits row i, returns the argmax with argmax's
    tie-breaking, and leaves its input alone (an fp32 input is not overwritten by the in-place softmax)."""
    g = torch.Generator().manual_seed(0)
    n, m, v = 10, 7, 37
    logits = (3 * torch.randn(n, v, generator=g)).to(dtype)
    logits[2, 5] = logits[2, 20] = logits[2].max() + 1  # a tie for the top: the first index wins
    q = torch.randn(m, v, generator=g).softmax(-1)
    index = torch.randint(0, m, (n,), generator=g)
    index[:2] = torch.tensor([m - 1, 0])
    w = torch.rand(n, generator=g)  # a weighted sum, so a wrong backward scale shows
    consecutive = torch.arange(2, 2 + n)  # rows read as a view of q, no gather
    q_long = torch.randn(n + 4, v, generator=g).softmax(-1)
    for rows, idx in ((q[index], None), (q, index), (q_long, consecutive)):
        a = logits.detach().clone().requires_grad_(True)
        b = logits.detach().clone().requires_grad_(True)
        ref = -(rows[idx] if idx is not None else rows).mul(a.float().log_softmax(-1)).sum(-1)
        got, arg = soft_target_ce(b, rows, idx, chunk=chunk)
        (ref * w).sum().backward()
        (got * w).sum().backward()
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        assert b.grad.dtype == dtype
        torch.testing.assert_close(b.grad.float(), a.grad.float(), atol=1e-5,
                                   rtol=1e-5 if dtype == torch.float32 else 1e-2)
        assert torch.equal(arg, logits.argmax(-1)) and int(arg[2]) == 5
        assert torch.equal(b.detach(), logits)
    with torch.no_grad():  # validation: no gradient buffer, same loss
        got, _ = soft_target_ce(logits, q, index, chunk=chunk)
    torch.testing.assert_close(got, -(q[index] * logits.float().log_softmax(-1)).sum(-1), atol=1e-5, rtol=1e-5)


def test_medusa_training_step_loss_equals_the_unfused_one():
    """MedusaModule's training path (fused) and validation path (plain logits) give the same per-head losses."""
    from helpers import varied_llama
    from train.medusa import MedusaModule

    v = varied_llama()
    module = MedusaModule(v, optimizer=lambda params: torch.optim.AdamW(params), num_heads=3)
    for block in module.heads.blocks:  # non-zero blocks, so each head differs
        for layer in block.layers:
            torch.nn.init.normal_(layer.weight, std=0.2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, v.vocab_size, (2, 24), generator=g)
    mask = torch.zeros_like(ids)
    mask[:, 8:] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
    fused = module.model_step(batch, train=True)
    plain = module.model_step(batch, train=False)
    torch.testing.assert_close(torch.stack(fused[1]), torch.stack(plain[1]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused[2][:, 0], plain[2][:, 0])  # top-1 hits


def test_eagle1_training_step_losses_equal_the_unfused_ones():
    """EagleModule's EAGLE-1 training path (fused cross-entropy to q) and its validation path (plain logits) give
    the same loss at every unrolled step, and the same top-1 hits."""
    from helpers import varied_llama
    from train.eagle import EagleModule

    v = varied_llama()
    torch.manual_seed(0)
    module = EagleModule(v, optimizer=lambda params: torch.optim.AdamW(params), kind="eagle", noise=0.0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, v.vocab_size, (2, 20), generator=g)
    mask = torch.zeros_like(ids)
    mask[:, 6:] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
    fused = module.model_step(batch, 3, train=True)
    plain = module.model_step(batch, 3, train=False)
    torch.testing.assert_close(torch.stack(fused["losses"]), torch.stack(plain["losses"]), atol=1e-5, rtol=1e-5)
    assert torch.equal(fused["correct"], plain["correct"]) and torch.equal(fused["valid"], plain["valid"])
    assert fused["valid"].any()


def test_medusa_train_vocab_is_the_full_heads_loss_over_the_kept_rows():
    """model.train_vocab: training and validation score each head over the kept rows of the shared head only; a
    target outside them leaves the loss and counts as a miss. Checked against the full head's logits cut to the rows."""
    from data.hidden_cache import gather_layers
    from helpers import varied_llama
    from models.medusa import medusa_targets
    from train.medusa import MedusaModule

    v = varied_llama()
    module = MedusaModule(v, optimizer=lambda params: torch.optim.AdamW(params), num_heads=3, train_vocab=300)
    for block in module.heads.blocks:  # non-zero blocks, so each head differs
        for layer in block.layers:
            torch.nn.init.normal_(layer.weight, std=0.2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 200, (2, 24), generator=g)  # 200 distinct tokens at most: many share a row
    mask = torch.zeros_like(ids)
    mask[:, 8:] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
    targets = ids[:, 8:].unique()
    keep = torch.cat([targets[::2], 1000 + torch.randperm(40000, generator=g)[:300 - len(targets[::2])]]).sort().values
    module.set_train_vocab(keep)
    hidden = gather_layers(batch, [-1], v, [-1])[-1]
    ref_losses, ref_hits, ref_counts = [], [], []
    for k, (tgt, valid) in enumerate(medusa_targets(ids, mask, 3)):
        tgt = tgt[valid]
        rows = F.linear(module.heads.head_features(hidden[valid], k), v.lm_head.weight)[:, keep]  # (N, 300)
        inside = torch.isin(tgt, keep)
        assert inside.any() and not inside.all()  # some targets kept, some dropped
        local = torch.searchsorted(keep, tgt[inside])
        ref_losses.append(F.cross_entropy(rows[inside], local))
        ref_hits.append((keep[rows.topk(10).indices] == tgt[:, None]).float().sum(0).cumsum(0))
        ref_counts.append(float(tgt.numel()))
    for train in (True, False):
        _, losses, hits, counts = module.model_step(batch, train=train)
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hits, torch.stack(ref_hits)[:, : hits.shape[1]])
        assert counts.tolist() == ref_counts  # dropped targets are counted: misses, not left out


def test_eagle1_train_vocab_scores_the_kept_rows_against_the_full_argmax():
    """EAGLE-1 with model.train_vocab: the loss is the feature regression plus the cross-entropy to q renormalised
    over the kept rows, in training (fused) and in validation; validation's hits and ranks compare the draft over
    those rows with M_q's full-vocabulary argmax, so an argmax outside them is a miss (rank V)."""
    from data.hidden_cache import gather_layers
    from helpers import varied_llama
    from models.eagle import unroll
    from train.eagle import EagleModule

    v = varied_llama()
    torch.manual_seed(0)
    module = EagleModule(v, optimizer=lambda params: torch.optim.AdamW(params), kind="eagle", noise=0.0,
                         train_vocab=400)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, v.vocab_size, (2, 20), generator=g)
    mask = torch.zeros_like(ids)
    mask[:, 6:] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
    states = gather_layers(batch, module.hidden_layers, v, module.hidden_layers)
    final = states[-1]
    full_arg = (final @ v.lm_head.weight.T).argmax(-1)  # (B, T) M_q's greedy token after each position
    args = full_arg[:, 6:].flatten().unique()
    keep = torch.cat([args[::2], 1000 + torch.randperm(40000, generator=g)[:400 - len(args[::2])]]).sort().values
    module.set_train_vocab(keep)
    steps = 3
    feats = module.net.features(states)[:, : ids.shape[1] - 1]
    embed = v.model.get_input_embeddings()
    ref_losses, ref_hits, ref_ranks = [], [], []
    for j, st in enumerate(unroll(module.net, feats, ids, batch["attention_mask"], mask.bool(), embed, steps)):
        valid, bi, ti = st.valid, st.batch, st.position
        h, tgt = st.at_targets, final[bi, ti + j + 1]
        q = (tgt @ v.lm_head.weight[keep].T).softmax(-1)
        p_full = h @ v.lm_head.weight.T  # (N, V)
        ce = -(q * p_full[:, keep].log_softmax(-1)).sum(-1).mean()
        ref_losses.append(F.smooth_l1_loss(h, tgt) + 0.1 * ce)
        arg = full_arg[bi, ti + j + 1]
        inside = torch.isin(arg, keep)
        if j == 0:
            assert inside.any() and not inside.all()  # some argmaxes kept, some outside
        hit = torch.zeros_like(valid)
        hit[bi, ti] = keep[p_full[:, keep].argmax(-1)] == arg
        ref_hits.append(hit)
        masked = p_full.masked_fill(~torch.isin(torch.arange(v.vocab_size), keep), float("-inf"))
        rank = torch.full(valid.shape, v.vocab_size, dtype=torch.long)
        rank[bi, ti] = torch.where(inside, (masked > masked.gather(1, arg[:, None])).sum(-1), v.vocab_size)
        ref_ranks.append(rank)
    val = module.model_step(batch, steps, train=False)
    torch.testing.assert_close(torch.stack(val["losses"]), torch.stack(ref_losses), atol=1e-5, rtol=1e-5)
    assert torch.equal(val["correct"], torch.stack(ref_hits)) and torch.equal(val["rank"], torch.stack(ref_ranks))
    trained = module.model_step(batch, 1, train=True)
    torch.testing.assert_close(trained["losses"][0], ref_losses[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("train", [True, False])
def test_eagle3_step_losses_and_hits_equal_a_plain_reference(train):
    """EAGLE-3's per-step loss (fused, q's rows read by index) against one written out with autograd ops: at step j
    and position t, -sum q log p with q = softmax of M_q's logits at t+j+1 over the draft vocabulary, averaged over
    the targets whose M_q argmax lies in it; and the same top-1 hits."""
    from data.hidden_cache import gather_layers
    from helpers import varied_llama
    from models.eagle import unroll
    from train.eagle import EagleModule

    v = varied_llama()
    torch.manual_seed(0)
    module = EagleModule(v, optimizer=lambda params: torch.optim.AdamW(params), kind="eagle3", ttt_steps=3,
                         draft_vocab_size=200, aux_layer_ids=[0, 1])
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, v.vocab_size, (2, 20), generator=g)
    mask = torch.zeros_like(ids)
    mask[0, 6:] = 1
    mask[1, 9:17] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
    states = gather_layers(batch, module.hidden_layers, v, module.hidden_layers)
    final = states[-1]
    q_logits = final @ v.lm_head.weight.T  # (B, T, V)
    full_arg = q_logits.argmax(-1)
    args = full_arg[mask.bool()].unique()
    vocab = torch.cat([args[::2], 1000 + torch.randperm(30000, generator=g)[: 200 - len(args[::2])]])
    module.net.set_draft_vocab(vocab)
    t2d = module.net.t2d
    feats = module.net.features(states)[:, : ids.shape[1] - 1]
    ref_losses, ref_hits = [], []
    for j, st in enumerate(unroll(module.net, feats, ids, batch["attention_mask"], mask.bool(),
                                  v.model.get_input_embeddings(), 3)):
        valid, bi, ti = st.valid, st.batch, st.position
        p = module.net.logits(st.at_targets)
        q = q_logits[bi, ti + j + 1][:, t2d].softmax(-1)
        arg = full_arg[bi, ti + j + 1]
        inside = t2d[arg]
        assert inside.any() and not inside.all()  # some targets in the draft vocabulary, some not
        ce = -(q * p.log_softmax(-1)).sum(-1)
        ref_losses.append(ce[inside].mean())
        hit = torch.zeros_like(valid)
        hit[bi, ti] = module.net.draft_to_target(p.argmax(-1)) == arg
        ref_hits.append(hit)
    got = module.model_step(batch, 3, train=train)
    torch.testing.assert_close(torch.stack(got["losses"]), torch.stack(ref_losses), atol=1e-5, rtol=1e-5)
    assert torch.equal(got["correct"], torch.stack(ref_hits))
