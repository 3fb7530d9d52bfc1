"""Medusa heads: target shifts, independent zero-initialised blocks, export round trip and verifier checks."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from models.exports.io import load_export, save_export
from models.medusa import MedusaHeads, medusa_targets
from models.verifiers.tiny import build_tiny
from runtime.errors import UserError, VerifierMismatchError


def _load(path, verifier):
    loaded = load_export(path, verifier, "medusa")
    return loaded.net, loaded.lm_head, loaded.config


def test_targets_are_shifted_per_head():
    # Sequence 10..17; assistant tokens from position 3 on.
    ids = torch.arange(10, 18)[None]  # (1, 8)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    targets = medusa_targets(ids, mask, num_heads=3)
    # Head 1 at t predicts t+2, head 2 predicts t+3, head 3 predicts t+4.
    for k, (tgt, valid) in enumerate(targets):
        shift = k + 2
        positions = valid[0].nonzero().flatten().tolist()
        assert positions == [t for t in range(8 - shift) if mask[0, t + shift]]
        assert [tgt[0, t].item() for t in positions] == [10 + t + shift for t in positions]
    # Concretely: head 1 learns from t=1..5 (targets 13..17), head 3 from t=0..3 (targets 14..17).
    assert targets[0][1][0].nonzero().flatten().tolist() == [1, 2, 3, 4, 5]
    assert targets[0][0][0, 1].item() == 13
    assert targets[2][1][0].nonzero().flatten().tolist() == [0, 1, 2, 3]


def test_blocks_are_independent_and_start_as_identity(tiny):
    heads = MedusaHeads(tiny.hidden_size, tiny.vocab_size, num_heads=3, num_layers=2)
    params = [p.data_ptr() for p in heads.parameters()]
    assert len(params) == len(set(params)) == 3 * 2 * 2  # each block and layer its own weight and bias
    hidden = torch.randn(1, 5, tiny.hidden_size)
    for k in range(3):  # zero-initialised blocks: each head starts as the verifier's own head
        torch.testing.assert_close(heads.head_logits(hidden, k, tiny.lm_head), tiny.lm_head(hidden))
    heads.blocks[0].layers[0].weight.data.normal_()
    assert not torch.equal(heads.blocks[1].layers[0].weight, heads.blocks[0].layers[0].weight)


def _randomised(heads: MedusaHeads) -> MedusaHeads:
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(std=0.02)
    return heads


@pytest.mark.parametrize("share", [True, False])
def test_export_round_trip_is_bit_exact(tiny, tmp_path, share):
    heads = _randomised(MedusaHeads(tiny.hidden_size, tiny.vocab_size, 4, 1, share_lm_head=share))
    save_export(heads, tiny, tmp_path / "export", {"medusa_topk_accuracy": [[0.5] * 10] * 4})
    loaded, lm_head, config = _load(tmp_path / "export", tiny)
    for name, tensor in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    if share:
        assert torch.equal(lm_head, tiny.lm_head.weight)
    else:
        assert lm_head is None
    assert config["medusa_topk_accuracy"][0][0] == 0.5


def test_export_layout_is_vllms(tiny, tmp_path):
    heads = MedusaHeads(tiny.hidden_size, tiny.vocab_size, num_heads=2, num_layers=2, share_lm_head=True)
    save_export(heads, tiny, tmp_path / "shared")
    cfg = json.loads((tmp_path / "shared" / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (2, 2, 64, 49152)
    assert cfg["medusa_fc_bias"] is True and cfg["original_lm_head"] is True
    assert cfg["verifier_fingerprint"] == tiny.fingerprint
    names = set(load_file(str(tmp_path / "shared" / "model.safetensors")))
    assert names == {f"blocks.{h}.layers.{j}.{p}" for h in range(2) for j in range(2) for p in ("weight", "bias")} | {
        "lm_head.weight"}
    own = MedusaHeads(tiny.hidden_size, tiny.vocab_size, num_heads=2, num_layers=1, share_lm_head=False)
    save_export(own, tiny, tmp_path / "own")
    names = set(load_file(str(tmp_path / "own" / "model.safetensors")))
    assert {"lm_heads.0.weight", "lm_heads.1.weight"} <= names and "lm_head.weight" not in names


def test_mismatched_verifier_is_refused(tiny, tmp_path, cache_dir):
    save_export(MedusaHeads(tiny.hidden_size, tiny.vocab_size), tiny, tmp_path / "export")
    other = build_tiny(cache_dir=cache_dir, seed=1)
    with pytest.raises(VerifierMismatchError, match="lm_head_sha256") as err:
        load_export(tmp_path / "export", other)
    assert "different verifier" in str(err.value) and other.name in str(err.value)


def test_missing_and_corrupt_files(tiny, tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        load_export(tmp_path / "nowhere", tiny)
    path = save_export(MedusaHeads(tiny.hidden_size, tiny.vocab_size), tiny, tmp_path / "export")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(UserError, match="corrupt"):
        load_export(path, tiny)
    weights.unlink()
    with pytest.raises(UserError, match="missing"):
        load_export(path, tiny)


def test_export_is_atomic(tiny, tmp_path):
    """A failure while writing leaves the previous export intact and no half-written directory."""
    heads = MedusaHeads(tiny.hidden_size, tiny.vocab_size)
    save_export(heads, tiny, tmp_path / "export")
    before = (tmp_path / "export" / "model.safetensors").read_bytes()
    with pytest.raises(TypeError):
        save_export(heads, tiny, tmp_path / "export", {"bad": object()})  # not JSON-serialisable
    assert (tmp_path / "export" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_atomic_dir_leaves_nothing_behind_on_failure(tmp_path):
    from runtime.io import atomic_dir

    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(tmp_path / "cache") as tmp:
            (tmp / "part.arrow").write_text("half")
            raise KeyboardInterrupt  # a Ctrl-C in the middle of a data build
    assert list(tmp_path.iterdir()) == []
