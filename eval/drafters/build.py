"""Building a drafter: `make_drafter` from an export or a network (through the family's decoder in the registry,
models/families.py), and one factory per `conf/drafter/<name>.yaml`, which `build_drafter` instantiates.

Each factory is instantiated by Hydra as a partial (`_target_` + `_partial_: true`, its own options filled in) and
called with what only the harness knows: `factory(verifier, tree, export)`, `export` the ExportInfo read once by the
harness (or None). `tree` (conf/tree) is the tree policy of the export-based families (Medusa, EAGLE, and the
hybrid's primary); the chain families set their shape in their own options (draft_model.depth,
prompt_lookup.num_tokens, lookahead.window / ngram / guesses).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from eval.drafters.online import Adaptable, adapt_settings
from eval.engine.exports import load_export  # once per run inside `python -m eval` (eval.engine.exports)
from eval.engine.protocol import Draft, Drafter  # noqa: F401  (the protocol, importable from here as before)
from eval.engine.sampling import SamplingConfig
from eval.engine.tree import TreePolicy
from models.exports.io import Export, ExportInfo, frequent_ids
from models.families import FAMILIES, export_families, family_of_net, resolve, title
from models.verifiers.core import Verifier
from runtime.errors import UserError, VerifierMismatchError


def make_drafter(kind: str | None, verifier: Verifier, tree: TreePolicy,
                 checkpoint: str | Path | Export | None = None,
                 net: nn.Module | None = None, sampling: SamplingConfig | None = None,
                 generator: torch.Generator | None = None, draft_vocab: int | None = None,
                 dtype: str | None = None, adapt: str | None = None, **adapt_options: Any) -> Drafter:
    """A drafter for `verifier` proposing trees under the policy `tree`, from an export (checkpoint=<dir>; `kind`
    None takes the export's own) or a network (net=<MedusaHeads or EAGLE net>, `kind` naming it). With `sampling`
    (temperature > 0) it samples its proposals from its warped distribution instead of taking the top-k.
    `draft_vocab` (EAGLE-1, shared-head Medusa): draft over the export's `draft_vocab` most frequent training targets
    only, through those rows of the verifier's lm_head. None: the export's `train_vocab` (a drafter trained over that
    many rows: train/base.py), else the full vocabulary. `dtype` (eval's `drafter_dtype`): the network's weights
    cast to it, on a copy (an export's network is shared by the drafters built from it); None keeps them.
    `adapt` ("online") and `adapt_*` (eval.drafters.online.adapt_settings): the drafter learns while it decodes."""
    learning = adapt_settings(adapt, **adapt_options)
    if (checkpoint is None) == (net is None):
        raise UserError(f"make_drafter({kind!r}, ...) needs exactly one of checkpoint=<export dir> or net=<network>.")
    if kind is not None and kind not in export_families():
        raise UserError(f"drafter={kind!r} is no family with an export; choose one of {sorted(export_families())}.")
    config: dict[str, Any] = {}
    counts, export = None, None
    if checkpoint is not None:
        export = checkpoint if isinstance(checkpoint, Export) else load_export(checkpoint, verifier, kind)
        if kind is not None and export.kind != kind:
            raise UserError(f"the export is {title(export.kind)} but was given as {title(kind)}; use "
                            f"drafter={export.kind}.")
        kind, net, config, counts = export.kind, export.net, export.config, export.target_counts
    elif kind is None or family_of_net(net) != kind:
        found = family_of_net(net)
        raise UserError(f"net is a {title(found)} drafter but was given as {title(kind)}; use "
                        f"make_drafter({found!r}, ...).")
    net = net.to(verifier.device)
    if dtype is not None and any(p.dtype != drafter_dtype(dtype) for p in net.parameters()):
        net = copy.deepcopy(net).to(drafter_dtype(dtype))
    if draft_vocab is None and config.get("train_vocab"):
        draft_vocab = config["train_vocab"]  # trained over those rows: draft over them
    head_ids = None
    if draft_vocab is not None:
        if not net.shares_verifier_head:
            raise UserError(f"drafter.draft_vocab={draft_vocab} cuts the verifier's lm_head that EAGLE-1 and "
                            f"shared-head Medusa draft through; this {title(kind)} drafter has its own head. "
                            f"Leave drafter.draft_vocab=null.")
        if counts is None:
            raise UserError(f"drafter.draft_vocab={draft_vocab} needs the export's training-target counts "
                            f"(target_counts.safetensors), and {export.path if export else 'the network given'} has "
                            f"none. Re-export it with a current train.py "
                            f"(python train.py <the run's overrides> ckpt_path=last validate_only=true), or "
                            f"leave drafter.draft_vocab=null.")
        head_ids = frequent_ids(counts, int(draft_vocab)).to(verifier.device)
    # e.g. eval.drafters.medusa.medusa_drafter, eval.drafters.eagle.eagle_drafter
    build = resolve(FAMILIES[kind].decoder)
    drafter = build(net, config, verifier, tree, sampling=sampling, generator=generator, head_ids=head_ids)
    if learning is not None:
        if not isinstance(drafter, Adaptable):
            raise UserError(f"drafter.adapt=online: the {title(kind)} drafter cannot learn while it decodes yet "
                            f"(the drafters of eval/drafters/online.py's Adaptable can: EAGLE-1, EAGLE-3). Drop "
                            f"drafter.adapt, or evaluate an export of those.")
        drafter.learn_online(learning)
    return drafter


CONF = Path(__file__).resolve().parents[2] / "conf" / "drafter"


def export_of(checkpoint: ExportInfo | str | Path | None, family: str) -> ExportInfo | Path:
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
    (eval.drafters.build.make_drafter)."""
    return make_drafter(kind, verifier, tree, checkpoint=export_of(checkpoint, kind or "export"), **proposals)


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


DRAFTER_DTYPES = ("float32", "bfloat16")


def drafter_dtype(value: Any) -> torch.dtype:
    """eval's `drafter_dtype`, checked: the torch dtype an export's drafter runs in."""
    if value not in DRAFTER_DTYPES:
        raise UserError(f"drafter_dtype={value!r}: choose one of {['auto', *DRAFTER_DTYPES]} (auto: the verifier's "
                        f"dtype; float32: the export's weights as saved; bfloat16: cast, as serving engines run a "
                        f"drafter beside a bf16 verifier).")
    return getattr(torch, str(value))


def resolve_drafter_dtype(value: Any, verifier_dtype: str) -> str:
    """eval's `drafter_dtype` for this run: `auto` is the verifier's dtype (a bf16 verifier drafts with bf16 weights,
    as serving engines run a drafter beside it; an fp32 verifier with the export's fp32 weights); others checked."""
    if value == "auto":
        value = verifier_dtype if verifier_dtype in DRAFTER_DTYPES else "float32"
        print(f"drafter_dtype: {value} (auto: the verifier's dtype)")
    drafter_dtype(value)
    return str(value)


def check_proposals(sampled_drafts: bool, name: str) -> None:
    """Refuse sampled_drafts=true for family `name` when it drafts from no export (nothing to sample proposals from)."""
    if sampled_drafts and name != "export" and not FAMILIES[name].needs_export:
        raise UserError(f"sampled_drafts=true applies to the drafters of an export (Medusa, EAGLE, the hybrid), "
                        f"not to drafter={name}; drop sampled_drafts.")


def build_drafter(family: str, drafter_cfg: DictConfig, verifier: Verifier, export: ExportInfo | None,
                  policy: TreePolicy, dtype: str = "float32", sampling: SamplingConfig | None = None,
                  seed: int = 0) -> Drafter:
    """The one place a drafter is built from a config: instantiate `family`'s factory (conf/drafter/<family>.yaml,
    or the command line's `drafter` group) and call it with the verifier, the tree policy and the export. The
    families that draft from an export also get `dtype` (eval's drafter_dtype) and, with `sampling` (sampled_drafts
    at temperature > 0), the warped sampling settings for their proposals and a generator seeded from `seed` (the
    others draft as they always do)."""
    factory = instantiate(drafter_cfg, _convert_="all")
    proposals: dict[str, Any] = {}
    # A family that drafts from no export has no distribution to sample proposals from: a one-family run refuses
    # sampled_drafts for it before loading (check_proposals, from eval.harness), method=all drafts it as it is.
    from_export = family == "export" or FAMILIES[family].needs_export
    if from_export and dtype != "float32":
        proposals["dtype"] = dtype
    if sampling is not None and from_export:
        proposals |= {"sampling": sampling, "generator": torch.Generator(verifier.device).manual_seed(seed + 1)}
    try:
        return factory(verifier, policy, export, **proposals)
    except VerifierMismatchError as e:  # its advice names train.py's key; here the verifier is `verifier_path`
        raise VerifierMismatchError(str(e).replace("verifier.path=", "verifier_path=")) from None


def method_name(family: str, drafter: Drafter) -> str:
    """The method label report.json records, e.g. `medusa/auto-16`, `prompt_lookup/chain-10`."""
    policy = drafter.describe().get("policy", "tree")
    return f"{family}/{policy}-{drafter.max_nodes - 1}"


def ran_dtype(description: dict[str, Any]) -> str | None:
    """The dtype the drafter's weights ran in, from its `describe()` (a combination's: its primary's), or None where
    the drafter has no weights of its own: what report.json records as `drafter_dtype`."""
    for part in (description, description.get("primary") or {}):
        if part.get("weights") is not None:
            return str(part["weights"])
    return None
