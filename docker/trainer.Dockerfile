# syntax=docker/dockerfile:1
# The `trainer` host: Airflow's Celery worker for the `mi250` queue on AMD MI250 (gfx90a),
# with TIDE and SpecForge on ROCm PyTorch. The `train` task runs `tide_lib.training.launch`
# under torchrun (shipped with PyTorch) when TIDE_TRAINING__NPROC_PER_NODE > 1.
# Build context: the repository root (compose.yaml: context ..).
#
# Base image to bump: a rocm/pytorch tag with Python 3.11 (TIDE requires 3.11) and the
# torch release of constraints.txt (2.13.0), from AMD's "Install PyTorch for ROCm" page:
#   rocm/pytorch:rocm<ROCm>_ubuntu<OS>_py3.11_pytorch_release_<torch>
# When bumping, check that the ROCm release still lists gfx90a (MI250) as supported.
ARG ROCM_PYTORCH_IMAGE=rocm/pytorch:rocm10.0_ubuntu24.04_py3.11_pytorch_release_2.13.0
FROM ${ROCM_PYTORCH_IMAGE}

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1 \
    AIRFLOW_HOME=/opt/airflow \
    AIRFLOW__CORE__DAGS_FOLDER=/opt/tide/dags \
    AIRFLOW__CORE__PLUGINS_FOLDER=/opt/tide/plugins \
    AIRFLOW__CORE__LOAD_EXAMPLES=False \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

WORKDIR /opt/tide
COPY pyproject.toml README.md requirements-nodeps.txt constraints.txt ./
COPY tide_lib ./tide_lib
# Keep the base image's ROCm torch (and its Triton): torch and triton are left out of the
# constraints (the `train` extra asks for no Triton); everything else keeps the tested pins.
RUN python -c "import sys, torch; assert sys.version_info[:2] == (3, 11), sys.version; assert torch.version.hip, 'not a ROCm build of torch'" \
    && grep -vE '^(torch|triton)==' constraints.txt > /tmp/constraints.txt \
    && python -m pip install -c /tmp/constraints.txt ".[airflow,train]" \
    && python -m pip install --no-deps -r requirements-nodeps.txt \
    && python -c "import torch; assert torch.version.hip, 'pip replaced the ROCm torch'"

# $AIRFLOW_HOME/airflow.cfg: the Helm chart mounts its own config over it.
COPY airflow.cfg /opt/airflow/airflow.cfg
COPY dags ./dags
COPY plugins ./plugins
COPY docker/pools.json ./docker/pools.json
RUN python -c "import specforge, tide_lib.training.launch" \
    && command -v torchrun

RUN useradd --uid 50000 --gid 0 --create-home --home-dir /home/airflow airflow \
    && mkdir -p /opt/airflow /var/lib/tide/scratch \
    && chown -R airflow:0 /opt/airflow /var/lib/tide
USER airflow
EXPOSE 8793
