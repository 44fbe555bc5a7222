"""`tide stack up` with CeleryExecutor: Postgres metadata DB, Redis broker, one worker per queue.

The scheduler, not a test harness, runs a whole ``tide_adaptation`` cycle on
captured traffic; the training task goes through the ``mi250`` queue to the
``mi250`` worker and every other task to the ``default`` worker. On this
production-shaped stack, anonymous calls to the Airflow API, the TIDE view,
MLflow and an engine's admin route are refused and logged-in ones work.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from pathlib import Path

import httpx
import psycopg2
import pytest
import redis
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import SPARE_PORTS
from tests.serving.conftest import start_engine
from tide_lib.config import TideConfig
from tide_lib.lake import LakeWriter, ObjectStore
from tide_lib.orchestration.assets import champion_asset, draft_asset, lake_asset
from tide_lib.registry import CHAMPION, DraftRegistry
from tide_lib.stack import SERVICES, StackManager, free_ports
from tide_lib.stack.airflow_api import AirflowAPI
from tide_lib.target_model import load_corpus
from tide_lib.target_model.hidden import capture_records

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
POSTGRES = "postgresql+psycopg2://postgres@127.0.0.1:5432"
BROKER_DB = 7


def _capture_korean_traffic(config: TideConfig, tiny_target: Path, target_id: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    documents = load_corpus().domain("ko_chat")[:40]
    with LakeWriter(ObjectStore(config.store, config.store.lake_bucket), config.lake) as writer:
        for record in capture_records(model, tokenizer, documents, target_id=target_id):
            assert writer.submit(record)
        assert writer.flush(timeout=60)


def _wait_for_run(api: AirflowAPI, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    runs: list[dict] = []
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):  # a busy API server: ask again
            response = api.get("/api/v2/dags/tide_adaptation/dagRuns")
            runs = response.json().get("dag_runs", []) if response.status_code == 200 else []
        finished = [run for run in runs if run["state"] in ("success", "failed")]
        if finished:
            return finished[0]
        time.sleep(5)
    raise AssertionError(f"no tide_adaptation run finished in {timeout_s:.0f} s: {runs}")


def _assert_asset_events(api: AirflowAPI, run: dict, version: str) -> None:
    """The API lists the cycle's asset events: its window, the new version, the champion."""
    response = api.get(
        "/api/v2/assets/events",
        params={"source_dag_id": "tide_adaptation", "source_run_id": run["dag_run_id"]},
    )
    assert response.status_code == 200, response.text
    events = {event["name"]: event for event in response.json()["asset_events"]}
    lake, draft, champion = (
        asset("tiny-celery") for asset in (lake_asset, draft_asset, champion_asset)
    )
    assert set(events) == {lake.name, draft.name, champion.name}
    assert events[lake.name]["source_task_id"] == "snapshot"
    assert events[lake.name]["extra"]["window_tokens"] >= 200
    assert events[draft.name]["extra"]["version"] == version
    assert events[champion.name]["uri"] == champion.uri
    assert events[champion.name]["extra"]["version"] == version
    assert events[champion.name]["source_task_id"] == "promote"


def _assert_airflow_logins(config: TideConfig) -> None:
    base = f"http://127.0.0.1:{config.stack.airflow_port}"
    for path in ("/api/v2/dags", "/tide/"):
        assert httpx.get(f"{base}{path}", timeout=30).status_code == 401, path
    assert httpx.get(f"{base}/auth/token", timeout=30).status_code == 403  # no all-admins
    wrong = httpx.post(
        f"{base}/auth/token", json={"username": "admin", "password": "guess"}, timeout=30
    )
    assert wrong.status_code == 401
    admin, viewer = AirflowAPI.for_stack(config), AirflowAPI.for_stack(config, "viewer")
    for api in (admin, viewer):
        assert api.get("/api/v2/dags").status_code == 200
        page = api.get("/tide/", params={"target": "tiny-celery"})
        assert page.status_code == 200 and "Recent cycles" in page.text
    # Roles: a viewer may look but not trigger.
    trigger = viewer.post("/api/v2/dags/tide_rollback/dagRuns", json={"logical_date": None})
    assert trigger.status_code == 403


def _assert_mlflow_logins(tracking_uri: str) -> None:
    url = f"{tracking_uri}/api/2.0/mlflow/registered-models/search"
    assert httpx.get(url, timeout=30).status_code == 401
    login = (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"])
    assert httpx.get(url, auth=login, timeout=30).status_code == 200
    assert httpx.get(url, auth=(login[0], "guess"), timeout=30).status_code == 401


def _assert_engine_admin_key(
    stack: TideConfig, tiny_target: Path, tmp_path: Path, registry: DraftRegistry, version: str
) -> None:
    keys = {
        "TIDE_SERVE__API_KEY": "k-" + uuid.uuid4().hex,
        "TIDE_SERVE__ADMIN_API_KEY": "a-" + uuid.uuid4().hex,
    }
    draft = registry.download(version, tmp_path / "champion")
    engine = start_engine(
        tmp_path, tiny_target, "--speculative-draft-model-path", str(draft), stack=stack, env=keys
    )
    try:
        swap = f"{engine.url}/update_weights_from_disk"
        body = {"model_path": registry.model_uri(version), "weight_version": "swapped"}
        user = {"Authorization": f"Bearer {keys['TIDE_SERVE__API_KEY']}"}
        admin = {"Authorization": f"Bearer {keys['TIDE_SERVE__ADMIN_API_KEY']}"}
        assert httpx.post(swap, json=body, timeout=60).status_code == 401
        assert httpx.post(swap, json=body, headers=user, timeout=60).status_code == 401
        assert httpx.get(f"{engine.url}/model_info", timeout=30).status_code == 401
        assert httpx.post(swap, json=body, headers=admin, timeout=300).status_code == 200
        served = httpx.get(f"{engine.url}/get_weight_version", headers=user, timeout=30)
        assert served.json()["weight_version"] == "swapped"
    finally:
        engine.stop()


@pytest.mark.timeout(1800)  # stack start, traffic capture and a whole cycle on 2 cores
def test_scheduler_runs_a_cycle_with_training_on_the_mi250_worker(
    stack: TideConfig, tiny_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    database = f"tide_celery_{uuid.uuid4().hex[:8]}"
    prefix = f"celery-{uuid.uuid4().hex[:6]}"
    redis.Redis(db=BROKER_DB).flushdb()  # no stale messages from an interrupted run
    config = stack.model_copy(
        update={
            "stack": stack.stack.model_copy(
                update={
                    "state_dir": tmp_path,
                    "airflow": True,
                    "executor": "CeleryExecutor",
                    "airflow_database_url": f"{POSTGRES}/{database}",
                    "celery_broker_url": f"redis://127.0.0.1:6379/{BROKER_DB}",
                    "worker_log_port": free_ports(1, SPARE_PORTS + 50)[0],
                }
            ),
            "lake": stack.lake.model_copy(
                update={"prefix": prefix, "spool_dir": tmp_path / "spool"}
            ),
        }
    )
    _capture_korean_traffic(config, tiny_target, "tiny-celery")
    # What the Airflow processes (and so every task) read: the cycle's settings.
    for key, value in {
        "TIDE_LAKE__PREFIX": prefix,
        "TIDE_LAKE__SPOOL_DIR": str(tmp_path / "task-spool"),
        "TIDE_LAKE__COMMIT_SETTLE_S": "5",
        "TIDE_CYCLE__TARGET_ID": "tiny-celery",
        "TIDE_CYCLE__TARGET_PATH": str(tiny_target),
        "TIDE_CYCLE__MIN_NEW_TOKENS": "200",
        "TIDE_TRAINING__STEPS": "10",
        "TIDE_TRAINING__TTT_LENGTH": "2",
        "TIDE_TRAINING__DRAFT_VOCAB_SIZE": "512",
        "TIDE_GATE__K": "3",
    }.items():
        monkeypatch.setenv(key, value)
    airflow_only = StackManager(
        config, services=tuple(s for s in SERVICES if s.name.startswith("airflow-"))
    )
    airflow_only.up()
    try:
        statuses = {s.name: s.healthy for s in airflow_only.status()}
        assert statuses == {
            "airflow-api-server": True,
            "airflow-scheduler": True,
            "airflow-dag-processor": True,
            "airflow-triggerer": True,
            "airflow-worker-default": True,
            "airflow-worker-mi250": True,
        }
        # The hourly schedule starts a cycle as soon as the DAG is parsed; its sensor
        # finds the captured tokens.
        run = _wait_for_run(AirflowAPI.for_stack(airflow_only.config), timeout_s=600)
        logs = {
            queue: airflow_only.log_file(
                next(s for s in SERVICES if s.name == f"airflow-worker-{queue}")
            ).read_text()
            for queue in ("default", "mi250")
        }
        assert run["state"] == "success", logs
        assert "task_id='train'" in logs["mi250"]
        assert "task_id='train'" not in logs["default"]
        for task_id in ("snapshot", "register", "evaluate", "promote", "advance_watermark"):
            assert f"task_id='{task_id}'" in logs["default"]
            assert f"task_id='{task_id}'" not in logs["mi250"]
        registry = DraftRegistry(stack.mlflow.tracking_uri, "tiny-celery")
        champion = registry.alias(CHAMPION)
        assert champion is not None and champion.tags["tide.cycle_id"] == run["dag_run_id"]
        _assert_asset_events(AirflowAPI.for_stack(airflow_only.config), run, champion.version)
        _assert_airflow_logins(airflow_only.config)
        _assert_mlflow_logins(stack.mlflow.tracking_uri)
        _assert_engine_admin_key(stack, tiny_target, tmp_path, registry, champion.version)
    finally:
        airflow_only.down()
        connection = psycopg2.connect("postgresql://postgres@127.0.0.1:5432/postgres")
        connection.autocommit = True
        with connection.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        connection.close()
