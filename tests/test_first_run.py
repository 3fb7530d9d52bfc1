"""README "Your own model, first run" (issue 64), on the real command lines: a tiny random Qwen3 saved with a chat
template (tests/archs.py) and a ShareGPT JSONL file; the README's train command, a run that stops inside its first
epoch and still exports its acceptance table; its eval command (greedy_match 1.0, the tree planned from that table);
and vLLM serving the export folder as it is. The commands are read from the README, so the recipe stays the one
tested: only the two paths, the run folder and what makes it small here are changed. Below them, the final
validation in-process on the tiny Llama, however a run stops (train/export.py ExportOnFitEnd), and never twice."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from archs import checkpoint

from helpers import ROOT, compose_train, run_shared

SECTION = "### Your own model, first run"
MODEL, DATA = "/models/my-model", "/data/chats.jsonl"  # the README's placeholders
TOPICS = ["cats", "rivers", "prime numbers", "bread", "trains", "the moon", "chess", "tea"]


def readme_section() -> str:
    text = (ROOT / "README.md").read_text()
    assert SECTION in text, f"README.md has no {SECTION!r} section"
    return re.split(r"\n#{2,3} ", text.split(SECTION, 1)[1], maxsplit=1)[0]


def readme_commands() -> dict[str, list[str]]:
    """The section's bash block: {"train" | "eval" | "serve": argv}, continuation lines joined, comments dropped."""
    block = readme_section().split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    lines = [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    marks = {"train": "python train.py ", "eval": "python -m eval ", "serve": "python -m serve "}
    return {name: shlex.split(next(ln for ln in lines if mark in ln)) for name, mark in marks.items()}


def readme_record() -> dict[str, Any]:
    """The section's example ShareGPT record."""
    return json.loads(readme_section().split("```json\n", 1)[1].split("```", 1)[0])


def with_settings(argv: list[str], settings: dict[str, str]) -> list[str]:
    """`argv` with the key=value arguments in `settings` replaced (or added): the README's command, changed only
    where a test must change it."""
    kept = [a for a in argv if a.split("=", 1)[0] not in settings]
    return kept + [f"{k}={v}" for k, v in settings.items()]


def write_sharegpt(path: Path, n: int) -> None:
    """The README's example record, then n - 1 more of its shape: one JSON record a line."""
    example = readme_record()
    assert [t["from"] for t in example["conversations"]] == ["human", "gpt"]
    with open(path, "w") as f:
        f.write(json.dumps(example) + "\n")
        for i in range(1, n):
            topic = TOPICS[i % len(TOPICS)]
            turns = [{"from": "human", "value": f"Tell me one thing about {topic} (question {i})."},
                     {"from": "gpt", "value": f"One thing about {topic}: it is item {i} on my list, and I like it."}]
            f.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")


def _run(argv: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny matmuls: one thread is faster on a shared 2-core box
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="session")
def first_run(tmp_path_factory) -> dict[str, Any]:
    """The README's train command on the tiny Qwen3 and 40 conversations, in a temporary run folder (once per test
    run, whichever xdist worker asks first). One row a batch (38 training rows: 38 steps an epoch), so the README's
    30 steps stop inside the first epoch, where Lightning itself never validates."""
    with run_shared(tmp_path_factory, "first-run") as root:
        model = checkpoint("qwen3", root)  # config, weights, the tokenizer and its chat template
        assert (model / "chat_template.jinja").is_file()
        done = root / "run.json"
        if not done.is_file():
            data = root / "chats.jsonl"
            write_sharegpt(data, 40)
            argv = readme_commands()["train"]
            assert argv[:2] == ["python", "train.py"] and {f"verifier.path={MODEL}", f"data.source={DATA}"} <= set(argv)
            assert {"verifier=hf", "data=sharegpt"} <= set(argv)
            small = {"verifier.path": str(model), "data.source": str(data), "data.batch_size": "1", "logger": "csv",
                     "hydra.run.dir": str(root / "run")}
            argv = with_settings(argv[1:], small)
            proc = _run(argv)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
            done.write_text(json.dumps({"stdout": proc.stdout}))
        stdout = json.loads(done.read_text())["stdout"]
    export = Path(stdout.strip().splitlines()[-1].removeprefix("export: "))
    return {"root": root, "model": model, "export": export, "stdout": stdout}


def test_a_run_shorter_than_an_epoch_exports_its_acceptance_table(first_run):
    export = first_run["export"]
    assert export == first_run["root"] / "run" / "export"
    config = json.loads((export / "config.json").read_text())
    steps = int(next(a for a in readme_commands()["train"] if a.startswith("trainer.max_steps=")).split("=")[1])
    assert config["trained_steps"] == steps
    assert config["train_sequences"] > steps  # one row a step: the run stopped inside its first epoch
    # The final weights were validated: the tables eval's planner reads are there.
    assert config.get("eagle_topk_accuracy") and len(config.get("val_step_top1") or []) == 7, sorted(config)
    record = json.loads((first_run["root"] / "run" / "training.json").read_text())
    assert len(record["epochs"]) == 1 and "val/loss" in record["epochs"][0]["metrics"]
    assert "no validation ran" not in first_run["stdout"]


def test_the_readme_eval_runs_on_it(first_run, tmp_path):
    out = tmp_path / "eval"
    argv = readme_commands()["eval"]
    assert argv[:3] == ["python", "-m", "eval"] and argv[3] == "checkpoint=outputs/first-run/export"
    argv = with_settings(argv[1:], {"checkpoint": str(first_run["export"]), "num_prompts": "2",
                                    "max_new_tokens": "16", "threads": "1", "warmup": "false", "alone": "false",
                                    "wandb.mode": "disabled", "output_dir": str(out)})
    proc = _run(argv)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "no acceptance estimates" not in proc.stdout + proc.stderr  # planned from the export's own table
    report = json.loads((out / "report.json").read_text())
    assert report["greedy_match"] == 1.0


@pytest.mark.engine
def test_vllm_serves_the_export_folder_as_it_is(vllm, first_run):
    """The README's server (`python -m serve <export>`) takes the export folder as its model: its command names the
    folder, and vLLM reads the verifier (the tiny Qwen3) and the drafter's speculative config from it and drafts.
    Driven as the engine tests drive it (serve/vllm_engine.py: `LLM(model=<export>)`, what the server builds, without
    the HTTP layer and its start-up), fp32, one prompt."""
    argv = readme_commands()["serve"]
    assert argv == ["python", "-m", "serve", "outputs/first-run/export"], argv
    printed = _run([*argv[1:3], str(first_run["export"]), "--print-command"])
    assert printed.returncode == 0, printed.stdout[-2000:] + printed.stderr[-2000:]
    assert "vllm.entrypoints.openai.api_server" in printed.stdout and str(first_run["export"]) in printed.stdout
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(first_run["model"])("The quick brown fox jumps over the lazy dog.")["input_ids"]
    run = vllm.serve(str(first_run["export"]), [ids], 16, dtype="float32", warmup=False)
    assert run.resolved is not None and run.resolved["method"] == "eagle3", run.resolved
    assert Path(run.resolved["model"]) == first_run["export"]
    assert run.spec is not None and run.spec["num_drafts"] > 0, run.spec
    assert len(run.outputs[0]) == 16


# The tiny verifier, 12 prompts: 9 training rows, 3 batches an epoch.
TINY = ["verifier=tiny", "data.limit=12", "data.max_new_tokens=12", "data.gen_batch_size=12", "data.batch_size=4",
        "data.val_fraction=0.25", "model=medusa", "logger=csv", "trainer.log_every_n_steps=1"]


@pytest.mark.parametrize("stop,validations", [
    (["trainer.max_steps=4", "trainer.max_epochs=20"], [3, 4]),  # stops one batch into epoch 2: validated there too
    (["trainer.max_steps=3", "trainer.max_epochs=20"], [3]),  # stops at an epoch's end: validated once
    (["trainer.max_epochs=2"], [3, 6]),  # the default: each epoch's end, the last one not twice
    (["trainer.max_epochs=3", "+trainer.check_val_every_n_epoch=2"], [6, 9]),  # the last epoch is one it skips
    (["trainer.max_epochs=1", "+trainer.val_check_interval=2", "+trainer.check_val_every_n_epoch=null"], [2, 3]),
])
def test_the_final_weights_are_validated_once(train_script, tmp_path, stop, validations):
    """Validation runs on the final weights however the run stops, and never twice at one step: the export's
    table is measured on the weights it holds."""
    import csv

    export = train_script.run(compose_train([*TINY, *stop], tmp_path))
    with open(next((tmp_path / "csv").glob("version_*/metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("val/loss")]
    config = json.loads((export / "config.json").read_text())
    assert [int(r["step"]) + 1 for r in rows] == validations, rows  # logged at the step before global_step moves
    assert config["trained_steps"] == validations[-1] and config["medusa_topk_accuracy"]
