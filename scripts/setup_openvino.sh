#!/usr/bin/env bash
# OpenVINO GenAI for the OpenVINO engine tests and the harness's openvino peer:
#   bash scripts/setup_openvino.sh        (setup.sh runs it; SKIP_OPENVINO=1 skips it there)
# openvino-genai (its LLMPipeline with speculative decoding and prompt lookup) and optimum-intel (the verifier's
# export to OpenVINO IR) pin transformers below this project's, so they live in their own virtualenv:
# $SPECDRAFT_OPENVINO_VENV (default ~/.cache/specdraft/openvino-venv). The project drives it through that
# interpreter (serve/openvino_engine.py). torch is the CPU build pip finds on the project's machines' disk (the same
# torch==2.13.0 setup.sh installs). Idempotent and safe to kill: the venv counts as done only once its marker is
# written, after the imports below worked; an unfinished one is rebuilt.
# Time: 2-2.5 min from nothing on the project's 2-core CPU machine (1 min 51 s and 2 min 27 s measured; torch from
# local disk, the rest from PyPI, pip's download cache warm; another job shared the cores; 2026-12-07); 1.6 GB.
set -euo pipefail
VERSION=2026.4.1.0
OPTIMUM=2.2.0
VENV=${SPECDRAFT_OPENVINO_VENV:-$HOME/.cache/specdraft/openvino-venv}
MARK="$VENV/.specdraft-openvino-$VERSION"
PY=${PYTHON:-python}
[ -f "$MARK" ] && [ -x "$VENV/bin/python" ] && exit 0
echo "setup_openvino: installing openvino-genai==$VERSION and optimum-intel==$OPTIMUM into $VENV (minutes, once)" >&2
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
# One resolve, torch held at 2.13.0 by the torchvision release built for it: optimum-intel requires torchvision, whose
# newest release would pull torch 2.14 with its CUDA libraries (4 GB) from PyPI; that torchvision (a CUDA build) is
# then removed, as its operators do not load on the CPU torch and break transformers' imports (text models do not
# need it). optimum-intel loads an EAGLE-3
# draft through its own modeling file, whose imports transformers checks: diffusers (below 0.38, which imports model
# classes this transformers lacks) and einops, with the hub client optimum-intel takes.
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0" "torchvision==0.28.0" "openvino-genai==$VERSION" \
  "openvino-tokenizers==$VERSION" "optimum-intel[openvino]==$OPTIMUM" "diffusers==0.37.1" "einops==0.8.2" \
  "huggingface-hub==1.21.0"
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision
"$VENV/bin/python" -c "import openvino_genai, openvino_tokenizers, optimum.intel, optimum.exporters.openvino; \
import diffusers, einops, torch; assert torch.__version__.endswith('+cpu'), torch.__version__; \
assert openvino_genai.__version__.startswith('${VERSION%.*}'), openvino_genai.__version__"
touch "$MARK"
