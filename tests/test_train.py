"""Training end to end on the tiny verifier (in-process), the real command line, resume, W&B files, NaN handling."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT, batch_recorder_overrides, compose_train
from models.exports.io import load_export
from runtime.errors import NonFiniteLossError, UserError

TINY = ["verifier=tiny", "data.limit=12", "data.max_new_tokens=12", "data.gen_batch_size=12", "data.batch_size=4",
        "data.val_fraction=0.25"]


def _metrics(output_dir: Path) -> list[dict[str, str]]:
    rows = []
    for path in sorted((output_dir / "csv").glob("version_*/metrics.csv")):
        with open(path) as f:
            rows += list(csv.DictReader(f))
    return rows


def _series(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key)]


def test_fast_dev_run_exports_loadable_heads(train_script, tmp_path, tiny):
    cfg = compose_train([*TINY, "model=medusa", "logger=csv", "+trainer.fast_dev_run=true"], tmp_path)
    export = train_script.run(cfg)
    loaded = load_export(export, tiny)

    heads, config = loaded.net, loaded.config
    assert heads.num_heads == 4 and config["verifier_fingerprint"] == tiny.fingerprint


def test_loss_goes_down_when_overfitting(train_script, tmp_path):
    cfg = compose_train([*TINY, "logger=csv", "trainer.max_epochs=12", "trainer.log_every_n_steps=1",
                         "model.optimizer.lr=3e-2", "model.warmup_ratio=0.0", "data.val_fraction=0.1"], tmp_path)
    export = train_script.run(cfg)
    losses = _series(_metrics(tmp_path), "train/loss")
    assert len(losses) >= 20
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.7 * first, (first, last)
    # Validation accuracies per head were logged and written into the export for tree construction.
    config = json.loads((export / "config.json").read_text())
    table = config["medusa_topk_accuracy"]
    assert len(table) == 4 and all(len(row) == 10 and row == sorted(row) for row in table)
    # The last epoch's depth-1 training accuracy (head 1, top-1), the one logged at that epoch's end.
    epochs = _series(_metrics(tmp_path), "train/epoch_depth1_top1")
    assert len(epochs) == 12 and config["train_depth1_top1"] == pytest.approx(epochs[-1])
    print("train d1 per epoch", epochs, "val head1", table[0][0])


def test_resume_from_last_checkpoint(train_script, tmp_path):
    common = [*TINY, "logger=csv", "trainer.log_every_n_steps=1", "callbacks.checkpoint.every_n_train_steps=2",
              "trainer.max_epochs=20"]
    train_script.run(compose_train([*common, "trainer.max_steps=4"], tmp_path))
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 4
    state = torch.load(last, weights_only=False)["state_dict"]
    assert all(k.startswith("heads.") for k in state)  # the frozen verifier is never in a checkpoint
    train_script.run(compose_train([*common, "trainer.max_steps=7", "ckpt_path=last"], tmp_path))
    assert torch.load(last, weights_only=False)["global_step"] == 7
    resumed_steps = [int(r["step"]) for r in _metrics(tmp_path) if r.get("train/loss")]
    assert sorted(resumed_steps) == list(range(7))  # steps 0-3 from the first run, 4-6 resumed, none repeated


def test_training_record_per_epoch_survives_a_resume(train_script, tmp_path):
    """<run>/training.json: one entry per epoch with its wall time, steps, assistant tokens (every training target
    once per epoch) and logged figures; a run resumed for a third epoch keeps the first two as they were written."""
    common = [*TINY, "logger=csv", "trainer.log_every_n_steps=1"]
    export = train_script.run(compose_train([*common, "trainer.max_epochs=2"], tmp_path))
    first = json.loads((tmp_path / "training.json").read_text())
    tokens = json.loads((export / "config.json").read_text())["train_tokens"]
    assert [e["epoch"] for e in first["epochs"]] == [0, 1] and first["max_epochs"] == 2
    for e in first["epochs"]:
        assert e["assistant_tokens"] == tokens and e["steps"] == 3 and e["wall_s"] > 0  # 9 train rows, batch 4
        assert e["assistant_tokens_per_wall_s"] == pytest.approx(tokens / e["wall_s"], rel=0.05)
        assert "train/loss" in e["metrics"] and any(k.startswith("val/") for k in e["metrics"])
        assert 0 < e["train_loss_mean"] < 100
    assert first["global_step"] == 6
    assert first["wall_s_total"] == pytest.approx(sum(e["wall_s"] for e in first["epochs"]))
    train_script.run(compose_train([*common, "trainer.max_epochs=3", "ckpt_path=last"], tmp_path))
    second = json.loads((tmp_path / "training.json").read_text())
    assert second["epochs"][:2] == first["epochs"] and second["epochs"][2]["epoch"] == 2
    assert second["global_step"] == 9 and second["max_epochs"] == 3


def test_validate_only_rewrites_the_export_from_the_checkpoint(train_script, tmp_path):
    """An export trained before a figure was recorded gets it from its checkpoint, with the training record kept."""
    common = [*TINY, "model=eagle", "model.val_steps=3", "logger=csv", "trainer.max_steps=4"]
    export = train_script.run(compose_train(common, tmp_path))
    trained = json.loads((export / "config.json").read_text())
    weights = (export / "model.safetensors").read_bytes()
    from safetensors.torch import load_file

    counts = load_file(str(export / "specdraft" / "target_counts.safetensors"))["counts"]  # every target, once
    assert counts.sum() == trained["train_tokens"] and counts.numel() == 49152
    assert sorted(f.name for f in export.iterdir() if f.is_file()) == ["config.json", "model.safetensors"]
    (export / "specdraft" / "target_counts.safetensors").unlink()  # as a previous train.py wrote it
    older = {k: v for k, v in trained.items() if k != "eagle_topk_accuracy"}  # as a previous train.py wrote it
    older["train_depth1_top1"] = -1.0  # the checkpoint's own record wins over the export's
    (export / "config.json").write_text(json.dumps(older))
    with pytest.raises(UserError, match="validate_only=true validates a trained checkpoint"):
        train_script.run(compose_train([*common, "validate_only=true"], tmp_path))
    train_script.run(compose_train([*common, "validate_only=true", "ckpt_path=last"], tmp_path))
    again = json.loads((export / "config.json").read_text())
    assert again["trained_steps"] == trained["trained_steps"] == 4  # the checkpoint's steps, not the validator's 0
    assert again["train_depth1_top1"] == pytest.approx(trained["train_depth1_top1"])  # kept in the checkpoint
    assert again["val_step_top1"] == pytest.approx(trained["val_step_top1"])
    assert torch.allclose(torch.tensor(again["eagle_topk_accuracy"]), torch.tensor(trained["eagle_topk_accuracy"]))
    assert (export / "model.safetensors").read_bytes() == weights
    assert torch.equal(load_file(str(export / "specdraft" / "target_counts.safetensors"))["counts"], counts)


def test_resume_without_a_checkpoint_is_refused(train_script, tmp_path):
    from runtime.errors import UserError

    with pytest.raises(UserError, match="ckpt_path=last: no checkpoint"):
        train_script.run(compose_train([*TINY, "ckpt_path=last"], tmp_path))


def test_nan_loss_stops_with_a_message(tiny):
    from hydra.utils import instantiate

    from data.datamodule import collate

    cfg = compose_train(["verifier=tiny"])
    module = instantiate(cfg.model, verifier=tiny)
    with torch.no_grad():
        module.heads.blocks[0].layers[0].bias.fill_(float("nan"))
    ids = list(range(100, 120))
    batch = collate([{"input_ids": ids, "loss_mask": [0] * 5 + [1] * 15}], pad_id=0)
    with pytest.raises(NonFiniteLossError, match="model.optimizer.lr"):
        module.training_step(batch, 0)


def test_throughput_logs_count_step_and_wall_time(tiny, monkeypatch):
    """tokens/s over each step's own time, and assistant tokens/s over the epoch's wall time from its first batch
    (the time between steps counts there), on a fake clock."""
    from hydra.utils import instantiate

    import train.base as base
    from data.datamodule import collate

    module = instantiate(compose_train(["verifier=tiny"]).model, verifier=tiny)
    logged: dict[str, list[float]] = {}
    monkeypatch.setattr(module, "log", lambda name, value, **kw: logged.setdefault(name, []).append(value))
    clock = iter([10.0, 12.0, 15.0, 16.0])  # batch 1 runs 10 -> 12; 3 s between; batch 2 runs 15 -> 16
    monkeypatch.setattr(base.time, "perf_counter", lambda: next(clock))
    batch = collate([{"input_ids": list(range(100, 120)), "loss_mask": [0] * 5 + [1] * 15},
                     {"input_ids": list(range(100, 110)), "loss_mask": [0] * 4 + [1] * 6}], pad_id=0)
    module.on_train_epoch_start()
    for i in range(2):
        module.on_train_batch_start(batch, i)
        module.on_train_batch_end(None, batch, i)
    assert logged["train/tokens_per_s"] == [30 / 2, 30 / 1]
    assert logged["train/assistant_tokens_per_s"] == [21 / 2, 21 / 1]
    assert logged["train/wall_assistant_tokens_per_s"] == [21 / 2, 42 / 6]


def test_wandb_offline_run_holds_the_metrics(train_script, tmp_path):
    cfg = compose_train([*TINY, "logger=wandb", "logger.mode=offline", "trainer.max_steps=3",
                         "trainer.log_every_n_steps=1"], tmp_path)
    train_script.run(cfg)
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    proc = subprocess.run(["wandb", "leet", "inspect", "--json", str(run_file)], capture_output=True, text=True,
                          timeout=120)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    history = [r["history"]["item"] for r in records if r.get("type") == "history"]
    logged = set().union(*history)
    assert {"train/loss", "train/head1_loss", "train/head1_top1", "train/tokens_per_s", "lr-AdamW",
            "train/assistant_tokens_per_s", "train/wall_assistant_tokens_per_s",
            "val/loss", "val/head1_top1", "val/head4_top5"} <= logged
    assert sum("train/loss" in h for h in history) == 3
    config_keys = json.dumps([r for r in records if r.get("type") in ("config", "run")])
    assert "verifier_fingerprint" in config_keys


def _train_cli(args: list[str], tmp_path: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *args, f"hydra.run.dir={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_missing_verifier_path_on_the_command_line(tmp_path):
    proc = _train_cli(["verifier=hf", "verifier.path=/nonexistent/llama"], tmp_path)
    assert proc.returncode == 2
    assert "error: verifier.path='/nonexistent/llama'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_smoke_experiment_on_the_default_verifier(smoke_run, smollm2):
    """The recipe test: the real command line, the real default verifier, the export printed last."""
    proc, run = smoke_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last == f"export: {run / 'export'}"
    loaded = load_export(run / "export", smollm2)

    heads, _, config = loaded.net, loaded.lm_head, loaded.config
    assert config["trained_steps"] == 8 and heads.hidden_size == 576
    losses = _series(_metrics(run), "train/loss")
    assert len(losses) == 8 and all(x == x for x in losses)


def test_killed_training_resumes_with_ckpt_path_last(tmp_path):
    """SIGKILL a real training process once it has checkpointed, then rerun with ckpt_path=last."""
    import signal
    import time

    args = [*TINY, "logger=csv", "trainer.max_epochs=1000", "callbacks.checkpoint.every_n_train_steps=3"]
    proc = subprocess.Popen([sys.executable, "train.py", *args, "trainer.max_steps=100000",
                             f"hydra.run.dir={tmp_path}"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    last = tmp_path / "checkpoints" / "last.ckpt"
    deadline = time.time() + 240
    while time.time() < deadline and not (last.is_file() and torch.load(last, weights_only=False)["global_step"] >= 6):
        time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = torch.load(last, weights_only=False)["global_step"]  # the file is whole: Lightning saves atomically
    assert killed_at >= 6 and killed_at % 3 == 0
    done = _train_cli([*args, f"trainer.max_steps={killed_at + 2}", "ckpt_path=last"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert torch.load(last, weights_only=False)["global_step"] == killed_at + 2
    assert (tmp_path / "export" / "config.json").is_file()


def test_train_depth1_top1_is_the_last_epochs_tally(tmp_path):
    """DrafterModule.count_depth1 tallies one epoch's batches, reset at each epoch start: with 0 hits in epoch 0
    and 1+2+3 of 3 x 4 positions in epoch 1 the record is 0.5 (a tally never reset would give 0.25)."""
    import functools

    import lightning as L
    from torch.utils.data import DataLoader

    from train.base import DrafterModule

    class Counting(DrafterModule):
        hidden_layers = [-1]

        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))
            self.optimizer_factory = functools.partial(torch.optim.SGD, lr=0.1)
            self.scheduler_factory = None

        def export(self, path):  # DrafterModule's contract; this test exports nothing
            raise AssertionError("not exported here")

        def activation_estimate(self, tokens, hidden, intermediate, width):
            return 0.0, "none"

        def training_step(self, batch, batch_idx):
            self.count_depth1(torch.tensor(float(self.current_epoch * (batch_idx + 1))), torch.tensor(4.0))
            return (self.w**2).sum()

    data = DataLoader([{"attention_mask": torch.ones(3)}] * 3, batch_size=1)
    module = Counting()
    L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, default_root_dir=tmp_path).fit(module, data)
    assert module.train_summary == {"train_depth1_top1": 0.5}


@pytest.mark.parametrize("model", ["medusa", "eagle"])
def test_train_vocab_is_exported_and_the_decoder_drafts_over_it(train_script, tmp_path, model):
    """model.train_vocab=N: the rows are the training split's N most frequent targets, the export records N, and
    the decoder drafts over those rows unless drafter.draft_vocab says otherwise."""
    from safetensors.torch import load_file

    from eval.drafters.build import make_drafter
    from eval.engine.tree import Chain
    from helpers import varied_llama

    varied = ["verifier.seed=1", "+verifier.layer_std=0.3"]  # varied_llama(): its answers are not one token repeated
    cfg = compose_train([*TINY, *varied, f"model={model}", "model.train_vocab=64", "logger=csv",
                         "trainer.max_steps=2"], tmp_path)
    export = train_script.run(cfg)
    tiny = varied_llama()
    config = json.loads((export / "config.json").read_text())
    assert config["train_vocab"] == 64
    counts = load_file(str(export / "specdraft" / "target_counts.safetensors"))["counts"]
    drafter = make_drafter(None, tiny, Chain(), checkpoint=export)
    assert drafter.head_ids.numel() == 64
    # The 64 most frequent targets: every kept count is at least every dropped one.
    kept = torch.zeros_like(counts, dtype=torch.bool).index_fill(0, drafter.head_ids, True)
    assert counts[kept].min() >= counts[~kept].max() and counts[kept].min() > 0
    assert torch.equal(load_export(export, tiny).train_ids, drafter.head_ids)  # what offline scoring ranks over
    assert make_drafter(None, tiny, Chain(), checkpoint=export, draft_vocab=128).head_ids.numel() == 128


@pytest.mark.parametrize("model", ["medusa", "eagle", "eagle3"])
def test_init_from_starts_from_the_exports_weights_and_keeps_its_vocabulary(train_script, tmp_path, model):
    """init_from=<export>: training starts from the export's weights (with lr=0 the new export's weights are the
    old one's, bit for bit; without init_from they are not), and the vocabulary it chose on its own data (Medusa /
    EAGLE-1 train_vocab rows, EAGLE-3 draft vocabulary) is kept on new data whose own choice differs."""
    from safetensors.torch import load_file

    from helpers import varied_llama

    varied = ["verifier.seed=1", "+verifier.layer_std=0.3"]
    vocab = "model.draft_vocab_size=64" if model == "eagle3" else "model.train_vocab=64"
    extra = ["model.ttt_steps=2", "model.val_steps=2", "model.aux_layer_ids=[0,1]"] if model == "eagle3" else []
    base = [TINY[0], *TINY[2:], *varied, f"model={model}", "logger=csv", *extra]
    first = train_script.run(compose_train([*base, "data.limit=12", vocab, "trainer.max_steps=2"], tmp_path / "a"))
    new_data = [*base, "data.limit=4", "trainer.max_steps=1", "model.optimizer.lr=0.0", "model.warmup_ratio=0.0"]
    shape = [vocab] if model == "eagle3" else []  # EAGLE-3's draft vocabulary size is a shape: given as the export's
    warm = train_script.run(compose_train([*new_data, *shape, f"init_from={first}"], tmp_path / "b"))
    cold = train_script.run(compose_train([*new_data, vocab], tmp_path / "c"))

    weights = {name: load_file(str(path / "model.safetensors")) for name, path in
               (("first", first), ("warm", warm), ("cold", cold))}
    assert weights["warm"].keys() == weights["first"].keys()
    assert all(torch.equal(weights["warm"][k], weights["first"][k]) for k in weights["first"])
    assert not all(torch.equal(weights["cold"][k], weights["first"][k]) for k in weights["first"])

    tiny = varied_llama()
    runs = (("first", first), ("warm", warm), ("cold", cold))
    if model == "eagle3":
        rows = {name: load_export(path, tiny).net.t2d for name, path in runs}
    else:
        rows = {name: load_export(path, tiny).train_ids for name, path in runs}
        assert json.loads((warm / "config.json").read_text())["train_vocab"] == 64
    assert not torch.equal(rows["cold"], rows["first"])  # the new data alone would choose other tokens
    assert torch.equal(rows["warm"], rows["first"])


def test_init_from_refuses_another_kind_or_shape(train_script, tmp_path):
    varied = ["verifier.seed=1", "+verifier.layer_std=0.3"]
    medusa = train_script.run(compose_train([*TINY, *varied, "logger=csv", "trainer.max_steps=1"], tmp_path / "a"))
    with pytest.raises(UserError, match="is a Medusa export but this run trains EAGLE-1.*model=medusa"):
        train_script.run(compose_train([*TINY, *varied, "model=eagle", f"init_from={medusa}"], tmp_path / "b"))
    with pytest.raises(UserError, match="does not match this model's shape.*model.num_layers"):
        train_script.run(compose_train([*TINY, *varied, "model.num_layers=2", f"init_from={medusa}"], tmp_path / "c"))
    with pytest.raises(UserError, match="model.train_vocab unset"):
        train_script.run(compose_train([*TINY, *varied, "model.train_vocab=64", f"init_from={medusa}"],
                                       tmp_path / "d"))


@pytest.mark.parametrize("grouped", [False, True])
def test_resumed_runs_train_on_the_batches_of_an_unbroken_run(train_script, tmp_path, grouped):
    """Three-batch epochs. A run crashes at step 5 (its last checkpoint: step 4, one batch into epoch 1), resumes
    and stops on max_steps=7 (one batch into epoch 2), resumes to step 10 (across an epoch's end): it trains on
    the examples of one unbroken 10-step run, in the same order."""
    common = [*TINY, "logger=csv", "trainer.max_epochs=20", f"data.group_by_length={str(grouped).lower()}",
              "callbacks.checkpoint.every_n_train_steps=2"]

    def batches(path: Path) -> list[tuple[int, int, int, list[str]]]:
        return [(r["step"], r["epoch"], r["batch_idx"], r["rows"])
                for r in map(json.loads, path.read_text().splitlines())]

    unbroken = tmp_path / "unbroken"
    train_script.run(compose_train([*common, "trainer.max_steps=10", *batch_recorder_overrides(unbroken / "b.jsonl")],
                                   unbroken))
    expected = batches(unbroken / "b.jsonl")
    assert [b[0] for b in expected] == list(range(10)) and {b[1] for b in expected} == {0, 1, 2, 3}
    assert len({tuple(b[3]) for b in expected if b[1] == 0}) == 3  # three distinct batches an epoch
    assert [b[3] for b in expected if b[1] == 0] != [b[3] for b in expected if b[1] == 1]  # reshuffled each epoch

    broken = tmp_path / "broken"
    with pytest.raises(RuntimeError, match="crashed at step 5"):
        train_script.run(compose_train([*common, "trainer.max_steps=10", "+callbacks.crash._target_=helpers.CrashAt",
                                        "+callbacks.crash.step=5", *batch_recorder_overrides(broken / "crashed.jsonl")],
                                       broken))
    assert torch.load(broken / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 4
    for steps in (7, 10):
        train_script.run(compose_train([*common, f"trainer.max_steps={steps}", "ckpt_path=last",
                                        *batch_recorder_overrides(broken / f"to{steps}.jsonl")], broken))
    seen = [b for b in batches(broken / "crashed.jsonl") if b[0] < 4]  # step 4 was trained, then lost in the crash
    seen += batches(broken / "to7.jsonl") + batches(broken / "to10.jsonl")
    assert seen == expected
