# syntax=docker/dockerfile:1
# Airflow 3.3.2 with TIDE, for the `control` host (api-server, scheduler, dag-processor,
# triggerer, `default` Celery worker). Same pins as the tested .venv (pyproject's
# `airflow` and `train` extras under constraints.txt, SpecForge --no-deps), CPU torch:
# nothing here trains on a GPU.
# Build context: the repository root (compose.yaml: context ..).
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    AIRFLOW_HOME=/opt/airflow \
    AIRFLOW__CORE__DAGS_FOLDER=/opt/tide/dags \
    AIRFLOW__CORE__PLUGINS_FOLDER=/opt/tide/plugins \
    AIRFLOW__CORE__LOAD_EXAMPLES=False \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

# gcc/g++: torch and Triton compile small kernels at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 50000 --gid 0 --create-home --home-dir /home/airflow airflow \
    && mkdir -p /opt/airflow /var/lib/tide/scratch \
    && chown -R airflow:0 /opt/airflow /var/lib/tide

WORKDIR /opt/tide
COPY pyproject.toml README.md requirements-nodeps.txt constraints.txt ./
COPY tide_lib ./tide_lib
# torch from the CPU index first; the extras then find torch==2.13.0 satisfied. CPU torch
# ships no Triton, which SpecForge imports.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" \
    && pip install -c constraints.txt ".[airflow,train]" triton \
    && pip install --no-deps -r requirements-nodeps.txt \
    && python -c "import tide_lib.config, tide_lib.orchestration.cycle"

# $AIRFLOW_HOME/airflow.cfg: the Helm chart mounts its own config over it.
COPY airflow.cfg /opt/airflow/airflow.cfg
COPY dags ./dags
COPY plugins ./plugins
COPY docker/pools.json ./docker/pools.json

USER airflow
EXPOSE 8080 8793
