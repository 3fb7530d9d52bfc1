"""The conformance matrix (issue 53, item 5): every drafter family the registry trains x every tiny verifier
architecture (tests/archs.py: Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral with a sliding window, Gemma 3 with local and
global layers, Phi-3), each cell from a test:

- train: the real train.py (composed config, in-process) trains the family a few steps on that verifier and exports;
- exact decode: the export is read back through the registry and decodes exactly (speculative output = plain
  greedy, greedy_match 1.0), in fp32 through the exact engine where it runs the architecture, else through Hugging
  Face's forward (exact in fp32 on a CPU);
- vLLM serve: vLLM 0.32 loads the verifier and drafts with the export, for every family it serves (Medusa, EAGLE-1,
  EAGLE-3, P-EAGLE, DFlash: one launch per cell, its engine core in the test's worker process, see tests/conftest.py),
  or refuses it with its own message. DSpark is refused on every CPU (tests/test_engine_vllm_dspark.py), whatever the
  architecture, so it has no cell here.

`python -m scripts.tools.conformance_table <junit.xml>` turns a run of this file into docs/results/conformance.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from archs import ARCHS, arch_verifier, checkpoint

from helpers import compose_train, run_shared
from models.families import FAMILIES
from serve.vllm_engine import methods

TRAINED = [n for n, f in FAMILIES.items() if f.training is not None]
TRAIN = ["data.limit=4", "data.max_new_tokens=8", "data.gen_batch_size=4", "data.batch_size=2",
         "data.val_fraction=0.25", "logger=csv", "trainer.max_steps=1", "trainer.max_epochs=1",
         "verifier.dtype=float32", "verifier.device=cpu"]
# EAGLE-3 and P-EAGLE keep their default three aux layers (vLLM's fc reads 3 x hidden); the others read two.
EXTRA = {"eagle3": ["model.draft_vocab_size=64", "model.ttt_steps=2", "model.val_steps=1"],
         "eagle": ["model.val_steps=1"], "draft_model": ["model.num_layers=1"],
         "peagle": ["model.draft_vocab_size=64", "model.parallel_tokens=3"],
         "dflash": ["model.aux_layer_ids=[0,1]", "model.block_size=4"],
         "dspark": ["model.aux_layer_ids=[0,1]", "model.block_size=4", "model.markov_rank=16"],
         "dflash2": ["model.aux_layer_ids=[0,1]", "model.block_size=4", "model.selector_rank=16"]}
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
MAX_NEW = 16
# The families vLLM serves (serve/vllm_engine.py, from the registry) but DSpark and DFlash2, which vLLM 0.32 runs only
# on its Model Runner V2 (Triton: no CPU), refused for every architecture alike (tests/test_engine_vllm_dspark.py,
# tests/test_engine_vllm_dflash2.py).
VLLM_FAMILIES = [f for f in methods() if f not in ("dspark", "dflash2")]
# (architecture, family) pairs vLLM 0.32 will not draft, and its own words. Gemma 3 has no aux-hidden-states
# interface there, so every family that reads the verifier's intermediate layers is refused, not only EAGLE-3.
VLLM_REFUSES = {("gemma3", "eagle3"): "does not support EAGLE3 interface",
                ("gemma3", "peagle"): "does not support EAGLE3 interface",
                ("gemma3", "dflash"): "does not support EAGLE3 interface"}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="session")
def archs_dir(tmp_path_factory):
    with run_shared(tmp_path_factory, "archs") as folder:  # one folder per run, shared by xdist workers
        pass  # the lock is not held while tests run: archs.checkpoint writes each verifier atomically
    return folder


class _Runs(dict):
    """(arch, family) -> the export train.py wrote (or the exception it raised), trained when first asked."""

    def __init__(self, train_script, tmp_path_factory, archs_dir: Path) -> None:
        super().__init__()
        self.train_script, self.tmp, self.archs_dir = train_script, tmp_path_factory, archs_dir

    def __missing__(self, key: tuple[str, str]) -> Path | BaseException:
        arch, family = key
        path = checkpoint(arch, self.archs_dir)
        cfg = compose_train(["verifier=hf", f"verifier.path={path}", f"model={family}", *TRAIN,
                             *EXTRA.get(family, [])], self.tmp.mktemp(f"{arch}-{family}"))
        try:
            self[key] = Path(self.train_script.run(cfg))
        except Exception as e:  # noqa: BLE001  (the train cell fails with it; the decode cell reports it too)
            self[key] = e
        return self[key]


@pytest.fixture(scope="session")
def runs(train_script, tmp_path_factory, archs_dir):
    return _Runs(train_script, tmp_path_factory, archs_dir)


@pytest.fixture(scope="session")
def verifiers(archs_dir):
    cache: dict[str, object] = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = arch_verifier(arch, archs_dir)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def hf_greedy(verifiers):
    """arch -> Hugging Face's plain greedy continuation of PROMPT (a full forward per token, no cache): what the
    decode cell's plain greedy must emit, so a cell fails where the engine gets the architecture wrong."""
    cache: dict[str, torch.Tensor] = {}

    def get(arch: str) -> torch.Tensor:
        if arch not in cache:
            v = verifiers(arch)
            seq = torch.tensor([v.tokenizer(PROMPT)["input_ids"]])
            with torch.no_grad():
                for _ in range(MAX_NEW):
                    seq = torch.cat([seq, v.model(seq).logits[:, -1:].argmax(-1)], dim=1)
            cache[arch] = seq[:, -MAX_NEW:]
        return cache[arch]

    return get


def _export(runs, arch: str, family: str) -> Path:
    out = runs[arch, family]
    if isinstance(out, BaseException):
        raise out
    return out


@pytest.mark.parametrize("family", TRAINED)
@pytest.mark.parametrize("arch", ARCHS)
def test_train(runs, arch, family):
    export = _export(runs, arch, family)
    assert (export / "config.json").is_file()


@pytest.mark.parametrize("family", TRAINED)
@pytest.mark.parametrize("arch", ARCHS)
def test_exact_decode(runs, verifiers, hf_greedy, arch, family):

    from eval.drafters.build import build_drafter, family_config
    from eval.engine.arch import supported
    from eval.engine.decode import greedy_decode, speculative_decode
    from eval.engine.tree import Chain
    from models.exports.io import load_export, read_info

    export = _export(runs, arch, family)
    v = verifiers(arch)
    fam = FAMILIES[family]
    info = None
    if fam.has_export:
        info = read_info(export)
        assert info.kind == family
        assert type(load_export(info, v).net) is fam.network  # read back through the registry
    drafter_cfg = family_config(family)
    if family == "draft_model":
        drafter_cfg.path = str(export)
    drafter = build_drafter(family, drafter_cfg, v, info, Chain(3))
    engine = "engine" if supported(v.model.config) else "hf"  # fp32: both exact here
    ids = torch.tensor([v.tokenizer(PROMPT)["input_ids"]])
    plain = greedy_decode(v, ids, MAX_NEW, [], engine=engine)
    spec = speculative_decode(v, drafter, ids, MAX_NEW, [], engine=engine)
    assert torch.equal(plain.tokens, hf_greedy(arch)), arch  # the engine runs this architecture right
    assert torch.equal(spec.tokens, plain.tokens), (arch, family)  # greedy_match 1.0


@pytest.mark.engine
@pytest.mark.parametrize("arch,family", [(a, f) for a in ARCHS for f in VLLM_FAMILIES if (a, f) not in VLLM_REFUSES])
def test_vllm_serve(vllm, runs, verifiers, archs_dir, arch, family):
    """vLLM loads the tiny verifier and drafts with the family's export (fp32): drafts proposed and counted."""
    export = _export(runs, arch, family)
    v = verifiers(arch)
    ids = v.tokenizer(PROMPT)["input_ids"]
    run = vllm.serve(str(checkpoint(arch, archs_dir)), [ids], MAX_NEW, dtype="float32",
                     spec=vllm.speculative_config(family, export, 3))
    assert run.spec is not None and run.spec["num_drafts"] > 0, run.spec
    assert len(run.spec["accepted_per_pos"]) == 3, run.spec  # the 3 tokens asked for, position by position


@pytest.mark.engine
@pytest.mark.parametrize("arch,family", list(VLLM_REFUSES))
def test_vllm_refuses(vllm, runs, verifiers, archs_dir, arch, family):
    """vLLM refuses to draft this family for this architecture, and says so (its message, asserted)."""
    export = _export(runs, arch, family)
    ids = verifiers(arch).tokenizer(PROMPT)["input_ids"]
    with pytest.raises(vllm.EngineError) as refused:
        vllm.serve(str(checkpoint(arch, archs_dir)), [ids], MAX_NEW, dtype="float32",
                   spec=vllm.speculative_config(family, export, 3))
    assert VLLM_REFUSES[arch, family] in refused.value.log, refused.value.cause
