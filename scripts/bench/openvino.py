"""An EAGLE-3 export in OpenVINO GenAI, side by side in one process: OpenVINO plain, drafting K tokens per step with
the feature layers in OpenVINO's convention (what `convert openvino` writes) and with our ids unshifted (what
OpenVINO takes by default on a 30-layer verifier), and OpenVINO's own prompt lookup, on the same prompts,
interleaved prompt by prompt, in each inference precision asked.

    python -m scripts.bench.openvino pretrained/eagle3-smollm2 --num 8 --max-new-tokens 128 --ks 2,3,4 \
        --precisions bf16,f32

Prints tokens/s, speedup over OpenVINO's plain in the same precision, drafts accepted per round, tau, and how many
outputs equal OpenVINO's plain output.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from data.chat import prompt_ids
from data.prompts import load_conversations
from data.selfdistill import first_turn
from models.verifiers.embedded import load_smollm2
from serve import openvino_engine as ov


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export", nargs="?", default="pretrained/eagle3-smollm2")
    ap.add_argument("--num", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ks", default="2,3,4")
    ap.add_argument("--precisions", default="bf16,f32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weight-format", default="fp32")
    args = ap.parse_args()
    verifier = load_smollm2(dtype="float32", device="cpu")
    convs = load_conversations("builtin", split="eval", limit=args.num)
    prompts = [prompt_ids(verifier.tokenizer, first_turn(c)) for c in convs]
    folder = ov.converted_folder(args.export, verifier.checkpoint, weight_format=args.weight_format)
    ks = [int(k) for k in args.ks.split(",")]
    with tempfile.TemporaryDirectory(prefix="specdraft-ov-bench-") as tmp:
        unshifted = Path(tmp) / "draft"
        shutil.copytree(folder / "draft", unshifted)
        layers = ov.expected_contract(Path(args.export))["feature_layers"]
        ov.set_feature_layers(unshifted, layers)
        configs = [ov.configuration("plain")]
        for k in ks:
            configs.append(ov.configuration(f"eagle3 K={k}", folder / "draft", k))
            configs.append(ov.configuration(f"eagle3 K={k}, ids unshifted {layers}", unshifted, k))
        configs.append(ov.configuration("prompt lookup K=3", tokens=3, lookup=True))
        for precision in args.precisions.split(","):
            runs = ov.serve_many(folder / "verifier", prompts, args.max_new_tokens, configs, precision=precision,
                                 threads=args.threads)
            plain = runs["plain"]
            print(f"\nOpenVINO GenAI {plain.version}, {precision}, {args.num} prompts x {args.max_new_tokens} tokens, "
                  f"{args.threads} threads, weights {args.weight_format}")
            print(f"{'configuration':<44} {'tok/s':>7} {'speedup':>8} {'acc/round':>9} {'tau':>6} {'= plain':>8}")
            for name, r in runs.items():
                same = sum(a == b for a, b in zip(r.outputs, plain.outputs))
                acc = f"{r.accepted_per_round:.3f}" if r.accepted_per_round is not None else "-"
                tau = f"{r.tau:.3f}" if r.tau is not None else "-"
                print(f"{name:<44} {r.tokens_per_s:7.1f} {r.tokens_per_s / plain.tokens_per_s:7.2f}x {acc:>9} "
                      f"{tau:>6} {same:>5}/{len(prompts)}")


if __name__ == "__main__":
    main()
