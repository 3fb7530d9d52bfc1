"""Every drafter family behind `python -m eval drafter=<name>`: one factory per `conf/drafter/<name>.yaml`.

Each factory is instantiated by Hydra as a partial (`_target_` + `_partial_: true`, its own options filled in) and
called with what only the harness knows: `factory(verifier, tree, checkpoint)`. `tree` (conf/tree) is the tree
policy of the export-based families (Medusa, EAGLE, and the hybrid's primary); the chain families set their shape in
their own options (draft_model.depth, prompt_lookup.num_tokens, lookahead.window / ngram / guesses).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from eval.drafters import Drafter, make_drafter
from eval.tree import Chain, TreePolicy
from models.errors import UserError
from models.verifier import Verifier

CONF = Path(__file__).resolve().parents[1] / "conf" / "drafter"
FAMILIES = ("medusa", "eagle", "eagle3", "draft_model", "prompt_lookup", "lookahead", "hybrid")
NEEDS_EXPORT = ("export", "medusa", "eagle", "eagle3", "hybrid")


def _export(checkpoint: str | Path | None, family: str) -> Path:
    if checkpoint is None:
        raise UserError(f"drafter={family} needs checkpoint=<export dir>: the `export/` directory train.py printed, "
                        f"e.g. python -m eval drafter={family} checkpoint=outputs/medusa-smollm2/export. "
                        f"drafter=draft_model, prompt_lookup and lookahead need no export.")
    return Path(str(checkpoint)).expanduser()


def export(verifier: Verifier, tree: TreePolicy, checkpoint: str | Path | None, kind: str | None = None,
           **proposals: Any) -> Drafter:
    """Medusa / EAGLE / EAGLE-3 from an export; `kind` None takes the export's own, else refuses another kind.
    `proposals`: sampling= and generator= for sampled drafts, draft_vocab= (eval.drafters.make_drafter)."""
    return make_drafter(kind, verifier, tree, checkpoint=_export(checkpoint, kind or "export"), **proposals)


def draft_model(verifier: Verifier, tree: TreePolicy, checkpoint: Any = None, depth: int = 4,
                path: str | None = None, layers: int | None = None) -> Drafter:
    """A chain of `depth` drafts from `path` (a small model with the verifier's tokenizer), else from the verifier's
    first `layers` layers (null: half of them)."""
    from eval.draft_model import make_draft_model_drafter

    if layers is None:
        layers = max(verifier.num_layers // 2, 1)
    return make_draft_model_drafter(verifier, Chain(depth), path=path, layers=layers)


LOOKUP_TOKENS = 10  # prompt lookup's chain length (conf/drafter/prompt_lookup.yaml), and the hybrid's by default


def prompt_lookup(verifier: Verifier, tree: TreePolicy, checkpoint: Any = None, num_tokens: int = LOOKUP_TOKENS,
                  max_ngram_size: int = 3, min_ngram_size: int = 1) -> Drafter:
    from eval.lookup import PromptLookupDrafter

    return PromptLookupDrafter(Chain(num_tokens), num_tokens, max_ngram_size, min_ngram_size)


def lookahead(verifier: Verifier, tree: TreePolicy, checkpoint: Any = None, window: int = 5, ngram: int = 4,
              guesses: int = 5, pool_from_prompt: bool = False) -> Drafter:
    from eval.lookahead import LookaheadDrafter

    return LookaheadDrafter(window, ngram, guesses, pool_from_prompt)


def hybrid(verifier: Verifier, tree: TreePolicy, checkpoint: str | Path | None, num_tokens: int | None = None,
           max_ngram_size: int = 3, min_ngram_size: int = 1, budget: int | None = None, **proposals: Any) -> Drafter:
    """The export's drafter (Medusa / EAGLE, under `tree`) with prompt-lookup chains of up to `num_tokens` grafted
    in, within `budget` nodes (null: the export drafter's own node count). num_tokens null: as long as prompt
    lookup's own chain (LOOKUP_TOKENS), or what the budget holds beside the root when that is less."""
    from eval.hybrid import HybridDrafter
    from eval.lookup import PromptLookupDrafter

    primary = make_drafter(None, verifier, tree, checkpoint=_export(checkpoint, "hybrid"), **proposals)
    if num_tokens is None:
        num_tokens = max(min(LOOKUP_TOKENS, (primary.max_nodes if budget is None else budget) - 1), 1)
    return HybridDrafter(primary, PromptLookupDrafter(Chain(num_tokens), num_tokens, max_ngram_size, min_ngram_size),
                         budget)


def family_config(name: str) -> Any:
    """conf/drafter/<name>.yaml, for runs that build several families (method=all)."""
    file = CONF / f"{name}.yaml"
    if not file.is_file():
        raise UserError(f"drafter={name!r} is not known; choose one of {sorted(FAMILIES)} (conf/drafter/).")
    return OmegaConf.load(file)


def method_name(family: str, drafter: Drafter) -> str:
    """The method label report.json records, e.g. `medusa/auto-16`, `prompt_lookup/chain-10`."""
    policy = drafter.describe().get("policy", "tree")
    return f"{family}/{policy}-{drafter.max_nodes - 1}"
