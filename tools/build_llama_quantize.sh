#!/usr/bin/env bash
# Build llama.cpp's `llama-quantize` (only that target) for tests/llm/test_gguf.py, from
# the llama-cpp-python sdist tools/fetch_gguf_converter.py fetches (the same llama.cpp as
# the converter), into ~/.cache/bitserve/llama.cpp/build/bin (or $BITSERVE_LLAMA_CPP).
# Once per machine: ~20 min on 2 busy cores (measured beside 4 other jobs), a few on a
# free 8-core box. A later `--target llama-server llama-perplexity` reuses this build.
#   tools/build_llama_quantize.sh [python]
set -euo pipefail
PY=${1:-python3}
DEST=${BITSERVE_LLAMA_CPP:-$HOME/.cache/bitserve/llama.cpp}
if [[ -x $DEST/build/bin/llama-quantize ]]; then
  echo "$DEST/build/bin/llama-quantize: already there"
  exit 0
fi
command -v cmake >/dev/null || { echo "no cmake: llama-quantize not built" >&2; exit 1; }
"$PY" "$(dirname "$0")/fetch_gguf_converter.py" --dest "$DEST" --source
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$DEST/src" -B "$DEST/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF >/dev/null
nice cmake --build "$DEST/build" --target llama-quantize -j "$(nproc)"
echo "llama-quantize: $DEST/build/bin/llama-quantize"
