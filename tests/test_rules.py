"""The acceptance-rule seam (eval.engine.acceptance): one rule chosen per run from the sampling settings, each naming
itself and its exactness for the report; a rule defined outside the package (tests/toy_rule.py) registers and decodes
through the real loop and the real command line with no other change."""

from __future__ import annotations

import pytest
import torch

from eval.engine.acceptance import named_rule, rule_for, verify_names
from eval.engine.acceptance.protocol import AcceptanceRule
from eval.engine.sampling import SamplingConfig
from runtime.errors import UserError


def test_the_rule_is_chosen_from_the_sampling_settings():
    chosen = {str(k): rule_for(s) for k, s in {
        "greedy": None, "greedy0": SamplingConfig(temperature=0.0, verify="block"),
        "token": SamplingConfig(temperature=0.7), "block": SamplingConfig(temperature=0.7, verify="block"),
        "typical": SamplingConfig(temperature=0.7, typical=True)}.items()}
    assert {k: r.name for k, r in chosen.items()} == {
        "greedy": "greedy", "greedy0": "greedy", "token": "rejection sampling (exact)",
        "block": "block verification (exact)", "typical": "typical (lossy)"}
    assert [k for k, r in chosen.items() if not r.exact] == ["typical"]
    assert [k for k, r in chosen.items() if r.chains_only] == ["block"]
    assert all(isinstance(r, AcceptanceRule) for r in chosen.values())
    with pytest.raises(UserError, match="verify='first_only' is not one of token, block"):
        named_rule(SamplingConfig(temperature=0.7, verify="first_only"))  # not registered yet


def test_a_new_rule_is_one_module_and_its_registration(tmp_path):
    import toy_rule  # noqa: F401  (registers verify=first_only)

    from eval.drafters.build import make_drafter
    from eval.engine.decode import speculative_decode
    from eval.engine.tree import Chain
    from helpers import varied_llama
    from models.eagle import build_eagle

    assert "first_only" in verify_names()
    verifier = varied_llama()
    net = build_eagle("eagle", verifier)
    with torch.no_grad():
        for p in net.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 0.1)
    cfg = SamplingConfig(temperature=1.0, top_k=4, verify="first_only")
    drafter = make_drafter("eagle", verifier, Chain(3), net=net, sampling=cfg,
                           generator=torch.Generator().manual_seed(8))
    ids = torch.tensor([verifier.tokenizer("Hello, my name is")["input_ids"]])
    out = speculative_decode(verifier, drafter, ids, 16, sampling=cfg, generator=torch.Generator().manual_seed(0))
    assert out.tokens.shape == (1, 16)
    assert int(out.accept_lengths.max()) <= 1 < out.num_forwards  # the toy's rule ran: never past the first draft
    assert rule_for(cfg).name == "first draft only (exact)"
