"""Exports made compact for the repository (models/exports/shipped.py) and the drafters that ship in pretrained/:
compact -> loaded as it is -> decodes exactly; engine-ready folders written back bit for bit; refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_families_registry import EXTRA as REGISTRY_EXTRA

from helpers import ROOT, compose_train
from models.exports.shipped import COMPACT_KEY, MANIFEST, check_manifest, engine_ready, file_manifest, ship
from models.families import EXPORT_FAMILIES
from runtime.errors import UserError, VerifierMismatchError

VARIED = ["verifier=tiny", "verifier.seed=1", "+verifier.layer_std=0.3"]
TRAIN = [*VARIED, "data.limit=8", "data.max_new_tokens=12", "data.gen_batch_size=8", "data.batch_size=4",
         "data.val_fraction=0.25", "logger=csv", "trainer.max_steps=2", "trainer.max_epochs=1"]
# Each family's tiny recipe is the registry test's (one list: a family added there is trained here too), Medusa with
# the shared head whose tensors a compact export leaves out.
EXTRA = {**REGISTRY_EXTRA, "medusa": ["model.share_lm_head=true"]}
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
PRETRAINED = ROOT / "pretrained"


@pytest.fixture(scope="module")
def varied():
    from helpers import varied_llama

    return varied_llama(seed=1)


@pytest.fixture(scope="module")
def exports(train_script, tmp_path_factory):
    out = {}
    for name in EXPORT_FAMILIES:
        cfg = compose_train([*TRAIN, f"model={name}", *EXTRA.get(name, [])], tmp_path_factory.mktemp(name))
        out[name] = Path(train_script.run(cfg))
    return out


def _decode_exactly(verifier, export) -> None:
    from eval.drafters.build import build_drafter, family_config
    from eval.engine.decode import greedy_decode, speculative_decode
    from eval.engine.tree import AutoTree
    from models.exports.io import read_info

    info = read_info(export)
    drafter = build_drafter(info.kind,
                            family_config(info.kind), verifier, info, AutoTree(size=6))
    ids = torch.tensor([verifier.tokenizer(PROMPT)["input_ids"]])
    plain = greedy_decode(verifier, ids, 16, [])
    spec = speculative_decode(verifier, drafter, ids, 16, [])
    assert torch.equal(spec.tokens, plain.tokens)
    assert spec.num_forwards <= plain.num_forwards


@pytest.mark.parametrize("name", EXPORT_FAMILIES)
def test_a_compact_export_loads_as_it_is_and_decodes_exactly(name, exports, varied, tmp_path, one_thread):
    from models.exports.io import load_export

    full = exports[name]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: test\n")
    compact = ship(full, tmp_path / "compact", varied, {"recipe.yaml": recipe, "training.json": None})
    config = json.loads((compact / "config.json").read_text())
    stored = load_file(str(compact / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in stored.values() if t.is_floating_point())
    assert (compact / "specdraft" / "recipe.yaml").read_text() == "model: test\n"
    if name == "medusa":  # the shared head is the verifier's: not stored
        assert config[COMPACT_KEY]["dropped"] == {"lm_head.weight": "verifier.lm_head"}
        assert "lm_head.weight" not in stored
    a, b = load_export(full, varied), load_export(compact, varied)
    for (k, x), (k2, y) in zip(a.net.state_dict().items(), b.net.state_dict().items()):
        assert k == k2 and x.dtype == y.dtype
        assert torch.equal(x.to(torch.bfloat16).to(x.dtype), y) if x.is_floating_point() else torch.equal(x, y), k
    _decode_exactly(varied, compact)


@pytest.mark.parametrize("name", EXPORT_FAMILIES)
def test_engine_ready_writes_the_full_export_back(name, exports, varied, tmp_path):
    full = exports[name]
    compact = ship(full, tmp_path / "compact", varied)
    served = engine_ready(compact, tmp_path / "served", varied)
    a, b = load_file(str(full / "model.safetensors")), load_file(str(served / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        expected = a[k].to(torch.bfloat16).to(a[k].dtype) if a[k].is_floating_point() else a[k]
        assert torch.equal(b[k], expected) or torch.equal(b[k], a[k]), k
    assert json.loads((served / "config.json").read_text()) == json.loads((full / "config.json").read_text())
    assert sorted(p.name for p in served.iterdir()) == sorted(p.name for p in full.iterdir())


def test_a_damaged_or_foreign_compact_export_is_refused(exports, varied, tiny, tmp_path):
    from models.exports.io import load_export

    compact = ship(exports["medusa"], tmp_path / "compact", varied)
    with pytest.raises(VerifierMismatchError):
        load_export(compact, tiny)
    with pytest.raises(VerifierMismatchError):
        engine_ready(compact, tmp_path / "served", tiny)
    with pytest.raises(UserError, match="already compact"):
        ship(compact, tmp_path / "again", varied)
    (compact / MANIFEST).unlink()  # what the reader itself refuses, in a folder without a manifest
    tensors = load_file(str(compact / "model.safetensors"))
    tensors.pop("blocks.0.layers.0.weight")
    save_file(tensors, str(compact / "model.safetensors"))
    with pytest.raises(UserError, match=r"lacks \['blocks.0.layers.0.weight'\].*damaged"):
        load_export(compact, varied)
    config = json.loads((compact / "config.json").read_text())
    config[COMPACT_KEY]["dropped"]["lm_head.weight"] = "verifier.embed"
    (compact / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="does not know"):
        load_export(compact, varied)


def test_a_shipped_file_that_differs_from_its_manifest_is_refused(exports, varied, tmp_path):
    """Issue 54: one flipped byte in a shipped model.safetensors loaded silently with a changed weight. Now the
    manifest (size and sha256 per file) is checked on load and by engine_ready."""
    from models.exports.io import load_export, read_info

    compact = ship(exports["eagle3"], tmp_path / "compact", varied)
    good = load_export(compact, varied).net.state_dict()
    weights = compact / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-2] ^= 0x40  # inside the last tensor's bytes: still a valid file
    weights.write_bytes(bytes(data))
    # read_info: python -m eval's first read of an export, before the verifier loads
    for read in (lambda: read_info(compact), lambda: load_export(compact, varied),
                 lambda: engine_ready(compact, tmp_path / "served", varied)):
        with pytest.raises(UserError, match=r"compact/model.safetensors: sha256 .* but .*manifest.json records .*"
                                            r"git checkout -- .*compact.*ship"):
            read()
    assert not (tmp_path / "served").exists()
    manifest = (compact / MANIFEST).read_bytes()
    (compact / MANIFEST).unlink()  # the negative control: without the check the damage loads silently
    bad = load_export(compact, varied).net.state_dict()
    assert any(not torch.equal(good[k], bad[k]) for k in good)
    (compact / MANIFEST).write_bytes(manifest)
    weights.write_bytes(bytes(data[:-1]))  # truncated
    with pytest.raises(UserError, match=r"model.safetensors has \d+ bytes but .*manifest.json records \d+"):
        load_export(compact, varied)
    weights.unlink()
    with pytest.raises(UserError, match=r"model.safetensors is missing but .*manifest.json lists it"):
        load_export(compact, varied)


def test_engine_ready_and_ship_keep_a_folder_that_is_not_the_same_kind_of_export(exports, varied, tmp_path):
    """Issue 54: engine-ready and ship replaced their output folder whole, whatever it held. Now only an export of
    the same family and layout is replaced; anything else is refused unless force=True."""
    compact = ship(exports["medusa"], tmp_path / "compact", varied)
    other = ship(exports["eagle3"], tmp_path / "other", varied)
    before = {p.name: p.read_bytes() for p in other.iterdir() if p.is_file()}
    for write in (lambda: engine_ready(compact, other, varied), lambda: ship(exports["medusa"], other, varied),
                  lambda: engine_ready(compact, compact, varied)):  # the shipped folder itself: a full export
        with pytest.raises(UserError, match=r"holds an? .*export; writing an? .* there would replace the whole "
                                            r"folder and delete it.*--force"):
            write()
    assert {p.name: p.read_bytes() for p in other.iterdir() if p.is_file()} == before
    assert check_manifest(compact) is None
    served = engine_ready(compact, tmp_path / "served", varied)
    assert engine_ready(compact, served, varied) == served  # the same kind of export: replaced
    assert ship(exports["medusa"], compact, varied) == compact
    assert engine_ready(compact, other, varied, force=True) == other
    assert json.loads((other / "config.json").read_text())["model_type"] == "medusa"


def test_the_folders_in_pretrained_match_their_manifests():
    for folder in _shipped():
        check_manifest(folder)


def _shipped() -> list[Path]:
    return sorted(p for p in PRETRAINED.iterdir() if (p / "config.json").is_file()) if PRETRAINED.is_dir() else []


@pytest.mark.slow
@pytest.mark.parametrize("export", _shipped() or [pytest.param(None, marks=pytest.mark.skip(
    reason="no drafter in pretrained/ yet"))], ids=lambda p: p.name if p else "none")
def test_every_shipped_drafter_is_its_embedded_verifiers_and_decodes_exactly(export, cache_dir, one_thread, tmp_path):
    """Each folder of pretrained/: compact, made for one of the embedded verifiers (its `verifier` entry names the
    loader, its fingerprint is that verifier's: load_export refuses another), with the recipe, training figures and
    eval report it ships with, and speculative decoding through it equal to plain greedy decoding token for token.
    Its engine-ready folder names the verifier vLLM loads where this machine keeps it (the tests' cache), not where
    the shipping machine did."""
    from models.exports.io import export_verifier, load_export
    from models.verifiers.load import load_verifier

    config = json.loads((export / "config.json").read_text())
    assert config.get(COMPACT_KEY) and sum(f.stat().st_size for f in export.rglob("*") if f.is_file()) <= 32 * 2**20
    source = export_verifier(config)
    assert source is not None and source["loader"] in ("smollm2", "gemma3"), source
    verifier = load_verifier(source, "float32", "cpu", cache_dir)
    # compact: the drafter's own tensors only, in bf16; nothing as wide as the verifier's vocabulary (its embedding
    # and head are put back from the verifier, never stored)
    stored = load_file(str(export / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in stored.values() if t.is_floating_point())
    assert not [k for k, t in stored.items() if t.is_floating_point() and verifier.vocab_size in t.shape], export.name
    assert config["verifier_fingerprint"] == verifier.fingerprint
    load_export(export, verifier)
    named = config.get("speculators_config", {}).get("verifier")
    if named:  # a speculators-format export: vLLM serves it as the model itself, loading the verifier it names
        # (the tests' cache is not the shipping machine's, so this fails when engine-ready keeps the shipped path)
        served = json.loads((engine_ready(export, tmp_path / "served", verifier) / "config.json").read_text())
        assert served["speculators_config"]["verifier"]["name_or_path"] == str(verifier.checkpoint)
        served["speculators_config"]["verifier"]["name_or_path"] = named["name_or_path"]
        assert served == {k: v for k, v in config.items() if k != COMPACT_KEY}  # nothing else changed
    manifest = json.loads((export / "specdraft" / "manifest.json").read_text())
    assert manifest == file_manifest(export), f"{export.name} differs from its specdraft/manifest.json"
    for name in ("recipe.yaml", "training.json", "eval_report.json"):
        assert (export / "specdraft" / name).is_file(), f"{export.name} ships without specdraft/{name}"
    _decode_exactly(verifier, export)


@pytest.mark.slow
@pytest.mark.parametrize("export", _shipped()[:1] or [pytest.param(None, marks=pytest.mark.skip(
    reason="no drafter in pretrained/ yet"))], ids=lambda p: p.name if p else "none")
def test_python_m_eval_runs_a_shipped_drafter_as_it_is(export, tmp_path):
    """The quick start: `python -m eval checkpoint=pretrained/<name>` from the clone, nothing trained or built,
    decodes through the compact export (bf16 where the CPU has it), combined with prompt lookup and alone, and
    both match plain greedy decoding."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "eval", f"checkpoint={export.relative_to(ROOT)}", "num_prompts=2",
                           "max_new_tokens=32", "tree.size=6", "threads=1", "wandb.mode=disabled", "warmup=false",
                           f"output_dir={tmp_path / 'out'}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    alone = report["drafter_alone"]
    assert report["method"].startswith("hybrid/") and report["num_prompts"] == 2
    assert report["greedy_match"] == 1.0 and alone["greedy_match"] == 1.0
    print(f"{export.name}: tau {report['tau']} (alone {alone['tau']})")
    # measured 1.35 (2 x 32 tokens, tree.size=6); a fixed budget: under tree.size=auto the plan follows the timing
    assert alone["tau"] > 1.15, "the shipped drafter's weights draft nothing the verifier accepts"
