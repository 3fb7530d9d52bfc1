"""The cost curve as a feature (issue 10): tree.size=auto picks the node budget the verifier's cost curve and the
drafter's acceptance estimates predict best, and `python -m eval profile=true` writes the curve beside the bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval.engine.tree import AutoTree, auto_tree, chain
from eval.planner import cost
from helpers import ROOT
from models.exports.io import ExportInfo, save_export
from models.medusa import MedusaHeads
from runtime.errors import UserError

ACCURACY = [[0.6, 0.75, 0.8, 0.83], [0.45, 0.55, 0.6, 0.62], [0.35, 0.42, 0.46, 0.5], [0.25, 0.3, 0.33, 0.35]]
SIZES = [1, 2, 4, 8, 16, 32, 64]


def test_expected_tokens_are_the_tree_node_values():
    tree = auto_tree(ACCURACY, 3)  # (0,), (0, 0), (1,) by value: 0.6, 0.6 * 0.45, 0.15
    assert cost.tree_values(tree, ACCURACY) == pytest.approx([0.6, 0.15, 0.27])
    assert cost.expected_tokens(ACCURACY, 3) == pytest.approx(1 + 0.6 + 0.27 + 0.15)
    assert cost.tree_values(chain(5), ACCURACY)[-1] == 0.0  # no fifth head in the table: never right
    eagle = ExportInfo(Path("."), "eagle3", {"val_step_top1": [0.7, 0.5]}).acceptance
    assert cost.expected_tokens(eagle, 10) == pytest.approx(1 + 0.7 + 0.35)  # a chain: siblings unknown
    # With its per-depth top-k table an EAGLE export plans trees with siblings, and the table wins over the chain.
    table = [[0.5, 0.7], [0.4, 0.6]]
    eagle = ExportInfo(Path("."), "eagle", {"eagle_topk_accuracy": table, "val_step_top1": [0.9, 0.9]}).acceptance
    assert eagle == table
    assert cost.expected_tokens(eagle, 3) == pytest.approx(1 + 0.5 + 0.2 + 0.5 * 0.4)  # (0), (1), (0, 0)


def test_best_size_follows_the_curve():
    flat_then_steep = [10, 10, 10, 10, 10, 20, 40]  # free up to 16 tokens, then linear
    plan = cost.best_size(SIZES, flat_then_steep, ACCURACY)
    assert plan.size == 15 and plan.verify_ms == 10  # every free node, none that costs
    assert plan.predicted_speedup == pytest.approx(cost.expected_tokens(ACCURACY, 15), abs=1e-4)
    linear = [float(n) for n in SIZES]  # a forward costs its tokens: no tree pays
    assert cost.best_size(SIZES, linear, ACCURACY).size == 0
    free = [10.0] * len(SIZES)
    assert cost.best_size(SIZES, free, ACCURACY).size == 63


def test_a_timing_dip_does_not_decide_the_plan():
    """A forward over more tokens is timed below a smaller one (noise: the 2-token forward below the 1-token step);
    the planner reads the curves non-decreasing, so the dip neither makes a tree look cheaper than the step nor picks
    the size. Measured as it was in one run: the 2-token forward 23.4 ms, the step 24.0."""
    ms = [24.0, 23.4, 24.9, 25.0, 25.2, 25.6, 26.4, 27.5, 28.6, 29.8, 32.5, 35.0, 37.6, 43.0]
    assert cost.monotone(ms)[:2] == pytest.approx([23.7, 23.7]) and cost.monotone([1.0, 2.0]) == [1.0, 2.0]
    fitted = cost.monotone(ms)
    assert all(a <= b for a, b in zip(fitted, fitted[1:]))
    one = cost.plan(cost.SIZES, ms, 1.3, 1)
    assert one.verify_ms == one.step_ms  # one draft costs what the step costs, not less
    assert cost.best_size(cost.SIZES, ms, ACCURACY) == cost.best_size(cost.SIZES, fitted, ACCURACY)


def test_draft_time_enters_the_prediction():
    flat = [10.0] * len(SIZES)
    draft = [2.0 * n for n in SIZES]  # drafting costs 2 ms a node
    p = cost.best_size(SIZES, flat, ACCURACY, draft=draft)
    for s in (0, 3, p.size):
        q = cost.plan(SIZES, flat, cost.expected_tokens(ACCURACY, s), s, draft)
        assert q.draft_ms == (0.0 if s == 0 else cost.interpolate(SIZES, draft, s + 1))
        expected = cost.expected_tokens(ACCURACY, s) * 10 / (10 + q.draft_ms)
        assert q.predicted_speedup == pytest.approx(expected, abs=1e-4)
        assert p.predicted_speedup >= q.predicted_speedup
    assert 0 < p.size < 63  # free verification alone would take all 63 (test_best_size_follows_the_curve)
    assert cost.best_size(SIZES, flat, ACCURACY, draft=[100.0] * len(SIZES)).size == 0  # drafting dearer than it pays


def test_the_hybrid_plans_from_its_primarys_table_and_drafts_at_least_one_node():
    linear = cost.Curve("float32", 1, "hf", SIZES, [float(n) for n in SIZES], [], [], {})  # no tree pays
    medusa = ExportInfo(Path("."), "medusa", {"model_type": "medusa", "medusa_topk_accuracy": ACCURACY})
    assert medusa.acceptance == ACCURACY
    eagle = ExportInfo(Path("."), "eagle3", {"architectures": ["Eagle3LlamaForCausalLM"],
                                               "eagle_topk_accuracy": [[0.5, 0.7]]})
    assert eagle.acceptance == [[0.5, 0.7]]
    assert cost.auto_size("medusa", medusa, linear).size == 0  # plain decoding
    assert cost.auto_size("hybrid", medusa, linear).size == 1  # the grafted lookup chain needs a node
    flat = cost.Curve("float32", 1, "hf", SIZES, [10.0] * 7, [], [], {})
    assert cost.auto_size("hybrid", medusa, flat).size == cost.auto_size("medusa", medusa, flat).size == 63


def test_auto_size_needs_the_exports_estimates():
    curve = cost.Curve("float32", 1, "hf", SIZES, [10.0] * 7, [], [], {})
    with pytest.raises(UserError, match="val_step_top1"):
        cost.auto_size("eagle", ExportInfo(Path("."), "eagle", {}), curve)
    with pytest.raises(UserError, match="'auto'"):
        AutoTree(size="big")


def test_auto_dtype_is_bf16_only_with_bf16_units(tmp_path):
    assert cost.auto_dtype("cpu", {"fpu", "avx512f", "avx512_bf16"}) == (
        "bfloat16", "CPU has avx512_bf16 (bf16 matmuls in hardware)")
    assert cost.auto_dtype("cpu", {"amx_bf16", "amx_tile", "avx512_bf16"})[0] == "bfloat16"
    dtype, reason = cost.auto_dtype("cpu", {"fpu", "avx2", "avx512f"})
    assert dtype == "float32" and "neither amx_bf16 nor avx512_bf16" in reason
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx512_bf16 avx2\nbugs\t\t: spectre\n")
    assert cost.cpu_flags(str(cpuinfo)) == {"fpu", "sse", "avx512_bf16", "avx2"}


@pytest.mark.usefixtures("one_thread")
def test_profile_and_auto_size_in_the_harness(tiny, tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from eval.harness import evaluate

    export = save_export(MedusaHeads(tiny.hidden_size, tiny.vocab_size, num_heads=4), tiny, tmp_path / "export",
                         {"medusa_topk_accuracy": ACCURACY})
    out = tmp_path / "run"
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="eval", overrides=[
            f"checkpoint={export}", "drafter=export", "threads=1", "max_new_tokens=8", "num_prompts=2",
            "wandb.mode=disabled",
            "profile=true", "profile_dtypes=[float32,bfloat16]", "profile_threads=[1]", "dtype=auto",  # tree.size: auto
            "plan=static", f"output_dir={out}"])  # the budget planned once (plan=adaptive re-plans it as it decodes)
    evaluate(cfg, progress=False)
    profile = json.loads((out / "profile.json").read_text())
    curves = json.loads((out / "cost_curve.json").read_text())
    dtype, reason = cost.auto_dtype("cpu")  # this machine's choice, which the run records
    assert (profile["dtype"], profile["dtype_reason"]) == (dtype, reason)
    other = {"float32": "bfloat16", "bfloat16": "float32"}[dtype]
    assert [(c["dtype"], c["threads"]) for c in curves] == [(dtype, 1), (other, 1)]  # the run's own curve first
    path = {"float32": "hf", "bfloat16": "engine"}  # auto: HF in fp32 on a CPU, the engine in bf16
    assert [c["path"] for c in curves] == [path[dtype], path[other]]
    assert profile["engine"] == path[dtype]
    if path[dtype] == "engine":  # the row counts [lo, hi] each weight's calls keep to, probed on this machine
        rows = profile["engine_weight_rows"]
        assert sorted(rows) == ["down", "gate_up", "lm_head", "o", "qkv"]
        assert all(lo >= 1 and (hi is None or hi >= lo) for lo, hi in rows.values())
    else:
        assert "engine_weight_rows" not in profile
    first = curves[0]
    assert first["sizes"] == list(cost.SIZES) and all(t > 0 for t in first["ms"])
    assert all(b > 0 for b in first["bound_memory_ms"] + first["bound_compute_ms"])
    model = profile["cost_model"]
    draft = model["draft_curve_ms"]  # Medusa: one propose, the same at every size
    assert len(draft) == len(first["sizes"]) and draft[0] > 0 and len(set(draft)) == 1
    expected = cost.best_size(first["sizes"], first["ms"], ACCURACY, draft=draft)
    assert model["draft_ms"] == (draft[0] if expected.size else 0.0)
    assert model["tree_size_auto"] and model["size"] == expected.size
    assert profile["tree"]["num_nodes"] == expected.size + 1  # the drafter was built with the chosen budget
    assert model["predicted_speedup"] == expected.predicted_speedup
    assert Path(out / "cost_curve.png").stat().st_size > 10_000
