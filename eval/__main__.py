"""Measure speculative decoding with an exported drafter against plain decoding, in one process.

    python -m eval checkpoint=outputs/medusa-smollm2/export prompts=builtin num_prompts=20 max_new_tokens=128
    python -m eval checkpoint=... tree=chain                       # or tree=auto tree.size=24, tree=medusa_choices
    python -m eval checkpoint=... prompts=question.jsonl multi_turn=true

Writes <output_dir>/report.json, profile.json and PNG plots, prints a table, logs to W&B (offline by default).
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from eval.harness import evaluate
from runtime.errors import exit_on_user_error
from runtime.lifetime import stop_on_signals


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval")
def main(cfg: DictConfig) -> None:
    stop_on_signals()  # SIGTERM and SIGHUP as Ctrl-C: a vLLM server the run started goes down with it
    try:
        exit_on_user_error(lambda: evaluate(cfg))
    except KeyboardInterrupt as e:
        print(f"[eval] stopped ({e or 'Ctrl-C'}); any vLLM server it started is down",
              file=sys.stderr, flush=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
