"""vLLM 0.32.0 / 0.33.0 loader conformance, re-implemented over the export files (source: the PyPI wheels
vllm-0.32.0 and vllm-0.33.0, identical in every function cited here unless noted; docs/engine_loaders.md).

Not run against vLLM itself (no GPU here): each function below mirrors one cited vLLM function.
"""

from __future__ import annotations

import pytest

from conformance.engines import Export, Load, assert_conforms, key, llama_layer, stacked

# vllm/model_executor/models/registry.py (_SPECULATIVE_DECODING_MODELS, _TEXT_GENERATION_MODELS): the Llama-family
# names and the class each resolves to. "MedusaModel" is registered in 0.32.0 and gone in 0.33.0.
REGISTRY = {
    "LlamaForCausalLM": "LlamaForCausalLM",
    "EagleLlamaForCausalLM": "EagleLlamaForCausalLM",
    "Eagle3LlamaForCausalLM": "Eagle3LlamaForCausalLM",
    "LlamaForCausalLMEagle3": "Eagle3LlamaForCausalLM",
    "PeagleLlamaForCausalLM": "Eagle3LlamaForCausalLM",
    "PEagleDraftModel": "Eagle3LlamaForCausalLM",
}
REGISTRY_032 = {**REGISTRY, "MedusaModel": "Medusa"}
ROTARY = ("rotary_pos_emb.inv_freq", "rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def resolve_draft_architecture(archs: list[str], method: str, registry: dict[str, str]) -> str | None:
    """The draft model class vLLM builds for `--speculative-config '{"method": method, ...}'`.

    config/speculative.py SpeculativeConfig.__post_init__ first builds the draft ModelConfig from the file's own
    `architectures` (registry.py ModelRegistry.inspect_model_cls: the first registered name, else the Transformers
    fallback, which knows no *Eagle* class, else ValueError), then wraps it in transformers_utils/configs/eagle.py
    EAGLEConfig, which rewrites each name: eagle -> "Eagle" + arch unless it starts with "Eagle"; eagle3 -> "Eagle3" +
    arch unless it starts with "Eagle3" or ends with "Eagle3"; update_arch_() then resolves the rewritten list.
    """
    if not any(a in registry for a in archs):
        return None
    if method == "eagle":
        archs = [a if a.startswith("Eagle") else f"Eagle{a}" for a in archs]
    elif method == "eagle3":
        archs = [a if a.startswith("Eagle3") or a.endswith("Eagle3") else f"Eagle3{a}" for a in archs]
    return next((registry[a] for a in archs if a in registry), None)


def _auto_load(load: Load, ex: Export, params_prefix: str, name: str, source: str) -> None:
    """model_executor/models/utils.py AutoWeightsLoader.load_weights: a name maps to a parameter or raises ValueError
    ("There is no module or parameter named ..."), except unexpected `.bias` names (ignore_unexpected_suffixes) and
    the rotary caches (REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER), which it skips."""
    param, shard = stacked(name) if name.startswith(params_prefix) else (name, None)
    k = key(param, shard)
    if param.endswith("embed_tokens.weight"):
        return  # the drafter's own embedding (has_own_embed_tokens); not shared from the target then
    if k in load.expected:
        load.put(k, source)
    elif any(r in name for r in ROTARY):
        load.dropped.append((source, "rotary cache"))
    elif param.endswith(".bias"):
        if not ex.is_zero(source):  # a zero bias dropped is the bias-free layer vLLM builds: harmless
            load.dropped.append((source, "AutoWeightsLoader ignores an unexpected .bias, and this one is not zero"))
    else:
        load.errors.append(f"There is no module or parameter named {param!r} (AutoWeightsLoader)")


def _attention_biases(cfg: dict) -> tuple[bool, bool]:
    """models/llama.py LlamaDecoderLayer.__init__: attention_bias = config.attention_bias or config.bias; o_proj uses
    it; qkv uses config.qkv_bias when the key exists."""
    bias = bool(cfg.get("attention_bias", False) or cfg.get("bias", False))
    return bool(cfg.get("qkv_bias", bias)), bias


def load_eagle1(ex: Export) -> Load:
    """models/llama_eagle.py EagleLlamaForCausalLM.load_weights + LlamaModel.__init__/load_weights.

    fc: ReplicatedLinear(2h -> h, bias=False). Layer 0's input_layernorm is nn.Identity. embed_tokens and lm_head come
    from the target (v1/worker/gpu/spec_decode/eagle/utils.py load_eagle_model) unless the file carries them.
    Names: "model." + name unless it contains "lm_head"; the top-level class builds no lm_head, so one raises.
    """
    cfg, h = ex.config, ex.config["hidden_size"]
    qkv_bias, o_bias = _attention_biases(cfg)
    load = Load("vLLM EagleLlamaForCausalLM")
    load.expected["model.fc.weight"] = (h, 2 * h)
    for i in range(cfg["num_hidden_layers"]):
        load.expected |= llama_layer(f"model.layers.{i}", cfg, h, attn_bias=qkv_bias, o_bias=o_bias,
                                     input_norm=i > 0, hidden_norm=False)
    for name in ex.shapes:
        full = name if "lm_head" in name else f"model.{name}"
        if not full.startswith("model."):
            load.errors.append(f"There is no module or parameter named {full!r} in EagleLlamaForCausalLM")
            continue
        _auto_load(load, ex, "model.", full, name)
    return load


def load_eagle3(ex: Export, target_vocab: int) -> Load:
    """models/llama_eagle3.py Eagle3LlamaForCausalLM.__init__/load_weights + LlamaModel.__init__/load_weights.

    Config: draft_vocab_size (default vocab_size); eagle_config.use_aux_hidden_state (default True); fc input =
    (target_hidden_size or hidden_size) * (num_aux_hidden_states or len(eagle_config.eagle_aux_hidden_state_layer_ids)
    or 3); norm_before_fc / fc_norm add norms. draft_id_to_target_id is a parameter only when draft_vocab_size !=
    the target's vocab (else it is None, and a `d2t` tensor has nowhere to go: AutoWeightsLoader raises).
    Names: t2d skipped; d2t -> draft_id_to_target_id; else "model." + name unless it has "lm_head"; then
    midlayer. -> layers.0. and the q/k/v, gate/up fusion.
    """
    cfg, h = ex.config, ex.config["hidden_size"]
    eagle_config = cfg.get("eagle_config") or {}
    draft_vocab = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    use_aux = eagle_config.get("use_aux_hidden_state", True)
    num_aux = cfg.get("num_aux_hidden_states") or len(eagle_config.get("eagle_aux_hidden_state_layer_ids") or []) or 3
    target_h = cfg.get("target_hidden_size", h)
    o_bias = _attention_biases(cfg)[1]
    load = Load("vLLM Eagle3LlamaForCausalLM")
    if use_aux:
        load.expected["model.fc.weight"] = (h, target_h * num_aux)
    if eagle_config.get("norm_before_fc", cfg.get("norm_before_fc", False)):
        load.expected["model.input_norm.weight"] = (target_h * num_aux,)
    if cfg.get("fc_norm", False):
        load.expected |= {f"model.fc_norm.{i}.weight": (target_h,) for i in range(num_aux)}
    for i in range(cfg["num_hidden_layers"]):
        layer = llama_layer(f"model.layers.{i}", cfg, 2 * h if i == 0 else h,
                            attn_bias=bool(cfg.get("attention_bias", False)), o_bias=o_bias, input_norm=True,
                            hidden_norm=True)
        load.expected |= layer
    load.expected["model.norm.weight"] = (h,)
    load.expected["lm_head.weight"] = (draft_vocab, h)
    if draft_vocab != target_vocab:
        load.expected["draft_id_to_target_id"] = (draft_vocab,)
    for name in ex.shapes:
        if "t2d" in name:
            continue  # not needed: vLLM maps draft ids with d2t only
        if "mask_hidden" in name:
            load.dropped.append((name, "mask_hidden is read only with parallel drafting"))
            continue
        if "d2t" in name:
            full = name.replace("d2t", "draft_id_to_target_id")
            if full not in load.expected:
                load.errors.append(f"{name}: draft_vocab_size == the target's vocab ({target_vocab}), so "
                                   f"draft_id_to_target_id is None and AutoWeightsLoader finds no parameter for it")
            else:
                load.put(full, name)
            continue
        full = name if "lm_head" in name else f"model.{name}"
        full = full.replace("midlayer.", "layers.0.")
        if not use_aux and "fc." in full:
            load.dropped.append((name, "use_aux_hidden_state is false"))
            continue
        _auto_load(load, ex, "model.", full, name)
    return load


def aux_layers_read(cfg: dict, num_layers: int, runner: str) -> list[int]:
    """The HF hidden_states indices vLLM feeds the EAGLE-3 fc, in feed order.

    Which ids: runner "v1" = v1/worker/gpu_model_runner.py GPUModelRunner._get_eagle3_aux_layers_from_config
    (top-level eagle_aux_hidden_state_layer_ids, else eagle_config.eagle_aux_hidden_state_layer_ids); runner "v2"
    (Model Runner V2, the default on CUDA in 0.32/0.33: config/vllm.py VllmConfig.use_v2_model_runner) =
    v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config (top-level key, else dflash /
    dspark keys, else eagle_config.layer_ids). Neither found: interfaces.py SupportsEagle3
    .get_eagle3_default_aux_hidden_state_layers = (2, L//2, L-3).
    How: interfaces.py EagleModelMixin._set_aux_hidden_state_layers keeps sorted(set(ids)); _maybe_add_hidden_state
    (models/llama.py LlamaModel.forward) captures hidden_states + residual entering layer k (k = 0 before layer 0,
    k = L after the last layer, pre-norm), i.e. HF hidden_states[k] for k < L.
    """
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    eagle_config = cfg.get("eagle_config") or {}
    if not ids:
        ids = eagle_config.get("eagle_aux_hidden_state_layer_ids") if runner == "v1" else eagle_config.get("layer_ids")
    if not ids:
        ids = (2, num_layers // 2, num_layers - 3)
    return [k for k in sorted(set(ids)) if 0 <= k <= num_layers]


def aux_layer_problems(cfg: dict, trained: tuple[int, ...], num_layers: int) -> list[str]:
    out = []
    for runner in ("v1", "v2"):
        read = aux_layers_read(cfg, num_layers, runner)
        if read != list(trained):
            out.append(f"vLLM model runner {runner} feeds hidden_states{read} to a drafter trained on "
                       f"hidden_states{list(trained)}")
        elif num_layers in read:
            out.append(f"vLLM feeds layer {num_layers}'s pre-norm output where HF hidden_states[{num_layers}] "
                       f"(trained on) is normed")
    return out


def load_medusa(ex: Export, target_vocab: int) -> Load:
    """vLLM 0.32.0 models/medusa.py Medusa.__init__/load_weights, config via transformers_utils/configs/medusa.py
    MedusaConfig.from_pretrained (every key containing "num" and "heads" becomes num_heads, "num" and "layers"
    num_hidden_layers; defaults hidden_size 4096, vocab_size 32001, num_heads 5, num_hidden_layers 1;
    truncated_vocab_size defaults to vocab_size; config/speculative.py resets vocab_size to the target's).
    Blocks: nn.Linear(h, h, bias=medusa_fc_bias (default False)); original_lm_head -> one lm_head shared by all heads,
    else lm_heads.{i}. Names: strip "medusa_heads.", remap the reference "{h}.{l}.linear.*" / "{h}.{L}.weight"
    (_remap_old_checkpoint_key); unknown names are skipped silently.
    """
    raw = dict(ex.config)
    for k in list(raw):
        if "num" in k and "heads" in k:
            raw["num_heads"] = raw.pop(k)
        elif "num" in k and "layers" in k:
            raw["num_hidden_layers"] = raw.pop(k)
    h = raw.get("hidden_size", 4096)
    vocab = target_vocab
    truncated = raw.get("truncated_vocab_size") or vocab
    load = Load("vLLM 0.32 Medusa")
    for i in range(raw.get("num_heads", 5)):
        for j in range(raw.get("num_hidden_layers", 1)):
            load.expected[f"blocks.{i}.layers.{j}.weight"] = (h, h)
            if raw.get("medusa_fc_bias", False):
                load.expected[f"blocks.{i}.layers.{j}.bias"] = (h,)
        if not raw.get("original_lm_head", False):
            load.expected[f"lm_heads.{i}.weight"] = (vocab, h)
    if raw.get("original_lm_head", False):
        load.expected["lm_head.weight"] = (truncated, h)
    for name in ex.shapes:
        n = name.replace("medusa_heads.", "")
        parts = n.split(".")
        if len(parts) >= 3 and parts[0].isdigit() and parts[1].isdigit():
            rest = parts[2:]
            n = (f"blocks.{parts[0]}.layers.{parts[1]}." + ".".join(rest[rest.index("linear") + 1:])
                 if "linear" in rest else f"lm_heads.{parts[0]}." + ".".join(rest))
        if n == "token_map":
            continue
        if n in load.expected:
            load.put(n, name)
        elif raw.get("original_lm_head", False) and n == "lm_heads.0.weight":
            load.put("lm_head.weight", name)
        else:
            load.dropped.append((name, "not a parameter of Medusa (skipped silently)"))
    if truncated != vocab:
        load.errors.append(f"truncated_vocab_size {truncated} < vocab_size {vocab} needs a token_map tensor")
    return load


# -- tests -------------------------------------------------------------------------------------------------------------

def test_eagle1_architecture_resolves(exported):
    ex = Export.read(exported("eagle-tiny").path)
    assert resolve_draft_architecture(ex.config["architectures"], "eagle", REGISTRY) == "EagleLlamaForCausalLM", \
        f"vLLM cannot build a draft model from architectures={ex.config['architectures']}"


def test_eagle3_architecture_resolves(exported):
    ex = Export.read(exported("eagle3-tiny4").path)
    assert resolve_draft_architecture(ex.config["architectures"], "eagle3", REGISTRY) == "Eagle3LlamaForCausalLM"


def test_eagle1_weights_load(exported):
    w = exported("eagle-tiny")
    ex = Export.read(w.path)
    assert_conforms(load_eagle1(ex).problems(ex))


def test_eagle3_weights_load_reduced_vocab(exported):
    w = exported("eagle3-tiny4")
    ex = Export.read(w.path)
    assert_conforms(load_eagle3(ex, w.vocab_size).problems(ex))


def test_eagle3_weights_load_full_vocab(exported):
    w = exported("eagle3-tiny4-fullvocab")
    ex = Export.read(w.path)
    assert_conforms(load_eagle3(ex, w.vocab_size).problems(ex))


def test_eagle3_layer_ids_explicit(exported):
    w = exported("eagle3-tiny4")
    ex = Export.read(w.path)
    assert_conforms(aux_layer_problems(ex.config, w.aux_layer_ids, w.verifier_layers))


@pytest.mark.slow
def test_eagle3_default_verifier(exported):
    """Default ids [2, 15, 27] equal vLLM's own defaults, so both runners read them right, and the weights load."""
    w = exported("eagle3-smollm2")
    ex = Export.read(w.path)
    assert_conforms(aux_layer_problems(ex.config, w.aux_layer_ids, w.verifier_layers)
                    + load_eagle3(ex, w.vocab_size).problems(ex))


@pytest.mark.parametrize("name", ["medusa-tiny", "medusa-tiny-own-heads"])
def test_medusa_loads_in_032(exported, name):
    w = exported(name)
    ex = Export.read(w.path)
    assert resolve_draft_architecture(ex.config["architectures"], "medusa", REGISTRY_032) == "Medusa"
    assert_conforms(load_medusa(ex, w.vocab_size).problems(ex))


def test_medusa_not_in_033(exported):
    ex = Export.read(exported("medusa-tiny").path)
    assert resolve_draft_architecture(ex.config["architectures"], "medusa", REGISTRY) is None


# -- the checks can fail: the same simulations on exports broken on purpose --------------------------------------------

def test_checks_catch_broken_exports(exported, tiny4):
    w = exported("eagle3-tiny4")
    ex = Export.read(w.path)
    missing = Export(ex.path, ex.config, {k: v for k, v in ex.shapes.items() if k != "norm.weight"}, ex.dtypes)
    problems = load_eagle3(missing, w.vocab_size).problems(missing)
    assert any("model.norm.weight" in p and "uninitialised" in p for p in problems)
    renamed = Export(ex.path, ex.config, {k.replace("midlayer.", "layer."): v for k, v in ex.shapes.items()}, ex.dtypes)
    assert any("raises" in p for p in load_eagle3(renamed, w.vocab_size).problems(renamed))
    wrong = Export(ex.path, ex.config, {**ex.shapes, "fc.weight": (64, 128)}, ex.dtypes)
    assert any("shape check fails" in p for p in load_eagle3(wrong, w.vocab_size).problems(wrong))
    top = {**ex.config, "eagle_aux_hidden_state_layer_ids": list(w.aux_layer_ids)}
    assert aux_layer_problems(top, w.aux_layer_ids, w.verifier_layers) == []
    assert aux_layer_problems({**top, "eagle_aux_hidden_state_layer_ids": [3, 1, 2]}, (3, 1, 2), 4)  # sorted
    assert aux_layer_problems({**top, "eagle_aux_hidden_state_layer_ids": [1, 1, 0]}, (1, 1, 0), 4)  # de-duplicated
    assert aux_layer_problems({**top, "eagle_aux_hidden_state_layer_ids": [1, 2, 4]}, (1, 2, 4), 4)  # pre-norm L
    e1 = Export.read(exported("eagle-tiny").path)
    bias = "layers.0.mlp.down_proj.bias"  # not in the file, so not known to be zero: dropping it changes the drafter
    biased = Export(e1.path, e1.config, {**e1.shapes, bias: (e1.config["hidden_size"],)}, e1.dtypes)
    assert any(bias in p and "drops" in p for p in load_eagle1(biased).problems(biased))
    fixed = {**ex.config, "architectures": ["LlamaForCausalLMEagle", "EagleLlamaForCausalLM"]}
    assert resolve_draft_architecture(fixed["architectures"], "eagle", REGISTRY) == "EagleLlamaForCausalLM"
    assert resolve_draft_architecture(["LlamaForCausalLMEagle"], "eagle", REGISTRY) is None
