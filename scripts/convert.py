"""Convert between this project's exports and the public reference layouts (models/reference_formats.py).

    # export -> reference (Medusa repository: medusa_lm_head.safetensors|.pt; EAGLE-1: pytorch_model.bin;
    # EAGLE-3: SpecForge's model.safetensors with d2t/t2d)
    python -m scripts.convert to-reference outputs/<run>/export ref/ [--weights medusa_lm_head.pt]
    # reference (or an older export) -> export, for the verifier it was trained on
    python -m scripts.convert from-reference ref/ outputs/<run>/export [--verifier smollm2|<hub id or dir>]
    # an EAGLE-3 export served where the verifier lives elsewhere, or drafting another number of tokens in vLLM
    python -m scripts.convert from-reference outputs/<run>/export served/ --served-verifier /models/my-llama \
        --speculative-tokens 5

`python -m eval checkpoint=<reference dir> verifier_path=<verifier>` reads the reference layouts directly too.
"""

from __future__ import annotations

import argparse
import sys

from models.errors import UserError
from models.export import export_verifier, from_reference, read_config, to_reference
from models.verifier import load_verifier


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    to = sub.add_parser("to-reference", help="this project's export -> the reference layout of its kind")
    to.add_argument("export_dir")
    to.add_argument("out_dir")
    to.add_argument("--weights", default=None, help="weights file name (e.g. medusa_lm_head.pt, model.safetensors)")
    fr = sub.add_parser("from-reference", help="a reference checkpoint -> this project's export")
    fr.add_argument("ref_dir")
    fr.add_argument("out_dir")
    fr.add_argument("--verifier", default=None, help="smollm2, a Hub id or a local HF directory (default: the one the "
                                                     "file names in base_model_name_or_path / verifier_path)")
    fr.add_argument("--cache-dir", default=None)
    fr.add_argument("--served-verifier", default=None,
                    help="EAGLE-3: the verifier path or Hub id vLLM loads when it serves the export as it is "
                         "(speculators_config.verifier.name_or_path; default: where this machine has the verifier)")
    fr.add_argument("--speculative-tokens", type=int, default=None,
                    help="EAGLE-3: tokens vLLM drafts per step when it serves the export as it is (default: the "
                         "export's own, else 3)")
    args = parser.parse_args(argv)
    try:
        if args.command == "to-reference":
            out = to_reference(None, args.export_dir, args.out_dir, args.weights)
        else:
            source = args.verifier or export_verifier(read_config(args.ref_dir))
            if not source:
                raise UserError(f"{args.ref_dir} names no verifier; pass --verifier <the verifier it was trained on>.")
            out = from_reference(args.ref_dir, args.out_dir, load_verifier(source, "float32", "cpu", args.cache_dir),
                                 served=args.served_verifier, speculative_tokens=args.speculative_tokens)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
