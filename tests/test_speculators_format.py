"""Exports an engine loads as they are: the speculators format for EAGLE-3 (models/exports/speculators.py), side data
out of the engine's glob, and one clear message per bad input (a stray weight file, a speculators config with a
missing or contradictory field, a missing or wrong vLLM interpreter). The real vLLM reading them:
tests/test_engine_vllm.py."""

from __future__ import annotations

import json
import stat

import pytest
import torch
from safetensors.torch import save_file

from models.eagle import build_eagle
from models.exports.io import COUNTS_NAME, SIDE_DIR, load_export, read_config, save_export
from models.verifiers.hf import save_checkpoint
from models.verifiers.tiny import build_tiny
from runtime.errors import UserError


@pytest.fixture(scope="module")
def tiny4(cache_dir):
    return build_tiny(cache_dir=cache_dir, dtype="float32", device="cpu", num_layers=4)


@pytest.fixture()
def eagle3_export(tiny4, tmp_path):
    net = build_eagle("eagle3", tiny4, draft_vocab_size=64, aux_layer_ids=[1, 2, 3])
    net.set_draft_vocab(torch.arange(64) * 3)
    counts = torch.arange(tiny4.vocab_size, dtype=torch.float64)
    return save_export(net, tiny4, tmp_path / "e3", {"trained_steps": 5}, target_counts=counts, speculative_tokens=4)


def test_eagle3_export_is_in_the_speculators_format_vllm_reads(eagle3_export, tiny4, tmp_path):
    cfg = json.loads((eagle3_export / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 4
    assert spec["verifier"] == {"name_or_path": tiny4.name, "architectures": ["LlamaForCausalLM"]}
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["hidden_size"] == 64 and layer["num_hidden_layers"] == 1
    # vLLM's speculators reader defaults norm_before_residual to true; our layer is false: written explicitly.
    assert cfg["norm_before_residual"] is False and cfg["norm_before_fc"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and cfg["draft_vocab_size"] == 64
    assert cfg["trained_steps"] == 5 and cfg["verifier_fingerprint"] == tiny4.fingerprint
    # Only the weights at the top: the side data is where no engine globs.
    assert sorted(f.name for f in eagle3_export.iterdir()) == ["config.json", "model.safetensors", SIDE_DIR]
    loaded = load_export(eagle3_export, tiny4)
    assert loaded.kind == "eagle3" and loaded.net.aux_layer_ids == [1, 2, 3]
    assert torch.equal(loaded.target_counts, torch.arange(tiny4.vocab_size, dtype=torch.float64))
    assert read_config(eagle3_export)["speculative_tokens"] == 4
    # A verifier saved as a checkpoint is what the export names for the engine to load.
    save_checkpoint(tiny4, tmp_path / "verifier")
    again = save_export(loaded.net, tiny4, tmp_path / "again")
    assert json.loads((again / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == \
        str((tmp_path / "verifier").resolve())


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["speculators_config"]["proposal_methods"][0].pop("speculative_tokens"), "speculative_tokens"),
    (lambda c: c["speculators_config"].__setitem__("algorithm", "eagle"), "contradicts speculators_model_type"),
    (lambda c: c["speculators_config"]["verifier"].pop("name_or_path"), "verifier.name_or_path is missing"),
    (lambda c: c.pop("norm_before_residual"), "norm_before_residual is not set"),
    (lambda c: c.__setitem__("norm_before_residual", True), "norm_before_residual=True, but"),
    (lambda c: c.pop("transformer_layer_config"), "transformer_layer_config is missing"),
    (lambda c: c.__setitem__("speculators_model_type", "dflash"), "speculators_model_type='dflash' needs"),
    (lambda c: c.__setitem__("speculators_model_type", "dspark"), "speculators_model_type='dspark'"),
])
def test_a_speculators_config_with_a_missing_or_contradictory_field_is_refused(eagle3_export, tiny4, edit, message):
    cfg = json.loads((eagle3_export / "config.json").read_text())
    edit(cfg)
    (eagle3_export / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=message) as info:
        load_export(eagle3_export, tiny4)
    assert "config.json" in str(info.value)


def test_a_stray_weight_file_is_refused_and_an_old_export_still_loads(eagle3_export, tiny4):
    save_file({"x": torch.zeros(2)}, str(eagle3_export / "extra.safetensors"))
    with pytest.raises(UserError, match=r"extra.safetensors: a weight file beside model.safetensors.*vLLM loads "
                                        r"every \*.safetensors.*move it out of the folder"):
        load_export(eagle3_export, tiny4)
    (eagle3_export / "extra.safetensors").unlink()
    (eagle3_export / SIDE_DIR / COUNTS_NAME).rename(eagle3_export / COUNTS_NAME)  # as exports were written before
    with pytest.warns(UserWarning, match="vLLM refuses the folder"):
        loaded = load_export(eagle3_export, tiny4)
    assert torch.equal(loaded.target_counts, torch.arange(tiny4.vocab_size, dtype=torch.float64))


def test_a_missing_or_wrong_vllm_interpreter_is_named_with_the_fix(tmp_path, monkeypatch):
    from serve import vllm_engine

    monkeypatch.setenv("SPECDRAFT_VLLM_VENV", str(tmp_path / "none"))
    with pytest.raises(UserError, match=r"no vLLM interpreter at .*none/bin/python: run `bash scripts/setup_vllm.sh`"):
        vllm_engine.vllm_python()
    venv = tmp_path / "old"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"  # an interpreter whose vLLM is another version
    python.write_text("#!/bin/sh\necho 0.31.0\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("SPECDRAFT_VLLM_VENV", str(venv))
    with pytest.raises(UserError, match=r"has vLLM 0.31.0, this project is tested with 0.32.0"):
        vllm_engine.vllm_python()
    with pytest.raises(UserError, match="does not serve 'draft_model' drafters"):
        vllm_engine.speculative_config("draft_model", tmp_path, 3)


# -- the layer settings an engine reads from the export, checked against the verifier (issue 54) ----------------------

def _layer(c: dict) -> dict:
    return c["transformer_layer_config"]


@pytest.mark.parametrize("edit, message", [
    (lambda c: _layer(c).pop("rope_theta"), r"transformer_layer_config.rope_theta is missing"),
    (lambda c: _layer(c).pop("num_attention_heads"), r"transformer_layer_config.num_attention_heads is missing"),
    (lambda c: _layer(c).__setitem__("rope_theta", 500000.0), r"rope_theta=500000.0 but the verifier's is 10000.0"),
    (lambda c: _layer(c).__setitem__("rms_norm_eps", 1e-5), r"rms_norm_eps=1e-05 but the verifier's is 1e-06"),
    (lambda c: _layer(c).__setitem__("num_attention_heads", 2), r"num_attention_heads=2 but the verifier's is 4"),
    (lambda c: _layer(c).__setitem__("head_dim", 32), r"head_dim=32 but the verifier's is 16"),
    (lambda c: c.pop("eagle_aux_hidden_state_layer_ids"), r"eagle_aux_hidden_state_layer_ids is missing: vLLM would "
                                                          r"feed the drafter its default layers"),
    (lambda c: c.__setitem__("eagle_aux_hidden_state_layer_ids", [1, 2, 4]), r"\[4\] out of range 0..3"),
])
def test_layer_settings_vllm_reads_that_are_missing_or_contradict_the_verifier_are_refused(eagle3_export, tiny4,
                                                                                          edit, message):
    """Each of these loaded silently before (this toolkit runs the layer with the verifier's values, vLLM with the
    export's, or its own defaults where one is missing): now one message naming the field, the values and the fix."""
    cfg = json.loads((eagle3_export / "config.json").read_text())
    edit(cfg)
    (eagle3_export / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=message) as info:
        load_export(eagle3_export, tiny4)
    assert "e3/config.json" in str(info.value)


def test_an_eagle1_export_without_its_layer_settings_is_refused(tiny4, tmp_path):
    path = save_export(build_eagle("eagle", tiny4), tiny4, tmp_path / "e1")
    cfg = json.loads((path / "config.json").read_text())
    load_export(path, tiny4)
    cfg.pop("rms_norm_eps")
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"e1/config.json: rms_norm_eps is missing \(expected 1e-06, the verifier's\)"
                                        r".*from-reference"):
        load_export(path, tiny4)


@pytest.mark.parametrize("edit, message", [
    (lambda c: (c.__setitem__("block_size", 2048), c["speculators_config"]["proposal_methods"][0].__setitem__(
        "speculative_tokens", 2047)), r"block_size=2048: the verifier's window \(2048 positions\) cannot hold"),
    (lambda c: _layer(c).__setitem__("max_position_embeddings", 4), r"block_size=4: .*window \(4 positions\)"),
    (lambda c: (c.__setitem__("block_size", 1), c["speculators_config"]["proposal_methods"][0].__setitem__(
        "speculative_tokens", 0)), r"block_size=1: .* >= 2"),
    (lambda c: _layer(c).__setitem__("rope_theta", 1e6), r"rope_theta=1000000.0 but the verifier's is 10000.0"),
    (lambda c: _layer(c).pop("rms_norm_eps"), r"transformer_layer_config.rms_norm_eps is missing"),
])
def test_a_dflash_export_whose_block_or_layer_settings_do_not_fit_is_refused(tiny4, tmp_path, edit, message):
    from models.dflash import build_dflash

    path = save_export(build_dflash(tiny4, 16, block_size=4, aux_layer_ids=[0, 1]), tiny4, tmp_path / "df")
    assert load_export(path, tiny4).net.block_size == 4
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=message) as info:
        load_export(path, tiny4)
    assert "df/config.json" in str(info.value)
