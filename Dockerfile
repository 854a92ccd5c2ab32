# bitserve: the server with a model repository baked in at /models (or mounted over it).
#
#   docker build -t bitserve .                                 # CPU (torch's CPU wheel)
#   docker build -t bitserve:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 \
#     --build-arg EXTRAS=gpu .
#   docker run -p 8000:8000 bitserve                           # the baked-in repository
#   docker run -p 8000:8000 -v "$PWD/my-models:/models:ro" bitserve   # your own
#
# Build args: MODELS (the repository folder in the build context, default models/),
# EXTRAS (pip extras, comma-separated: "gpu" for onnxruntime's CUDA build, "ray" for
# `--ray ADDRESS` replicas), BITSERVE_UID.
ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- base: a python3 >= 3.11
FROM ${BASE_IMAGE} AS base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The CUDA images carry no Python: take the distribution's (3.12 on Ubuntu 24.04).
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH

# ------------------------------------------------- build: the venv and the generated weights
FROM base AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""
ARG MODELS=models
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
WORKDIR /src
# torch first, from the index that matches the base (CPU or CUDA); pyproject keeps a range
COPY pyproject.toml README.md ./
# hadolint ignore=DL3013
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch>=2.4,<2.15"
COPY bitserve ./bitserve
# The gpu extra's onnxruntime-gpu and the core onnxruntime are one module in two wheels:
# keep the CUDA one alone (installed last, whole), or the CPU files may win.
# hadolint ignore=DL3013
RUN pip install ".${EXTRAS:+[$EXTRAS]}" \
    && if [[ ",${EXTRAS}," == *",gpu,"* ]]; then \
        pip uninstall -y onnxruntime onnxruntime-gpu \
        && pip install --no-deps "onnxruntime-gpu>=1.17"; \
    fi
COPY tools ./tools
COPY ${MODELS} /models
# Generated weights (tools/build_models.py) are made here, at build time, never at run
# time, for the default models the repository holds (a folder with a config.toml); onnx
# builds the ONNX model and leaves again.
# hadolint ignore=DL3013
RUN pip install onnx \
    && python -c "import sys; from pathlib import Path; sys.path.insert(0, 'tools'); \
from build_models import BUILDERS, build; \
build(Path('/models'), names=[n for n in BUILDERS if Path('/models', n, 'config.toml').is_file()])" \
    && pip uninstall -y onnx

# ----------------------------------------------------------------------- runtime
FROM base AS runtime
ARG BITSERVE_UID=10001
RUN useradd --uid "${BITSERVE_UID}" --user-group --no-create-home --home-dir /tmp bitserve
COPY --from=build /opt/venv /opt/venv
COPY --from=build /models /models
# Nothing downloads at run time; caches go to /tmp (the root filesystem may be read-only).
ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib
USER ${BITSERVE_UID}
WORKDIR /tmp
EXPOSE 8000 8001
# Ready = every model loaded and warmed and not draining: the traffic gate.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=2)"]
# bitserve is PID 1 and turns SIGTERM into a drain (--drain-timeout, default 30 s).
ENTRYPOINT ["bitserve", "serve"]
CMD ["--repository", "/models", "--host", "0.0.0.0", "--port", "8000", "--drain-timeout", "30"]
