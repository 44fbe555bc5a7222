# syntax=docker/dockerfile:1
# An `engine-N` host: SGLang (a release TIDE supports: 0.5.14 or 0.5.23) with TIDE's
# capture plugin, which SGLang loads from the `sglang.srt.plugins` entry point TIDE's
# package declares; it captures when TIDE_SGLANG_CAPTURE=1 (compose.yaml sets it). The
# build fails on an SGLang the plugin would refuse (the plugin's own feature check).
# Build context: the repository root (compose.yaml: context ..).
# Base image to bump with sglang: lmsysorg/sglang:v<version>[-cu<CUDA>] on Docker Hub.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23
FROM ${SGLANG_IMAGE}

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1

# tide[capture] brings what the plugin imports (SGLang already has most of it; pip keeps
# SGLang's versions), mlflow-skinny for models:/ URIs; specforge --no-deps checks draft shapes.
# TIDE pins Python 3.11 for its own environments; inside SGLang's image the plugin runs on
# that image's Python (3.11 or later: tide_lib uses datetime.UTC), hence the override.
WORKDIR /opt/tide
COPY pyproject.toml README.md ./
COPY tide_lib ./tide_lib
RUN python3 -c "import sys; assert sys.version_info >= (3, 11), sys.version" \
    && python3 -m pip install --ignore-requires-python ".[capture]" \
    && python3 -m pip install --no-deps "specforge==0.2.0" \
    && python3 -c "import importlib.metadata as m; assert any(e.name == 'tide_capture' for e in m.entry_points(group='sglang.srt.plugins'))" \
    && python3 -c "import tide_lib.serving.sglang_plugin" \
    && python3 -c "from tide_lib.serving.sglang_api import SourceTree, detect; print(detect(SourceTree.installed()))" \
    && mkdir -p /var/spool/tide /var/lib/tide/scratch

EXPOSE 30000
