"""model/optim@model=muon (train/muon.py): Muon on the drafter's hidden matrices, AdamW on the rest, one schedule;
a real training run resumed from its checkpoint continues as the unbroken run; bad settings refused."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from helpers import compose_train
from runtime.errors import UserError
from train.muon import MuonAdamW, hidden_matrices

TINY4 = ["verifier=tiny", "verifier.num_layers=4", "data.limit=12", "data.max_new_tokens=12", "data.gen_batch_size=12",
         "data.batch_size=4", "data.val_fraction=0.25", "logger=csv", "model/optim@model=muon"]


@pytest.fixture(scope="module")
def tiny4(cache_dir):
    from models.verifiers.tiny import build_tiny

    return build_tiny(cache_dir=cache_dir, dtype="float32", device="cpu", num_layers=4)


def _module(family: str, verifier, **kw):
    from train.dflash import DFlashModule
    from train.dspark import DSparkModule
    from train.eagle import EagleModule

    opt = functools.partial(MuonAdamW)
    build = {"eagle3": lambda: EagleModule(verifier, opt, kind="eagle3", draft_vocab_size=256),
             "dflash": lambda: DFlashModule(verifier, opt, block_size=4),
             "dspark": lambda: DSparkModule(verifier, opt, block_size=4, markov_rank=8)}[family]
    return build()


@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark"])
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(tiny4, family):
    """The split speculators makes: every 2-D layer matrix (and fc) to Muon; norms, the draft lm_head, the Markov
    factors to AdamW; one list of groups, so one schedule scales both."""
    module = _module(family, tiny4)
    opt = MuonAdamW([(n, p) for n, p in module.named_parameters() if p.requires_grad])
    names = {id(p): n for n, p in module.named_parameters()}
    muon = {names[id(p)] for p in opt.muon_params}
    adamw = {names[id(p)] for p in opt.adamw_params}
    assert muon and "net.fc.weight" in muon and any("q_proj" in n for n in muon)
    assert all(module.get_parameter(n).ndim == 2 for n in muon)
    assert not any(h in n for n in muon for h in ("lm_head", "markov", "norm"))
    assert any("norm" in n for n in adamw)
    assert muon | adamw == {n for n, p in module.named_parameters() if p.requires_grad} and not muon & adamw
    if family == "eagle3":
        assert "net.lm_head.weight" in adamw
    if family == "dspark":
        assert {"net.markov_head.markov_w1.weight", "net.markov_head.markov_w2.weight"} <= adamw
    assert opt.param_groups == opt.muon.param_groups + opt.adamw.param_groups
    assert sorted(muon) == sorted(hidden_matrices(module))


def test_muon_moves_its_matrices_and_keeps_a_momentum(tiny4):
    """One step: every Muon matrix moved and holds a momentum buffer; AdamW's parameters hold their two moments."""
    module = _module("dflash", tiny4)
    opt = MuonAdamW([(n, p) for n, p in module.named_parameters() if p.requires_grad], lr=1e-2, adamw_lr=1e-2)
    before = [p.detach().clone() for p in opt.muon_params]
    loss = sum((p.float() ** 2).sum() for p in module.parameters() if p.requires_grad)
    loss.backward()
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, opt.muon_params))
    assert all(set(opt.state[p]) == {"momentum_buffer"} for p in opt.muon_params)
    assert all({"exp_avg", "exp_avg_sq"} <= set(opt.state[p]) for p in opt.adamw_params)


@pytest.mark.parametrize("momentum", [1.0, 1.5, -0.1, "0.9"])
def test_a_momentum_outside_0_1_is_refused(tiny4, momentum):
    module = _module("dflash", tiny4)
    with pytest.raises(UserError, match=r"momentum=.*in \[0, 1\)"):
        MuonAdamW(list(module.named_parameters()), momentum=momentum)


def test_a_model_without_a_hidden_matrix_is_refused():
    """Only vectors and a vocabulary table: nothing for Muon; the message names what it saw and the way out."""
    model = nn.ModuleDict({"embed_tokens": nn.Embedding(100, 8), "norm": nn.LayerNorm(8), "proj": nn.Linear(8, 1)})
    with pytest.raises(UserError, match=r"no 2-D hidden matrix.*embed_tokens.weight \(100, 8\).*adamw_cosine"):
        MuonAdamW(list(model.named_parameters()))


def test_the_config_composes_and_the_memory_table_counts_muons_state(tiny4):
    """model/optim@model=muon gives the MuonAdamW factory; the memory table counts one fp32 buffer per Muon weight
    and two per AdamW weight."""
    from hydra.utils import instantiate

    from train.memory import plan_memory

    cfg = compose_train([*TINY4, "model=dflash", "model.block_size=4"])
    assert cfg.model.optimizer._target_ == "train.muon.MuonAdamW" and cfg.model.optimizer.momentum == 0.95
    module = instantiate(cfg.model, verifier=tiny4)
    plan = plan_memory(tiny4, module, batch_size=2, max_length=16)
    rows = {what: size for what, size, _ in plan.rows}
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    m = sum(p.numel() for n, p in named if n in hidden_matrices(module))
    a = sum(p.numel() for _, p in named) - m
    assert m > 0 and rows["Muon + AdamW states"] == 4 * (m + 2 * a)
    assert "AdamW states" not in rows


def test_a_resumed_muon_run_continues_as_the_unbroken_run(train_script, tmp_path):
    """DFlash on the tiny verifier with Muon (every anchor: no sampling): 6 steps in one run, and a run that crashes
    at step 4 (its last checkpoint: step 3) resumed to 6 from last.ckpt, end on the same step with the same weights
    and both optimizers' states (Muon's momentum, AdamW's moments and step) and the same learning rates."""
    common = [*TINY4, "model=dflash", "model.block_size=4", "model.num_anchors=null", "trainer.max_epochs=20",
              "callbacks.checkpoint.every_n_train_steps=3", "model.warmup_ratio=0.2"]
    train_script.run(compose_train([*common, "trainer.max_steps=6"], tmp_path / "unbroken"))
    with pytest.raises(RuntimeError, match="crashed at step 4"):
        train_script.run(compose_train([*common, "trainer.max_steps=6", "+callbacks.crash._target_=helpers.CrashAt",
                                        "+callbacks.crash.step=4"], tmp_path / "broken"))
    half = torch.load(tmp_path / "broken" / "checkpoints" / "last.ckpt", weights_only=False)
    assert half["global_step"] == 3 and half["optimizer_states"][0]["state"]
    train_script.run(compose_train([*common, "trainer.max_steps=6", "ckpt_path=last"], tmp_path / "broken"))
    a, b = (torch.load(tmp_path / d / "checkpoints" / "last.ckpt", weights_only=False) for d in ("unbroken", "broken"))
    assert a["global_step"] == b["global_step"] == 6
    for k in a["state_dict"]:
        torch.testing.assert_close(a["state_dict"][k], b["state_dict"][k], msg=k)
    sa, sb = a["optimizer_states"][0], b["optimizer_states"][0]
    kinds = {tuple(sorted(v)) for v in sa["state"].values()}
    assert kinds == {("momentum_buffer",), ("exp_avg", "exp_avg_sq", "step")}
    for i, state in sa["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(value, sb["state"][i][key], msg=f"{i} {key}")
    assert [g["lr"] for g in sa["param_groups"]] == pytest.approx([g["lr"] for g in sb["param_groups"]])
    assert a["lr_schedulers"][0]["last_epoch"] == b["lr_schedulers"][0]["last_epoch"] == 6
