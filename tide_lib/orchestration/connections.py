"""Airflow connections as the source of the object store's and MLflow's settings in DAG tasks.

A platform team configures S3 and MLflow the way it configures every other Airflow
integration: an ``aws`` connection (endpoint URL, keys or a role to assume, region,
CA bundle) and an ``http`` connection (the tracking server and its login). One rule
decides which setting counts:

* inside a DAG task (every task builds its settings with
  :func:`~tide_lib.orchestration.params.config_from_params`), a connection that exists
  wins for every setting it carries; what it does not carry (bucket names, timeouts)
  keeps its ``TIDE_*`` value;
* everywhere else (the CLI, engines, the SGLang plugin), and inside Airflow where the
  connection is not defined, the environment alone: ``TIDE_STORE__*``,
  ``TIDE_MLFLOW__TRACKING_URI``, ``MLFLOW_TRACKING_USERNAME``/``PASSWORD``.

The values are exported into the task process's own environment, so that what the
task starts (torchrun workers, MLflow's client, which reads its login only from
there) sees the same settings; nothing reaches a file, an XCom or a log. Credentials
come from the amazon provider (:class:`AwsBaseHook`), so a connection with a
``role_arn`` yields temporary credentials (key, secret, session token) frozen when
the task starts.
"""

from __future__ import annotations

import logging
import os
from typing import Any
from urllib.parse import urlparse

from tide_lib.config import ConfigError, TideConfig

__all__ = ["mlflow_environment", "store_environment", "use_airflow_connections"]

logger = logging.getLogger(__name__)

# None: the variable is removed (a credential set from the connection is whole)
Environment = dict[str, str | None]


def _connection(conn_id: str) -> Any | None:
    """The Airflow connection ``conn_id``, or None where it is not defined."""
    from airflow.sdk import BaseHook  # noqa: PLC0415
    from airflow.sdk.exceptions import AirflowNotFoundException  # noqa: PLC0415

    try:
        return BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        return None


def store_environment(conn_id: str) -> Environment | None:
    """``TIDE_STORE__*`` values from the ``aws`` connection ``conn_id`` (None: not defined)."""
    if _connection(conn_id) is None:
        return None
    from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook  # noqa: PLC0415

    hook = AwsBaseHook(aws_conn_id=conn_id, client_type="s3")
    wrapper = hook.conn_config
    if wrapper.verify is False:
        raise ConfigError(
            f"Airflow connection {conn_id!r} turns TLS verification off (extra.verify: false); "
            "TIDE does not: give the path of the CA bundle in extra.verify instead"
        )
    region = wrapper.region_name
    environment: Environment = {}
    if wrapper.endpoint_url:
        environment["TIDE_STORE__ENDPOINT"] = wrapper.endpoint_url
    elif region:  # no endpoint: AWS S3 itself
        environment["TIDE_STORE__ENDPOINT"] = f"https://s3.{region}.amazonaws.com"
    if region:
        environment["TIDE_STORE__REGION"] = region
    if isinstance(wrapper.verify, str):
        environment["TIDE_STORE__CA_BUNDLE"] = wrapper.verify
    credentials = hook.get_credentials(region_name=region)
    if credentials.access_key and credentials.secret_key:
        environment["TIDE_STORE__ACCESS_KEY"] = credentials.access_key
        environment["TIDE_STORE__SECRET_KEY"] = credentials.secret_key
        environment["TIDE_STORE__SESSION_TOKEN"] = credentials.token or None
    return environment


def mlflow_environment(conn_id: str) -> Environment | None:
    """The tracking URI and MLflow's login from the ``http`` connection ``conn_id``."""
    connection = _connection(conn_id)
    if connection is None:
        return None
    host = connection.host or ""
    if "://" in host:  # a whole URL in the host field
        uri = host.rstrip("/")
    else:
        scheme = next(
            (s for s in (connection.schema, connection.conn_type) if s in ("http", "https")),
            "http",
        )
        port = f":{connection.port}" if connection.port else ""
        uri = f"{scheme}://{host}{port}"
    if not urlparse(uri).hostname:
        raise ConfigError(
            f"Airflow connection {conn_id!r} has no host: set it to the MLflow tracking "
            "server (host, port, and http or https as the schema)"
        )
    environment: Environment = {"TIDE_MLFLOW__TRACKING_URI": uri}
    if connection.login:
        environment["MLFLOW_TRACKING_USERNAME"] = connection.login
        environment["MLFLOW_TRACKING_PASSWORD"] = connection.password or None
    return environment


def use_airflow_connections(config: TideConfig) -> list[str]:
    """Export the store's and MLflow's connections into this process's environment.

    Returns the ids of the connections used (none: the environment stays as it was).
    """
    used = []
    for conn_id, read in (
        (config.store.airflow_conn_id, store_environment),
        (config.mlflow.airflow_conn_id, mlflow_environment),
    ):
        environment = read(conn_id) if conn_id else None
        if environment is None:
            continue
        for name, value in environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        logger.info(
            "settings %s from Airflow connection %r", ", ".join(sorted(environment)), conn_id
        )
        used.append(conn_id)
    return used
