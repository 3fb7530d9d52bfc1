"""Plain test helpers, imported by test modules (`from helpers import ...`); fixtures live in conftest.py.

Kept out of conftest.py because every test folder may have its own conftest, and `from conftest import` would then
pick whichever was imported first."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def varied_llama(seed: int = 1):
    """A tiny verifier with large random layer weights: unlike the plain tiny one, it does not repeat one token,
    so its greedy output exercises the cache and the masks."""
    from models.verifier import build_tiny

    return build_tiny(cache_dir=os.environ.get("SPECDRAFT_CACHE"), dtype="float32", device="cpu", seed=seed,
                      layer_std=0.3)


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
