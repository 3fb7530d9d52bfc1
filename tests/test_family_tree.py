"""One family tree across the layers: a family that builds on another does so in models/ (its network), train/ (its
LightningModule) and eval/ (its drafter) alike, read from the registry (models/families.py), never from a list here.

- Two families whose classes are their own in every layer: one's class subclasses the other's in all three layers or in
  none (DSpark and DFlash2 build on DFlash everywhere; P-EAGLE and DFlash are siblings everywhere).
- The named bases are pairs like any other: a network that reads the verifier's hidden states
  (models.eagle.VerifierFedNet) trains under train.verifier_fed.VerifierFedModule and drafts under
  eval.drafters.verifier_fed.VerifierFedDrafter, and only such a network does; a family subclasses another family's
  class in all three layers or in none (so a DFlash-line module deriving from EAGLE's class fails).
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


# The families' classes per layer, with the shared bases as a row of their own.
def _with_bases() -> dict[str, dict[str, type]]:
    from eval.drafters.verifier_fed import VerifierFedDrafter
    from models.eagle import VerifierFedNet
    from train.verifier_fed import VerifierFedModule

    return LAYERS | {"verifier_fed": {"models": VerifierFedNet, "train": VerifierFedModule,
                                      "eval": VerifierFedDrafter}}


ROWS = _with_bases()
PAIRS = [(a, b) for a, b in itertools.permutations(ROWS, 2)
         if len({ROWS[a][k] for k in ROWS[a]} & {ROWS[b][k] for k in ROWS[b]}) == 0]  # EAGLE-1/-3 share classes


# P-EAGLE's network is EAGLE-3's with mask slots (its export layout is EAGLE-3's); its module and drafter are the
# verifier-fed bases', as every parallel drafter's are. The one pair that builds on another in models/ alone.
NETWORK_ONLY = {("peagle", "eagle3"): {"models": True, "train": False, "eval": False}}


@pytest.mark.parametrize("child,parent", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_a_family_builds_on_another_in_every_layer_or_in_none(child, parent):
    builds = {layer: issubclass(ROWS[child][layer], ROWS[parent][layer]) for layer in ROWS[child]}
    if (child, parent) in NETWORK_ONLY:
        assert builds == NETWORK_ONLY[child, parent], f"{child} on {parent}: {builds}"
        return
    assert len(set(builds.values())) == 1, (
        f"{child} builds on {parent} in {[k for k, v in builds.items() if v]} but not in "
        f"{[k for k, v in builds.items() if not v]}: one inheritance order per family across models/, train/, eval/")


def test_the_builds_on_that_the_tree_names():
    """The tree as it stands (a change to it is a decision: update this line with the design note)."""
    on = {(a, b) for a, b in PAIRS if issubclass(ROWS[a]["models"], ROWS[b]["models"]) and (a, b) not in NETWORK_ONLY}
    fed = {name for name in LAYERS if issubclass(LAYERS[name]["models"], ROWS["verifier_fed"]["models"])}
    assert on == {("dspark", "dflash"), ("dflash2", "dflash")} | {(name, "verifier_fed") for name in fed}
    assert fed >= {"eagle", "eagle3", "peagle", "dflash", "dspark", "dflash2"}
    assert not issubclass(LAYERS["medusa"]["models"], ROWS["verifier_fed"]["models"])
