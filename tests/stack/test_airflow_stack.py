"""`tide stack up` with Airflow: api-server, scheduler, dag-processor and triggerer come up
with the project's airflow.cfg, parse TIDE's DAGs and serve the TIDE plugin view."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tide_lib.config import TideConfig
from tide_lib.stack import SERVICES, StackManager

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
        deadline = time.monotonic() + 120
        dag_ids: set[str] = set()
        while time.monotonic() < deadline:
            dags = httpx.get(f"{base}/api/v2/dags", timeout=10).json().get("dags", [])
            dag_ids = {dag["dag_id"] for dag in dags}
            if {"tide_adaptation", "tide_rollback", "tide_lake_retention"} <= dag_ids:
                break
            time.sleep(2)
        assert {"tide_adaptation", "tide_rollback", "tide_lake_retention"} <= dag_ids
        page = httpx.get(f"{base}/tide/", timeout=30)
        assert page.status_code == 200 and "Recent cycles" in page.text
        plugins = httpx.get(f"{base}/api/v2/plugins", timeout=10).json()["plugins"]
        assert any(p["name"] == "tide" for p in plugins)
    finally:
        airflow_only.down()
