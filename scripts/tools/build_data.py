"""Build a run's training data (and its hidden-state cache in offline mode) without training: the data steps of
`train.py`, same config, same caches, resumable (kill it and run the same command again).

    # prompts -> answers -> hidden states (+ argmax)
    python -m scripts.tools.build_data experiment=cpu_large model=eagle3
    python -m scripts.tools.build_data data.source=selfgen data.selfgen.num=64 data.limit=null verifier=tiny

Prints the number of conversations and assistant tokens, and the time each step took.
"""

from __future__ import annotations

import time

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig

from runtime.errors import exit_on_user_error


@hydra.main(version_base="1.3", config_path="../../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    exit_on_user_error(lambda: build(cfg))


def build(cfg: DictConfig) -> None:
    verifier = instantiate(cfg.verifier)
    datamodule = instantiate(cfg.data, verifier=verifier)
    t0 = time.perf_counter()
    ds = datamodule.build()
    t1 = time.perf_counter()
    tokens = sum(sum(m) for m in ds["loss_mask"])
    print(f"[build_data] {len(ds)} conversations, {tokens} assistant tokens, {sum(map(len, ds['input_ids']))} "
          f"tokens in all ({t1 - t0:.0f} s, cached steps included)")
    if cfg.data.cache_hidden_states:
        model = instantiate(cfg.model, verifier=verifier)
        datamodule.hidden_layers = model.hidden_layers  # as train.py sets them
        datamodule.verifier_argmax = getattr(model, "uses_verifier_argmax", False)
        # the hidden states, and M_q's argmax where the model reads it (EAGLE-3)
        path = datamodule.build_caches(*datamodule.cache_scope(ds))
        print(f"[build_data] hidden states in {path} ({time.perf_counter() - t1:.0f} s)")


if __name__ == "__main__":
    main()
