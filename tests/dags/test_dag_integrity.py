"""DAG integrity: the DAG files parse fast, light and wired as the design says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tide_lib.config import CycleConfig

DAGS = Path(__file__).resolve().parents[2] / "dags"

_PARSE = """
import json, sys
from airflow.sdk import BaseHook, Variable
def forbidden(*args, **kwargs):
    raise RuntimeError("connection or variable lookup at parse time")
BaseHook.get_connection = forbidden
Variable.get = forbidden
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1])
HEAVY = {"torch", "transformers", "specforge", "mlflow", "minio", "pyarrow"}
heavy = sorted({m.split(".")[0] for m in sys.modules} & HEAVY)
from airflow.serialization.serialized_objects import DagSerialization
dags = {}
for dag_id, dag in bag.dags.items():
    # what the dag-processor stores and the API server reads back (trigger, grid)
    DagSerialization.from_dict(DagSerialization.to_dict(dag))
    dags[dag_id] = {
        "tags": sorted(dag.tags),
        "max_active_runs": dag.max_active_runs,
        "params": sorted(dag.params.keys()),
        "tasks": {
            t.task_id: {
                "retries": t.retries,
                "queue": t.queue,
                "pool": t.pool,
                "trigger_rule": getattr(t.trigger_rule, "value", t.trigger_rule),
                "upstream": sorted(t.upstream_task_ids),
                "ignore_downstream_trigger_rules": getattr(
                    t, "ignore_downstream_trigger_rules", None
                ),
                "soft_fail": getattr(t, "soft_fail", None),
                "inlets": sorted(a.name for a in t.inlets),
                "outlets": sorted(a.name for a in t.outlets),
            }
            for t in dag.tasks
        },
    }
errors = {k: str(v) for k, v in bag.import_errors.items()}
print(json.dumps({"errors": errors, "heavy": heavy, "dags": dags}))
"""


@pytest.fixture(scope="module")
def parsed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(tmp_path_factory.mktemp("airflow")),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
    }
    result = subprocess.run(
        [sys.executable, "-c", _PARSE, str(DAGS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_no_import_errors(parsed: dict) -> None:
    assert parsed["errors"] == {}
    assert "tide_adaptation" in parsed["dags"]


def test_no_heavy_imports_or_lookups_at_parse_time(parsed: dict) -> None:
    assert parsed["heavy"] == []


def test_tags_and_retries(parsed: dict) -> None:
    for dag_id, dag in parsed["dags"].items():
        assert "tide" in dag["tags"], dag_id
        retried = [task for task, spec in dag["tasks"].items() if spec["retries"] > 0]
        assert retried, f"{dag_id} has no task with retries"


def test_adaptation_wiring(parsed: dict) -> None:
    dag = parsed["dags"]["tide_adaptation"]
    assert dag["max_active_runs"] == 1
    assert dag["tasks"]["train"]["queue"] == "mi250" and dag["tasks"]["train"]["pool"] == "mi250"
    assert dag["tasks"]["promote"]["retries"] == 0  # a fleet rollout is not blindly retried
    per_run = set(CycleConfig.model_fields) - {"schedule_minutes"}  # read at parse time
    assert set(dag["params"]) == per_run | {"gate_margin", "gate_tolerance"}


def test_a_cycle_without_drift_or_gain_skips_to_the_watermark(parsed: dict) -> None:
    """Issue 14: training and registration run only when they pay, and a skipped cycle
    still moves the watermark (its window is consumed, not retried forever)."""
    tasks = parsed["dags"]["tide_adaptation"]["tasks"]
    assert "check_drift" in tasks["train"]["upstream"]
    assert "challenger_improved" in tasks["register"]["upstream"]
    for gate in ("check_drift", "challenger_improved"):
        # Only the next task is skipped; the rest follow their trigger rules.
        assert tasks[gate]["ignore_downstream_trigger_rules"] is False
    assert tasks["advance_watermark"]["trigger_rule"] == "none_failed_min_one_success"
    assert {"snapshot", "promote"} <= set(tasks["advance_watermark"]["upstream"])
    # A quiet window skips the run instead of failing it (issue 15).
    assert tasks["wait_for_new_tokens"]["soft_fail"] is True


def test_the_loop_declares_its_assets(parsed: dict) -> None:
    """Issue 15: the lake window, the registered drafts and the champion are Assets:
    the adaptation DAG consumes and produces them, the rollback DAG moves the champion."""
    lake, drafts = "tide_lake_demo", "tide_draft_demo"
    champion = "tide_draft_demo_champion"
    tasks = parsed["dags"]["tide_adaptation"]["tasks"]
    assert tasks["snapshot"]["outlets"] == [lake]
    assert tasks["train"]["inlets"] == sorted([lake, champion])
    assert tasks["register"]["outlets"] == [drafts]
    assert tasks["promote"]["outlets"] == [champion]
    assert parsed["dags"]["tide_rollback"]["tasks"]["roll_back"]["outlets"] == [champion]
