"""`tide stack up` with Airflow: api-server, scheduler, dag-processor and triggerer come up
with the project's airflow.cfg, parse TIDE's DAGs and serve the TIDE plugin view."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tide_lib.config import TideConfig
from tide_lib.stack import SERVICES, StackManager
from tide_lib.stack.airflow_api import AirflowAPI

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
