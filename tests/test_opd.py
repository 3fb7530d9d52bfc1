"""On-policy distillation (eval/rollout.py, data/onpolicy.py, train/opd.py): the rollout records what our decoder
did, the training replay reproduces the drafter's own drafts, training moves the drafter toward the recorded
targets, and bad input is refused with a message."""

from __future__ import annotations

import json

import pytest
import torch

from data.onpolicy import OnPolicyDataModule, collate_rounds, read_rollout, training_row
from eval.drafters.build import make_drafter
from eval.engine.decode import greedy_decode, speculative_decode
from eval.engine.tree import Chain
from eval.rollout import Recorder
from eval.rollout import main as rollout_main
from helpers import compose_train
from models.eagle import build_eagle, unroll
from models.exports.io import load_export, save_export
from models.verifiers.tiny import build_tiny
from runtime.errors import UserError
from train.opd import replay_inputs

DEPTH = 3


@pytest.fixture(scope="module")
def verifier(cache_dir):
    """conf/verifier/tiny.yaml's verifier (what `verifier=tiny` builds in train.py), with large random layer weights
    so its greedy answers vary (a plain tiny one repeats one token)."""
    return build_tiny(cache_dir=cache_dir, dtype="float32", device="cpu", layer_std=0.3)


def random_eagle3(verifier, seed: int = 0):
    """A random EAGLE-3 over the full vocabulary, confident enough that some of its drafts are accepted."""
    net = build_eagle("eagle3", verifier, aux_layer_ids=[0, 1])
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return net


@pytest.fixture(scope="module")
def export(verifier, tmp_path_factory):
    return save_export(random_eagle3(verifier), verifier, tmp_path_factory.mktemp("e3") / "export")


def roll(export, out, cache_dir, *extra):
    return rollout_main([str(export), "--out", str(out), "--num-prompts", "6", "--max-new-tokens", "24",
                         "--shard-size", "2", "--dtype", "float32", "--device", "cpu", "--cache-dir", cache_dir,
                         *extra])


@pytest.fixture(scope="module")
def rollout(export, tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("rollout") / "r"
    roll(export, out, cache_dir)
    return out


@pytest.mark.slow
def test_recorder_keeps_what_the_decoder_did(smollm2, one_thread):
    """Greedy, the shipped EAGLE-3 on the default verifier: the committed tokens are plain greedy decoding's; each
    recorded round's accepted drafts are the committed tokens after its root, M_q's recorded top-1 at every drafted
    position up to the rejection is the token the decoder committed there, the first rejected draft is not, and the
    rounds' accepted counts are the decode's accept lengths."""
    drafter = make_drafter(None, smollm2, Chain(DEPTH), checkpoint="pretrained/eagle3-smollm2", dtype="float32")
    recorder = Recorder(drafter, topk=5)
    accepted = rejected = 0
    for prompt in ("def fib(n):\n    return", "The capital of France is Paris. The capital of Italy is"):
        ids = smollm2.tokenizer(prompt, return_tensors="pt").input_ids
        result = speculative_decode(smollm2, recorder, ids, 48)
        assert result.tokens.tolist() == greedy_decode(smollm2, ids, 48).tokens.tolist()
        seq = ids[0].tolist() + result.tokens[0].tolist()
        rounds = recorder.take()
        assert len(rounds) >= len(result.accept_lengths) - DEPTH  # all but the last rounds, cut short
        assert [r["accepted"] for r in rounds] == result.accept_lengths[: len(rounds), 0].tolist()
        for r in rounds:
            s, a = r["start"], r["accepted"]
            assert len(r["drafts"]) == len(r["q_ids"]) == DEPTH and sorted(r["q_probs"][0], reverse=True) == \
                r["q_probs"][0]
            assert r["drafts"][:a] == seq[s + 1: s + 1 + a]
            for j in range(min(a + 1, DEPTH)):  # node j <= the rejection: M_q's argmax is the committed token
                assert r["q_ids"][j][0] == seq[s + j + 1]
            if a < DEPTH:
                assert r["drafts"][a] != seq[s + a + 1]  # the first rejected draft is not what was committed
                rejected += 1
            accepted += a
    assert accepted > 10 and rejected > 10  # both kinds of position were checked


def test_replay_reproduces_the_drafts(verifier, rollout, export):
    """Training's replay of a round (train/opd.replay_inputs over models.eagle.unroll) computes what the drafter
    computed in the decoder: its argmax at step j is the draft d_{j+1} it drafted, rejected ones included."""
    net = load_export(export, verifier).net
    _, lines = read_rollout(rollout, verifier)
    batch = collate_rounds([r for r in (training_row(x, 1024) for x in lines) if r is not None],
                           verifier.tokenizer.pad_token_id)
    ids, attn, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    with torch.no_grad():
        states = verifier.model.get_decoder()(input_ids=ids, attention_mask=attn,
                                              output_hidden_states=True).hidden_states
        feats = net.features(states)[:, : ids.shape[1] - 1]
        inputs, round_of = replay_inputs(batch, ids, mask, DEPTH)
        checked = 0
        for j, step in enumerate(unroll(net, feats, ids, attn, mask, verifier.token_embedding, DEPTH, inputs)):
            drafted = batch["opd_drafts"][step.batch, round_of[step.batch, step.position], j]
            mine = net.draft_to_target(net.logits(step.at_targets).argmax(-1))
            assert mine.tolist() == drafted.tolist()
            checked += drafted.numel()
    # drafts after a rejection in their round: there the replay fed the drafter's own wrong tokens
    rejected = sum(max(0, len(r["drafts"]) - r["accepted"] - 1) for x in lines for r in x["rounds"])
    assert checked > 20 and rejected > 5


def test_rollout_resumes_and_refuses_other_settings(verifier, export, rollout, tmp_path, cache_dir):
    """A killed rollout resumes from its first missing shard and writes what an unbroken one wrote; the same
    directory with other settings is refused."""
    out = tmp_path / "r"
    out.mkdir()
    for f in rollout.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    whole = (out / "shard-00001.jsonl").read_text()
    (out / "shard-00001.jsonl").unlink()
    kept = (out / "shard-00000.jsonl").stat().st_mtime_ns
    roll(export, out, cache_dir)
    assert (out / "shard-00001.jsonl").read_text() == whole
    assert (out / "shard-00000.jsonl").stat().st_mtime_ns == kept  # finished work is not redone
    with pytest.raises(UserError, match="other settings"):
        roll(export, out, cache_dir, "--depth", "2")
    summary = json.loads((out / "rollout.json").read_text())["summary"]
    assert summary["prompts"] == 6 and 1.0 <= summary["tau"] <= 1 + DEPTH


def test_a_sampled_rollout_records_its_rounds(export, tmp_path, cache_dir):
    """--temperature: sampled decoding and sampled drafts; each recorded round's accepted drafts are the tokens
    committed after its root and its accepted count is the decode's, as under greedy."""
    roll(export, tmp_path / "s", cache_dir, "--temperature", "1.0", "--seed", "3")
    manifest, lines = read_rollout(tmp_path / "s")
    assert manifest["settings"]["temperature"] == 1.0
    accepted = 0
    for line in lines:
        rounds, seq = line["rounds"], line["input_ids"]
        assert [r["accepted"] for r in rounds] == line["accept_lengths"][: len(rounds)]
        for r in rounds:
            assert r["drafts"][: r["accepted"]] == seq[r["start"] + 1: r["start"] + 1 + r["accepted"]]
            accepted += r["accepted"]
    assert sum(len(x["rounds"]) for x in lines) > 20 and accepted > 0


def replay_loss(net, verifier, rows) -> float:
    """Mean cross-entropy of the drafter's replayed steps against M_q's recorded top-1 over `rows`."""
    batch = collate_rounds(rows, verifier.tokenizer.pad_token_id)
    ids, attn, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    total, count = 0.0, 0
    with torch.no_grad():
        states = verifier.model.get_decoder()(input_ids=ids, attention_mask=attn,
                                              output_hidden_states=True).hidden_states
        feats = net.features(states)[:, : ids.shape[1] - 1]
        inputs, round_of = replay_inputs(batch, ids, mask, DEPTH)
        for j, step in enumerate(unroll(net, feats, ids, attn, mask, verifier.token_embedding, DEPTH, inputs)):
            target = batch["opd_q_ids"][step.batch, round_of[step.batch, step.position], j, 0]
            logits = net.logits(step.at_targets).float()
            total += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            count += target.numel()
    return total / count


def test_training_end_to_end_moves_toward_the_recorded_targets(train_script, verifier, export, rollout, tmp_path,
                                                               cache_dir):
    """python train.py experiment=opd from the export, on-policy loss only: the new export's replayed drafts are
    closer to M_q's recorded distributions than the export it started from."""
    cfg = compose_train(["experiment=opd", "verifier=tiny", "+verifier.layer_std=0.3", f"cache_dir={cache_dir}",
                         f"init_from={export}", f"data.rollout={rollout}", "model.aux_layer_ids=[0,1]",
                         "model.draft_vocab_size=null", "model.tf_weight=0", "model.optimizer.lr=3e-3",
                         "data.batch_size=2", "data.val_fraction=0.2", "trainer.max_epochs=3",
                         "trainer.accumulate_grad_batches=1", "trainer.precision=32", "logger=csv"], tmp_path / "run")
    new = train_script.run(cfg)
    rows = [r for r in (training_row(x, 1024) for x in read_rollout(rollout, verifier)[1]) if r is not None]
    before = replay_loss(load_export(export, verifier).net, verifier, rows)
    after = replay_loss(load_export(new, verifier).net, verifier, rows)
    print(f"replayed cross-entropy {before:.3f} -> {after:.3f}")
    assert after < before - 0.05, (before, after)
    assert load_export(new, verifier).config["trained_steps"] == 9  # 5 train rows, batches of 2, 3 epochs


def test_eagle1_rolls_out_and_trains(train_script, verifier, tmp_path, cache_dir):
    """EAGLE-1 (through the verifier's head) takes the same path: rollout, then experiment=opd from its export."""
    net = build_eagle("eagle", verifier)
    export = save_export(net, verifier, tmp_path / "e1")
    rollout_main([str(export), "--out", str(tmp_path / "r"), "--num-prompts", "4", "--max-new-tokens", "12",
                  "--shard-size", "2", "--dtype", "float32", "--device", "cpu", "--cache-dir", cache_dir])
    cfg = compose_train(["experiment=opd", "model=eagle", "verifier=tiny", "+verifier.layer_std=0.3",
                         f"cache_dir={cache_dir}", f"init_from={export}", f"data.rollout={tmp_path / 'r'}",
                         "model.draft_vocab_size=null", "data.batch_size=2", "data.val_fraction=0.25",
                         "+trainer.fast_dev_run=true", "trainer.precision=32", "logger=csv"], tmp_path / "run")
    assert load_export(train_script.run(cfg), verifier).kind == "eagle"


@pytest.mark.slow
def test_a_family_that_cannot_is_refused(cache_dir, tmp_path, smollm2):
    """Medusa drafts from one forward of its heads: no chain to replay. The rollout and training both say so."""
    with pytest.raises(UserError, match="EAGLE-1, EAGLE-3"):
        rollout_main(["pretrained/medusa-smollm2", "--out", str(tmp_path / "m"), "--num-prompts", "1",
                      "--dtype", "float32", "--cache-dir", cache_dir])
    from train.opd import OnPolicyModule

    with pytest.raises(UserError, match="replays a drafter's chain"):
        OnPolicyModule(smollm2, optimizer=torch.optim.AdamW, kind="dflash")
    module = OnPolicyModule(smollm2, optimizer=torch.optim.AdamW, kind="eagle3", draft_vocab_size=4096)
    with pytest.raises(UserError, match="Medusa export"):
        module.warm_start(load_export("pretrained/medusa-smollm2", smollm2), "pretrained/medusa-smollm2")


def test_a_rollout_for_another_verifier_is_refused(rollout, cache_dir):
    other = build_tiny(cache_dir=cache_dir, dtype="float32", device="cpu", layer_std=0.3, seed=1)
    with pytest.raises(UserError, match="verifier"):
        OnPolicyDataModule(other, rollout=str(rollout)).setup()
    with pytest.raises(UserError, match="data.rollout"):
        OnPolicyDataModule(other)
