"""One family tree across the layers: a family that builds on another does so in models/ (its network), train/ (its
LightningModule) and eval/ (its drafter) alike, read from the registry (models/families.py), never from a list here.

- Two families whose classes are their own in every layer: one's class subclasses the other's in all three layers or in
  none (DSpark and DFlash2 build on DFlash everywhere; P-EAGLE and DFlash are siblings everywhere).
- EAGLE-1 and EAGLE-3 share their LightningModule and drafter (one class, two versions), so the EAGLE line is
  checked by its bases: a network that reads the verifier's hidden states (models.eagle.VerifierFedNet) trains
  under train.eagle.EagleModule and drafts under eval.drafters.eagle.EagleDrafter, and only such a network does.
"""

from __future__ import annotations

import importlib
import itertools
from typing import get_type_hints

import pytest

from models.families import FAMILIES


def _load(path: str) -> object:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def layers() -> dict[str, dict[str, type]]:
    """family -> {layer: class} for every family with a network, a training module and a decoder."""
    out = {}
    for f in FAMILIES.values():
        if f.network is None or f.training is None or f.decoder is None:
            continue
        drafter = get_type_hints(_load(f.decoder))["return"]
        out[f.name] = {"models": f.network, "train": _load(f.training), "eval": drafter}
    return out


LAYERS = layers()


def test_the_registry_reaches_every_layer_of_the_families_with_exports():
    assert {"medusa", "eagle", "eagle3", "peagle", "dflash", "dspark", "dflash2"} <= set(LAYERS)
    for classes in LAYERS.values():
        assert all(isinstance(c, type) for c in classes.values()), classes


# A class several families hold in one layer (EAGLE-1's and EAGLE-3's module and drafter) is a base there, checked as
# the EAGLE line below; the pairwise check takes the families whose classes are their own in every layer.
_SHARED = {c for layer in ("models", "train", "eval") for c in
           [cls for cls in {v[layer] for v in LAYERS.values()} if sum(v[layer] is cls for v in LAYERS.values()) > 1]}
_OWN = [name for name, classes in LAYERS.items() if not _SHARED & set(classes.values())]
PAIRS = list(itertools.permutations(_OWN, 2))


@pytest.mark.parametrize("child,parent", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_a_family_builds_on_another_in_every_layer_or_in_none(child, parent):
    builds = {layer: issubclass(LAYERS[child][layer], LAYERS[parent][layer]) for layer in LAYERS[child]}
    assert len(set(builds.values())) == 1, (
        f"{child} builds on {parent} in {[k for k, v in builds.items() if v]} but not in "
        f"{[k for k, v in builds.items() if not v]}: one inheritance order per family across models/, train/, eval/")


def test_the_builds_on_that_the_tree_names():
    """The tree as it stands (a change to it is a decision: update this line with the design note)."""
    on = {(a, b) for a, b in PAIRS if issubclass(LAYERS[a]["models"], LAYERS[b]["models"])}
    assert on == {("dspark", "dflash"), ("dflash2", "dflash")}


def test_the_eagle_line_is_one_line_in_every_layer():
    from eval.drafters.eagle import EagleDrafter
    from models.eagle import VerifierFedNet
    from train.eagle import EagleModule

    for name, classes in LAYERS.items():
        line = {layer: issubclass(classes[layer], base) for layer, base in
                (("models", VerifierFedNet), ("train", EagleModule), ("eval", EagleDrafter))}
        assert len(set(line.values())) == 1, f"{name}: of the EAGLE line in {line}"
    assert not issubclass(LAYERS["medusa"]["models"], VerifierFedNet)
    assert issubclass(LAYERS["dflash"]["models"], VerifierFedNet)
