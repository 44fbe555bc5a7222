"""`tide stack up` with Airflow: api-server, scheduler, dag-processor and triggerer come up
with the project's airflow.cfg, parse TIDE's DAGs and serve the TIDE plugin view."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tide_lib.config import TideConfig
from tide_lib.stack import SERVICES, StackManager
from tide_lib.stack.airflow_api import AirflowAPI
from tide_lib.stack.services import repo_root

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_airflow_services_start_and_parse_the_dags(stack: TideConfig, tmp_path: Path) -> None:
    config = stack.model_copy(
        update={"stack": stack.stack.model_copy(update={"state_dir": tmp_path, "airflow": True})}
    )
    airflow_only = StackManager(
        config, services=tuple(s for s in SERVICES if s.name.startswith("airflow-"))
    )
    airflow_only.up()
    try:
        statuses = airflow_only.status()
        assert [s.name for s in statuses] == [
            "airflow-api-server",
            "airflow-scheduler",
            "airflow-dag-processor",
            "airflow-triggerer",
        ]
        assert all(s.healthy for s in statuses)
        base = f"http://127.0.0.1:{config.stack.airflow_port}"
        api = AirflowAPI.for_stack(airflow_only.config)
        deadline = time.monotonic() + 120
        dag_ids: set[str] = set()
        while time.monotonic() < deadline:
            dags = api.get("/api/v2/dags").json().get("dags", [])
            dag_ids = {dag["dag_id"] for dag in dags}
            if {"tide_adaptation", "tide_rollback", "tide_lake_retention"} <= dag_ids:
                break
            time.sleep(2)
        assert {"tide_adaptation", "tide_rollback", "tide_lake_retention"} <= dag_ids
        # The trigger form is CycleConfig's schema: a value outside a field's limits is
        # refused by the API before a run exists (held_out_percent: 1..50).
        runs = "/api/v2/dags/tide_adaptation/dagRuns"
        bad = {"logical_date": None, "conf": {"held_out_percent": 80}}
        refused = api.post(runs, json=bad)
        while refused.status_code in (404, 500) and time.monotonic() < deadline + 120:
            # 404: listed (the database) before this parse is serialized; 500: the
            # audit-log insert met SQLite's lock while the retention DAG runs
            time.sleep(2)
            refused = api.post(runs, json=bad)
        assert refused.status_code == 400, refused.text
        assert "held_out_percent" in refused.text or "50" in refused.text
        listed = api.get(runs).json()["dag_runs"]  # the schedule may have started one
        assert not [run for run in listed if run["run_type"] == "manual"]
        # The training pool comes from docker/pools.json, as in compose and Helm.
        pool = api.get("/api/v2/pools/mi250").json()
        declared = json.loads((repo_root() / "docker" / "pools.json").read_text())["mi250"]
        assert (pool["slots"], pool["description"]) == (declared["slots"], declared["description"])
        page = api.get("/tide/")
        assert page.status_code == 200 and "Recent cycles" in page.text
        # Logins are on by default: anonymous callers get nothing.
        assert httpx.get(f"{base}/tide/", timeout=30).status_code == 401
        assert httpx.get(f"{base}/api/v2/dags", timeout=30).status_code == 401
        assert httpx.get(f"{base}/auth/token", timeout=30).status_code == 403
        plugins = api.get("/api/v2/plugins").json()["plugins"]
        assert any(p["name"] == "tide" for p in plugins)
    finally:
        airflow_only.down()
