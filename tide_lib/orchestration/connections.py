"""Airflow connections as the source of the object store's and MLflow's settings in DAG tasks.

A platform team configures S3 and MLflow the way it configures every other Airflow
integration: an ``aws`` connection (endpoint URL, keys or a role to assume, region,
CA bundle) and an ``http`` connection (the tracking server and its login). One rule
decides which setting counts:

* inside a DAG task (every task builds its settings with
  :func:`~tide_lib.orchestration.params.config_from_params`), a connection that exists
  wins for every setting it carries; what it does not carry (bucket names, timeouts,
  the S3 keys of a connection without credentials) keeps its ``TIDE_*`` value. An
  MLflow connection is the whole server: its login, or none, replaces
  ``MLFLOW_TRACKING_*``, so a login is never sent to a host it was not given for;
* everywhere else (the CLI, engines, the SGLang plugin), and inside Airflow where the
  connection is not defined, the environment alone: ``TIDE_STORE__*``,
  ``TIDE_MLFLOW__TRACKING_URI``, ``MLFLOW_TRACKING_USERNAME``/``PASSWORD``.

The settings reach the task's configuration as explicit values (over the environment
and the secrets dir). A task process also exports them into its own environment, for
what it starts (torchrun workers) and for MLflow's client, which reads its login only
from there; a value the connection removes is exported empty, so no secret file can
bring it back. The sensor's trigger shares its process with other triggers and
exports nothing. Credentials come from the amazon provider (:class:`AwsBaseHook`): a
connection with a ``role_arn`` yields temporary credentials, fetched when the task
starts, so the role's session must outlast the task (training included).
"""

from __future__ import annotations

__all__ = ["ConnectionSettings", "connection_settings", "mlflow_settings", "store_settings"]

import logging
import os
import threading
from typing import Any
from urllib.parse import urlsplit

from tide_lib.config import ConfigError, TideConfig

logger = logging.getLogger(__name__)

_EXPORT_LOCK = threading.Lock()
_FALSE = frozenset({"false", "0", "no", "off"})
# extras by which an aws connection carries credentials of its own
_CREDENTIAL_EXTRAS = ("role_arn", "aws_session_token", "profile_name", "aws_access_key_id")


class ConnectionSettings:
    """What the defined connections say: config overrides and the variables to export."""

    def __init__(self) -> None:
        self.overrides: dict[str, dict[str, Any]] = {}
        self.environment: dict[str, str] = {}  # "" for a value the connection removes
        self.used: list[str] = []

    def add(self, conn_id: str, section: str, values: dict[str, str | None]) -> None:
        for name, value in values.items():
            if name.startswith("TIDE_"):
                field = name.split("__", 1)[1].lower()
                self.overrides.setdefault(section, {})[field] = value
            self.environment[name] = value or ""
        self.used.append(conn_id)

    def export(self) -> None:
        """Into this process's environment (a task process: what it starts inherits them)."""
        with _EXPORT_LOCK:
            os.environ.update(self.environment)


def _connection(conn_id: str) -> Any | None:
    """The Airflow connection ``conn_id``, or None where it is not defined."""
    from airflow.sdk import BaseHook  # noqa: PLC0415
    from airflow.sdk.exceptions import AirflowNotFoundException  # noqa: PLC0415

    try:
        return BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        return None


def store_settings(conn_id: str) -> dict[str, str | None] | None:
    """``TIDE_STORE__*`` values from the ``aws`` connection ``conn_id`` (None: not defined)."""
    connection = _connection(conn_id)
    if connection is None:
        return None
    from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook  # noqa: PLC0415

    hook = AwsBaseHook(aws_conn_id=conn_id, client_type="s3")
    wrapper = hook.conn_config
    verify = wrapper.verify
    if verify is False or (isinstance(verify, str) and verify.strip().lower() in _FALSE):
        raise ConfigError(
            f"Airflow connection {conn_id!r} turns TLS verification off (extra.verify: false); "
            "TIDE does not: give the path of the CA bundle in extra.verify instead"
        )
    values: dict[str, str | None] = {}
    region = wrapper.region_name
    if wrapper.endpoint_url:
        values["TIDE_STORE__ENDPOINT"] = wrapper.endpoint_url
    elif region:  # no endpoint: AWS S3 itself
        values["TIDE_STORE__ENDPOINT"] = f"https://s3.{region}.amazonaws.com"
    if region:
        values["TIDE_STORE__REGION"] = region
    if isinstance(verify, str):
        values["TIDE_STORE__CA_BUNDLE"] = verify
    extra = connection.extra_dejson or {}
    if connection.login or any(extra.get(name) for name in _CREDENTIAL_EXTRAS):
        credentials = hook.get_credentials(region_name=region)
        if credentials is None or not (credentials.access_key and credentials.secret_key):
            raise ConfigError(
                f"Airflow connection {conn_id!r} names credentials the amazon provider could "
                "not resolve: check its login/password, role_arn or profile"
            )
        values["TIDE_STORE__ACCESS_KEY"] = credentials.access_key
        values["TIDE_STORE__SECRET_KEY"] = credentials.secret_key
        values["TIDE_STORE__SESSION_TOKEN"] = credentials.token or None
    return values


def _tracking_uri(connection: Any, conn_id: str) -> str:
    host = (connection.host or "").strip()
    schemes = ("http", "https")
    scheme = next(
        (
            s.lower()
            for s in (connection.schema, connection.conn_type)
            if s and s.lower() in schemes
        ),
        "http",
    )
    parts = urlsplit(host if "://" in host else f"{scheme}://{host}")
    if not parts.hostname:
        raise ConfigError(
            f"Airflow connection {conn_id!r} has no host: set it to the MLflow tracking "
            "server (host, port, and http or https as the schema)"
        )
    netloc = parts.netloc
    if connection.port and parts.port is None:
        netloc = f"{netloc}:{connection.port}"
    return f"{parts.scheme}://{netloc}{parts.path}".rstrip("/")


def mlflow_settings(conn_id: str) -> dict[str, str | None] | None:
    """The tracking URI and MLflow's login (none: anonymous) from the ``http`` connection."""
    connection = _connection(conn_id)
    if connection is None:
        return None
    return {
        "TIDE_MLFLOW__TRACKING_URI": _tracking_uri(connection, conn_id),
        "MLFLOW_TRACKING_USERNAME": connection.login or None,
        "MLFLOW_TRACKING_PASSWORD": (connection.password or None) if connection.login else None,
    }


def connection_settings(config: TideConfig) -> ConnectionSettings:
    """The store's and MLflow's connections named by ``config``, those that exist."""
    settings = ConnectionSettings()
    for conn_id, section, read in (
        (config.store.airflow_conn_id, "store", store_settings),
        (config.mlflow.airflow_conn_id, "mlflow", mlflow_settings),
    ):
        values = read(conn_id) if conn_id else None
        if values is None:
            continue
        settings.add(conn_id, section, values)
        logger.info("settings %s from Airflow connection %r", ", ".join(sorted(values)), conn_id)
    return settings
