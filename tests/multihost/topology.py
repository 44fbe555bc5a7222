"""The production topology TIDE is tested in: hosts, what runs on each, what configures it.

The multi-host test builds these hosts as network namespaces; ``docker/compose.yaml``
deploys the same services with the same variables (``tests/docker`` checks that the
two agree). Only the network is shared between hosts.
"""

from __future__ import annotations

from typing import Final

# host -> the compose services that run on it (their `tide.host` label names the host)
HOSTS: Final[dict[str, tuple[str, ...]]] = {
    "data": ("minio", "postgres", "redis", "mlflow"),
    "control": (
        "airflow-api-server",
        "airflow-scheduler",
        "airflow-dag-processor",
        "airflow-triggerer",
        "airflow-worker-default",
    ),
    "trainer": ("airflow-worker-mi250",),
    "engine-1": ("engine-1",),
    "engine-2": ("engine-2",),
}

# Variables every TIDE process reads (object store and MLflow live on `data`).
TIDE_ENV: Final = (
    "TIDE_STORE__ENDPOINT",
    "TIDE_STORE__ACCESS_KEY",
    "TIDE_STORE__SECRET_KEY",
    "TIDE_MLFLOW__TRACKING_URI",
    "MLFLOW_TRACKING_USERNAME",  # MLflow runs its basic-auth app
    "MLFLOW_TRACKING_PASSWORD",
    "TIDE_SERVE__API_KEY",  # engines require SGLang's keys, the fleet client sends them
    "TIDE_SERVE__ADMIN_API_KEY",
    "TIDE_SCRATCH_DIR",
)
# Variables of the Airflow processes on `control` and `trainer` (one JWT secret for all).
AIRFLOW_ENV: Final = (
    "AIRFLOW__CORE__EXECUTOR",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
    "AIRFLOW__CELERY__BROKER_URL",
    "AIRFLOW__CELERY__RESULT_BACKEND",
    "AIRFLOW__CORE__EXECUTION_API_SERVER_URL",
    "AIRFLOW__API_AUTH__JWT_SECRET",
    "TIDE_CYCLE__TARGET_ID",
    "TIDE_CYCLE__TARGET_PATH",
    "TIDE_CYCLE__SERVERS",
)
# Variables of the trainer hosts' worker on top of AIRFLOW_ENV.
TRAINER_ENV: Final = ("TIDE_TRAINING__DEVICE", "TIDE_TRAINING__NPROC_PER_NODE")
# Variables of each engine (capture into the lake, drafts fetched from MLflow/S3).
ENGINE_ENV: Final = ("TIDE_LAKE__SPOOL_DIR", "TIDE_LAKE__PREFIX")
