"""The verifier's side of a decode: which forward runs it (`use_engine`: eval.engine.forward, batch-invariant with a
preallocated KV cache and exact in bf16, for the Llama-family verifiers it runs; else Hugging Face's forward through
eval.engine.hf_forward), decided once per run (eval.setup holds it as `Run.engine`) and handed to every loop, and the
session one decode holds (`VerifierSession`: the forward, the cache, the commit of an accepted path). The decode loops
(eval.engine.decode) and the planner's cost curves (eval.planner.cost) both verify through it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from eval.engine import forward as fast
from eval.engine import hf_forward as kv
from eval.engine.arch import fallback_note, supported
from models.verifiers.core import Verifier
from runtime.errors import UserError

ENGINES = ("auto", "engine", "hf")


TREE_ROOM = 64  # cache slots past prompt + max_new_tokens: both loops size the engine cache alike (exactness)


def use_engine(verifier: Verifier, engine: str = "auto") -> bool:
    """Whether the decode loops run eval.engine.forward (True) or HF's forward via eval.engine.hf_forward (False).
    `engine`: "engine" (refuses verifiers it does not run), "hf", or "auto": the engine for the model types it runs,
    except in float32 on a CPU, where HF's forward is already batch-invariant and was measured faster
    (docs/results/engine-bf16.md)."""
    if engine not in ENGINES:
        raise UserError(f"engine={engine!r} is not one of {', '.join(ENGINES)}.")
    if engine != "auto":
        return engine == "engine"
    model = verifier.model
    dtype = model.get_input_embeddings().weight.dtype
    if not supported(model.config):
        fallback_note(model.config)  # names the architecture, once
        return False
    return not (dtype == torch.float32 and verifier.device.type == "cpu")


class VerifierSession:
    """The verifier's forward and KV cache for one decode, through eval.engine.forward or eval.engine.hf_forward (same
    calls)."""

    def __init__(self, verifier: Verifier, engine: str, max_length: int, tree_nodes: int, tree_depth: int) -> None:
        self.model, self.fast = verifier.model, use_engine(verifier, engine)
        if not self.fast:
            self.cache = kv.new_cache()
            return
        if tree_nodes > TREE_ROOM or tree_depth >= fast.WINDOW:
            raise UserError(f"The engine verifies trees of at most {TREE_ROOM} nodes and depth {fast.WINDOW - 1}; "
                            f"this drafter proposes up to {tree_nodes} nodes, {tree_depth} deep. Draft less: a "
                            f"smaller tree (tree.size, tree.depth) or, for a drafter sized by its own options, fewer "
                            f"tokens (drafter.num_tokens, drafter.budget); or engine=hf (not exact in bfloat16).")
        self.cache = fast.new_cache(engine_of(self.model), max_length + TREE_ROOM)

    def forward(self, tokens: Tensor, positions=None, mask=None, layers=None, last_logits=False) -> kv.ForwardOutput:
        if self.fast:
            return fast.forward(self.cache, tokens, positions, mask, layers, last_logits)
        return kv.forward(self.model, self.cache, tokens, positions, mask, layers, last_logits)

    def commit(self, prefix_len: int, nodes: Tensor) -> None:
        (fast if self.fast else kv).commit(self.cache, prefix_len, nodes)

    @property
    def length(self) -> int:
        return (fast if self.fast else kv).cache_length(self.cache)


def prepare(verifier: Verifier, max_length: int, engine: str = "auto") -> None:
    """The engine's one-time work for a cache of `max_length` tokens (prompt + max_new_tokens), done now: its
    exactness probes are memoised per cache length (eval.engine.forward's `trimmed_keys_invariant`: 0.05 s at 300
    tokens, 0.56 s at 1,600, 0.9 s at 2,100 on a 2-core machine), and whichever decode first meets a length pays them;
    the prefill's attention dtype is timed once per process (`prefill_attention_for`, 0.2 s) when a cache is made.
    A comparison that times several loops on one prompt calls this first, so that no loop pays them for the others
    (both loops size the cache alike: TREE_ROOM)."""
    VerifierSession(verifier, engine, max_length, 1, 0)


def engine_of(model: torch.nn.Module) -> fast.Engine:
    """One fast.Engine (fused weight copies) per model, kept on the model and rebuilt if its weights were replaced
    (e.g. `.to(dtype)`); the weights are frozen while decoding, so their storage identifies them."""
    key = tuple((p.data_ptr(), p.dtype, p.device) for p in model.parameters())
    hit = model.__dict__.get("_specdraft_engine")
    if hit is None or hit[0] != key:
        hit = (key, fast.Engine(model))
        model.__dict__["_specdraft_engine"] = hit
    return hit[1]


def check_inputs(verifier: Verifier, input_ids: Tensor, max_new_tokens: int, tree_nodes: int,
                  engine: str = "auto") -> None:
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise UserError(f"input_ids must be (batch, length) with length >= 1; got shape {tuple(input_ids.shape)}.")
    if input_ids.shape[0] != 1:
        raise UserError(
            f"Decoding runs one sequence at a time for now; got batch size {input_ids.shape[0]}. Loop over the rows."
        )
    if max_new_tokens < 0:
        raise UserError(f"max_new_tokens={max_new_tokens} must be >= 0.")
    kv.check_model(verifier.model, input_ids.shape[1] + max_new_tokens + tree_nodes, use_engine(verifier, engine))
