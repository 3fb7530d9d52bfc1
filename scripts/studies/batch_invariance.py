"""Where does the verifier's numerics depend on how many tokens a forward holds?

    python -m scripts.studies.batch_invariance [--dtype bfloat16 float32] [--threads 1] [--tokens 16]

For each dtype: (1) one forward over n tokens against n one-token forwards, through Hugging Face
(eval.engine.hf_forward) and through eval.engine.forward, with the largest logit difference; (2) HF hooked module by
module: the first module whose output differs between the two, and whether its input already did; (3) the ops alone:
F.linear over 1..130 rows (which row counts give the same bits for a row), SDPA over key lengths / masks / query counts,
RMSNorm, rotary.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from eval.engine import forward as engine
from eval.engine import hf_forward as kv
from models.verifiers.embedded import load_smollm2

PROMPT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle. The keeper had lived alone on "
    "the rock for eleven years, and every morning he climbed the stairs to polish the lamp."
)


def hooked(model):
    """Record (name, input, output) of every leaf module and attention block, in call order."""
    calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    handles = []
    for name, mod in model.named_modules():
        if name and (not list(mod.children()) or name.endswith("self_attn")):

            def hook(m, args, out, name=name):
                x = args[0] if args else None
                y = out[0] if isinstance(out, tuple) else out
                if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and y.ndim == 3:
                    calls.append((name, x.detach().clone(), y.detach().clone()))

            handles.append(mod.register_forward_hook(hook))
    return calls, handles


def first_difference(model, ids, prefix: int) -> str:
    n = ids.shape[1] - prefix
    runs = []
    for chain in (True, False):
        cache = kv.new_cache()
        kv.forward(model, cache, ids[:, :prefix])
        calls, handles = hooked(model)
        if chain:
            kv.forward(model, cache, ids[:, prefix:])
        else:
            for j in range(n):
                kv.forward(model, cache, ids[:, prefix + j : prefix + j + 1])
        for h in handles:
            h.remove()
        runs.append(calls)
    chain_calls, step_calls = runs
    per_module = len(chain_calls)
    for i, (name, x, y) in enumerate(chain_calls):
        xs = torch.cat([step_calls[i + j * per_module][1] for j in range(n)], dim=1)
        ys = torch.cat([step_calls[i + j * per_module][2] for j in range(n)], dim=1)
        if not torch.equal(y, ys):
            rows = [j for j in range(n) if not torch.equal(y[:, j], ys[:, j])]
            return (
                f"first differing module: {name} (input {x.shape[-1]} -> output {y.shape[-1]}); inputs equal: "
                f"{torch.equal(x, xs)}; max |diff| {(y.float() - ys.float()).abs().max().item():.3g}; "
                f"tokens differing: {len(rows)}/{n}"
            )
    return "no module differs"


def row_paths(fn, x: torch.Tensor) -> str:
    """For M = 1..20, 33, 64, 130: is every row of fn(x[:M]) bitwise the row computed alone, i.e. fn of that row
    repeated p times (p = 1: a one-token step; p = 2, 4: the padding eval.engine.forward applies)? Lists the M that
    fail."""
    sizes = list(range(1, 21)) + [33, 64, 130]
    out = []
    for p in (1, 2, 4):
        alone = torch.cat([fn(x[r : r + 1].expand(p, -1))[:1] for r in range(max(sizes))])
        bad = [m for m in sizes if m >= p and not torch.equal(fn(x[:m]), alone[:m])]
        differs = f"differs at M={bad[:8]}{'...' if len(bad) > 8 else ''}"
        out.append(f"alone x{p}: " + ("all M agree" if not bad else differs))
    return "; ".join(out)


def op_checks(v, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    layer = v.model.model.layers[0]
    for name, lin in [("q_proj", layer.self_attn.q_proj), ("o_proj", layer.self_attn.o_proj),
                      ("gate_proj", layer.mlp.gate_proj), ("down_proj", layer.mlp.down_proj), ("lm_head", v.lm_head)]:
        x = torch.randn(130, lin.in_features, generator=gen).to(dtype)
        print(f"  F.linear {name:9s} K={lin.in_features:5d} N={lin.out_features:5d}: "
              f"{row_paths(lambda a: F.linear(a, lin.weight), x)}")
    norm = layer.input_layernorm
    x = torch.randn(130, v.hidden_size, generator=gen).to(dtype)
    print(f"  RMSNorm: {row_paths(lambda a: norm(a[None])[0], x)}")
    rot = v.model.model.rotary_emb
    pos = torch.arange(200)[None]
    cos_all, _ = rot(x, pos)
    same = all(torch.equal(rot(x, pos[:, p : p + 1])[0][0, 0], cos_all[0, p]) for p in range(0, 200, 7))
    print(f"  rotary cos/sin: one position alone == same position in a batch of 200: {same}")
    # SDPA: one query over s visible keys, computed (a) on exactly s keys, (b) on S keys with a bool mask hiding
    # the rest, (c) with an additive mask, (d) as row 0 of 4 queries. GQA shapes of the default verifier.
    h, dh, s_max = 3, 64, 96
    q = torch.randn(1, h, 4, dh, generator=gen).to(dtype)
    k = torch.randn(1, h, s_max, dh, generator=gen).to(dtype)
    vv = torch.randn(1, h, s_max, dh, generator=gen).to(dtype)
    diffs = {"bool mask": 0, "additive mask": 0, "4 queries": 0, "key length": 0}
    for s in range(8, 64):
        exact = F.scaled_dot_product_attention(q[:, :, :1], k[:, :, :s], vv[:, :, :s])[:, :, 0]
        keep = torch.zeros(1, s_max, dtype=torch.bool)
        keep[:, :s] = True
        bool_out = F.scaled_dot_product_attention(q[:, :, :1], k, vv, attn_mask=keep)[:, :, 0]
        add = torch.zeros(1, s_max, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
        add_out = F.scaled_dot_product_attention(q[:, :, :1], k, vv, attn_mask=add)[:, :, 0]
        four = F.scaled_dot_product_attention(q, k, vv, attn_mask=keep.expand(4, s_max))[:, :, 0]
        longer = F.scaled_dot_product_attention(q[:, :, :1], k[:, :, : s + 8], vv[:, :, : s + 8],
                                                attn_mask=keep[:, : s + 8])[:, :, 0]
        diffs["bool mask"] += not torch.equal(exact, bool_out)
        diffs["additive mask"] += not torch.equal(exact, add_out)
        diffs["4 queries"] += not torch.equal(bool_out, four)
        diffs["key length"] += not torch.equal(bool_out, longer)
    print("  SDPA, one query over s = 8..63 visible keys, cases whose bits differ from the reference (of 56): "
          + ", ".join(f"{k}: {n}" for k, n in diffs.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.dtype:
        v = load_smollm2(dtype=name, device="cpu")
        dtype = v.dtype
        ids = v.tokenizer(PROMPT, return_tensors="pt").input_ids
        prefix = ids.shape[1] - args.tokens
        print(f"== {name}, {args.threads} thread(s), prefix {prefix} + {args.tokens} tokens")
        for label, make, fwd in [
            ("HF (eval.engine.hf_forward)", lambda: kv.new_cache(), lambda c, x: kv.forward(v.model, c, x)),
            ("eval.engine.forward", lambda: engine.new_cache(v.model, ids.shape[1]), engine.forward),
        ]:
            c1, c2 = make(), make()
            fwd(c1, ids[:, :prefix])
            fwd(c2, ids[:, :prefix])
            chain = fwd(c1, ids[:, prefix:]).logits
            steps = torch.cat([fwd(c2, ids[:, prefix + j : prefix + j + 1]).logits for j in range(args.tokens)], 1)
            print(f"  {label:13s} chain vs steps: bitwise {torch.equal(chain, steps)}, "
                  f"max |logit diff| {(chain.float() - steps.float()).abs().max().item():.3g}")
        print("  HF hooked: " + first_difference(v.model, ids, prefix))
        op_checks(v, dtype)


if __name__ == "__main__":
    main()
