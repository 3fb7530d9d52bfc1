"""Adding a family is its modules, two YAMLs and one registry entry: a family defined only in the tests
(tests/toy_family: network and export layout, training module, drafter, conf/model/toy.yaml, conf/drafter/toy.yaml)
is registered with `models.families.register` and runs through train (train.py's own `run`, its config composed with
the family's folder on Hydra's search path) -> export -> read -> decode, greedy output equal to plain greedy. No
module of the package names it."""

from __future__ import annotations

import inspect

import pytest
import torch
from omegaconf import OmegaConf

from helpers import ROOT, compose_train
from models.families import FAMILIES, register, unregister

TOY = ROOT / "tests" / "toy_family"
SEARCH = f"hydra.searchpath=[file://{TOY / 'conf'}]"
VARIED = ["verifier=tiny", "verifier.seed=1", "+verifier.layer_std=0.3"]
TRAIN = [*VARIED, "data.limit=8", "data.max_new_tokens=12", "data.gen_batch_size=8", "data.batch_size=4",
         "data.val_fraction=0.25", "logger=csv", "trainer.max_steps=3", "trainer.max_epochs=1"]
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


@pytest.fixture
def toy():
    from toy_family.toy import ENTRY

    register(ENTRY)
    try:
        yield ENTRY
    finally:
        unregister(ENTRY.name)


def test_a_family_defined_outside_the_package_trains_exports_reads_and_decodes(toy, train_script, tmp_path,
                                                                               one_thread):
    from eval.drafters.build import build_drafter
    from eval.engine.decode import greedy_decode, speculative_decode
    from eval.engine.protocol import CostProbe, Drafter
    from eval.engine.tree import Chain
    from helpers import varied_llama
    from models.exports.io import load_export, read_info
    from models.families import resolve
    from toy_family.toy import ToyDrafter, ToyHead

    # the contracts shared code relies on, as tests/test_family_home.py checks them for the built-in families
    assert not inspect.isabstract(resolve(toy.training))
    assert issubclass(ToyDrafter, CostProbe)

    cfg = compose_train([SEARCH, *TRAIN, f"model={toy.name}"], tmp_path / "run")
    assert cfg.model._target_ == toy.training  # conf/model/toy.yaml, found on the search path
    export = train_script.run(cfg)

    verifier = varied_llama(seed=1)
    loaded = load_export(export, verifier)
    assert loaded.kind == toy.name and isinstance(loaded.net, ToyHead)
    assert read_info(export).kind == toy.name
    trained = loaded.net.proj.weight
    assert torch.isfinite(trained).all() and trained.abs().sum() > 0

    drafter_cfg = OmegaConf.load(TOY / "conf" / "drafter" / f"{toy.name}.yaml")
    drafter = build_drafter(toy.name, drafter_cfg, verifier, read_info(export),
                            Chain())
    assert isinstance(drafter, ToyDrafter) and isinstance(drafter, Drafter)  # the decode loop's protocol
    ids = torch.tensor([verifier.tokenizer(PROMPT)["input_ids"]])
    plain = greedy_decode(verifier, ids, 16, [])
    spec = speculative_decode(verifier, drafter, ids, 16, [])
    assert torch.equal(spec.tokens, plain.tokens)
    assert spec.num_forwards <= plain.num_forwards


def test_register_refuses_a_taken_name_and_unregister_keeps_the_built_in_families(toy):
    from runtime.errors import UserError

    with pytest.raises(UserError, match="registered already"):
        register(toy)
    with pytest.raises(UserError, match="built-in"):
        unregister("medusa")
    assert "medusa" in FAMILIES and toy.name in FAMILIES
