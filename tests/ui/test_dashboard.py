"""The TIDE view: data from the real MLflow registry, rendered, and loaded as an Airflow plugin."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import mlflow
import pytest
from fastapi.testclient import TestClient

from tide_lib.config import GateConfig, TideConfig
from tide_lib.evaluation.gate import decide
from tide_lib.evaluation.tracking import log_decision
from tide_lib.registry import DraftRegistry
from tide_lib.ui.dashboard import create_app, dashboard_data, render_dashboard

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"


@pytest.fixture
def populated(stack: TideConfig, tiny_drafts: dict[str, Path]) -> tuple[TideConfig, str]:
    target_id = f"ui-{uuid.uuid4().hex[:6]}"
    registry = DraftRegistry(stack.mlflow.tracking_uri, target_id)
    client = mlflow.MlflowClient(stack.mlflow.tracking_uri)
    experiment = client.create_experiment(registry.name)
    champion: dict[str, float] | None = None
    for cycle, (language, recent, older) in enumerate(
        [("en", 1.3, 3.9), ("ko", 2.6, 3.8), ("en", 2.5, 3.2)]
    ):
        run = client.create_run(experiment).info.run_id
        version = registry.register(tiny_drafts[language], run, cycle_id=f"cycle-{cycle}").version
        figures = {"recent": recent, "older": older}
        decision = decide(figures, champion, GateConfig(k=4))
        log_decision(registry, version, decision, k=4)
        if decision.promote:
            registry.promote(version)
            champion = figures
    config = stack.model_copy(
        update={"cycle": stack.cycle.model_copy(update={"target_id": target_id})}
    )
    return config, target_id


@pytest.mark.slow
def test_dashboard_shows_champion_cycles_and_plot(populated: tuple[TideConfig, str]) -> None:
    config, target_id = populated
    data = dashboard_data(config, target_id)
    assert data["aliases"] == {"champion": "2", "challenger": "3", "previous-champion": "1"}
    assert [c["decision"] for c in data["cycles"]] == ["promote", "promote", "reject"]
    # The figures are the evaluation's MLflow metrics, not the version tags: with a
    # version's acceptance-length tags gone, the view still shows its figures.
    assert [c["accept_length"] for c in data["cycles"]] == [
        {"recent": 1.3, "older": 3.9},
        {"recent": 2.6, "older": 3.8},
        {"recent": 2.5, "older": 3.2},
    ]
    registry = DraftRegistry(config.mlflow.tracking_uri, target_id)
    for key in list(registry.get("1").tags):
        if key.startswith("tide.al."):
            registry.client.delete_model_version_tag(registry.name, "1", key)
    assert dashboard_data(config, target_id)["cycles"][0]["accept_length"] == {
        "recent": 1.3,
        "older": 3.9,
    }
    page = render_dashboard(data)
    assert f"TIDE — {target_id}" in page
    assert "data:image/png;base64," in page
    assert f"#/models/tide-draft-{target_id}/versions/2" in page
    assert "3.200 vs champion 3.800 (drop 0.600" in page  # the rejected cycle's reason


@pytest.mark.slow
def test_dashboard_app_serves_html(
    populated: tuple[TideConfig, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config, target_id = populated
    monkeypatch.setenv("TIDE_MLFLOW__TRACKING_URI", config.mlflow.tracking_uri)
    response = TestClient(create_app()).get("/", params={"target": target_id})
    assert response.status_code == 200 and "Recent cycles" in response.text


def test_plugin_loads_in_airflow(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(tmp_path),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(PLUGINS),
    }
    script = (
        "from airflow import plugins_manager as p; apps, _ = p.get_fastapi_plugins(); "
        "print(sorted(a['url_prefix'] for a in apps)); print(p.get_import_errors())"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert "'/tide'" in result.stdout and "{}" in result.stdout


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed")
def test_dashboard_renders_in_headless_chromium(
    populated: tuple[TideConfig, str], tmp_path: Path
) -> None:
    config, target_id = populated
    page = tmp_path / "tide.html"
    page.write_text(render_dashboard(dashboard_data(config, target_id)))
    shot = tmp_path / "tide.png"
    subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1200,1400",
            f"--screenshot={shot}",
            page.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20000
