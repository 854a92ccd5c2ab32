#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (continuous batching, -np slots), `llama-quantize`
# (f32 GGUF -> Q4_K_M, Q8_0, ...) and `llama-perplexity` from the llama.cpp sources
# vendored in PyPI's llama-cpp-python sdist, for bench/llm_serving.py, bench/perplexity.py
# and bench/quant.py. Bench-only: nothing in bitserve depends on it. About 15-25 min on
# 2 cores.
#   bench/peers/build_llama_cpp.sh [DEST]   (default ~/.cache/bitserve/llama.cpp)
# Prints the folder of the built binaries (DEST/build/bin); the source tree (with
# convert_hf_to_gguf.py and gguf-py) is DEST/src.
set -euo pipefail
VERSION=0.3.36
DEST=${1:-$HOME/.cache/bitserve/llama.cpp}
BIN=$DEST/build/bin
TARGETS=(llama-server llama-quantize llama-perplexity)
if [[ -x $BIN/llama-server && -x $BIN/llama-quantize && -x $BIN/llama-perplexity ]]; then
  echo "$BIN"; exit 0
fi
mkdir -p "$DEST"
if [[ ! -f $DEST/src/CMakeLists.txt ]]; then
  tmp=$(mktemp -d)
  python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp" >&2
  tar -xzf "$tmp"/llama_cpp_python-$VERSION.tar.gz -C "$tmp"
  rm -rf "$DEST/src"
  mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DEST/src"
  rm -rf "$tmp"
fi
cmake -S "$DEST/src" -B "$DEST/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=ON \
  -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$DEST/build" --target "${TARGETS[@]}" -j "$(nproc)" >&2
echo "$BIN"
