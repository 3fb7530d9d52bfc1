"""The real vLLM 0.32 (CPU) with verifier=gemma3 (Gemma 3 270M, 262,144-token vocabulary, plain rendering).

vLLM loads the cached checkpoint models/verifiers/embedded.py dequantised (the same folder our verifier loads), serves
each
family it serves for Gemma 3 from a fresh export, and refuses the rest with its own message:

- Medusa is served: its export drafts in vLLM, and vLLM's per-position acceptance equals ours on the same prompts and
  chains within the tolerance tests/test_engine_vllm.py derives. The export is Medusa as initialised (each head's
  residual block zero, so each head is the verifier's own head): training on Gemma 3 takes minutes a step on the
  CI machine (docs/results/gemma3.md). A head that repeats the verifier's next-token guess is accepted where the
  text repeats, so the prompts are plain text that a base model continues by repeating.
- EAGLE-3 (and every family that drafts from the verifier's intermediate layers: P-EAGLE, DFlash) is refused:
  vLLM 0.32's Gemma3ForCausalLM does not implement its EAGLE-3 interface (aux hidden states). The refusal does not
  depend on the weights, so a freshly built export shows it. P-EAGLE's and DFlash's refusals are asserted on the
  tiny Gemma 3 of tests/test_conformance_matrix.py (same vLLM model class, seconds instead of minutes to load).

Without the vLLM virtualenv these tests skip, except in CI (CI=true) or under SPECDRAFT_REQUIRE_VLLM=1, where they fail.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

pytestmark = [pytest.mark.engine, pytest.mark.slow]

TOKENS = 2  # speculative tokens per step, ours and vLLM's
MAX_NEW = 24
# Plain text (Gemma 3 is a base model) that it continues by repeating: where Medusa's fresh heads get accepted.
TEXTS = ["a a a a a a a a a a a a", "1, 1, 1, 1, 1, 1, 1, 1,", "Yes. Yes. Yes. Yes. Yes. Yes."]
EAGLE3_REFUSAL = "Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested"


@pytest.fixture(scope="module")
def prompts(gemma3):
    from data.chat import prompt_ids

    return [prompt_ids(gemma3.tokenizer, [{"role": "user", "content": t}], gemma3.rendering)[:-1] for t in TEXTS]


def _tolerance(p: float, n_ours: int, n_vllm: int) -> float:
    """As tests/test_engine_vllm.py: four standard errors of the difference of two binomial rates at the pooled rate
    (at least that of p = 0.05), plus one round's weight on each side."""
    q = min(max(p, 0.05), 0.95)
    return 4 * math.sqrt(q * (1 - q) * (1 / n_ours + 1 / n_vllm)) + 1 / n_ours + 1 / n_vllm


def test_vllm_serves_medusa_on_gemma3_and_accepts_what_we_accept(vllm, gemma3, prompts, tmp_path):
    """--speculative-config {method: medusa, model: EXPORT}: vLLM loads Gemma 3 from our cache and the Medusa export
    beside it, drafts, and its alpha_1..2 equal ours (eval's exact decoder, chains of 2) within the derived
    tolerance; its greedy output is ours on most prompts."""
    from eval.drafters.build import make_drafter
    from eval.engine.decode import speculative_decode
    from eval.engine.tree import Chain
    from models.exports.io import save_export
    from models.medusa import MedusaHeads

    heads = MedusaHeads(gemma3.hidden_size, gemma3.vocab_size, num_heads=TOKENS)
    export = save_export(heads, gemma3, tmp_path / "medusa")
    drafter = make_drafter("medusa", gemma3, Chain(TOKENS), checkpoint=export)
    outs, lengths = [], []
    for ids in prompts:
        res = speculative_decode(gemma3, drafter, torch.tensor([ids]), MAX_NEW,
                                 eos_token_id=gemma3.tokenizer.eos_token_id)
        outs.append(res.tokens[0].tolist())
        lengths.append(res.accept_lengths[:, 0])
    rounds = torch.cat(lengths)
    ours = [float((rounds >= k).float().mean()) for k in range(1, TOKENS + 1)]
    assert ours[0] > 0, "Medusa accepted nothing here: the comparison would prove nothing"
    run = vllm.serve(gemma3.checkpoint, prompts, MAX_NEW, dtype="float32",
                     spec=vllm.speculative_config("medusa", export, TOKENS))
    assert run.resolved["method"] == "medusa" and run.spec["num_drafts"] > 0
    assert len(run.alpha) == TOKENS
    print(f"medusa on gemma3: alpha ours {ours} ({rounds.numel()} rounds), vLLM {run.alpha} "
          f"({run.spec['num_drafts']} drafts), vLLM load {run.load_seconds:.1f} s")
    for k, (a, b) in enumerate(zip(ours, run.alpha), start=1):
        tol = _tolerance((a + b) / 2, rounds.numel(), run.spec["num_drafts"])
        assert abs(a - b) <= tol, f"alpha_{k}: ours {a:.3f} vLLM {b:.3f}, tolerance {tol:.3f}"
    assert sum(a == b for a, b in zip(outs, run.outputs)) >= len(prompts) - 1, (outs, run.outputs)


def test_vllm_refuses_eagle3_on_gemma3_with_its_own_message(vllm, gemma3, tmp_path):
    """An EAGLE-3 export for Gemma 3 (the speculators format naming Gemma3ForCausalLM and our cached checkpoint), given
    through --speculative-config, is refused by vLLM 0.32 in its own words: Gemma 3 has no EAGLE-3 interface there."""
    from models.eagle import build_eagle
    from models.exports.io import save_export

    torch.manual_seed(0)
    export = save_export(build_eagle("eagle3", gemma3, draft_vocab_size=64), gemma3, tmp_path / "eagle3")
    config = json.loads((export / "config.json").read_text())
    assert config["speculators_config"]["verifier"] == {"name_or_path": gemma3.checkpoint,
                                                          "architectures": ["Gemma3ForCausalLM"]}
    with pytest.raises(vllm.EngineError) as refused:
        vllm.serve(gemma3.checkpoint, [[2, 818, 5279]], 4, dtype="float32",
                   spec=vllm.speculative_config("eagle3", export, TOKENS))
    assert EAGLE3_REFUSAL in refused.value.log, refused.value.cause
