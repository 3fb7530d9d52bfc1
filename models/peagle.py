"""P-EAGLE (parallel EAGLE-3; arXiv 2602.01469): EAGLE-3's drafter that drafts K tokens in one forward.

The network is EAGLE-3's (models/eagle.py `Eagle3Net`) plus one learned vector, `mask_hidden`, in the space of the
concatenated verifier features (before `fc`). A round's drafter forward holds K query slots after the committed
context: slot 0 is EAGLE-3's step 0 at the last committed position (the root token with the verifier's features,
predicting the depth-1 draft); slot d = 1..K-1 holds the mask token `mask_token_id` with the feature
fc(mask_hidden), at rotary position P-1+d, attends the context and slots 0..d (causal), and predicts the depth-(d+1)
draft. So each depth's distribution is conditioned on the context alone, not on the drafts before it: one forward
gives K marginals, and a Medusa-style tree (each depth's top-k, the same for every parent) fills from them.

Training (`parallel_rows`): step 0 over every position, as EAGLE-3; then chains of mask slots after sampled anchors,
COD-style (PARD's conditional drop-token, as the vLLM project's trainer samples them): depth d keeps a share
max(ratio^d, min_ratio) of the anchors whose chain reached depth d-1, so the deep slots cost a fraction of K dense
copies. A depth-d row at anchor a sits at position a+d, sees the step-0 keys at positions <= a and its own chain's
slots 1..d, and its target is q at position a+d+1 (x_{a+d+2}): exactly what slot d sees at decode time.

The export is vLLM's `peagle` speculators type: the EAGLE-3 tensors, `mask_hidden`, and `mask_token_id` (served as
method eagle3 with parallel drafting).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from models.eagle import Eagle3Net, UnrolledStep, step_inputs
from models.eagle_layers import UnrollMask
from runtime.errors import UserError


def check_mask_token(mask_token_id: Any, vocab_size: int, where: str = "model.mask_token_id") -> int:
    """A mask token id must be a whole number inside the verifier's vocabulary."""
    if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int) or not 0 <= mask_token_id < vocab_size:
        raise UserError(f"{where}={mask_token_id!r}: the mask token must be a token id in 0..{vocab_size - 1} (the "
                        f"verifier's vocabulary), one the training data never holds (SmolLM2: 16, <empty_output>).")
    return int(mask_token_id)


def check_parallel(parallel: Any, where: str = "model.parallel_tokens", window: int | None = None) -> int:
    """K, the tokens one forward drafts: at least 1, and the context window must hold them."""
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise UserError(f"{where}={parallel!r}: give the number of tokens one drafter forward drafts, a whole number "
                        f">= 1 (P-EAGLE's published recipes use 4-8).")
    if window is not None and parallel >= window:
        raise UserError(f"{where}={parallel}: the verifier's window ({window} positions) cannot hold a block of "
                        f"{parallel} drafts after a prompt; use fewer.")
    return int(parallel)


class PEagleNet(Eagle3Net):
    """EAGLE-3's network with a learned mask feature: `parallel` drafts per forward (see the module docstring)."""

    kind = "peagle"

    def __init__(self, mask_token_id: int, parallel: int = 4, **eagle3: Any) -> None:
        if eagle3.get("norm_output"):
            raise UserError("model.norm_output changes what one drafted step passes to the next; P-EAGLE drafts every "
                            "depth in one forward (vLLM ignores it there). Leave it false; model.fc_norm applies.")
        super().__init__(**eagle3)
        self.mask_token_id = check_mask_token(mask_token_id, self.vocab_size)
        self.parallel = check_parallel(parallel)
        # The feature of a mask slot, before fc (vLLM: `mask_hidden`, n_aux * H): small, so early training reads the
        # mask slots mostly through their position and the token embedding.
        self.mask_hidden = nn.Parameter(torch.randn(len(self.aux_layer_ids) * self.hidden_size) * 0.02)

    def mask_feature(self) -> Tensor:
        """fc(mask_hidden) (each chunk normalised first with fc_norm, as vLLM fuses it): the hidden input of every mask
        slot. (D,)"""
        return self.fuse(self.mask_hidden)

    def mask_slots(self, count: int, cache_length: int, past_k: Tensor, past_v: Tensor, embed: nn.Module) -> Tensor:
        """Decode time: the outputs of mask slots 1..count after a context of `cache_length` committed positions whose
        step-0 keys are past_k/past_v (B, H_kv, P, hd): slot d at rotary position P-1+d, seeing the whole context and
        slots 1..d. Returns (B, count, D)."""
        bsz, dev = past_k.shape[0], past_k.device
        hid = self.mask_feature()[None, None].expand(bsz, count, -1)
        emb = embed(torch.full((bsz, count), self.mask_token_id, device=dev))
        pos = (cache_length - 1 + torch.arange(1, count + 1, device=dev))[None].expand(bsz, count)
        own = torch.ones(count, count, dtype=torch.bool, device=dev).tril()
        mask = torch.cat([own.new_ones(count, cache_length), own], dim=1)[None, None].expand(bsz, 1, -1, -1)
        out, _, _ = self.step(hid, emb, pos, mask, past_k, past_v)
        return out


def cod_anchors(valid: Sequence[Tensor], ratio: float, min_ratio: float, max_anchors: int | None,
                generator: torch.Generator | None = None) -> list[Tensor]:
    """Which (row, anchor) pairs get a mask slot at each depth d = 1..D (COD sampling). `valid[d]` (B, n): the
    depth-d target of anchor a exists and is an assistant token. Depth 1 keeps a random `max(ratio, min_ratio)`
    share of its valid anchors (at most `max_anchors` per row); depth d keeps, of the anchors depth d-1 kept whose
    depth-d target is valid, as many as a share max(ratio^d, min_ratio) of depth 1's candidates. ratio 1 keeps every
    chain (validation). Returns D bool masks (B, n), each inside the one before."""
    kept: list[Tensor] = []
    if len(valid) < 2:
        return kept
    seeds = valid[1].sum(-1).float()  # (B,) depth-1 candidates per row
    prev = valid[1]
    for d in range(1, len(valid)):
        cand = prev & valid[d] if d > 1 else valid[1]
        share = max(ratio**d, min_ratio) if ratio < 1 else 1.0
        want = (seeds * share).floor().long()
        if max_anchors is not None:
            want = want.clamp(max=max_anchors)
        noise = torch.rand(cand.shape, generator=generator, device=cand.device)
        score = torch.where(cand, noise, torch.full_like(noise, 2.0))  # candidates first, in random order
        order = score.argsort(dim=-1)
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(cand.shape[1], device=cand.device)
                                                 .expand_as(order))
        prev = cand & (rank < want[:, None])
        kept.append(prev)
    return kept


def parallel_rows(net: PEagleNet, feats: Tensor, input_ids: Tensor, attention_mask: Tensor, loss_mask: Tensor,
                  embed: nn.Module, depths: int, ratio: float = 0.7, min_ratio: float = 0.2,
                  max_anchors: int | None = 256, generator: torch.Generator | None = None) -> Iterator[UnrolledStep]:
    """P-EAGLE's training forward over a batch: step 0 over every position (EAGLE-3's, yielded first), then one forward
    over the COD-sampled mask slots of depths 1..`depths`-1, yielded depth by depth as `UnrolledStep`s (the same
    alignment as EAGLE-3's unrolled step d: position t = the anchor, target x_{t+d+2}), so training and validation
    read them as they read the unroll. feats: (B, n, D) F_t for t = 0..n-1, n = T-1."""
    bsz, n = feats.shape[:2]
    dev = input_ids.device
    valid_keys = attention_mask[:, :n].bool()
    causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()[None, None] & valid_keys[:, None, None, :]
    eye = torch.eye(n, dtype=torch.bool, device=dev)
    causal = causal | (eye & ~causal.any(-1, keepdim=True))  # a query with no key (left padding) sees its own
    right_padded = bool((valid_keys[:, 1:] <= valid_keys[:, :-1]).all())
    inputs = [step_inputs(input_ids, loss_mask, d) for d in range(depths)]  # (tokens, valid) (B, n) each
    tok, valid0 = inputs[0]
    with torch.no_grad():
        emb = embed(tok)
    positions = torch.arange(n, device=dev)[None].expand(bsz, n)
    out0, k0, v0 = net.step(feats, emb, positions, UnrollMask(causal, 0, right_padded), None, None)
    b0, t0 = valid0.nonzero(as_tuple=True)
    yield UnrolledStep(out0, valid0, b0, t0, t0)
    if depths == 1:
        return
    kept = cod_anchors([v for _, v in inputs], ratio, min_ratio, max_anchors, generator)  # depths 1..D-1
    # The rows: (batch, anchor, depth), grouped per batch row into M columns (padding columns see only themselves).
    rows_b, rows_a, rows_d = [], [], []
    for d, k in enumerate(kept, start=1):
        b, a = k.nonzero(as_tuple=True)
        rows_b.append(b)
        rows_a.append(a)
        rows_d.append(torch.full_like(b, d))
    rb, ra, rd = torch.cat(rows_b), torch.cat(rows_a), torch.cat(rows_d)
    counts = torch.bincount(rb, minlength=bsz)
    width = max(int(counts.max()), 1)
    order = torch.argsort(rb * (n * depths) + ra * depths + rd, stable=True)  # per batch row, chain by chain
    rb, ra, rd = rb[order], ra[order], rd[order]
    starts = torch.cumsum(counts, 0) - counts
    col = torch.arange(rb.numel(), device=dev) - starts[rb]  # each row's column
    anchor = torch.full((bsz, width), -1, dtype=torch.long, device=dev)
    depth = torch.zeros((bsz, width), dtype=torch.long, device=dev)
    anchor[rb, col], depth[rb, col] = ra, rd
    real = anchor >= 0
    # Keys: step-0 keys s <= anchor (not padding); own chain's slots of depth <= own depth.
    ctx = (torch.arange(n, device=dev)[None, None] <= anchor[..., None]) & valid_keys[:, None, :]  # (B, M, n)
    chain = (anchor[:, :, None] == anchor[:, None, :]) & (depth[:, None, :] <= depth[:, :, None])
    chain &= real[:, :, None] & real[:, None, :]
    chain |= torch.eye(width, dtype=torch.bool, device=dev)[None]  # padding columns: themselves (no NaN)
    mask = torch.cat([ctx, chain], dim=-1)[:, None]  # (B, 1, M, n + M)
    hid = net.mask_feature()[None, None].expand(bsz, width, -1)
    with torch.no_grad():
        emb = embed(torch.full((bsz, width), net.mask_token_id, device=dev))
    pos = torch.where(real, anchor + depth, 0)
    out, _, _ = net.step(hid, emb, pos, mask, k0, v0)  # (B, M, D)
    for d, k in enumerate(kept, start=1):
        sel = rd == d
        yield UnrolledStep(out, k, rb[sel], ra[sel], col[sel])


def build_peagle(verifier: Any, mask_token_id: int, parallel: int, draft_vocab_size: int | None = None,
                 aux_layer_ids: Sequence[int] | None = None, fc_norm: bool = False) -> PEagleNet:
    from models.eagle import layer_config

    return PEagleNet(mask_token_id=check_mask_token(mask_token_id, int(verifier.vocab_size)),
                     parallel=check_parallel(parallel, window=getattr(verifier.config, "max_position_embeddings",
                                                                      None)),
                     draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids, fc_norm=fc_norm,
                     **layer_config(verifier))
