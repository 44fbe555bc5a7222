"""Decisions become MLflow version tags and a report; the plot becomes a run artifact."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest

from tide_lib.config import GateConfig, TideConfig
from tide_lib.evaluation.gate import decide, decision_from_tags
from tide_lib.evaluation.plot import plot_acceptance
from tide_lib.evaluation.tracking import log_acceptance_plot, log_decision
from tide_lib.registry import DraftRegistry


def test_plot_is_a_png(tmp_path: Path) -> None:
    history = {"v1": {"recent": 1.2, "older": 3.9}, "v2": {"recent": 2.4, "older": 3.7}}
    path = plot_acceptance(history, tmp_path / "al.png", k=4)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


@pytest.mark.slow
def test_decision_and_plot_reach_mlflow(stack: TideConfig, tmp_path: Path) -> None:
    client = mlflow.MlflowClient(stack.mlflow.tracking_uri)
    run = client.create_run(client.create_experiment("tide-eval-test"))
    client.create_registered_model("tide-draft-eval-test")
    version = client.create_model_version(
        "tide-draft-eval-test", "s3://x/draft", run_id=run.info.run_id
    )
    registry = DraftRegistry(stack.mlflow.tracking_uri, "eval-test")
    decision = decide({"recent": 2.5, "older": 3.05}, {"recent": 2.0, "older": 3.1}, GateConfig())
    report = log_decision(registry, version.version, decision, k=4)
    tags = client.get_model_version("tide-draft-eval-test", version.version).tags
    assert tags["tide.gate.decision"] == "promote" and tags["tide.al.recent.k4"] == "2.5000"
    metrics = client.get_run(run.info.run_id).data.metrics  # charts in the MLflow UI
    assert metrics["eval.accept_length.recent.k4"] == 2.5
    assert metrics["eval.champion_accept_length.older.k4"] == 3.1
    assert metrics["eval.weighted_accept_length.k4"] == pytest.approx(decision.weighted_challenger)
    history = client.get_metric_history(run.info.run_id, "eval.accept_length.older.k4")
    assert [(m.value, m.step) for m in history] == [(3.05, int(version.version))]
    log_acceptance_plot(stack.mlflow.tracking_uri, run.info.run_id, {"v1": {"recent": 2.5}}, k=4)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "evaluation")}
    assert artifacts == {"evaluation/acceptance_length_k4.png"}
    gate = {a.path for a in client.list_artifacts(run.info.run_id, "gate")}
    assert gate == {f"gate/decision-v{version.version}.md"} and "PROMOTE" in report


@pytest.mark.slow
def test_a_rejudged_version_keeps_no_figures_of_the_judging_that_died(stack: TideConfig) -> None:
    """A judging that died midway left a floor and a segment this one does not have;
    read back, the new decision must not carry them."""
    client = mlflow.MlflowClient(stack.mlflow.tracking_uri)
    client.create_registered_model("tide-draft-rejudge-test")
    version = client.create_model_version("tide-draft-rejudge-test", "s3://x/draft").version
    registry = DraftRegistry(stack.mlflow.tracking_uri, "rejudge-test")
    died = {
        "tide.gate.floor_version": "1",
        "tide.gate.floor_al.recent.k4": "3.0000",
        "tide.al.cluster-3.k4": "1.5000",
        "tide.gate.replay": "every_position",
    }
    registry.set_tags(version, died)
    decision = decide({"recent": 2.5}, {"recent": 2.0}, GateConfig(floor=False))
    log_decision(registry, version, decision, k=4)
    tags = registry.get(version).tags
    assert tags["tide.gate.replay"] == "every_position"  # how it was measured: kept
    assert not {"tide.gate.floor_version", "tide.gate.floor_al.recent.k4"} & tags.keys()
    assert "tide.al.cluster-3.k4" not in tags and tags["tide.al.recent.k4"] == "2.5000"
    read_back = decision_from_tags(tags, 4)
    assert read_back is not None and read_back.floor is None and read_back.floor_version is None
    assert read_back.challenger == {"recent": 2.5}
