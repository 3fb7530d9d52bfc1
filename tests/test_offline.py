"""Teacher-forced acceptance tables (eval/offline.py) and draft ranks (models/eagle.py) on hand-built numbers."""

from __future__ import annotations

import pytest
import torch

from eval.offline import acceptance_tables, chain_rounds, round_leads
from models.eagle import target_rank


def test_draft_vocabulary_rank_equals_the_rank_widened_to_the_full_vocabulary():
    """EAGLE-3's ranks are computed over the draft vocabulary alone: equal to ranking the logits scattered into the
    full vocabulary (the rest -inf), on logits with many ties, targets inside and outside the vocabulary."""
    g = torch.Generator().manual_seed(0)
    vocab, draft, n = 300, 40, 200
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.randperm(vocab, generator=g)[:draft]] = True
    p = torch.randint(0, 6, (n, draft), generator=g).float()  # ties everywhere
    p[0, :] = float("-inf")
    inside_ids = t2d.nonzero()[:, 0]
    target = torch.where(torch.rand(n, generator=g) < 0.8, inside_ids[torch.randint(0, draft, (n,), generator=g)],
                         torch.randint(0, vocab, (n,), generator=g))
    full = p.new_full((n, vocab), float("-inf"))
    full[:, t2d] = p
    at = full.gather(1, target[:, None])
    lower = torch.arange(vocab) < target[:, None]
    want = ((full > at) | ((full == at) & lower)).sum(-1)
    want = torch.where(at[:, 0] == float("-inf"), vocab, want)
    got = target_rank(p, target, t2d)
    assert torch.equal(got, want)
    assert (got == vocab).any() and (got == 0).any() and ((got > 0) & (got < vocab)).any()


def test_target_rank_full_and_draft_vocabulary():
    p = torch.tensor([[3.0, 1.0, 2.0], [0.0, 5.0, 1.0]])
    assert target_rank(p, torch.tensor([2, 1])).tolist() == [1, 0]
    # EAGLE-3: logits over a draft vocabulary {0, 2, 3} of a 4-token verifier vocabulary.
    t2d = torch.tensor([True, False, True, True])
    p3 = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]])  # target 0 -> 1.0, 2 -> 3.0, 3 -> 2.0
    assert target_rank(p3, torch.tensor([3, 1]), t2d).tolist() == [1, 4]  # id 1 is outside: the vocabulary size
    # Ties rank as argmax breaks them (the lower id first): only argmax's pick is top-1.
    tied = torch.tensor([[2.0, 5.0, 5.0, 5.0]] * 3)
    assert target_rank(tied, torch.tensor([1, 2, 3])).tolist() == [0, 1, 2]
    assert int(tied[0].argmax()) == 1
    boosted = p3[:1].repeat(2, 1).index_fill(1, torch.tensor([2]), 3.0)
    assert target_rank(boosted, torch.tensor([2, 3]), t2d).tolist() == [0, 1]


def test_acceptance_tables_hand_built():
    # One answer x_2..x_5 after a 2-token prompt; depth 1 at t predicts x_{t+2}, depth 2 x_{t+3}.
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    valid = torch.tensor([[[True, True, True, True, False, False]], [[True, True, True, False, False, False]]])
    big = 99
    rank = torch.tensor([[[0, 0, 5, 0, big, big]], [[0, 0, 0, big, big, big]]])
    conf = torch.tensor([[[0.5, 0.7, 0.1, 0.9, 0.0, 0.0]], [[0.2, 0.4, 0.8, 0.0, 0.0, 0.0]]])
    out = acceptance_tables(rank, valid, loss_mask, topk=(1, 4, 8), confidence=conf)
    assert out["depth1_topk"] == {1: 0.75, 4: 0.75, 8: 1.0}
    # Depth 2 at t=2 is right but depth 1 there is not, so the chain does not count it; at t=3 depth 1 is right but
    # depth 2 has no target (x_6 is past the answer): the chain reaches depth 2 at t=0 and t=1 only.
    assert out["chain_conditional"] == pytest.approx([0.75, 1.0])
    assert out["chain_confidence"] == pytest.approx([(0.5 + 0.7 + 0.1 + 0.9) / 4, (0.2 + 0.4) / 2])
    assert out["tau_positions"] == pytest.approx(1 + (2 + 2 + 0 + 1) / 4)
    # The first round roots at x_2 (features end at t=1), accepts 2 drafts + M_q's token: x_3..x_5, done.
    assert out["tau_rounds"] == 3.0
    assert out["round_accept_per_position"] == [1.0, 1.0]  # that one round accepted both drafts
    assert out["positions"] == 4


def test_chain_rounds_step_over_accepted_runs():
    lead = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 0, 0])
    assert chain_rounds(lead, 1, 9) == (7, 7)  # nothing accepted: one token a round
    lead = torch.tensor([0, 3, 0, 0, 0, 1, 0, 0, 0, 0])
    # t=1 accepts 3 (4 tokens, to t=5), t=5 accepts 1 (2 tokens, to t=7), t=7 emits x_9 alone.
    assert chain_rounds(lead, 1, 9) == (7, 3)
    assert round_leads(lead, 1, 9) == [3, 1, 0]  # the rounds start where the last one failed: t = 1, 5, 7


def test_round_acceptance_counts_rounds_not_positions():
    """Depth-1 drafts right at every other position: right half the time over positions, but after the first round
    (wrong, at t=0) every round starts two past a right one, on a right one again: 3 of 4 rounds accept."""
    rank = torch.tensor([[[1, 0, 1, 0, 1, 0, 1, 0]]])  # (D=1, B=1, T=8): right at t = 1, 3, 5, 7
    valid = torch.ones(1, 1, 8, dtype=torch.bool)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]])  # the answer is x_1..x_7: the first round roots at t=0
    out = acceptance_tables(rank, valid, mask)
    assert out["chain_conditional"][0] == pytest.approx(0.5)
    assert round_leads(torch.tensor([0, 1, 0, 1, 0, 1, 0, 1]), 0, 7) == [0, 1, 1, 1]  # rounds at t = 0, 1, 3, 5
    assert out["round_accept_per_position"] == pytest.approx([3 / 4])


def test_acceptance_tables_refuse_empty_answers():
    with pytest.raises(ValueError, match="empty"):
        acceptance_tables(torch.zeros(1, 1, 4, dtype=torch.long), torch.zeros(1, 1, 4, dtype=torch.bool),
                          torch.zeros(1, 4, dtype=torch.long))


def test_verifier_top1_is_the_mean_top1_probability_where_the_answer_is_predicted(cache_dir):
    """Brute force through the model's own forward: at each t whose next token is an assistant token, the max of
    softmax(logits[t]); a sharper head (logits x 3) raises it."""
    from eval.offline import verifier_top1
    from models.verifiers.tiny import build_tiny

    v = build_tiny(cache_dir=cache_dir, dtype="float32", device="cpu", layer_std=0.3, initializer_range=0.2)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n, start in ((9, 4), (14, 6)):
        ids = torch.randint(0, v.vocab_size, (n,), generator=gen)
        rows.append({"input_ids": ids.tolist(), "loss_mask": [0] * start + [1] * (n - start)})
    want = []
    with torch.no_grad():
        for r in rows:
            probs = v.model(torch.tensor([r["input_ids"]])).logits[0].softmax(-1).amax(-1)
            want += [probs[t] for t in range(len(r["input_ids"]) - 1) if r["loss_mask"][t + 1]]
    expected = float(torch.stack(want).mean())
    assert verifier_top1(v, rows) == pytest.approx(expected, rel=1e-5)
    with torch.no_grad():
        v.lm_head.weight.mul_(3.0)
    assert verifier_top1(v, rows) > expected
    with pytest.raises(ValueError, match="assistant token"):
        verifier_top1(v, [{"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}])


def test_ranks_over_the_training_rows_of_a_train_vocab_export():
    """Offline scoring of a drafter trained with train_vocab ranks over the rows it drafts over: a target inside them
    gets its rank among them, one outside is a miss (rank V)."""
    from eval.drafters.medusa import medusa_ranks
    from helpers import varied_llama
    from models.medusa import MedusaHeads, medusa_targets

    v = varied_llama()
    heads = MedusaHeads(v.hidden_size, v.vocab_size, num_heads=2)
    for block in heads.blocks:
        torch.nn.init.normal_(block.layers[0].weight, std=0.2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (2, 24), generator=g)
    mask = torch.zeros_like(ids)
    mask[:, 8:] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
    targets = ids[:, 8:].unique()
    keep = torch.cat([targets[::2], 1000 + torch.randperm(40000, generator=g)[:200]]).sort().values
    with torch.no_grad():
        _, valid, _ = medusa_ranks(heads, v, batch, 2)
        sub, valid2, conf = medusa_ranks(heads, v, batch, 2, keep=keep)
        assert torch.equal(valid, valid2)
        hidden = v.model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        for k, (tgt, ok) in enumerate(medusa_targets(ids, mask, 2)):
            logits = heads.head_logits(hidden[ok], k, v.lm_head)[:, keep]  # the kept rows only
            inside = torch.isin(tgt[ok], keep)
            assert inside.any() and not inside.all()
            want = torch.full_like(tgt[ok], v.vocab_size)
            want[inside] = target_rank(logits[inside], torch.searchsorted(keep, tgt[ok][inside]))
            assert torch.equal(sub[k][ok], want)
            torch.testing.assert_close(conf[k][ok], logits.softmax(-1).amax(-1))
    # EAGLE-1 the same way: M_q's argmax outside the kept rows is a miss, inside it ranks among them.
    from eval.drafters.eagle import eagle_ranks
    from models.eagle import build_eagle

    torch.manual_seed(0)
    net = build_eagle("eagle", v)
    with torch.no_grad():
        sub, valid, _ = eagle_ranks(net, v, batch, 2, keep=keep)
        full, _, _ = eagle_ranks(net, v, batch, 2)
        q_arg = v.lm_head(hidden).argmax(-1)  # (B, T)
    for j in range(2):
        target = torch.roll(q_arg, -(j + 1), dims=1)  # step j at t is scored against M_q's argmax at t+j+1
        ok = valid[j]
        inside = torch.isin(target[ok], keep)
        assert ok.any() and inside.any() and not inside.all()
        assert (sub[j][ok][~inside] == v.vocab_size).all()
        assert (sub[j][ok][inside] <= full[j][ok][inside]).all()  # fewer competitors, never a worse rank
        assert (sub[j][ok][inside] < v.vocab_size).all()


def test_first_answer_tokens_keeps_the_first_n_assistant_tokens():
    from eval.offline import first_answer_tokens

    row = {"input_ids": [5, 6, 7, 8, 9, 10, 11], "loss_mask": [0, 0, 1, 1, 0, 1, 1], "row": 3}
    cut = first_answer_tokens(row, 3)
    assert cut["input_ids"] == [5, 6, 7, 8, 9, 10] and cut["loss_mask"] == [0, 0, 1, 1, 0, 1] and cut["row"] == 3
    assert first_answer_tokens(row, 1)["input_ids"] == [5, 6, 7]
    assert first_answer_tokens(row, 4) is row and first_answer_tokens(row, None) is row


def test_heldout_accuracy_scores_the_runs_held_out_rows_by_source(train_script, tmp_path):
    """Two prompt files as the run's sources: the script rebuilds the run's held-out split, tags each row with the
    file its prompt came from, and scores each window over that many answer tokens at most."""
    import importlib.util
    import json

    from hydra.utils import instantiate
    from omegaconf import open_dict

    from helpers import ROOT, compose_train

    topics = {"pets": ["cats", "dogs", "parrots", "goldfish", "rabbits", "hamsters"],
              "food": ["bread", "rice", "cheese", "apples", "soup", "pasta"]}
    files = []
    for name, words in topics.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"question_id": i, "turns": [f"Tell me three facts about {w}."]}) + "\n"
                                for i, w in enumerate(words)))
        files.append(str(path))
    overrides = ["verifier=tiny", f"data.source=[{','.join(files)}]", "data.limit=null", "data.max_new_tokens=10",
                 "data.gen_batch_size=12", "data.batch_size=4", "data.val_fraction=0.5", "model=medusa",
                 "logger=csv"]
    export = train_script.run(compose_train([*overrides, "+trainer.fast_dev_run=true"], tmp_path / "run"))

    spec = importlib.util.spec_from_file_location("heldout_accuracy",
                                                  ROOT / "scripts" / "tools" / "heldout_accuracy.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    cfg = compose_train(overrides, tmp_path / "run")
    with open_dict(cfg):
        cfg.export, cfg.answer_tokens, cfg.verifier.dtype = str(export), [4, None], "float32"
    results = script.heldout_tables(cfg)

    verifier = instantiate(cfg.verifier)
    datamodule = instantiate(cfg.data, verifier=verifier)
    _, held_out = datamodule.split(datamodule.build())
    texts = [verifier.tokenizer.decode(r) for r in held_out["input_ids"]]
    expected = {name: sum(any(f"about {w}." in t for w in words) for t in texts) for name, words in topics.items()}
    whole, window = results["None"], results["4"]
    assert whole["all"]["rows"] == len(held_out) == 6
    assert {k: v["rows"] for k, v in whole.items() if k != "all"} == {k: v for k, v in expected.items() if v}
    assert whole["all"]["assistant_tokens"] == sum(sum(m) for m in held_out["loss_mask"])
    assert window["all"]["assistant_tokens"] == sum(min(sum(m), 4) for m in held_out["loss_mask"])
    assert window["all"]["assistant_tokens"] < whole["all"]["assistant_tokens"]
    for groups in results.values():
        for r in groups.values():
            assert 0 < r["verifier_top1"] <= 1 and len(r["chain_accuracy"]) == 3
