"""`python -m eval`'s run, opened once (`open(settings) -> Run`): the export(s) read once (their family, verifier and
acceptance estimates: models.exports.io.ExportInfo), every refusal the settings and the exports' config.json
settle alone in one check (`check`), the prompts loaded once, the verifier loaded once, and the verifier path of our
decode loops (eval.engine.forward or Hugging Face's forward) decided once. The later steps (eval.planning builds
the drafters, eval.runner decodes, eval.serving measures, eval.published writes) take the Run and ask it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from data.chat import prompt_ids
from data.prompts import Conversation, load_prompt_pool, load_prompt_sets
from eval import serving as wing
from eval.drafters.build import check_proposals, family_of
from eval.engine.session import use_engine
from eval.planner import adaptive
from eval.runner import check_length, user_turns
from eval.settings import EvalSettings
from models.exports.io import ExportInfo, read_info
from models.families import FAMILIES, a_title, resolve
from models.verifiers.core import Verifier, check_fingerprint
from models.verifiers.load import load_verifier
from runtime.errors import UserError

if TYPE_CHECKING:
    from eval.engine.protocol import Drafter
    from eval.planner import cost


@dataclass
class Run:
    """One run: what setup opened (settings, family, exports, prompts, verifier, its path, the plan mode), then what
    the planner built on it (the drafters by method label: `speculative`, `drafter_alone`, `grafted_alone`, or every
    family with method=all, and what it measured on the way)."""

    settings: EvalSettings
    family: str  # the family `drafter=` names, resolved once ("export": the export's own)
    exports: list[ExportInfo]
    convs: list[Conversation]
    source: Any  # the verifier description it was loaded from (a name, a Hub id, a path or a loader's arguments)
    verifier: Verifier
    engine: str  # the verifier path of every decode loop and cost curve: "engine" or "hf", decided once
    adapt: bool  # plan=: whether the single family's budget is re-planned round by round (eval.planner.adaptive)
    serving: wing.Serving  # the serving wing's settings, checked against the export (eval.serving.check)
    pool: list[list[Conversation]]  # every eval prompt of the prompt set(s), set by set: `convs` is drawn from it
    drafters: dict[str, Drafter] = field(default_factory=dict)
    method: str = ""  # report.json's label: `medusa/auto-16`, or "all"
    curves: list[cost.Curve] = field(default_factory=list)  # the verifier's cost curves (profile=true, size=auto)
    predicted: cost.Plan | None = None  # what the first curve predicts for this drafter
    auto_size: bool = False
    draft_curve: list[float] | None = None  # ms of one round's drafting at the first curve's sizes
    plans: dict[str, cost.Plan] = field(default_factory=dict)  # method=all, tree.size=auto: each family's plan
    left_out: list[str] = field(default_factory=list)  # method=all under verify=block: the tree drafters left out

    @property
    def export(self) -> ExportInfo | None:
        return self.exports[0] if self.exports else None

    @property
    def drafter(self) -> Drafter:
        return next(iter(self.drafters.values()))

    def prefix(self) -> list[int]:
        """A real prefix for the cost curves (the first prompt), checked before anything runs on it."""
        conv = self.convs[0]
        ids = prompt_ids(self.verifier.tokenizer, user_turns(conv)[0], self.verifier.rendering)
        check_length(self.verifier, ids, self.settings.max_new_tokens, f"prompt {conv.id!r}")
        return ids


def check(s: EvalSettings, family: str, exports: list[ExportInfo]) -> tuple[bool, wing.Serving]:
    """Every refusal the settings and the exports' config.json settle alone, before the verifier loads and any cost
    curve is measured (minutes): no export for a family that needs one, `drafter=<family>` of another family than
    the export holds, sampled_drafts for a family that drafts from no export, tree.size=0 (plain decoding under a
    drafter's label), exports of different verifiers under method=all, and plan=adaptive where there is nothing to
    adapt; the serving wing's settings against the export (eval.serving.check: a family vLLM does not serve, a K
    beyond what the export drafts). Returns the plan mode (eval.planner.adaptive.plan_mode), decided here once, and
    the serving wing's checked settings."""
    if not exports and (family == "export" or FAMILIES[family].needs_export):
        no_export = [n for n, f in FAMILIES.items() if not f.needs_export]
        raise UserError("checkpoint=<export dir> is required: the `export/` directory train.py printed, e.g. "
                        "python -m eval checkpoint=outputs/medusa-smollm2/export. Drafters that need no export: "
                        f"{', '.join(f'drafter={n}' for n in no_export)}.")
    export = exports[0] if exports else None
    if not s.method_all and export is not None and FAMILIES[family].has_export and family != export.kind:
        raise UserError(f"checkpoint={str(export.path)!r} is {a_title(export.kind)} export but drafter={family} asks "
                        f"for {a_title(family)} one. Use drafter={export.kind} (or leave drafter= out: the export's "
                        f"own family), or pass {a_title(family)} export.")
    if not s.method_all:
        check_proposals(s.sampled_drafts, family)
    if getattr(s.tree, "size", None) == 0:
        raise UserError("tree.size=0 drafts nothing: the run would be plain decoding labelled as speculative "
                        "(report.json measures plain decoding as `baseline` already). Give tree.size >= 1 draft "
                        "nodes per round, or tree.size=auto to plan it from the verifier's cost curve.")
    check_exports_agree(exports)
    serving = wing.check(s.serving, export)
    return adaptive.plan_mode(s.plan, s.tree, family, export, not s.method_all), serving


def check_exports_agree(exports: list[ExportInfo]) -> None:
    """method=all over several exports: one verifier decodes them all, so every export must have been made for the
    same one (their config.json fingerprints agree)."""
    first = exports[0] if exports else None
    for other in exports[1:]:
        a, b = first.config.get("verifier_fingerprint"), other.config.get("verifier_fingerprint")
        if isinstance(a, dict) and isinstance(b, dict) and a != b:
            key = next(k for k in sorted({*a, *b}) if a.get(k) != b.get(k))
            raise UserError(f"checkpoint=[...]: {str(first.path)!r} was made for the verifier {first.verifier} and "
                            f"{str(other.path)!r} for {other.verifier} (verifier_fingerprint {key}: {a.get(key)!r} "
                            f"vs {b.get(key)!r}); one run decodes with one verifier. Evaluate them in separate runs, "
                            f"or pass exports of the same verifier.")


def verifier_source_of(s: EvalSettings, family: str, export: ExportInfo | None) -> Any:
    """verifier_path when given, else the verifier the export names (or the one the drafter's own files name: a
    distilled draft model's, through its registry entry's `stored_verifier`), else the default verifier (smollm2)."""
    source: Any = s.verifier_path
    if not source and export is not None:
        source = export.verifier
        if not source:
            raise UserError(f"checkpoint={str(export.path)!r} names no verifier; pass verifier_path=<the verifier>.")
    if not source and FAMILIES[family].stored_verifier:  # named by the drafter's file: local, no code
        source = resolve(FAMILIES[family].stored_verifier)(s.drafter)
    return source or "smollm2"


def open(s: EvalSettings) -> Run:
    """Read the export(s) and the prompts first (a bad file fails in a second), refuse what they settle, then load
    the verifier (the export's, `verifier_path`, else the default) and decide its path; an export made for another
    verifier is refused here, before any cost curve."""
    named = family_of(s.drafter)
    exports = [read_info(c) for c in s.checkpoints]
    export = exports[0] if exports else None
    family = export.kind if named == "export" and export is not None else named
    adapt, serving = check(s, family, exports)
    pool = load_prompt_pool(s.prompts)
    convs = load_prompt_sets(s.prompts, s.num_prompts, pool)
    source = verifier_source_of(s, family, export)
    verifier = load_verifier(source, s.dtype, s.device, s.cache_dir)
    for e in exports:
        if isinstance(e.config.get("verifier_fingerprint"), dict) and not e.config.get("reference_layout"):
            check_fingerprint(e.config["verifier_fingerprint"], verifier, f"{a_title(e.kind)} export {str(e.path)!r}")
    engine = "engine" if use_engine(verifier, s.engine) else "hf"
    return Run(s, family, exports, convs, source, verifier, engine, adapt, serving, pool)
