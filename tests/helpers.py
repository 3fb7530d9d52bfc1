"""Plain test helpers, imported by test modules (`from helpers import ...`); fixtures live in conftest.py.

Kept out of conftest.py because every test folder may have its own conftest, and `from conftest import` would then
pick whichever was imported first."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import lightning as L

ROOT = Path(__file__).resolve().parents[1]


def varied_llama(seed: int = 1):
    """A tiny verifier with large random layer weights: unlike the plain tiny one, it does not repeat one token,
    so its greedy output exercises the cache and the masks."""
    from models.verifiers.tiny import build_tiny

    return build_tiny(cache_dir=os.environ.get("SPECDRAFT_CACHE"), dtype="float32", device="cpu", seed=seed,
                      layer_std=0.3)


@contextlib.contextmanager
def run_shared(tmp_path_factory, name: str) -> Iterator[Path]:
    """A directory shared by every xdist worker of this test run (one per run; the worker's own without xdist),
    held under a file lock while the body runs: what the first worker builds there, the others find."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = root / "shared" / name
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        yield folder


def compose_train(overrides: list[str], output_dir: Path | None = None):
    """Compose conf/train.yaml as `python train.py <overrides>` would, with hydra's runtime values set."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        cfg.output_dir = str(output_dir) if output_dir else "outputs/test"
        del cfg.hydra
    return cfg


def batch_recorder_overrides(path: Path) -> list[str]:
    """Hydra overrides that add a BatchRecorder writing to `path` (a training run's callbacks come from config)."""
    return ["+callbacks.record._target_=helpers.BatchRecorder", f"+callbacks.record.path={path}"]


class BatchRecorder(L.Callback):
    """A Lightning callback that appends, for every training batch, the step, epoch, batch index and a digest of
    each row's tokens to a JSONL file: which examples a run trained on, in which order."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        rows = [hashlib.sha1(r[m.bool()].numpy().tobytes()).hexdigest()[:12]
                for r, m in zip(batch["input_ids"], batch["attention_mask"])]
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "epoch": trainer.current_epoch, "batch_idx": batch_idx,
                                "rows": rows}) + "\n")


class CrashAt(L.Callback):
    """A Lightning callback that raises at the start of training step `step`: a crash after the checkpoints of the
    steps before it were written."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"CrashAt: crashed at step {self.step}")


class RankRecorder(L.Callback):
    """After every optimizer step, appends this rank's step, loss, assistant-token count and a digest of its trainable
    weights to `<path>.rank<R>.jsonl`: whether the ranks of a DDP run hold the same weights, and its loss curve."""

    def __init__(self, path: str) -> None:
        self.path = path

    start = None  # the trainable weights before the first step, flat

    @staticmethod
    def _flat(pl_module):
        import torch

        return torch.cat([p.detach().float().flatten().cpu() for _, p in sorted(pl_module.named_parameters())
                          if p.requires_grad])

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = self._flat(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """`moved`: the distance of the weights from where training started; `probe`: their projection on a fixed
        random direction. Both compare runs whose weights agree up to float rounding, unlike the digest."""
        import torch

        flat = self._flat(pl_module)
        direction = torch.randn(flat.numel(), generator=torch.Generator().manual_seed(0))
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        with open(f"{self.path}.rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "loss": float(torch.as_tensor(loss).detach()),
                                "tokens": int(batch["loss_mask"].sum()),
                                "weights": hashlib.sha1(flat.numpy().tobytes()).hexdigest(),
                                "moved": float((flat - self.start).norm()),
                                "probe": float(((flat - self.start) * direction).sum())}) + "\n")


def count_reads(monkeypatch) -> collections.Counter:
    """A counter of the calls of each input's loader, through a wrapper around the real one in its module and
    wherever a module imported it by name: the export's config.json (models.exports.io.read_config, behind
    read_info) and weights (load_export), the verifier (models.verifiers.load.load_verifier) and the prompt sets
    (data.prompts.load_conversations). What a run reads once shows as 1."""
    import sys

    import data.prompts
    import models.exports.io
    import models.verifiers.load

    loaders = [(models.exports.io, "read_config"), (models.exports.io, "load_export"),
               (models.verifiers.load, "load_verifier"), (data.prompts, "load_conversations")]
    calls: collections.Counter = collections.Counter()
    for module, name in loaders:
        real = getattr(module, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        for mod in list(sys.modules.values()):  # `from ... import load_verifier` elsewhere (eval.setup, ...)
            if getattr(mod, "__dict__", {}).get(name) is real:
                monkeypatch.setattr(mod, name, counting)
    return calls
