"""llama.cpp's plain decoding per verifier quantization and its drafting per K and confidence cut: one llama-server
at a time (serve.llamacpp_engine.serve_many: servers side by side steal each other's cores even idle), plain first.
Ratios are against plain bf16 (drafting: against plain decoding of the same GGUF); run it alone on the machine. The
folder is what `convert gguf` wrote.

    python -m scripts.tools.convert gguf pretrained/eagle3-smollm2 gguf/eagle3 --quant bf16,q8_0,q4_k_m,q4_1
    python -m scripts.bench.llamacpp gguf/eagle3 [--prompts 5 --max-new 128 --threads 2]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from serve import llamacpp_engine
from serve.llamacpp_engine import ServerSettings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plain", default=None, help="the quantizations measured plain (default: every one there)")
    parser.add_argument("--drafting", default="bf16,q4_1", help="the quantizations drafting is measured on")
    parser.add_argument("--settings", default="1:0,3:0,3:0.6,5:0.6", help="K:p-min pairs")
    args = parser.parse_args(argv)
    from data.chat import prompt_ids
    from data.prompts import load_conversations
    from models.verifiers.embedded import load_smollm2

    folder = Path(args.folder)
    manifest = json.loads((folder / "llamacpp.json").read_text())
    files = manifest["verifier"]["files"]
    tokenizer = load_smollm2(dtype="float32", device="cpu").tokenizer
    convs = load_conversations("builtin", split="eval", limit=args.prompts)
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": c.user_turns[0]}]) for c in convs]
    configs: dict[str, ServerSettings] = {}
    for q in [q for q in (args.plain.split(",") if args.plain else files) if q in files]:
        configs[f"plain {q}"] = ServerSettings(folder / files[q], threads=args.threads)
    kind = manifest["kind"]
    for q in [q for q in args.drafting.split(",") if q in files]:
        for pair in args.settings.split(","):
            k, p = pair.split(":")
            configs[f"{kind} {q} K={k} p-min={p}"] = ServerSettings(
                folder / files[q], folder / manifest["draft"], kind, int(k), float(p), args.threads)
    runs = llamacpp_engine.serve_many(configs, prompts, args.max_new)  # one server at a time, in this order
    stats = {name: {"tokens": r.tokens, "ms": r.seconds * 1000, "outputs": r.outputs, "per_pos": r.accepted_per_pos,
                    "counters": {"accepted": r.accepted, "drafted": r.drafted, "steps": r.steps}}
             for name, r in runs.items()}
    print(f"llama.cpp {llamacpp_engine.VERSION}, {args.prompts} prompts x {args.max_new} new tokens, "
          f"{args.threads} threads, batch 1")
    print(f"{'configuration':34s} {'tok/s':>7s} {'vs plain':>9s} {'accept':>7s} {'tau':>5s}  alpha_k   same output")
    for name, s in stats.items():
        tps = s["tokens"] / (s["ms"] / 1000)
        q = name.split()[1]
        base = stats[f"plain {q}"]
        ratio = tps / (base["tokens"] / (base["ms"] / 1000))
        c = s.get("counters", {})
        acc = c["accepted"] / c["drafted"] if c.get("drafted") else float("nan")
        tau = 1 + c["accepted"] / c["steps"] if c.get("steps") else float("nan")
        alpha = ", ".join(f"{a / c['steps']:.2f}" for a in s["per_pos"]) if c.get("steps") else ""
        same = sum(a == b for a, b in zip(s["outputs"], base["outputs"]))
        print(f"{name:34s} {tps:7.1f} {ratio:8.2f}x {acc:7.2f} {tau:5.2f}  {alpha:9s} {same}/{len(prompts)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
