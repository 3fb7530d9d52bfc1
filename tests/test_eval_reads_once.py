"""One `python -m eval` run reads each input once (issue 79): the export's config.json (models.exports.io
.read_config, behind read_info) and its weights (models.exports.io.load_export), the verifier
(models.verifiers.load.load_verifier) and the prompt sets (data.prompts.load_conversations), each counted through a
wrapper around the real loader while a real `evaluate` runs (helpers.count_reads; the load sweep's run, with vLLM, is
counted in tests/test_serve_load.py). The run is the default one, the run that builds the most
drafters from one export: drafter=hybrid with the drafter alone beside it, tree.size=auto (a probe drafter timed on
the verifier's cost curve, then planned); a second read added anywhere on the way fails it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eval.harness import evaluate
from helpers import ROOT, count_reads
from models.exports.io import save_export
from models.medusa import MedusaHeads

ACCURACY = [[0.6, 0.75, 0.8, 0.83], [0.45, 0.55, 0.6, 0.62], [0.35, 0.42, 0.46, 0.5], [0.25, 0.3, 0.33, 0.35]]
EAGLE3 = ROOT / "pretrained" / "eagle3-smollm2"
def _cfg(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return compose(config_name="eval", overrides=["threads=1", "wandb.mode=disabled", "dtype=float32",
                                                      "warmup=false", *overrides])


@pytest.fixture(scope="module")
def medusa_export(tiny, tmp_path_factory) -> Path:
    """A Medusa export of the tiny verifier with its acceptance estimates (so tree.size=auto plans its budget)."""
    heads = MedusaHeads(tiny.hidden_size, tiny.vocab_size, num_heads=4)
    with torch.no_grad():
        for p in heads.parameters():
            p.zero_()
    return save_export(heads, tiny, tmp_path_factory.mktemp("export") / "medusa", {"medusa_topk_accuracy": ACCURACY})


@pytest.mark.usefixtures("one_thread")
def test_the_export_the_verifier_and_the_prompts_are_each_read_once(medusa_export, tmp_path, monkeypatch):
    cfg = _cfg([f"checkpoint={medusa_export}", "num_prompts=2", "max_new_tokens=8", f"output_dir={tmp_path}"])
    calls = count_reads(monkeypatch)
    report = evaluate(cfg, progress=False)
    # the run built the hybrid, its drafter alone and, for tree.size=auto, a probe: several drafters, one export
    assert report["drafter_alone"] is not None and report["grafted_alone"] is not None
    assert json.loads((tmp_path / "report.json").read_text())["num_prompts"] == 2
    assert dict(calls) == {"read_config": 1, "load_export": 1, "load_verifier": 1, "load_conversations": 1}


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_the_default_verifier_and_an_eagle3_export_are_each_read_once(tmp_path, monkeypatch):
    """The same on the default verifier (SmolLM2-135M) with the shipped EAGLE-3 export, method=all: the export's
    family, the hybrid on it and the families that need no export, one read of each input between them."""
    if not EAGLE3.is_dir():
        pytest.skip("pretrained/eagle3-smollm2 is not in this checkout")
    cfg = _cfg([f"checkpoint={EAGLE3}", "method=all", "tree=chain", "tree.depth=2", "num_prompts=1",
                "max_new_tokens=4", f"output_dir={tmp_path}"])
    calls = count_reads(monkeypatch)
    report = evaluate(cfg, progress=False)
    assert report["num_prompts"] == 1 and len(report["methods"]) > 3
    assert dict(calls) == {"read_config": 1, "load_export": 1, "load_verifier": 1, "load_conversations": 1}
