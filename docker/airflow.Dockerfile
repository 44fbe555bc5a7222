# syntax=docker/dockerfile:1
# Airflow 3.3.2 with TIDE, for the `control` host (api-server, scheduler, dag-processor,
# triggerer, `default` Celery worker). Same pins as the tested .venv (requirements.txt under
# constraints.txt, SpecForge --no-deps), CPU torch: nothing here trains on a GPU.
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
COPY requirements.txt requirements-nodeps.txt constraints.txt ./
# torch from the CPU index first; the rest of requirements.txt (without the dev tools)
# then finds torch==2.13.0 satisfied.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" \
    && grep -vE '^(torch|pytest|pytest-timeout|ruff|mypy)==' requirements.txt > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt -c constraints.txt \
    && pip install --no-deps -r requirements-nodeps.txt

COPY pyproject.toml README.md ./
# $AIRFLOW_HOME/airflow.cfg: the Helm chart mounts its own config over it.
COPY airflow.cfg /opt/airflow/airflow.cfg
COPY tide_lib ./tide_lib
COPY dags ./dags
COPY plugins ./plugins
COPY docker/pools.json ./docker/pools.json
RUN pip install --no-deps . \
    && python -c "import tide_lib.config, tide_lib.orchestration.cycle"

USER airflow
EXPOSE 8080 8793
