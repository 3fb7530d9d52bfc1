"""What the bench and study scripts share: the verifier they run on (`--verifier`, `--cache-dir`, `--threads`) and
their figures (matplotlib on the file-only Agg backend, imported only when a script plots)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch

from models.verifiers.core import Verifier


def add_verifier_args(ap: argparse.ArgumentParser, threads_help: str | None = None) -> None:
    """--verifier (smollm2, or tiny: a random 2-layer Llama), --cache-dir (default: SPECDRAFT_CACHE) and --threads."""
    ap.add_argument("--verifier", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--cache-dir", default=os.environ.get("SPECDRAFT_CACHE"))
    ap.add_argument("--threads", type=int, default=None, help=threads_help)


def add_theory_args(ap: argparse.ArgumentParser) -> None:
    """The theory studies' (eval/theory.py) --threads (2), --cache-dir (the dequantised verifier's; default:
    SPECDRAFT_CACHE) and --out (outputs/theory, where their figure and JSON go)."""
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", default=None, help="the dequantised verifier cache (default: SPECDRAFT_CACHE)")
    ap.add_argument("--out", type=Path, default=Path("outputs/theory"))


def set_threads(args: argparse.Namespace) -> None:
    """torch's threads from --threads, where it is given."""
    if args.threads:
        torch.set_num_threads(args.threads)


def load_cpu_verifier(args: argparse.Namespace, dtype: str) -> Verifier:
    """The --verifier on the CPU in `dtype`, from --cache-dir."""
    from models.verifiers.embedded import load_smollm2
    from models.verifiers.tiny import build_tiny

    load = load_smollm2 if args.verifier == "smollm2" else build_tiny
    return load(cache_dir=args.cache_dir, dtype=dtype, device="cpu")


def subplots(*args: Any, **kwargs: Any) -> Any:
    """matplotlib's `plt.subplots` on the Agg backend: (figure, axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save_figure(fig: Any, path: str | Path) -> None:
    """Lay the figure out, write it to `path` (120 dpi) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
