"""Every option of every config group composes and resolves; bad keys are refused with a clear message."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from helpers import ROOT, compose_train

# Options that need a value the user must give.
REQUIRED = {"verifier=hf": ["verifier.path=some/model"], "data=sharegpt": ["data.source=conv.json"],
            "data=served": ["data.source=record/"], "experiment=retrain_served": ["data.source=record/"]}


EVAL_GROUPS = {"tree", "drafter", "setting"}  # groups of conf/eval.yaml; every other group belongs to conf/train.yaml


def group_options(eval_groups: bool = False) -> list[str]:
    """`group=option` for every yaml file under conf/<group>/ (recursively), of train.yaml's or eval.yaml's groups."""
    out = []
    for path in sorted((ROOT / "conf").rglob("*.yaml")):
        rel = path.relative_to(ROOT / "conf")
        if rel.parts[:2] == ("model", "optim"):
            continue  # a building block every model file composes at its own level, not a choice of its own
        if len(rel.parts) > 1 and (rel.parts[0] in EVAL_GROUPS) == eval_groups:
            out.append(f"{'/'.join(rel.parts[:-1])}={rel.stem}")
    return out


def test_every_group_has_options():
    groups = {o.split("=")[0] for o in group_options()}
    assert {"verifier", "data", "model", "trainer", "logger", "experiment"} <= groups


@pytest.mark.parametrize("override", group_options())
def test_compose_every_option(override, tmp_path):
    cfg = compose_train([override, *REQUIRED.get(override, [])], tmp_path)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    for key in ("verifier", "data", "model", "trainer", "callbacks", "seed"):
        assert key in resolved
    from models.families import FAMILIES, resolve

    # a family's training module, or a recipe built on one (experiment=opd: train.opd.OnPolicyModule)
    trained = tuple(resolve(f.training) for f in FAMILIES.values() if f.training)
    assert issubclass(resolve(resolved["model"]["_target_"]), trained)


@pytest.mark.parametrize("override", group_options(eval_groups=True))
def test_compose_every_eval_option(override):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="eval", overrides=[override, "checkpoint=some/export", "output_dir=out"])
    resolved = OmegaConf.to_container(cfg, resolve=True)
    policy = {"chain": "Chain", "auto": "AutoTree", "dynamic": "DynamicTree", "medusa_choices": "from_medusa_choices"}
    group, option = override.split("=")
    if group == "tree":
        assert resolved["tree"]["_target_"].rsplit(".", 1)[1] == policy[option]
    elif group == "setting":  # a named setting over eval.yaml's keys (conf/setting/): every key it sets is applied
        named = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "setting" / f"{option}.yaml"))
        assert named and all(resolved[k] == v for k, v in named.items())
    else:  # every drafter is a factory partial in eval.drafters.build; medusa/eagle/eagle3 name the export kind
        assert resolved["drafter"]["_target_"].rsplit(".", 1)[1] in {option, "export"}
        assert resolved["drafter"]["_partial_"] is True
    assert {"checkpoint", "prompts", "num_prompts", "max_new_tokens", "dtype", "threads"} <= set(resolved)


def test_experiments_pin_names(tmp_path):
    assert compose_train(["experiment=smoke"], tmp_path).name == "smoke"
    # one directory per drafter, so the recipe's Medusa and EAGLE runs do not resume each other's checkpoints
    assert compose_train(["experiment=cpu_full"], tmp_path).name == "medusa-cpu_full-smollm2"
    assert compose_train(["model=eagle3", "experiment=cpu_full"], tmp_path).name == "eagle3-cpu_full-smollm2"
    assert compose_train([], tmp_path).name == "medusa-smollm2"


def test_unknown_key_is_refused(tmp_path):
    with pytest.raises(ConfigCompositionException, match="decya"):
        compose_train(["model.decya=0.5"], tmp_path)


def test_unknown_key_on_the_command_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "train.py", "model.decya=0.5", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "model.decya" in proc.stderr and "Traceback" not in proc.stderr


def test_the_parallel_drafters_recipes_share_eagle3s_budget(tmp_path):
    """experiment=ship_peagle and ship_dflash train on what ship_eagle3 trains on: the shipped set, the same cache,
    batch and epochs (the side-by-side of the parallel drafters compares them on one budget)."""
    eagle3 = compose_train(["experiment=ship_eagle3"], tmp_path)
    for name, target in (("ship_peagle", "train.peagle.PEagleModule"), ("ship_dflash", "train.dflash.DFlashModule")):
        cfg = compose_train([f"experiment={name}"], tmp_path)
        assert cfg.model._target_ == target and cfg.data.mode == "shipped"
        assert cfg.data.shipped == eagle3.data.shipped and cfg.data.cache_hidden_states
        assert cfg.data.batch_size == eagle3.data.batch_size and cfg.trainer.max_epochs == eagle3.trainer.max_epochs


@pytest.mark.parametrize("name", ["ship_medusa", "ship_eagle3", "ship_dflash"])
def test_each_shipped_recipe_has_a_gpu_twin_that_changes_only_the_machine(name, tmp_path):
    """experiment=<recipe>_gpu is the shipped drafter's recipe for one GPU: the same data, drafter and epochs; only
    the trainer, the batch, the loader and the hidden-state cache change."""
    from omegaconf import OmegaConf

    cpu = OmegaConf.to_container(compose_train([f"experiment={name}"], tmp_path))
    gpu = OmegaConf.to_container(compose_train([f"experiment={name}_gpu"], tmp_path))
    assert gpu["trainer"]["accelerator"] == "gpu" and gpu["trainer"]["precision"] == "bf16-mixed"
    assert gpu["model"] == cpu["model"] and gpu["trainer"]["max_epochs"] == cpu["trainer"]["max_epochs"]
    assert gpu["data"]["batch_size"] == 4 * cpu["data"]["batch_size"] and not gpu["data"]["cache_hidden_states"]
    machine = {"batch_size", "cache_hidden_states", "num_workers"}
    assert {k: v for k, v in gpu["data"].items() if k not in machine} == \
        {k: v for k, v in cpu["data"].items() if k not in machine}


@pytest.mark.parametrize("module", ["scripts.tools.build_data", "scripts.tools.heldout_accuracy",
                                    "scripts.tools.ship_data", "eval"])
def test_every_hydra_command_finds_its_config(module):
    """Each Hydra command line composes its config from conf/ (`--cfg job` prints it and runs nothing): a command
    moved to another folder with its config_path left behind fails here, not at a user's first run."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", module, "--cfg", "job"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "cache_dir:" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.parametrize("name, export", [("ship_eagle3_long", "eagle3-smollm2"),
                                          ("ship_medusa_long", "medusa-smollm2")])
def test_the_long_input_fine_tunes_start_from_the_shipped_export_with_its_shape(name, export, tmp_path):
    """experiment=ship_<family>_long fine-tunes the shipped export (init_from) on the long-input part beside a
    replay sample of the short-prompt set: its drafter's shape is the export's recipe's (init_from refuses another),
    and both recipes read one hidden-state cache (the same sets, rows and cached layers)."""
    from omegaconf import OmegaConf

    cfg = compose_train([f"experiment={name}"], tmp_path)
    assert (ROOT / str(cfg.init_from) / "config.json").is_file() and str(cfg.init_from).endswith(export)
    assert list(cfg.data.shipped) == ["smollm2-selfdistill-v1@1200", "smollm2-longtasks-v1"]
    recipe = OmegaConf.load(ROOT / "pretrained" / export / "specdraft" / "recipe.yaml")
    shape = {"draft_vocab_size", "num_layers", "train_vocab", "num_heads", "kind"}
    assert {k: v for k, v in cfg.model.items() if k in shape} == {k: v for k, v in recipe.model.items() if k in shape}
    # EAGLE-3 unrolls further than the shipped run did (a schedule, not a shape): its deeper drafts get trained
    assert cfg.model.get("ttt_steps", 1) >= recipe.model.get("ttt_steps", 1)
    assert cfg.model.optimizer.lr < recipe.model.optimizer.lr and cfg.data.cache_hidden_states
    other = compose_train([f"experiment={ {'ship_eagle3_long': 'ship_medusa_long'}.get(name, 'ship_eagle3_long') }"],
                          tmp_path)
    assert other.data.shipped == cfg.data.shipped


def test_the_gemma3_drafter_recipe_trains_on_the_set_its_data_recipe_builds(tmp_path):
    """experiment=ship_eagle3_gemma3 reads the set experiment=ship_data_gemma3 writes (under verifier=gemma3: its
    name follows the verifier), a base model's set: no self-generated user turns, no second turns, the real vLLM."""
    data = compose_train(["verifier=gemma3", "experiment=ship_data_gemma3"], tmp_path)
    drafter = compose_train(["verifier=gemma3", "experiment=ship_eagle3_gemma3"], tmp_path)
    assert data.ship.name == drafter.data.shipped == "gemma3-selfdistill-v1"
    assert data.verifier.rendering == "plain" and data.ship.second_turns == 0 and data.data.generator == "vllm"
    assert "selfgen" not in list(data.data.source) and set(data.ship.decontaminate) == {"builtin", "registry3"}
    assert drafter.model.kind == "eagle3" and drafter.data.cache_hidden_states
