"""What a resume (`ckpt_path=last`, or a checkpoint of a run) may change, and how to resume an interrupted run.

A resumed run trains on the batches an unbroken run would have seen, so a resume that changes the drafter, the
verifier, the rows, their order or the batches is another run under this one's name: `check_resume` refuses it
before anything of the run is written, comparing the settings with the recipe the run recorded at its start
(`<run>/.hydra/config.yaml` and the config groups chosen, in `hydra.yaml`). `SHAPES_THE_RUN` lists what is compared,
`MAY_CHANGE` the exceptions; every other key (trainer.max_epochs / max_steps to extend a run, trainer.precision,
gradient clipping, the logger, callbacks, the name) may change on resume.
"""

from __future__ import annotations

import inspect
import shlex
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from runtime.errors import UserError
from train.preflight import RUN_CONFIG

# The config groups whose choice names what is trained: model=medusa vs model=eagle is another drafter.
GROUPS = ("model", "verifier", "data")

# Keys (or whole subtrees) that shape the run: compared on resume, in this order, the first difference named.
SHAPES_THE_RUN = (
    "seed",                             # the data split, each epoch's order, sampling
    "model",                            # the drafter, its objective and optimizer
    "verifier",                         # M_q: its hidden states and q are the inputs and targets
    "data",                             # the rows (sources, limits, answers, lengths) and the batches
    "trainer.accumulate_grad_batches",  # the batches that make one optimizer step
    "trainer.devices",                  # under DDP each process takes its own rows: the global batch
    "trainer.num_nodes",
    "trainer.limit_train_batches",      # where an epoch ends, so the next epoch's order
    "trainer.overfit_batches",
)

# Inside those, what may change on resume: how the run is fed or where it computes, not what it trains on.
MAY_CHANGE = (
    "model.optimizer.lr",               # the divergence guard's advice: lower it and resume from last-good.ckpt
    "model.optimizer.adamw_lr",         # ... and under Muon (model/optim=muon) AdamW's, for the rest
    "model.val_steps",                  # what validation measures, not what training sees
    "verifier.device",
    "verifier.cache_dir",
    "data.cache_dir",                   # the same settings rebuild the same data in another place
    "data.num_workers",
    "data.cache_hidden_states",         # the same batches, their hidden states read from disk
    "data.cache_shard_rows",
)

_UNSET = "(not set)"


def recorded_run(cfg: DictConfig, ckpt_path: str | None) -> Path | None:
    """The run directory whose recipe a resume from `ckpt_path` continues: this run's for `ckpt_path=last`, else the
    run that holds the checkpoint (`<run>/checkpoints/<file>.ckpt`); None when no recorded recipe is found."""
    if ckpt_path is None:
        return None
    if cfg.ckpt_path == "last":
        run = Path(cfg.output_dir).expanduser()
    else:
        run = Path(ckpt_path).expanduser().resolve().parent.parent
    return run if (run / RUN_CONFIG / "config.yaml").is_file() else None


# Hydra targets that moved since a run may have been recorded: the same code under its new name, so a run recorded
# before the move resumes (models/verifier.py became the models/verifiers/ folder; drafter factories moved home).
MOVED_TARGETS = {
    "models.verifier.load_smollm2": "models.verifiers.embedded.load_smollm2",
    "models.verifier.load_gemma3": "models.verifiers.embedded.load_gemma3",
    "models.verifier.load_hf": "models.verifiers.hf.load_hf",
    "models.verifier.build_tiny": "models.verifiers.tiny.build_tiny",
}


def _value(node: DictConfig, key: str) -> Any:
    """A leaf's value, resolved where it can be (a recorded recipe's `${hydra:...}` cannot be: its text then)."""
    try:
        value = node[key]
    except Exception:  # an interpolation that needs the recording run's Hydra state
        return str(node._get_node(key)._value())  # type: ignore[union-attr]
    if isinstance(value, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(value, resolve=True)
        except Exception:
            return OmegaConf.to_container(value, resolve=False)
    return value


def _leaves(node: Any, prefix: str) -> dict[str, Any]:
    """Every leaf under `prefix` as {dotted key: value}; lists are leaves."""
    out: dict[str, Any] = {}
    if not isinstance(node, DictConfig):
        return out
    for key in node.keys():
        child = node._get_node(key)
        dotted = f"{prefix}.{key}"
        if isinstance(child, DictConfig) and not child._is_interpolation():
            out |= _leaves(child, dotted)
        else:
            out[dotted] = _value(node, str(key))
    return out


def _settings(cfg: DictConfig) -> dict[str, Any]:
    """{dotted key: value} of what SHAPES_THE_RUN names, less MAY_CHANGE."""
    out: dict[str, Any] = {}
    for key in SHAPES_THE_RUN:
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        if not isinstance(parent, DictConfig) or leaf not in parent:
            continue
        if isinstance(parent._get_node(leaf), DictConfig):
            out |= _leaves(parent[leaf], key)
        else:
            out[key] = _value(parent, leaf)
    out = {k: MOVED_TARGETS.get(v, v) if k.endswith("._target_") else v for k, v in out.items()}
    return {k: v for k, v in out.items() if not any(k == m or k.startswith(m + ".") for m in MAY_CHANGE)}


def _follows(cfg: DictConfig, key: str) -> str | None:
    """The interpolation a key is set to (`data.seed: ${seed}`), or None: such a key follows the one it names."""
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key, throw_on_resolution_failure=False) if parent_key else cfg
    if not isinstance(parent, DictConfig) or leaf not in parent:
        return None
    node = parent._get_node(leaf)
    return str(node._value()) if node is not None and node._is_interpolation() else None  # type: ignore[union-attr]


def _trainer_default(key: str) -> Any:
    """Lightning's own default for a trainer key a recipe does not set (e.g. accumulate_grad_batches: 1)."""
    import lightning as L

    param = inspect.signature(L.Trainer.__init__).parameters.get(key.removeprefix("trainer."))
    return _UNSET if param is None or param.default is inspect.Parameter.empty else param.default


def _current_choices() -> dict[str, str]:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    return {k: v for k, v in HydraConfig.get().runtime.choices.items() if k in GROUPS}


def check_resume(cfg: DictConfig, ckpt_path: str | None) -> None:
    """Refuse a resume whose settings would train another run than the one recorded: one message naming the first
    key that differs, the value the run was trained with, and the two ways out. Call it before anything of the run
    is written (its `.hydra/` recipe included)."""
    run = recorded_run(cfg, ckpt_path)
    if run is None:
        return
    old_cfg = OmegaConf.load(run / RUN_CONFIG / "config.yaml")
    assert isinstance(old_cfg, DictConfig)
    differences: list[tuple[str, Any, Any]] = []
    hydra_file = run / RUN_CONFIG / "hydra.yaml"
    old_choices = OmegaConf.select(OmegaConf.load(hydra_file), "hydra.runtime.choices") if hydra_file.is_file() \
        else None
    now_choices = _current_choices()
    for group in GROUPS:
        old, now = (old_choices or {}).get(group), now_choices.get(group)
        if old is not None and now is not None and old != now:
            differences.append((group, old, now))
    if not differences:  # the same groups: compare their settings, key by key
        old, now = _settings(old_cfg), _settings(cfg)
        for key in dict.fromkeys([*now, *old]):
            if key not in old and key in now and not key.startswith("trainer."):
                continue  # a key this train.py has and the recording one had not: its default is what that run had
            was = old.get(key, _trainer_default(key) if key.startswith("trainer.") else _UNSET)
            is_ = now.get(key, _trainer_default(key) if key.startswith("trainer.") else _UNSET)
            if was != is_ and not (_follows(cfg, key) and _follows(cfg, key) == _follows(old_cfg, key)):
                differences.append((key, was, is_))  # (a key that follows another, as before, is that one's)
    if not differences:
        return
    key, was, is_ = differences[0]
    more = [k for k, _, _ in differences[1:]]
    also = f" ({len(more)} more differ: {', '.join(more[:4])}{' ...' if len(more) > 4 else ''})" if more else ""
    now = f"{key}={is_}" if is_ != _UNSET else f"no {key}"
    trained = f"with {key}={was}" if was != _UNSET else f"without {key}"
    back = f"{key}={was}" if was != _UNSET else f"without {key}"
    raise UserError(f"{now}: run {run.name!r} was trained {trained}{also}, and a resume continues it as trained "
                    f"(the same drafter, data and batches). Resume with {back}, or start a new run without "
                    f"ckpt_path: another name=..., or overwrite=true to replace {run.name!r}.")


def resume_command(cfg: DictConfig) -> str:
    """`python train.py <this run's overrides> ckpt_path=last`: the command that resumes this run."""
    from hydra.core.hydra_config import HydraConfig

    args: list[str] = []
    if HydraConfig.initialized():
        hydra_cfg = HydraConfig.get()
        args = [o for o in hydra_cfg.overrides.task if not o.lstrip("+~").startswith(("ckpt_path=", "overwrite="))]
        args += [o for o in hydra_cfg.overrides.hydra if o.startswith("hydra.run.dir=")]
    else:
        args = [f"name={cfg.name}"]
    return shlex.join(["python", "train.py", *args, "ckpt_path=last"])
