"""The local stack: real servers, clear failures, MLflow artifacts landing in S3."""

from __future__ import annotations

import socket
from pathlib import Path

import mlflow
import pytest

from tests.conftest import (
    SPARE_PORTS,
    STOPPED_STACK_PORTS,
    TAKEN_PORT_STACK_PORTS,
    stack_config,
)
from tide_lib.config import TideConfig
from tide_lib.lake import ObjectStore
from tide_lib.stack import SERVICES, StackError, StackManager, free_ports, manager
from tide_lib.stack.services import find_binary

pytestmark = pytest.mark.slow


def test_status_reports_every_service_healthy(stack: TideConfig) -> None:
    statuses = StackManager(stack).status()
    assert [s.name for s in statuses] == ["seaweedfs", "mlflow"]
    assert all(s.healthy and s.pid for s in statuses)


def test_up_is_idempotent(stack: TideConfig) -> None:
    manager = StackManager(stack)
    before = [s.pid for s in manager.status()]
    manager.up()
    assert [s.pid for s in manager.status()] == before


def test_buckets_exist(stack: TideConfig) -> None:
    for bucket in (stack.store.lake_bucket, stack.store.artifact_bucket):
        assert ObjectStore(stack.store, bucket).is_reachable()


def test_mlflow_artifacts_land_in_the_s3_server(stack: TideConfig, tmp_path: Path) -> None:
    mlflow.set_tracking_uri(stack.mlflow.tracking_uri)
    mlflow.set_experiment("tide-stack-test")
    payload = tmp_path / "note.txt"
    payload.write_text("stored in s3")
    with mlflow.start_run() as run:
        mlflow.log_metric("x", 1.0)
        mlflow.log_artifact(str(payload))
    artifacts = ObjectStore(stack.store, stack.store.artifact_bucket)
    keys = [info.key for info in artifacts.list("artifacts/")]
    matching = [key for key in keys if run.info.run_id in key and key.endswith("note.txt")]
    assert matching, f"no artifact of run {run.info.run_id} in s3://{stack.store.artifact_bucket}"
    assert artifacts.get_bytes(matching[0]) == b"stored in s3"


def test_taken_port_fails_with_a_clear_message(tmp_path: Path) -> None:
    config = stack_config(tmp_path, port_base=TAKEN_PORT_STACK_PORTS)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", config.stack.mlflow_port))
        squatter.listen()
        mlflow_only = StackManager(
            config, services=tuple(s for s in SERVICES if s.name == "mlflow")
        )
        with pytest.raises(StackError, match=rf"port\(s\) \[{config.stack.mlflow_port}\].*taken"):
            mlflow_only.up()
        assert not mlflow_only.status()[0].running


def test_a_seaweedfs_on_the_same_ports_elsewhere_fails_with_a_clear_message(
    tmp_path: Path,
) -> None:
    # Another SeaweedFS on the same ports in a network namespace of its own: its ports
    # look free from here, but its unix sockets in /tmp (named by port) are shared, and
    # starting would take them over from it.
    config = stack_config(tmp_path, port_base=TAKEN_PORT_STACK_PORTS)
    path = Path(f"/tmp/seaweedfs-master-grpc-{config.stack.master_port + 10000}.sock")
    if path.exists():
        assert not manager._socket_served(path), f"{path} is served: move the test's ports"
        path.unlink()
    seaweedfs_only = StackManager(config, services=(SERVICES[0],))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as squatter:
            squatter.bind(str(path))
            squatter.listen()
            with pytest.raises(StackError, match=rf"seaweedfs.*{path}.*TIDE_STACK__"):
                seaweedfs_only.up()
            assert not seaweedfs_only.status()[0].running
        # The file a stopped one leaves behind is no conflict.
        assert path.exists() and not manager._socket_served(path)
    finally:
        path.unlink(missing_ok=True)


def test_missing_binary_names_the_fix() -> None:
    with pytest.raises(FileNotFoundError, match="pip install no-such-tool"):
        find_binary("no-such-tool-xyz", "install it with `pip install no-such-tool`")


def test_down_stops_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    # a relative state dir, as the default .tide/stack
    config = stack_config(Path("relative/state"), port_base=STOPPED_STACK_PORTS)
    manager = StackManager(config, services=tuple(s for s in SERVICES if s.name == "seaweedfs"))
    manager.up()
    pid = manager.status()[0].pid
    assert pid is not None
    manager.down()
    assert manager.status()[0].running is False
    assert (
        not Path(f"/proc/{pid}").exists()
        or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    )


def _postgres_database() -> str | None:
    """A fresh database on the local PostgreSQL (CI has one), or None when there is none."""
    import uuid

    import psycopg2

    try:
        admin = psycopg2.connect(
            host="127.0.0.1", user="postgres", dbname="postgres", connect_timeout=2
        )
    except psycopg2.OperationalError:
        return None
    name = f"tide_mlflow_{uuid.uuid4().hex[:8]}"
    admin.autocommit = True
    with admin.cursor() as cursor:
        cursor.execute(f"CREATE DATABASE {name}")
    admin.close()
    return f"postgresql+psycopg2://postgres@127.0.0.1:5432/{name}"


def test_mlflow_runs_on_postgres(stack: TideConfig, tmp_path: Path) -> None:
    backend = _postgres_database()
    if backend is None:
        pytest.skip("no PostgreSQL on 127.0.0.1:5432 (CI machines have one)")
    config = stack.model_copy(
        update={
            "mlflow": stack.mlflow.model_copy(update={"backend_store_uri": backend}),
            "stack": stack.stack.model_copy(
                update={"state_dir": tmp_path, "mlflow_port": free_ports(1, SPARE_PORTS)[0]}
            ),
        }
    )
    mlflow_only = StackManager(config, services=tuple(s for s in SERVICES if s.name == "mlflow"))
    mlflow_only.up()
    try:
        client = mlflow.MlflowClient(f"http://127.0.0.1:{config.stack.mlflow_port}")
        experiment = client.create_experiment("on-postgres")
        run = client.create_run(experiment)
        client.log_metric(run.info.run_id, "accept_length", 2.5)
        assert client.get_run(run.info.run_id).data.metrics == {"accept_length": 2.5}
    finally:
        mlflow_only.down()
        _drop_database(backend.rsplit("/", 1)[1])


def _drop_database(name: str) -> None:
    import psycopg2

    admin = psycopg2.connect(host="127.0.0.1", user="postgres", dbname="postgres")
    admin.autocommit = True
    with admin.cursor() as cursor:
        cursor.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    admin.close()
