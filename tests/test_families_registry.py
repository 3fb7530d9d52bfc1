"""The family registry (models/families.py) is the one place that says what a family is made of: every entry runs
through train (the real train.py, a few steps on a tiny verifier) -> export -> read -> decode exactly, the configs
point where the registry does, and no folder holds an import circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from helpers import ROOT, compose_train
from models.families import EXPORT_FAMILIES, FAMILIES, family, family_of_config, resolve

# A tiny verifier whose large random weights make its greedy output vary (tests/helpers.py varied_llama(seed=1)).
VARIED = ["verifier=tiny", "verifier.seed=1", "+verifier.layer_std=0.3"]
TRAIN = [*VARIED, "data.limit=8", "data.max_new_tokens=12", "data.gen_batch_size=8", "data.batch_size=4",
         "data.val_fraction=0.25", "logger=csv", "trainer.max_steps=2", "trainer.max_epochs=1"]
EXTRA = {"eagle3": ["model.aux_layer_ids=[0,1]", "model.draft_vocab_size=64", "model.ttt_steps=2",
                    "model.val_steps=2"],
         "eagle": ["model.val_steps=2"], "draft_model": ["model.num_layers=1"],
         "peagle": ["model.aux_layer_ids=[0,1]", "model.draft_vocab_size=64", "model.parallel_tokens=3"],
         "dflash": ["model.aux_layer_ids=[0,1]", "model.block_size=4"],
         "dspark": ["model.aux_layer_ids=[0,1]", "model.block_size=4", "model.markov_rank=16"],
         "dflash2": ["model.aux_layer_ids=[0,1]", "model.block_size=4", "model.selector_rank=16"]}
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


@pytest.fixture(scope="module")
def varied():
    from helpers import varied_llama

    return varied_llama(seed=1)


@pytest.fixture(scope="module")
def trained(train_script, tmp_path_factory):
    """name -> what `python train.py model=<name>` wrote, for every family the registry says trains."""
    out = {}
    for name, fam in FAMILIES.items():
        if fam.training is not None:
            cfg = compose_train([*TRAIN, f"model={name}", *EXTRA.get(name, [])], tmp_path_factory.mktemp(name))
            out[name] = train_script.run(cfg)
    return out


def test_every_family_has_its_configs_and_its_pieces():
    for name, fam in FAMILIES.items():
        drafter = OmegaConf.load(ROOT / "conf" / "drafter" / f"{name}.yaml")
        assert drafter._target_ == fam.drafter, name
        assert callable(resolve(fam.drafter)), name
        model = ROOT / "conf" / "model" / f"{name}.yaml"
        assert model.is_file() == (fam.training is not None), name
        if fam.training is not None:
            assert compose_train([f"model={name}"]).model._target_ == fam.training, name
            assert isinstance(resolve(fam.training), type), name
        assert (fam.decoder is not None) == fam.has_export == (fam.network is not None), name
        if fam.has_export:
            assert callable(resolve(fam.decoder)) and fam.acceptance and fam.needs_export, name
            assert family_of_config({"architectures": [fam.export.architectures[0]],
                                     "model_type": fam.export.model_type}) == name
    with pytest.raises(Exception, match="not a drafter family"):
        family("medusa2")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_trains_exports_reads_and_decodes_exactly(name, trained, varied, tmp_path, one_thread):
    """train (smoke) -> export -> read (through the registry) -> decode: greedy speculative output = plain greedy."""
    from eval.drafters.build import build_drafter, family_config
    from eval.engine.decode import greedy_decode, speculative_decode
    from eval.engine.tree import AutoTree
    from models.exports.io import load_export, read_info

    fam = FAMILIES[name]
    export = trained.get(name)
    if fam.has_export:
        info = read_info(export)
        assert info.kind == name and info.acceptance, name  # training recorded its acceptance estimates
        loaded = load_export(info, varied)
        assert type(loaded.net) is fam.network
    elif fam.needs_export:  # built on another family's export (the hybrid): the first that has one
        info = read_info(trained[EXPORT_FAMILIES[0]])
    else:
        info = None
    drafter_cfg = family_config(name)
    if name == "draft_model":
        drafter_cfg.path = str(export)  # the distilled draft model train.py wrote
    drafter = build_drafter(name, drafter_cfg, varied, info, AutoTree(size=6))
    ids = torch.tensor([varied.tokenizer(PROMPT)["input_ids"]])
    plain = greedy_decode(varied, ids, 16, [])
    spec = speculative_decode(varied, drafter, ids, 16, [])
    assert torch.equal(spec.tokens, plain.tokens), name
    assert spec.num_forwards <= plain.num_forwards


def _imports(module_file: Path, modules: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(module_file.read_text())):
        names = ([node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        found |= {n for n in names if n in modules}
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (at the top or inside a function), over every package folder."""
    files = {".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): f
             for pkg in PACKAGES for f in (ROOT / pkg).rglob("*.py")}
    return {m: _imports(f, set(files)) - {m} for m, f in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each strongly connected group of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return out


# The layers, bottom up: a module may import its own layer and the ones below it, never one above. eval/ is three
# layers of its own: the exact engine, the drafters on it, the harness on both.
LAYERS = [
    ("runtime",),
    ("models",),
    ("serve",),
    ("data",),
    ("train", "eval.engine"),
    ("eval.drafters",),
    ("eval",),  # the harness: eval/*.py
    ("scripts",),
]
PACKAGES = ("runtime", "models", "serve", "data", "train", "eval", "scripts")


def layer_of(module: str) -> int:
    """The index in LAYERS of the most specific prefix naming `module`."""
    best, depth = None, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = i, prefix.count(".")
    assert best is not None, module
    return best


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """module -> the project modules it imports from a layer above its own (train and eval.engine are one layer but
    do not import each other)."""
    out = {}
    for m, targets in graph.items():
        up = sorted(t for t in targets if layer_of(t) > layer_of(m)
                    or {m.split(".")[0], t.split(".")[0]} == {"train", "eval"})
        if up:
            out[m] = up
    return out


def test_no_import_circle_and_the_layers_import_downward():
    graph = import_graph()
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]  # the check sees a circle
    assert upward_imports(graph) == {}
    # the check sees a step up: the engine importing a drafter, a drafter the harness, models/ the data layer
    assert upward_imports({"eval.engine.decode": {"eval.drafters.medusa"}, "eval.drafters.build": {"eval.runner"},
                           "models.exports.io": {"data.chat"}, "eval.runner": {"eval.engine.decode"}}) == {
        "eval.drafters.build": ["eval.runner"], "eval.engine.decode": ["eval.drafters.medusa"],
        "models.exports.io": ["data.chat"]}


@pytest.mark.parametrize("method", ["all", "single", "all-bf16"])
def test_python_m_eval_runs_every_export_family_as_it_builds_it_alone(method, trained, tmp_path, one_thread):
    """`python -m eval` on every family's export: method=all over all of them, and a one-export run with the default
    drafter (the hybrid, with the export's drafter decoded alone beside it). Both build each export's drafter from its
    conf/drafter/<family>.yaml, as a one-family run does; a DSpark export crashed both (its factory was handed a
    `kind` it does not take). Greedy output equals plain greedy for every method. `all-bf16`: a bf16 verifier with
    every export's drafter in bf16 too (`drafter_dtype=auto`, the default: the verifier's dtype), still the verifier's
    own output."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from eval.harness import evaluate

    dtypes = ["dtype=bfloat16"] if method == "all-bf16" else ["dtype=float32"]
    method = method.split("-")[0]
    names = list(EXPORT_FAMILIES) if method == "all" else ["dspark"]
    checkpoint = f"[{','.join(str(trained[n]) for n in names)}]" if method == "all" else str(trained["dspark"])
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="eval", overrides=[
            f"method={method}", f"checkpoint={checkpoint}", "tree=chain", "tree.depth=2", "num_prompts=1",
            "max_new_tokens=6", "threads=1", *dtypes, "warmup=false", "wandb.mode=disabled",
            f"output_dir={tmp_path}"])
    report = evaluate(cfg, progress=False)
    assert report["drafter_dtype"] == dtypes[0].removeprefix("dtype=")  # auto: the verifier's dtype
    if method == "all":
        labels = list(report["methods"])
        assert all(any(label.startswith(f"{n}/") for label in labels) for n in names), labels
        # our decoding loops (a tau): the verifier's own output; Hugging Face's rows (no tau) are exact only in fp32
        ours = {m: r["greedy_match"] for m, r in report["methods"].items() if r["tau"] is not None or m == "baseline"}
        assert all(g in (None, 1.0) for g in ours.values()), report["methods"]
        if dtypes == ["dtype=float32"]:
            assert all(r["greedy_match"] in (None, 1.0) for r in report["methods"].values()), report["methods"]
    else:
        assert report["greedy_match"] == 1.0 and report["drafter_alone"]["greedy_match"] == 1.0


def test_drafter_dtype_casts_a_copy_of_the_exports_network(trained, varied):
    """make_drafter(dtype=...) runs the drafter's network in that dtype, on a copy: the export's network (shared by
    every drafter built from it) keeps its weights; a dtype not in the list is one message."""
    from eval.drafters.build import drafter_dtype, make_drafter, resolve_drafter_dtype
    from eval.engine.tree import Chain
    from models.exports.io import load_export
    from runtime.errors import UserError

    exp = load_export(trained["eagle3"], varied)
    drafter = make_drafter(None, varied, Chain(2), checkpoint=exp, dtype="bfloat16")
    assert {p.dtype for p in drafter.net.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in exp.net.parameters()} == {torch.float32}
    with pytest.raises(UserError, match="drafter_dtype='float16': choose one of"):
        drafter_dtype("float16")
    assert [resolve_drafter_dtype("auto", v) for v in ("bfloat16", "float32")] == ["bfloat16", "float32"]
    assert resolve_drafter_dtype("float32", "bfloat16") == "float32"  # set: as given
    from eval.drafters.build import build_drafter, family_config
    from eval.engine.sampling import SamplingConfig
    from models.exports.io import read_info

    for name, sampled in (("eagle3", False), ("dflash", False), ("eagle3", True), ("medusa", True)):
        # the harness's one builder passes eval's drafter_dtype on, sampled proposals or not (sampled_drafts once
        # replaced the options and the drafter ran in fp32 while the report said bf16)
        sampling = SamplingConfig(temperature=0.7) if sampled else None
        built = build_drafter(name, family_config(name), varied, read_info(trained[name]), Chain(2),
                              dtype="bfloat16", sampling=sampling)
        assert built.describe()["weights"] == "bfloat16", (name, sampled)


def test_the_report_records_the_dtype_the_drafter_ran_in(trained, tmp_path, one_thread):
    """report.json's drafter_dtype is read from the drafter that decoded (its weights), not from the setting."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from eval.harness import evaluate

    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="eval", overrides=[
            f"checkpoint={trained['eagle3']}", "drafter=export", "tree=chain", "tree.depth=2", "num_prompts=1",
            "max_new_tokens=6", "threads=1", "dtype=float32", "drafter_dtype=bfloat16", "temperature=0.7",
            "sampled_drafts=true", "warmup=false", "wandb.mode=disabled", f"output_dir={tmp_path}"])
    report = evaluate(cfg, progress=False)
    assert report["drafter_dtype"] == report["tree"]["weights"] == "bfloat16"
