"""Replay a rollout's held-out rounds through several exports (docs/results/opd.md): how often each export's top-1
at the replayed positions is M_q's, and the on-policy loss there, as experiment=opd's validation computes them.

    python -m scripts.studies.opd_replay outputs/opd/rollout-pool pretrained/eagle3-smollm2 \
        outputs/opd-eagle3/export outputs/opd-eagle3-control/export

The rows are the rollout's validation split of experiment=opd (data/onpolicy.py: val_fraction 0.05, seed 0), the
verifier the one the rollout was made with (bfloat16, as training runs it). Step j replays the j-th draft of each
recorded round on the drafter's own earlier drafts (train/opd.py), so its top-1 is the recorded round's alpha at
step 0 and, past a rejection, agreement with M_q on the drafter's own wrong path.
"""

from __future__ import annotations

import argparse

import torch

from data.onpolicy import OnPolicyDataModule
from models.exports.io import export_verifier, load_export, read_config
from models.verifiers.load import load_verifier
from train.opd import OnPolicyModule


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rollout")
    ap.add_argument("exports", nargs="+")
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args()
    first = read_config(args.exports[0])
    verifier = load_verifier(export_verifier(first), args.dtype, "cpu", args.cache_dir)
    dm = OnPolicyDataModule(verifier, rollout=args.rollout, val_fraction=args.val_fraction, seed=args.seed)
    dm.setup()
    batches = list(dm.val_dataloader())
    for path in args.exports:
        export = load_export(path, verifier)
        module = OnPolicyModule(verifier, optimizer=torch.optim.AdamW, kind=export.kind,
                                draft_vocab_size=export.config.get("draft_vocab_size"),
                                aux_layer_ids=export.config.get("eagle_aux_hidden_state_layer_ids"),
                                fc_norm=bool(export.config.get("fc_norm")),
                                norm_output=bool(export.config.get("norm_output")))
        module.warm_start(export, path)
        module.eval()
        hits, counts, loss = None, None, 0.0
        with torch.no_grad():
            for batch in batches:
                out = module.on_policy(batch, train=False)
                h, c = torch.stack(out["hits"]), torch.stack(out["counts"])
                hits, counts = (h, c) if hits is None else (hits + h, counts + c)
                loss += float(out["loss"]) / len(batches)
        assert hits is not None and counts is not None
        top1 = " ".join(f"{float(a):.3f}" for a in hits / counts)
        print(f"{path}: {int(counts[0])} replayed rounds, top-1 by step {top1}, on-policy loss {loss:.3f}")


if __name__ == "__main__":
    main()
