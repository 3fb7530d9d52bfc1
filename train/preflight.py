"""What train.py does before any work starts, in this order: check the numeric settings (no lock, no file, nothing
loaded), then, holding the run directory's lock, refuse to start a new run over a finished one of the same `name`
and record the run's config in `<run>/.hydra/`.

Hydra would write `.hydra/config.yaml`, `hydra.yaml` and `overrides.yaml` at start-up, before train.py runs, so a
second run with a running run's `name` replaced its recipe (what `scripts.tools.convert ship --recipe` ships) before the
lock refused it. conf/train.yaml sets `hydra.output_subdir: null`, and `record_run_config` writes the same files
once the lock is held.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from runtime.errors import UserError

RUN_CONFIG = ".hydra"


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _betas(v: Any) -> bool:
    return isinstance(v, (ListConfig, list, tuple)) and len(v) == 2 and all(_num(b) and 0 <= b < 1 for b in v)


def _whole(least: int, null: bool = False) -> Callable[[Any], bool]:
    """Valid when a whole number >= `least` (or None, with `null`)."""
    return lambda v: (null and v is None) or (_int(v) and v >= least)


def _non_negative(v: Any) -> bool:
    return _num(v) and v >= 0


MUON_LR_FNS = ("match_rms_adamw", "original")  # torch.optim.Muon's adjust_lr_fn

# key, valid when, what to give, an example value. A key the config does not have is skipped.
RULES: list[tuple[str, Callable[[Any], bool], str, str]] = [
    # 0 is allowed: the weights stay as they start (a warm start re-validated on new data, as tests do)
    ("model.optimizer.lr", _non_negative, "a learning rate of 0 or more", "1e-3"),
    ("model.optimizer.weight_decay", _non_negative, "a weight decay of 0 or more", "0.0"),
    ("model.optimizer.betas", _betas, "two moment decays, each in [0, 1) (1 or more never forgets a "
     "gradient)", "[0.9,0.95]"),
    # Muon's (model/optim=muon, train/muon.py): torch.optim.Muon / AdamW would refuse them only after the data step
    ("model.optimizer.adamw_lr", _non_negative, "AdamW's learning rate, 0 or more", "1e-3"),
    ("model.optimizer.adamw_weight_decay", _non_negative, "AdamW's weight decay, 0 or more", "0.0"),
    ("model.optimizer.adjust_lr_fn", lambda v: v is None or v in MUON_LR_FNS,
     f"one of {', '.join(MUON_LR_FNS)} (how Muon scales its update), or null (torch's original)", "match_rms_adamw"),
    ("model.optimizer.momentum", lambda v: _num(v) and 0 <= v < 1, "a share of the last update kept, in [0, 1) (1 "
     "or more never forgets a gradient and diverges)", "0.95"),
    ("model.optimizer.ns_steps", _whole(1), "a whole number of Newton-Schulz iterations >= 1", "5"),
    ("model.warmup_ratio", lambda v: _num(v) and 0 <= v <= 1, "a fraction of the steps in [0, 1]", "0.05"),
    ("data.batch_size", _whole(1), "a whole number of sequences >= 1", "8"),
    ("data.gen_batch_size", _whole(1), "a whole number of prompts >= 1", "32"),
    ("data.max_new_tokens", _whole(1), "a whole number of tokens >= 1", "128"),
    ("data.max_length", _whole(2), "a whole number of tokens >= 2", "1024"),
    ("data.limit", _whole(1, null=True), "a whole number of prompts >= 1, or null", "null"),
    ("data.val_fraction", lambda v: _num(v) and 0 <= v < 1, "a fraction in [0, 1)", "0.05"),
    ("data.num_workers", _whole(0), "a whole number of loader processes >= 0", "0"),
    ("data.shard_size", _whole(1), "a whole number of prompts >= 1", "256"),
    ("trainer.max_epochs", lambda v: v is None or (_int(v) and (v >= 1 or v == -1)),
     "a whole number of epochs >= 1 (-1: until trainer.max_steps)", "2"),
    ("trainer.max_steps", lambda v: _int(v) and (v >= 1 or v == -1), "a whole number of steps >= 1, or -1 (no limit)",
     "-1"),
    ("trainer.accumulate_grad_batches", _whole(1), "a whole number of batches >= 1", "1"),
    ("trainer.gradient_clip_val", lambda v: v is None or _non_negative(v), "a norm of 0 or more, or null", "1.0"),
    ("trainer.log_every_n_steps", _whole(1), "a whole number of steps >= 1", "5"),
    ("callbacks.checkpoint.every_n_train_steps", _whole(0, null=True),
     "a whole number of steps >= 1 (0 or null: only the last)", "50"),
    # drafter settings that leave nothing to train (a loss of 0 and an untrained export): each key means the same in
    # every family that has it
    ("model.num_layers", _whole(1), "a whole number of draft layers >= 1", "1"),
    ("model.num_heads", _whole(1), "a whole number of heads >= 1", "4"),
    ("model.block_size", _whole(2), "a whole number >= 2 (the root token and its drafts)", "8"),
    ("model.num_anchors", _whole(1, null=True),
     "a whole number of blocks per sequence >= 1 (null: every anchor)", "64"),
    ("model.max_anchors", _whole(1, null=True),
     "a whole number of chains per sequence >= 1 (null: every anchor)", "256"),
    ("model.parallel_tokens", _whole(1), "a whole number of drafts per forward >= 1", "4"),
    ("model.ttt_steps", _whole(1), "a whole number of training steps unrolled >= 1", "1"),
    ("model.val_steps", _whole(1), "a whole number of steps validation unrolls >= 1", "5"),
    ("model.draft_vocab_size", _whole(2, null=True),
     "a whole number of draft tokens >= 2, or null (the verifier's vocabulary)", "8192"),
    ("model.markov_rank", _whole(1), "a rank >= 1", "256"),
]

# Keys Hydra's instantiate handles itself, never passed to the target as arguments.
_HYDRA_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}


def check_settings(cfg: DictConfig) -> None:
    """Refuse numeric settings that cannot train, before the verifier loads or any data is built: one message
    naming the key, the value seen and a value that works."""
    for key, ok, what, example in RULES:
        node, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(cfg, node)
        if not isinstance(parent, DictConfig) or leaf not in parent:
            continue
        value = parent[leaf]
        if not ok(value):
            shown = repr(value) if isinstance(value, str) else value
            raise UserError(f"{key}={shown}: give {what}, e.g. {key}={example}.")
    if cfg.trainer.get("max_epochs") == -1 and cfg.trainer.get("max_steps", -1) == -1:
        raise UserError("trainer.max_epochs=-1 with trainer.max_steps=-1 never stops: give trainer.max_epochs >= 1 "
                        "or trainer.max_steps >= 1.")
    if cfg.get("validate_only") and cfg.get("ckpt_path") is None:
        raise UserError("validate_only=true validates a trained checkpoint: add ckpt_path=last (this run's) or "
                        "ckpt_path=<file.ckpt>.")
    for group in ("model", "data", "verifier"):
        check_keys(cfg, group)


def check_keys(cfg: DictConfig, group: str) -> None:
    """Refuse a key the group's `_target_` does not take (`+model.loss=tv` for Medusa), before the verifier loads:
    instantiate would stop on a TypeError. The message names the key, the family and the keys it takes."""
    from hydra.utils import get_object

    node = cfg.get(group)
    if not isinstance(node, DictConfig) or "_target_" not in node:
        return
    try:
        target = get_object(node._target_)
        params = inspect.signature(target).parameters
    except Exception:  # an unknown target is instantiate's own message; a C callable has no signature
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = [k for k in node.keys() if k not in _HYDRA_KEYS and k not in params]
    if not unknown:
        return
    from hydra.core.hydra_config import HydraConfig

    choice = HydraConfig.get().runtime.choices.get(group) if HydraConfig.initialized() else None
    family = f"{group}={choice}" if choice else getattr(target, "__name__", str(node._target_))
    takes = [k for k, p in params.items() if k not in ("self", "verifier", "net") and p.kind is p.POSITIONAL_OR_KEYWORD]
    raise UserError(f"{group}.{unknown[0]}: {family} takes no such key. Remove it from the command line (and from "
                    f"any experiment= file); {family} takes {', '.join(takes)}.")


def earlier_run(cfg: DictConfig) -> list[Path]:
    """What a run with this config's output locations would replace: its checkpoints, export and training record."""
    found: list[Path] = []
    callbacks = cfg.get("callbacks") or {}
    if callbacks.get("checkpoint") is not None:
        ckpts = Path(callbacks.checkpoint.dirpath).expanduser()
        found += sorted(p for p in ckpts.glob("*.ckpt") if p.is_file()) if ckpts.is_dir() else []
    if callbacks.get("export") is not None:
        export = Path(callbacks.export.dirpath).expanduser()
        found += [export] if export.is_dir() and any(export.iterdir()) else []
    if callbacks.get("training_record") is not None:
        record = Path(callbacks.training_record.path).expanduser()
        found += [record] if record.is_file() else []
    return found


def check_reused_name(cfg: DictConfig) -> None:
    """A new run (no ckpt_path) in a directory an earlier run left its checkpoints, export or training record in
    is refused, unless `overwrite=true`; that removes the earlier run's checkpoints and training record first (so
    none of it is resumed or merged into this run's), and keeps its export until this run exports over it."""
    if cfg.get("ckpt_path") is not None:
        return  # resuming: the earlier run is this one
    found = earlier_run(cfg)
    if not found:
        return
    if not cfg.get("overwrite"):
        names = ", ".join(str(p) for p in found[:4]) + (" ..." if len(found) > 4 else "")
        raise UserError(f"{str(Path(cfg.output_dir))!r} holds an earlier run named {cfg.name!r} ({names}). Resume it "
                        f"with ckpt_path=last, give this run another name (name=...), or replace it with "
                        f"overwrite=true.")
    for path in found:
        if path.suffix in (".ckpt", ".json") and path.is_file():
            path.unlink()


def record_run_config(cfg: DictConfig) -> None:
    """Write `<output_dir>/.hydra/{config,hydra,overrides}.yaml` as Hydra writes them, atomically each. Called with
    the run's lock held. Nothing is written outside a Hydra run, or when a `hydra.output_subdir` was given (then
    Hydra wrote them itself)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.instance().cfg
    if hydra_cfg.hydra.get("output_subdir") is not None:
        return
    out = Path(cfg.output_dir).expanduser() / RUN_CONFIG
    out.mkdir(parents=True, exist_ok=True)
    for name, node in (("config.yaml", cfg), ("hydra.yaml", hydra_cfg),
                       ("overrides.yaml", hydra_cfg.hydra.overrides.task)):
        tmp = out / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(OmegaConf.to_yaml(node), encoding="utf-8")
        os.replace(tmp, out / name)

