"""`tide stack up` with CeleryExecutor: Postgres metadata DB, Redis broker, one worker per queue.

The scheduler, not a test harness, runs a whole ``tide_adaptation`` cycle on
captured traffic; the training task goes through the ``mi250`` queue to the
``mi250`` worker and every other task to the ``default`` worker.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from pathlib import Path

import httpx
import psycopg2
import pytest
import redis
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import SPARE_PORTS
from tide_lib.config import TideConfig
from tide_lib.lake import LakeWriter, ObjectStore
from tide_lib.registry import CHAMPION, DraftRegistry
from tide_lib.stack import SERVICES, StackManager, free_ports
from tide_lib.target import load_corpus
from tide_lib.target.hidden import capture_records

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


def _wait_for_run(base: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    runs: list[dict] = []
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):  # a busy API server: ask again
            response = httpx.get(f"{base}/api/v2/dags/tide_adaptation/dagRuns", timeout=30)
            runs = response.json().get("dag_runs", []) if response.status_code == 200 else []
        finished = [run for run in runs if run["state"] in ("success", "failed")]
        if finished:
            return finished[0]
        time.sleep(5)
    raise AssertionError(f"no tide_adaptation run finished in {timeout_s:.0f} s: {runs}")


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
        run = _wait_for_run(f"http://127.0.0.1:{config.stack.airflow_port}", timeout_s=600)
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
        champion = DraftRegistry(stack.mlflow.tracking_uri, "tiny-celery").alias(CHAMPION)
        assert champion is not None and champion.tags["tide.cycle_id"] == run["dag_run_id"]
    finally:
        airflow_only.down()
        connection = psycopg2.connect("postgresql://postgres@127.0.0.1:5432/postgres")
        connection.autocommit = True
        with connection.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        connection.close()
