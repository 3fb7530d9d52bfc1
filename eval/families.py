"""Every drafter family behind `python -m eval drafter=<name>`: one factory per `conf/drafter/<name>.yaml` (the
registry, models/families.py, names it), and `build_drafter`, which instantiates one from its config.

Each factory is instantiated by Hydra as a partial (`_target_` + `_partial_: true`, its own options filled in) and
called with what only the harness knows: `factory(verifier, tree, export)`, `export` the ExportInfo read once by the
harness (or None). `tree` (conf/tree) is the tree policy of the export-based families (Medusa, EAGLE, and the
hybrid's primary); the chain families set their shape in their own options (draft_model.depth,
prompt_lookup.num_tokens, lookahead.window / ngram / guesses).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from eval.drafters import make_drafter
from eval.protocol import Drafter
from eval.runner import sampling_config
from eval.tree import Chain, TreePolicy
from models.errors import UserError, VerifierMismatchError
from models.export import ExportInfo
from models.families import FAMILIES
from models.verifier import Verifier

CONF = Path(__file__).resolve().parents[1] / "conf" / "drafter"


def _export(checkpoint: ExportInfo | str | Path | None, family: str) -> ExportInfo | Path:
    if checkpoint is None:
        no_export = [n for n, f in FAMILIES.items() if not f.needs_export]
        raise UserError(f"drafter={family} needs checkpoint=<export dir>: the `export/` directory train.py printed, "
                        f"e.g. python -m eval drafter={family} checkpoint=outputs/medusa-smollm2/export. "
                        f"{', '.join(f'drafter={n}' for n in no_export)} need no export.")
    return checkpoint if isinstance(checkpoint, ExportInfo) else Path(str(checkpoint)).expanduser()


def export(verifier: Verifier, tree: TreePolicy, checkpoint: ExportInfo | str | Path | None,
           kind: str | None = None, **proposals: Any) -> Drafter:
    """The drafter of a family with an export (Medusa, EAGLE-1, EAGLE-3: models/families.py); `kind` None takes the
    export's own, else refuses another kind. `proposals`: sampling= and generator= for sampled drafts, draft_vocab=
    (eval.drafters.make_drafter)."""
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


def hybrid(verifier: Verifier, tree: TreePolicy, checkpoint: ExportInfo | str | Path | None, num_tokens: int | None = None,
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
    if name not in FAMILIES or not file.is_file():
        raise UserError(f"drafter={name!r} is not known; choose one of {sorted(FAMILIES)} (conf/drafter/).")
    return OmegaConf.load(file)


def family_of(drafter_cfg: DictConfig) -> str:
    """The family a drafter config builds: its factory's name, or for `export` the kind it names ("export": any)."""
    name = str(drafter_cfg._target_).rsplit(".", 1)[-1]
    return str(drafter_cfg.get("kind") or "export") if name == "export" else name


def check_proposals(cfg: DictConfig, name: str) -> None:
    """Refuse sampled_drafts=true for family `name` when it drafts from no export (nothing to sample proposals from)."""
    if bool(cfg.get("sampled_drafts", False)) and name != "export" and not FAMILIES[name].needs_export:
        raise UserError(f"sampled_drafts=true applies to the drafters of an export (Medusa, EAGLE, the hybrid), "
                        f"not to drafter={name}; drop sampled_drafts.")


def build_drafter(cfg: DictConfig, family: str, drafter_cfg: DictConfig, verifier: Verifier,
                  export: ExportInfo | None, policy: TreePolicy) -> Drafter:
    """The one place a drafter is built from a config: instantiate `family`'s factory (conf/drafter/<family>.yaml,
    or the command line's `drafter` group) and call it with the verifier, the tree policy and the export; with
    `sampled_drafts`, the families that draft from an export also get the warped sampling settings for their
    proposals."""
    factory = instantiate(drafter_cfg, _convert_="all")
    proposals = {}
    if bool(cfg.get("sampled_drafts", False)):
        check_proposals(cfg, family)
        proposals = {"sampling": sampling_config(cfg),
                     "generator": torch.Generator(verifier.device).manual_seed(int(cfg.seed) + 1)}
    try:
        return factory(verifier, policy, export, **proposals)
    except VerifierMismatchError as e:  # its advice names train.py's key; here the verifier is `verifier_path`
        raise VerifierMismatchError(str(e).replace("verifier.path=", "verifier_path=")) from None


def method_name(family: str, drafter: Drafter) -> str:
    """The method label report.json records, e.g. `medusa/auto-16`, `prompt_lookup/chain-10`."""
    policy = drafter.describe().get("policy", "tree")
    return f"{family}/{policy}-{drafter.max_nodes - 1}"
