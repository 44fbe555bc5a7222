# syntax=docker/dockerfile:1
# An `engine-N` host: SGLang 0.5.14 (the release SpecForge 0.2.0 pins) with TIDE's capture
# plugin, which SGLang loads from the `sglang.srt.plugins` entry point TIDE's package
# declares; it captures when TIDE_SGLANG_CAPTURE=1 (compose.yaml sets it).
# Build context: the repository root (compose.yaml: context ..).
# Base image to bump with sglang: lmsysorg/sglang:v<version>[-cu<CUDA>] on Docker Hub.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.14
FROM ${SGLANG_IMAGE}

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1

# Only what the capture path and the draft-only swap import beyond SGLang's own stack
# (torch, numpy, pydantic, pyyaml, tqdm, transformers, safetensors), at TIDE's pins; the
# swap resolves models:/ and runs:/ URIs through MLflow (the skinny client is enough).
# pip leaves SGLang's packages as they are.
RUN python3 -c "import importlib.metadata as m; v = m.version('sglang'); assert v == '0.5.14', v" \
    && python3 -m pip install "minio==7.2.20" "pyarrow==25.0.1" "pydantic-settings==2.16.3" \
       "mlflow-skinny==3.17.2" \
    && python3 -m pip install --no-deps "specforge==0.2.0"  # draft validation: tensor shapes

# TIDE pins Python 3.11 for its own environments; inside SGLang's image the plugin runs on
# that image's Python (3.11 or later: tide_lib uses datetime.UTC), hence the override.
WORKDIR /opt/tide
COPY pyproject.toml README.md ./
COPY tide_lib ./tide_lib
RUN python3 -c "import sys; assert sys.version_info >= (3, 11), sys.version" \
    && python3 -m pip install --no-deps --ignore-requires-python . \
    && python3 -c "import importlib.metadata as m; assert any(e.name == 'tide_capture' for e in m.entry_points(group='sglang.srt.plugins'))" \
    && python3 -c "import tide_lib.serving.sglang_plugin" \
    && mkdir -p /var/spool/tide /var/lib/tide/scratch

EXPOSE 30000
