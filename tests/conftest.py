"""Shared fixtures: a cache directory for the dequantised default verifier, the tiny verifier, and config composition."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# One cache per checkout: the default verifier is dequantised from its GGUF once (~20 s), then reused.
os.environ.setdefault("SPECDRAFT_CACHE", str(ROOT / ".cache"))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="session")
def cache_dir() -> str:
    return os.environ["SPECDRAFT_CACHE"]


@pytest.fixture(scope="session")
def tiny(cache_dir):
    from models.verifier import build_tiny

    return build_tiny(cache_dir=cache_dir, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm2(cache_dir):
    from models.verifier import load_smollm2

    return load_smollm2(cache_dir=cache_dir, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def one_thread():
    """Small matmuls on this 2-core box are much faster on one thread (thread wake-ups dominate)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def varied_llama(seed: int = 1):
    """A tiny verifier with large random layer weights: unlike the plain tiny one, it does not repeat one token,
    so its greedy output exercises the cache and the masks."""
    from models.verifier import build_tiny

    return build_tiny(cache_dir=os.environ.get("SPECDRAFT_CACHE"), dtype="float32", device="cpu", seed=seed,
                      layer_std=0.3)


@pytest.fixture(scope="session")
def train_script():
    """train.py loaded as a module (the `train/` package shadows it for a plain import)."""
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
