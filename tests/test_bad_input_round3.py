"""Issue 78, bad input round three: settings taken and ignored or bent, and failures that ended in a traceback.

- a resume applies the learning rate it is given (model.optimizer.lr, and adamw_lr under Muon), the schedule going on
  at its step, instead of the checkpoint's;
- Muon's settings (adamw_lr, betas, adjust_lr_fn) refused before the data step, one message each;
- eval's drafter settings read at the door: a word where a number goes (drafter.num_tokens=abc), a word where true or
  false goes (drafter.sit_out=no once turned it on), drafter.budget beyond what a round verifies;
- drafter.sit_out=true with drafter.budget sits rounds out (it never did);
- an export whose config.json `verifier` entry has a key its loader does not take;
- a full disk in `convert engine-ready` and at the end of `python -m eval`: one message, what was finished kept;
- exports readable by others (model.safetensors was written 0600).
Each ends in one message naming the problem, the value seen and the fix, before anything is written or started.

A full disk is injected where the operating system reports it: os.fsync / os.sendfile raising OSError(ENOSPC) for
files in the folder under test (the files before it are written for real)."""

from __future__ import annotations

import csv
import errno
import json
import os
import stat
from pathlib import Path

import pytest
import torch
from test_adaptive import PROMPTS, base  # noqa: F401
from test_adaptive_hybrid import MAX_NEW, planned_eagle
from test_untrusted_input import _compose

from eval.drafters.hybrid import HybridDrafter
from eval.drafters.lookup import PromptLookupDrafter
from eval.engine.decode import greedy_decode, speculative_decode
from eval.engine.tree import Chain
from eval.harness import evaluate
from helpers import compose_train
from models.exports.io import save_export
from models.medusa import MedusaHeads
from runtime.errors import UserError

TINY = ["verifier=tiny", "data.limit=12", "data.max_new_tokens=12", "data.gen_batch_size=12", "data.batch_size=4",
        "data.val_fraction=0.25", "logger=csv", "model.warmup_ratio=0"]
NO_VERIFIER = ["verifier=hf", "verifier.path=/nonexistent/llama"]  # a check that comes first gives its own message


# -- 1. a resume applies the learning rate it is given ----------------------------------------------------------------
def _logged_lrs(run: Path) -> dict[str, list[float]]:
    """The learning rates LearningRateMonitor logged in the resumed run (the csv logger's second version)."""
    with open(run / "csv" / "version_1" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return {k: [float(r[k]) for r in rows if r[k]] for k in rows[0] if k.startswith("lr-")}


@pytest.mark.parametrize("optim,new,rates", [
    ([], ["model.optimizer.lr=1e-9"], [1e-9]),
    (["model/optim@model=muon"], ["model.optimizer.lr=1e-9", "model.optimizer.adamw_lr=2e-9"], [1e-9, 2e-9]),
])
def test_a_resume_applies_the_learning_rate_it_is_given(train_script, tmp_path, optim, new, rates):
    """`ckpt_path=last model.optimizer.lr=1e-9` resumed at the checkpoint's rate: Lightning restores the optimizer's
    param groups and the schedule's base_lrs after configure_optimizers built them. Now every group (Muon's and
    AdamW's under Muon) takes the rate given, the schedule going on at its step, and the recipe says so."""
    run = tmp_path / "run"
    train_script.run(compose_train([*TINY, "model=medusa", *optim, "trainer.max_epochs=1"], run))
    first = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert [g["initial_lr"] for g in first["optimizer_states"][0]["param_groups"]] == [1e-3] * len(rates)
    train_script.run(compose_train([*TINY, "model=medusa", *optim, "trainer.max_epochs=2", *new, "ckpt_path=last"],
                                   run))
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] > first["global_step"]
    assert [g["initial_lr"] for g in last["optimizer_states"][0]["param_groups"]] == rates
    assert last["lr_schedulers"][0]["base_lrs"] == rates
    logged = list(_logged_lrs(run).values())  # one column per param group, in the groups' order
    assert len(logged) == len(rates) and all(logged)
    for values, rate in zip(logged, rates):
        assert all(0 < v <= rate for v in values), (values, rate)  # the cosine schedule's share of the new rate
    if len(rates) == 2:  # the same step of one schedule: the groups keep the ratio of their rates
        assert all(b == pytest.approx(2 * a) for a, b in zip(*logged))
    recipe = (run / ".hydra" / "config.yaml").read_text()  # what the run records is what ran
    assert "lr: 1.0e-09" in recipe and ("adamw_lr: 2.0e-09" in recipe) == bool(optim)


# -- 2. Muon's settings, before the data step -------------------------------------------------------------------------
@pytest.mark.parametrize("override,message", [
    ("model.optimizer.adamw_lr=-1", "model.optimizer.adamw_lr=-1: give AdamW's learning rate, 0 or more, e.g. "
                                    "model.optimizer.adamw_lr=1e-3."),
    ("model.optimizer.betas=[0.9,1.5]", "model.optimizer.betas=[0.9, 1.5]: give two moment decays, each in [0, 1) "
                                        "(1 or more never forgets a gradient), e.g. model.optimizer.betas=[0.9,0.95]."),
    ("model.optimizer.adjust_lr_fn=foo", "model.optimizer.adjust_lr_fn='foo': give one of match_rms_adamw, original "
                                         "(how Muon scales its update), or null (torch's original), e.g. "
                                         "model.optimizer.adjust_lr_fn=match_rms_adamw."),
])
def test_muon_settings_are_refused_before_the_data_step(train_script, tmp_path, override, message):
    """torch.optim.Muon / AdamW refused them with a ValueError traceback once the data was built."""
    with pytest.raises(UserError) as err:  # before the verifier loads (it does not exist): before the data step
        train_script.run(compose_train([*TINY, *NO_VERIFIER, "model=eagle3", "model/optim@model=muon", override],
                                       tmp_path / "run"))
    assert str(err.value) == message
    assert not (tmp_path / "run").exists()


# -- 3, 6, 7. eval's drafter settings, at the door --------------------------------------------------------------------
_compose_eval = _compose  # the eval config of tests/test_untrusted_input.py: one prompt, 4 tokens, fp32, no W&B


@pytest.fixture
def export(tiny, tmp_path) -> Path:
    return save_export(MedusaHeads(tiny.hidden_size, tiny.vocab_size, num_heads=2), tiny, tmp_path / "export",
                       {"medusa_topk_accuracy": [[0.5, 0.6], [0.3, 0.4]]})


@pytest.mark.parametrize("overrides,message", [
    (["drafter=prompt_lookup", "drafter.num_tokens=abc"],
     "drafter.num_tokens='abc': give a whole number, e.g. drafter.num_tokens=10."),
    (["drafter.num_tokens=abc"], "drafter.num_tokens='abc': give a whole number, or null (the default)."),
    (["drafter.sit_out=no"], "drafter.sit_out='no': give true or false, e.g. drafter.sit_out=false."),
    (["drafter.sit_out=yes"], "drafter.sit_out='yes': give true or false, e.g. drafter.sit_out=false."),
    (["drafter=lookahead", "drafter.pool_from_prompt=abc"],
     "drafter.pool_from_prompt='abc': give true or false, e.g. drafter.pool_from_prompt=false."),
    (["typical=no"], "typical='no': give true or false, e.g. typical=false."),
    (["alone=no"], "alone='no': give true or false, e.g. alone=true."),
    (["drafter.budget=500"], "drafter.budget=500: the budget is the nodes one round verifies (the root included), and "
                             "a round verifies at most 64. Give drafter.budget in [2, 64], or null (the export "
                             "drafter's own node count); engine=hf verifies more, not exact in bfloat16."),
])
def test_eval_drafter_settings_are_read_at_the_door(export, tmp_path, overrides, message):
    """drafter.num_tokens=abc ended in a TypeError, drafter.sit_out=no (bool() of a word) turned it on, and
    drafter.budget=500 was refused after the cost curve with advice about tree.size / tree.depth. Now each is one
    message before the verifier loads (it does not exist here)."""
    out = tmp_path / "eval"
    cfg = _compose_eval([f"checkpoint={export}", f"verifier_path={tmp_path / 'no-verifier-here'}",
                         f"output_dir={out}", *overrides])
    with pytest.raises(UserError) as err:
        evaluate(cfg, progress=False)
    assert str(err.value) == message
    assert not out.exists()


def test_a_lookup_chain_past_what_a_round_verifies_names_its_own_setting(smollm2, tmp_path):
    """drafter=prompt_lookup drafter.num_tokens=500 on the default verifier: the engine's refusal named only
    tree.size / tree.depth, which this drafter does not read."""
    cfg = _compose_eval(["drafter=prompt_lookup", "drafter.num_tokens=500", "engine=engine",
                         f"output_dir={tmp_path / 'eval'}"])
    with pytest.raises(UserError, match=r"proposes up to 501 nodes.*fewer tokens \(drafter.num_tokens"):
        evaluate(cfg, progress=False)


def test_sit_out_with_a_budget_sits_rounds_out(base, one_thread):  # noqa: F811
    """The same drafter and prompts as test_adaptive_hybrid's sit-out test, within a node budget: rounds lookup carries
    alone still skip the drafter's forward (a budget once turned sit_out off without a word); output plain greedy's."""
    hybrid = HybridDrafter(planned_eagle(base, 5.0), PromptLookupDrafter(Chain(10), 10), budget=12, sit_out=True)
    rounds = 0
    for text in PROMPTS:
        ids = base.tokenizer(text, return_tensors="pt").input_ids
        got = speculative_decode(base, hybrid, ids, MAX_NEW)
        assert got.tokens[0].tolist() == greedy_decode(base, ids, MAX_NEW).tokens[0].tolist()
        rounds += len(got.accept_lengths)
    assert hybrid.max_nodes == 12
    assert hybrid.lookup_rounds > rounds // 2, (hybrid.lookup_rounds, rounds)


# -- 4. an export's `verifier` entry with a key its loader does not take ----------------------------------------------
def test_a_verifier_entry_with_an_unknown_key_is_one_message(export, tmp_path):
    config = json.loads((export / "config.json").read_text())
    config["verifier"]["bogus"] = 1
    (export / "config.json").write_text(json.dumps(config))
    cfg = _compose_eval([f"checkpoint={export}", f"output_dir={tmp_path / 'eval'}"])
    with pytest.raises(UserError) as err:  # was: TypeError: build_tiny() got an unexpected keyword argument 'bogus'
        evaluate(cfg, progress=False)
    assert str(err.value) == (
        f"{export / 'config.json'}: `verifier` {config['verifier']!r}: the 'tiny' loader takes no key 'bogus'; the "
        f"keys allowed are loader, num_layers, hidden_size, num_heads, seed, initializer_range, layer_std, rendering. "
        f"Remove it from that entry, or write the file again with this version (re-export the drafter).")
    assert not (tmp_path / "eval").exists()


# -- 5. a full disk --------------------------------------------------------------------------------------------------
def _full_under(folder: Path, monkeypatch, *calls: str) -> None:
    """From now on the OS reports a full disk (ENOSPC) for files under `folder`, at the calls named (os.fsync,
    os.sendfile: where a write's data reaches the disk): a fault injected where the kernel raises it."""
    folder = str(folder.resolve())

    def under(fd: int) -> bool:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(folder)

    for name in calls:
        real = getattr(os, name)

        def fault(fd: int, *args, _real=real):
            if under(fd):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return _real(fd, *args)

        monkeypatch.setattr(os, name, fault)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="finds a descriptor's file through /proc")
def test_a_full_disk_in_engine_ready_keeps_the_old_export(export, tiny, tmp_path, monkeypatch, capsys):
    from models.exports.shipped import ship
    from scripts.tools.convert import main

    compact = ship(export, tmp_path / "shipped", tiny)
    served = tmp_path / "disk" / "served"
    assert main(["engine-ready", str(compact), str(served)]) == 0
    before = _files(served)
    capsys.readouterr()
    _full_under(tmp_path / "disk", monkeypatch, "fsync")
    assert main(["engine-ready", str(compact), str(served)]) == 2  # was: a SafetensorError / OSError traceback
    assert capsys.readouterr().err.splitlines() == [
        f"error: no space left on the disk that holds {served.parent} while writing {served}. Nothing was replaced: "
        f"{served} holds its previous version, whole. Free space there (df -h {served.parent}) and run the command "
        f"again."]
    assert _files(served) == before
    assert sorted(p.name for p in served.parent.iterdir()) == ["served"]  # no scratch folder left filling the disk


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="finds a descriptor's file through /proc")
def test_a_full_disk_at_the_end_of_eval_keeps_the_report(export, tmp_path, monkeypatch):
    """The last step of `python -m eval`, logging the run to W&B (offline: files under <output_dir>/wandb), met a full
    disk copying the plots into the run: an OSError traceback. Now one message, and report.json is whole. A full disk
    when report.json itself is written keeps the previous report.json."""
    out = tmp_path / "eval"
    cfg = _compose_eval([f"checkpoint={export}", f"output_dir={out}", "alone=false", "wandb.mode=offline"])
    with monkeypatch.context() as m:
        _full_under(out / "wandb", m, "sendfile", "fsync")
        with pytest.raises(UserError) as err:
            evaluate(cfg, progress=False)
    assert str(err.value) == (
        f"no space left on the disk that holds {out} while logging the run to W&B. The report is written whole "
        f"(report.json, profile.json, outputs.jsonl, the plots in {out}); the W&B run under {out / 'wandb'} is "
        f"incomplete. (wandb.mode=disabled skips W&B.) Free space there (df -h {out}) and run the command again.")
    report = json.loads((out / "report.json").read_text())
    assert report["greedy_match"] == 1.0 and (out / "tokens_per_s.png").is_file()

    before = (out / "report.json").read_bytes()
    cfg = _compose_eval([f"checkpoint={export}", f"output_dir={out}", "alone=false", "max_new_tokens=6"])
    with monkeypatch.context() as m:
        _full_under(out, m, "fsync")
        with pytest.raises(UserError) as err:
            evaluate(cfg, progress=False)
    assert str(err.value) == (
        f"no space left on the disk that holds {out} while writing the report. Nothing of this run's report was "
        f"written; every file not written keeps its previous version, if any. Free space there (df -h {out}) and run "
        f"the command again.")
    assert (out / "report.json").read_bytes() == before  # the previous run's, whole
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


# -- 8. an export others can read --------------------------------------------------------------------------------------
def test_an_export_has_the_usual_file_modes(tiny, tmp_path):
    """safetensors writes through a private temporary file: model.safetensors (and the target counts) were 0600,
    unreadable to the other users of a shared export. Under umask 022 an export's files are 0644, as `open` makes
    them."""
    umask = os.umask(0o022)
    try:
        out = save_export(MedusaHeads(tiny.hidden_size, tiny.vocab_size, num_heads=2), tiny, tmp_path / "export",
                          target_counts=torch.ones(tiny.vocab_size))
    finally:
        os.umask(umask)
    modes = {str(p.relative_to(out)): stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()}
    assert modes == {"config.json": 0o644, "model.safetensors": 0o644, "specdraft/target_counts.safetensors": 0o644}
