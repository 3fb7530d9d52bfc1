"""An independent draft model M_p (Leviathan et al., 2023; Chen et al., 2023): a smaller causal LM with the
verifier's tokenizer proposes a chain of N tokens, one at a time, with its own KV cache.

Offline default: a truncated copy of the verifier M_q (its first k decoder layers, then its final norm and lm_head;
the layers are shared, not copied), i.e. self-speculative drafting (Zhang et al., 2024, "Draft & Verify", which
skips layers; here the skipped layers are the last ones). `path=` loads a real small model instead, or a draft
model distilled by `python train.py model=draft_model` (its export names the verifier it was trained for).

Cache and rollback: the drafter remembers which tokens its cache holds. Each round it keeps the longest prefix that
agrees with the tokens so far (eval.engine.hf_forward.commit with nothing after the prefix: a crop,
which reads the same under every transformers version), feeds the rest (the accepted drafts, the verifier's bonus
token, the new root) in one forward, then drafts N-1 more tokens one forward each. `accepted` crops to what the
verifier kept, so rejected drafts never stay cached; the prefix check makes a new prompt start over on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from eval.engine import hf_forward as kv
from eval.engine.protocol import Draft
from eval.engine.tree import Chain, TreePolicy, chain
from models.draft_model import read_draft_info, truncate
from models.verifiers.core import Verifier, check_fingerprint
from models.verifiers.hf import from_file
from models.verifiers.load import verifier_source
from runtime.errors import UserError

DEFAULT_DEPTH = 4


def stored_verifier(drafter_cfg: Any) -> Any:
    """The verifier a distilled draft model's export names (`drafter.path=`), as a description read from a file: loaded
    from this machine only, without running code (models.verifiers.hf.from_file); None where it names none."""
    path = drafter_cfg.get("path")
    described = (read_draft_info(path) or {}).get("verifier") if path else None
    where = f"drafter.path={str(path)!r}'s `verifier`"
    return from_file(verifier_source(described, where), where) if described else None


def truncated_copy(verifier: Verifier, layers: int) -> nn.Module:
    """The verifier's first `layers` decoder layers with its embeddings, final norm and lm_head, sharing its weights
    (no extra memory): a causal LM that runs under HF's own forward and cache."""
    return truncate(verifier.model, layers, own=False, key="drafter.layers")


def check_vocabulary(verifier: Verifier, model: nn.Module, tokenizer: Any | None, where: str) -> None:
    """Refuse a draft model whose tokens do not mean the verifier's: a different vocabulary size, or a tokenizer that
    maps any token to another id."""
    want = verifier.vocab_size
    got = model.get_output_embeddings().weight.shape[0]
    mismatch = got < want
    if tokenizer is not None and not mismatch:
        mismatch = tokenizer.get_vocab() != verifier.tokenizer.get_vocab()
    if mismatch:
        size = len(tokenizer) if tokenizer is not None else got
        raise UserError(f"The draft model {where} has a different vocabulary than the verifier {verifier.name} "
                        f"({size} tokens, output layer {got}, against {want}): its token ids would not mean the "
                        f"verifier's. Use a draft model with the verifier's tokenizer (the same family, e.g. "
                        f"SmolLM2-135M for SmolLM2-360M), or drafter.layers=<k> for a truncated copy of the verifier.")


def load_draft_model(verifier: Verifier, path: str | None = None, layers: int = 1) -> tuple[nn.Module, str]:
    """The draft model and its name: `path` (a Hub id or local directory, with the verifier's tokenizer), else the
    verifier's first `layers` layers."""
    if path is None:
        return truncated_copy(verifier, layers), f"{verifier.name}[:{layers}]"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        # never the checkpoint's own code (auto_map): the architectures transformers ships only
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        model, loading = AutoModelForCausalLM.from_pretrained(path, dtype=verifier.dtype, attn_implementation="sdpa",
                                                              trust_remote_code=False, output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"drafter.path={path!r} could not be loaded as a causal LM with a tokenizer ({e}). Give a "
                        f"Hub id or a local checkpoint directory.") from None
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in loading.get("missing_keys", []) if k not in tied]
    if missing:  # the config builds weights the file lacks (a layer count raised by hand): they would be random
        config = model.config
        raise UserError(f"drafter.path={path!r}: its config.json disagrees with its weights: it builds "
                        f"{len(missing)} tensors the checkpoint lacks (e.g. {missing[0]}; num_hidden_layers="
                        f"{config.num_hidden_layers}, hidden_size={config.hidden_size}), which would draft with "
                        f"random values. Restore the checkpoint's own config.json, or save the model again.")
    check_vocabulary(verifier, model, tokenizer, repr(path))
    info = read_draft_info(path)
    if info is not None:  # distilled by train.py for one verifier: refuse it for another
        check_fingerprint(info["verifier_fingerprint"], verifier, f"the draft model drafter.path={str(path)!r}")
    return model.to(verifier.device).eval().requires_grad_(False), str(path)


class DraftModelDrafter:
    """A chain of N tokens, each the draft model's argmax after the ones before it (tree=chain; depth null: 4)."""

    feature_layers = (-1,)  # the loop hands hidden states; a draft model reads tokens only

    def __init__(self, model: nn.Module, verifier: Verifier, tree: TreePolicy = Chain(), name: str = "") -> None:
        if not isinstance(tree, Chain):
            raise UserError(f"tree={type(tree).__name__} does not fit a draft model, which drafts a chain; use "
                            f"tree=chain tree.depth=<N>.")
        check_vocabulary(verifier, model, None, name or type(model).__name__)
        self.model, self.name = model, name
        self.vocab = verifier.vocab_size  # a padded output layer never proposes an id the verifier lacks
        self.depth = DEFAULT_DEPTH if tree.depth is None else tree.depth
        self.max_nodes, self.max_depth = self.depth + 1, self.depth
        self.tree = chain(self.depth)
        self.cache = kv.new_cache()
        self.cached: list[int] = []  # the tokens whose keys the cache holds, in order

    def describe(self) -> dict[str, Any]:
        return {"policy": "chain", "depth": self.depth, "max_nodes": self.max_nodes, "draft_model": self.name}

    def _sync(self, tokens: list[int]) -> None:
        """Crop the cache to its longest prefix that agrees with `tokens`, leaving at least one token to feed."""
        keep = 0
        limit = min(len(self.cached), len(tokens) - 1)
        while keep < limit and self.cached[keep] == tokens[keep]:
            keep += 1
        if keep == 0:
            self.cache = kv.new_cache()
        elif keep < len(self.cached):
            self._crop(keep)
        self.cached = self.cached[:keep]

    def _crop(self, keep: int) -> None:
        kv.commit(self.cache, keep, torch.zeros(1, 0, dtype=torch.long))  # nothing kept past `keep`: a crop

    def _step(self, ids: Tensor) -> Tensor:
        """Feed `ids` (1, T) after the cache; the draft model's argmax after the last. (1,)"""
        out = kv.forward(self.model, self.cache, ids)
        self.cached += ids[0].tolist()
        return out.logits[:, -1, : self.vocab].argmax(dim=-1)

    @torch.no_grad()
    def propose(self, input_ids: Tensor, hidden: Tensor) -> Draft:
        if input_ids.shape[0] != 1:
            raise UserError(f"Draft-model drafting runs one sequence at a time; got batch size {input_ids.shape[0]}.")
        root = input_ids[:, -1:]  # (1, 1)
        if self.depth == 0:
            return Draft(tree=self.tree, tokens=root)
        tokens = input_ids[0].tolist()
        self._sync(tokens)
        drafts = [self._step(input_ids[:, len(self.cached):])]  # the accepted tokens, the bonus, the root
        for _ in range(self.depth - 1):  # the last draft is never fed: the verifier checks it
            drafts.append(self._step(drafts[-1][:, None]))
        return Draft(tree=self.tree, tokens=torch.cat([root, torch.stack(drafts, dim=1).to(root.dtype)], dim=1))

    def accepted(self, num_accepted: Tensor, nodes: Tensor) -> None:
        """Roll back: keep the root and the accepted drafts, drop the rejected ones' keys."""
        n = int(num_accepted[0])
        # The cache ends with the root and drafts 1..N-1; keep up to the root plus n drafts.
        keep = len(self.cached) - (self.depth - 1) + n
        if 0 < keep < len(self.cached):
            self._crop(keep)
            self.cached = self.cached[:keep]

    def draft_cost(self, verifier: Verifier, prefix_ids: Tensor, sizes: Sequence[int], engine: str = "auto",
                   reps: int = 3) -> None:
        """eval.engine.protocol.CostProbe: not timed, planned as free. Its chain depth is its own setting (tree.depth),
        which tree.size=auto does not plan; the report measures its drafting time apart."""

    def hf_assistant(self) -> tuple[nn.Module, int]:
        """eval.engine.protocol.Assistant: this draft model and its depth, for HF assisted generation beside it."""
        return self.model, self.depth


def make_draft_model_drafter(verifier: Verifier, tree: TreePolicy, path: str | None = None,
                             layers: int = 1) -> DraftModelDrafter:
    """`drafter=draft_model`: `path` for a real small model with the verifier's tokenizer, else the verifier's first
    `layers` layers."""
    model, name = load_draft_model(verifier, path, layers)
    return DraftModelDrafter(model, verifier, tree, name)


# conf/drafter/draft_model.yaml's factory (eval.drafters.build.build_drafter calls it)
def draft_model(verifier: Verifier, tree: TreePolicy, checkpoint: Any = None, depth: int = 4,
                path: str | None = None, layers: int | None = None) -> DraftModelDrafter:
    """A chain of `depth` drafts from `path` (a small model with the verifier's tokenizer), else from the verifier's
    first `layers` layers (null: half of them)."""
    if layers is None:
        layers = max(verifier.num_layers // 2, 1)
    return make_draft_model_drafter(verifier, Chain(depth), path=path, layers=layers)
