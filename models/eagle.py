"""EAGLE drafters (Li et al., 2024/2025): a one-layer transformer that drafts from the verifier's features.

EAGLE-1 (`kind="eagle"`): the feature f_t is M_q's last hidden state (the input of its lm_head). One step reads
    fc(cat(embed(x_{t+1}), f_t)) -> decoder layer (no input norm) -> predicted f_{t+1}; M_q's own lm_head turns it
    into draft logits. Trained with feature regression + cross-entropy to q.
EAGLE-3 (`kind="eagle3"`): the feature is fc(cat(low, mid, high)) over three M_q layers (the inputs of layers
    2, L//2, L-3 by default). One step reads cat(norm(embed(x_{t+1})), norm(hidden)) -> decoder layer -> its own
    norm and lm_head over a reduced draft vocabulary (`d2t`: draft id -> target id offset, `t2d`: bool mask).
    Later steps feed the layer's own output back as `hidden` (training-time test unrolls this).

Both reuse M_q's token embedding (and, for EAGLE-1, its lm_head) by reference: frozen and never stored here.
Tensor names follow the layouts vLLM and SGLang load (`fc.weight`, `layers.0.*` / `midlayer.*`, `norm.weight`,
`lm_head.weight`, `d2t`, `t2d`); models/exports/io.py writes and reads them. `unroll` is the training-time unroll,
shared by training (train/eagle.py) and offline scoring (scripts/tools/drafter_accuracy.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.eagle_layers import DraftDecoderLayer, RMSNorm, UnrollMask
from models.verifiers.core import Verifier
from runtime.errors import UserError


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high feature layers: the inputs of layers 2, L//2 and L-3 (the engines' own default,
    distinct from L = 7 on); a 3..6-layer verifier gets [0, L//2, L-1]; fewer than 3 layers is refused (no three
    distinct layers: use a deeper verifier, or pass `model.aux_layer_ids` with fewer features)."""
    if num_layers < 3:
        raise UserError(f"EAGLE-3 needs three distinct verifier layers for its default features, but the verifier has "
                        f"only {num_layers} layers (the default [2, L//2, L-3] would be "
                        f"{[2, num_layers // 2, num_layers - 3]}). Use a verifier with >= 3 layers (verifier=tiny: "
                        f"verifier.num_layers=4), or pass model.aux_layer_ids=[...] with fewer feature layers "
                        f"(strictly increasing ids below {num_layers}; the export then records num_aux_hidden_states "
                        f"in transformer_layer_config, where vLLM sizes the drafter's fc from it).")
    engine = [2, num_layers // 2, num_layers - 3]
    return engine if engine[0] < engine[1] < engine[2] else [0, num_layers // 2, num_layers - 1]


def layer_config(verifier: Verifier) -> dict[str, Any]:
    """The drafter layer's shape, taken from the verifier's own config (same family, one layer)."""
    c = verifier.config
    heads = int(c.num_attention_heads)
    rope_params = getattr(c, "rope_parameters", None) or {}
    if isinstance(rope_params.get("full_attention"), dict):  # per layer type (Gemma 3): the draft layer is global
        rope_params = rope_params["full_attention"]
    return {
        "hidden_size": int(c.hidden_size),
        "intermediate_size": int(c.intermediate_size),
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(c, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(c, "head_dim", None) or c.hidden_size // heads),
        "rope_theta": float(rope_params.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
        "rms_norm_eps": float(getattr(c, "rms_norm_eps", 1e-6)),
        "attention_bias": bool(getattr(c, "attention_bias", False)),
        "vocab_size": int(verifier.vocab_size),
        "num_verifier_layers": int(c.num_hidden_layers),
    }


class VerifierFedNet(nn.Module):
    """The base of every drafter network that reads the verifier's hidden states (EAGLE-1, EAGLE-3, P-EAGLE, DFlash
    and the block drafters built on it): the verifier's shapes and the drafter interface (`feature_layers`,
    `features`, `logits`, `draft_to_target`, `target_rank`); an unrolled one (EAGLE's line) adds one draft decoder
    `layer` and its `step`. `shares_verifier_head`: the draft logits come through the verifier's own head (so
    `train_vocab` / `draft_vocab` can cut its rows) rather than an own head. Subclasses build their own input and
    head."""

    kind: str
    shares_verifier_head: bool
    feature_noise: bool  # trained on features with uniform noise added (EAGLE-1's recipe: model.noise)

    def __init__(self, hidden_size: int, intermediate_size: int, num_attention_heads: int, num_key_value_heads: int,
                 head_dim: int, rope_theta: float, rms_norm_eps: float, vocab_size: int, num_verifier_layers: int,
                 attention_bias: bool = False) -> None:
        super().__init__()
        self.hidden_size, self.vocab_size, self.num_verifier_layers = hidden_size, vocab_size, num_verifier_layers
        self._layer_args = dict(hidden_size=hidden_size, intermediate_size=intermediate_size,
                                num_heads=num_attention_heads, num_kv_heads=num_key_value_heads, head_dim=head_dim,
                                rope_theta=rope_theta, eps=rms_norm_eps, attention_bias=attention_bias)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The M_q hidden states the drafter reads, as indices into HF's `hidden_states` (-1: the final-normed last
        layer, i.e. the lm_head input); `features` takes them in this order."""
        raise NotImplementedError

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Map draft-vocabulary ids to verifier ids."""
        return draft_ids

    def target_rank(self, p_logits: Tensor, target: Tensor) -> Tensor:
        """Rank of each verifier-id target under draft logits (see `target_rank`). (N, V_draft) -> (N,)"""
        return target_rank(p_logits, target)

    def features(self, hidden_states: Sequence[Tensor] | Mapping[int, Tensor]) -> Tensor:
        """The drafter's input features F_t from M_q's hidden states, indexed like HF `output_hidden_states`
        (0 = embeddings, i = input of layer i, -1 = final-normed): the tuple itself, or a {layer id: tensor} dict.
        (B, T, D)"""
        raise NotImplementedError

    def logits(self, out: Tensor, verifier_lm_head: nn.Module | None = None) -> Tensor:
        """Draft logits from the layer's output. (B, T, D) -> (B, T, V_draft)"""
        raise NotImplementedError


class Eagle1Net(VerifierFedNet):
    """EAGLE-1: fc(cat(embed(x_{t+1}), f_t)) -> the layer without its input norm -> predicted f_{t+1}; M_q's own
    lm_head makes the draft logits over the full vocabulary."""

    kind = "eagle"
    shares_verifier_head = True  # drafts through M_q's lm_head (so `draft_vocab` can cut its rows)
    feature_noise = True  # trained on features with uniform noise added (EAGLE-1's recipe: model.noise)

    def __init__(self, fc_bias: bool = False, **shape: Any) -> None:
        super().__init__(**shape)
        # Trained here without a bias (the export writes a zero `fc.bias`); a reference checkpoint's trained one loads.
        self.fc = nn.Linear(2 * self.hidden_size, self.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList([DraftDecoderLayer(**self._layer_args, two_inputs=False)])
        self.draft_vocab_size = self.vocab_size

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return (-1,)

    @property
    def layer(self) -> DraftDecoderLayer:
        return self.layers[0]

    def features(self, hidden_states: Sequence[Tensor] | Mapping[int, Tensor]) -> Tensor:
        return hidden_states[-1]

    def carry(self, out: Tensor) -> Tensor:
        return out

    def step(self, hidden: Tensor, embeds: Tensor, positions: Tensor, mask: Tensor, past_k: Tensor | None = None,
             past_v: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """One drafter forward. hidden: features (step 0) or the previous step's output (B, T, D); embeds: M_q's
        embedding of the next tokens (B, T, D). Returns (output (B, T, D), this call's k, v)."""
        dtype = self.fc.weight.dtype
        x = self.fc(torch.cat([embeds.to(dtype), hidden.to(dtype)], dim=-1))  # (B, T, D)
        return self.layer(x, None, positions, mask, past_k, past_v)

    def logits(self, out: Tensor, verifier_lm_head: nn.Module | None = None) -> Tensor:
        return verifier_lm_head(out.to(verifier_lm_head.weight.dtype))


class Eagle3Net(VerifierFedNet):
    """EAGLE-3: F_t = fc(cat(low, mid, high)) over three M_q layers; the layer reads cat(norm(embed), norm(hidden))
    and its own norm and head draft over a reduced vocabulary (`d2t`: draft id -> target id offset, `t2d`: mask)."""

    kind = "eagle3"
    shares_verifier_head = False  # its own head over the draft vocabulary
    feature_noise = False

    def __init__(self, draft_vocab_size: int | None = None, aux_layer_ids: Sequence[int] | None = None,
                 fc_norm: bool = False, norm_output: bool = False, **shape: Any) -> None:
        super().__init__(**shape)
        if aux_layer_ids is None or len(aux_layer_ids) == 0:
            aux_layer_ids = default_aux_layers(self.num_verifier_layers)
        self.aux_layer_ids = [int(i) for i in aux_layer_ids]
        check_aux_layers(self.aux_layer_ids, self.num_verifier_layers)
        self.draft_vocab_size = min(int(draft_vocab_size or self.vocab_size), self.vocab_size)
        self.fc = nn.Linear(len(self.aux_layer_ids) * self.hidden_size, self.hidden_size, bias=False)
        # EAGLE-3.1's fixes of "attention drift" (vLLM, SGLang and TensorRT-LLM serve both): `fc_norm` normalises each
        # verifier feature on its own before fc; `norm_output` feeds the final-normed output, not the pre-norm one,
        # to the next unrolled / drafted step.
        self.fc_norm = (nn.ModuleList([RMSNorm(self.hidden_size, self._layer_args["eps"]) for _ in self.aux_layer_ids])
                        if fc_norm else None)
        self.norm_output = bool(norm_output)
        self.midlayer = DraftDecoderLayer(**self._layer_args, two_inputs=True)
        self.norm = RMSNorm(self.hidden_size, self._layer_args["eps"])
        self.lm_head = nn.Linear(self.hidden_size, self.draft_vocab_size, bias=False)
        # Identity mapping until set_draft_vocab is called with the training data's most frequent tokens. A
        # full-vocabulary draft's mapping is always the identity: not stored (vLLM refuses a d2t then), so absent
        # = identity.
        persistent = self.draft_vocab_size < self.vocab_size
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long), persistent=persistent)
        t2d = torch.zeros(self.vocab_size, dtype=torch.bool)
        t2d[: self.draft_vocab_size] = True
        self.register_buffer("t2d", t2d, persistent=persistent)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.aux_layer_ids)

    @property
    def layer(self) -> DraftDecoderLayer:
        return self.midlayer

    def set_draft_vocab(self, target_ids: Tensor) -> None:
        """The draft vocabulary is `target_ids` (sorted ascending inside), stored as d2t offsets + t2d mask."""
        ids = torch.sort(target_ids.to(torch.long).flatten()).values
        if ids.numel() != self.draft_vocab_size or ids.max() >= self.vocab_size or ids.unique().numel() != ids.numel():
            raise UserError(f"the draft vocabulary must be {self.draft_vocab_size} distinct ids below the verifier's "
                            f"vocabulary size {self.vocab_size}; got {ids.numel()} ids.")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_rank(self, p_logits: Tensor, target: Tensor) -> Tensor:
        return target_rank(p_logits, target, self.t2d)

    def features(self, hidden_states: Sequence[Tensor] | Mapping[int, Tensor]) -> Tensor:
        return self.fuse(torch.cat([hidden_states[i] for i in self.aux_layer_ids], dim=-1))

    def fuse(self, concatenated: Tensor) -> Tensor:
        """fc over the concatenated verifier features (each normalised first with `fc_norm`).
        (..., n_aux D) -> (..., D)"""
        x = concatenated.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, x.split(self.hidden_size, dim=-1))], dim=-1)
        return self.fc(x)

    def carry(self, out: Tensor) -> Tensor:
        """What a step's output passes to the next unrolled or drafted step as its hidden input."""
        return self.norm(out) if self.norm_output else out

    def step(self, hidden: Tensor, embeds: Tensor, positions: Tensor, mask: Tensor, past_k: Tensor | None = None,
             past_v: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        dtype = self.fc.weight.dtype
        return self.layer(hidden.to(dtype), embeds.to(dtype), positions, mask, past_k, past_v)

    def logits(self, out: Tensor, verifier_lm_head: nn.Module | None = None) -> Tensor:
        return self.lm_head(self.norm(out))


EagleNet = Eagle1Net | Eagle3Net


def check_aux_layers(layer_ids: Sequence[int], num_layers: int, where: str = "EAGLE-3 aux_layer_ids") -> None:
    """EAGLE-3 feature layer ids (id k = the input of verifier layer k = HF `hidden_states[k]`) as every engine reads
    them alike: at least one, in 0..L-1 (vLLM captures k = L before the final norm, SGLang cannot capture it at all),
    strictly increasing and unique (vLLM sorts and de-duplicates them). `where` names the source in the message."""
    ids = list(layer_ids)
    problem = None
    if len(ids) == 0:
        problem = "the list is empty"
    elif any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
        problem = "not all are integers"
    elif any(not 0 <= i < num_layers for i in ids):
        problem = f"{[i for i in ids if not 0 <= i < num_layers]} out of range 0..{num_layers - 1}"
    elif any(a >= b for a, b in zip(ids, ids[1:])):
        problem = "not strictly increasing (vLLM sorts and de-duplicates them, so it would feed other features)"
    if problem:
        hint = (f"the default is {default_aux_layers(num_layers)}" if num_layers >= 3
                else f"this {num_layers}-layer verifier has no three distinct layers")
        raise UserError(f"{where}={ids}: {problem}. Give strictly increasing unique ids in 0..{num_layers - 1} (id k = "
                        f"the input of verifier layer k) for this {num_layers}-layer verifier; {hint}.")


def eagle_class(kind: str) -> type[EagleNet]:
    """The network of an EAGLE version: `eagle` (EAGLE-1) or `eagle3` (EAGLE-3)."""
    for cls in (Eagle1Net, Eagle3Net):
        if kind == cls.kind:
            return cls
    raise UserError(f"EAGLE kind {kind!r} is not one of {[Eagle1Net.kind, Eagle3Net.kind]}.")


def build_eagle(kind: str, verifier: Verifier, draft_vocab_size: int | None = None,
                aux_layer_ids: Sequence[int] | None = None, fc_norm: bool = False,
                norm_output: bool = False) -> EagleNet:
    """A fresh EAGLE-1 (`kind="eagle"`) or EAGLE-3 (`"eagle3"`, with EAGLE-3.1's `fc_norm` / `norm_output` when
    asked) drafter shaped like `verifier`'s layers."""
    if eagle_class(kind) is Eagle1Net:
        if fc_norm or norm_output:
            raise UserError("model.fc_norm / model.norm_output are EAGLE-3.1's options (EAGLE-3 features and its "
                            "unrolled steps); EAGLE-1 has neither. Use model=eagle3.")
        return Eagle1Net(**layer_config(verifier))
    return Eagle3Net(draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids, fc_norm=fc_norm,
                     norm_output=norm_output, **layer_config(verifier))


# -- the training-time unroll (EAGLE-3's "training-time test"), shared by training and offline scoring ---------------

def unroll_mask(valid_keys: Tensor, step: int) -> Tensor:
    """Boolean attention mask of unrolled step `step` over [step-0 keys, step-1 keys, ..., step-`step` keys].

    valid_keys: (B, n) non-padding positions. Query t sees step-0 keys s <= t and, for each later step, only the key
    at its own position t. Returns (B, 1, n, (step + 1) * n).
    """
    bsz, n = valid_keys.shape
    causal = torch.ones(n, n, dtype=torch.bool, device=valid_keys.device).tril()  # (n, n)
    causal = causal[None] & valid_keys[:, None, :]  # (B, n, n)
    eye = torch.eye(n, dtype=torch.bool, device=valid_keys.device)[None].expand(bsz, n, n)
    return torch.cat([causal] + [eye] * step, dim=-1)[:, None]


def step_inputs(input_ids: Tensor, loss_mask: Tensor, step: int) -> tuple[Tensor, Tensor]:
    """Unrolled step `step`'s input tokens and target validity at positions t = 0..T-2.

    tokens[b, t] = x_{t+step+1} (0 past the end); valid[b, t] = x_{t+step+2} exists and is an assistant token.
    The target distribution is q at position t+step+1. Returns two (B, T-1) tensors.
    """
    n = input_ids.shape[1] - 1
    tokens = F.pad(input_ids[:, 1 + step :], (0, step), value=0)[:, :n]
    valid = F.pad(loss_mask[:, 2 + step :].bool(), (0, 2 + step), value=False)[:, :n]
    return tokens, valid


@dataclass(frozen=True)
class UnrolledStep:
    """One unrolled step's outputs. `out` (B, W, D) holds the step's W columns (step 0: every position t, W = n;
    later steps: a window of positions, see `unroll`); `valid` (B, n) marks positions t whose target x_{t+j+2}
    is an assistant token (as `step_inputs` gives); `batch`, `position` and `column` (N,) list those targets:
    batch row, position t, and t's column in `out`."""

    out: Tensor
    valid: Tensor
    batch: Tensor
    position: Tensor
    column: Tensor

    @property
    def at_targets(self) -> Tensor:
        """The outputs at the valid targets, in `batch`/`position` order. (N, D)"""
        return self.out[self.batch, self.column]


def unroll(net: EagleNet, feats: Tensor, input_ids: Tensor, attention_mask: Tensor, loss_mask: Tensor,
           embed: nn.Module, steps: int, inputs: list[tuple[Tensor, Tensor]] | None = None
           ) -> Iterator[UnrolledStep]:
    """Unroll the drafter `steps` times over a batch, teacher-forced on the true tokens.

    Step 0 at position t reads (x_{t+1}, F_t) and predicts x_{t+2}; step j > 0 reads (x_{t+j+1}, its own step j-1
    output at t) at rotary position t+j and predicts x_{t+j+2}, attending the step-0 keys at positions <= t plus the
    keys its own earlier steps made at t: what it sees when drafting a chain at decode time.

    Step 0 runs over every position (its keys are every later query's context). Steps 1.. run only over a window per
    row, the span of positions whose targets some step >= 1 needs (assistant tokens: prompts and padding drop out),
    left-aligned into W columns; a position's step-j output feeds only its own step j+1, so nothing outside the
    window is ever read. feats: (B, n, D) F_t for t = 0..n-1, n = T-1. Yields one `UnrolledStep` per step.

    `inputs`: each step's (tokens, valid) (B, n) in place of `step_inputs`' teacher-forced ones. On-policy training
    (train/opd.py) feeds the drafter's own drafts at the positions where its decoding rounds started, and marks only
    those positions as targets.
    """
    bsz, n = feats.shape[:2]
    device = input_ids.device
    valid_keys = attention_mask[:, :n].bool()
    keys = unroll_mask(valid_keys, 0)  # (B, 1, n, n): query t sees the non-padding keys s <= t
    eye = torch.eye(n, dtype=torch.bool, device=device)
    keys = keys | (eye & ~keys.any(-1, keepdim=True))  # a query with no key (left padding) sees its own: no NaN
    right_padded = bool((valid_keys[:, 1:] <= valid_keys[:, :-1]).all())  # plain causal attention is exact then
    if inputs is None:  # teacher-forced: (tokens, valid) (B, n) each
        inputs = [step_inputs(input_ids, loss_mask, j) for j in range(steps)]

    def step_of(out: Tensor, valid: Tensor, column_of: Tensor | None) -> UnrolledStep:
        bi, ti = valid.nonzero(as_tuple=True)
        return UnrolledStep(out, valid, bi, ti, ti if column_of is None else column_of[bi, ti])

    tok, valid = inputs[0]
    with torch.no_grad():
        emb = embed(tok)
    positions = torch.arange(n, device=device)[None].expand(bsz, n)
    out, k0, v0 = net.step(feats, emb, positions, UnrollMask(keys, 0, right_padded), None, None)
    yield step_of(out, valid, None)
    if steps == 1:
        return
    # The window: per row, the positions [lo, hi) some later step has a target at, as columns 0..W-1.
    need = torch.stack([v for _, v in inputs[1:]]).any(0)  # (B, n)
    idx = torch.arange(n, device=device)
    lo = torch.where(need, idx, n).amin(-1).clamp(max=n - 1)  # (B,)
    hi = torch.where(need, idx + 1, 0).amax(-1)
    width = int((hi - lo).clamp(min=1).max())
    offsets = torch.arange(width, device=device)
    cols = (lo[:, None] + offsets).clamp(max=n - 1)  # (B, W): each column's position (past the end: unread)
    column_of = torch.full((bsz, n), -1, dtype=torch.long, device=device)  # position -> column, (B, n)
    inside = cols - lo[:, None] == offsets
    rows = torch.arange(bsz, device=device)[:, None].expand(bsz, width)
    column_of[rows[inside], cols[inside]] = offsets.expand(bsz, width)[inside]
    window_keys = keys.gather(2, cols[:, None, :, None].expand(bsz, 1, width, n))  # (B, 1, W, n)
    hidden = net.carry(out).gather(1, cols[..., None].expand(bsz, width, out.shape[-1]))
    past_k, past_v = [k0], [v0]
    for j in range(1, steps):
        tok, valid = inputs[j]
        with torch.no_grad():
            emb = embed(tok.gather(1, cols))
        out, k, v = net.step(hidden, emb, cols + j, UnrollMask(window_keys, j), past_k, past_v)
        past_k.append(k)
        past_v.append(v)
        yield step_of(out, valid, column_of)
        hidden = net.carry(out)


def target_rank(p_logits: Tensor, target: Tensor, t2d: Tensor | None = None) -> Tensor:
    """Rank of each target (a verifier id) in the draft logits: 0 if it is the draft's top-1 (`argmax`), ties broken
    by the lower id as `argmax` breaks them (bf16 logits tie often; counting a tie as top-1 would flatter the
    tables). With `t2d` (EAGLE-3) the logits are over the draft vocabulary, whose ids are the t2d-selected target
    ids in ascending order, so a target's draft index is the count of selected ids below it and "lower id" is "lower
    draft index": ranked in (N, V_draft), never widened to the full vocabulary. A target outside the vocabulary, or
    whose logit is -inf, gets the verifier's vocabulary size. (N, V_draft) -> (N,)"""
    size = p_logits.shape[-1]
    inside = torch.ones_like(target, dtype=torch.bool)
    if t2d is not None:
        size = t2d.numel()
        inside = t2d[target]
        target = (t2d.cumsum(0) - 1)[target].clamp(min=0)  # the draft index of each target inside
    at = p_logits.gather(1, target[:, None])  # (N, 1)
    lower = torch.arange(p_logits.shape[-1], device=p_logits.device) < target[:, None]  # (N, V_draft)
    rank = ((p_logits > at) | ((p_logits == at) & lower)).sum(-1)
    return torch.where(inside & (at[:, 0] != float("-inf")), rank, torch.full_like(rank, size))
