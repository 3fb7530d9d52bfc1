"""train/losses.py: each acceptance loss against its closed form (chunk boundaries included), gradcheck of the
closed-form gradients in float64, D-PACE weights on a hand-computed case, bad names, a tiny-model training step per
loss through the real config, and the best checkpoint chosen on val/expected_accepted_length."""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd.gradcheck import GradcheckError

from runtime.errors import UserError
from train.losses import (
    LOSSES,
    TERMS,
    _ChunkedLoss,
    chain_acceptance,
    check_loss,
    chunked_loss,
    dpace_weights,
    frozen_head_loss,
)

ETA = 3.0


def closed_form(name: str, z: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Each loss written out from its definition, in float64 (speculators/losses/eager.py's definitions)."""
    z, q = z.double(), q.double()
    p = z.softmax(-1)
    logp, logq = z.log_softmax(-1), q.log()
    alpha = torch.minimum(p, q).sum(-1)
    kl = (q * (logq - logp)).sum(-1)
    m = (p + q) / 2
    return {"kl": kl + -(q * logq).sum(-1),  # today's: the cross-entropy to q, KL + H(q)
            "rkl": (p * (logp - logq)).sum(-1),
            "jsd": 0.5 * (p * (logp - m.log())).sum(-1) + 0.5 * (q * (logq - m.log())).sum(-1),
            "ce": -logp.gather(-1, q.argmax(-1, keepdim=True))[:, 0],
            "tv": 0.5 * (p - q).abs().sum(-1),
            "nla": -alpha.clamp_min(1e-5).log(),
            "lk_hybrid": (lam := torch.exp(-ETA * alpha.detach())) * kl + (1 - lam) * (1 - alpha)}[name]  # sg[alpha]


def _case(n: int = 7, v: int = 11, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=g) * 2
    q = (torch.randn(n, v, generator=g) * 2).softmax(-1)
    return z, q


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("chunk", [1, 3, 64])  # rows split across chunks, a ragged last chunk, one chunk
def test_loss_matches_closed_form(name: str, chunk: int) -> None:
    z, q = _case()
    got, arg, alpha = chunked_loss(z, q, loss=name, eta=ETA, chunk=chunk)
    assert torch.allclose(got.double(), closed_form(name, z, q), atol=1e-5)
    assert torch.equal(arg, z.argmax(-1))
    assert torch.allclose(alpha.double(), torch.minimum(z.double().softmax(-1), q.double()).sum(-1), atol=1e-6)
    # gathered rows of q (index) read the same rows as q[index] row by row
    index = torch.tensor([4, 0, 0, 6, 2, 1, 3])
    got_i, _, _ = chunked_loss(z, q, index, loss=name, eta=ETA, chunk=chunk)
    assert torch.allclose(got_i.double(), closed_form(name, z, q[index]), atol=1e-5)


@pytest.mark.parametrize("name", LOSSES)
def test_frozen_head_loss_matches_closed_form(name: str) -> None:
    g = torch.Generator().manual_seed(1)
    hidden, teacher, weight = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g), torch.randn(9, 4,
                                                                                                          generator=g)
    for chunk in (2, 512):
        got, arg, q_arg, alpha = frozen_head_loss(hidden, weight, teacher=teacher, loss=name, eta=ETA, chunk=chunk)
        z, q = hidden @ weight.T, (teacher @ weight.T).softmax(-1)
        assert torch.allclose(got.double(), closed_form(name, z, q), atol=1e-5)
        assert torch.equal(q_arg, q.argmax(-1)) and torch.equal(arg, z.argmax(-1))
        # the gradient to hidden is dL/dz @ W: compare with autograd through the closed form
        h = hidden.clone().requires_grad_(True)
        frozen_head_loss(h, weight, teacher=teacher, loss=name, eta=ETA, chunk=chunk)[0].sum().backward()
        h2 = hidden.double().clone().requires_grad_(True)
        closed_form(name, h2 @ weight.double().T, q.double()).sum().backward()
        assert torch.allclose(h.grad.double(), h2.grad, atol=1e-4)


@pytest.mark.parametrize("name", LOSSES)
def test_closed_form_gradients_pass_gradcheck(name: str) -> None:
    """Finite differences in float64 over 4 rows in chunks of 3. lk_hybrid's gradient leaves out d lam/dz on purpose
    (lam = exp(-eta sg[alpha])), so finite differences of its value cannot match: it is checked against autograd
    through the closed form with lam detached instead."""
    z, q = _case(n=4, v=6, seed=2)
    z = z.double().requires_grad_(True)
    q = q.double()
    if name != "lk_hybrid":
        assert torch.autograd.gradcheck(lambda x: _ChunkedLoss.apply(x, q, None, name, ETA, 3)[0], (z,), eps=1e-6,
                                        atol=1e-5)
    w = torch.linspace(0.5, 2.0, 4, dtype=torch.float64)  # a non-uniform upstream gradient
    (_ChunkedLoss.apply(z, q, None, name, ETA, 3)[0] * w).sum().backward()
    ref = z.detach().clone().requires_grad_(True)
    (closed_form(name, ref, q) * w).sum().backward()
    assert torch.allclose(z.grad, ref.grad, atol=1e-9)


def test_a_wrong_gradient_fails_gradcheck() -> None:
    """Negative control: gradcheck catches a gradient that is off (tv's with the sign of its sum flipped)."""
    z, q = _case(n=4, v=6, seed=2)
    z = z.double().requires_grad_(True)
    terms = TERMS["tv"]

    def wrong(zz, qq, y, eta):
        loss, grad, alpha = terms(zz, qq, y, eta)
        return loss, -grad, alpha

    TERMS["tv"] = wrong
    try:
        with pytest.raises(GradcheckError):
            torch.autograd.gradcheck(lambda x: _ChunkedLoss.apply(x, q.double(), None, "tv", ETA, 3)[0], (z,),
                                     eps=1e-6, atol=1e-5)
    finally:
        TERMS["tv"] = terms


def test_dpace_weights_by_hand() -> None:
    conf = torch.tensor([[0.5, 0.8, 0.25], [1.0, 1.0, 1.0]])
    # prefix products 0.5, 0.4, 0.1: suffix sums 1.0, 0.5, 0.1; all ones: 3, 2, 1
    assert torch.allclose(dpace_weights(conf), torch.tensor([[1.0, 0.5, 0.1], [3.0, 2.0, 1.0]]))
    assert not dpace_weights(conf.requires_grad_(True)).requires_grad
    assert chain_acceptance(torch.tensor([0.5, 0.8, 0.25])).item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"\[0, 1\].*saw 2.0"):
        dpace_weights(torch.tensor([0.5, 2.0]))


def test_expected_accepted_length_by_hand() -> None:
    """Validation's tally: per chain start, sum_k prod_{j<=k} alpha_j over the steps, an invalid step ending it."""
    from train.verifier_fed import validation_summary, validation_tallies

    alpha = torch.tensor([[[0.5, 0.4]], [[0.8, 0.9]]])  # (S=2, B=1, n=2)
    valid = torch.tensor([[[True, True]], [[True, False]]])
    rank = torch.zeros(2, 1, 2, dtype=torch.long)
    tallies = validation_tallies(rank == 0, valid, rank, alpha=alpha)
    assert float(tallies["expected_accept"]) == pytest.approx(0.5 + 0.5 * 0.8 + 0.4)
    agg = {k: v for k, v in tallies.items()}
    assert validation_summary(agg)["expected_accepted_length"] == pytest.approx(1 + 1.3 / 2)


def test_unknown_loss_names_the_list() -> None:
    with pytest.raises(UserError, match="model.loss='kld'.*kl, rkl, jsd, ce, tv, nla, lk_hybrid"):
        check_loss("kld")
    with pytest.raises(UserError, match="kl, rkl"):
        chunked_loss(torch.zeros(1, 3), torch.ones(1, 3) / 3, loss="hinge")


def test_nla_is_ce_for_a_point_mass_and_tv_bounds_hold() -> None:
    """Sanity of the definitions: against a one-hot q, nla = ce; tv = 1 - alpha in [0, 1]; jsd <= log 2."""
    z, _ = _case()
    q = torch.nn.functional.one_hot(torch.arange(7) % 11, 11).float()
    assert torch.allclose(chunked_loss(z, q, loss="nla")[0], chunked_loss(z, q, loss="ce")[0], atol=1e-5)
    _, q = _case(seed=5)
    assert bool((chunked_loss(z, q, loss="jsd")[0] <= math.log(2) + 1e-6).all())


# -- through the real config: a training step per loss, and the best checkpoint -------------------------------------
# dflash: every anchor (num_anchors=null), so two calls train on the same blocks
FAMILIES = {"dflash": ["model.block_size=4", "model.aux_layer_ids=[0,1]", "model.num_anchors=null"],
            "eagle3": ["model.draft_vocab_size=64", "model.aux_layer_ids=[0,1]", "model.ttt_steps=2"],
            "draft_model": ["model.num_layers=1"]}


def _module(tiny, family: str, *extra: str):
    from hydra.utils import instantiate

    from helpers import compose_train

    cfg = compose_train(["verifier=tiny", f"model={family}", *FAMILIES[family], *extra])
    torch.manual_seed(0)
    module = instantiate(cfg.model, verifier=tiny)
    if family == "eagle3":
        module.net.set_draft_vocab(torch.arange(64))  # the ids the batch uses
    return module


def _step_loss(module, batch) -> torch.Tensor:
    if hasattr(module, "ttt_steps") or "ttt_steps" in module.hparams:
        return module._loss(module.model_step(batch, module.hparams.ttt_steps, train=True)["losses"])
    return module.model_step(batch, train=True)[0]


@pytest.mark.parametrize("family", ["dflash", "eagle3", "draft_model"])
def test_a_training_step_with_each_loss_descends(tiny, family: str) -> None:
    """model.loss=<each> through conf/model/<family>.yaml: the step's loss is finite, its gradient reaches the
    drafter, and a small step against that gradient lowers the same loss on the same batch."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(20, 64, (2, 12), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "loss_mask": torch.tensor([[0] * 3 + [1] * 9, [0] * 5 + [1] * 7])}
    for name in LOSSES:  # (D-PACE's weights move with the step, so the descent is checked on exp's fixed ones)
        module = _module(tiny, family, f"model.loss={name}")
        assert module.hparams.loss == name
        params = [p for p in module.parameters() if p.requires_grad]
        loss = _step_loss(module, batch)
        loss.backward()
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params if p.grad is not None))
        assert torch.isfinite(loss) and 0 < norm < float("inf"), (name, loss, norm)
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p -= 1e-3 / float(norm) * p.grad
            after = _step_loss(module, batch)
        assert after < loss, (name, float(loss), float(after))


def test_bad_loss_settings_are_refused(tiny) -> None:
    # (hydra wraps the UserError in its InstantiationException; train.py prints the message)
    with pytest.raises(Exception, match="model.loss='kld'.*pick one of kl, rkl, jsd, ce, tv, nla, lk_hybrid"):
        _module(tiny, "eagle3", "model.loss=kld")
    with pytest.raises(Exception, match="model.slot_weighting='linear'.*exp.*dpace"):
        _module(tiny, "dflash", "model.slot_weighting=linear")
    with pytest.raises(Exception, match="model.lk_eta=-1"):
        _module(tiny, "draft_model", "model.lk_eta=-1")


def test_dflash_dpace_weights_follow_the_slots_overlaps(tiny) -> None:
    """slot_weighting=dpace: slot k's weight is dpace_weights of the smoothed per-slot overlaps of its block (an
    invalid slot ends the chain); exp keeps step_decay^(k-1)."""
    module = _module(tiny, "dflash", "model.slot_weighting=dpace", "model.dpace_alpha=0.5")
    alpha = torch.tensor([0.2, 0.6, 1.0])[:, None, None].expand(3, 1, 2).clone()  # (S, B, n)
    valid = torch.ones(3, 1, 2, dtype=torch.bool)
    valid[2, 0, 1] = False
    w = module.slot_weights(alpha, valid)
    c = [0.6, 0.8, 1.0]  # 0.5 alpha + 0.5
    assert torch.allclose(w[:, 0, 0], torch.tensor([c[0] + c[0] * c[1] + c[0] * c[1] * c[2],
                                                    c[0] * c[1] + c[0] * c[1] * c[2], c[0] * c[1] * c[2]]))
    assert torch.allclose(w[:, 0, 1], torch.tensor([c[0] + c[0] * c[1], c[0] * c[1], 0.0]))
    assert module.step_weight(2) == 1.0
    exp = _module(tiny, "dflash")
    assert exp.slot_weights(alpha, valid) is None and exp.step_weight(2) == pytest.approx(0.7788**2)


def test_best_checkpoint_is_the_largest_expected_accepted_length(train_script, tmp_path) -> None:
    """A DFlash run with D-PACE and lk_hybrid through train.py: every validation logs val/expected_accepted_length
    (in [1, 1 + K]), checkpoints/best.ckpt holds the validation where it was largest, and the export records it."""
    import csv
    import json

    from helpers import compose_train

    cfg = compose_train(["verifier=tiny", "data.limit=12", "data.max_new_tokens=12", "data.gen_batch_size=12",
                         "data.batch_size=4", "data.val_fraction=0.25", "model=dflash", *FAMILIES["dflash"],
                         "model.slot_weighting=dpace", "model.loss=lk_hybrid", "model.optimizer.lr=1e-2",
                         "+verifier.initializer_range=0.3", "logger=csv", "trainer.max_epochs=4",
                         "callbacks.progress.when=never"], tmp_path)
    export = train_script.run(cfg)
    rows = list(csv.DictReader(open(next((tmp_path / "csv").glob("version_*/metrics.csv")))))
    eal = [(float(r["val/expected_accepted_length"]), int(r["epoch"])) for r in rows
           if r.get("val/expected_accepted_length")]
    assert len(eal) == 4 and all(1.0 <= v <= 4.0 for v, _ in eal), eal
    assert len({v for v, _ in eal}) > 1  # the figure moves with training, so choosing among them means something
    best = torch.load(tmp_path / "checkpoints" / "best.ckpt", weights_only=True, map_location="cpu")
    state = next(v for k, v in best["callbacks"].items() if k.startswith("BestCheckpoint"))
    top, epoch = max(eal)
    assert float(state["best_model_score"]) == pytest.approx(top) and best["epoch"] == epoch, (eal, best["epoch"])
    config = json.loads((export / "config.json").read_text())
    assert config["expected_accepted_length"] == pytest.approx(eal[-1][0], abs=1e-5)
