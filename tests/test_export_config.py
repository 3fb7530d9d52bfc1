"""Each family's export config is a typed, validated class (models/formats/config.py): one description per field, the
config.json written by its `to_config` and read by its `from_config`, and a bad field (a wrong type, a count below its
bound, a missing required key) refused naming the file, the key and the value seen."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from models.exports.io import load_export, save_export
from models.families import FAMILIES
from models.formats.config import ExportConfig
from models.formats.dflash import DFlashConfig, DFlashSpeculators, DFlashTargets
from models.formats.eagle import Eagle3Config, EagleConfig, SGLangAuxLayers
from models.formats.medusa import MedusaConfig
from models.formats.peagle import PEagleConfig
from models.medusa import MedusaHeads
from models.verifiers.tiny import build_tiny
from runtime.errors import UserError

CLASSES = [MedusaConfig, EagleConfig, Eagle3Config, SGLangAuxLayers, PEagleConfig, DFlashConfig, DFlashTargets,
           DFlashSpeculators]


@pytest.fixture(scope="module")
def tiny4(cache_dir):
    return build_tiny(cache_dir=cache_dir, dtype="float32", device="cpu", num_layers=4)


def _nets(verifier) -> dict[str, torch.nn.Module]:
    """family -> a small network of it."""
    from models.dflash import build_dflash
    from models.eagle import build_eagle
    from models.peagle import build_peagle

    torch.manual_seed(0)
    return {"medusa": MedusaHeads(verifier.config.hidden_size, verifier.vocab_size, num_heads=2),
            "eagle": build_eagle("eagle", verifier),
            "eagle3": build_eagle("eagle3", verifier, draft_vocab_size=64, aux_layer_ids=[1, 2, 3]),
            "peagle": build_peagle(verifier, 16, 3, draft_vocab_size=64, aux_layer_ids=[0, 1]),
            "dflash": build_dflash(verifier, 16, block_size=4, aux_layer_ids=[0, 1])}


@pytest.fixture(scope="module")
def nets(tiny4):
    return _nets(tiny4)


@pytest.fixture(scope="module")
def exports(tiny4, nets, tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    return {name: save_export(net, tiny4, root / name) for name, net in nets.items()}


def _layer(key: str, value):
    return lambda c: c["transformer_layer_config"].__setitem__(key, value)


def _edited(export: Path, tmp: Path, edit) -> Path:
    """A copy of `export` whose config.json went through `edit`."""
    copy = tmp / export.name
    copy.mkdir()
    for f in export.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((copy / "config.json").read_text())
    edit(cfg)
    (copy / "config.json").write_text(json.dumps(cfg))
    return copy


def _set(key: str, value):
    return lambda c: c.__setitem__(key, value)


BAD = [
    ("medusa", _set("num_heads", -1), "num_heads=-1", ">= 1"),
    ("medusa", _set("num_heads", "2"), "num_heads='2'", "whole number"),
    ("medusa", _set("num_heads", True), "num_heads=True", "whole number"),
    ("medusa", _set("num_hidden_layers", 0), "num_hidden_layers=0", ">= 1"),
    ("medusa", _set("hidden_size", 64.0), "hidden_size=64.0", "whole number"),
    ("medusa", lambda c: c.pop("hidden_size"), "hidden_size is missing", "whole number"),
    ("medusa", _set("original_lm_head", "yes"), "original_lm_head='yes'", "true or false"),
    ("medusa", _set("medusa_fc_bias", False), "medusa_fc_bias=False", "one of [True]"),
    ("eagle", _set("verifier_num_hidden_layers", 0), "verifier_num_hidden_layers=0", ">= 1"),
    ("eagle", _set("eagle_kind", 3), "eagle_kind=3", "a string"),
    ("eagle3", _set("draft_vocab_size", -5), "draft_vocab_size=-5", ">= 1"),
    ("eagle3", _set("draft_vocab_size", "64"), "draft_vocab_size='64'", "whole number"),
    ("eagle3", _set("eagle_aux_hidden_state_layer_ids", ["1", 2]), "eagle_aux_hidden_state_layer_ids=['1', 2]",
     "list of whole numbers"),
    ("eagle3", _set("eagle_aux_hidden_state_layer_ids", [-1, 2]), "eagle_aux_hidden_state_layer_ids=[-1, 2] holds -1",
     ">= 0"),
    ("eagle3", _set("fc_norm", "yes"), "fc_norm='yes'", "true or false"),
    ("eagle3", _set("verifier_num_hidden_layers", -4), "verifier_num_hidden_layers=-4", ">= 1"),
    ("peagle", _set("mask_token_id", -1), "mask_token_id=-1", ">= 0"),
    ("peagle", lambda c: c.pop("mask_token_id"), "mask_token_id is missing", "whole number"),
    ("peagle", _set("parallel_tokens", 0), "parallel_tokens=0", ">= 1"),
    ("peagle", _set("parallel_tokens", 2.5), "parallel_tokens=2.5", "whole number"),
    ("dflash", _set("mask_token_id", -1), "mask_token_id=-1", ">= 0"),
    ("dflash", _set("mask_token_id", 1.5), "mask_token_id=1.5", "whole number"),
    ("dflash", _set("aux_hidden_state_layer_ids", ["1", 2]), "aux_hidden_state_layer_ids=['1', 2]",
     "list of whole numbers"),
    ("dflash", _set("aux_hidden_state_layer_ids", [-2, 1]), "aux_hidden_state_layer_ids=[-2, 1] holds -2", ">= 0"),
    ("dflash", _layer("num_hidden_layers", 0), "num_hidden_layers=0", ">= 1"),
    ("dflash", _layer("num_hidden_layers", "1"), "num_hidden_layers='1'", "whole number"),
    ("dflash", _set("block_size", "4"), "block_size='4'", "whole number"),
]


@pytest.mark.parametrize("family,edit,seen,fix", BAD, ids=[f"{b[0]}:{b[2]}" for b in BAD])
def test_a_bad_field_is_refused_naming_the_file_the_key_and_the_value(exports, tiny4, tmp_path, family, edit, seen,
                                                                      fix):
    bad = _edited(exports[family], tmp_path, edit)
    with pytest.raises(UserError, match=re.escape(seen)) as info:
        load_export(bad, tiny4)
    assert str(bad / "config.json") in str(info.value) and fix in str(info.value)


@pytest.mark.parametrize("family,cls", [("medusa", MedusaConfig), ("eagle", EagleConfig), ("eagle3", Eagle3Config),
                                        ("peagle", PEagleConfig), ("dflash", DFlashConfig)])
def test_the_written_config_is_the_class_round_trip(nets, exports, tiny4, family, cls):
    """What a family's layout writes holds its class's `to_config`, and reading it back gives the same values."""
    layout, _ = FAMILIES[family].export.write(nets[family], tiny4)
    read = cls.from_config(layout, "config.json")
    assert read.to_config() == {k: layout[k] for k in read.to_config()}, family
    assert type(load_export(exports[family], tiny4).net) is FAMILIES[family].network  # and the export loads


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_field_is_described(cls):
    assert issubclass(cls, ExportConfig) and dataclasses.is_dataclass(cls)
    for f in dataclasses.fields(cls):
        assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no description"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Nested(ExportConfig):
    ids: list[int] = dataclasses.field(metadata={"help": "layer ids", "min": 0})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Demo(ExportConfig):
    count: int = dataclasses.field(metadata={"help": "a count", "min": 1, "max": 8})
    rate: float = dataclasses.field(default=0.5, metadata={"help": "a rate", "min": 0.0})
    inner: Nested = dataclasses.field(metadata={"help": "the nested part"})
    note: str | None = dataclasses.field(default=None, metadata={"help": "a note"})


def test_the_checks_themselves():
    """A negative control on the class machinery alone: each kind of bad value is refused, a good one kept."""

    good = {"count": 3, "rate": 1, "inner": {"ids": [0, 2]}, "note": None, "other": "kept out"}
    assert Demo.from_config(good, "f.json").to_config() == {"count": 3, "rate": 1, "inner": {"ids": [0, 2]},
                                                           "note": None}
    for config, message in [({"inner": {"ids": []}}, "count is missing"),
                            ({"count": 9, "inner": {"ids": []}}, "count=9: give >= 1 and <= 8 (a count)"),
                            ({"count": 2, "rate": "x", "inner": {"ids": []}}, "rate='x'"),
                            ({"count": 2, "inner": {"ids": [0, -1]}}, "inner.ids=[0, -1] holds -1"),
                            ({"count": 2, "inner": [0]}, "inner=[0]"),
                            ({"count": 2, "inner": {"ids": ["0"]}}, "inner.ids=['0']")]:
        with pytest.raises(UserError, match=re.escape(message)):
            Demo.from_config(config, "f.json")


# -- the config against its weights, on every read and at save (issue 64) ----------------------------------------------

def _layer_key(key: str, value):
    return lambda c: (c["transformer_layer_config"] if "transformer_layer_config" in c else c).__setitem__(key, value)


AGAINST_WEIGHTS = [
    ("medusa", _set("num_heads", 3), r"num_heads=3 disagrees with the weights: model.safetensors holds blocks.\{h\}.\* "
                                     r"\(2 heads\)"),
    ("medusa", _set("num_hidden_layers", 2), r"num_hidden_layers=2 disagrees .* blocks.0.layers.\{l\}.\* \(1 layers "
                                             r"per head\)"),
    ("eagle", _set("num_hidden_layers", 2), r"num_hidden_layers=2 disagrees .* layers.0.\* \(1 layer\)"),
    ("eagle", _set("intermediate_size", 128), r"intermediate_size=128 disagrees .* layers.0.mlp.gate_proj.weight of "
                                              r"shape \[256, 64\]"),
    ("eagle3", _layer_key("num_hidden_layers", 2), r"transformer_layer_config.num_hidden_layers=2 disagrees .* "
                                                   r"midlayer.\* \(1 layer\)"),
    ("eagle3", _set("draft_vocab_size", 32), r"draft_vocab_size=32 disagrees .* lm_head.weight of shape \[64, 64\]"),
    ("eagle3", _set("eagle_aux_hidden_state_layer_ids", [1, 2]), r"eagle_aux_hidden_state_layer_ids=\[1, 2\] "
                                                                 r"disagrees .* fc.weight of shape \[64, 192\]"),
    ("peagle", _layer_key("intermediate_size", 512), r"transformer_layer_config.intermediate_size=512 disagrees"),
    ("peagle", _set("draft_vocab_size", 128), r"draft_vocab_size=128 disagrees .* lm_head.weight of shape \[64, 64\]"),
    ("dflash", _layer_key("num_hidden_layers", 3), r"transformer_layer_config.num_hidden_layers=3 disagrees .* "
                                                   r"layers.0.\* \(1 layer\)"),
    ("dflash", _layer_key("hidden_size", 32), r"transformer_layer_config.hidden_size=32 disagrees"),
    ("dflash", _set("aux_hidden_state_layer_ids", [1, 2, 3]), r"aux_hidden_state_layer_ids=\[1, 2, 3\] disagrees .* "
                                                              r"fc.weight of shape \[64, 128\]"),
]


@pytest.mark.parametrize("family,edit,said", AGAINST_WEIGHTS, ids=[f"{a[0]}:{a[2][:40]}" for a in AGAINST_WEIGHTS])
def test_a_config_that_disagrees_with_its_weights_is_refused_naming_field_and_tensor(exports, tmp_path, family, edit,
                                                                                      said):
    """A config.json edited against its weights (a layer count vLLM would build, a draft vocabulary the head does
    not have) once loaded, or was blamed on the verifier: refused from the safetensors header when the export is
    read, before any verifier loads, naming the field, the tensor and its shape."""
    from models.exports.io import read_info

    bad = _edited(exports[family], tmp_path, edit)
    with pytest.raises(UserError, match=said) as info:
        read_info(bad)
    assert str(bad / "config.json") in str(info.value) and "restore this export's own config.json" in str(info.value)


def test_dspark_layers_disagreeing_with_the_weights_are_refused(tiny4, tmp_path):
    from models.dspark import build_dspark
    from models.exports.io import read_info

    path = save_export(build_dspark(tiny4, 16, block_size=4, num_layers=2), tiny4, tmp_path / "ds")
    (tmp_path / "edited").mkdir()
    bad = _edited(path, tmp_path / "edited", _layer_key("num_hidden_layers", 1))
    with pytest.raises(UserError, match=r"num_hidden_layers=1 disagrees .* \{layers.0, layers.1\}.\* \(2 layers\)"):
        read_info(bad)


@pytest.mark.parametrize("name,edit,said", [
    ("eagle3-smollm2", _layer_key("num_hidden_layers", 2),
     r"transformer_layer_config.num_hidden_layers=2 disagrees with the weights: model.safetensors holds midlayer.\* "
     r"\(1 layer\)"),
    ("eagle3-smollm2", _set("draft_vocab_size", 2048),
     r"draft_vocab_size=2048 disagrees with the weights: model.safetensors holds lm_head.weight of shape "
     r"\[4096, 576\]"),
])
def test_a_shipped_export_copied_without_its_manifest_and_edited_is_refused(tmp_path, name, edit, said):
    """The issue's probes: a copy of pretrained/<name> without specdraft/ (no manifest) and one field edited."""
    import shutil

    from helpers import ROOT
    from models.exports.io import read_info

    shipped = ROOT / "pretrained" / name
    if not (shipped / "model.safetensors").is_file():
        pytest.skip(f"no {shipped}")
    copy = tmp_path / name
    shutil.copytree(shipped, copy, ignore=shutil.ignore_patterns("specdraft"))
    read_info(copy)  # as copied: reads
    cfg = json.loads((copy / "config.json").read_text())
    edit(cfg)
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=said) as info:
        read_info(copy)
    assert "does not fit the verifier" not in str(info.value)


def test_an_eagle3_export_of_two_feature_layers_tells_vllm_how_wide_fc_is(tiny, tmp_path):
    """EAGLE-3 on a 2-layer verifier with model.aux_layer_ids=[0,1]: vLLM sizes fc from transformer_layer_config's
    num_aux_hidden_states, else 3 (llama_eagle3.py), so the export once could not be served (fc 128 wide against
    192). Now the export records it, and the check of what vLLM reads refuses a config without it."""
    from models.eagle import build_eagle
    from models.exports.io import header_shapes
    from models.formats.eagle import eagle3_engine_disagreements

    path = save_export(build_eagle("eagle3", tiny, draft_vocab_size=64, aux_layer_ids=[0, 1]), tiny, tmp_path / "e3")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["transformer_layer_config"]["num_aux_hidden_states"] == 2
    shapes = header_shapes(path / "model.safetensors")
    assert shapes["fc.weight"] == [64, 128] and eagle3_engine_disagreements(cfg, shapes) == []
    del cfg["transformer_layer_config"]["num_aux_hidden_states"]  # what the writer wrote before
    (d,) = eagle3_engine_disagreements(cfg, shapes)
    assert (d.field, d.tensor, d.shape) == ("transformer_layer_config.num_aux_hidden_states", "fc.weight", [64, 128])
    assert "vLLM sizes fc for 3 hidden states x 64 = 192 columns" in d.expected
    assert load_export(path, tiny).net.aux_layer_ids == [0, 1]  # and it reads back
