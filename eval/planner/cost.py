"""The verifier's cost curve and the machine's bound, and the tree size they make best (`tree.size=auto`).

A speculative round costs one verifier forward over the tree's N nodes; it pays when the drafts it accepts outweigh
how much more that forward costs than a one-token step. `forward_curve` measures that forward for N = 1..64 tokens
after a real prefix, through the path the decode loops use (eval.engine.decode: eval.engine.forward or HF), and
`machine` measures what this machine allows: a step must read every weight once (weight bytes / read bandwidth) and do 2
FLOPs per weight and token (FLOPs / matmul peak), so the bound is the larger of the two.

With a drafter's acceptance estimates, E[tokens per round](s) for a tree of s drafts is 1 + the sum of its nodes'
path-acceptance probabilities: eval.engine.tree.auto_tree's node values from the export's top-k table (Medusa: per head;
EAGLE: per unrolled step, `eagle_topk_accuracy`; an older EAGLE export's `val_step_top1` is a chain, which says
nothing about siblings, so it never asks for more nodes than its depth). A round also pays the drafter: `draft_curve`
measures d(s), the ms one round's drafting takes for s drafts on the same prefix (EAGLE: feeding the round's new
features, then growing s nodes; Medusa: its heads and top-k, the same for every s; P-EAGLE and DFlash: the new
features, then one forward over the mask slots of the depth the s-draft tree reaches). Both curves are read
non-decreasing (`monotone`). The best size maximises E[tokens](s) / (t(s + 1) + d(s)); the predicted speedup over
plain decoding is E[tokens](s) * t(1) / (t(s + 1) + d(s)). What else a round costs (acceptance, commit, Python) is
not in it; the report measures every part apart.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eval.engine.protocol import CostProbe
from eval.engine.timing import interleaved, timed
from eval.engine.tree import Tree, auto_tree, best_first, rank_probs, tree_buffers
from models.exports.io import ExportInfo
from models.families import FAMILIES
from models.verifiers.core import Verifier
from runtime.errors import UserError

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64)  # measured; the rest interpolated
FALLBACK_SIZE = 16  # tree.size=auto's budget where it cannot be planned (no acceptance estimates; method=all)
# What writes an export's acceptance estimates: a validation of its final weights (train.py runs one at the end of
# every run; an older run stopped inside an epoch, or an export converted from another format, may have none).
VALIDATE_EXPORT = "python train.py <the run's overrides> ckpt_path=last validate_only=true"
SHAPE_TABLE = [[0.6, 0.75, 0.8, 0.85]] * 4  # the shape of the measured trees: bushy, 4 deep, like a Medusa tree


def machine(dtypes: Sequence[str] = ("float32", "bfloat16"), reps: int = 3) -> dict[str, Any]:
    """Read bandwidth (GB/s, a 256 MiB sum) and matmul peak per dtype (GFLOP/s, 1024x2048 @ 2048x2048), measured with
    the current thread count."""
    big = torch.ones(64 * 2**20)
    read = big.sum  # bound here: `big` is deleted below, so the generator must not look it up by name
    read_ms = min(timed(read, reps) for _ in range(2))
    out: dict[str, Any] = {"threads": torch.get_num_threads(), "read_gbs": big.numel() * 4 / read_ms / 1e6,
                           "peak_gflops": {}}
    del big
    for name in dtypes:
        dt = getattr(torch, name)
        a, b = torch.randn(1024, 2048).to(dt), torch.randn(2048, 2048).to(dt)
        ms = min(timed(lambda: a @ b, reps) for _ in range(2))
        out["peak_gflops"][name] = 2 * 1024 * 2048 * 2048 / ms / 1e6
    return out


def bound_ms(verifier: Verifier, tokens: int, prefix: int, mach: dict[str, Any]) -> tuple[float, float]:
    """(memory bound, compute bound) in ms for one forward over `tokens` after `prefix` cached ones."""
    model = verifier.model
    dtype = str(model.get_input_embeddings().weight.dtype).removeprefix("torch.")
    params = {p.data_ptr(): p for p in model.parameters()}.values()  # a tied head once
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
    matmul_weights = sum(p.numel() for p in params if p.ndim == 2) - (0 if tied else embed.numel())
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attention = 4 * tokens * (prefix + tokens) * cfg.num_attention_heads * head_dim * cfg.num_hidden_layers
    flops = 2 * tokens * matmul_weights + attention
    return weight_bytes / mach["read_gbs"] / 1e6, flops / mach["peak_gflops"][dtype] / 1e6


def _tree(n: int) -> Tree:
    return auto_tree(SHAPE_TABLE, n - 1)


def forward_curve(verifier: Verifier, prefix_ids: Tensor, sizes: Sequence[int] = SIZES, engine: str = "auto",
                  reps: int = 3) -> list[float]:
    """Least ms (of `reps` interleaved rounds) of one verifier forward over n tokens (a one-token step for n = 1, a
    tree of n nodes otherwise) after the prefix `prefix_ids` (1, P), for each n in `sizes`, through the decode loops'
    path (eval.engine.decode)."""
    from eval.engine.decode import VerifierSession  # eval.engine.decode imports nothing from here

    if max(sizes) > 64 or min(sizes) < 1:
        raise UserError(f"profile sizes must lie in 1..64; got {list(sizes)}.")
    prefix = prefix_ids.shape[1]
    cache = VerifierSession(verifier, engine, prefix + 1, max(sizes), _tree(max(sizes)).max_depth)
    cache.forward(prefix_ids)
    tokens = prefix_ids[:, -1:].repeat(1, max(sizes))  # which tokens does not change the cost
    empty = torch.zeros(1, 0, dtype=torch.long)

    def step(n: int) -> Callable[[], None]:
        buf = tree_buffers(_tree(n))

        def run() -> None:
            if n == 1:
                cache.forward(tokens[:, :1])
            else:
                cache.forward(tokens[:, :n], buf.positions, buf.mask)
            cache.commit(prefix, empty)  # back to the prefix

        return run

    return interleaved([step(n) for n in sizes], reps)


def draft_curve(verifier: Verifier, drafter: CostProbe, prefix_ids: Tensor, sizes: Sequence[int] = SIZES,
                engine: str = "auto", reps: int = 3) -> list[float] | None:
    """Least ms (of `reps` interleaved rounds) of one round's drafting with s = n - 1 drafts, for each n in `sizes`,
    after the prefix `prefix_ids` (1, P) in steady state (the previous round accepted nothing, so one new position
    comes in): the drafter's own `draft_cost` (eval.engine.protocol.CostProbe). EAGLE: its `trial` (its layer over the
    new features, then growing s nodes, each depth a drafter forward and a head over the frontier); P-EAGLE and DFlash:
    their `trial`, one forward over the depth of the tree s drafts buy; Medusa: one `propose`, the same for every s
    (its heads run once a round whatever the tree; the tree only indexes their top-k); the hybrid: its primary's
    (the grafted prompt lookup's string search is left out). None where the drafter says its drafting is not timed
    (prompt lookup, lookahead, a draft model)."""
    return drafter.draft_cost(verifier, prefix_ids, sizes, engine, reps)


def interpolate(sizes: Sequence[int], ms: Sequence[float], n: int) -> float:
    """Linear interpolation of the curve at n tokens (clamped at its ends)."""
    if n <= sizes[0]:
        return ms[0]
    for (a, ta), (b, tb) in zip(zip(sizes, ms), zip(sizes[1:], ms[1:])):
        if n <= b:
            return ta + (tb - ta) * (n - a) / (b - a)
    return ms[-1]


# -- acceptance estimates --------------------------------------------------------------------------------------------

def tree_values(tree: Tree, topk_accuracy: Sequence[Sequence[float]]) -> list[float]:
    """Each draft node's path-acceptance probability from a Medusa top-k table (eval.engine.tree.auto_tree's node
    value); a rank the table lacks counts as never right."""
    probs = rank_probs(topk_accuracy)
    values = []
    for path in tree.paths[1:]:
        v = 1.0
        for depth, rank in enumerate(path):
            row = probs[depth] if depth < len(probs) else []
            v *= row[rank] if rank < len(row) else 0.0
        values.append(v)
    return values


def expected_tokens(table: Sequence[Sequence[float]], size: int) -> float:
    """E[tokens per round] of the best `size`-draft tree under `table`: 1 (the bonus) + its nodes' values."""
    return 1.0 + sum(tree_values(auto_tree(table, size), table)) if size else 1.0


def expected_curve(table: Sequence[Sequence[float]], max_drafts: int) -> list[float]:
    """`expected_tokens(table, s)` for s = 0..max_drafts from one best-first growth (eval.engine.tree.best_first):
    the s-draft tree is the first s nodes of the largest, so one growth prices every budget (what lets the adaptive
    planner, eval.planner.adaptive, re-plan between rounds for a fraction of a millisecond's work)."""
    out, total = [1.0], 1.0
    for v in best_first(table, max_drafts)[1]:
        total += v
        out.append(total)
    return out + [total] * (max_drafts + 1 - len(out))  # a table that runs out of nodes adds nothing past them


@dataclass
class Plan:
    """What the cost curve predicts for one tree: drafts, E[tokens per round], verify ms, predicted speedup."""

    size: int
    expected_tokens: float
    verify_ms: float
    step_ms: float
    predicted_speedup: float
    draft_ms: float = 0.0


def monotone(ms: Sequence[float]) -> list[float]:
    """The non-decreasing curve nearest `ms` (least squares, scipy's isotonic regression). A forward over more tokens,
    or a round with more drafts, does at least the work of a smaller one, so a measured dip is timing noise; planning on
    it would let one noisy size (a 2-token forward timed below the 1-token step) decide the tree."""
    from scipy.optimize import isotonic_regression

    return [float(x) for x in isotonic_regression(list(ms), increasing=True).x]


def plan(sizes: Sequence[int], ms: Sequence[float], expected: float, drafts: int,
         draft: Sequence[float] | None = None) -> Plan:
    """The prediction for `drafts` drafts: verify time t(drafts + 1) and, with a draft curve `draft` (ms at the same
    `sizes`, as n = drafts + 1 nodes), the round's drafting time d(drafts); no drafting at 0 drafts. Both curves are
    read through `monotone`."""
    return plan_monotone(sizes, monotone(ms), expected, drafts, None if draft is None else monotone(draft))


def plan_monotone(sizes: Sequence[int], ms: Sequence[float], expected: float, drafts: int,
          draft: Sequence[float] | None) -> Plan:
    """`plan` on curves already read non-decreasing."""
    verify = interpolate(sizes, ms, drafts + 1)
    step = interpolate(sizes, ms, 1)
    spent = interpolate(sizes, draft, drafts + 1) if draft is not None and drafts > 0 else 0.0
    return Plan(drafts, round(expected, 4), round(verify, 3), round(step, 3),
                round(expected * step / (verify + spent), 4), round(spent, 3))


def best_size(sizes: Sequence[int], ms: Sequence[float], table: Sequence[Sequence[float]],
              max_nodes: int = 64, draft: Sequence[float] | None = None, min_drafts: int = 0) -> Plan:
    """The draft budget s in min_drafts..max_nodes-1 that maximises E[tokens](s) / (t(s + 1) + d(s)) (ties: the
    smaller s); without a draft curve, d = 0."""
    ms, draft = monotone(ms), (None if draft is None else monotone(draft))
    expected = expected_curve(table, max_nodes - 1)
    plans = [plan_monotone(sizes, ms, expected[s], s, draft) for s in range(min_drafts, max_nodes)]
    return max(plans, key=lambda p: (p.predicted_speedup, -p.size))


# -- the curve as a product: measure, write, plot --------------------------------------------------------------------

@dataclass
class Curve:
    dtype: str
    threads: int
    path: str  # "engine" | "hf"
    sizes: list[int]
    ms: list[float]
    bound_memory_ms: list[float]
    bound_compute_ms: list[float]
    machine: dict[str, Any]


def measure(verifier: Verifier, prefix_ids: Tensor, threads: int, engine: str = "auto",
            sizes: Sequence[int] = SIZES, reps: int = 3) -> Curve:
    """One curve with `threads` threads (restored after), beside this machine's bound."""
    from eval.engine.session import use_engine

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dtype = str(verifier.model.get_input_embeddings().weight.dtype).removeprefix("torch.")
        mach = machine((dtype,))
        ms = forward_curve(verifier, prefix_ids, sizes, engine, reps)
    finally:
        torch.set_num_threads(before)
    bounds = [bound_ms(verifier, n, prefix_ids.shape[1], mach) for n in sizes]
    return Curve(dtype, threads, "engine" if use_engine(verifier, engine) else "hf", list(sizes),
                 [round(t, 3) for t in ms], [round(b[0], 3) for b in bounds], [round(b[1], 3) for b in bounds], mach)


def write(curves: Sequence[Curve], out_dir: Path, title: str = "") -> list[Path]:
    """cost_curve.json and cost_curve.png (time per forward against tokens, each curve beside its bound)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cost_curve.json").write_text(json.dumps([asdict(c) for c in curves], indent=2))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, c in enumerate(curves):
        color = f"C{i}"
        label = f"{c.dtype}, {c.threads} thread(s), {c.path}"
        ax.plot(c.sizes, c.ms, "o-", color=color, label=label)
        bound = [max(m, f) for m, f in zip(c.bound_memory_ms, c.bound_compute_ms)]
        ax.plot(c.sizes, bound, "--", color=color, alpha=0.7, label=f"bound ({c.machine['read_gbs']:.0f} GB/s, "
                f"{c.machine['peak_gflops'][c.dtype]:.0f} GFLOP/s)")
    ax.set(xlabel="tokens in the forward (tree nodes)", ylabel="ms per verifier forward", ylim=(0, None),
           title=title or "verifier forward cost beside the machine's bound")
    ax.legend(fontsize=7)
    fig.tight_layout()
    png = out_dir / "cost_curve.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return [out_dir / "cost_curve.json", png]


# -- the harness's use: tree.size=auto, and the predicted speedup beside the measured one ---------------------------

def auto_size(family: str, export: ExportInfo, curve: Curve, draft: Sequence[float] | None = None) -> Plan:
    """The best draft budget for drafter `family` on this export, this curve and the drafter's draft curve
    (`tree.size=auto`), planned on the export's acceptance estimates (ExportInfo.acceptance: the hybrid plans its
    primary's budget, at least the family's `min_drafts`: the grafted prompt-lookup chain needs a node, and what it
    adds to acceptance is not in the table)."""
    table = export.acceptance
    if table is None:
        need = " or ".join(FAMILIES[export.kind].acceptance)
        raise UserError(f"tree.size=auto needs the export's acceptance estimates ({need} in its config.json), and "
                        f"this export has none: no validation of its final weights wrote them. Give a "
                        f"number (tree.size=16), or write them: {VALIDATE_EXPORT}.")
    return best_size(curve.sizes, curve.ms, table, draft=draft, min_drafts=FAMILIES[family].min_drafts)


PROBE_SIZE = max(SIZES) - 1  # tree.size=auto times a probe drafter of this budget, the largest the curve reaches


def timed_draft_curve(verifier: Verifier, drafter: Any, prefix: Tensor, sizes: Sequence[int], engine: str,
                      threads: int) -> list[float] | None:
    """`draft_curve` of a drafter the caller built, measured with `threads` threads (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return draft_curve(verifier, drafter, prefix, sizes, engine)
    finally:
        torch.set_num_threads(before)


# -- the evaluation dtype: bf16 where the machine computes it natively ----------------------------------------------

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    try:
        text = Path(path).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def auto_dtype(device: str, flags: set[str] | None = None) -> tuple[str, str]:
    """`dtype: auto`: bfloat16 where this machine has bf16 matmul units (a GPU that supports it; a CPU with AMX or
    AVX512-BF16), float32 elsewhere; returns (dtype, the reason, for the report). bf16 speculative decoding is exact
    through eval.engine.forward (tests/test_exact_bf16.py), so this only changes speed."""
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if cuda:
        if torch.cuda.is_bf16_supported():
            return "bfloat16", f"GPU {torch.cuda.get_device_name()} supports bf16"
        return "float32", f"GPU {torch.cuda.get_device_name()} has no bf16 support"
    found = sorted((cpu_flags() if flags is None else flags) & set(BF16_CPU_FLAGS))
    if found:
        return "bfloat16", f"CPU has {' and '.join(found)} (bf16 matmuls in hardware)"
    return "float32", f"CPU has neither {' nor '.join(BF16_CPU_FLAGS)} (bf16 would be emulated, slower than fp32)"
