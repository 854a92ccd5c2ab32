#!/usr/bin/env bash
# The wheels bitserve needs that the lent H200's image lacks (shared/research/gpu-device.md),
# for Python 3.12, into .whl/ (ignored by git, carried by the device call, ~15 MB):
#   bash bench/gpu_wheels.sh
# On the device, before `python3 -m bench.gpu`:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PY=${PYTHON:-.venv/bin/python}
platforms=()
for n in 2_17 2_27 2_28 2_31 2_34; do platforms+=(--platform "manylinux_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl \
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0 cffi==2.1.1 pycparser==3.12 llguidance==1.9.1 orjson==3.13.0 \
  starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 grpcio-health-checking==1.81.0 \
  ml_dtypes gguf
du -sh .whl
