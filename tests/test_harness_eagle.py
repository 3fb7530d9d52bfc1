"""`python -m eval` with EAGLE exports: the drafter family is read from the export; chain and dynamic trees decode
exactly (also on a verifier whose output varies, with a broken KV commit as a negative control); trees that belong
to the other family are refused."""

from __future__ import annotations

import pytest
import torch
from test_eagle_decode import random_net
from test_harness import FAST, off_by_one, run_eval, run_objects

from eval.drafters.build import make_drafter
from eval.engine import session
from eval.engine.tree import Chain, DynamicTree
from eval.planner import cost
from helpers import varied_llama
from models.eagle import build_eagle
from models.exports.io import save_export
from runtime.errors import UserError


@pytest.fixture(scope="module")
def eagle_exports(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle_exports")
    out = {}
    gen = torch.Generator().manual_seed(0)
    for kind in ("eagle", "eagle3"):
        net = build_eagle(kind, tiny, draft_vocab_size=256, aux_layer_ids=[0, 1] if kind == "eagle3" else None)
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        out[kind] = save_export(net, tiny, root / kind)
    return out


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("tree, method", [("tree=chain", "chain-5"), ("tree=dynamic", "dynamic-24")])
def test_eagle_exports_decode_exactly(eagle_exports, tmp_path, kind, tree, method):
    report, profile = run_eval([f"checkpoint={eagle_exports[kind]}", "num_prompts=2", tree, *FAST], tmp_path)
    assert report["method"] == f"{kind}/{method}"
    assert report["greedy_match"] == 1.0 and report["tau"] >= 1.0
    assert len(report["accept_rate_per_position"]) == 5


def test_medusa_trees_are_refused_for_eagle(eagle_exports, tmp_path):
    with pytest.raises(UserError, match="does not fit an EAGLE drafter"):
        run_eval([f"checkpoint={eagle_exports['eagle']}", "tree=medusa_choices", *FAST], tmp_path)


def test_tree_size_zero_is_refused_and_the_report_records_the_real_tree(eagle_exports, tmp_path):
    with pytest.raises(UserError, match="tree.size=0 drafts nothing"):  # once plain decoding labelled eagle3/auto-0
        run_eval([f"checkpoint={eagle_exports['eagle3']}", "num_prompts=1", "tree=auto", "tree.size=0", *FAST],
                 tmp_path)
    report, profile = run_eval([f"checkpoint={eagle_exports['eagle']}", "num_prompts=1", "tree=dynamic",
                                "tree.size=12", "tree.depth=3", "tree.topk=4", *FAST], tmp_path)
    assert profile["tree"] == {"policy": "dynamic", "dynamic": True, "size": 12, "depth": 3, "topk": 4,
                               "max_nodes": 13, "proposals": "topk", "weights": "float32"}
    assert "medusa_choices" not in profile["tree"] and len(report["accept_rate_per_position"]) == 3


@pytest.fixture(scope="module")
def varied():
    return varied_llama()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_eagle_report_is_exact_on_a_varied_verifier_and_a_wrong_commit_shows(varied, tmp_path, monkeypatch, kind):
    net = random_net(kind, varied)
    for tree in (Chain(5), DynamicTree()):
        drafter = make_drafter(kind, varied, tree, net=net)
        report, profile = run_objects(varied, drafter, tmp_path / f"ok-{drafter.max_nodes}")
        assert report["greedy_match"] == 1.0 and set(profile["match_plain_greedy"].values()) == {1.0}
    monkeypatch.setattr(session.kv, "commit", off_by_one)
    broken, _ = run_objects(varied, make_drafter(kind, varied, DynamicTree(), net=net), tmp_path / "broken")
    assert broken["greedy_match"] < 1.0


def test_the_default_budget_is_16_for_an_export_without_acceptance_estimates(eagle_exports, tmp_path, capsys):
    # tree.size=auto is the default; these exports record no eagle_topk_accuracy, so nothing can be planned.
    report, profile = run_eval([f"checkpoint={eagle_exports['eagle']}", "num_prompts=1"], tmp_path)
    assert report["method"] == "eagle/auto-16" and report["greedy_match"] == 1.0
    assert "records no acceptance estimates" in capsys.readouterr().out and "cost_model" not in profile


def test_the_hybrid_on_an_eagle_export_plans_with_its_drafters_table_and_draft_curve(tiny, tmp_path):
    # tree.size=auto (the default) plans the hybrid's budget from its primary (an EAGLE export with its per-depth
    # top-k table) and times the EAGLE drafter's growth per budget; the decode stays exact.
    export = save_export(random_net("eagle", tiny, seed=1), tiny, tmp_path / "e",
                         {"eagle_topk_accuracy": [[0.6, 0.8], [0.5, 0.7], [0.4, 0.6]]})
    report, profile = run_eval(["drafter=hybrid", f"checkpoint={export}", "num_prompts=1"], tmp_path / "out")
    model = profile["cost_model"]
    assert model["tree_size_auto"] and model["size"] >= 1  # the label: the cap of the budget chosen per round
    assert report["method"] == f"hybrid/hybrid-{report['tree']['max_nodes'] - 1}" and report["tree"]["split"]
    assert model["draft_ms"] > 0 and len(model["draft_curve_ms"]) == len(cost.SIZES)  # the EAGLE drafter, timed
    assert report["greedy_match"] == 1.0
