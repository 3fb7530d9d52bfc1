"""A lean, batch-invariant forward for Llama-family verifiers (gpt-fast style), with a preallocated KV cache.

Why: speculative decoding is exact only if one forward over n tokens gives, for each token, the bits n one-token
forwards give. HF's eager forward does not (in bf16 or fp32, depending on the CPU): the matmul kernels take another
path for a one-row input than for a multi-row one, and attention reduces over a key length that grows with the
cache. Here every forward runs the same numerics whatever the number of tokens:

- Rows: a matmul kernel picks its path by row count, so each product runs only over row counts that give every row
  the same bits, probed once per shape, dtype and thread count on this machine's kernels. The weight matmuls keep
  to their own range (`linear_rows`, `Linear.min_rows` / `max_rows`, `Engine.weight_rows`): in bf16 on an AMX CPU
  oneDNN takes one path for 1-32 rows and another above, so a call over more than 32 rows is split into calls of at
  most 32; without AMX one path from 1-4 rows up, so short calls are padded by repeating their last row.
  Attention's fp32 products need 2-4 rows (`min_invariant_rows`), so a forward over fewer than `min_rows` tokens is
  padded by repeating its last token (same position, same mask row).
  Any count from `min_rows` up gives the same bits, so a short forward is padded to the one of them that runs
  fastest on this machine (`pad_rows`, timed once per process).
- Keys: how a token's attention is summed depends on its own position t only, never on the forward computing it.
  Keys at positions < t - W + 1 (always committed, each in its own slot) are attended with a mask over the cache's
  first 64-slot blocks, up to the last block any row of the forward reaches (`far_keys`): masked keys add exact
  zeros, so the bits do not depend on how many blocks a forward reads, which `trimmed_keys_invariant` checks on
  this machine's kernels when a cache is made (else every forward reads the whole cache, `max_length`); the W = 16 most
  recent positions are gathered along the token's own path (prefix slots, then its tree ancestors by depth), so a
  tree node off the first branch sums exactly the terms, in the same lanes, that a chain would. Attention math is
  fp32 (q, k, v, the cache, softmax), cast back to the model dtype before o_proj.

Interface (close to eval.engine.hf_forward): `new_cache(model, max_length)`, `forward(cache, tokens, positions,
tree_mask, hidden_layers) -> ForwardOutput`, `commit(cache, prefix_len, nodes)`, `cache_length(cache)`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.activations import ACT2FN

from eval.engine.arch import SUPPORTED as ARCH_SUPPORTED
from eval.engine.arch import Arch, describe
from eval.engine.hf_forward import ForwardOutput
from models.packed import Linear, can_pack
from runtime.errors import UserError

SUPPORTED = ARCH_SUPPORTED  # model types the engine runs (eval.engine.arch); others decode through hf_forward
WINDOW = 16  # the most recent keys of each token are attended in path order (trees up to this deep)
KEY_BLOCK = 64  # the cache length is rounded up to this: softmax over keys never has a tail to handle
_PROBE_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 32, 33, 40, 64, 65, 96)  # row counts each probe runs
_PROBE_CHECK = (0, 1, 2, 3, 4, 6, 7, 8, 15, 16, 31, 32, 39, 63, 64, 95)  # rows compared in each probe
_CANDIDATES = (1, 2, 4, 8, 16, 33, 40, 48, 64)  # row counts a product may be padded to
_MIN_ROWS: dict[tuple, int] = {}
_PAD_ROWS: dict[tuple, int] = {}
MAX_PAD_ROWS = 8  # padding beyond this costs more than kernel choice saves
T = TypeVar("T")
_PREFILL_ATTENTION: dict[tuple, str] = {}
PREFILL_PROBE_TOKENS = 1024  # the causal attention `prefill_attention_for` times: one layer's, at this length
PREFILL_MARGIN = 1.15  # attention in the model's dtype replaces fp32 only when at least this much faster


def min_invariant_rows(
    dtype: torch.dtype, shapes: Sequence[tuple[int, int]], heads: int, candidates=_CANDIDATES,
) -> int:
    """Smallest row count P such that, for every (K, N) in `shapes`, the product of (1, heads, M, K) and
    (1, heads, K, N) -- attention's, batched over `heads` -- gives every row the same bits whatever the call: a call
    over m rows, padded to P by repeating its last row when m < P (what `forward` does), gives row r the bits of row
    r alone (at position 0, padded to P), for every probed m. Probed on random data with the current thread count;
    memoised. (The weight products are probed by `linear_rows`.)"""
    key = (dtype, tuple(sorted(set(shapes))), heads, torch.get_num_threads(), tuple(candidates))
    if key in _MIN_ROWS:
        return _MIN_ROWS[key]
    gen = torch.Generator().manual_seed(0)
    worst = 1
    for k, n in key[1]:
        lead = (1, heads)
        w = torch.randn(*lead, n, k, generator=gen).to(dtype)
        x = torch.randn(*lead, max(_PROBE_ROWS), k, generator=gen).to(dtype)
        mul = lambda a: torch.matmul(a, w.transpose(-1, -2))

        def padded(a: Tensor, p: int) -> Tensor:  # a's rows, computed in a call of at least p rows
            m = a.shape[-2]
            return mul(torch.cat([a, a[..., -1:, :].expand(*lead, p - m, k)], dim=-2))[..., :m, :] if m < p else mul(a)

        unpadded = {m: mul(x[..., :m, :]) for m in _PROBE_ROWS}
        for p in candidates:
            alone = {r: padded(x[..., r : r + 1, :], p)[..., 0, :] for r in _PROBE_CHECK}
            if all(
                torch.equal((unpadded[m] if m >= p else padded(x[..., :m, :], p))[..., r, :], alone[r])
                for m in _PROBE_ROWS for r in _PROBE_CHECK if r < m
            ):
                worst = max(worst, p)
                break
        else:
            raise UserError(
                f"No row count up to {candidates[-1]} makes {dtype} matmuls of shape K={k}, N={n} batch-invariant "
                f"on this machine, so exact speculative decoding is not possible here in {dtype}. Use float32."
            )
    _MIN_ROWS[key] = worst
    return worst


_LINEAR_ROWS: dict[tuple, tuple[int, int | None]] = {}
_CALL_ROWS = (*range(1, 41), 48, 63, 64, 65, 96, 128)  # the call sizes `linear_rows` compares, every one up to 40
MIN_CHUNK = 16  # calls split smaller than this would read the weights too often to pay


def linear_rows(dtype: torch.dtype, in_features: int, out_features: int,
                packed: bool = False) -> tuple[int, int | None]:
    """The row counts (lo, hi) between which a weight product's kernel gives every row the same bits on this machine,
    whatever the call: `Linear` pads a call over fewer than lo rows (repeating its last row) and splits one over more
    than hi (None: no limit) into calls of at most hi rows. Kernels choose their path by row count: oneDNN's bf16
    kernels on an AMX CPU take one path for 1-32 rows and another above (1-32 and 33+ each agree within
    themselves), so there (1, 32): a one-token step runs one row, a 17-node tree one call of 17, a 64-token
    prefill two calls of 32. Without AMX a single path from 1-4 rows up: (lo, None). Where no split of at least
    MIN_CHUNK rows works, padding alone: (P, None) with P up to 64.

    Probed on random data through `Linear` itself (the kernel the engine then calls), with the current thread count,
    memoised: each of R rows computed alone (padded to lo) against the same rows in calls of every size in
    _CALL_ROWS, each row in every position of a call. The two paths differ in the fp32 order of a sum and a bf16
    output hides most of that (about 1 element in 20,000 differs on the default verifier's shapes), so R is chosen
    for about a million compared elements per call size."""
    key = (dtype, in_features, out_features, packed, torch.get_num_threads())
    if key in _LINEAR_ROWS:
        return _LINEAR_ROWS[key]
    gen = torch.Generator().manual_seed(0)
    lin = Linear(torch.randn(out_features, in_features, generator=gen).to(dtype), None, packed)
    rows = min(1024, max(2 * max(_CALL_ROWS), -(-(1 << 20) // out_features)))
    x = torch.randn(rows, in_features, generator=gen).to(dtype)

    def in_calls(m: int, lo: int) -> Tensor:  # x's rows (all of them that fill whole calls), m rows to a call
        calls = [x[i : i + m] for i in range(0, rows - m + 1, m)]
        if m < lo:  # padded as Linear pads
            calls = [torch.cat([c, c[-1:].expand(lo - m, in_features)]) for c in calls]
        return torch.cat([lin._kernel(c)[:m] for c in calls])

    found = None
    for lo in _CANDIDATES:
        alone = in_calls(1, lo)
        bad = next((m for m in _CALL_ROWS if m >= lo and not torch.equal(in_calls(m, lo), alone[: (rows // m) * m])),
                   None)  # the smallest call size that rounds otherwise
        if bad is None:
            found = (lo, None)
        elif bad - 1 >= max(lo, MIN_CHUNK):
            found = (lo, min(bad - 1, 40))  # every size up to 40 is compared; above it only some are
        if found:
            break
    if found is None:
        raise UserError(
            f"No row counts make {dtype} matmuls of shape K={in_features}, N={out_features} batch-invariant on this "
            f"machine (padded to up to {_CANDIDATES[-1]} rows, or split into calls of {MIN_CHUNK}+ rows), so exact "
            f"speculative decoding is not possible here in {dtype}. Use float32."
        )
    _LINEAR_ROWS[key] = found
    return found


def packed_head(lm_head: nn.Module) -> nn.Module | Linear:
    """The verifier's vocabulary head, for the engine and for drafters that reuse it (EAGLE-1, Medusa with a shared
    head): a prepacked `Linear` where `can_pack` holds (bf16 on CPU: a one-row 49k-wide head 10.7 -> ~6 ms here),
    else the module."""
    weight = lm_head.weight.detach()
    if not can_pack(weight):
        return lm_head
    # One packed copy per head, kept on the module (the engine and every drafter share it), rebuilt if the weights
    # were replaced (e.g. `.to(dtype)`); the weights are frozen while decoding, so their storage identifies them.
    key = (weight.data_ptr(), weight.dtype)
    hit = lm_head.__dict__.get("_specdraft_packed")
    if hit is None or hit[0] != key:
        with torch.no_grad():
            bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias.detach()
            hit = (key, Linear(weight, bias, True))
        lm_head.__dict__["_specdraft_packed"] = hit
    return hit[1]


class Engine:
    """The verifier's weights, read from an HF decoder the architecture description runs (eval.engine.arch), as
    `Linear`s (prepacked copies in bf16 on CPU; q/k/v and gate/up fused). `pack=False` keeps F.linear on the model's
    own tensors."""

    def __init__(self, model: nn.Module, pack: bool = True, arch: Arch | None = None) -> None:
        cfg = model.config
        decoder = model.get_decoder()
        # Unsupported (a UserError naming the architecture) if the engine lacks it. `arch`: another description of
        # the same model (tests break one piece of it on purpose and watch the logits leave Hugging Face's).
        self.arch = arch = describe(cfg) if arch is None else arch
        self.model = model
        self.dtype = model.get_input_embeddings().weight.dtype
        self.num_layers = int(cfg.num_hidden_layers)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.scale = arch.scale
        self.act = ACT2FN[arch.act]
        self.embed = model.get_input_embeddings().weight
        # Gemma scales the embeddings in the model dtype (sqrt(hidden) rounded to it), as its embedding module does.
        self.embed_scale = None if arch.embed_scale is None else torch.tensor(arch.embed_scale).to(self.dtype)
        self.pack = pack and can_pack(self.embed)
        self.norm = decoder.norm.weight
        self.rotary = decoder.rotary_emb
        self.rope_kinds = list(dict.fromkeys(arch.rope_kinds))  # the rotary tables, one per kind (StaticCache.rot_*)
        self.layers = []
        with torch.no_grad():
            head = model.get_output_embeddings()
            self.lm_head = packed_head(head) if self.pack else Linear(head.weight.detach(), None, False)
            for i, layer in enumerate(decoder.layers):
                att, mlp = layer.self_attn, layer.mlp
                if arch.fused:
                    qkv_w, qkv_b = att.qkv_proj.weight.detach(), att.qkv_proj.bias
                    gate_up_w = mlp.gate_up_proj.weight.detach()
                else:
                    qkv = [att.q_proj, att.k_proj, att.v_proj]
                    qkv_w = torch.cat([p.weight for p in qkv])
                    qkv_b = torch.cat([p.bias for p in qkv]) if qkv[0].bias is not None else None
                    gate_up_w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
                # Llama's post_attention_layernorm is the MLP's input norm; in Gemma's sandwich it normalises
                # attention's output, and pre_feedforward_layernorm is the MLP's input norm.
                ln2 = layer.pre_feedforward_layernorm if arch.sandwich else layer.post_attention_layernorm
                self.layers.append(
                    dict(
                        ln1=layer.input_layernorm.weight,
                        ln2=ln2.weight,
                        post_attn=layer.post_attention_layernorm.weight if arch.sandwich else None,
                        post_mlp=layer.post_feedforward_layernorm.weight if arch.sandwich else None,
                        q_norm=att.q_norm.weight if arch.qk_norm else None,
                        k_norm=att.k_norm.weight if arch.qk_norm else None,
                        window=arch.windows[i],
                        rope=self.rope_kinds.index(arch.rope_kinds[i]),
                        qkv=Linear(qkv_w, qkv_b, self.pack),
                        o=Linear(att.o_proj.weight.detach(), att.o_proj.bias, self.pack),
                        gate_up=Linear(gate_up_w, None, self.pack),
                        down=Linear(mlp.down_proj.weight.detach(), None, self.pack),
                    )
                )
        self.intermediate = self.layers[0]["down"].in_features
        # The prefill's causal attention: in fp32 as every other attention of the engine ("fp32"), over q, k, v
        # cast to the model's dtype ("model", what HF's SDPA runs), or "auto": whichever of the two this machine
        # runs faster, timed once per process (`prefill_attention_for`). Exactness holds either way: plain and
        # speculative decoding run the same prefill. `python -m scripts.bench.long` times both beside HF's forward.
        self.prefill_attention = "auto"
        # Each weight's kernel gives every row the same bits over its own range of row counts on this machine
        # (probed per shape): `Linear` pads a call below it and splits one above it, so the rest of the forward runs
        # on the real rows. (On an AMX CPU in bf16: 1-32 rows; without AMX from 1-4 rows up.)
        self.weight_rows: dict[str, tuple[int, int | None]] = {}
        for name in ("qkv", "o", "gate_up", "down", "lm_head"):
            lin = self.lm_head if name == "lm_head" else self.layers[0][name]
            self.keep_rows(name, linear_rows(self.dtype, lin.in_features, lin.out_features, packed=self.pack))

    def keep_rows(self, name: str, rows: tuple[int, int | None]) -> None:
        """Every kernel call of weight `name` (qkv, o, gate_up, down, lm_head), in every layer, over rows[0] to
        rows[1] rows (None: no limit): see `Linear`."""
        self.weight_rows[name] = rows
        if name == "lm_head":
            self.lm_head = self.lm_head.with_rows(*rows)  # a view: drafters sharing the packed head keep theirs
        else:
            for w in self.layers:
                w[name] = w[name].with_rows(*rows)

    def min_rows(self, max_length: int) -> int:
        """Tokens a forward must have so that attention's two fp32 products (scores, and values per key block),
        whose rows are group * tokens (GQA), are batch-invariant on this machine. The weight matmuls pad themselves
        (`weight_rows`)."""
        # Attention's products as `_attend` runs them: scores over the whole cache's keys, values per 64-key block.
        scores = min_invariant_rows(torch.float32, [(self.head_dim, max_length)], heads=self.num_kv_heads)
        values = min_invariant_rows(torch.float32, [(KEY_BLOCK, self.head_dim)],
                                    heads=self.num_kv_heads * (max_length // KEY_BLOCK))
        group = self.num_heads // self.num_kv_heads
        return -(-max(scores, values) // group)

    def pad_rows(self, min_rows: int) -> int:
        """The row count short forwards are padded to: of the probed counts from `min_rows` to MAX_PAD_ROWS (each
        gives the same bits, `min_invariant_rows` checked them), the one whose one-token step runs fastest here,
        timed once per dtype, thread count and model shape (~40 one-token forwards)."""
        candidates = [r for r in _PROBE_ROWS if min_rows <= r <= MAX_PAD_ROWS] or [min_rows]
        key = (self.dtype, torch.get_num_threads(), self.pack, min_rows, self.num_layers, self.embed.shape)
        if key not in _PAD_ROWS:
            _PAD_ROWS[key] = fastest(candidates, self._step_timer(min_rows)) if len(candidates) > 1 else candidates[0]
        return _PAD_ROWS[key]

    def _step_timer(self, min_rows: int) -> Callable[[int], float]:
        """Seconds one one-token step takes padded to r rows, on a 32-token prefix of a scratch cache."""
        cache = StaticCache(self, *_cache_tensors(self, KEY_BLOCK), min_rows=min_rows, pad_rows=min_rows)
        tokens = torch.arange(33, device=self.embed.device)[None] % self.embed.shape[0]
        forward(cache, tokens[:, :32])

        def step(rows: int) -> float:
            cache.length, cache.pad_rows = 32, rows
            start = time.perf_counter()
            forward(cache, tokens[:, 32:])
            return time.perf_counter() - start

        return step


def prefill_attention_for(engine: Engine, seconds: Callable[[str], float] | None = None) -> str:
    """The dtype the prefill's causal attention runs in: `engine.prefill_attention` where set ("fp32" or "model"),
    else ("auto") "model" where that is at least PREFILL_MARGIN times faster than fp32 on this machine, else "fp32".
    On a CPU with AMX, bf16 products run about 5x fp32's, and HF's forward, whose attention runs in bf16, led
    ours (fp32 attention) by 1.4-1.6x at 1-1.5k tokens; on one without AMX the two tie (measured) and fp32 stays, so
    a machine does not flip between them from one process to the next. Timed once per process, dtype, thread count
    and head shape, on one layer's attention over PREFILL_PROBE_TOKENS random tokens (0.2 s on a 2-core CPU);
    `seconds(choice)` replaces the timer (tests)."""
    if engine.prefill_attention != "auto":
        return engine.prefill_attention
    if engine.dtype == torch.float32:
        return "fp32"  # the same kernel either way
    hq, hkv, dh = engine.num_heads, engine.num_kv_heads, engine.head_dim
    key = (engine.dtype, torch.get_num_threads(), hq, hkv, dh, engine.embed.device.type)
    timed = seconds is None
    if timed and key in _PREFILL_ATTENTION:
        return _PREFILL_ATTENTION[key]
    if seconds is None:
        gen = torch.Generator().manual_seed(0)
        t, device = PREFILL_PROBE_TOKENS, engine.embed.device
        q, k, v = (torch.randn(1, h, t, dh, generator=gen).to(device) for h in (hq, hkv, hkv))

        def seconds(choice: str) -> float:
            start = time.perf_counter()
            _causal_attention(engine, q, k, v, choice)
            return time.perf_counter() - start

    best = least_seconds(("fp32", "model"), seconds)
    choice = "model" if best["model"] * PREFILL_MARGIN <= best["fp32"] else "fp32"
    if timed:
        _PREFILL_ATTENTION[key] = choice
    return choice


def _causal_attention(e: Engine, q: Tensor, k: Tensor, v: Tensor, choice: str) -> Tensor:
    """The prefill's causal SDPA of fp32 q (B, Hq, T, Dh) over k, v (B, Hkv, T, Dh), q pre-scaled: in fp32, or over
    q, k, v cast to the model's dtype ("model"). (B, Hq, T, Dh)."""
    if choice == "model" and e.dtype != torch.float32:
        q, k, v = q.to(e.dtype), k.to(e.dtype), v.to(e.dtype)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0, enable_gqa=e.num_heads != e.num_kv_heads)


def least_seconds(candidates: Sequence[T], seconds: Callable[[T], float], rounds: int = 3,
                  reps: int = 2) -> dict[T, float]:
    """Each candidate's least time, each timed `reps` times per round after a warm call, rounds interleaved (a burst
    of load lands on every candidate alike)."""
    best = {c: float("inf") for c in candidates}
    for c in candidates:
        seconds(c)
    for _ in range(rounds):
        for c in candidates:
            best[c] = min(best[c], *(seconds(c) for _ in range(reps)))
    return best


def fastest(candidates: Sequence[int], seconds: Callable[[int], float], rounds: int = 3, reps: int = 2) -> int:
    """The candidate with the least time (`least_seconds`); ties go to the smaller."""
    best = least_seconds(candidates, seconds, rounds, reps)
    return min(candidates, key=lambda c: (best[c], c))


@dataclass
class StaticCache:
    """Keys and values of every layer in one fp32 buffer `kv` (layers, B, 2 H_kv, max_length, Dh): keys in heads
    0..H_kv-1, values after them, so one copy writes a forward's keys and values and one gather commits them;
    `length` entries are committed. `rot_cos` / `rot_sin` (max_length, H_q + 2 H_kv, Dh) rotate a forward's fused
    q/k/v in one pass: rotary on the key heads, rotary times the attention scale on the query heads, the identity on
    the value heads (cos 1, sin 0), with rotate-half's sign folded into sin."""

    engine: Engine
    kv: Tensor
    rot_cos: Tensor
    rot_sin: Tensor
    min_rows: int  # the fewest rows a forward may have and stay batch-invariant
    pad_rows: int  # what short forwards are padded to (>= min_rows, the fastest here)
    length: int = 0
    trim_keys: bool = False  # far keys read up to the last block a forward reaches (trimmed_keys_invariant holds)

    @property
    def max_length(self) -> int:
        return self.kv.shape[3]

    @property
    def k(self) -> Tensor:
        return self.kv[:, :, : self.engine.num_kv_heads]

    @property
    def v(self) -> Tensor:
        return self.kv[:, :, self.engine.num_kv_heads :]


def new_cache(model: nn.Module | Engine, max_length: int, batch_size: int = 1, trim: bool = True) -> StaticCache:
    """A cache for up to `max_length` tokens (prompt + max_new_tokens + tree nodes), rounded up to KEY_BLOCK.
    `trim=False` attends the whole cache in every forward even where trimming was found exact (for comparison)."""
    engine = model if isinstance(model, Engine) else Engine(model)
    length = -(-max(max_length, 1) // KEY_BLOCK) * KEY_BLOCK
    min_rows = engine.min_rows(length)
    prefill_attention_for(engine)  # timed once per process, here rather than inside the first (timed) prefill
    return StaticCache(engine, *_cache_tensors(engine, length, batch_size), min_rows=min_rows,
                       pad_rows=engine.pad_rows(min_rows),
                       trim_keys=trim and trimmed_keys_invariant(engine, length, min_rows))


def _cache_tensors(engine: Engine, length: int, batch_size: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """A zeroed kv buffer and the rotation tables (StaticCache) for `length` positions."""
    device = engine.embed.device
    hq, hkv, dh = engine.num_heads, engine.num_kv_heads, engine.head_dim
    positions = torch.arange(length, device=device)[None]  # (1, L)
    x = torch.zeros(1, device=device, dtype=torch.float32)
    half = dh // 2
    heads = lambda q, k, v: torch.stack([q] * hq + [k] * hkv + [v] * hkv, dim=1)  # (L, Hq + 2 Hkv, Dh)
    cos_tables, sin_tables = [], []
    for kind in engine.rope_kinds:  # one table per rotary kind (Gemma 3: local and global theta)
        cos, sin = engine.rotary(x, positions) if kind is None else engine.rotary(x, positions, kind)  # (1, L, Dh)
        cos, sin = cos[0].float(), sin[0].float()
        sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)  # rotate_half(x) * sin == swap_halves(x) * signed sin
        cos_tables.append(heads(cos * engine.scale, cos, torch.ones_like(cos)))
        sin_tables.append(heads(sin * engine.scale, sin, torch.zeros_like(sin)))
    return (
        torch.zeros(engine.num_layers, batch_size, 2 * hkv, length, dh, device=device),
        torch.stack(cos_tables),  # (R, L, Hq + 2 Hkv, Dh)
        torch.stack(sin_tables),
    )


def cache_length(cache: StaticCache) -> int:
    return cache.length


def _rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    # As HF's LlamaRMSNorm: statistics in fp32, cast back, then scale; Gemma's (offset 1): scaled by 1 + w in fp32,
    # then cast.
    if offset:
        return (F.rms_norm(x.float(), weight.shape, eps=eps) * (offset + weight.float())).to(x.dtype)
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def _softcap(x: Tensor, cap: float | None) -> Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


def _qkv(e: Engine, w: dict, x: Tensor, cos: Tensor, sin: Tensor, dense: bool = False) -> Tensor:
    """The layer's fused q/k/v of normed input x (B, T, D), per-head q/k norms where the architecture has them, then
    rotary (and the attention scale on q) in fp32: (B, T, Hq + 2 Hkv, Dh)."""
    bsz, t = x.shape[:2]
    hq, hkv = e.num_heads, e.num_kv_heads
    y = (w["qkv"].dense(x) if dense else w["qkv"](x)).view(bsz, t, hq + 2 * hkv, e.head_dim)
    if w["q_norm"] is not None:
        y = torch.cat([_rms_norm(y[:, :, :hq], w["q_norm"], e.eps, e.arch.norm_offset),
                       _rms_norm(y[:, :, hq : hq + hkv], w["k_norm"], e.eps, e.arch.norm_offset),
                       y[:, :, hq + hkv :]], dim=2)
    return _rotate(y.float(), cos, sin)


def _residual(e: Engine, w: dict, h: Tensor, att: Tensor, dense: bool = False) -> Tensor:
    """The rest of a layer after attention's output att (B, T, Hq Dh), in the model dtype: o_proj (and the sandwich
    norm), then the MLP."""
    lin = (lambda name, v: w[name].dense(v)) if dense else (lambda name, v: w[name](v))
    off = e.arch.norm_offset
    out = lin("o", att)
    h = h + (out if w["post_attn"] is None else _rms_norm(out, w["post_attn"], e.eps, off))
    x = _rms_norm(h, w["ln2"], e.eps, off)
    gate, up = lin("gate_up", x).split(e.intermediate, dim=-1)
    out = lin("down", e.act(gate) * up)
    return h + (out if w["post_mlp"] is None else _rms_norm(out, w["post_mlp"], e.eps, off))


def _embed(e: Engine, tokens: Tensor) -> Tensor:
    h = F.embedding(tokens, e.embed)  # (B, T, D)
    return h if e.embed_scale is None else h * e.embed_scale


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary with rotate-half's sign already in `sin` (StaticCache.rot_sin)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin


def _window_slots(prefix: int, offsets: Tensor, visible: Tensor, window: int) -> tuple[Tensor, Tensor]:
    """For each new token j at position t_j = prefix + offsets[j]: the cache slots holding positions t_j - W + 1 ..
    t_j along its own path (W, oldest first), and an additive mask hiding positions < 0. Positions before the
    prefix sit in their own slot; new ones in the slot of the token at that depth that j sees (itself included)."""
    t, cols = visible.shape  # rows may include the padding repeats of the last token
    depth = offsets[None, :cols] == torch.arange(int(offsets.max()) + 1, device=offsets.device)[:, None]  # (D+1, T)
    seen = visible[:, None, :] & depth[None]  # (Tp, D+1, T): token i is j's ancestor at depth e
    counts = seen.sum(-1)  # (T, D+1)
    expected = torch.arange(counts.shape[1], device=offsets.device)[None] <= offsets[:, None]
    if not torch.equal(counts, expected.long()):
        raise UserError(
            "tree_mask/positions do not describe a tree: every node must see exactly one node at each depth from 0 "
            f"to its own (itself included). Seen per node and depth: {counts.tolist()}. Build them with "
            "eval.engine.tree.tree_buffers."
        )
    ancestor = seen.float().argmax(-1)  # (T, D+1) index of the ancestor at each depth
    pos = prefix + offsets[:, None] - window + 1 + torch.arange(window, device=offsets.device)  # (T, W)
    new = pos >= prefix
    slots = torch.where(new, prefix + ancestor.gather(1, (pos - prefix).clamp(min=0)), pos.clamp(min=0))
    mask = torch.zeros(t, window, device=offsets.device).masked_fill_(pos < 0, float("-inf"))
    return slots, mask


def _attend(q: Tensor, kv: Tensor, far_len: int, far_mask: Tensor, flat_slots: Tensor, near_mask: Tensor,
            softcap: float | None = None) -> Tensor:
    """fp32 attention of q (B, Hkv, G Tp, Dh), query heads grouped by kv head, over the far keys (cache slots
    0..far_len-1, `far_mask` (Tp, far_len) hiding those a row does not see) and each row's W near keys (cache slots
    `flat_slots` (Tp W,), `near_mask` (Tp, W)); kv (B, 2 Hkv, L, Dh) holds keys, then values; scores soft-capped
    by `softcap` where the architecture sets it (elementwise, so batch-invariant). Returns (B, Hkv, G, Tp, Dh) fp32."""
    bsz, hkv, window = q.shape[0], kv.shape[1] // 2, near_mask.shape[1]
    tp, dh = near_mask.shape[0], q.shape[-1]
    group = q.shape[2] // tp
    kc, vc = kv[:, :hkv, :far_len], kv[:, hkv:, :far_len]
    far = torch.matmul(q, kc.transpose(-1, -2))  # (B, Hkv, G Tp, Lf)
    far = _softcap(far.view(bsz, hkv, group, tp, -1), softcap) + far_mask
    kn, vn = kv.index_select(2, flat_slots).view(bsz, 2, hkv, 1, tp, window, dh).unbind(1)
    near = _softcap((q.view(bsz, hkv, group, tp, 1, dh) * kn).sum(-1), softcap) + near_mask  # (B, Hkv, G, Tp, W)
    probs = torch.softmax(torch.cat([far, near], dim=-1), dim=-1)
    p_far, p_near = probs.split([far_len, window], dim=-1)
    # Values: one product per 64-key block, the blocks then summed in order (cumsum is a sequential scan), so blocks
    # past the last one a row sees add exact zeros at the end. One product over all far_len keys would not do: the
    # matmul kernel splits a long reduction into pieces whose sizes follow its length (measured: 256 and 320 keys
    # sum the same 150 terms differently).
    blocks = far_len // KEY_BLOCK
    p_blocks = p_far.reshape(bsz, hkv, group * tp, blocks, KEY_BLOCK).transpose(2, 3)  # (B, Hkv, nb, G Tp, 64)
    att = torch.matmul(p_blocks, vc.reshape(bsz, hkv, blocks, KEY_BLOCK, dh)).cumsum(2)[:, :, -1]  # (B, Hkv, G Tp, Dh)
    return att.view(bsz, hkv, group, tp, dh) + (p_near[..., None] * vn).sum(-2)


def far_keys(cache: StaticCache, last_position: int) -> int:
    """How many cache slots a forward whose last token sits at `last_position` attends as far keys: the blocks up to
    the last position any of its rows sees there (positions < t - W + 1), at least one block; the whole cache unless
    `cache.trim_keys`."""
    if not cache.trim_keys:
        return cache.max_length
    reach = last_position - WINDOW + 1  # far slots 0..reach-1
    return min(cache.max_length, max(KEY_BLOCK, -(-reach // KEY_BLOCK) * KEY_BLOCK))


_TRIM: dict[tuple, bool] = {}


def trimmed_keys_invariant(engine: Engine, max_length: int, min_rows: int) -> bool:
    """Whether attention gives the same bits whatever number of far-key blocks it reads past the last one a row
    sees (masked keys add exact zeros, and keys sit in the same SIMD lanes since blocks are 64 wide, but a matmul
    kernel may still sum another way for another length): probed on random data, through `_attend` itself, for
    forwards of min_rows..64 tokens, every block count from the one a row needs up to `max_length`. Memoised per
    shape and thread count. False keeps every forward on the whole cache (the old, always-exact layout)."""
    hkv, group, dh = engine.num_kv_heads, engine.num_heads // engine.num_kv_heads, engine.head_dim
    key = (hkv, group, dh, max_length, min_rows, torch.get_num_threads())
    if key in _TRIM:
        return _TRIM[key]
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(1, 2 * hkv, max_length, dh, generator=gen)
    ok = True
    for tp in sorted({r for r in _PROBE_ROWS if min_rows <= r <= 64} | {min_rows}):
        q = torch.randn(1, hkv, group * tp, dh, generator=gen)
        for last in sorted({WINDOW + 5, KEY_BLOCK + WINDOW, max_length // 2 + 7, max_length - 1}):
            if last >= max_length or last - tp + 1 < 0:
                continue
            pos = last - tp + 1 + torch.arange(tp)
            near = pos[:, None] - WINDOW + 1 + torch.arange(WINDOW)  # each row's own recent slots (a chain)
            near_mask = torch.zeros(tp, WINDOW).masked_fill_(near < 0, float("-inf"))
            flat = near.clamp(min=0).flatten()
            outs = []
            for far_len in range(max(KEY_BLOCK, -(-(last - WINDOW + 1) // KEY_BLOCK) * KEY_BLOCK), max_length + 1,
                                 KEY_BLOCK):
                mask = torch.zeros(tp, far_len).masked_fill_(torch.arange(far_len)[None] > (pos - WINDOW)[:, None],
                                                              float("-inf"))
                outs.append(_attend(q, kv, far_len, mask, flat, near_mask))
            ok = ok and all(torch.equal(o, outs[-1]) for o in outs)
    _TRIM[key] = ok
    return ok


def _prefill(cache: StaticCache, tokens: Tensor, wanted: list[int] | None, last_logits: bool) -> ForwardOutput:
    """The first forward into an empty cache (a prompt), at matmul speed: every weight product in one kernel call
    over all the prompt's rows, causal attention by SDPA (fp32 like the rest of the engine's attention, or in the
    model's dtype where this machine runs that faster: `prefill_attention_for`), the vocabulary head over the last
    position only when `last_logits`. Deterministic (the same prompt gives the same bits) but not batch-invariant,
    and need not be: plain and speculative decoding run this same call on the same prompt, and every later forward
    (one-token steps, chains, trees) reads the keys it leaves in the cache through the batch-invariant path. Linear
    in the prompt's length but for attention's T^2 / 2 products."""
    e = cache.engine
    bsz, t = tokens.shape
    hq, hkv, dh = e.num_heads, e.num_kv_heads, e.head_dim
    cos, sin = cache.rot_cos[:, :t], cache.rot_sin[:, :t]  # (R, T, Hq + 2 Hkv, Dh); q rows carry the scale
    kept: dict[int, Tensor] = {}
    h = _embed(e, tokens)  # (B, T, D)
    off, cap = e.arch.norm_offset, e.arch.attn_softcap
    ahead = torch.arange(t, device=tokens.device)
    distance = ahead[:, None] - ahead[None]  # (T, T): query minus key position
    attention = prefill_attention_for(e)
    for i, w in enumerate(e.layers):
        if wanted is not None and i in wanted:
            kept[i] = h
        x = _rms_norm(h, w["ln1"], e.eps, off)
        qkv = _qkv(e, w, x, cos[w["rope"]], sin[w["rope"]], dense=True)  # (B, T, Hq + 2 Hkv, Dh)
        kv = cache.kv[i]  # (B, 2 Hkv, L, Dh)
        kv[:, :, :t] = qkv[:, :, hq:].transpose(1, 2)
        q = qkv[:, :, :hq].transpose(1, 2)  # (B, Hq, T, Dh)
        k, v = kv[:, :hkv, :t], kv[:, hkv:, :t]
        if cap is not None or w["window"] is not None:  # soft-capping or a window: scores by hand, same fp32 math
            group = hq // hkv
            scores = _softcap(torch.matmul(q, k.repeat_interleave(group, 1).transpose(-1, -2)), cap)  # (B, Hq, T, T)
            seen = (distance >= 0) & (distance < (w["window"] or t + 1))
            att = torch.matmul(torch.softmax(scores.masked_fill(~seen, float("-inf")), -1),
                               v.repeat_interleave(group, 1))  # (B, Hq, T, Dh)
        else:
            att = _causal_attention(e, q, k, v, attention)  # (B, Hq, T, Dh)
        h = _residual(e, w, h, att.transpose(1, 2).reshape(bsz, t, hq * dh).to(e.dtype), dense=True)
    h = _rms_norm(h, e.norm, e.eps, off)
    head = h[:, -1:] if last_logits else h
    logits = e.lm_head.dense(head) if isinstance(e.lm_head, Linear) else e.lm_head(head)  # (B, 1 or T, V)
    logits = _softcap(logits, e.arch.final_softcap)
    cache.length = t
    if wanted is None:
        return ForwardOutput(logits=logits, hidden=h)
    kept[e.num_layers] = h
    return ForwardOutput(logits=logits, hidden=torch.cat([kept[i] for i in wanted], dim=-1))  # (B, T, K*D)


@torch.inference_mode()
def forward(
    cache: StaticCache,
    tokens: Tensor,
    positions: Tensor | None = None,
    tree_mask: Tensor | None = None,
    hidden_layers: Sequence[int] | None = None,
    last_logits: bool = False,
) -> ForwardOutput:
    """Run the verifier over `tokens` (B, T) after the `cache.length` committed ones, writing their keys/values into
    slots length..length+T-1.

    Without `tree_mask`: a plain continuation (causal, positions length + 0..T-1), committed at once. With
    `tree_mask` (T, T) and `positions` (T,) offsets: tree nodes at positions length + depth, each seeing the prefix,
    its ancestors and itself; nothing is committed until `commit`. `hidden_layers` as in eval.engine.hf_forward.forward
    (0 = embeddings, i = input of layer i, -1 or num_layers = after the final norm); None gives the last one.
    A plain continuation into an empty cache (the prompt) is the prefill (`_prefill`: deterministic, at matmul
    speed, not batch-invariant); `last_logits` then computes the vocabulary head at the last position only.
    """
    e = cache.engine
    bsz, t = tokens.shape
    prefix = cache.length
    if t == 0:
        raise UserError(f"forward needs at least one token; got tokens of shape {tuple(tokens.shape)}.")
    if prefix + t > cache.max_length:
        raise UserError(
            f"The verifier cache holds {cache.max_length} tokens and this forward needs {prefix + t} "
            f"({prefix} cached + {t} new). Build it with new_cache(model, max_length) for prompt + max_new_tokens "
            f"+ tree nodes."
        )
    dev = tokens.device
    offsets = torch.arange(t, device=dev) if positions is None else positions.to(dev)
    if offsets.shape != (t,) or (tree_mask is not None and tree_mask.shape != (t, t)):
        raise UserError(
            f"{t} tokens need positions of shape ({t},) and a tree_mask of shape ({t}, {t}); got "
            f"{tuple(offsets.shape)} and {None if tree_mask is None else tuple(tree_mask.shape)}."
        )
    wanted = None if hidden_layers is None else [i % (e.num_layers + 1) for i in hidden_layers]
    if tree_mask is None and prefix == 0 and positions is None:
        return _prefill(cache, tokens, wanted, last_logits)
    if tree_mask is None:
        visible = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
    else:
        visible = tree_mask.to(dev, torch.bool)
        if int(offsets.max()) >= WINDOW:
            raise UserError(
                f"The tree is {int(offsets.max())} deep; the engine's exact attention handles depth < {WINDOW}. "
                f"Use a shallower tree (tree depth / number of draft tokens below {WINDOW})."
            )
    # 1. Pad to pad_rows (>= min_rows) by repeating the last token (same position, same mask row): every matmul sees
    #    >= min_rows rows, so each row's bits do not depend on T. The repeats write the same keys into the same slot.
    pad = max(cache.pad_rows - t, 0)
    if pad:
        tokens = torch.cat([tokens, tokens[:, -1:].expand(bsz, pad)], dim=1)
        offsets = torch.cat([offsets, offsets[-1:].expand(pad)])
        visible = torch.cat([visible, visible[-1:].expand(pad, t)], dim=0)
    tp = t + pad
    pos = prefix + offsets  # (Tp,)
    cos, sin = cache.rot_cos[:, pos], cache.rot_sin[:, pos]  # (R, Tp, Hq + 2 Hkv, Dh)
    # 2. Which keys a token sees, split by its own position t only, so that the split is the same whatever forward
    #    computes it: far keys (positions < t - W + 1, always committed, each in its own slot) attended with a mask,
    #    up to the last 64-slot block any row reaches (`far_len`; the whole cache unless cache.trim_keys, i.e. unless
    #    the probe found the bits do not depend on that length); the W most recent positions gathered along the
    #    token's own path, oldest first.
    slots, near_mask = _window_slots(prefix, offsets, visible, WINDOW)  # (Tp, W)
    far_len = far_keys(cache, prefix + int(offsets.max()))
    far_mask = torch.zeros(tp, far_len, device=dev)
    far_mask.masked_fill_(torch.arange(far_len, device=dev)[None] > (pos - WINDOW)[:, None], float("-inf"))
    flat_slots = slots.flatten()
    # A sliding window (a token sees keys at distance < S) hides more far keys and, when S < W, the oldest near
    # ones: both by the token's own position only, so still batch-invariant.
    masks = {None: (far_mask, near_mask)}
    for s in {w["window"] for w in e.layers} - {None}:
        far_s = far_mask.masked_fill(torch.arange(far_len, device=dev)[None] <= (pos - s)[:, None], float("-inf"))
        near_s = near_mask.clone()
        near_s[:, : max(WINDOW - s, 0)] = float("-inf")
        masks[s] = (far_s, near_s)

    kept: dict[int, Tensor] = {}
    h, hq, hkv, dh = _embed(e, tokens), e.num_heads, e.num_kv_heads, e.head_dim  # h: (B, Tp, D)
    group = hq // hkv
    for i, w in enumerate(e.layers):
        if wanted is not None and i in wanted:
            kept[i] = h[:, :t]
        # 3. Attention, fp32. One rotation pass over fused q/k/v: rotary on k, rotary and the scale on q, v as is.
        x = _rms_norm(h, w["ln1"], e.eps, e.arch.norm_offset)
        qkv = _qkv(e, w, x, cos[w["rope"]], sin[w["rope"]])  # (B, Tp, Hq + 2 Hkv, Dh)
        kv = cache.kv[i]  # (B, 2 Hkv, L, Dh): keys, then values
        kv[:, :, prefix : prefix + t] = qkv[:, :t, hq:].transpose(1, 2)
        q = qkv[:, :, :hq].transpose(1, 2).reshape(bsz, hkv, group * tp, dh)  # query heads sharing a kv head (GQA)
        far_w, near_w = masks[w["window"]]
        att = _attend(q, kv, far_len, far_w, flat_slots, near_w, e.arch.attn_softcap).to(e.dtype)  # (B,Hkv,G,Tp,Dh)
        # 4. o_proj and the MLP (with Gemma's sandwich norms).
        h = _residual(e, w, h, att.view(bsz, hq, tp, dh).transpose(1, 2).reshape(bsz, tp, hq * dh))
    h = _rms_norm(h, e.norm, e.eps, e.arch.norm_offset)
    logits = _softcap(e.lm_head(h)[:, :t], e.arch.final_softcap)  # (B, T, V)
    if tree_mask is None:
        cache.length = prefix + t
    if wanted is None:
        return ForwardOutput(logits=logits, hidden=h[:, :t])
    kept[e.num_layers] = h[:, :t]
    return ForwardOutput(logits=logits, hidden=torch.cat([kept[i] for i in wanted], dim=-1))  # (B, T, K*D)


def commit(cache: StaticCache, prefix_len: int, nodes: Tensor) -> None:
    """Keep the entries of new tokens `nodes` (B, A), indices counted from `prefix_len`, in that order, right after
    the prefix; the cache then holds prefix + A tokens. In place: one gather over all layers, no reallocation."""
    bsz, a = nodes.shape
    if not bool((nodes == torch.arange(a, device=nodes.device)).all()):  # a chain's path needs no move
        if bsz != 1 and not bool((nodes == nodes[:1]).all()):
            raise UserError(f"commit takes one accepted path for the whole batch; got {nodes.tolist()}.")
        slots = prefix_len + nodes[0].to(cache.kv.device)
        cache.kv[:, :, :, prefix_len : prefix_len + a] = cache.kv.index_select(3, slots)
    cache.length = prefix_len + a
