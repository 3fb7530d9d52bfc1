"""DSpark at decode time (models/dspark.py): one backbone forward, then the block slot by slot through the Markov bias.

Each round: 1. the new committed positions enter the context cache (DFlash's `_extend`); 2. one block forward over
[root, K masks] gives slot outputs h_1..h_K and base logits lm_head(h_k); 3. depth by depth, first the confidence
head gives each node's slot its predicted acceptance sigmoid(proj([h_d, W1[parent token]])), and the proposal stops
at the depth before the one where the predicted cumulative acceptance along the top-1 path (the product of the
confidences, vLLM's survival probability) falls below `threshold` (0: the whole tree); then, for a depth kept, each
node's children are ranked by base_d + MarkovBias(W1[the node's token]) (the root's token for depth 1), so every draft
conditions on the token drafted before it. A depth the cut drops is never drafted: the confidence of slot d needs only
the tokens of depth d-1, so the Markov bias, the costly term (an r x V product), runs only for the depths proposed.
The bias runs in the verifier head's dtype (bf16 training computes it under autocast), prepacked on a CPU like the
head (models.packed). The tree itself is fixed as DFlash's (tree=auto plans on the export's
`dspark_confidence_table`: the head's predicted acceptance per depth). Greedy acceptance keeps plain greedy's tokens
whatever is proposed, so the output is the verifier's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eval.drafters.dflash import DFlashDrafter
from eval.drafters.parallel import family_tree
from eval.engine.forward import packed_head
from eval.engine.protocol import Draft, Drafter
from eval.engine.sampling import SamplingConfig
from eval.engine.tree import TreePolicy, truncate
from models.dspark import DSparkNet
from models.exports.io import ExportInfo
from models.verifiers.core import Verifier
from runtime.errors import UserError


def check_threshold(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise UserError(f"drafter.confidence_threshold={value!r}: the proposal is cut where the predicted cumulative "
                        f"acceptance falls below it, so give a number in [0, 1] (0: verify the whole tree).")
    return float(value)


class DSparkDrafter(DFlashDrafter):
    """DSpark for the drafter protocol: DFlash's context cache and block forward, the Markov bias per depth, and the
    confidence head's cut (module docstring)."""

    net: DSparkNet
    title = "DSpark"

    def __init__(self, *args: Any, threshold: float = 0.0, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.threshold = check_threshold(threshold)
        self.last_confidence: list[float] = []  # the top-1 path's predicted acceptance per depth, last round
        self.cut_depths: list[int] = []  # the depth each round was cut to (tests, reports)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "confidence_threshold": self.threshold}

    def _markov_w2(self) -> Any:
        """The Markov head's W2 (r -> V) as decoding runs it: in the verifier's dtype, prepacked where the head
        is (eval.engine.forward.packed_head keeps one packed copy per weight, rebuilt if the weights change)."""
        w2 = self.net.markov_head.markov_w2
        dtype = self.embed.weight.dtype
        if w2.weight.dtype == dtype:
            return packed_head(w2)
        key = (w2.weight.data_ptr(), w2.weight._version, dtype)
        hit = self.__dict__.get("_w2_cast")
        if hit is None or hit[0] != key:
            cast = torch.nn.Linear(w2.in_features, w2.out_features, bias=False, dtype=dtype)
            with torch.no_grad():
                cast.weight.copy_(w2.weight)
            hit = self.__dict__["_w2_cast"] = (key, cast)
        return packed_head(hit[1])

    def _confidence(self, out: Tensor, prev: Tensor) -> tuple[Tensor, Tensor]:
        """For parents with tokens `prev` (m,) at one depth: each parent's slot confidence (m,) and W1 rows (m, r)."""
        emb = self.net.markov_head.embed(prev)  # (m, r)
        h = out.expand(prev.shape[0], -1)
        return torch.sigmoid(self.net.confidence_logit(h, emb).float()), emb

    def _bias_logits(self, out: Tensor, base: Tensor, emb: Tensor, state: Tensor | None
                     ) -> tuple[Tensor, Tensor | None]:
        """The children's logits (m, V) of parents with W1 rows `emb`: the slot's base logits plus each parent's
        Markov bias; and the rnn state."""
        w2, dtype = self._markov_w2(), self.embed.weight.dtype
        h = out.expand(emb.shape[0], -1)
        bias, state = self.net.markov_head.step(emb, h, state, w2=lambda x: w2(x.to(dtype)))
        return base[None] + bias.float(), state

    def _children(self, out: Tensor, base: Tensor, prev: Tensor, state: Tensor | None
                  ) -> tuple[Tensor, Tensor, Tensor | None]:
        """For parents with tokens `prev` (m,) at one depth: their children's logits (m, V) (the slot's base logits
        plus the Markov bias of each parent's token), each parent's slot confidence (m,), and the rnn state."""
        conf, emb = self._confidence(out, prev)
        logits, state = self._bias_logits(out, base, emb, state)
        return logits, conf, state

    conditions_on_parent = True

    def _child_logits(self, out: Tensor, base: Tensor, prev: Tensor, state: Any) -> tuple[Tensor, Any]:
        """The base logits plus the Markov bias of each parent's token (the rnn head's state passed on)."""
        return self._bias_logits(out, base, self.net.markov_head.embed(prev), state)

    def _draft_block(self, out: Tensor, tokens: Tensor, p: Tensor | None) -> Draft:
        tree, device = self.tree, tokens.device
        base: Tensor | None = None  # the base logits (K, V), made once a depth is kept (one head call for all K)
        conf = torch.ones(tree.num_nodes, device=device)  # the slot confidence under each node's parent
        states: dict[int, Tensor] = {}
        path, node, survival, keep_depth = [], 0, 1.0, 0  # the top-1 path's confidences; the depth proposed
        for d in range(1, tree.max_depth + 1):  # 3. depth by depth: the confidence, the cut, the Markov bias
            kids, parents, row = self._depth_nodes(d, device)
            c, emb = self._confidence(out[d - 1 : d], tokens[parents])
            conf[kids] = c[row]
            first = next((i for i in kids if tree.parents[i] == node and tree.ranks[i] == 0), None)
            if first is not None:
                path.append(float(conf[first]))
                survival *= path[-1]
            if self.threshold > 0 and (first is None or survival < self.threshold):
                break  # 4. the cut: depth d and below are not drafted
            node, keep_depth = (node if first is None else first), d
            if base is None:
                base = self.net.logits(out, self.lm_head).float()
            state = torch.stack([states[q] for q in parents]) if states else None
            logits, state = self._bias_logits(out[d - 1 : d], base[d - 1], emb, state)
            if state is not None:
                states.update({q: state[i] for i, q in enumerate(parents)})
            self._draft_children(logits, kids, row, tokens, p)
            if states:  # the rnn state a child passes on is its parent's step
                states = {i: states[tree.parents[i]] for i in kids}
        self.last_confidence = path
        self.cut_depths.append(keep_depth)
        full = Draft(tree=tree, tokens=tokens[None], p=None if p is None else p[None])
        if keep_depth >= tree.max_depth:
            return full
        cut, keep = truncate(tree, keep_depth)
        index = torch.tensor(keep, device=device)
        return Draft(tree=cut, tokens=full.tokens[:, index], p=None if p is None else full.p[:, index])


def dspark_drafter(net: DSparkNet, config: dict[str, Any], verifier: Verifier, tree: TreePolicy,
                   sampling: SamplingConfig | None = None, generator: torch.Generator | None = None,
                   head_ids: Tensor | None = None, threshold: float = 0.0) -> DSparkDrafter:
    """The DSpark drafter for a loaded network (models/families.py names it the family's decoder): a fixed tree under
    `tree` (tree=auto from the export's dspark_confidence_table, else its eagle_topk_accuracy), at most K deep,
    cut each round at `threshold` (0: never)."""
    if head_ids is not None:
        raise UserError("drafter.draft_vocab cuts the verifier's head, but DSpark's Markov bias spans the whole "
                        "vocabulary; leave drafter.draft_vocab=null for a DSpark export.")


    shape, name, table = family_tree("dspark", net.parallel, config, tree)
    return DSparkDrafter(net, verifier, shape, policy=name, sampling=sampling, generator=generator, table=table,
                         threshold=threshold)


def dspark(verifier: Verifier, tree: TreePolicy, checkpoint: ExportInfo | str | Path | None,
           confidence_threshold: float = 0.2, **proposals: Any) -> Drafter:
    """conf/drafter/dspark.yaml: the DSpark drafter of an export, each round cut where the predicted cumulative
    acceptance falls below `confidence_threshold`."""
    from eval.drafters.build import export_of, make_drafter

    threshold = check_threshold(confidence_threshold)
    drafter = make_drafter("dspark", verifier, tree, checkpoint=export_of(checkpoint, "dspark"), **proposals)
    assert isinstance(drafter, DSparkDrafter)
    drafter.threshold = threshold
    return drafter
