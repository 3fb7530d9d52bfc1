"""The real vLLM 0.32 (CPU, its own virtualenv) serves a DSpark export: speculators type `dspark`, the Markov head
and the confidence head loaded by vLLM's qwen3_dspark, drafting block_size - 1 tokens per step slot by slot through
the Markov bias. Trained once per run by train.py on the default verifier (tests/test_engine_vllm.py's recipe and
helpers), its per-position acceptance equals ours within the tolerance that file derives.

Without the vLLM virtualenv these tests skip, except in CI (CI=true) or under SPECDRAFT_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import json

import pytest
from test_engine_vllm import MAX_NEW, RECIPE, TOKENS, _compare, _ours, exports, prompts, vllm  # noqa: F401

pytestmark = [pytest.mark.engine, pytest.mark.slow]

# The root and TOKENS drafts per block; a small Markov rank for the 40-step recipe.
DSPARK = ["model=dspark", f"model.block_size={TOKENS + 1}", "model.markov_rank=64"]


@pytest.fixture(scope="session")
def dspark_export(exports):  # noqa: F811
    """The DSpark export, trained once per run (the shared exports' cache under its own name)."""
    from helpers import compose_train, run_shared

    with run_shared(exports.tmp_path_factory, "engine-export-dspark") as root:
        done = root / "export.path"
        if not done.is_file():
            done.write_text(str(exports.train_script.run(compose_train([*DSPARK, *RECIPE], root / "run"))))
        from pathlib import Path

        return Path(done.read_text())


def test_vllm_serves_the_dspark_export_and_accepts_what_we_accept(vllm, dspark_export, prompts, smollm2):  # noqa: F811
    """--speculative-config {method: dspark, model: EXPORT, num_speculative_tokens: K}: vLLM reads the speculators
    `dspark` config (markov_rank, the confidence head, the anchor as the bonus token), loads the Markov and
    confidence heads, drafts K tokens a step through the Markov bias, and its alpha_1..K equal ours (a chain of K,
    uncut: vLLM without adaptive verification verifies every draft) within the derived tolerance."""
    config = json.loads((dspark_export / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["markov_rank"] == 64
    assert config["enable_confidence_head"] is True and config["sample_from_anchor"] is False
    assert config["dspark_confidence_table"] and len(config["dspark_confidence"]) == TOKENS
    outs, alpha, rounds = _ours(smollm2, "dspark", dspark_export, prompts)
    assert alpha[0] > 0, "the DSpark drafter accepted nothing here: the comparison would prove nothing"
    run = vllm.serve(smollm2.checkpoint, prompts, MAX_NEW, dtype="float32",
                     spec=vllm.speculative_config("dspark", dspark_export, TOKENS))
    assert run.version == vllm.VERSION and run.resolved["method"] == "dspark"
    _compare(alpha, rounds, run)
    assert sum(a == b for a, b in zip(outs, run.outputs)) >= len(prompts) - 1, (outs, run.outputs)
