"""The reference layouts (Medusa repository, EAGLE repository EAGLE-1, SpecForge EAGLE-3) read and written:
files built by hand from the layouts docs/engine_loaders.md documents, loaded directly by load_export (and by
`python -m eval`), converted to this project's exports and back; bad input refused with the file and the key."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.exports.io import from_reference, load_export, read_config, read_weights, save_export, to_reference
from models.medusa import MedusaHeads
from runtime.errors import UserError

H, NH, HD, KV, INTER = 64, 4, 16, 2, 256  # build_tiny's shapes


@pytest.fixture(scope="module")
def tiny4(cache_dir):
    from models.verifiers.tiny import build_tiny

    return build_tiny(cache_dir=cache_dir, dtype="float32", device="cpu", num_layers=4)


def _rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape) * 0.05


def _write(d: Path, config: dict, tensors: dict, name: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    if name.endswith(".safetensors"):
        save_file(tensors, str(d / name))
    else:
        torch.save(tensors, d / name)
    return d


def _layer(prefix: str, in_dim: int, input_norm: bool, hidden_norm: bool) -> dict:
    """eagle/model/cnets1.py / cnets.py decoder layer names and shapes (docs/engine_loaders.md, reference layouts)."""
    out = {f"{prefix}.self_attn.q_proj.weight": _rand(NH * HD, in_dim),
           f"{prefix}.self_attn.k_proj.weight": _rand(KV * HD, in_dim),
           f"{prefix}.self_attn.v_proj.weight": _rand(KV * HD, in_dim),
           f"{prefix}.self_attn.o_proj.weight": _rand(H, NH * HD),
           f"{prefix}.mlp.gate_proj.weight": _rand(INTER, H), f"{prefix}.mlp.up_proj.weight": _rand(INTER, H),
           f"{prefix}.mlp.down_proj.weight": _rand(H, INTER),
           f"{prefix}.post_attention_layernorm.weight": 1 + _rand(H)}
    if input_norm:
        out[f"{prefix}.input_layernorm.weight"] = 1 + _rand(H)
    if hidden_norm:
        out[f"{prefix}.hidden_norm.weight"] = 1 + _rand(H)
    return out


def _llama_cfg(vocab: int) -> dict:
    return {"hidden_size": H, "intermediate_size": INTER, "num_attention_heads": NH, "num_key_value_heads": KV,
            "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "vocab_size": vocab}


def medusa_reference(d: Path, vocab: int, heads: int = 3, name: str = "medusa_lm_head.safetensors",
                     own_heads: bool = True) -> tuple[Path, dict]:
    sd = {}
    for h in range(heads):
        sd |= {f"{h}.0.linear.weight": _rand(H, H), f"{h}.0.linear.bias": _rand(H)}
        if own_heads:
            sd[f"{h}.1.weight"] = _rand(vocab, H)
    cfg = {"medusa_num_heads": heads, "medusa_num_layers": 1, "base_model_name_or_path": "x/y"}
    return _write(d, cfg, sd, name), sd


def eagle1_reference(d: Path, vocab: int, name: str = "pytorch_model.bin") -> tuple[Path, dict]:
    sd = {"fc.weight": _rand(H, 2 * H), "fc.bias": _rand(H), "embed_tokens.weight": _rand(vocab, H)}
    sd |= _layer("layers.0", H, input_norm=False, hidden_norm=False)
    return _write(d, {"architectures": ["LlamaForCausalLM"], "bias": True, **_llama_cfg(vocab)}, sd, name), sd


def eagle3_reference(d: Path, vocab: int, draft: int, sglang_ids: list[int] | None) -> tuple[Path, dict]:
    """SpecForge's export_to_sglang output: d2t and t2d always, ids (if any) in SGLang's output-of-layer convention."""
    ids = torch.arange(draft) * 3  # every third token id
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    sd = {"fc.weight": _rand(H, 3 * H), "norm.weight": 1 + _rand(H), "lm_head.weight": _rand(draft, H),
          "d2t": ids - torch.arange(draft), "t2d": t2d}
    sd |= _layer("midlayer", 2 * H, input_norm=True, hidden_norm=True)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft, "torch_dtype": "float16",
           **_llama_cfg(vocab)}
    if sglang_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": sglang_ids}
    return _write(d, cfg, sd, "model.safetensors"), sd


def _same(a: dict, b: dict, skip: tuple[str, ...] = ()) -> None:
    assert sorted(k for k in a if k not in skip) == sorted(k for k in b if k not in skip)
    for k in a:
        if k not in skip:
            assert torch.equal(a[k], b[k]), k


# -- reading the reference layouts, and round trips --------------------------------------------------------------------

@pytest.mark.parametrize("name", ["medusa_lm_head.safetensors", "medusa_lm_head.pt"])
def test_medusa_reference_round_trip(tiny, tmp_path, name):
    ref, sd = medusa_reference(tmp_path / "ref", tiny.vocab_size, name=name)
    loaded = load_export(ref, tiny, "medusa")
    assert loaded.net.num_heads == 3 and not loaded.net.share_lm_head
    assert torch.equal(loaded.net.blocks[2].layers[0].bias, sd["2.0.linear.bias"])
    assert torch.equal(loaded.net.lm_heads[1].weight, sd["1.1.weight"])
    ours = from_reference(ref, tmp_path / "ours", tiny)
    assert json.loads((ours / "config.json").read_text())["verifier_fingerprint"] == tiny.fingerprint
    back = to_reference("medusa", ours, tmp_path / "back", name)
    _same(sd, load_file(str(back / name)) if name.endswith("safetensors") else torch.load(back / name,
                                                                                           weights_only=True))
    assert json.loads((back / "config.json").read_text())["medusa_num_heads"] == 3


def test_medusa_shared_head_round_trip(tiny, tmp_path):
    """Ours (shared verifier head) -> reference (the head copied per head) -> ours shares it again; the Medusa-2
    file without {h}.1.weight shares the verifier's head too."""
    heads = MedusaHeads(H, tiny.vocab_size, num_heads=2)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(_rand(*p.shape))
    save_export(heads, tiny, tmp_path / "ours")
    ref = to_reference("medusa", tmp_path / "ours", tmp_path / "ref")
    assert torch.equal(load_file(str(ref / "medusa_lm_head.safetensors"))["1.1.weight"], tiny.lm_head.weight)
    again = load_export(ref, tiny)
    assert again.net.share_lm_head
    _same(again.net.state_dict(), heads.state_dict())
    medusa2, _ = medusa_reference(tmp_path / "m2", tiny.vocab_size, heads=2, own_heads=False)
    assert load_export(medusa2, tiny).net.share_lm_head


def test_eagle1_reference_round_trip(tiny, tmp_path):
    ref, sd = eagle1_reference(tmp_path / "ref", tiny.vocab_size)
    net = load_export(ref, tiny, "eagle").net
    assert torch.equal(net.fc.bias, sd["fc.bias"])  # the reference's trained bias is kept
    ours = from_reference(ref, tmp_path / "ours", tiny)
    back = to_reference("eagle", ours, tmp_path / "back")
    _same(sd, torch.load(back / "pytorch_model.bin", weights_only=True), skip=("embed_tokens.weight",))
    also = to_reference("eagle", ours, tmp_path / "back2", "model.safetensors")
    assert load_export(also, tiny).net.fc.bias is not None


@pytest.mark.parametrize("sglang_ids, ours_ids", [([0, 1, 2], [1, 2, 3]), ([-1, 1, 2], [0, 2, 3])])
def test_eagle3_reference_round_trip(tiny4, tmp_path, sglang_ids, ours_ids):
    ref, sd = eagle3_reference(tmp_path / "ref", tiny4.vocab_size, 512, sglang_ids)
    net = load_export(ref, tiny4, "eagle3").net
    assert net.aux_layer_ids == ours_ids  # SGLang's "output of layer k" is this project's k + 1
    assert net.draft_to_target(torch.arange(4)).tolist() == [0, 3, 6, 9]
    ours = from_reference(ref, tmp_path / "ours", tiny4)
    cfg = json.loads((ours / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == ours_ids  # the speculators format: vLLM's convention
    assert cfg["speculators_model_type"] == "eagle3" and "eagle_config" not in cfg  # SGLang reads the reference
    back = to_reference("eagle3", ours, tmp_path / "back")
    _same(sd, load_file(str(back / "model.safetensors")))
    back_cfg = json.loads((back / "config.json").read_text())
    assert back_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == sglang_ids
    assert "verifier_fingerprint" not in back_cfg and "eagle_aux_hidden_state_layer_ids" not in back_cfg


def test_full_vocab_eagle3_has_no_d2t_and_reads_spec_forge_identity(tiny4, tmp_path):
    from models.eagle import build_eagle

    net = build_eagle("eagle3", tiny4)  # 4 layers: the default ids are [0, 2, 3]
    assert net.aux_layer_ids == [0, 2, 3]
    save_export(net, tiny4, tmp_path / "ours")
    tensors = load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert "d2t" not in tensors and "t2d" not in tensors
    assert load_export(tmp_path / "ours", tiny4).net.draft_vocab_size == tiny4.vocab_size
    back = to_reference("eagle3", tmp_path / "ours", tmp_path / "ref")  # SpecForge writes them always: identity
    ref = load_file(str(back / "model.safetensors"))
    assert not ref["d2t"].any() and bool(ref["t2d"].all())
    assert load_export(back, tiny4).net.aux_layer_ids == [0, 2, 3]


def test_eval_reads_a_reference_checkpoint(tiny, tmp_path):
    from test_harness import FAST, run_eval

    ref, _ = medusa_reference(tmp_path / "ref", tiny.vocab_size, heads=2)
    report, _ = run_eval([f"checkpoint={ref}", "verifier_path={loader: tiny}", "num_prompts=1", "tree=chain", *FAST],
                         tmp_path / "out")
    assert report["method"] == "medusa/chain-2" and report["greedy_match"] == 1.0


def test_convert_cli(tiny, tmp_path, capsys):
    from scripts.tools.convert import main

    ref, sd = medusa_reference(tmp_path / "ref", tiny.vocab_size, heads=2)
    save_export(load_export(ref, tiny).net, tiny, tmp_path / "ours")
    assert main(["to-reference", str(tmp_path / "ours"), str(tmp_path / "back"), "--weights", "medusa_lm_head.pt"]) == 0
    _same(sd, torch.load(tmp_path / "back" / "medusa_lm_head.pt", weights_only=True))
    assert main(["to-reference", str(ref), str(tmp_path / "x")]) == 2
    assert "already in a reference layout" in capsys.readouterr().err


def test_convert_keeps_a_folder_that_is_not_the_same_kind_of_export(tiny, tmp_path, capsys):
    """Issue 54: every writer replaced its output folder whole, so `convert ... served` deleted another export and
    the notes in served/ with exit 0. Now a folder holding anything but an export of the same family and layout is
    refused (exit 2, naming it and --force); the same kind of export is still replaced (a re-run, a re-export)."""
    import shutil

    from scripts.tools.convert import main

    ref, _ = medusa_reference(tmp_path / "ref", tiny.vocab_size, heads=2)
    net = load_export(ref, tiny).net
    ours = save_export(net, tiny, tmp_path / "ours")
    eagle = from_reference(eagle1_reference(tmp_path / "eref", tiny.vocab_size)[0], tmp_path / "eagle", tiny)
    served = tmp_path / "served"
    shutil.copytree(eagle, served)
    (served / "notes.txt").write_text("how this was served\n")

    def kept() -> dict:
        return {p.name: p.read_bytes() for p in served.iterdir() if p.is_file()}

    before = kept()
    for command in ("to-reference", "from-reference"):  # from-reference: the verifier `ours` names (tiny)
        assert main([command, str(ours), str(served)]) == 2
        err = capsys.readouterr().err
        assert f"{served} holds an EAGLE-1 export" in err and "--force" in err, err
    with pytest.raises(UserError, match=r"served holds an EAGLE-1 export; writing a Medusa export there"):
        save_export(net, tiny, served)
    assert kept() == before
    (served / "model.safetensors").unlink()
    (served / "config.json").unlink()  # only the notes: no export at all
    with pytest.raises(UserError, match=r"served holds no export but notes.txt; writing a Medusa export"):
        save_export(net, tiny, served)
    save_export(net, tiny, tmp_path / "empty")  # an empty or missing folder is written
    (tmp_path / "blank").mkdir()
    save_export(net, tiny, tmp_path / "blank")
    # The same kind of export is replaced (train.py's re-export, a re-run of the same convert) ...
    assert save_export(net, tiny, ours) == ours
    assert main(["to-reference", str(ours), str(tmp_path / "back")]) == 0
    assert main(["to-reference", str(ours), str(tmp_path / "back")]) == 0
    assert from_reference(ours, ours, tiny) == ours  # an export rewritten in place
    # ... but not with files beside it that the new one would not have; --force replaces all of it.
    (ours / "notes.txt").write_text("x")
    with pytest.raises(UserError, match=r"ours holds a Medusa export and also \['notes.txt'\]"):
        save_export(net, tiny, ours)
    assert main(["to-reference", str(ours), str(served), "--force"]) == 0
    assert sorted(p.name for p in served.iterdir()) == ["config.json", "medusa_lm_head.safetensors"]


def test_convert_engine_ready_refuses_before_loading_the_verifier(tmp_path, capsys):
    """The issue's own command: `convert engine-ready pretrained/medusa-smollm2 served` with another export and notes
    in served/ stops at once (the default verifier is never loaded), deleting nothing."""
    from helpers import ROOT
    from scripts.tools.convert import main

    served = tmp_path / "served"
    served.mkdir()
    (served / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    (served / "notes.txt").write_text("mine\n")
    shipped = ROOT / "pretrained" / "medusa-smollm2"
    if not (shipped / "config.json").is_file():
        pytest.skip("no pretrained/medusa-smollm2")
    for command in ("engine-ready", "ship"):
        assert main([command, str(shipped), str(served)]) == 2
        err = capsys.readouterr().err
        assert f"error: {served} holds no export but config.json, notes.txt; writing a" in err, err
        assert "--force" in err
    assert sorted(p.name for p in served.iterdir()) == ["config.json", "notes.txt"]


# -- bad input: one message each, naming the file and the key ----------------------------------------------------------

def test_unknown_layout_is_refused(tiny, tmp_path):
    d = _write(tmp_path / "odd", {"architectures": ["GPT2LMHeadModel"]}, {"wte.weight": torch.zeros(2, 2)},
               "model.safetensors")
    with pytest.raises(UserError, match=r"odd/model.safetensors: unknown layout.*wte.weight"):
        load_export(d, tiny)
    (d / "model.safetensors").unlink()
    with pytest.raises(UserError, match="no weight file of a reference layout"):
        load_export(d, tiny)


def test_layer_ids_an_engine_would_read_differently(tiny4, tmp_path):
    from models.eagle import build_eagle

    path = save_export(build_eagle("eagle3", tiny4, draft_vocab_size=64, aux_layer_ids=[1, 2, 3]), tiny4,
                       tmp_path / "e3")
    spec_cfg = json.loads((path / "config.json").read_text())
    spec_cfg["eagle_aux_hidden_state_layer_ids"] = [2, 1, 3]  # the speculators format: vLLM would sort them
    (path / "config.json").write_text(json.dumps(spec_cfg))
    with pytest.raises(UserError, match=r"config.json: eagle_aux_hidden_state_layer_ids=\[2, 1, 3\]: not strictly"):
        load_export(path, tiny4)
    spec_cfg["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    (path / "config.json").write_text(json.dumps(spec_cfg))
    cfg = read_config(path)  # the flat layout an older export has, with SGLang's nested key
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]  # what SGLang would read as 2, 3, 4
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"e3/config.json: eagle_config.eagle_aux_hidden_state_layer_ids=\[1, 2, 3\]"):
        load_export(path, tiny4)
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    cfg["eagle_aux_hidden_state_layer_ids"] = [2, 1, 3]  # vLLM sorts them
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"config.json: eagle_aux_hidden_state_layer_ids=\[2, 1, 3\]: not strictly"):
        load_export(path, tiny4)


def test_head_count_disagreeing_with_config(tiny, tmp_path):
    ref, _ = medusa_reference(tmp_path / "ref", tiny.vocab_size, heads=3)
    cfg = json.loads((ref / "config.json").read_text()) | {"medusa_num_heads": 5}
    (ref / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"medusa_lm_head.safetensors: config.json medusa_num_heads=5 but the file "
                                        r"holds 3 heads"):
        load_export(ref, tiny)
    heads = MedusaHeads(H, tiny.vocab_size, num_heads=3)
    path = save_export(heads, tiny, tmp_path / "ours")
    cfg = json.loads((path / "config.json").read_text()) | {"num_heads": 4}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"config.json: num_heads=4 disagrees with the weights: model.safetensors "
                                        r"holds blocks.\{h\}.\* \(3 heads\)"):
        load_export(path, tiny)


def test_hidden_size_disagreeing_with_config(tiny, tmp_path):
    ref, _ = eagle1_reference(tmp_path / "ref", tiny.vocab_size)
    cfg = json.loads((ref / "config.json").read_text()) | {"hidden_size": 128}
    (ref / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"pytorch_model.bin|model.safetensors"):
        load_export(ref, tiny)
    with pytest.raises(UserError, match=r"config.json hidden_size=128 but fc.weight is \(64, 128\)"):
        load_export(ref, tiny)
    heads = MedusaHeads(H, tiny.vocab_size, num_heads=2)
    path = save_export(heads, tiny, tmp_path / "ours")
    cfg = json.loads((path / "config.json").read_text()) | {"hidden_size": 32}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"config.json: hidden_size=32 disagrees with the weights: model.safetensors "
                                        r"holds blocks.0.layers.0.weight of shape \[64, 64\]"):
        load_export(path, tiny)


def test_medusa_layers_other_than_one_are_refused(tiny, tmp_path):
    ref, _ = medusa_reference(tmp_path / "ref", tiny.vocab_size)
    cfg = json.loads((ref / "config.json").read_text()) | {"medusa_num_layers": 2}
    (ref / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="medusa_num_layers=2; only 1 maps"):
        load_export(ref, tiny)
    heads = MedusaHeads(H, tiny.vocab_size, num_heads=2, num_layers=2)
    save_export(heads, tiny, tmp_path / "two")
    with pytest.raises(UserError, match="num_hidden_layers=2"):
        to_reference("medusa", tmp_path / "two", tmp_path / "out")


def test_read_weights_names_a_corrupt_pt(tmp_path):
    d = tmp_path / "ref"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"medusa_num_heads": 1}))
    (d / "medusa_lm_head.pt").write_bytes(b"not a pickle")
    with pytest.raises(UserError, match="medusa_lm_head.pt is corrupt"):
        read_weights(d)


assert os.environ.get("SPECDRAFT_CACHE")  # conftest sets it


@pytest.mark.parametrize("tokens", ["0", "-2"])
def test_convert_refuses_a_chain_of_no_tokens_before_loading_the_verifier(tmp_path, capsys, tokens):
    """`--speculative-tokens 0` once became the default 3 without a word: refused, naming the flag and the value."""
    from scripts.tools.convert import main

    ref = tmp_path / "ref"
    assert main(["from-reference", str(ref), str(tmp_path / "out"), "--speculative-tokens", tokens]) == 2
    err = capsys.readouterr().err
    assert f"error: --speculative-tokens={tokens}: the tokens vLLM drafts per step must be a whole number >= 1" in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match=rf"speculative_tokens={tokens}: .*>= 1"):
        from_reference(ref, tmp_path / "out", verifier=None, speculative_tokens=int(tokens))
