"""What a training run will hold in memory per process, printed before it starts: the frozen verifier (its decoder
layers divided over the ranks under trainer=fsdp), the drafter's weights, gradients and AdamW states, and an
estimate of the activations of one step (the verifier's hidden states, the drafter's saved activations, once per
unrolled TTT step). The anchors' users hit out-of-memory exactly here (EAGLE-3's training-time test); the table
says which term to cut (data.batch_size, data.max_length, model.ttt_steps, trainer=fsdp, data.cache_hidden_states).

The activation terms are estimates, stated by formula (B = batch size, T = max length, H / I = the verifier's
hidden and MLP sizes, L its layers, b = 2 bytes in bf16, 4 in fp32):
  verifier forward: (L + 1) x B x T x H x b (every layer's output kept for the hidden states read) plus one
    layer's MLP, 2 x B x T x I x b; zero when the hidden states come from the offline cache.
  drafter: what its training module says (DrafterModule.activation_estimate): per drafter layer and unrolled
    step, B x T x (10 H + 4 I) x b (`layer_activations`: attention inputs, scores by flash-style kernels not
    counted, MLP; EAGLE, P-EAGLE, DFlash, a draft model); Medusa: heads x B x T x 4 H x b; plus the fused head's
    chunk of logits (train/fused_head.py: 2 x 512 rows x V in fp32).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from models.verifiers.core import Verifier
from train.fused_head import CHUNK
from train.muon import optimizer_state

if TYPE_CHECKING:
    from train.base import DrafterModule

GIB = 2**30


@dataclass
class MemoryPlan:
    rows: list[tuple[str, float, str]]  # (what, bytes, how it was counted)

    @property
    def total(self) -> float:
        return sum(b for _, b, _ in self.rows)

    def table(self) -> str:
        lines = ["[memory] per process, before the run starts (estimates marked ~):"]
        for what, size, how in self.rows:
            lines.append(f"[memory]   {what:<26} {size / GIB:8.3f} GiB   {how}")
        lines.append(f"[memory]   {'total':<26} {self.total / GIB:8.3f} GiB")
        return "\n".join(lines)


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def layer_activations(hparams: Mapping[str, Any], tokens: int, hidden: int, intermediate: int,
                      width: int) -> tuple[float, str]:
    """A transformer drafter's activations: its `num_layers` layers (hparams, default 1) once per unrolled step
    (`ttt_steps`, default 1), B x T x (10 H + 4 I) values each; (bytes, how)."""
    steps = int(hparams.get("ttt_steps", 1) or 1)
    layers = int(hparams.get("num_layers", 1) or 1)
    return (steps * layers * tokens * (10 * hidden + 4 * intermediate) * width,
            f"~ {steps} unrolled step(s) x {layers} layer(s) x B x T x (10H + 4I) x {width} B")


def plan_memory(verifier: Verifier, module: DrafterModule, batch_size: int, max_length: int, world: int = 1,
                shard_verifier: bool = False, offline: bool = False, precision: str = "bf16-mixed") -> MemoryPlan:
    model = verifier.model
    layers = model.get_decoder().layers
    layer_bytes = _bytes(p for layer in layers for p in layer.parameters())
    total = _bytes(model.parameters())
    if shard_verifier and world > 1:
        verifier_row = ("verifier (frozen)", total - layer_bytes + layer_bytes / world,
                        f"{(total - layer_bytes) / GIB:.3f} GiB whole on every rank (embeddings, head, norm) + "
                        f"{layer_bytes / GIB:.3f} GiB of decoder layers / {world} ranks (FSDP2)")
    else:
        verifier_row = ("verifier (frozen)", float(total), f"{sum(p.numel() for p in model.parameters()):,} "
                        f"parameters in {str(verifier.dtype).removeprefix('torch.')}")
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    trainable = [p for _, p in named]
    n = sum(p.numel() for p in trainable)
    weights = _bytes(trainable)
    cfg = verifier.config
    H, Lv = verifier.hidden_size, len(layers)
    # I: the intermediate size, named as in the formulas above
    I = int(getattr(cfg, "intermediate_size", 4 * H))  # noqa: E741
    b = 2 if "bf16" in str(precision) or "16" in str(precision) else 4
    tokens = batch_size * max_length
    verifier_act = 0.0 if offline else tokens * H * b * (Lv + 1) + 2 * tokens * I * b
    drafter_act, how = module.activation_estimate(tokens, H, I, b)
    head_chunk = 2 * CHUNK * verifier.vocab_size * 4  # logits and their softmax, one chunk at a time
    return MemoryPlan([
        verifier_row,
        ("drafter weights", float(weights), f"{n:,} trainable parameters"),
        ("drafter gradients", float(weights), "one per trainable weight"),
        optimizer_state(getattr(module, "optimizer_factory", None), named),
        ("verifier activations", float(verifier_act),
         "0: hidden states read from the offline cache" if offline else
         f"~ (L+1) x B x T x H x {b} B + 2 x B x T x I x {b} B, B={batch_size}, T={max_length}"),
        ("drafter activations", float(drafter_act), how),
        ("fused head chunk", float(head_chunk), f"~ 2 x {CHUNK} rows x {verifier.vocab_size:,} logits in fp32"),
    ])
