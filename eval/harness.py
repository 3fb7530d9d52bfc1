"""The evaluation harness behind `python -m eval`, one pass: resolve the config -> read the export(s) once
(models.formats.export.ExportInfo: kind, verifier, acceptance estimates) -> load the verifier -> plan the tree and
build the
drafter(s) -> decode every prompt (eval.runner) -> report. Methods, interleaved in one process so that they share
the machine's state:

- `baseline`: our plain greedy decoding (plain sampling when temperature > 0), one verifier forward per token,
  through the same cache code;
- `speculative` (or, with method=all, one label per family): speculative decoding with the drafter over its chain
  or tree, greedy or sampled (eval.engine.sampling: exact rejection sampling, or Medusa's lossy typical acceptance when
  typical=true);
- `hf_generate`: Hugging Face `model.generate`, greedy or sampled alike, as an outside reference;
- `hf_prompt_lookup`: the same with `prompt_lookup_num_tokens`, HF's own drafter-free speculation;
- `hf_assisted` (with a draft model): HF assisted generation with the same draft model as `assistant_model` and a
  constant `num_assistant_tokens` = its depth.

eval.report (one family) and eval.compare (method=all) turn the samples into report.json, plots and a table.
`evaluate(cfg)` is the whole command.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig

from data.chat import prompt_ids
from data.prompts import Conversation, load_prompt_sets, prompt_set_label
from eval import compare, serving
from eval.drafters.build import (
    build_drafter,
    check_proposals,
    family_config,
    family_of,
    method_name,
    ran_dtype,
)
from eval.engine.block_verify import check_chain_drafters, may_branch
from eval.engine.decode import engine_of, use_engine
from eval.engine.protocol import Combination, Drafter
from eval.engine.rules import named_rule
from eval.engine.tree import AutoTree
from eval.planner import adaptive, cost, shapes
from eval.report import ALONE, GRAFTED, SPECULATIVE, write_outputs
from eval.runner import Runner, assistant_of, check_length, run_prompts, sampling_record, user_turns
from eval.settings import EvalSettings, parse
from models.families import FAMILIES, a_title, resolve
from models.formats.export import ExportInfo, read_info
from models.verifiers.core import Verifier, check_fingerprint
from models.verifiers.load import load_verifier
from runtime.errors import UserError


@dataclass
class Setup:
    """What a run decodes with: the verifier, the drafters by method label (one, `speculative`, or every family with
    method=all), the exports they were read from and the prompts."""

    verifier: Verifier
    drafters: dict[str, Drafter]
    method: str  # report.json's label: `medusa/auto-16`, or "all"
    exports: list[ExportInfo]
    convs: list[Conversation]
    source: Any = None  # the verifier description it was loaded from
    curves: list[cost.Curve] = field(default_factory=list)  # the verifier's cost curves (profile=true, size=auto)
    predicted: cost.Plan | None = None  # what the first curve predicts for this drafter
    auto_size: bool = False
    draft_curve: list[float] | None = None  # ms of one round's drafting at the first curve's sizes
    plans: dict[str, cost.Plan] = field(default_factory=dict)  # method=all, tree.size=auto: each family's plan

    @property
    def drafter(self) -> Drafter:
        return next(iter(self.drafters.values()))


def read_exports(s: EvalSettings, family: str) -> list[ExportInfo]:
    """checkpoint=<export dir> (a list only with method=all), each read once; required by the families that need an
    export, and of the kind `drafter=` names when it names one."""
    if not s.checkpoints:
        if family == "export" or FAMILIES[family].needs_export:
            no_export = [n for n, f in FAMILIES.items() if not f.needs_export]
            raise UserError("checkpoint=<export dir> is required: the `export/` directory train.py printed, e.g. "
                            "python -m eval checkpoint=outputs/medusa-smollm2/export. Drafters that need no export: "
                            f"{', '.join(f'drafter={n}' for n in no_export)}.")
        return []
    if s.checkpoint_list and not s.method_all:
        raise UserError(f"checkpoint={[str(c) for c in s.checkpoints]} is a list; one run takes one export (a list "
                        f"only with method=all).")
    return [read_info(c) for c in s.checkpoints]


def verifier_source_of(s: EvalSettings, family: str, export: ExportInfo | None) -> Any:
    """verifier_path when given, else the verifier the export names (or the one the drafter's own files name: a
    distilled draft model's, through its registry entry's `stored_verifier`), else the default verifier (smollm2)."""
    source = s.verifier_path
    if not source and export is not None:
        source = export.verifier
        if not source:
            raise UserError(f"checkpoint={str(export.path)!r} names no verifier; pass verifier_path=<the verifier>.")
    if not source and FAMILIES[family].stored_verifier:  # named by the drafter's file: local, no code
        source = resolve(FAMILIES[family].stored_verifier)(s.drafter)
    return source or "smollm2"


def check_exports_agree(exports: list[ExportInfo]) -> None:
    """method=all over several exports: one verifier decodes them all, so every export must have been made for the
    same one (their config.json fingerprints agree); refused before anything loads."""
    first = exports[0] if exports else None
    for other in exports[1:]:
        a, b = first.config.get("verifier_fingerprint"), other.config.get("verifier_fingerprint")
        if isinstance(a, dict) and isinstance(b, dict) and a != b:
            key = next(k for k in sorted({*a, *b}) if a.get(k) != b.get(k))
            raise UserError(f"checkpoint=[...]: {str(first.path)!r} was made for the verifier {first.verifier} and "
                            f"{str(other.path)!r} for {other.verifier} (verifier_fingerprint {key}: {a.get(key)!r} "
                            f"vs {b.get(key)!r}); one run decodes with one verifier. Evaluate them in separate runs, "
                            f"or pass exports of the same verifier.")


def check_before_loading(s: EvalSettings, family: str, exports: list[ExportInfo]) -> None:
    """Refuse what the config and the exports' config.json settle alone, before the verifier loads and any cost
    curve is measured (minutes): `drafter=<family>` of another family than the export holds, sampled_drafts for a
    family that drafts from no export, tree.size=0 (plain decoding under a drafter's label), exports of different
    verifiers under method=all, and plan=adaptive where there is nothing to adapt."""
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
    adaptive.plan_mode(s.plan, s.tree, family, export, not s.method_all)


def _every_family(s: EvalSettings, chosen: str, verifier: Verifier, exports: list[ExportInfo],
                  prefix: Callable[[], list[int]]) -> tuple[dict[str, Drafter], dict[str, cost.Plan]]:
    """method=all: every family available, by method label (e.g. `medusa/auto-16`): each export's own family, then
    every family that needs no export, then those that build on one (the hybrid) on the first export. The family
    named by `drafter=` keeps its command-line options; the others take conf/drafter/<name>.yaml as it is.

    tree.size=N gives every tree family N nodes. tree.size=auto (the default) plans each export family's budget as a
    single run would, on one verifier cost curve, the export's own acceptance estimates and the family's own draft
    curve (a parallel drafter's one forward buys it a deeper tree than a sequential one's); a family that cannot be
    planned drafts FALLBACK_SIZE nodes. Returns the drafters and the plans by method label."""
    families: list[tuple[str, Any, ExportInfo | None]] = [(e.kind, family_config(e.kind), e) for e in exports]
    for name, fam in FAMILIES.items():
        if fam.has_export or (fam.needs_export and not exports):
            continue
        families.append((name, s.drafter if name == chosen else family_config(name),
                         exports[0] if exports and fam.needs_export else None))
    policy = s.tree
    auto = isinstance(policy, AutoTree) and policy.size == "auto"
    curve = None
    if auto and any(e is not None and e.acceptance is not None and shapes.shape_of(n).plans for n, _, e in families):
        ids = torch.tensor([prefix()], device=verifier.device)
        curve = cost.measure(verifier, ids, s.threads, s.engine)
    drafters, plans = {}, {}
    for name, drafter_cfg, export in families:
        if curve is None:
            drafter, planned = build_drafter(name, drafter_cfg, verifier, export,
                                             AutoTree(size=cost.FALLBACK_SIZE) if auto else policy,
                                             **proposals_of(s)), None
        else:  # profile=true's extra curves are not drawn here: one curve plans every family
            built = plan_and_build(s, name, drafter_cfg, verifier, export, prefix, curve, profile=False)
            drafter, planned = built.drafter, built.planned
        label = method_name(name, drafter)
        if export is not None and sum(e.kind == export.kind for e in exports) > 1:
            label = f"{label}@{export_tag(export)}"  # two exports of one family: each keeps its own row
        if label in drafters:
            raise UserError(f"checkpoint=[...]: two exports give the method {label}; give each export once, from "
                            "folders with different names.")
        drafters[label] = drafter
        if planned is not None:
            plans[label] = planned
            print(f"[eval] tree.size=auto: {label} plans {planned.size} nodes (predicted "
                  f"{planned.predicted_speedup:.2f}x)")
    return drafters, plans


@dataclass
class Built:
    """One family's drafter as built for the run, with what the planner measured and chose on the way."""

    drafter: Drafter
    curve: cost.Curve | None = None  # the verifier's cost curve at the run's dtype and threads
    planned: cost.Plan | None = None  # the budget tree.size=auto chose
    draft: list[float] | None = None  # ms of one round's drafting at the curve's sizes


def plan_and_build(s: EvalSettings, family: str, drafter_cfg: DictConfig, verifier: Verifier,
                   export: ExportInfo | None, prefix: Callable[[], list[int]], curve: cost.Curve | None = None,
                   profile: bool | None = None) -> Built:
    """Build `family`'s drafter under the tree policy. tree.size=auto: a probe drafter with the largest budget is
    built and its drafting timed, eval.planner.cost chooses the budget on the verifier's cost curve (`curve`, else
    measured now on a real prefix), then the drafter is built with it. profile=true: the drafter's draft curve beside
    the curve."""
    adapt = adaptive.plan_mode(s.plan, s.tree, family, export, not s.method_all)
    policy, auto = shapes.budget_policy(s.tree, family, export)
    profile = s.profile if profile is None else profile

    def build(p: Any) -> Drafter:
        return build_drafter(family, drafter_cfg, verifier, export, p, **proposals_of(s))

    if not (profile or auto):
        return Built(build(policy))
    ids = torch.tensor([prefix()], device=verifier.device)
    engine, threads = s.engine, s.threads
    curve = curve if curve is not None else cost.measure(verifier, ids, threads, engine)
    planned, draft = None, None
    if auto:
        probe = build(AutoTree(size=cost.PROBE_SIZE))
        draft = cost.timed_draft_curve(verifier, probe, ids, curve.sizes, engine, threads)
        planned = cost.auto_size(family, export, curve, draft)
        assert export is not None and export.acceptance is not None  # auto_size refuses an export without them
        # adaptive: the probe itself, built at the largest budget (its depth the deepest any plan may reach), then
        # re-planned round by round; static: the drafter built at the planned budget, predicted round by round.
        drafter = probe if adapt else build(AutoTree(size=planned.size))
        drafter = adaptive.plan(drafter, shapes.shape_of(export.kind), export.acceptance, curve, draft, planned.size,
                                adapt, FAMILIES[family].min_drafts)
        return Built(drafter, curve, planned, draft)
    drafter = build(policy)
    draft = cost.timed_draft_curve(verifier, drafter, ids, curve.sizes, engine, threads)
    return Built(drafter, curve, planned, draft)


def profile_curves(s: EvalSettings, source: Any, verifier: Verifier, prefix: Callable[[], list[int]]
                   ) -> list[cost.Curve]:
    """profile=true: the verifier's cost curve at every other `profile_dtypes` x `profile_threads` (each other dtype's
    verifier loaded for it)."""
    ids = torch.tensor([prefix()], device=verifier.device)
    engine, threads, dtype = s.engine, s.threads, s.dtype
    curves = []
    for other_dtype in s.profile_dtypes:
        other = verifier if other_dtype == dtype else load_verifier(source, other_dtype, s.device, s.cache_dir)
        curves += [cost.measure(other, ids, t, engine) for t in s.profile_threads
                   if (other_dtype, t) != (dtype, threads)]
    return curves


def plan_of(drafter: Drafter) -> str:
    """`adaptive` or `static`: how a planned drafter's budget followed the run (eval.planner.adaptive)."""
    described = drafter.describe()
    return str(described.get("plan") or described.get("primary", {}).get("plan") or "static")


def export_tag(export: ExportInfo) -> str:
    """An export's short name in method labels: its folder's name, or the run's for a train.py `<run>/export`."""
    return export.path.parent.name if export.path.name == "export" else export.path.name


def setup(s: EvalSettings) -> Setup:
    """Read the export(s) and the prompts first (a bad file fails in a second), then load the verifier (the
    export's, `verifier_path`, else the default), then build the drafter(s) with their tree policy (an export made
    for another verifier, or a tree a drafter cannot draft, is refused there)."""
    named = family_of(s.drafter)  # the family, resolved once for the run: "export" takes the export's own
    exports = read_exports(s, named)
    export = exports[0] if exports else None
    family = export.kind if named == "export" and export is not None else named
    check_before_loading(s, family, exports)
    convs = load_prompt_sets(s.prompts, s.num_prompts)
    source = verifier_source_of(s, family, export)
    verifier = load_verifier(source, s.dtype, s.device, s.cache_dir)
    for e in exports:  # an export for another verifier (verifier_path= given): refused before any cost curve
        if isinstance(e.config.get("verifier_fingerprint"), dict) and not e.config.get("reference_layout"):
            check_fingerprint(e.config["verifier_fingerprint"], verifier, f"{a_title(e.kind)} export {str(e.path)!r}")

    def prefix() -> list[int]:  # a real prefix for the cost curve, checked before anything runs on it
        ids = prompt_ids(verifier.tokenizer, user_turns(convs[0])[0], verifier.rendering)
        check_length(verifier, ids, s.max_new_tokens, f"prompt {convs[0].id!r}")
        return ids

    if s.method_all:
        drafters, plans = _every_family(s, family, verifier, exports, prefix)
        return Setup(verifier, drafters, "all", exports, convs, source, plans=plans)

    built = plan_and_build(s, family, s.drafter, verifier, export, prefix)
    curves = [built.curve] if built.curve is not None else []
    if s.profile:
        curves += profile_curves(s, source, verifier, prefix)
    # tree.size=auto: the plan made before the first round (a hybrid: its primary's); else, with a curve, the
    # prediction for the tree given
    predicted = built.planned
    if predicted is None and curves and export is not None and FAMILIES[family].has_export:
        predicted = shapes.predict(export, built.drafter, curves[0], built.draft)
    drafters = {SPECULATIVE: built.drafter}
    if s.alone and export is not None and shapes.shape_of(family).combines:
        # a combination built on the export's drafter (the hybrid): that drafter alone beside it, planned the same
        # way on the same cost curve, so the report gives what the combination adds (report.json drafter_alone)
        drafters[ALONE] = plan_and_build(s, export.kind, family_config(export.kind), verifier, export, prefix,
                                         curve=built.curve).drafter
        if isinstance(built.drafter, Combination):  # and the grafted drafter alone (report.json grafted_alone)
            drafters[GRAFTED] = built.drafter.grafted_alone()
    return Setup(verifier, drafters, method_name(family, built.drafter), exports, convs, source,
                 curves, predicted, built.planned is not None, built.draft)


def chains_only(run: Any) -> list[str]:
    """method=all under verify=block: the methods whose drafters propose trees (block verification is defined on
    chains) leave the run, each named on the console and in report.json's sampling record; a one-family run is
    refused instead (check_chain_drafters)."""
    trees = [m for m, d in run.drafters.items() if may_branch(d)]
    for m in trees:
        print(f"[eval] verify=block: {m} left out, its drafter proposes trees (block verification is defined on "
              f"chains; verify=token runs it)")
        del run.drafters[m]
        run.plans.pop(m, None)
    return trees


def evaluate(cfg: DictConfig, progress: bool = True) -> dict[str, Any]:
    """Run `python -m eval` as configured by conf/eval.yaml; returns report.json's content. The config is read here
    only, parsed once into the run's settings (eval.settings: every value checked before anything loads)."""
    return evaluate_settings(parse(cfg), progress)


def evaluate_settings(s: EvalSettings, progress: bool = True) -> dict[str, Any]:
    """The run for settings already parsed (eval.settings.parse)."""
    wing = serving.settings(s)  # the serving engines' settings, refused here before anything loads
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    try:
        run = setup(s)
        wing = serving.ready(wing, s, run)  # the sweep's length groups and clients, before decoding
        rule = named_rule(s.sampling)  # the acceptance rule asked for (eval.engine.rules)
        left_out = chains_only(run) if run.method == "all" and rule.chains_only else []
        check_chain_drafters(rule, run.drafters.values())  # verify=block: chains only, before decoding
        # HF assisted generation joins the references with the run's first draft model, at its depth
        assistant, depth = next((assistant_of(d) for d in run.drafters.values() if assistant_of(d)[0] is not None),
                                (None, 0))
        runner = Runner(run.verifier, run.drafters, s.max_new_tokens, s.prompt_lookup_num_tokens, s.sampling, s.seed,
                        s.engine, assistant, depth)
        samples = run_prompts(runner, run.convs, s.multi_turn, s.warmup, progress)
        peer_report = serving.measure(wing, s, run, samples)
    finally:
        torch.set_num_threads(threads)  # callers in the same process (tests) keep their own setting
    engine = "engine" if use_engine(run.verifier, s.engine) else "hf"
    record = sampling_record(s.sampling, s.sampled_drafts)
    if run.method == "all":
        return compare.report(s, run.verifier, run.drafters, run.exports, samples,
                              record | ({"left_out_as_trees": left_out} if left_out else {}), engine,
                              {m: asdict(p) for m, p in run.plans.items()})
    # the dtype the drafter's weights ran in, read from the drafter (the setting where it has no weights of its own)
    ran = ran_dtype(run.drafter.describe()) or s.drafter_dtype
    meta = {"method": run.method, "tree": run.drafter.describe(), "verifier": run.verifier.name,
            "drafter_dtype": ran, "checkpoint": s.checkpoint_label, "sampling": record,
            "prompt_sets": None if isinstance(s.prompts, str) else [prompt_set_label(p) for p in s.prompts]}
    setting = {"threads": s.threads, "dtype": s.dtype, "drafter_dtype": ran, "device": str(run.verifier.device),
               "dtype_reason": s.dtype_reason, "engine": engine, "max_new_tokens": s.max_new_tokens,
               "prompt_source": prompt_source(s.prompts), "multi_turn": s.multi_turn,
               "tree": run.drafter.describe()}
    if engine == "engine":  # rows each weight's kernel is padded to, to stay batch-invariant here
        setting["engine_weight_rows"] = engine_of(run.verifier.model).weight_rows
    if run.predicted is not None:
        setting["cost_model"] = {**asdict(run.predicted), "tree_size_auto": run.auto_size, "plan": plan_of(run.drafter),
                                 "draft_curve_ms": run.draft_curve,
                                 "note": "verify time from the cost curve plus the drafter's measured draft time "
                                         "(draft_curve_ms, at the curve's sizes); acceptance, commit and Python "
                                         "overhead excluded"}
    if run.curves:
        cost.write(run.curves, s.output_dir, f"{run.verifier.name}: verifier forward cost")
    report = write_outputs(samples, meta, setting, run.drafter.max_depth, s.output_dir, s.wandb, peers=peer_report,
                           alone_depths={m: run.drafters[m].max_depth for m in (ALONE, GRAFTED) if m in run.drafters})
    if run.predicted is not None:
        p = run.predicted
        rounds = report["predicted_speedup"]
        print(f"speedup: predicted {p.predicted_speedup:.2f}x from the cost curve ({p.size} drafts, E[tokens/round] "
              f"{p.expected_tokens:.2f}, verify {p.verify_ms:.1f} ms + draft {p.draft_ms:.1f} ms vs step "
              f"{p.step_ms:.1f} ms){' [tree.size=auto]' if run.auto_size else ''}"
              f"{'' if rounds is None else f', {rounds:.2f}x round by round (plan={plan_of(run.drafter)})'}; "
              f"measured {report['speedup']:.2f}x")
    return report


def prompt_source(prompts: str | tuple[str, ...]) -> str:
    """report.json's `prompt_source`: the set, or the sets as the command line lists them."""
    return prompts if isinstance(prompts, str) else str(list(prompts))


def proposals_of(s: EvalSettings) -> dict[str, Any]:
    """What build_drafter takes from the settings: the drafter dtype, and sampled_drafts' sampling and seed."""
    return {"dtype": s.drafter_dtype, "sampling": s.proposal_sampling, "seed": s.seed}
