"""Exports for the loader conformance tests, written once per session by exports.write_export."""

from __future__ import annotations

import pytest

from conformance.exports import Written, write_export

# name -> (verifier fixture, kind, options). EAGLE-3 on the tiny verifier needs 3 distinct layer ids below L, so it
# uses a 4-layer tiny verifier; the default verifier (30 layers) keeps the default ids [2, 15, 27].
SPECS = {
    "medusa-tiny": ("tiny", "medusa", {}),
    "medusa-tiny-own-heads": ("tiny", "medusa", {"share_lm_head": False, "num_layers": 2}),
    "eagle-tiny": ("tiny", "eagle", {}),
    "eagle3-tiny4": ("tiny4", "eagle3", {"aux_layer_ids": [1, 2, 3], "draft_vocab_size": 1024}),
    "eagle3-tiny4-fullvocab": ("tiny4", "eagle3", {"aux_layer_ids": [1, 2, 3]}),
    "eagle-smollm2": ("smollm2", "eagle", {}),
    "eagle3-smollm2": ("smollm2", "eagle3", {"draft_vocab_size": 8192}),
}


@pytest.fixture(scope="session")
def tiny4(cache_dir):
    from models.verifiers.tiny import build_tiny

    return build_tiny(cache_dir=cache_dir, dtype="float32", device="cpu", num_layers=4)


@pytest.fixture(scope="session")
def exported(request, tmp_path_factory):
    """exported(name) -> Written: the export SPECS[name] describes, written on first use."""
    cache: dict[str, Written] = {}

    def get(name: str) -> Written:
        if name not in cache:
            fixture, kind, opts = SPECS[name]
            verifier = request.getfixturevalue(fixture)
            cache[name] = write_export(kind, verifier, tmp_path_factory.mktemp(name) / "export", **opts)
        return cache[name]

    return get
