"""The draft registry on the real MLflow server: aliases, idempotent registration, downloads."""

from __future__ import annotations

import uuid
from pathlib import Path

import mlflow
import pytest
import torch
from safetensors.torch import load_file

from tide_lib.config import GateConfig, TideConfig
from tide_lib.evaluation.gate import decide
from tide_lib.evaluation.tracking import log_decision
from tide_lib.lake import target_slug
from tide_lib.registry import (
    BASELINE,
    CHALLENGER,
    CHAMPION,
    DRAFT_MODEL_TYPE,
    PREVIOUS_CHAMPION,
    DraftRegistry,
    registered_model_name,
)
from tide_lib.registry.uris import logged_model_id
from tide_lib.training.draft import InvalidCheckpointError

pytestmark = pytest.mark.slow


def _run(stack: TideConfig) -> str:
    client = mlflow.MlflowClient(stack.mlflow.tracking_uri)
    experiment = client.create_experiment(f"tide-registry-{uuid.uuid4().hex[:6]}")
    return str(client.create_run(experiment).info.run_id)


def test_register_promote_and_download(
    stack: TideConfig, tiny_drafts: dict[str, Path], tmp_path: Path
) -> None:
    target = f"org/model-{uuid.uuid4().hex[:6]}"
    registry = DraftRegistry(stack.mlflow.tracking_uri, target)
    assert registry.name == registered_model_name(target) == f"tide-draft-{target_slug(target)}"
    first = registry.register(
        tiny_drafts["en"], _run(stack), cycle_id="c1", tags={"tide.window": "w1"}
    )
    again = registry.register(tiny_drafts["en"], _run(stack), cycle_id="c1")
    assert again.version == first.version  # a rerun of the cycle registers nothing new
    assert registry.alias(CHALLENGER).version == first.version
    assert registry.alias(CHAMPION) is None

    registry.promote(first.version)
    second = registry.register(tiny_drafts["ko"], _run(stack), cycle_id="c2")
    registry.promote(second.version)
    assert registry.alias(CHAMPION).version == second.version
    assert registry.alias(PREVIOUS_CHAMPION).version == first.version
    assert registry.alias(CHAMPION).tags["tide.promoted"] == "true"
    # the gate's floor stays on the first champion however many follow
    assert registry.alias(BASELINE).version == first.version

    # Issue 15: each draft is an MLflow 3 logged model of its run, registered from it,
    # and the gate's figures are metrics of that model.
    model_id = logged_model_id(second.source)
    assert model_id is not None
    model = registry.client.get_logged_model(model_id)
    assert (model.source_run_id, model.model_type) == (second.run_id, DRAFT_MODEL_TYPE)
    assert str(model.status) in ("READY", "LoggedModelStatus.READY")
    artifacts = {Path(a.path).name for a in registry.client.list_logged_model_artifacts(model_id)}
    assert {"config.json", "model.safetensors"} <= artifacts
    decision = decide({"ko": 2.5}, {"ko": 2.0}, GateConfig())
    log_decision(registry, second.version, decision, k=3)
    model_metrics = {m.key: m.value for m in registry.client.get_logged_model(model_id).metrics}
    assert model_metrics["eval.accept_length.ko.k3"] == 2.5
    assert registry.find_by_tag("tide.cycle_id", "c2") == registry.get(second.version)

    downloaded = registry.download(second.version, tmp_path / "dl")
    original = load_file(tiny_drafts["ko"] / "model.safetensors")
    fetched = load_file(downloaded / "model.safetensors")
    assert all(torch.equal(original[key], fetched[key]) for key in original)


def test_invalid_checkpoint_is_never_registered(stack: TideConfig, tmp_path: Path) -> None:
    registry = DraftRegistry(stack.mlflow.tracking_uri, f"org/bad-{uuid.uuid4().hex[:6]}")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(InvalidCheckpointError):
        registry.register(tmp_path, _run(stack), cycle_id="bad")
    assert registry.find_by_tag("tide.cycle_id", "bad") is None


def test_a_retried_record_keeps_the_params_already_logged(stack: TideConfig) -> None:
    """MLflow refuses to change a param: a retried train task must not fail on it."""
    registry = DraftRegistry(stack.mlflow.tracking_uri, f"org/model-{uuid.uuid4().hex[:6]}")
    run_id = _run(stack)
    registry.record_run(run_id, params={"trained_replay_tokens": 120}, tags={"a": "1"})
    registry.record_run(
        run_id, params={"trained_replay_tokens": 96, "window_tokens": 700}, tags={"a": "2"}
    )
    run = mlflow.MlflowClient(stack.mlflow.tracking_uri).get_run(run_id)
    assert run.data.params == {"trained_replay_tokens": "120", "window_tokens": "700"}
    assert run.data.tags["a"] == "2"
