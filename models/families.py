"""The drafter families, in one place: what each is made of, for training (train.py), export I/O
(models/exports/io.py),
decoding (eval/) and serving (serve/vllm_engine.py). Every other module reads this registry instead of naming
families; adding one is its modules plus one entry in FAMILIES (tests/test_families_registry.py runs every entry
through train -> export -> read -> decode).

Pieces that live above models/ (a LightningModule in train/, a drafter in eval/) are named by their dotted path, as
Hydra's `_target_` names them, and resolved where they are used (`resolve`): models/ imports neither train/ nor
eval/. `conf/model/<name>.yaml` and `conf/drafter/<name>.yaml` must target the same paths (a test checks it).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from models.dflash import DFlashNet
from models.dflash2 import DFlash2Net
from models.dspark import DSparkNet
from models.eagle import Eagle1Net, Eagle3Net
from models.formats import eagle as eagle_io
from models.formats import parts
from models.formats import peagle as peagle_io
from models.formats.dflash import (
    dflash_from_layout,
    dflash_from_speculators,
    dflash_layout,
    dflash_to_speculators,
    dflash_weights_agree,
)
from models.formats.dflash2 import (
    dflash2_from_layout,
    dflash2_from_speculators,
    dflash2_layout,
    dflash2_to_speculators,
)
from models.formats.dspark import dspark_from_layout, dspark_from_speculators, dspark_layout, dspark_to_speculators
from models.formats.medusa import (
    is_medusa_reference,
    medusa_from_layout,
    medusa_from_reference,
    medusa_layout,
    medusa_to_reference,
    medusa_weights_agree,
)
from models.medusa import MedusaHeads
from models.peagle import PEagleNet
from runtime.errors import UserError

# (net, verifier) -> (the family's config keys, tensors to write). Each family's writer takes its own network class
# (MedusaHeads, Eagle1Net | Eagle3Net, ...), which its entry pairs with it, so the arguments are not typed here: a
# writer for any nn.Module would have to accept every family's network.
Writer = Callable[..., tuple[dict[str, Any], dict[str, Tensor]]]
# (config, tensors, verifier, weights file, reference layout?) -> (network, the export's copy of a shared head or None)
Reader = Callable[[dict[str, Any], dict[str, Tensor], Any, Path, bool], tuple[nn.Module, Tensor | None]]
# (flat config, speculators_model_type, verifier name_or_path, verifier architectures, speculative tokens) -> the
# config in the speculators format (models/exports/speculators.py)
SpeculatorsWriter = Callable[[dict[str, Any], str, str, list[str], int], dict[str, Any]]
# (speculators config, file, family name, the architecture to write) -> the flat config the family's Reader reads
SpeculatorsReader = Callable[[dict[str, Any], str, str, str], dict[str, Any]]
# (config, tensor shapes by name) -> the config fields that disagree with the tensors (models.formats.parts)
WeightsCheck = Callable[[dict[str, Any], "parts.Shapes"], list["parts.Disagreement"]]
# (reference config, the weight file's tensor names) -> whether they are the family's reference layout
ReferenceDetector = Callable[[dict[str, Any], list[str]], bool]


@dataclass(frozen=True)
class ExportFormat:
    """How a family's export is written and read; models/exports/io.py does the files, the verifier fingerprint
    and the side data, this says what is the family's own."""

    architectures: tuple[str, ...]  # written into config.json, in this order; any of them identifies the family
    write: Writer
    read: Reader
    model_type: str | None = None  # identifies the family first, when set (vLLM's Medusa layout: "medusa")
    reads: tuple[str, ...] = ()  # further `architectures` read as this family
    reference_weights: tuple[str, ...] = ()  # the reference repository's weight file names, the first written
    to_reference: Callable[..., tuple[dict, dict]] | None = None  # (config, tensors, base model, file) -> reference
    from_reference: Callable[..., tuple[dict, dict]] | None = None  # (config, tensors, file) -> this project's
    is_reference: ReferenceDetector | None = None  # a reference-layout folder is this family's (layout_of)
    speculators_type: str | None = None  # vLLM's `speculators_model_type`: the export is in that format
    to_speculators: SpeculatorsWriter | None = None  # with speculators_type: the flat config in that format
    from_speculators: SpeculatorsReader | None = None  # with speculators_type: that format's config as the flat one
    # (flat config, the weight file's tensor shapes by name) -> the fields that disagree with the weights
    # (models.exports.io.check_weights_agree reads the shapes from the safetensors header on every read and at save)
    agrees: WeightsCheck | None = None
    # (the config as written, shapes) -> what the serving engine would build otherwise than the weights are
    # (checked at save: an export that trains but cannot serve is refused)
    engine_reads: WeightsCheck | None = None

    def __post_init__(self) -> None:
        speculators = (self.speculators_type, self.to_speculators, self.from_speculators)
        if any(x is None for x in speculators) != all(x is None for x in speculators):
            raise TypeError(f"{self.architectures}: speculators_type, to_speculators and from_speculators go together")
        reference = (self.is_reference, self.to_reference, self.from_reference)
        if any(x is None for x in reference) != all(x is None for x in reference) or (
                self.is_reference is not None and not self.reference_weights):
            raise TypeError(f"{self.architectures}: is_reference, to_reference, from_reference and reference_weights "
                            f"go together")


@dataclass(frozen=True)
class Family:
    """One drafter family.

    drafter: what `python -m eval drafter=<name>` instantiates (conf/drafter/<name>.yaml's `_target_`).
    decoder: for a family with an export, the eval builder `(net, config, verifier, tree, sampling=, generator=,
        head_ids=) -> Drafter` that drafts with the loaded network.
    training: the LightningModule `python train.py model=<name>` trains (conf/model/<name>.yaml), or None.
    network: the nn.Module class an export of this family holds, or None.
    export: its export format, or None (no export, or a plain HF checkpoint: the draft model).
    needs_export: eval needs `checkpoint=<export dir>`.
    tree: how `tree` (conf/tree) shapes its drafts: "fixed" (one tree every round, planned from the export's
        acceptance table), "dynamic" (grown each round within a node budget), "primary" (the export's drafter's
        budget), "own" (the family's own options: a chain length, a window).
    acceptance: the export config keys holding its acceptance estimates, best first (tree.size=auto plans on them).
    min_drafts: the fewest drafts tree.size=auto may plan (the hybrid's grafted lookup chain needs a node).
    serve: vLLM's speculative method for its export (serve/vllm_engine.py), or None.
    serve_options: further --speculative-config keys that method needs for this family (P-EAGLE: vLLM serves it
        as eagle3 with parallel drafting).
    openvino: OpenVINO GenAI's speculative mode for its export (serve/openvino_engine.py: "eagle3", the draft IR's
        eagle3_mode), or None: `convert openvino` and engine_peers=[openvino] refuse the family.
    llamacpp: llama.cpp's --spec-type for its export converted to GGUF (serve/gguf.py), or None: llama.cpp (b11434)
        has no such drafter, and `convert gguf` / `python -m serve --engine llamacpp` refuse it.
    llamacpp_refusal: for a family llama.cpp has but this toolkit does not convert for it, why (said instead of
        "llama.cpp has no such drafter").
    llamacpp_flat: llama.cpp's converter reads this family only in its reference layout (z-lab's flat DFlash:
        `dflash_config.target_layer_ids` counted as layer outputs), written first with `to_reference`.
    serve_cpu_refusal: why vLLM's CPU build (the one this project runs) refuses this family's export although vLLM
        serves it elsewhere, or None: `python -m serve` and the load sweep say so before starting a server.
    teacher_forced: for a family with an export, the function eval/offline.py scores its network with, teacher-
        forced: `(net, verifier, batch, depth, keep) -> (ranks, valid, top-1 probability)`, each (D, B, T).
    stored_verifier: for a family whose drafter's own files name a verifier (a distilled draft model), the function
        `(drafter config) -> verifier description or None` that `python -m eval` loads when neither verifier_path
        nor an export names one.
    """

    name: str
    title: str
    drafter: str
    decoder: str | None = None
    training: str | None = None
    network: type[nn.Module] | None = None
    export: ExportFormat | None = None
    needs_export: bool = False
    tree: str = "own"
    acceptance: tuple[str, ...] = ()
    min_drafts: int = 0
    serve: str | None = None
    serve_options: tuple[tuple[str, Any], ...] = ()  # further --speculative-config keys vLLM needs for it
    serve_cpu_refusal: str | None = None
    openvino: str | None = None
    llamacpp: str | None = None
    llamacpp_flat: bool = False
    llamacpp_refusal: str | None = None
    teacher_forced: str | None = None
    stored_verifier: str | None = None
    # (config key, offset): the most tokens one engine step of this export drafts, its config value plus the offset
    # (Medusa: a token per head; a block drafter: the block less its root); None: any K (one forward per token)
    drafts_per_step: tuple[str, int] | None = None

    @property
    def has_export(self) -> bool:
        return self.export is not None

    @property
    def modules(self) -> frozenset[str]:
        """The modules holding this family's own code, as its entry reaches them: its network's classes, its export
        format's functions, its training module, its decoder (or, without an export, its own drafter), its scoring
        and stored-verifier functions. Shared code is every other module (tests/test_family_home.py reads this)."""
        found = {c.__module__ for c in (self.network.__mro__ if self.network else ())
                 if c.__module__.split(".")[0] not in ("torch", "builtins")}
        paths = [self.decoder or self.drafter, self.training, self.teacher_forced, self.stored_verifier]
        found |= {p.rsplit(".", 1)[0] for p in paths if p}
        if self.export is not None:
            for value in vars(self.export).values():
                value = getattr(value, "func", value)  # a functools.partial's function
                if callable(value) and not isinstance(value, type):
                    found.add(value.__module__)
        return frozenset(found)


# SGLang takes the first registered name (LlamaForCausalLMEagle); vLLM resolves the list through the second
# (EagleLlamaForCausalLM, kept as is by its EAGLEConfig). Never plain LlamaForCausalLM: SGLang would build the target.
_EAGLE_ARCHS = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM")

# What the EAGLE line's entries share (EAGLE-1, EAGLE-3, P-EAGLE): built from an export, the per-depth top-k table
# tree=auto plans on, teacher-forced ranks through EAGLE's drafter.
_EAGLE_LINE: dict[str, Any] = dict(drafter="eval.drafters.build.export", needs_export=True,
                                   acceptance=("eagle_topk_accuracy", "val_step_top1"),
                                   teacher_forced="eval.drafters.eagle.eagle_ranks")
# What the exports in EAGLE-3's layout share (EAGLE-3, P-EAGLE): the speculators form, the weight and engine checks.
_EAGLE3_LAYOUT: dict[str, Any] = dict(to_speculators=eagle_io.eagle3_to_speculators,
                                      agrees=eagle_io.eagle3_weights_agree,
                                      engine_reads=eagle_io.eagle3_engine_disagreements)

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("medusa", "Medusa", drafter="eval.drafters.build.export", decoder="eval.drafters.medusa.medusa_drafter",
           training="train.medusa.MedusaModule", network=MedusaHeads, needs_export=True, tree="fixed",
           acceptance=("medusa_topk_accuracy",), serve="medusa", teacher_forced="eval.drafters.medusa.medusa_ranks",
           drafts_per_step=("num_heads", 0),
           export=ExportFormat(("MedusaModel",), medusa_layout, medusa_from_layout, model_type="medusa",
                               reference_weights=("medusa_lm_head.safetensors", "medusa_lm_head.pt"),
                               is_reference=is_medusa_reference, to_reference=medusa_to_reference,
                               from_reference=medusa_from_reference, agrees=medusa_weights_agree)),
    Family("eagle", "EAGLE-1", **_EAGLE_LINE, decoder="eval.drafters.eagle.eagle_drafter",
           training="train.eagle.EagleModule", network=Eagle1Net, tree="dynamic", serve="eagle",
           export=ExportFormat(_EAGLE_ARCHS, eagle_io.eagle_layout, partial(eagle_io.eagle_from_layout, "eagle"),
                               reference_weights=("pytorch_model.bin", "model.safetensors"),
                               is_reference=eagle_io.is_eagle1_reference, to_reference=eagle_io.eagle1_to_reference,
                               from_reference=eagle_io.eagle1_from_reference,
                               agrees=eagle_io.eagle1_weights_agree)),
    Family("eagle3", "EAGLE-3", **_EAGLE_LINE, decoder="eval.drafters.eagle.eagle_drafter",
           training="train.eagle.EagleModule", network=Eagle3Net, tree="dynamic", serve="eagle3", openvino="eagle3",
           llamacpp="draft-eagle3",
           export=ExportFormat(("LlamaForCausalLMEagle3",), eagle_io.eagle_layout,
                               partial(eagle_io.eagle_from_layout, "eagle3"), reads=("Eagle3LlamaForCausalLM",),
                               reference_weights=("model.safetensors", "pytorch_model.bin"),
                               is_reference=eagle_io.is_eagle3_reference, to_reference=eagle_io.eagle3_to_reference,
                               from_reference=eagle_io.eagle3_from_reference,
                               speculators_type="eagle3", from_speculators=eagle_io.eagle3_from_speculators,
                               **_EAGLE3_LAYOUT)),
    Family("peagle", "P-EAGLE", **_EAGLE_LINE, decoder="eval.drafters.peagle.peagle_drafter",
           training="train.peagle.PEagleModule", network=PEagleNet, tree="fixed", serve="eagle3",
           serve_options=(("parallel_drafting", True),),
           export=ExportFormat(("PeagleLlamaForCausalLM",), peagle_io.peagle_layout, peagle_io.peagle_from_layout,
                               speculators_type="peagle", from_speculators=peagle_io.peagle_from_speculators,
                               **_EAGLE3_LAYOUT)),
    Family("dflash", "DFlash", drafter="eval.drafters.build.export", decoder="eval.drafters.dflash.dflash_drafter",
           training="train.dflash.DFlashModule", network=DFlashNet, needs_export=True, tree="fixed",
           acceptance=("eagle_topk_accuracy", "val_step_top1"), serve="dflash",
           llamacpp="draft-dflash", llamacpp_flat=True,
           teacher_forced="eval.drafters.dflash.dflash_ranks", drafts_per_step=("block_size", -1),
           export=ExportFormat(("DFlashDraftModel",), dflash_layout, dflash_from_layout, speculators_type="dflash",
                               to_speculators=dflash_to_speculators, from_speculators=dflash_from_speculators,
                               agrees=dflash_weights_agree)),
    Family("dspark", "DSpark", drafter="eval.drafters.dspark.dspark", decoder="eval.drafters.dspark.dspark_drafter",
           training="train.dspark.DSparkModule", network=DSparkNet, needs_export=True, tree="fixed",
           acceptance=("dspark_confidence_table", "eagle_topk_accuracy", "val_step_top1"), serve="dspark",
           llamacpp="draft-dspark",
           teacher_forced="eval.drafters.dflash.dflash_ranks", drafts_per_step=("block_size", -1),
           export=ExportFormat(("DSparkDraftModel",), dspark_layout, dspark_from_layout, speculators_type="dspark",
                               to_speculators=dspark_to_speculators, from_speculators=dspark_from_speculators,
                               agrees=dflash_weights_agree)),
    Family("dflash2", "DFlash2", drafter="eval.drafters.build.export",
           decoder="eval.drafters.dflash2.dflash2_drafter", training="train.dflash2.DFlash2Module",
           network=DFlash2Net, needs_export=True, tree="fixed", acceptance=("eagle_topk_accuracy", "val_step_top1"),
           serve="dflash", teacher_forced="eval.drafters.dflash2.dflash2_ranks", drafts_per_step=("block_size", -1),
           llamacpp_refusal="llama.cpp b11434 reads z-lab's DFlash2DraftModel, but this toolkit's conversion to it "
                            "(the candidate selector's tensors and keys) is neither written nor checked against "
                            "llama.cpp yet",
           serve_cpu_refusal="its candidate selector runs only in vLLM's Model Runner V2, which needs Triton (a GPU); "
                             "the CPU build's V1 runner refuses DFlash candidate-head drafts",
           export=ExportFormat(("DFlash2DraftModel",), dflash2_layout, dflash2_from_layout,
                               speculators_type="dflash2", to_speculators=dflash2_to_speculators,
                               from_speculators=dflash2_from_speculators, agrees=dflash_weights_agree)),
    Family("draft_model", "draft model", drafter="eval.drafters.draft_model.draft_model",
           training="train.draft_model.DraftModelModule", stored_verifier="eval.drafters.draft_model.stored_verifier"),
    Family("prompt_lookup", "prompt lookup", drafter="eval.drafters.lookup.prompt_lookup"),
    Family("lookahead", "lookahead", drafter="eval.drafters.lookahead.lookahead"),
    Family("hybrid", "hybrid", drafter="eval.drafters.hybrid.hybrid", needs_export=True, tree="primary", min_drafts=1),
)}
BUILT_IN = frozenset(FAMILIES)  # the families this package defines
EXPORT_FAMILIES = tuple(n for n, f in FAMILIES.items() if f.has_export)  # the built-in families an export holds


def export_families() -> tuple[str, ...]:
    """The families an export directory can hold, registered ones included (`register`)."""
    return tuple(n for n, f in FAMILIES.items() if f.has_export)


def register(entry: Family) -> Family:
    """Add a drafter family to the registry: a family defined outside this package (a plugin, or one a test defines)
    is its modules, its two YAMLs (conf/model/<name>.yaml, conf/drafter/<name>.yaml, found through Hydra's
    `hydra.searchpath`) and this one call; no shared module changes. Its name must be new."""
    if entry.name in FAMILIES:
        raise UserError(f"a drafter family named {entry.name!r} is registered already; give the new one another name.")
    FAMILIES[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Remove a family `register` added (a test cleaning up after itself); the built-in ones stay."""
    if name in BUILT_IN:
        raise UserError(f"{name!r} is a built-in family; only a registered one can be removed.")
    FAMILIES.pop(name, None)


def family(name: str, setting: str = "drafter") -> Family:
    """The registry entry `name`, or one error naming the choices (`setting`: the option that gave the name)."""
    if name not in FAMILIES:
        raise UserError(f"{setting}={name!r} is not a drafter family; choose one of {sorted(FAMILIES)}.")
    return FAMILIES[name]


def title(name: str | None) -> str:
    """A family's name for messages (`EAGLE-3`), or the name itself when it is none."""
    return FAMILIES[name].title if name in FAMILIES else str(name)


def a_title(name: str | None) -> str:
    """A family's name with its article, for messages: `a Medusa`, `an EAGLE-3`."""
    t = title(name)
    return f"{'an' if t[:1] in 'AEIOU' else 'a'} {t}"


def family_of_config(config: dict[str, Any]) -> str | None:
    """The family an export's config.json (flattened: models/exports/speculators.py, or as written) holds, or None: its
    model_type or speculators_model_type, else an architecture one family writes or reads, else the project's
    `eagle_kind` key."""
    formats = [(name, fam.export) for name, fam in FAMILIES.items() if fam.export is not None]  # export_families()
    for name, fmt in formats:
        if fmt.model_type and config.get("model_type") == fmt.model_type:
            return name
        if fmt.speculators_type and config.get("speculators_model_type") == fmt.speculators_type:
            return name
    for arch in config.get("architectures") or []:
        for name, fmt in formats:
            if arch in fmt.architectures or arch in fmt.reads:
                return name
    kind = config.get("eagle_kind")
    return kind if kind in export_families() else None


def family_of_net(net: nn.Module) -> str:
    """The family whose network `net` is."""
    for name, fam in FAMILIES.items():
        if fam.network is not None and type(net) is fam.network:
            return name
    raise UserError(f"{type(net).__name__} is no drafter network of a registered family "
                    f"({', '.join(f.network.__name__ for f in FAMILIES.values() if f.network)}).")


def resolve(path: str) -> Any:
    """The object a dotted path names (`eval.drafters.medusa.medusa_drafter`), imported on first use."""
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)
