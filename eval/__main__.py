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
from models.errors import user_error


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval")
def main(cfg: DictConfig) -> None:
    try:
        evaluate(cfg)
    except Exception as exc:
        err = user_error(exc)
        if err is None:
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
