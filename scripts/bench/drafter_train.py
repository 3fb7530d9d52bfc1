"""Training throughput of each drafter from cached verifier hidden states (offline mode), and what bounds it.

    python -m scripts.bench.drafter_train                        # Medusa, EAGLE-1, EAGLE-3 on the default verifier
    python -m scripts.bench.drafter_train --drafters eagle3 --batch-size 16 --seq-len 512 --steps 6
    python -m scripts.bench.drafter_train --drafters medusa medusa_lean eagle eagle_lean --train-vocab 4096
        # *_lean: model.train_vocab=4096 (the kept rows hold every target of the batch)

One batch of `batch_size` sequences of `seq_len` tokens (the first 40% a prompt, the rest assistant tokens, as in
self-distilled data), its hidden states computed once by the verifier and fed as the `hidden` cache tensor the data
module gives in offline mode; then forward + backward + optimizer step of each drafter's training step under bf16
autocast, the first step untimed. Prints tokens/s (all tokens, and assistant tokens: the ones with targets), the
matmul FLOPs per assistant token the step needs (EAGLE-3 reads M_q's argmax from the offline cache, as training
does, unless --no-cached-argmax), the GFLOP/s that implies, and this machine's bf16 matmul rate on
the head's shape, measured in the same process: their ratio says how close a step is to the arithmetic. Nothing here
is asserted.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from runtime.cpu_memory import keep_freed_memory
from scripts.common import add_verifier_args, load_cpu_verifier, set_threads
from train.eagle import EagleModule
from train.medusa import MedusaModule


def make_module(kind: str, verifier, args: argparse.Namespace):
    opt = lambda params: torch.optim.AdamW(params, lr=1e-4)  # noqa: E731
    if kind in ("medusa", "medusa_lean"):
        lean = min(args.train_vocab, verifier.vocab_size) if kind == "medusa_lean" else None
        return MedusaModule(verifier, optimizer=opt, num_heads=args.medusa_heads, train_vocab=lean)
    if kind in ("eagle", "eagle_lean"):
        lean = min(args.train_vocab, verifier.vocab_size) if kind == "eagle_lean" else None
        return EagleModule(verifier, optimizer=opt, kind="eagle", ttt_steps=1, train_vocab=lean)
    aux = [1, verifier.num_layers // 2, verifier.num_layers - 1] if verifier.num_layers >= 3 else [0, 1]
    module = EagleModule(verifier, optimizer=opt, kind="eagle3", ttt_steps=args.ttt_steps,
                         draft_vocab_size=min(args.draft_vocab, verifier.vocab_size), aux_layer_ids=aux)
    return module


def flops_per_token(kind: str, verifier, module, args: argparse.Namespace) -> float:
    """Matmul FLOPs per assistant token of one training step (forward 2mnk; backward 2x that for trained weights,
    1x for frozen ones whose input needs a gradient)."""
    d, v = verifier.hidden_size, verifier.vocab_size
    head = 2 * d * v
    if kind in ("medusa", "medusa_lean"):
        head = 2 * d * (v if module.head_ids is None else module.head_ids.numel())
        block = 2 * d * d * module.hparams.num_layers
        return args.medusa_heads * (3 * block + 2 * head)  # frozen shared head: forward + input gradient
    net = module.net
    layer = sum(2 * p.numel() for n, p in net.layer.named_parameters() if p.dim() == 2)
    fc = 2 * net.fc.weight.numel()
    if kind in ("eagle", "eagle_lean"):  # q (no grad) + the draft's own logits (frozen head, input grad)
        if module.head_ids is not None:
            head = 2 * d * module.head_ids.numel()
        return 3 * (fc + layer) + head + 2 * head
    draft_head = 2 * d * net.draft_vocab_size
    # q over the draft vocabulary's rows once; with --no-cached-argmax over the full vocabulary (for M_q's argmax)
    return 3 * fc + args.ttt_steps * 3 * (layer + draft_head) + (head if args.no_cached_argmax else draft_head)


def matmul_rate(m: int, k: int, n: int) -> float:
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16)
    a @ b
    t0 = time.perf_counter()
    for _ in range(5):
        a @ b
    return 2 * m * k * n * 5 / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_verifier_args(ap)
    ap.add_argument("--drafters", nargs="+", default=["medusa", "eagle", "eagle3"])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=384)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--medusa-heads", type=int, default=4)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--train-vocab", type=int, default=4096, help="medusa_lean, eagle_lean: model.train_vocab=N")
    ap.add_argument("--no-cached-argmax", action="store_true",
                    help="EAGLE-3: compute M_q's argmax in every step (a full-vocabulary projection per target), as "
                         "training without the offline argmax cache does")
    ap.add_argument("--system-malloc", action="store_true",
                    help="leave glibc's allocator as it is (training keeps freed memory: runtime/cpu_memory.py)")
    args = ap.parse_args()
    kept = False if args.system_malloc else keep_freed_memory()
    torch.manual_seed(0)
    set_threads(args)
    verifier = load_cpu_verifier(args, "bfloat16")
    bsz, seq = args.batch_size, args.seq_len
    ids = torch.randint(0, verifier.vocab_size, (bsz, seq))
    loss_mask = torch.zeros(bsz, seq, dtype=torch.long)
    loss_mask[:, int(0.4 * seq) :] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
    with torch.no_grad():
        out = verifier.model.get_decoder()(input_ids=ids, output_hidden_states=True, use_cache=False)
    assistant = int(loss_mask.sum())
    print(f"verifier={args.verifier} batch={bsz}x{seq} ({assistant} assistant tokens) "
          f"threads={torch.get_num_threads()} torch={torch.__version__} load={os.getloadavg()[0]:.1f} "
          f"freed memory kept={kept}")
    print(f"{'drafter':<10}{'s/step':>8}{'tok/s':>9}{'asst tok/s':>12}{'MFLOP/tok':>11}{'GFLOP/s':>9}{'peak':>7}"
          f"{'of peak':>9}")
    for kind in args.drafters:
        module = make_module(kind, verifier, args)
        layers = module.hidden_layers
        batch["hidden"] = torch.stack([out.hidden_states[i] for i in layers], dim=1).to(torch.bfloat16)  # (B, L, T, D)
        if kind in ("medusa_lean", "eagle_lean"):  # rows holding every target of the batch (real runs: ~98%)
            targets = ids[loss_mask.bool()].unique()
            others = torch.randperm(verifier.vocab_size)
            others = others[~torch.isin(others, targets)][: max(module.hparams.train_vocab - targets.numel(), 0)]
            module.set_train_vocab(torch.cat([targets, others])[: module.hparams.train_vocab].sort().values)
        batch.pop("verifier_argmax", None)
        if kind == "eagle3":
            module.net.set_draft_vocab(torch.randperm(verifier.vocab_size)[: module.net.draft_vocab_size])
            if not args.no_cached_argmax:  # what offline mode's argmax cache gives every batch
                with torch.no_grad():
                    batch["verifier_argmax"] = verifier.lm_head(out.hidden_states[-1]).float().argmax(-1)
        opt = module.configure_optimizers()
        elapsed = 0.0
        for step in range(args.steps + 1):
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                if kind.startswith("medusa"):
                    loss = module.model_step(batch, train=True)[0]
                else:
                    loss = module._loss(module.model_step(batch, module.hparams.ttt_steps, train=True)["losses"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step:
                elapsed += time.perf_counter() - t0
        per_step = elapsed / args.steps
        flops = flops_per_token(kind, verifier, module, args)
        rate = flops * assistant / per_step
        peak = matmul_rate(assistant, verifier.hidden_size, verifier.vocab_size // 4)
        print(f"{kind:<10}{per_step:>8.2f}{bsz * seq / per_step:>9.0f}{assistant / per_step:>12.0f}{flops / 1e6:>11.0f}"
              f"{rate / 1e9:>9.1f}{peak / 1e9:>7.0f}{rate / peak:>9.0%}")


if __name__ == "__main__":
    main()
