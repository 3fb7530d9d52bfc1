"""Reference repositories' loader conformance, re-implemented over the export files:
SafeAILab/EAGLE at cb7e0841fe0c (2026-02-19) and FasterDecoding/Medusa at e2a5d20c048a (2024-04-18; tag v0.1 for
the v0.1 layout). See docs/engine_loaders.md. Their loaders call load_state_dict(strict=False): a missing tensor
keeps its initial value, an extra one is ignored; only a shape mismatch raises.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.engines import Export, Load, assert_conforms


def _strict_false(load: Load, ex: Export, rename=lambda n: n) -> Load:
    """torch.nn.Module.load_state_dict(strict=False) as EaModel.__init__ / MedusaModelABC.from_pretrained call it."""
    for name in ex.shapes:
        n = rename(name)
        if n in load.expected:
            load.put(n, name)
        else:
            load.dropped.append((name, "unexpected key, ignored by load_state_dict(strict=False)"))
    return load


def _eagle_layer(prefix: str, cfg: dict, in_dim: int, input_norm: bool, hidden_norm: bool) -> dict:
    """eagle/model/cnets1.py (EAGLE-1) / cnets.py (EAGLE-3) LlamaAttention, LlamaMLP, LlamaDecoderLayer(emb):
    head_dim = hidden_size // num_attention_heads (the config's head_dim is not read); q/k/v bias only with qkv_bias."""
    h, inter, nh = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    nkv, hd = cfg.get("num_key_value_heads") or nh, cfg["hidden_size"] // cfg["num_attention_heads"]
    out = {f"{prefix}.self_attn.q_proj.weight": (nh * hd, in_dim),
           f"{prefix}.self_attn.k_proj.weight": (nkv * hd, in_dim),
           f"{prefix}.self_attn.v_proj.weight": (nkv * hd, in_dim), f"{prefix}.self_attn.o_proj.weight": (h, nh * hd),
           f"{prefix}.mlp.gate_proj.weight": (inter, h), f"{prefix}.mlp.up_proj.weight": (inter, h),
           f"{prefix}.mlp.down_proj.weight": (h, inter), f"{prefix}.post_attention_layernorm.weight": (h,)}
    if cfg.get("qkv_bias"):
        out |= {k.replace(".weight", ".bias"): v[:1] for k, v in out.items() if "_proj" in k and "self_attn.o" not in k
                and "mlp" not in k}
    if input_norm:
        out[f"{prefix}.input_layernorm.weight"] = (h,)
    if hidden_norm:
        out[f"{prefix}.hidden_norm.weight"] = (h,)
    return out


def load_eagle1(ex: Export) -> Load:
    """eagle/model/ea_model.py EaModel.from_pretrained/__init__ (use_eagle3=False) -> cnets1.py Model.

    Weights: pytorch_model.bin, else model.safetensors. fc = nn.Linear(2h, h, bias=config["bias"], default True).
    Layer 0 has no input_layernorm. embed_tokens is read from the base model (load_emb=True); the base lm_head is used.
    """
    cfg, h = ex.config, ex.config["hidden_size"]
    load = Load("EAGLE repo (EAGLE-1)")
    load.expected["fc.weight"] = (h, 2 * h)
    if cfg.get("bias", True):
        load.expected["fc.bias"] = (h,)
    for i in range(cfg["num_hidden_layers"]):
        load.expected |= _eagle_layer(f"layers.{i}", cfg, h, input_norm=i != 0, hidden_norm=False)
    return _strict_false(load, ex)


def load_eagle3(ex: Export) -> Load:
    """eagle/model/ea_model.py EaModel.__init__ (use_eagle3=True) -> cnets.py Model.__init__.

    lm_head (draft_vocab_size, h); midlayer = LlamaDecoderLayeremb (q/k/v over 2h, hidden_norm, input_layernorm);
    fc = nn.Linear(3 * (target_hidden_size or h), h, bias=False); norm; buffers d2t (draft_vocab_size,) and t2d
    (vocab_size,), deleted before loading when vocab_size == draft_vocab_size (then extra d2t/t2d are ignored).
    """
    cfg, h = ex.config, ex.config["hidden_size"]
    draft_vocab = cfg["draft_vocab_size"]
    load = Load("EAGLE repo (EAGLE-3)")
    load.expected |= {"lm_head.weight": (draft_vocab, h), "fc.weight": (h, 3 * cfg.get("target_hidden_size", h)),
                      "norm.weight": (h,)}
    load.expected |= _eagle_layer("midlayer", cfg, 2 * h, input_norm=True, hidden_norm=True)
    if cfg["vocab_size"] != draft_vocab:
        load.expected |= {"d2t": (draft_vocab,), "t2d": (cfg["vocab_size"],)}
        return _strict_false(load, ex)
    load = _strict_false(load, Export(ex.path, ex.config, {k: v for k, v in ex.shapes.items()
                                                           if k not in ("d2t", "t2d")}, ex.dtypes))
    return load


def aux_layers_read(num_layers: int) -> list[int]:
    """eagle/model/modeling_llama_kv.py LlamaModel.forward: before layer idx runs, its input is kept when
    idx == L-3 or idx == L//2 or idx == 2; fixed, not read from any config."""
    return [i for i in range(num_layers) if i in (num_layers - 3, num_layers // 2, 2)]


MEDUSA_CONFIG_KEYS = ("medusa_num_heads", "medusa_num_layers", "base_model_name_or_path")


def load_medusa(ref_dir: Path, num_heads: int, hidden: int, vocab: int) -> tuple[Load, Export]:
    """medusa/model/medusa_model.py MedusaModel.from_pretrained -> MedusaModelABC.from_pretrained (the v0.1 path:
    MedusaConfig with medusa_num_heads, medusa_num_layers, base_model_name_or_path; weights medusa_lm_head.pt,
    torch.load, load_state_dict(strict=False)) into medusa_head = ModuleList(Sequential([ResBlock] * L, Linear(h, V,
    bias=False))): keys {h}.{l}.linear.weight|bias for l < L and {h}.{L}.weight. `[ResBlock] * L` is one block
    repeated, so only medusa_num_layers = 1 round-trips. Reads .pt; train_legacy.py writes .safetensors (read both).
    """
    weights = next((f for f in ("medusa_lm_head.safetensors", "medusa_lm_head.pt") if (ref_dir / f).is_file()), None)
    assert weights is not None, f"{ref_dir}: no medusa_lm_head.safetensors / medusa_lm_head.pt"
    if weights.endswith(".pt"):
        import torch

        sd = torch.load(ref_dir / weights, weights_only=True)
        ex = Export(ref_dir, _json(ref_dir), {k: tuple(v.shape) for k, v in sd.items()}, {})
    else:
        ex = Export.read(ref_dir, weights)
    missing_keys = [k for k in MEDUSA_CONFIG_KEYS if k not in ex.config]
    load = Load("Medusa repo")
    if missing_keys:
        load.errors.append(f"config.json lacks {missing_keys}")
    layers = ex.config.get("medusa_num_layers", 1)
    if layers != 1:
        load.errors.append(f"medusa_num_layers={layers}: the reference shares one ResBlock across layers")
    for i in range(num_heads):
        for j in range(layers):
            load.expected |= {f"{i}.{j}.linear.weight": (hidden, hidden), f"{i}.{j}.linear.bias": (hidden,)}
        load.expected[f"{i}.{layers}.weight"] = (vocab, hidden)
    return _strict_false(load, ex), ex


def _json(d: Path) -> dict:
    import json

    return json.loads((d / "config.json").read_text())


def to_reference_layout(kind: str, export_dir: Path, out_dir: Path) -> Path:
    """This project's export -> the reference layout: what `scripts/tools/convert.py to-reference` runs."""
    from models.exports.io import to_reference

    return to_reference(kind, export_dir, out_dir)


# -- tests -------------------------------------------------------------------------------------------------------------

def test_eagle1_weights_load(exported):
    ex = Export.read(exported("eagle-tiny").path)
    assert_conforms(load_eagle1(ex).problems(ex))


@pytest.mark.parametrize("name", ["eagle3-tiny4", "eagle3-tiny4-fullvocab"])
def test_eagle3_weights_load(exported, name):
    ex = Export.read(exported(name).path)
    assert_conforms(load_eagle3(ex).problems(ex))


@pytest.mark.slow
def test_eagle3_default_verifier(exported):
    """The EAGLE repository only takes the default layers: the default verifier's [2, 15, 27] match them."""
    w = exported("eagle3-smollm2")
    ex = Export.read(w.path)
    assert aux_layers_read(w.verifier_layers) == list(w.aux_layer_ids)
    assert_conforms(load_eagle3(ex).problems(ex))


def test_eagle3_explicit_layers_not_supported(exported):
    """Non-default layer ids cannot be served by the EAGLE repository (README, Export formats: not supported); the check
    sees it."""
    w = exported("eagle3-tiny4")
    assert aux_layers_read(w.verifier_layers) != list(w.aux_layer_ids)


def test_medusa_reference_layout(exported, tmp_path):
    w = exported("medusa-tiny")
    ref = to_reference_layout("medusa", w.path, tmp_path / "ref")
    load, ex = load_medusa(ref, num_heads=3, hidden=w.hidden_size, vocab=w.vocab_size)
    assert_conforms(load.problems(ex))


# -- the checks can fail: the same simulations on files broken on purpose ----------------------------------------------

def test_checks_catch_broken_files(exported, tmp_path):
    import json

    import torch
    from safetensors.torch import save_file

    e1 = Export.read(exported("eagle-tiny").path)
    no_bias = Export(e1.path, {**e1.config, "bias": False}, {k: v for k, v in e1.shapes.items() if k != "fc.bias"},
                     e1.dtypes)
    assert load_eagle1(no_bias).problems(no_bias) == []
    e3 = Export.read(exported("eagle3-tiny4").path)
    short = Export(e3.path, e3.config, {**e3.shapes, "t2d": (10,)}, e3.dtypes)
    assert any("shape check fails: t2d" in p for p in load_eagle3(short).problems(short))
    # A Medusa reference file written by hand from the documented layout: passes; drop a head: flagged.
    h, v = 8, 16
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1,
                                                 "base_model_name_or_path": "x"}))
    sd = {f"{i}.0.linear.weight": torch.zeros(h, h) for i in range(2)} | {f"{i}.0.linear.bias": torch.zeros(h)
                                                                         for i in range(2)}
    sd |= {f"{i}.1.weight": torch.zeros(v, h) for i in range(2)}
    save_file(sd, str(ref / "medusa_lm_head.safetensors"))
    load, ex = load_medusa(ref, 2, h, v)
    assert load.problems(ex) == []
    torch.save({k: t for k, t in sd.items() if not k.startswith("1.")}, ref / "medusa_lm_head.pt")
    (ref / "medusa_lm_head.safetensors").unlink()
    load, ex = load_medusa(ref, 2, h, v)
    assert any("1.1.weight" in p and "uninitialised" in p for p in load.problems(ex))
