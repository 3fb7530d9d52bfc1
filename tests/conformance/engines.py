"""Shared pieces of the loader conformance tests: reading an export at the file level, and judging a simulated load.

Each `test_<engine>.py` re-implements, in plain Python, how that engine's published loader turns an export directory
(config.json + model.safetensors) into the parameters it builds: which names it maps each tensor to, which it drops,
which shapes its weight loaders assert, which config keys it reads. `Load` collects what such a simulation found and
`Load.problems()` lists every way the drafter would not run as trained. docs/engine_loaders.md cites the source read.

Project convention for EAGLE-3 feature layers: id k is the INPUT of verifier layer k, i.e. HF `hidden_states[k]`
(0 = embeddings; k = L would be the final-normed output in HF).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import safe_open

from models.exports.speculators import flatten, is_speculators

Shape = tuple[int, ...]


@dataclass
class Export:
    """An export directory read the way the engines read it: the raw config dict and the tensor shapes by name."""

    path: Path
    config: dict[str, Any]
    shapes: dict[str, Shape]
    dtypes: dict[str, str]

    @classmethod
    def read(cls, path: str | Path, weights: str = "model.safetensors") -> Export:
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        if is_speculators(config):
            # An EAGLE-3 export in the speculators format, read as the flat EAGLE-3 layout: what `convert.py
            # to-reference` writes for SGLang and the EAGLE repository, and the fields vLLM's speculators reader hands
            # its EAGLE-3 model. The real vLLM reads the format itself in tests/test_engine_vllm.py.
            config = flatten(config, str(path / "config.json"))
        shapes, dtypes = {}, {}
        with safe_open(str(path / weights), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                shapes[name] = tuple(sl.get_shape())
                dtypes[name] = sl.get_dtype()
        return cls(path, config, shapes, dtypes)

    def is_zero(self, name: str, weights: str = "model.safetensors") -> bool:
        """Whether tensor `name` is all zeros (an engine that drops a zero bias computes the same thing)."""
        with safe_open(str(self.path / weights), framework="pt") as f:
            return name in f.keys() and not bool(f.get_tensor(name).any())


@dataclass
class Load:
    """What one engine's loader would do with one export.

    expected: every parameter (or `param[shard]` for fused q/k/v, gate/up) the engine builds and needs from the file,
        with the shape its weight loader asserts. Parameters the engine takes from the verifier (shared embedding,
        shared lm_head) are not listed.
    got: expected key -> the file's tensor name that lands there.
    dropped: file tensors the engine skips (silently or with a log line), with why.
    errors: what the engine would raise on.
    """

    engine: str
    expected: dict[str, Shape] = field(default_factory=dict)
    got: dict[str, str] = field(default_factory=dict)
    dropped: list[tuple[str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def put(self, key: str, source: str) -> None:
        if key in self.got:
            self.errors.append(f"{source} and {self.got[key]} both load into {key}")
        self.got[key] = source

    def problems(self, export: Export) -> list[str]:
        out = [f"{self.engine} raises: {e}" for e in self.errors]
        out += [f"{self.engine} drops {name}: {why}" for name, why in self.dropped]
        for key, shape in self.expected.items():
            if key not in self.got:
                out.append(f"{self.engine} leaves {key} {shape} uninitialised: the export has no tensor for it")
            elif export.shapes[self.got[key]] != shape:
                out.append(f"{self.engine} shape check fails: {self.got[key]} is {export.shapes[self.got[key]]}, "
                           f"{key} is {shape}")
        out += [f"{self.engine} loads {src} into {key}, a parameter it does not build"
                for key, src in self.got.items() if key not in self.expected]
        return out


def assert_conforms(problems: list[str]) -> None:
    assert not problems, "export does not load as trained:\n  " + "\n  ".join(problems)


def stacked(name: str) -> tuple[str, str | int | None]:
    """The fused-parameter mapping vLLM and SGLang share (`stacked_params_mapping` / `hf_to_vllm_mapper`):
    q/k/v_proj -> qkv_proj shards "q"/"k"/"v", gate/up_proj -> gate_up_proj shards 0/1."""
    for part, fused, shard in ((".q_proj", ".qkv_proj", "q"), (".k_proj", ".qkv_proj", "k"),
                               (".v_proj", ".qkv_proj", "v"), (".gate_proj", ".gate_up_proj", 0),
                               (".up_proj", ".gate_up_proj", 1)):
        if part in name:
            return name.replace(part, fused), shard
    return name, None


def key(param: str, shard: str | int | None) -> str:
    return param if shard is None else f"{param}[{shard}]"


def llama_layer(prefix: str, cfg: dict[str, Any], in_dim: int, *, attn_bias: bool, o_bias: bool,
                input_norm: bool, hidden_norm: bool) -> dict[str, Shape]:
    """The fused parameters of one vLLM / SGLang Llama decoder layer, keyed like `Load.expected`."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or h // nh
    qkv = f"{prefix}.self_attn.qkv_proj"
    out = {f"{qkv}.weight[q]": (nh * hd, in_dim), f"{qkv}.weight[k]": (nkv * hd, in_dim),
           f"{qkv}.weight[v]": (nkv * hd, in_dim), f"{prefix}.self_attn.o_proj.weight": (h, nh * hd),
           f"{prefix}.mlp.gate_up_proj.weight[0]": (inter, h), f"{prefix}.mlp.gate_up_proj.weight[1]": (inter, h),
           f"{prefix}.mlp.down_proj.weight": (h, inter), f"{prefix}.post_attention_layernorm.weight": (h,)}
    if attn_bias:
        out |= {f"{qkv}.bias[q]": (nh * hd,), f"{qkv}.bias[k]": (nkv * hd,), f"{qkv}.bias[v]": (nkv * hd,)}
    if o_bias:
        out[f"{prefix}.self_attn.o_proj.bias"] = (h,)
    if input_norm:
        out[f"{prefix}.input_layernorm.weight"] = (h,)
    if hidden_norm:
        out[f"{prefix}.hidden_norm.weight"] = (h,)
    return out


def config_dtype(cfg: dict[str, Any]) -> str | None:
    """The dtype a config declares, as transformers >= 4.56 / 5 and SGLang read it (`dtype` before `torch_dtype`)."""
    return cfg.get("dtype") or cfg.get("torch_dtype")
