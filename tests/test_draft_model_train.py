"""Distilling a truncated copy of the verifier into a draft model (train/draft_model.py), on tiny verifiers: the KL to
the verifier falls, the export is a plain HF checkpoint that `drafter=draft_model drafter.path=` decodes with
exactly, and an export made for another verifier is refused."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from data.chat import prompt_ids
from eval.drafters.draft_model import load_draft_model
from eval.engine.decode import greedy_decode
from helpers import ROOT, compose_train, varied_llama
from models.draft_model import read_draft_info
from runtime.errors import VerifierMismatchError
from train.draft_model import DraftModelModule, next_token_positions

VARIED = ["verifier=tiny", "+verifier.layer_std=0.3", "verifier.seed=1", "data.limit=12", "data.max_new_tokens=12",
          "data.gen_batch_size=12", "data.batch_size=4", "data.val_fraction=0.25"]


@pytest.fixture(scope="module")
def varied():
    return varied_llama(seed=1)


def _module(verifier, lr: float = 3e-3) -> DraftModelModule:
    return DraftModelModule(verifier, partial(torch.optim.AdamW, lr=lr), num_layers=1)


def _batch(verifier) -> tuple[dict[str, torch.Tensor], int]:
    """A chat prompt and the verifier's own 24-token greedy answer; loss on the answer. Returns (batch, prompt len)."""
    ids = torch.tensor([prompt_ids(verifier.tokenizer, [{"role": "user", "content": "Name three rivers."}])])
    answer = greedy_decode(verifier, ids, 24).tokens
    seq = torch.cat([ids, answer], dim=1)  # (1, T)
    mask = torch.zeros_like(seq)
    mask[:, ids.shape[1]:] = 1
    return {"input_ids": seq, "attention_mask": torch.ones_like(seq), "loss_mask": mask}, ids.shape[1]


@torch.no_grad()
def _kl(verifier, draft, batch, start: int) -> float:
    """KL(q || p) measured apart from the module: each model's own HF forward, positions start-1 .. T-2 (the ones
    whose next token is an answer token)."""
    q = verifier.model(input_ids=batch["input_ids"]).logits[0, start - 1 : -1].float()
    p = draft(input_ids=batch["input_ids"]).logits[0, start - 1 : -1].float()
    return F.kl_div(p.log_softmax(-1), q.log_softmax(-1), log_target=True, reduction="batchmean").item()


def test_distillation_lowers_the_kl_and_the_export_holds_what_was_trained(varied, tmp_path, one_thread):
    assert next_token_positions(torch.tensor([[0, 0, 1, 1, 0]])).tolist() == [[False, True, True, False, False]]
    batch, start = _batch(varied)
    module = _module(varied)
    before = _kl(varied, module.draft, batch, start)
    opt = module.configure_optimizers()  # no scheduler: the bare optimizer
    for _ in range(30):
        loss, _, _ = module.model_step(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
    after = _kl(varied, module.draft, batch, start)
    assert after < 0.5 * before, (before, after)
    # The verifier's own weights were not touched: only the draft's copies learn.
    assert all(not p.requires_grad and p.grad is None for p in varied.model.parameters())

    export = module.export(tmp_path / "export")
    loaded, _ = load_draft_model(varied, str(export))
    with torch.no_grad():
        want = module.draft(input_ids=batch["input_ids"]).logits
        got = loaded(input_ids=batch["input_ids"]).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert loaded.config.num_hidden_layers == 1
    assert read_draft_info(export)["verifier_fingerprint"] == varied.fingerprint


def _eval_cfg(tmp_path, overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return compose(config_name="eval", overrides=[
            "drafter=draft_model", "num_prompts=2", "max_new_tokens=16", "threads=1", "warmup=false",
            "dtype=float32", "wandb.mode=disabled", f"output_dir={tmp_path / 'out'}", *overrides])


def test_trained_export_decodes_exactly_through_the_harness(train_script, tmp_path):
    from eval.harness import evaluate

    cfg = compose_train([*VARIED, "model=draft_model", "model.num_layers=1", "logger=csv", "trainer.max_epochs=1"],
                        tmp_path / "run")
    export = train_script.run(cfg)
    info = read_draft_info(export)
    assert info["trained_steps"] > 0 and 0 <= info["val_top1"] <= 1 and info["val_kl"] >= 0
    # No verifier_path: the harness takes the verifier the export names.
    report = evaluate(_eval_cfg(tmp_path, [f"drafter.path={export}"]), progress=False)
    assert report["verifier"] == "tiny-llama-2x64-seed1" and report["greedy_match"] == 1.0
    assert report["tree"]["draft_model"] == str(export) and report["tree"]["depth"] == 4
    assert report["tau"] >= 1.0


def test_export_for_another_verifier_is_refused(varied, tmp_path):
    from eval.harness import evaluate

    export = _module(varied).export(tmp_path / "export")  # for the seed-1 verifier
    with pytest.raises(VerifierMismatchError, match="different verifier") as err:
        evaluate(_eval_cfg(tmp_path, [f"drafter.path={export}", "verifier_path={loader: tiny, layer_std: 0.3}"]),
                 progress=False)
    message = str(err.value)
    assert "drafter.path=" in message and "weights_sha256" in message and "verifier_path=" in message, message


def test_a_draft_model_whose_config_builds_layers_it_lacks_is_refused(varied, tmp_path):
    """The draft-model family's probe of issue 64: its config.json's num_hidden_layers raised by hand (1 -> 2) once
    loaded with a randomly initialised second layer; refused naming the field and a missing tensor."""
    import json

    from runtime.errors import UserError

    export = _module(varied).export(tmp_path / "export")
    load_draft_model(varied, str(export))  # as written: loads
    cfg = json.loads((export / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    (export / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"its config.json disagrees with its weights: it builds \d+ tensors the "
                                        rf"checkpoint lacks \(e.g. model.layers.{cfg['num_hidden_layers'] - 1}\..*"
                                        rf"num_hidden_layers={cfg['num_hidden_layers']}"):
        load_draft_model(varied, str(export))
