"""trainer=ddp on CPU processes (gloo), through the real command line: every rank holds the same weights after each
step, the export is written once, the loss curve is the one-process curve of the same global batch, and a run whose
rank was killed resumes to the same final step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import ROOT, compose_train

WORDS = "the verifier checks every drafted token at once and keeps the ones it agrees with".split()


def _conversations(path: Path) -> Path:
    """16 ShareGPT conversations whose answers run from 2 to 77 words, so the ranks' batches hold different numbers
    of assistant tokens (with equal counts, weighing each rank's loss by its share would change nothing)."""
    rows = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: {' '.join(WORDS[i % 7: i % 7 + 4])}?"},
        {"from": "gpt", "value": " ".join(WORDS[j % len(WORDS)] for j in range(2 + (i * 37) % 76))}]}
        for i in range(16)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


TINY = ["verifier=tiny", "data=sharegpt", "data.val_fraction=0.25", "logger=csv", "trainer.precision=32-true",
        "callbacks.progress.when=never"]
# 12 training rows: three global batches of 4, as one process (batch 4) or two (batch 2 each) sees them.


@pytest.fixture(autouse=True)
def _data(tmp_path_factory, monkeypatch):
    path = _conversations(tmp_path_factory.mktemp("ddp-data") / "conversations.jsonl")
    monkeypatch.setattr(sys.modules[__name__], "TINY", [*TINY, f"data.source={path}"])


def _recorder(record: Path | None) -> list[str]:
    return [] if record is None else ["+callbacks.record._target_=helpers.RankRecorder",
                                      f"+callbacks.record.path={record}"]


def _cmd(args: list[str], run_dir: Path, record: Path | None = None) -> list[str]:
    return [sys.executable, "train.py", *TINY, *args, *_recorder(record), f"hydra.run.dir={run_dir}"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _train(args: list[str], run_dir: Path, record: Path | None = None,
           timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(_cmd(args, run_dir, record), cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _records(record: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in Path(f"{record}.rank{rank}.jsonl").read_text().splitlines()]


LAYERS = {"eagle3": ["verifier.num_layers=4"], "peagle": ["verifier.num_layers=4"], "dflash": ["verifier.num_layers=4"],
          "draft_model": ["model.num_layers=1"], "eagle": ["model.noise=0"]}  # EAGLE-1's noise: each rank its own
DDP = ["trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu", "data.batch_size=2"]
ONE = ["trainer=cpu", "data.batch_size=4"]


def _compare(model: list[str], tmp_path: Path, train_script, steps: int = 3,
             global_means: bool = False) -> tuple[list[list[float]], list[list[float]]]:
    """Train `steps` steps in one process (this one: train.py's `run` on the composed command line, the reference)
    and in two (the real command line, trainer=ddp); returns each run's per-step (loss, distance the weights moved
    from the start, their projection on a random direction), the two-process loss being the global batch's."""
    one, two = tmp_path / "one", tmp_path / "two"
    reference = [*TINY, *model, *ONE, f"trainer.max_steps={steps}", *_recorder(tmp_path / "one-rec")]
    train_script.run(compose_train(reference, one))
    proc = _train([*model, *DDP, f"trainer.max_steps={steps}"], two, tmp_path / "two-rec")
    r0, r1 = _records(tmp_path / "two-rec", 0), _records(tmp_path / "two-rec", 1)
    single = _records(tmp_path / "one-rec", 0)
    assert ([r["step"] for r in r0] == [r["step"] for r in r1] == [r["step"] for r in single]
            == list(range(1, steps + 1)))
    # Every rank holds the same weights after each step.
    assert [r["weights"] for r in r0] == [r["weights"] for r in r1]
    # The export is written once, by rank 0, and said once.
    assert proc.stdout.count("[export] written by rank 0 of 2") == 1
    assert [line for line in proc.stdout.splitlines() if line.startswith("export: ")] == [f"export: {two / 'export'}"]
    assert (two / "export" / "config.json").is_file()
    # The global batch's loss: each rank's mean weighted by its assistant tokens; or, where each rank's loss is its
    # share of the global means already (EAGLE's modules: DrafterModule.global_mean), their mean.
    glob = [(a["loss"] + b["loss"]) / 2 if global_means else
            (a["loss"] * a["tokens"] + b["loss"] * b["tokens"]) / (a["tokens"] + b["tokens"]) for a, b in zip(r0, r1)]
    assert sum(a["tokens"] + b["tokens"] for a, b in zip(r0, r1)) == sum(r["tokens"] for r in single)
    return ([[r["loss"], r["moved"], r["probe"]] for r in single],
            [[g, r["moved"], r["probe"]] for g, r in zip(glob, r0)])



@pytest.mark.parametrize("family,rel", [
    ("medusa", 1e-4),
    pytest.param("eagle", 1e-4, marks=pytest.mark.slow),
    pytest.param("eagle3", 1e-4, marks=pytest.mark.slow),
    pytest.param("peagle", 2e-3, marks=pytest.mark.slow),
    pytest.param("dflash", 2e-3, marks=pytest.mark.slow),
    pytest.param("draft_model", 1e-4, marks=pytest.mark.slow),
])
def test_two_cpu_processes_train_as_one(family, rel, tmp_path, train_script):
    """Two gloo ranks with batch 2 each against one process with batch 4, fp32, three steps: the same loss curve and
    the same weights (how far they moved, and in which direction).

    Medusa's and the draft model's losses are means over assistant tokens: each rank's loss weighed by its share of
    the global batch's tokens gives the one-process step. The EAGLE-style losses sum per-step means over different
    position sets (EAGLE-1 a feature term too): each mean is taken over the global batch (DrafterModule.global_mean).
    Either way the weights match the one-process run in size and direction up to float rounding (measured 1e-5 at
    most; checked at 1e-4, as fp32 rounding with batches of 2 and 4 differs from one CPU kernel to another);
    without them, directions differed by up to 2x at step 1 (AdamW's first steps are close to
    lr x sign(g)). P-EAGLE and DFlash sample their chains and anchors, so each process draws its own: their loss
    and the distance the weights moved agree within 2e-3, and direction is not compared."""
    single, two = _compare([f"model={family}", *LAYERS.get(family, [])], tmp_path, train_script,
                           global_means=family in ("eagle", "eagle3", "peagle", "dflash"))
    exact = family in ("medusa", "draft_model", "eagle", "eagle3")  # P-EAGLE, DFlash sample: see above
    for step, (a, b) in enumerate(zip(single, two), 1):
        a, b = (a, b) if exact else (a[:2], b[:2])
        assert b == pytest.approx(a, rel=rel), f"step {step}: one process {a}, two {b} (loss, moved, probe)"


def test_a_run_whose_rank_was_killed_resumes_to_the_same_final_step(tmp_path):
    """SIGKILL rank 1 once a checkpoint is written; rank 0 stops too; `ckpt_path=last` with the same command line
    trains on to the final step."""
    import psutil

    args = [*DDP, "model=medusa", "trainer.max_epochs=1000", "callbacks.checkpoint.every_n_train_steps=2"]
    proc = subprocess.Popen(_cmd([*args, "trainer.max_steps=100000"], tmp_path), cwd=ROOT, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    last = tmp_path / "checkpoints" / "last.ckpt"
    deadline = time.time() + 300
    try:
        while time.time() < deadline and not (
                last.is_file() and torch.load(last, weights_only=False)["global_step"] >= 4):
            time.sleep(0.5)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if "train.py" in " ".join(p.cmdline())]
        assert len(ranks) == 1, "expected rank 1 as the one child of the launching process"
        ranks[0].send_signal(signal.SIGKILL)
        proc.wait(timeout=180)  # rank 0 sees its peer gone and stops
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    killed_at = torch.load(last, weights_only=False)["global_step"]
    assert killed_at >= 4 and killed_at % 2 == 0
    done = _train([*args, f"trainer.max_steps={killed_at + 3}", "ckpt_path=last"], tmp_path)
    assert torch.load(last, weights_only=False)["global_step"] == killed_at + 3
    assert f"export: {tmp_path / 'export'}" in done.stdout


def test_ranks_that_disagree_on_the_config_are_refused(tmp_path):
    """Rank 1 composes another seed (read from LOCAL_RANK, which only the launched rank has set when the config is
    resolved): one message on every rank, before any step."""
    seed = "seed='${oc.decode:${oc.env:LOCAL_RANK,0}}'"
    proc = subprocess.run(_cmd([*DDP, "model=medusa", "trainer.max_steps=2", seed], tmp_path),
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "the ranks disagree on the run's config" in proc.stderr
    assert not (tmp_path / "export").exists() and not (tmp_path / "checkpoints" / "last.ckpt").exists()


def test_two_ranks_build_the_hidden_state_cache_together_and_train_from_it(tmp_path):
    """Offline mode under DDP: each rank writes its share of the cache's shards (shard i by rank i % 2), none twice,
    and both train from the whole cache."""
    cache = tmp_path / "cache"
    _train([*DDP, "model=eagle3", "verifier.num_layers=4", "data.cache_hidden_states=true",
            "data.cache_shard_rows=2", f"cache_dir={cache}", "trainer.max_steps=2"], tmp_path / "run")
    infos = [json.loads(p.read_text()) for p in sorted(cache.glob("hidden/*/0*/shard.json"))]
    assert len(infos) == 8  # 16 rows in shards of 2
    assert [i["rank"] for i in infos] == [0, 1] * 4 and {i["world"] for i in infos} == {2}
    assert len(list(cache.glob("hidden/*/done.json"))) == 1 and len(list(cache.glob("hidden/*/argmax/*"))) == 1


def test_fsdp_shards_the_verifier_and_trains_exactly_as_ddp(tmp_path):
    """trainer=fsdp on two CPU processes: the verifier's decoder layers sharded with FSDP2 (the memory table says
    half of them per rank), and the drafter's weights after every step bit for bit those of trainer=ddp, since
    gathering the shards gives the verifier's exact weights and hidden states."""
    args = ["model=eagle3", "verifier.num_layers=4", "trainer.devices=2", "trainer.accelerator=cpu",
            "data.batch_size=2", "trainer.max_steps=3"]
    ddp = _train([*args, "trainer=ddp"], tmp_path / "ddp", tmp_path / "ddp-rec")
    fsdp = _train([*args, "trainer=fsdp"], tmp_path / "fsdp", tmp_path / "fsdp-rec")
    assert "[fsdp] 4 verifier decoder layers sharded over 2 ranks (cpu)" in fsdp.stdout
    assert "[fsdp]" not in ddp.stdout
    for rank in (0, 1):
        assert [r["weights"] for r in _records(tmp_path / "fsdp-rec", rank)] == \
            [r["weights"] for r in _records(tmp_path / "ddp-rec", rank)]
    row = lambda out: next(line for line in out.splitlines() if "verifier (frozen)" in line)
    assert "decoder layers / 2 ranks (FSDP2)" in row(fsdp.stdout) and "parameters in float32" in row(ddp.stdout)
    assert float(row(fsdp.stdout).split()[3]) < float(row(ddp.stdout).split()[3])



def test_the_memory_table_counts_what_the_run_holds(tiny):
    """The printed plan: the verifier row is its parameter bytes (its decoder layers / W when sharded), the
    optimizer rows follow the trainable parameters, the TTT unroll multiplies the drafter's activations, and the
    offline cache removes the verifier's."""
    from hydra.utils import instantiate

    from helpers import compose_train
    from train.memory import GIB, plan_memory

    def module(steps: int):
        cfg = compose_train(["verifier=tiny", "model=eagle", f"model.ttt_steps={steps}"])
        return instantiate(cfg.model, verifier=tiny)

    rows = lambda plan: {what: size for what, size, _ in plan.rows}
    one = rows(plan_memory(tiny, module(1), 8, 256))
    model = tiny.model
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    layers = sum(p.numel() * p.element_size() for p in model.get_decoder().layers.parameters())
    assert one["verifier (frozen)"] == params
    n = sum(p.numel() for p in module(1).parameters() if p.requires_grad)
    assert one["drafter weights"] == one["drafter gradients"] == 4 * n and one["AdamW states"] == 8 * n
    three = rows(plan_memory(tiny, module(3), 8, 256))
    assert three["drafter activations"] == 3 * one["drafter activations"] > 0
    sharded = rows(plan_memory(tiny, module(1), 8, 256, world=2, shard_verifier=True))
    assert sharded["verifier (frozen)"] == params - layers / 2
    assert rows(plan_memory(tiny, module(1), 8, 256, offline=True))["verifier activations"] == 0
    table = plan_memory(tiny, module(1), 8, 256).table()
    assert f"{params / GIB:8.3f} GiB" in table and "total" in table


def test_the_gpu_recipe_composes_into_the_objects_it_names(cache_dir):
    """experiment=gpu_8b (an 8B verifier on a node of GPUs) is not run here; its config must still build the data
    module, the EAGLE-3 module and the DDP trainer it names, with the default verifier's tiny stand-in."""
    from hydra.utils import instantiate

    from helpers import compose_train
    from models.verifiers.tiny import build_tiny

    tiny = build_tiny(cache_dir=cache_dir, dtype="float32", device="cpu", num_layers=4)
    cfg = compose_train(["experiment=gpu_8b", "verifier=tiny", "trainer.accelerator=cpu", "trainer.devices=1"])
    assert cfg.trainer.strategy == "ddp" and cfg.data.generator == "vllm" and cfg.model.ttt_steps == 7
    dm = instantiate(cfg.data, verifier=tiny)
    assert dm.source == "HuggingFaceH4/ultrachat_200k" and dm.hub_split == "train_sft" and dm.batch_size == 4
    module = instantiate(cfg.model, verifier=tiny)
    assert module.hparams.draft_vocab_size == 32000
    trainer = instantiate(cfg.trainer, logger=False, callbacks=[])
    assert trainer.precision == "bf16-mixed"


def test_gpu_check_says_there_is_no_gpu():
    proc = subprocess.run([sys.executable, "-m", "scripts.tools.gpu_check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run python -m scripts.tools.gpu_check itself")
    assert proc.returncode == 2 and "no CUDA device here" in proc.stderr and "nothing was run" in proc.stderr


def test_the_data_digest_ranks_compare_sees_any_changed_token_mask_or_order():
    import datasets

    from train.distributed import data_digest

    rows = {"input_ids": [[1, 2, 3], [4, 5], [7]], "loss_mask": [[0, 1, 1], [1, 1], [1]]}
    base = datasets.Dataset.from_dict(rows)
    same = datasets.Dataset.from_dict({k: v[1:] for k, v in rows.items()})
    assert data_digest(base.select([1, 2])) == data_digest(same)  # a selection reads as the rows it holds
    for changed in ({"input_ids": [[1, 2, 3], [4, 6], [7]]}, {"loss_mask": [[0, 1, 1], [0, 1], [1]]}):
        assert data_digest(datasets.Dataset.from_dict(rows | changed)) != data_digest(base)
    assert data_digest(base.select([1, 0, 2])) != data_digest(base)
