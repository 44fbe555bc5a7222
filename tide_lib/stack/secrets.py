"""The local stack's secrets: taken from the environment, else generated once into files.

Production hands every secret to TIDE in the environment or as files (a Kubernetes
secret mounted at ``$TIDE_SECRETS_DIR``, one file per variable); there is no default
secret in code. ``tide stack up`` on a workstation has nobody to ask, so it generates
what is missing, keeps it in the secrets dir (mode 0600) and exports it to its own
environment, which the services it starts inherit; later ``tide`` commands read the
same files (:func:`tide_lib.config.load_secret_files`). Only names and paths are logged.
"""

from __future__ import annotations

__all__ = [
    "AUTH_SECRETS",
    "ENGINE_SECRETS",
    "STORE_SECRETS",
    "ensure_stack_secrets",
    "mlflow_username",
]

import logging
import os
import secrets
from pathlib import Path

from pydantic import SecretStr

from tide_lib.config import TideConfig, secrets_dir

logger = logging.getLogger(__name__)

STORE_SECRETS = ("TIDE_STORE__SECRET_KEY",)
# The admin key of engines started here (`tide serve`, the demo): without one an engine
# refuses every swap, and the cycle's fleet client sends this one.
ENGINE_SECRETS = ("TIDE_SERVE__ADMIN_API_KEY",)
AUTH_SECRETS = (
    "MLFLOW_TRACKING_PASSWORD",
    "TIDE_STACK__AIRFLOW_ADMIN_PASSWORD",
    "TIDE_STACK__AIRFLOW_VIEWER_PASSWORD",
)


def mlflow_username() -> str:
    """The MLflow user TIDE's clients log in as (MLflow's own variable; default admin)."""
    return os.environ.get("MLFLOW_TRACKING_USERNAME") or "admin"


def _secret_file(folder: Path, name: str) -> Path:
    path = folder / name
    if not path.is_file() or not path.read_text().strip():
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)
        # Written whole, then renamed: an interrupted run never leaves an empty secret.
        partial = folder / f".{name}.{os.getpid()}"
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(secrets.token_urlsafe(32))
        partial.replace(path)
        logger.info("generated %s into %s (mode 0600)", name, path)
    return path


def _keep_login_name(folder: Path, name: str) -> None:
    """Keep the user name beside its password, so later ``tide`` commands log in as it
    (MLflow's client sends no login at all with a password but no user name)."""
    path = folder / name
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(os.environ[name])


def ensure_stack_secrets(config: TideConfig) -> TideConfig:
    """Every secret the stack needs, in the environment and in ``config``.

    A secret already in the config or the environment is kept; a missing one is read
    from, or generated into, the secrets dir.
    """
    given = {
        "TIDE_STORE__SECRET_KEY": config.store.secret_key,
        "TIDE_STACK__AIRFLOW_ADMIN_PASSWORD": config.stack.airflow_admin_password,
        "TIDE_STACK__AIRFLOW_VIEWER_PASSWORD": config.stack.airflow_viewer_password,
        "TIDE_SERVE__ADMIN_API_KEY": config.serve.admin_api_key,
    }
    names = STORE_SECRETS + ENGINE_SECRETS + (AUTH_SECRETS if config.stack.auth else ())
    for name in names:
        value = given.get(name)
        if value is not None:
            os.environ[name] = value.get_secret_value()
        elif not os.environ.get(name):
            os.environ[name] = _secret_file(secrets_dir(), name).read_text().strip()
    if config.stack.auth:
        os.environ.setdefault("MLFLOW_TRACKING_USERNAME", mlflow_username())
        _keep_login_name(secrets_dir(), "MLFLOW_TRACKING_USERNAME")

    def env_secret(name: str) -> SecretStr | None:
        return SecretStr(os.environ[name]) if os.environ.get(name) else None

    store = config.store.model_copy(update={"secret_key": env_secret("TIDE_STORE__SECRET_KEY")})
    serve = config.serve.model_copy(
        update={"admin_api_key": env_secret("TIDE_SERVE__ADMIN_API_KEY")}
    )
    stack = config.stack.model_copy(
        update={
            "airflow_admin_password": env_secret("TIDE_STACK__AIRFLOW_ADMIN_PASSWORD"),
            "airflow_viewer_password": env_secret("TIDE_STACK__AIRFLOW_VIEWER_PASSWORD"),
        }
    )
    return config.model_copy(update={"store": store, "stack": stack, "serve": serve})
