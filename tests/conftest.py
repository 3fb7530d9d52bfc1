"""Shared fixtures: a cache directory for the dequantised default verifier, the tiny verifier, and config
composition."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from helpers import ROOT, compose_train, varied_llama  # noqa: F401  (plain helpers live in helpers.py)

# One cache per checkout: the default verifier is dequantised from its GGUF once (~20 s), then reused.
os.environ.setdefault("SPECDRAFT_CACHE", str(ROOT / ".cache"))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

# Under pytest-xdist (`-n auto`, what .ci/run uses) each worker is one process; torch's intra-op threads are shared
# out so the workers do not oversubscribe the cores (on this 2-core machine: two workers of one thread each).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORKERS))


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker a core, at most 4 (each holds the default verifier and may start a vLLM engine)."""
    return max(1, min(os.cpu_count() or 1, 4))



@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """`python train.py experiment=smoke logger=csv` on the default verifier, the real command line, run once per
    test run (whichever xdist worker asks first; the others wait on its lock): (the finished process, its run
    directory). The recipe test reads its output and metrics, the end-to-end eval test evaluates its export."""
    import subprocess
    import sys

    from helpers import run_shared

    with run_shared(tmp_path_factory, "smoke-run") as root:
        done, run = root / "done.json", root / "run"
        if not done.is_file():
            proc = subprocess.run([sys.executable, "train.py", "experiment=smoke", "logger=csv",
                                   f"hydra.run.dir={run}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
            done.write_text(json.dumps({"returncode": proc.returncode, "stdout": proc.stdout,
                                        "stderr": proc.stderr}))
        proc = json.loads(done.read_text())
    return subprocess.CompletedProcess(["train.py", "experiment=smoke"], proc["returncode"], proc["stdout"],
                                       proc["stderr"]), run


@pytest.fixture(scope="session")
def cache_dir() -> str:
    return os.environ["SPECDRAFT_CACHE"]


@pytest.fixture(scope="session")
def tiny(cache_dir):
    from models.verifiers.tiny import build_tiny

    return build_tiny(cache_dir=cache_dir, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm2(cache_dir):
    from models.verifiers.embedded import load_smollm2

    return load_smollm2(cache_dir=cache_dir, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def gemma3(cache_dir):
    """The second embedded verifier (Gemma 3 270M, a base model: plain rendering), in fp32."""
    from models.verifiers.embedded import load_gemma3

    return load_gemma3(cache_dir=cache_dir, dtype="float32", device="cpu")


@pytest.fixture(autouse=True)
def _no_thread_count_left_behind():
    """Every test leaves torch's thread count as it found it: memoised kernel probes are keyed by it, and a test
    that ran after one that changed it would probe (and pass or fail) on another kernel path."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_thread():
    """Small matmuls on this 2-core box are much faster on one thread (thread wake-ups dominate)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def train_script():
    """train.py loaded as a module (the `train/` package shadows it for a plain import)."""
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def llamacpp():
    """The real llama.cpp's driver (serve.llamacpp_engine) once its virtualenv is built (scripts/setup_llamacpp.sh);
    skipped without it, except in CI (`CI=true`) or with SPECDRAFT_REQUIRE_LLAMACPP=1, where a missing engine fails
    the test."""
    from runtime.errors import UserError
    from serve import llamacpp_engine

    try:
        llamacpp_engine.tools()
    except UserError as e:
        if os.environ.get("SPECDRAFT_REQUIRE_LLAMACPP") == "1" or os.environ.get("CI") == "true":
            pytest.fail(str(e))
        pytest.skip(str(e))
    return llamacpp_engine


@pytest.fixture(scope="session")
def vllm():
    """The real vLLM engine's driver (serve.vllm_engine) once its virtualenv answers (scripts/setup_vllm.sh); skipped
    without it, except in CI (`CI=true`) or with SPECDRAFT_REQUIRE_VLLM=1, where a missing engine fails the test."""
    from runtime.errors import UserError
    from serve import vllm_engine

    try:
        vllm_engine.vllm_python()
    except UserError as e:
        if os.environ.get("SPECDRAFT_REQUIRE_VLLM") == "1" or os.environ.get("CI") == "true":
            pytest.fail(str(e))
        pytest.skip(str(e))
    # vLLM's engine core in the worker's own process (its VLLM_ENABLE_V1_MULTIPROCESSING=0, as vLLM's own tests run
    # it): the same engine, scheduler, model runner and drafting, without a second process that imports torch and
    # vLLM again at every launch (a launch of the default verifier: ~4 s against 22-65 s). The tests assert what
    # the engine drafts and accepts, never its speed. Outside the tests vLLM keeps its default (a user's timed peer).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return vllm_engine


@pytest.fixture(scope="session")
def openvino():
    """OpenVINO GenAI's driver (serve.openvino_engine) once its virtualenv answers (scripts/setup_openvino.sh); skipped
    without it, except in CI (`CI=true`) or with SPECDRAFT_REQUIRE_OPENVINO=1, where a missing engine fails the test."""
    from runtime.errors import UserError
    from serve import openvino_engine

    try:
        openvino_engine.openvino_python()
    except UserError as e:
        if os.environ.get("SPECDRAFT_REQUIRE_OPENVINO") == "1" or os.environ.get("CI") == "true":
            pytest.fail(str(e))
        pytest.skip(str(e))
    return openvino_engine
