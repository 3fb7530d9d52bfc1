"""Issue 64, the training side: a resume that would train another run, Ctrl-C, settings that leave nothing to train,
a default-named run directory that cannot be made, a verifier that is not a causal LM, a key the family does not take.
Each ends in one message naming the problem, the value seen and the fix, with nothing of the run lost or rewritten."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from helpers import ROOT, compose_train
from runtime.errors import UserError, user_error

TINY = ["verifier=tiny", "data.limit=12", "data.max_new_tokens=12", "data.gen_batch_size=12", "data.batch_size=4",
        "data.val_fraction=0.25", "logger=csv", "trainer.max_epochs=50"]
NO_VERIFIER = ["verifier=hf", "verifier.path=/nonexistent/llama"]  # a check that comes first gives its own message


def _cli(args: list[str], cwd: Path = ROOT, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _run_files(run: Path) -> dict[str, bytes]:
    """What a refused resume must leave as it was: the recipe, the checkpoints, the export, the training record."""
    files = [*sorted((run / ".hydra").iterdir()), *sorted((run / "checkpoints").iterdir()),
             *sorted((run / "export").rglob("*")), run / "training.json"]
    return {str(p.relative_to(run)): p.read_bytes() for p in files if p.is_file()}


@pytest.fixture(scope="module")
def medusa_run(tmp_path_factory) -> Path:
    """A finished 2-step Medusa run on the tiny verifier, batch 4."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    train_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_script)
    run = tmp_path_factory.mktemp("medusa-run")
    train_script.run(compose_train([*TINY, "model=medusa", "trainer.max_steps=2"], run))
    return run


# -- 1. a resume that changes what the run trains on -------------------------------------------------------------------
@pytest.mark.parametrize("override,key,was", [
    ("data.batch_size=2", "data.batch_size=2", "data.batch_size=4"),
    ("+trainer.accumulate_grad_batches=2", "trainer.accumulate_grad_batches=2", "trainer.accumulate_grad_batches=1"),
    ("seed=1", "seed=1", "seed=0"),
    ("model.num_heads=2", "model.num_heads=2", "model.num_heads=4"),
    ("data.limit=10", "data.limit=10", "data.limit=12"),
])
def test_a_resume_that_changes_the_batches_is_refused(train_script, medusa_run, override, key, was):
    before = _run_files(medusa_run)
    with pytest.raises(UserError) as err:  # before the verifier loads: a refusal costs nothing
        train_script.run(compose_train([*TINY, "model=medusa", "trainer.max_steps=4", override, "ckpt_path=last"],
                                       medusa_run))
    name = medusa_run.name
    assert str(err.value) == (f"{key}: run {name!r} was trained with {was}, and a resume continues it as trained (the "
                              f"same drafter, data and batches). Resume with {was}, or start a new run without "
                              f"ckpt_path: another name=..., or overwrite=true to replace {name!r}.")
    assert _run_files(medusa_run) == before


def test_a_resume_may_extend_the_run(train_script, medusa_run, tmp_path):
    """What may change (trainer.max_steps, the loader's workers, the logger) does: the resumed run goes on."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(medusa_run, run)
    train_script.run(compose_train([*TINY, "model=medusa", "trainer.max_steps=3", "data.num_workers=0",
                                    "logger=csv", "ckpt_path=last"], run))
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 3


# -- 2. another family on resume: refused before the run's recipe is rewritten -----------------------------------------
def test_resuming_a_medusa_run_as_eagle_keeps_its_recipe(medusa_run):
    """Lightning's `Error(s) in loading state_dict for EagleModule` traceback, and before it `.hydra/config.yaml` and
    `overrides.yaml` already said model=eagle: the run's recipe was lost."""
    before = _run_files(medusa_run)
    proc = _cli([*TINY, "model=eagle", "trainer.max_steps=4", "ckpt_path=last", f"hydra.run.dir={medusa_run}"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: model=eagle: run {medusa_run.name!r} was trained with model=medusa, and a resume continues it as "
        f"trained (the same drafter, data and batches). Resume with model=medusa, or start a new run without "
        f"ckpt_path: another name=..., or overwrite=true to replace {medusa_run.name!r}."]
    assert _run_files(medusa_run) == before  # .hydra/ byte for byte, checkpoints, export


# -- 8. Ctrl-C names the command that resumes --------------------------------------------------------------------------
class Interrupt(L.Callback):
    """A real SIGINT to this process after optimizer step `at_step` (what Ctrl-C sends)."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step:
            os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_prints_the_command_that_resumes(train_script, tmp_path, capsys):
    args = [*TINY, "model=medusa", "trainer.max_steps=6", "callbacks.checkpoint.every_n_train_steps=2",
            "+callbacks.interrupt._target_=test_bad_training_input.Interrupt", "+callbacks.interrupt.at_step=3"]
    cfg = compose_train(args, tmp_path)
    handler = signal.getsignal(signal.SIGINT)
    # Ctrl-C as a terminal delivers it: Python's own handler (an xdist worker, or a test before, may have left SIGINT
    # ignored in this process)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(SystemExit):
            train_script.run(cfg)
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT from then on
    last = tmp_path / "checkpoints" / "last.ckpt"
    err = capsys.readouterr().err
    command = shlex.join(["python", "train.py", *args, "ckpt_path=last"])
    assert f"interrupted at step 3; {last} keeps step 2. Resume with:\n  {command}\n" in err, err
    # The command resumes (without the test's interrupting callback).
    resumed = [a for a in shlex.split(command)[2:] if "interrupt" not in a]
    train_script.run(compose_train(resumed, tmp_path))
    assert torch.load(last, weights_only=True)["global_step"] == 6


# -- 11. settings that leave nothing to train: refused before the verifier loads ---------------------------------------
@pytest.mark.parametrize("override,message", [
    ("model=dspark model.num_anchors=0", "model.num_anchors=0: give a whole number of blocks per sequence >= 1 (null: "
                                         "every anchor), e.g. model.num_anchors=64."),
    ("model=dflash model.num_anchors=-4", "model.num_anchors=-4: give a whole number of blocks per sequence >= 1"),
    ("model=dflash model.block_size=0", "model.block_size=0: give a whole number >= 2 (the root token and its "
                                        "drafts), e.g. model.block_size=8."),
    ("model=dspark model.block_size=1", "model.block_size=1: give a whole number >= 2"),
    ("model=eagle3 model.ttt_steps=0", "model.ttt_steps=0: give a whole number of training steps unrolled >= 1"),
    ("model=eagle model.val_steps=0", "model.val_steps=0: give a whole number of steps validation unrolls >= 1"),
    ("model=peagle model.max_anchors=0", "model.max_anchors=0: give a whole number of chains per sequence >= 1"),
    ("model=peagle model.parallel_tokens=0", "model.parallel_tokens=0: give a whole number of drafts per forward"),
    ("model=eagle3 model.draft_vocab_size=0", "model.draft_vocab_size=0: give a whole number of draft tokens >= 2"),
    ("model=dspark model.markov_rank=0", "model.markov_rank=0: give a rank >= 1, e.g. model.markov_rank=256."),
    ("model=draft_model model.num_layers=0", "model.num_layers=0: give a whole number of draft layers >= 1"),
])
def test_settings_that_leave_nothing_to_train_are_refused_first(train_script, tmp_path, override, message):
    with pytest.raises(UserError) as err:
        train_script.run(compose_train([*TINY, *NO_VERIFIER, *override.split()], tmp_path / "run"))
    assert str(err.value).startswith(message), err.value
    assert not (tmp_path / "run").exists()


# -- 14. a key the family does not take --------------------------------------------------------------------------------
@pytest.mark.parametrize("override,message", [
    ("model=medusa +model.loss=tv", "model.loss: model=medusa takes no such key. Remove it from the command line (and "
                                    "from any experiment= file); model=medusa takes optimizer, scheduler, decay, "
                                    "warmup_ratio, num_heads, num_layers, share_lm_head, train_vocab."),
    ("model=eagle +model.block_size=4", "model.block_size: model=eagle takes no such key."),
    ("+data.batchsize=2", "data.batchsize: data=selfdistill takes no such key."),
])
def test_a_key_the_family_does_not_take_is_one_message(train_script, tmp_path, override, message):
    """`+model.loss=tv` (what Hydra suggests after `model.loss=tv` on Medusa) ended in a TypeError traceback."""
    with pytest.raises(UserError) as err:
        train_script.run(compose_train([*TINY, *NO_VERIFIER, *override.split()], tmp_path / "run"))
    assert str(err.value).startswith(message), err.value


# -- 12. the default name gets the run-directory check ----------------------------------------------------------------
def test_a_default_named_run_directory_that_is_a_file_is_one_message(tmp_path):
    """The default `name` (<model>-<verifier>) could not be resolved in the check Hydra runs first: a warning on every
    default-named run, and a FileExistsError traceback where `outputs/<name>` is a file."""
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "eagle-tiny").write_text("")
    proc = _cli(["model=eagle", "verifier=tiny"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "error: the run directory 'outputs/eagle-tiny' cannot be written (File exists). Make it writable, or choose "
        "another place (name=..., or hydra.run.dir=...)."]
    # (and no "HydraConfig was not set" warning before it: the one line above is all stderr holds)


# -- 13. a verifier that is not a causal LM ----------------------------------------------------------------------------
def test_a_bert_verifier_is_not_a_causal_lm(train_script, tmp_path):
    from transformers import BertConfig, BertForMaskedLM, BertTokenizer

    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world"]))
    BertTokenizer(str(bert / "vocab.txt")).save_pretrained(bert)
    BertForMaskedLM(BertConfig(vocab_size=7, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32, max_position_embeddings=64)).save_pretrained(bert)
    with pytest.raises(Exception) as err:  # Hydra's instantiate wraps it; entry points print the UserError alone
        train_script.run(compose_train([*TINY, "verifier=hf", f"verifier.path={bert}",
                                        f"cache_dir={tmp_path / 'cache'}"], tmp_path / "run"))
    assert str(user_error(err.value)) == (
        f"verifier.path={str(bert)!r} is not a causal language model (model_type='bert', "
        f"architectures=['BertForMaskedLM']). Give a decoder-only causal LM (an architecture named *ForCausalLM: "
        f"Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3), or use the default verifier=smollm2.")
