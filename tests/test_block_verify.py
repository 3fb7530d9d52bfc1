"""Proof that block verification (eval.engine.acceptance.block, verify=block) keeps the warped verifier distribution.

1. Exact: on a small vocabulary, every drafted chain (sampled: weighted by the drafter's p; deterministic: the top-1
   chain) is enumerated, the rule's exact law (`block_outcome_distribution` over `block_plan`, the plan
   `sample_block` draws from) gives what one round emits, and the verifier continues from there: the first emitted
   token, and the whole block (the first g+1 tokens), must follow warped q to 1e-9. Negative controls (the token
   rule's residual in the block rule; q instead of a residual; every block accepted) must fail. Beside it, Theorem 2
   of the paper: block verification accepts more drafts than token by token (sampled drafts), and as many in law
   for deterministic drafts.
2. Statistical: 20k rounds through `block_accept` (batched on the same small world) against 20k draws from q:
   chi-square on the first g+1 tokens, with a fixed seed; drawing from q instead of the residual must fail.
3. The decode loop and the harness: temperature 0 is greedy whatever `verify` says (greedy_match 1.0 on the tiny
   verifier through the harness; slow: plain greedy's tokens with pretrained/eagle3-smollm2's chain); sampled
   decoding with verify=block runs on real drafters; a tree, an unknown rule, or typical acceptance with it are one
   UserError each.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest
import torch
from scipy.stats import chi2_contingency

from eval.engine.acceptance.block import BlockPlan, block_accept, block_outcome_distribution, block_plan, sample_block
from eval.engine.acceptance.sampled import outcome_distribution, rejection_plan
from eval.engine.sampling import SamplingConfig, warp
from eval.engine.tree import chain, tree_buffers
from helpers import ROOT
from runtime.errors import UserError

V, G = 3, 3  # vocabulary, drafts per chain: 27 sampled chains, 81 sequences of G + 1 tokens
TOL = 1e-9
SETTINGS = {"t1": (1.0, 1.0, 0), "t0.7": (0.7, 1.0, 0), "t0.7-top_k2": (0.7, 1.0, 2)}


class World:
    """A verifier q and a drafter p over every context of up to G tokens after a fixed root, as tables indexed by
    the context's tokens read as a base-V number: q[n][c] is q after the n-token context c (n = 0..G), p[n][c] the
    drafter's distribution for the (n+1)-th draft. p is q's logits plus noise, so drafts are often accepted."""

    def __init__(self, seed: int, setting: tuple[float, float, int], noise: float = 1.0) -> None:
        gen = torch.Generator().manual_seed(seed)
        logits = [torch.randn(V**n, V, generator=gen, dtype=torch.float64) * 2 for n in range(G + 1)]
        self.q = [self._warp(x, setting) for x in logits]
        self.p = [self._warp(x[:] + noise * torch.randn(x.shape, generator=gen, dtype=torch.float64), setting)
                  for x in logits[:G]]

    @staticmethod
    def _warp(logits: torch.Tensor, setting: tuple[float, float, int]) -> torch.Tensor:
        probs = warp(logits, *setting).double()
        return probs / probs.sum(-1, keepdim=True)  # exactly normalised in float64

    @staticmethod
    def index(context: torch.Tensor) -> torch.Tensor:
        """(..., n) tokens -> (...,) base-V index of the context."""
        weights = V ** torch.arange(context.shape[-1] - 1, -1, -1)
        return (context * weights).sum(-1)

    def round_inputs(self, drafts: torch.Tensor, sampled: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens (B, G+1), q (B, G+1, V), p (B, G+1, V) for B drafted chains (B, G)."""
        q = torch.stack([self.q[n][self.index(drafts[:, :n])] for n in range(G + 1)], dim=1)
        p = torch.stack([torch.zeros(len(drafts), V, dtype=torch.float64)]
                        + [self.p[n][self.index(drafts[:, :n])] for n in range(G)], dim=1)
        tokens = torch.cat([torch.zeros(len(drafts), 1, dtype=torch.long), drafts], dim=1)
        return tokens, q, p if sampled else None

    def seq_prob(self, seq: tuple[int, ...], start: int = 0) -> float:
        """q's probability of seq[start:] given seq[:start]."""
        out = 1.0
        for n in range(start, len(seq)):
            out *= float(self.q[n][self.index(torch.tensor(seq[:n], dtype=torch.long))][seq[n]])
        return out

    def top1_chain(self) -> tuple[int, ...]:
        drafts: list[int] = []
        for n in range(G):
            drafts.append(int(self.p[n][self.index(torch.tensor(drafts, dtype=torch.long))].argmax()))
        return tuple(drafts)


def _round_law(world: World, sampled: bool, plan_of=block_plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(the law of the first G+1 tokens after one round and the verifier's continuation (V,)*(G+1), the law of
    the drafts accepted (G+1,)), every drafted chain enumerated."""
    chains = list(itertools.product(range(V), repeat=G)) if sampled else [world.top1_chain()]
    drafts = torch.tensor(chains)
    tokens, q, p = world.round_inputs(drafts, sampled)
    weight = torch.ones(len(chains), dtype=torch.float64)
    if sampled:
        for n in range(G):
            weight *= p[torch.arange(len(chains)), n + 1, drafts[:, n]]
    stop = block_outcome_distribution(plan_of(tokens, q, None if p is None else p))  # (B, G+1, V)
    emitted: dict[tuple[int, ...], float] = {}
    for b, chain_ in enumerate(chains):
        for tau in range(G + 1):
            for y in range(V):
                key = chain_[:tau] + (y,)
                emitted[key] = emitted.get(key, 0.0) + float(weight[b] * stop[b, tau, y])
    law = torch.zeros((V,) * (G + 1), dtype=torch.float64)
    for seq in itertools.product(range(V), repeat=G + 1):
        law[seq] = sum(emitted.get(seq[:k], 0.0) * world.seq_prob(seq, k) for k in range(1, G + 2))
    accepted = (weight[:, None] * stop.sum(-1)).sum(0)  # (G+1,) P(tau = t)
    return law, accepted


def _target(world: World) -> torch.Tensor:
    law = torch.zeros((V,) * (G + 1), dtype=torch.float64)
    for seq in itertools.product(range(V), repeat=G + 1):
        law[seq] = world.seq_prob(seq)
    return law


def _token_rule_accepted(world: World, sampled: bool) -> torch.Tensor:
    """The law of the drafts accepted by token-by-token rejection sampling on the same chains. (G+1,)"""
    chains = list(itertools.product(range(V), repeat=G)) if sampled else [world.top1_chain()]
    drafts = torch.tensor(chains)
    tokens, q, p = world.round_inputs(drafts, sampled)
    weight = torch.ones(len(chains), dtype=torch.float64)
    if sampled:
        for n in range(G):
            weight *= p[torch.arange(len(chains)), n + 1, drafts[:, n]]
    _, stop = outcome_distribution(rejection_plan(chain(G).parents, tokens, q, p))
    return (weight[:, None] * stop.sum(-1)).sum(0)


def _token_residual(tokens, q, p):
    """Negative control: the block rule with the token rule's residual norm(max(q_i - p_{i+1}, 0)), w_i left out."""
    plan = block_plan(tokens, q, p)
    drafted = p[:, 1:] if p is not None else torch.zeros_like(q[:, 1:]).scatter_(-1, tokens[:, 1:, None], 1.0)
    left = (q[:, :-1] - drafted).clamp(min=0)
    left = left / left.sum(-1, keepdim=True).clamp(min=1e-300)
    return replace(plan, final=torch.cat([left, q[:, -1:]], dim=1))


def _no_residual(tokens, q, p):
    """Negative control: after the block's verdict, the next token drawn from q itself, not from the residual."""
    plan = block_plan(tokens, q, p)
    return replace(plan, final=q)


def _accept_all(tokens, q, p):
    plan = block_plan(tokens, q, p)
    return BlockPlan(plan.joint_ratio, torch.ones_like(plan.accept_prob), plan.final)


# -- 1. exact -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "top1"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_exact_law_is_warped_q(setting, sampled):
    world = World(0, SETTINGS[setting])
    law, accepted = _round_law(world, sampled)
    target = _target(world)
    assert float(law.sum()) == pytest.approx(1.0, abs=TOL)
    torch.testing.assert_close(law.sum(dim=tuple(range(1, G + 1))), world.q[0][0], atol=TOL, rtol=0)  # 1st token
    torch.testing.assert_close(law, target, atol=TOL, rtol=0)  # the whole block and the continuation
    token = _token_rule_accepted(world, sampled)
    mean = lambda law_: float((law_ * torch.arange(G + 1)).sum())  # noqa: E731
    if sampled:  # Theorem 2: never fewer drafts accepted than token by token; here strictly more
        assert mean(accepted) > mean(token) + 1e-3
    else:  # one-hot drafts: the same law of accepted drafts
        torch.testing.assert_close(accepted, token, atol=TOL, rtol=0)


@pytest.mark.parametrize("control", [_token_residual, _no_residual, _accept_all],
                         ids=["token-residual", "no-residual", "accept-all"])
def test_exact_law_negative_controls_fail(control):
    world = World(0, SETTINGS["t1"])
    law, _ = _round_law(world, True, plan_of=control)
    assert (law - _target(world)).abs().max() > 1e-4  # 1e5 x TOL; the token residual is off by 8e-4


def test_no_drafts_is_one_draw_from_q():
    q = warp(torch.randn(2, 1, 5, generator=torch.Generator().manual_seed(0)), 1.0)
    plan = block_plan(torch.zeros(2, 1, dtype=torch.long), q, None)
    torch.testing.assert_close(block_outcome_distribution(plan), q)


# -- 2. statistical -----------------------------------------------------------------------------------------------

SAMPLES = 20_000


def _sampled_sequences(world: World, seed: int, plan_of=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the first G+1 tokens after one round of block verification and q's continuation, the same drawn from q
    directly), (SAMPLES, G+1) each. The drafts are drawn from p, one chain per row."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.zeros(SAMPLES, G, dtype=torch.long)
    for n in range(G):
        drafts[:, n] = torch.multinomial(world.p[n][World.index(drafts[:, :n])], 1, generator=gen)[:, 0]
    tokens, q, p = world.round_inputs(drafts, True)
    if plan_of is None:  # the rule as the decode loop calls it
        acc = block_accept(tree_buffers(chain(G)).retrieve, chain(G).parents, tokens, q, p, gen)
        tau, y = acc.num_accepted, acc.next_token
    else:
        tau, y = sample_block(plan_of(tokens, q, p), gen)
    seq = torch.where(torch.arange(G)[None] < tau[:, None], drafts, 0)
    seq = torch.cat([seq, torch.zeros(SAMPLES, 1, dtype=torch.long)], dim=1)
    seq[torch.arange(SAMPLES), tau] = y
    for n in range(1, G + 1):  # the verifier continues after the emitted tokens
        drawn = torch.multinomial(world.q[n][World.index(seq[:, :n])], 1, generator=gen)[:, 0]
        seq[:, n] = torch.where(tau < n, drawn, seq[:, n])
    direct = torch.zeros(SAMPLES, G + 1, dtype=torch.long)
    for n in range(G + 1):
        direct[:, n] = torch.multinomial(world.q[n][World.index(direct[:, :n])], 1, generator=gen)[:, 0]
    return seq, direct


def _chi2_p(a: torch.Tensor, b: torch.Tensor) -> float:
    cells = World.index(torch.cat([a, b]))
    table = torch.stack([torch.bincount(World.index(s), minlength=V ** (G + 1)) for s in (a, b)])
    table = table[:, torch.bincount(cells, minlength=V ** (G + 1)) > 0]
    return float(chi2_contingency(table.numpy())[1])


@pytest.mark.parametrize("setting", ["t1", "t0.7-top_k2"])
def test_sampled_rounds_follow_the_verifier(setting):
    spec, direct = _sampled_sequences(World(1, SETTINGS[setting], noise=0.5), seed=11)
    assert _chi2_p(spec, direct) > 0.01


def test_sampled_rounds_without_the_residual_fail():
    # (the token rule's residual in the block rule is wrong by a total variation of 1e-3 here: the exact check
    # above catches it, 20k samples cannot)
    spec, direct = _sampled_sequences(World(1, SETTINGS["t1"], noise=0.5), seed=11, plan_of=_no_residual)
    assert _chi2_p(spec, direct) < 1e-6


# -- 3. the decode loop and the harness ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def varied():
    from helpers import varied_llama

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield varied_llama()
    torch.set_num_threads(before)


def _eagle(verifier, tree, cfg: SamplingConfig | None):
    from eval.drafters.build import make_drafter
    from models.eagle import build_eagle

    net = build_eagle("eagle", verifier)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in net.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return make_drafter("eagle", verifier, tree, net=net, sampling=cfg, generator=torch.Generator().manual_seed(8))


def test_decode_greedy_is_token_by_token_and_sampled_block_runs(varied):
    from eval.engine.decode import greedy_decode, speculative_decode
    from eval.engine.tree import Chain

    ids = torch.tensor([varied.tokenizer("Hello, my name is")["input_ids"]])
    greedy = greedy_decode(varied, ids, 12).tokens
    out = speculative_decode(varied, _eagle(varied, Chain(3), None), ids, 12,
                             sampling=SamplingConfig(temperature=0.0, verify="block"))
    assert torch.equal(out.tokens, greedy)
    cfg = SamplingConfig(temperature=1.0, top_k=6, verify="block")
    out = speculative_decode(varied, _eagle(varied, Chain(3), cfg), ids, 16, sampling=cfg,
                             generator=torch.Generator().manual_seed(0))
    assert out.tokens.shape == (1, 16) and out.tau >= 1.0 and out.num_forwards <= 17


def test_decode_refuses_a_tree(varied):
    from eval.engine.decode import speculative_decode
    from eval.engine.tree import DynamicTree

    ids = torch.tensor([varied.tokenizer("Hello")["input_ids"]])
    cfg = SamplingConfig(temperature=1.0, verify="block")
    with pytest.raises(UserError, match=r"defined on chains.*tree=chain"):
        speculative_decode(varied, _eagle(varied, DynamicTree(size=6, depth=2, topk=3), None), ids, 4, sampling=cfg)
    with pytest.raises(UserError, match=r"defined on chains.*tree=chain"):  # the rule itself, on a tree's parents
        block_accept(torch.zeros(2, 2, dtype=torch.long), (-1, 0, 0), torch.zeros(1, 3, dtype=torch.long),
                     torch.full((1, 3, 4), 0.25), None)


@pytest.mark.parametrize("bad", [dict(verify="blocks"), dict(verify="block", typical=True)],
                         ids=["unknown", "typical"])
def test_bad_verify_settings_are_one_user_error(bad):
    from eval.engine.acceptance import named_rule

    with pytest.raises(UserError, match="verify"):
        named_rule(SamplingConfig(temperature=0.7, **bad))


def test_report_records_the_rule():
    from eval.engine.sampling import sampling_config
    from eval.runner import sampling_record

    block = sampling_record(sampling_config({"temperature": 0.7, "verify": "block"}))
    assert block["verify"] == "block" and block["rule"] == "block verification (exact)" and block["exact"]
    assert sampling_record(sampling_config({"temperature": 0.7}))["verify"] == "token"


def _run_eval(overrides: list[str], out) -> dict:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from eval.harness import evaluate

    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="eval", overrides=["threads=1", "wandb.mode=disabled", "warmup=false",
                                                     "drafter=export", *overrides, f"output_dir={out}"])
    report = evaluate(cfg, progress=False)
    assert json.loads((out / "report.json").read_text()) == report
    return report


@pytest.fixture(scope="module")
def medusa_export(tiny, tmp_path_factory):
    from models.exports.io import save_export
    from models.medusa import MedusaHeads

    heads = MedusaHeads(tiny.hidden_size, tiny.vocab_size, num_heads=3)  # zero-initialised: the verifier's own head
    return save_export(heads, tiny, tmp_path_factory.mktemp("export") / "medusa",
                       {"medusa_topk_accuracy": [[0.6, 0.7], [0.4, 0.5], [0.3, 0.4]]})


def test_harness_verify_block_greedy_match_and_tree_refusal(medusa_export, tmp_path, one_thread):
    common = [f"checkpoint={medusa_export}", "num_prompts=2", "max_new_tokens=12", "dtype=float32"]
    report = _run_eval([*common, "tree=chain", "verify=block"], tmp_path / "greedy")
    assert report["greedy_match"] == 1.0 and report["tau"] > 1.0
    with pytest.raises(UserError, match=r"verify=block: block verification is defined on chains.*tree=chain"):
        _run_eval([*common, "tree=auto", "tree.size=4", "verify=block"], tmp_path / "tree")


def test_method_all_sampled_under_block_verification(medusa_export, tmp_path, one_thread):
    """method=all at T = 0.7 with sampled_drafts=true and verify=block: the export's drafter samples its proposals,
    the families that draft from no export draft as they always do, and the methods whose drafters propose trees
    (lookahead) leave the run, named in report.json; a one-family run asking sampled proposals of a family with
    none is still refused."""
    common = [f"checkpoint={medusa_export}", "num_prompts=1", "max_new_tokens=8", "dtype=float32"]
    report = _run_eval([*common, "method=all", "tree=chain", "tree.depth=3", "temperature=0.7",
                        "sampled_drafts=true", "verify=block"], tmp_path / "all")
    left = report["sampling"]["left_out_as_trees"]  # lookahead, and the hybrid: lookup grafted beside the drafter
    assert sorted(m.split("/")[0] for m in left) == ["hybrid", "lookahead"] and not set(left) & set(report["methods"])
    medusa = next(m for m in report["methods"] if m.startswith("medusa/"))
    assert report["trees"][medusa]["proposals"] == "sampled"
    assert any(m.startswith("prompt_lookup/") for m in report["methods"])
    assert report["sampling"]["verify"] == "block" and report["methods"][medusa]["tau"] >= 1.0

    from hydra import compose, initialize_config_dir

    from eval.harness import evaluate

    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):  # one family: refused
        cfg = compose(config_name="eval", overrides=[*common, "drafter=prompt_lookup", "temperature=0.7",
                                                     "sampled_drafts=true", "wandb.mode=disabled",
                                                     f"output_dir={tmp_path / 'one'}"])
    with pytest.raises(UserError, match="sampled_drafts=true applies to the drafters of an export.*prompt_lookup"):
        evaluate(cfg, progress=False)


@pytest.mark.slow
def test_shipped_eagle3_chain_verify_block(smollm2, one_thread):
    """pretrained/eagle3-smollm2 drafting a chain for the default verifier: at temperature 0 with verify=block the
    output is plain greedy decoding's, token for token; sampled, block verification runs on the real drafts."""
    from eval.drafters.build import export
    from eval.engine.decode import greedy_decode, speculative_decode
    from eval.engine.tree import Chain

    path = ROOT / "pretrained" / "eagle3-smollm2"
    if not path.is_dir():
        pytest.skip("pretrained/eagle3-smollm2 is not in this checkout")
    ids = torch.tensor([smollm2.tokenizer("The quick brown fox jumps over the lazy dog. The quick")["input_ids"]])
    greedy = greedy_decode(smollm2, ids, 16).tokens
    out = speculative_decode(smollm2, export(smollm2, Chain(None), path), ids, 16,
                             sampling=SamplingConfig(temperature=0.0, verify="block"))
    assert torch.equal(out.tokens, greedy) and out.tau > 1.0
    cfg = SamplingConfig(temperature=0.7, verify="block")
    drafter = export(smollm2, Chain(None), path, sampling=cfg, generator=torch.Generator().manual_seed(1))
    out = speculative_decode(smollm2, drafter, ids, 16, sampling=cfg, generator=torch.Generator().manual_seed(0))
    assert out.tokens.shape == (1, 16) and out.tau >= 1.0
