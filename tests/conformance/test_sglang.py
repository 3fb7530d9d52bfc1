"""SGLang 0.5.23 loader conformance, re-implemented over the export files (source: the PyPI wheel
sglang-0.5.23; docs/engine_loaders.md). SGLang has no Medusa. Not run against SGLang itself (no GPU here).
"""

from __future__ import annotations

import pytest

from conformance.engines import Export, Load, assert_conforms, config_dtype, key, llama_layer, stacked

# srt/models/*.py EntryClass, the Llama-family names (srt/models/registry.py ModelRegistry).
REGISTRY = {
    "LlamaForCausalLM": "LlamaForCausalLM",
    "LlamaForCausalLMEagle": "LlamaForCausalLMEagle",
    "LlamaForCausalLMEagle3": "LlamaForCausalLMEagle3",
    "MistralForCausalLMEagle": "MistralForCausalLMEagle",
}
SERVING_DTYPES = {"bfloat16", "float16"}


def resolve_architecture(archs: list[str]) -> str | None:
    """srt/models/registry.py _ModelRegistry.resolve_model_cls: the first name of `architectures` that is registered
    (no rewriting for a draft model: srt/configs/model_config.py ModelConfig._config_draft_model leaves Llama alone)."""
    return next((REGISTRY[a] for a in archs if a in REGISTRY), None)


def load_eagle1(ex: Export) -> Load:
    """srt/models/llama_eagle.py LlamaForCausalLMEagle.__init__/load_weights -> srt/models/llama.py
    LlamaForCausalLM._legacy_load_weights (SGLANG_ENABLE_WEIGHT_LOADER_V2 defaults to False).

    fc = torch.nn.Linear(2h, h): bias=True always. Layer 0 has no input_layernorm. Attention biases: attention_bias
    or bias (llama.py LlamaDecoderLayer.__init__). embed_tokens and lm_head come from the target (srt/speculative/
    eagle_worker_v2.py init_lm_head -> set_embed_and_head): names with "lm_head" are skipped; the rest get "model."
    and load if the parameter exists; an unknown `.bias` is skipped silently, anything else unknown is skipped with
    a warning ("Parameter ... not found in params_dict"); a missing tensor leaves its parameter as initialised.
    """
    cfg, h = ex.config, ex.config["hidden_size"]
    bias = bool(cfg.get("attention_bias", False) or cfg.get("bias", False))
    load = Load("SGLang LlamaForCausalLMEagle")
    load.expected |= {"model.fc.weight": (h, 2 * h), "model.fc.bias": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        load.expected |= llama_layer(f"model.layers.{i}", cfg, h, attn_bias=bias, o_bias=bias, input_norm=i > 0,
                                     hidden_norm=False)
    for name in ex.shapes:
        if "lm_head" in name:
            load.dropped.append((name, "LlamaForCausalLMEagle.load_weights skips lm_head (the target's is used)"))
            continue
        _legacy_load(load, f"model.{name}", name)
    return load


def _legacy_load(load: Load, name: str, source: str) -> None:
    if "rotary_emb" in name:
        return
    param, shard = stacked(name)
    k = key(param, shard)
    if k in load.expected:
        load.put(k, source)
    elif not param.endswith(".bias"):
        load.dropped.append((source, f"Parameter {param} not found in params_dict (a warning)"))
    else:
        load.dropped.append((source, "an unknown .bias is skipped silently"))


def load_eagle3(ex: Export, target_vocab: int) -> tuple[Load, bool]:
    """srt/models/llama_eagle3.py LlamaForCausalLMEagle3.__init__/load_weights + LlamaModel.__init__.

    fc = nn.Linear((target_hidden_size or hidden_size) * num_aux, h, bias=config.bias (default False)), num_aux =
    num_aux_hidden_states or len(eagle_config.eagle_aux_hidden_state_layer_ids) or 3; norm_before_fc -> input_norm;
    fc_norm / use_aux_norm -> fc_norm.{i}. Layer 0: qkv over 2h (bias=False), input_layernorm, hidden_norm.
    lm_head: (draft_vocab_size, h) unless tie_word_embeddings; draft_vocab_size None -> the target's lm_head.
    Names: midlayer -> layers.0 (and aux_norm_* -> fc_norm.*), d2t -> hot_token_id = d2t + arange, t2d skipped,
    q/k/v and gate/up fused; a name loads as-is or under "model." if that parameter exists, else is skipped silently.
    Returns (load, has_d2t).
    """
    cfg, h = ex.config, ex.config["hidden_size"]
    eagle_config = cfg.get("eagle_config") or {}
    num_aux = cfg.get("num_aux_hidden_states") or len(eagle_config.get("eagle_aux_hidden_state_layer_ids") or []) or 3
    h_in = cfg.get("target_hidden_size", h)
    bias = bool(cfg.get("attention_bias", False) or cfg.get("bias", False))
    load = Load("SGLang LlamaForCausalLMEagle3")
    load.expected["model.fc.weight"] = (h, h_in * num_aux)
    if cfg.get("bias", False):
        load.expected["model.fc.bias"] = (h,)
    if eagle_config.get("norm_before_fc", cfg.get("norm_before_fc", False)):
        load.expected["model.input_norm.weight"] = (h_in * num_aux,)
    if cfg.get("fc_norm") or cfg.get("use_aux_norm", False):
        load.expected |= {f"model.fc_norm.{i}.weight": (h_in,) for i in range(num_aux)}
    for i in range(cfg["num_hidden_layers"]):
        load.expected |= llama_layer(f"model.layers.{i}", cfg, 2 * h if i == 0 else h, attn_bias=False,
                                     o_bias=bias, input_norm=True, hidden_norm=True)
    load.expected["model.norm.weight"] = (h,)
    draft_vocab = cfg.get("draft_vocab_size")
    if not cfg.get("tie_word_embeddings", False) and draft_vocab is not None:
        load.expected["lm_head.weight"] = (draft_vocab, h)
    has_d2t = False
    for name in ex.shapes:
        n = name
        for legacy, new in (("midlayer", "layers.0"), ("aux_norm_low", "fc_norm.0"), ("aux_norm_mid", "fc_norm.1"),
                            ("aux_norm_high", "fc_norm.2")):
            n = n.replace(legacy, new)
        if "d2t" in n:
            has_d2t = True
            if ex.shapes[name] != ((draft_vocab or target_vocab),):
                load.errors.append(f"d2t has shape {ex.shapes[name]}, the draft vocabulary is {draft_vocab}")
            continue
        if "t2d" in n:
            continue
        param, shard = stacked(n)
        param = param if key(param, shard) in load.expected else f"model.{param}"
        if key(param, shard) in load.expected:
            load.put(key(param, shard), name)
        else:
            load.dropped.append((name, f"no parameter {param} (skipped silently)"))
    if draft_vocab is not None and draft_vocab < target_vocab and not has_d2t:
        load.errors.append("draft vocabulary smaller than the target's but no d2t: draft ids would be read as "
                           "target ids")
    return load, has_d2t


def aux_layers_read(cfg: dict, num_layers: int) -> list[int]:
    """The HF hidden_states indices SGLang feeds the EAGLE-3 fc, in feed order.

    srt/model_executor/model_runner_components/spec_aux_hidden_state.py _resolve_eagle_aux_hidden_state reads
    eagle_config["eagle_aux_hidden_state_layer_ids"] only (None if absent); srt/models/llama.py
    LlamaForCausalLM.set_eagle3_layers_to_capture: None -> [2, L//2, L-3], else [k + 1 for k in ids] ("for the ith
    layer, it takes the output of the (i-1)th layer"); LlamaModel.forward captures the stream entering layer i
    (layer_boundary prepare(capture=...)) for i in range(L) if i is listed, in layer order: HF hidden_states[i].
    """
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    capture = {2, num_layers // 2, num_layers - 3} if ids is None else {k + 1 for k in ids}
    return [i for i in range(num_layers) if i in capture]


def aux_layer_problems(cfg: dict, trained: tuple[int, ...], num_layers: int) -> list[str]:
    read = aux_layers_read(cfg, num_layers)
    if read != list(trained):
        return [f"SGLang feeds hidden_states{read} to a drafter trained on hidden_states{list(trained)}"]
    return []


def dtype_problems(cfg: dict) -> list[str]:
    """srt/configs/model_config.py _get_and_verify_dtype: the draft's dtype under the default --dtype auto is the
    config's `dtype` / `torch_dtype`, and float32 (or none) becomes float16 (ModelConfig.from_server_args: the draft
    gets server_args.dtype)."""
    declared = config_dtype(cfg)
    if declared not in SERVING_DTYPES:
        return [f"torch_dtype {declared!r}: SGLang --dtype auto serves this drafter in float16, whatever the "
                f"verifier's dtype; write the serving dtype (one of {sorted(SERVING_DTYPES)})"]
    return []


# -- tests -------------------------------------------------------------------------------------------------------------

def test_eagle1_architecture_resolves(exported):
    ex = Export.read(exported("eagle-tiny").path)
    assert resolve_architecture(ex.config["architectures"]) == "LlamaForCausalLMEagle"


def test_eagle1_weights_load(exported):
    ex = Export.read(exported("eagle-tiny").path)
    assert_conforms(load_eagle1(ex).problems(ex))


@pytest.mark.parametrize("name", ["eagle-tiny", "eagle3-tiny4"])
def test_torch_dtype_is_a_serving_dtype(exported, name):
    assert_conforms(dtype_problems(Export.read(exported(name).path).config))


def test_eagle3_architecture_resolves(exported):
    ex = Export.read(exported("eagle3-tiny4").path)
    assert resolve_architecture(ex.config["architectures"]) == "LlamaForCausalLMEagle3"


@pytest.mark.parametrize("name", ["eagle3-tiny4", "eagle3-tiny4-fullvocab"])
def test_eagle3_weights_load(exported, name):
    w = exported(name)
    ex = Export.read(w.path)
    assert_conforms(load_eagle3(ex, w.vocab_size)[0].problems(ex))


def test_eagle3_layer_ids_explicit(exported):
    w = exported("eagle3-tiny4")
    assert_conforms(aux_layer_problems(Export.read(w.path).config, w.aux_layer_ids, w.verifier_layers))


@pytest.mark.slow
def test_eagle3_layer_ids_default_verifier(exported):
    w = exported("eagle3-smollm2")
    assert_conforms(aux_layer_problems(Export.read(w.path).config, w.aux_layer_ids, w.verifier_layers))


@pytest.mark.slow
def test_weights_load_default_verifier(exported):
    w1, w3 = exported("eagle-smollm2"), exported("eagle3-smollm2")
    e1, e3 = Export.read(w1.path), Export.read(w3.path)
    problems = load_eagle3(e3, w3.vocab_size)[0].problems(e3)
    problems += load_eagle1(e1).problems(e1)
    assert_conforms(problems)


# -- the checks can fail: the same simulations on exports broken on purpose --------------------------------------------

def test_checks_catch_broken_exports(exported):
    w = exported("eagle3-tiny4")
    ex = Export.read(w.path)
    renamed = Export(ex.path, ex.config, {k.replace("midlayer.", "layer."): v for k, v in ex.shapes.items()}, ex.dtypes)
    problems = load_eagle3(renamed, w.vocab_size)[0].problems(renamed)
    assert any("drops layer.self_attn.q_proj.weight" in p for p in problems)
    assert any("model.layers.0.self_attn.qkv_proj.weight[q]" in p and "uninitialised" in p for p in problems)
    no_d2t = Export(ex.path, ex.config, {k: v for k, v in ex.shapes.items() if k != "d2t"}, ex.dtypes)
    assert any("no d2t" in p for p in load_eagle3(no_d2t, w.vocab_size)[0].problems(no_d2t))
    e1 = Export.read(exported("eagle-tiny").path)
    with_bias = Export(e1.path, e1.config, {**e1.shapes, "fc.bias": (e1.config["hidden_size"],)}, e1.dtypes)
    assert load_eagle1(with_bias).problems(with_bias) == []
    sglang_ids = {**ex.config, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in w.aux_layer_ids]}}
    assert aux_layer_problems(sglang_ids, w.aux_layer_ids, w.verifier_layers) == []
    assert aux_layer_problems(sglang_ids, (1, 2, 4), 4)  # hidden_states[L] cannot be captured
    assert dtype_problems({"torch_dtype": "bfloat16"}) == [] and dtype_problems({})
    assert resolve_architecture(["LlamaForCausalLMEagle", "EagleLlamaForCausalLM"]) == "LlamaForCausalLMEagle"
    assert resolve_architecture(["LlamaForCausalLM"]) == "LlamaForCausalLM"  # a full model, not a drafter
