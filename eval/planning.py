"""The drafters of a run (`build(run)`), built on what eval.setup opened: the verifier, the exports, the plan mode and
the verifier path it decided. tree.size=auto plans each budget on the verifier's cost curve (eval.planner.cost) and
the drafter's own draft curve, through a probe drafter built at the largest budget; profile=true adds the curves at
the other dtypes and thread counts. A single-family run holds `speculative` (and, beside a combination built on the
export's drafter, `drafter_alone` and `grafted_alone`); method=all one label per family. `runner(run)` then gives
the eval.runner.Runner that decodes them, the acceptance rule checked against them first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig

from eval.drafters.build import build_drafter, family_config, method_name
from eval.engine.acceptance import named_rule
from eval.engine.acceptance.block import check_chain_drafters, may_branch
from eval.engine.protocol import Combination, Drafter
from eval.engine.tree import AutoTree
from eval.planner import adaptive, cost, shapes
from eval.report import ALONE, GRAFTED, SPECULATIVE
from eval.runner import Runner, assistant_of
from eval.settings import EvalSettings
from eval.setup import Run
from models.exports.io import ExportInfo
from models.families import FAMILIES
from models.verifiers.load import load_verifier
from runtime.errors import UserError


@dataclass
class Built:
    """One family's drafter as built for the run, with what the planner measured and chose on the way."""

    drafter: Drafter
    curve: cost.Curve | None = None  # the verifier's cost curve at the run's dtype and threads
    planned: cost.Plan | None = None  # the budget tree.size=auto chose
    draft: list[float] | None = None  # ms of one round's drafting at the curve's sizes


def build(run: Run) -> Run:
    """The run's drafters by method label, and what the planner measured for them, held by the run."""
    s = run.settings
    if s.method_all:
        run.drafters, run.plans = every_family(run)
        run.method = "all"
        return run
    export = run.export
    built = plan_and_build(run, run.family, s.drafter, export, adapt=run.adapt)
    run.curves = [built.curve] if built.curve is not None else []
    if s.profile:
        run.curves += profile_curves(run)
    # tree.size=auto: the plan made before the first round (a hybrid: its primary's); else, with a curve, the
    # prediction for the tree given
    run.predicted = built.planned
    if run.predicted is None and run.curves and export is not None and FAMILIES[run.family].has_export:
        run.predicted = shapes.predict(export, built.drafter, run.curves[0], built.draft)
    run.drafters = {SPECULATIVE: built.drafter}
    if s.alone and export is not None and shapes.shape_of(run.family).combines:
        # a combination built on the export's drafter (the hybrid): that drafter alone beside it, planned the same
        # way on the same cost curve, so the report gives what the combination adds (report.json drafter_alone)
        run.drafters[ALONE] = plan_and_build(run, export.kind, family_config(export.kind), export, curve=built.curve,
                                             adapt=run.adapt).drafter
        if isinstance(built.drafter, Combination):  # and the grafted drafter alone (report.json grafted_alone)
            run.drafters[GRAFTED] = built.drafter.grafted_alone()
    run.method = method_name(run.family, built.drafter)
    run.auto_size, run.draft_curve = built.planned is not None, built.draft
    return run


def every_family(run: Run) -> tuple[dict[str, Drafter], dict[str, cost.Plan]]:
    """method=all: every family available, by method label (e.g. `medusa/auto-16`): each export's own family, then
    every family that needs no export, then those that build on one (the hybrid) on the first export. The family
    named by `drafter=` keeps its command-line options; the others take conf/drafter/<name>.yaml as it is.

    tree.size=N gives every tree family N nodes. tree.size=auto (the default) plans each export family's budget as a
    single run would, on one verifier cost curve, the export's own acceptance estimates and the family's own draft
    curve (a parallel drafter's one forward buys it a deeper tree than a sequential one's); a family that cannot be
    planned drafts FALLBACK_SIZE nodes. Returns the drafters and the plans by method label."""
    s, exports = run.settings, run.exports
    families: list[tuple[str, Any, ExportInfo | None]] = [(e.kind, family_config(e.kind), e) for e in exports]
    for name, fam in FAMILIES.items():
        if fam.has_export or (fam.needs_export and not exports):
            continue
        families.append((name, s.drafter if name == run.family else family_config(name),
                         exports[0] if exports and fam.needs_export else None))
    policy = s.tree
    auto = isinstance(policy, AutoTree) and policy.size == "auto"
    curve = None
    if auto and any(e is not None and e.acceptance is not None and shapes.shape_of(n).plans for n, _, e in families):
        ids = torch.tensor([run.prefix()], device=run.verifier.device)
        curve = cost.measure(run.verifier, ids, s.threads, run.engine)
    drafters, plans = {}, {}
    for name, drafter_cfg, export in families:
        if curve is None:
            drafter, planned = build_drafter(name, drafter_cfg, run.verifier, export,
                                             AutoTree(size=cost.FALLBACK_SIZE) if auto else policy,
                                             **proposals_of(s)), None
        else:  # profile=true's extra curves are not drawn here: one curve plans every family
            adapt = adaptive.plan_mode(s.plan, s.tree, name, export, strict=False)  # each family's own
            built = plan_and_build(run, name, drafter_cfg, export, curve, profile=False, adapt=adapt)
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


def plan_and_build(run: Run, family: str, drafter_cfg: DictConfig, export: ExportInfo | None,
                   curve: cost.Curve | None = None, profile: bool | None = None, adapt: bool = False) -> Built:
    """Build `family`'s drafter under the tree policy. tree.size=auto: a probe drafter with the largest budget is
    built and its drafting timed, eval.planner.cost chooses the budget on the verifier's cost curve (`curve`, else
    measured now on a real prefix), then the drafter is built with it, re-planned round by round when `adapt`.
    profile=true: the drafter's draft curve beside the curve."""
    s, verifier = run.settings, run.verifier
    policy, auto = shapes.budget_policy(s.tree, family, export)
    profile = s.profile if profile is None else profile

    def build(p: Any) -> Drafter:
        return build_drafter(family, drafter_cfg, verifier, export, p, **proposals_of(s))

    if not (profile or auto):
        return Built(build(policy))
    ids = torch.tensor([run.prefix()], device=verifier.device)
    engine, threads = run.engine, s.threads
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


def profile_curves(run: Run) -> list[cost.Curve]:
    """profile=true: the verifier's cost curve at every other `profile_dtypes` x `profile_threads` (each other dtype's
    verifier loaded for it, its path decided by the `engine` setting as for its own run)."""
    s, verifier = run.settings, run.verifier
    ids = torch.tensor([run.prefix()], device=verifier.device)
    curves = []
    for other_dtype in s.profile_dtypes:
        same = other_dtype == s.dtype
        other = verifier if same else load_verifier(run.source, other_dtype, s.device, s.cache_dir)
        curves += [cost.measure(other, ids, t, run.engine if same else s.engine) for t in s.profile_threads
                   if (other_dtype, t) != (s.dtype, s.threads)]
    return curves


def runner(run: Run) -> Runner:
    """The Runner of a run whose drafters are built (eval.planning): the acceptance rule asked for, checked against
    the drafters before anything decodes, on the verifier path the run decided; HF assisted generation joins the
    references with the run's first draft model, at its depth."""
    s = run.settings
    rule = named_rule(s.sampling)
    if run.method == "all" and rule.chains_only:
        # verify=block: the methods whose drafters propose trees (block verification is defined on chains) leave the
        # run, each named on the console and in report.json's sampling record; one family is refused instead
        run.left_out = [m for m, d in run.drafters.items() if may_branch(d)]
        for m in run.left_out:
            print(f"[eval] verify=block: {m} left out, its drafter proposes trees (block verification is defined on "
                  f"chains; verify=token runs it)")
            del run.drafters[m]
            run.plans.pop(m, None)
    check_chain_drafters(rule, run.drafters.values())
    assistant, depth = next((assistant_of(d) for d in run.drafters.values() if assistant_of(d)[0] is not None),
                            (None, 0))
    return Runner(run.verifier, run.drafters, s.max_new_tokens, s.prompt_lookup_num_tokens, s.sampling, s.seed,
                  run.engine, assistant, depth)


def plan_of(drafter: Drafter) -> str:
    """`adaptive` or `static`: how a planned drafter's budget followed the run (eval.planner.adaptive)."""
    described = drafter.describe()
    return str(described.get("plan") or described.get("primary", {}).get("plan") or "static")


def export_tag(export: ExportInfo) -> str:
    """An export's short name in method labels: its folder's name, or the run's for a train.py `<run>/export`."""
    return export.path.parent.name if export.path.name == "export" else export.path.name


def proposals_of(s: EvalSettings) -> dict[str, Any]:
    """What build_drafter takes from the settings: the drafter dtype, and sampled_drafts' sampling and seed."""
    return {"dtype": s.drafter_dtype, "sampling": s.proposal_sampling, "seed": s.seed}
