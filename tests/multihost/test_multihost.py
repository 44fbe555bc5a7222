"""The loop on several hosts that share nothing but the network, and three network faults.

Hosts are network namespaces on one bridge (``netns.py``), each with a directory
of its own as home and working directory, its own copy of the target, and only
addresses from configuration:

- ``data``: the S3 server (SeaweedFS) and MLflow; the machine's PostgreSQL and
  Redis are reached through relays on the bridge;
- ``control``: Airflow's api-server, scheduler, dag-processor, triggerer and the
  ``default`` Celery worker (CeleryExecutor);
- ``trainer`` and ``trainer-2``: a Celery worker on the ``mi250`` queue each;
- ``engine-1`` and ``engine-2``: reference engines serving the target with an
  EAGLE3 draft, capturing into the lake.

The scheduler runs ``tide_adaptation`` from captured traffic to both engines
serving the promoted draft; then, each in its own test and in this order: a
trainer host loses its link mid-training (the retry on the other trainer resumes
from the checkpoint in S3), ``engine-2`` is unreachable during promotion
(``engine-1`` is rolled back, the champion stays), and the ``data`` host is cut
off while the engines capture (every record reaches the lake exactly once).
Each test checks the versions registered, the champion alias, both engines'
weight versions and the records in the lake.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg2
import pytest
import redis
from pydantic import SecretStr

from tests.conftest import MULTIHOST_DATA_PORTS
from tests.multihost import netns
from tests.prometheus import metric_value
from tide_lib.config import TideConfig, load_config
from tide_lib.lake import LakeReader, ObjectStore, target_slug
from tide_lib.registry import CHAMPION, DraftRegistry
from tide_lib.stack.airflow_api import AirflowAPI
from tide_lib.target_model import load_corpus, render_prompt

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.multihost]

HOST_NAMES = ("data", "control", "trainer", "trainer-2", "engine-1", "engine-2")
TARGET_ID = "tiny"
PREFIX = "multihost"
POSTGRES_RELAY, REDIS_RELAY, BROKER_DB = 15432, 16379, 8
ENGINE_PORT, AIRFLOW_PORT = 30000, 8080
# The data host's stack ports: see MULTIHOST_DATA_PORTS (SeaweedFS's sockets in /tmp).
S3_PORT, MASTER_PORT, VOLUME_PORT, FILER_PORT, ADMIN_PORT, MLFLOW_PORT = range(
    MULTIHOST_DATA_PORTS, MULTIHOST_DATA_PORTS + 6
)
DATA_STACK_PORTS = {
    "TIDE_STACK__S3_PORT": str(S3_PORT),
    "TIDE_STACK__MASTER_PORT": str(MASTER_PORT),
    "TIDE_STACK__VOLUME_PORT": str(VOLUME_PORT),
    "TIDE_STACK__FILER_PORT": str(FILER_PORT),
    "TIDE_STACK__ADMIN_PORT": str(ADMIN_PORT),
    "TIDE_STACK__MLFLOW_PORT": str(MLFLOW_PORT),
}
TIDE = str(Path(sys.executable).parent / "tide")
# Every engine requires SGLang's keys (they listen on the bridge); Airflow's fleet client
# sends them. The session's other secrets (S3, MLflow, Airflow logins) come from conftest.
ENGINE_KEYS = {
    "TIDE_SERVE__API_KEY": secrets.token_urlsafe(16),
    "TIDE_SERVE__ADMIN_API_KEY": secrets.token_urlsafe(16),
}
AUTH = {"Authorization": f"Bearer {ENGINE_KEYS['TIDE_SERVE__API_KEY']}"}
SECRETS_OF_EVERY_HOST = (
    "TIDE_STORE__SECRET_KEY",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
)
AIRFLOW_LOGINS = ("TIDE_STACK__AIRFLOW_ADMIN_PASSWORD", "TIDE_STACK__AIRFLOW_VIEWER_PASSWORD")
CONTROL_SERVICES = [
    "airflow-api-server",
    "airflow-scheduler",
    "airflow-dag-processor",
    "airflow-triggerer",
    "airflow-worker-default",
]


@dataclasses.dataclass
class Topology:
    net: netns.Network
    root: Path
    config: TideConfig  # how the test itself (on the bridge) reaches data
    env: dict[str, dict[str, str]]
    engines: dict[str, netns.HostProcess]
    sent: int = 0  # requests served so far

    def host_dir(self, name: str) -> Path:
        return self.root / name

    @property
    def airflow(self) -> str:
        return f"http://{self.net.hosts['control'].address}:{AIRFLOW_PORT}"

    @property
    def api(self) -> AirflowAPI:
        password = SecretStr(os.environ["TIDE_STACK__AIRFLOW_ADMIN_PASSWORD"])
        return AirflowAPI(self.airflow, "admin", password, timeout_s=60)

    def engine_url(self, name: str) -> str:
        return f"http://{self.net.hosts[name].address}:{ENGINE_PORT}"

    def task_log(self, host: str, run_id: str, task_id: str, attempt: int) -> Path:
        logs = self.host_dir(host) / "stack" / "airflow" / "logs" / "dag_id=tide_adaptation"
        return logs / f"run_id={run_id}" / f"task_id={task_id}" / f"attempt={attempt}.log"


def _common_env(data: str) -> dict[str, str]:
    return {
        **{name: os.environ[name] for name in SECRETS_OF_EVERY_HOST},
        **ENGINE_KEYS,
        "TIDE_STORE__ENDPOINT": f"http://{data}:{S3_PORT}",
        "TIDE_STORE__TIMEOUT_S": "2",
        "TIDE_MLFLOW__TRACKING_URI": f"http://{data}:{MLFLOW_PORT}",
        "TIDE_LAKE__PREFIX": PREFIX,
        "TIDE_LAKE__COMMIT_SETTLE_S": "2",
        "TIDE_SCRATCH_DIR": "scratch",  # relative: each host's own working directory
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def _airflow_env(net: netns.Network, name: str, database: str) -> dict[str, str]:
    hosts = net.hosts
    engines = [f"http://{hosts[e].address}:{ENGINE_PORT}" for e in ("engine-1", "engine-2")]
    return {
        **{login: os.environ[login] for login in AIRFLOW_LOGINS},
        "TIDE_STACK__STATE_DIR": "stack",
        "TIDE_STACK__HOST": hosts[name].address,
        "TIDE_STACK__EXECUTOR": "CeleryExecutor",
        "TIDE_STACK__AIRFLOW_DATABASE_URL": (
            f"postgresql+psycopg2://postgres@{netns.ROOT_ADDRESS}:{POSTGRES_RELAY}/{database}"
        ),
        "TIDE_STACK__CELERY_BROKER_URL": f"redis://{netns.ROOT_ADDRESS}:{REDIS_RELAY}/{BROKER_DB}",
        "TIDE_STACK__AIRFLOW_API_URL": f"http://{hosts['control'].address}:{AIRFLOW_PORT}",
        "TIDE_STACK__START_TIMEOUT_S": "300",
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "30",
        "AIRFLOW__WORKERS__MAX_FAILED_HEARTBEATS": "2",
        "TIDE_CYCLE__TARGET_ID": TARGET_ID,
        "TIDE_CYCLE__TARGET_PATH": "target",  # relative: each host's own copy
        "TIDE_CYCLE__MIN_NEW_TOKENS": "300",
        "TIDE_CYCLE__FORCE_PROMOTE": "true",
        "TIDE_CYCLE__SCHEDULE_MINUTES": "0",  # every cycle here is triggered
        "TIDE_CYCLE__SERVERS": json.dumps(engines),
        "TIDE_TRAINING__STEPS": "120",
        "TIDE_TRAINING__CHECKPOINT_EVERY": "10",
        "TIDE_TRAINING__TTT_LENGTH": "2",
        "TIDE_TRAINING__DRAFT_VOCAB_SIZE": "512",
        "TIDE_GATE__K": "3",
    }


def _start_stack(top: Topology, name: str, services: list[str], env: dict[str, str]) -> None:
    env = {**env, "TIDE_STACK__SERVICES": json.dumps(services)}
    top.env[name] = env
    netns.run_on(top.net.hosts[name], [TIDE, "stack", "up"], env, top.host_dir(name), 900)


def _start_engine(top: Topology, name: str, draft_version: str) -> netns.HostProcess:
    host, home = top.net.hosts[name], top.host_dir(name)
    env = {
        **_common_env(top.net.hosts["data"].address),
        "TIDE_LAKE__SPOOL_DIR": "spool",
        "TIDE_LAKE__SHARD_MAX_AGE_S": "0.5",
    }
    top.env[name] = env
    argv = [TIDE, "serve", "--model-path", "target", "--speculative-draft-model-path", "draft"]
    argv += ["--host", host.address, "--port", str(ENGINE_PORT), "--served-model-name", TARGET_ID]
    argv += ["--speculative-num-steps", "3", "--weight-version", draft_version]
    engine = netns.spawn(host, argv, env, home, home / "engine.log")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert engine.process.poll() is None, engine.tail()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{top.engine_url(name)}/health", timeout=5).status_code == 200:
                return engine
        time.sleep(1)
    raise AssertionError(f"{name} did not become healthy:\n{engine.tail()}")


def _drop_database(database: str) -> None:
    connection = psycopg2.connect("postgresql://postgres@127.0.0.1:5432/postgres")
    connection.autocommit = True
    with connection.cursor() as cursor:
        cursor.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    connection.close()


@pytest.fixture(scope="module")
def topology(
    tiny_target: Path, tiny_drafts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Topology]:
    reason = netns.available()
    if reason is not None:
        pytest.skip(f"multi-host test needs network namespaces: {reason}")
    root = tmp_path_factory.mktemp("hosts")
    database = f"tide_mh_{uuid.uuid4().hex[:8]}"
    redis.Redis(db=BROKER_DB).flushdb()
    with netns.network(HOST_NAMES) as net:
        data = net.hosts["data"].address
        config = load_config(
            store={"endpoint": f"http://{data}:{S3_PORT}", "timeout_s": 2.0},
            mlflow={"tracking_uri": f"http://{data}:{MLFLOW_PORT}"},
            lake={"prefix": PREFIX, "spool_dir": root / "test-spool", "commit_settle_s": 0},
        )
        top = Topology(net, root, config, {}, {})
        net.forward(POSTGRES_RELAY, ("127.0.0.1", 5432))
        net.forward(REDIS_RELAY, ("127.0.0.1", 6379))
        for name in HOST_NAMES:  # every host its own copy of what it serves or trains
            if name != "data":
                shutil.copytree(tiny_target, top.host_dir(name) / "stack" / "target")
                shutil.copytree(tiny_target, top.host_dir(name) / "target")
        secrets_env = {
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(32),
            "AIRFLOW__API__SECRET_KEY": secrets.token_urlsafe(32),
        }
        try:
            _start_stack(
                top,
                "data",
                ["seaweedfs", "mlflow"],
                {
                    **_common_env(data),
                    **DATA_STACK_PORTS,
                    "TIDE_STACK__STATE_DIR": "stack",
                    "TIDE_STACK__HOST": data,
                    "TIDE_STACK__AIRFLOW": "false",
                    "TIDE_STACK__START_TIMEOUT_S": "300",
                },
            )
            registry = DraftRegistry(config.mlflow.tracking_uri, TARGET_ID)
            static = registry.seed_champion(tiny_drafts["en"])
            version = f"{registry.name}-v{static.version}"
            for name in ("engine-1", "engine-2"):
                shutil.copytree(tiny_drafts["en"], top.host_dir(name) / "draft")
                top.engines[name] = _start_engine(top, name, version)
            for name, services in (
                ("control", CONTROL_SERVICES),
                ("trainer", ["airflow-worker-mi250"]),
                ("trainer-2", ["airflow-worker-mi250"]),
            ):
                env = {**_common_env(data), **_airflow_env(net, name, database), **secrets_env}
                _start_stack(top, name, services, env)
            yield top
        finally:
            for engine in top.engines.values():
                engine.stop()
            for name in ("trainer-2", "trainer", "control", "data"):
                if name in top.env:
                    net.restore(name)
                    with contextlib.suppress(RuntimeError, OSError):
                        netns.run_on(
                            net.hosts[name],
                            [TIDE, "stack", "down"],
                            top.env[name],
                            top.host_dir(name),
                            300,
                        )
            _drop_database(database)


# -- what the tests look at ------------------------------------------------------------


def _send_traffic(top: Topology, engines: list[str], count: int) -> None:
    documents = load_corpus().domain("ko_chat")
    for index in range(count):
        document = documents[(top.sent + index) % len(documents)]
        url = top.engine_url(engines[index % len(engines)])
        response = httpx.post(
            f"{url}/generate",
            json={
                "text": render_prompt(document.turns[0]),
                "sampling_params": {"max_new_tokens": 16},
            },
            headers=AUTH,
            timeout=300,
        )
        assert response.status_code == 200, response.text
    top.sent += count


def _metric(url: str, name: str) -> float:
    return metric_value(httpx.get(f"{url}/metrics", timeout=30).text, name)


def _lake_records(top: Topology) -> list[str]:
    """Request ids of every committed record (one per captured request, if exactly once)."""
    store = ObjectStore(top.config.store, top.config.store.lake_bucket)
    reader = LakeReader(store, top.config.lake)
    shards = reader.list_shards(target_slug(TARGET_ID))
    return [sample.request_id for sample in reader.iter_records(shards)]


def _wait_for_lake(top: Topology, timeout_s: float = 240) -> list[str]:
    """Every request captured (or skipped) by the engines, and every capture committed."""
    urls = [top.engine_url(name) for name in ("engine-1", "engine-2")]
    deadline = time.monotonic() + timeout_s
    while True:
        captured = sum(_metric(url, "tide:capture_records_total") for url in urls)
        skipped = sum(_metric(url, "tide:capture_skipped_total") for url in urls)
        with contextlib.suppress(OSError):
            records = _lake_records(top)
            if captured + skipped >= top.sent and len(records) >= captured:
                assert skipped == 0, "every request of these tests is captured"
                return records
        assert time.monotonic() < deadline, f"{captured=} {skipped=} sent={top.sent}"
        time.sleep(2)


def _weight_version(top: Topology, name: str) -> str:
    response = httpx.get(f"{top.engine_url(name)}/get_weight_version", headers=AUTH, timeout=30)
    return str(response.json()["weight_version"])


def _registry(top: Topology) -> DraftRegistry:
    return DraftRegistry(top.config.mlflow.tracking_uri, TARGET_ID)


def _versions(top: Topology) -> list[str]:
    registry = _registry(top)
    found = registry.client.search_model_versions(f"name = '{registry.name}'")
    return sorted((str(v.version) for v in found), key=int)


def _check_state(top: Topology, versions: int, champion: str, served: dict[str, str]) -> None:
    """Versions registered, the champion alias, each engine's weight version, the lake."""
    registry = _registry(top)
    assert len(_versions(top)) == versions
    alias = registry.alias(CHAMPION)
    assert alias is not None and alias.version == champion
    for name, version in served.items():
        assert _weight_version(top, name) == f"{registry.name}-v{version}", name
    records = _wait_for_lake(top)
    assert len(records) == top.sent, f"{len(records)} records for {top.sent} requests"
    assert len(set(records)) == len(records), "a record reached the lake twice"


def _trigger(top: Topology) -> str:
    """Start a cycle (once the dag-processor has parsed the DAG); its run id."""
    run_id = f"mh-{uuid.uuid4().hex[:8]}"
    deadline = time.monotonic() + 300
    while True:
        with contextlib.suppress(httpx.HTTPError):
            response = top.api.post(
                "/api/v2/dags/tide_adaptation/dagRuns",
                json={"logical_date": None, "dag_run_id": run_id},
            )
            if response.status_code == 200:
                return run_id
        assert time.monotonic() < deadline, "tide_adaptation never became triggerable"
        time.sleep(5)


def _run_state(top: Topology, run_id: str) -> str:
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        url = f"/api/v2/dags/tide_adaptation/dagRuns/{run_id}"
        return str(top.api.get(url).json()["state"])
    return "unknown"


def _wait_for_run(top: Topology, run_id: str, timeout_s: float = 900) -> tuple[str, str]:
    """(run id, final state)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (state := _run_state(top, run_id)) in ("success", "failed"):
            return run_id, state
        time.sleep(5)
    raise AssertionError(f"run {run_id} did not finish in {timeout_s:.0f} s")


def _task_states(top: Topology, run_id: str) -> dict[str, str]:
    url = f"/api/v2/dags/tide_adaptation/dagRuns/{run_id}/taskInstances"
    instances = top.api.get(url).json()["task_instances"]
    return {item["task_id"]: item["state"] for item in instances}


# -- the tests, in order ----------------------------------------------------------------


@pytest.mark.timeout(2400)  # five hosts' services start on two cores
def test_a_cycle_runs_across_hosts(topology: Topology) -> None:
    top = topology
    _send_traffic(top, ["engine-1", "engine-2"], 24)
    _wait_for_lake(top)
    run_id, state = _wait_for_run(top, _trigger(top))
    assert state == "success", _task_states(top, run_id)
    trained_on = [
        host
        for host in ("trainer", "trainer-2")
        if top.task_log(host, run_id, "train", 1).is_file()
    ]
    assert len(trained_on) == 1, "train ran on exactly one trainer host"
    assert not top.task_log("control", run_id, "train", 1).is_file()
    assert top.task_log("control", run_id, "promote", 1).is_file()
    _check_state(top, versions=2, champion="2", served={"engine-1": "2", "engine-2": "2"})
    for name in HOST_NAMES:  # task scratch space is removed when each task ends
        scratch = top.host_dir(name) / "stack" / "scratch"
        assert not scratch.is_dir() or not any(scratch.iterdir()), name


@pytest.mark.timeout(1800)
def test_training_resumes_on_another_trainer_after_a_link_loss(topology: Topology) -> None:
    top = topology
    _send_traffic(top, ["engine-1", "engine-2"], 24)
    _wait_for_lake(top)
    run_id = _trigger(top)
    checkpoints = f"{PREFIX}/_state/target={target_slug(TARGET_ID)}/cycles/{run_id}/checkpoints/"
    store = ObjectStore(top.config.store, top.config.store.lake_bucket)
    deadline = time.monotonic() + 900
    while not any(store.list(checkpoints)):  # mid-training: the first checkpoint is in S3
        assert time.monotonic() < deadline, _task_states(top, run_id)
        time.sleep(0.5)
    first = next(
        h for h in ("trainer", "trainer-2") if top.task_log(h, run_id, "train", 1).is_file()
    )
    other = "trainer-2" if first == "trainer" else "trainer"
    top.net.cut(first)
    try:
        run_id, state = _wait_for_run(top, run_id)
    finally:
        top.net.restore(first)
    assert state == "success", _task_states(top, run_id)
    retry_log = top.task_log(other, run_id, "train", 2)
    assert retry_log.is_file(), "the retry ran on the other trainer host"
    assert "resuming from the mirrored checkpoint" in retry_log.read_text()
    registry = _registry(top)
    experiment = registry.client.get_experiment_by_name(registry.name)
    runs = registry.client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`tide.cycle_id` = '{run_id}'"
    )
    assert len(runs) == 1, "the retry continued the cycle's MLflow run"
    assert not any(store.list(checkpoints)), "registered: the cycle's checkpoints are gone"
    _check_state(top, versions=3, champion="3", served={"engine-1": "3", "engine-2": "3"})


@pytest.mark.timeout(1800)
def test_an_unreachable_engine_rolls_the_promotion_back(topology: Topology) -> None:
    top = topology
    top.net.cut("engine-2")
    try:
        _send_traffic(top, ["engine-1"], 24)
        run_id, state = _wait_for_run(top, _trigger(top))
        assert state == "failed"
        assert _task_states(top, run_id)["promote"] == "failed"
        why = top.task_log("control", run_id, "promote", 1).read_text()
        assert "rolled back" in why and top.engine_url("engine-2") in why
    finally:
        top.net.restore("engine-2")
    registry = _registry(top)
    challenger = registry.alias("challenger")
    assert challenger is not None and challenger.version == "4"
    _check_state(top, versions=4, champion="3", served={"engine-1": "3", "engine-2": "3"})


@pytest.mark.timeout(1200)
def test_captures_survive_the_data_host_being_cut_off(topology: Topology) -> None:
    top = topology
    before = len(_wait_for_lake(top))
    top.net.cut("data")
    try:
        _send_traffic(top, ["engine-1", "engine-2"], 16)  # serving goes on; capture spools
        time.sleep(5)
    finally:
        top.net.restore("data")
    records = _wait_for_lake(top)
    assert len(records) == before + 16
    _check_state(top, versions=4, champion="3", served={"engine-1": "3", "engine-2": "3"})
