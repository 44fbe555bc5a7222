"""An Airflow home with a migrated metadata DB and the mi250 pool, once per session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tide_lib.config import TideConfig

DAGS = Path(__file__).resolve().parents[2] / "dags"
_DAG_TEST = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
from datetime import datetime
dag = DagBag(dag_folder=sys.argv[1]).dags[sys.argv[2]]
options = json.loads(sys.argv[4])
if "logical_date" in options:  # run_after too: the run id is made from it
    options["logical_date"] = options["run_after"] = datetime.fromisoformat(options["logical_date"])
run = dag.test(run_conf=json.loads(sys.argv[3]), **options)
print(json.dumps({"state": str(run.state), "run_id": run.run_id}))
"""


_XCOMS = """
import json, sys
from airflow.models.xcom import XComModel
from airflow.utils.session import create_session
with create_session() as session:
    rows = session.query(XComModel).filter(
        XComModel.dag_id == sys.argv[1], XComModel.run_id == sys.argv[2]
    )
    print(json.dumps({f"{row.task_id}/{row.key}": row.value for row in rows}, default=str))
"""


def _query(env: dict[str, str], script: str, *args: str) -> Any:
    """Run a metadata-DB query script in a fresh interpreter; its last line is JSON."""
    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def xcoms(env: dict[str, str], dag_id: str, run_id: str) -> dict[str, object]:
    """Every XCom a run left in the metadata DB, by ``task_id/key``, as stored."""
    values: dict[str, object] = _query(env, _XCOMS, dag_id, run_id)
    return values


_ASSET_EVENTS = """
import json, sys
from airflow.models.asset import AssetEvent, AssetModel
from airflow.utils.session import create_session
with create_session() as session:
    rows = (
        session.query(AssetEvent, AssetModel)
        .join(AssetModel, AssetModel.id == AssetEvent.asset_id)
        .filter(AssetEvent.source_dag_id == sys.argv[1], AssetEvent.source_run_id == sys.argv[2])
    )
    print(json.dumps([
        {"asset": asset.name, "uri": asset.uri, "task": event.source_task_id, "extra": event.extra}
        for event, asset in rows
    ]))
"""


def asset_events(env: dict[str, str], dag_id: str, run_id: str) -> list[dict[str, object]]:
    """The asset events a run emitted, as the API's ``/assets/events`` lists them (its table)."""
    events: list[dict[str, object]] = _query(env, _ASSET_EVENTS, dag_id, run_id)
    return events


def airflow(env: dict[str, str], *args: str) -> None:
    command = [str(Path(sys.executable).parent / "airflow"), *args]
    subprocess.run(command, env=env, check=True, capture_output=True, timeout=600)


@pytest.fixture(scope="session")
def airflow_env(stack: TideConfig, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(tmp_path_factory.mktemp("airflow")),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
        "TIDE_STORE__ENDPOINT": stack.store.endpoint,
        "TIDE_MLFLOW__TRACKING_URI": stack.mlflow.tracking_uri,
    }
    airflow(env, "db", "migrate")
    airflow(env, "pools", "import", str(DAGS.parent / "docker" / "pools.json"))
    return env


def dag_test(
    env: dict[str, str],
    dag_id: str,
    cwd: Path,
    conf: dict[str, object] | None = None,
    logical_date: str | None = None,
) -> dict:
    """Run ``dag.test()`` in a fresh interpreter (Airflow reads its config at import).

    The same ``logical_date`` twice reruns the same run: the same run id, its task
    instances cleared (what "Clear" does in the UI).
    """
    options = {"logical_date": logical_date} if logical_date else {}
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _DAG_TEST,
            str(DAGS),
            dag_id,
            json.dumps(conf or {}),
            json.dumps(options),
        ],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    outcome: dict = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["state"].endswith("success"), result.stderr[-4000:]
    outcome["output"] = result.stdout + result.stderr  # every task's log, in order
    return outcome
