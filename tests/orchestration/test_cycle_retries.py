"""Retries of every task of tide_adaptation, tide_rollback and tide_lake_retention.

Issue 13, part 6 ("retries that are no-ops"): Airflow reruns a task after a
failure, a lost host or a clear; each step must then do nothing new, or finish
what the earlier attempt left undone. Real MLflow and S3 (the session's stack),
the SGLang stub (SGLang 0.5.14's own request models and auth) as the fleet.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import mlflow
import pytest
from pydantic import SecretStr

from tests.conftest import make_record
from tests.contract.sglang_stub import StubServer, StubState, create_stub
from tide_lib.config import TideConfig
from tide_lib.lake import LakeReader, LakeWriter, ObjectStore, target_slug
from tide_lib.orchestration import cycle
from tide_lib.orchestration.handoff import Decision
from tide_lib.registry import CHAMPION, PREVIOUS_CHAMPION, DraftRegistry
from tide_lib.serving.fleet import FleetError

pytestmark = pytest.mark.slow

PROMOTE = Decision(promote=True, reason="test", challenger={"recent": 2.0}, champion=None)


def _config(stack: TideConfig, tmp_path: Path, **cycle_fields: Any) -> TideConfig:
    """The stack's config for a target and a lake prefix of this test's own."""
    tag = uuid.uuid4().hex[:6]
    return stack.model_copy(
        update={
            "lake": stack.lake.model_copy(
                update={
                    "prefix": f"retries-{tag}",
                    "spool_dir": tmp_path / "spool",
                    "commit_settle_s": 0.0,
                    "shard_max_age_s": 0.5,
                }
            ),
            "cycle": stack.cycle.model_copy(
                update={"target_id": f"retries-{tag}", "servers": [], **cycle_fields}
            ),
            "training": stack.training.model_copy(
                update={"steps": 4, "ttt_length": 2, "draft_vocab_size": 512, "batch_size": 2}
            ),
            "scratch_dir": tmp_path / "scratch",
        }
    )


def _alias(registry: DraftRegistry, alias: str) -> str:
    found = registry.alias(alias)
    assert found is not None, f"{registry.name} has no {alias}"
    return found.version


def _versions(registry: DraftRegistry, drafts: dict[str, Path]) -> list[str]:
    """v1 (en) then v2 (ko), each promoted: champion v2, previous-champion v1."""
    client = mlflow.MlflowClient(registry.tracking_uri)
    numbers = []
    for language in ("en", "ko"):
        run = client.create_run(registry.experiment_id()).info.run_id
        numbers.append(registry.register(drafts[language], run, cycle_id=language).version)
        registry.promote(numbers[-1])
    return numbers


@pytest.fixture
def fleet(stack: TideConfig, tmp_path: Path) -> Iterator[tuple[TideConfig, StubState]]:
    """A config whose fleet is one SGLang stub (keys on) that loads any version of its model."""
    config = _config(stack, tmp_path)
    name = DraftRegistry(config.mlflow.tracking_uri, config.cycle.target_id).name
    state = StubState(loadable={f"models:/{name}/{n}" for n in range(1, 5)})
    server = StubServer(create_stub(state, api_key="k-api", admin_api_key="k-admin"))
    serve = config.serve.model_copy(
        update={"api_key": SecretStr("k-api"), "admin_api_key": SecretStr("k-admin")}
    )
    cycle_section = config.cycle.model_copy(update={"servers": [server.url]})
    yield config.model_copy(update={"serve": serve, "cycle": cycle_section}), state
    server.stop()


# -- tide_rollback ---------------------------------------------------------------------------


def test_a_retried_rollback_is_a_no_op(
    fleet: tuple[TideConfig, StubState], tiny_drafts: dict[str, Path]
) -> None:
    """Defect 1: a retry of rollback(previous-champion) flipped the champion back (2 -> 1 -> 2).

    The DAG run remembers what it rolled back to (in the lake), so a retry of the same
    run returns the same result and touches neither the fleet nor the aliases.
    """
    config, state = fleet
    registry = DraftRegistry(config.mlflow.tracking_uri, config.cycle.target_id)
    v1, v2 = _versions(registry, tiny_drafts)

    first = cycle.rollback(config, PREVIOUS_CHAMPION, run_id="manual__r1")
    assert first == {"version": v1}
    assert state.weight_version == f"{registry.name}-v{v1}"
    updates = len(state.updates)
    for _ in range(2):  # Airflow's retry, then a clear of the finished task
        assert cycle.rollback(config, PREVIOUS_CHAMPION, run_id="manual__r1") == first
    assert _alias(registry, CHAMPION) == v1
    assert _alias(registry, PREVIOUS_CHAMPION) == v2
    assert len(state.updates) == updates  # the fleet was not touched again
    assert state.weight_version == f"{registry.name}-v{v1}"

    # another DAG run is another rollback: previous-champion is v2 now
    assert cycle.rollback(config, PREVIOUS_CHAMPION, run_id="manual__r2") == {"version": v2}
    assert _alias(registry, CHAMPION) == v2


def test_a_rollback_retried_after_failed_attempts_goes_to_the_version_first_chosen(
    fleet: tuple[TideConfig, StubState], tiny_drafts: dict[str, Path]
) -> None:
    """Defect 1: attempts that failed midway are finished by the retry, to the version the
    first attempt resolved, although ``previous-champion`` has moved since."""
    config, state = fleet
    registry = DraftRegistry(config.mlflow.tracking_uri, config.cycle.target_id)
    v1, v2 = _versions(registry, tiny_drafts)
    loadable = set(state.loadable)
    state.loadable.clear()  # attempt 1: the engine refuses the draft
    with pytest.raises(FleetError, match="rolled back"):
        cycle.rollback(config, PREVIOUS_CHAMPION, run_id="manual__r3")
    assert _alias(registry, CHAMPION) == v2
    # attempt 2 dies inside DraftRegistry.promote, after previous-champion moved to v2
    state.loadable |= loadable
    registry.client.set_registered_model_alias(registry.name, PREVIOUS_CHAMPION, v2)
    assert cycle.rollback(config, PREVIOUS_CHAMPION, run_id="manual__r3") == {"version": v1}
    assert _alias(registry, CHAMPION) == v1
    assert _alias(registry, PREVIOUS_CHAMPION) == v2
    assert state.weight_version == f"{registry.name}-v{v1}"


# -- tide_adaptation: promote ----------------------------------------------------------------


def test_a_retried_promote_is_a_no_op_and_finishes_an_interrupted_one(
    fleet: tuple[TideConfig, StubState], tiny_drafts: dict[str, Path]
) -> None:
    """Issue 13 part 6, promote: re-promoting the champion touches nothing; a promotion
    interrupted after the alias moved (tag not yet set) is finished by the retry."""
    config, state = fleet
    registry = DraftRegistry(config.mlflow.tracking_uri, config.cycle.target_id)
    client = mlflow.MlflowClient(config.mlflow.tracking_uri)
    run = client.create_run(registry.experiment_id()).info.run_id
    v1 = registry.register(tiny_drafts["en"], run, cycle_id="p1").version
    assert cycle.promote(config, v1, PROMOTE).promoted
    updates = len(state.updates)
    again = cycle.promote(config, v1, PROMOTE)
    assert not again.promoted and "already champion" in again.reason
    assert len(state.updates) == updates
    assert _alias(registry, CHAMPION) == v1

    v2 = registry.register(tiny_drafts["ko"], run, cycle_id="p2").version
    # what an attempt killed inside DraftRegistry.promote leaves: aliases moved, no tag
    client.set_registered_model_alias(registry.name, PREVIOUS_CHAMPION, v1)
    client.set_registered_model_alias(registry.name, CHAMPION, v2)
    assert not cycle.promote(config, v2, PROMOTE).promoted
    assert registry.get(v2).tags.get("tide.promoted") == "true"
    assert _alias(registry, PREVIOUS_CHAMPION) == v1


# -- tide_adaptation: train and register -----------------------------------------------------


def _capture(config: TideConfig, tiny_target: Path, documents: int = 16, skip: int = 0) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tide_lib.target_model import load_corpus
    from tide_lib.target_model.hidden import capture_records

    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    chats = load_corpus().domain("ko_chat")[skip : skip + documents]
    store = ObjectStore(config.store, config.store.lake_bucket)
    with LakeWriter(store, config.lake) as writer:
        for record in capture_records(model, tokenizer, chats, target_id=config.cycle.target_id):
            assert writer.submit(record)
        assert writer.flush(timeout=60)
    time.sleep(1.2)  # settled: S3's Last-Modified has one-second resolution


def _cycle_runs(registry: DraftRegistry, cycle_id: str) -> list[Any]:
    return list(
        registry.client.search_runs(
            [registry.experiment_id()], filter_string=f"tags.`tide.cycle_id` = '{cycle_id}'"
        )
    )


@pytest.mark.timeout(900)
def test_a_train_retry_leaves_no_run_running_and_registers_once(
    stack: TideConfig, tiny_target: Path, tmp_path: Path
) -> None:
    """Defect 2: a retried train left the first MLflow run RUNNING forever.

    The first attempt dies after creating the run (its host has no target); a second
    attempt, racing, dies right after creating a run of its own. The retry resumes
    the first run and finishes it; no run of the cycle is left RUNNING, and
    registering twice gives one version.
    """
    config = _config(stack, tmp_path, target_path=tiny_target)
    _capture(config, tiny_target)
    cycle_id = "scheduled__retry"
    snapshot = cycle.snapshot_window(config, cycle_id)
    registry = DraftRegistry(config.mlflow.tracking_uri, config.cycle.target_id)

    lost = config.model_copy(
        update={"cycle": config.cycle.model_copy(update={"target_path": tmp_path / "absent"})}
    )
    with pytest.raises(Exception):  # noqa: B017 - whatever the lost host raises
        cycle.train(lost, snapshot)
    (failed,) = _cycle_runs(registry, cycle_id)
    assert failed.info.status == "FAILED"  # not RUNNING, even if no retry ever comes

    registry.client.create_run(  # an attempt killed right after it created its run
        registry.experiment_id(), tags={"tide.cycle_id": cycle_id, "tide.parent_version": ""}
    )
    trained = cycle.train(config, snapshot)
    runs = {run.info.run_id: run.info.status for run in _cycle_runs(registry, cycle_id)}
    assert "RUNNING" not in runs.values(), runs
    assert trained.run_id == failed.info.run_id and runs[trained.run_id] == "FINISHED"

    version = cycle.register(config, snapshot, trained)
    assert cycle.register(config, snapshot, trained) == version  # the retry of register
    assert cycle.train(config, snapshot) == trained  # a train retry after register
    cycle_versions = [
        raw
        for raw in registry.client.search_model_versions(f"name = '{registry.name}'")
        if raw.tags.get("tide.cycle_id") == cycle_id
    ]
    assert [raw.version for raw in cycle_versions] == [version]


# -- tide_adaptation: snapshot, advance_watermark; tide_lake_retention -----------------------


def _write(config: TideConfig, index: int, finished_at: datetime | None = None) -> None:
    store = ObjectStore(config.store, config.store.lake_bucket)
    with LakeWriter(store, config.lake) as writer:
        record = make_record(index, target_id=config.cycle.target_id, finished_at=finished_at)
        assert writer.submit(record)
        assert writer.flush(timeout=60)
    time.sleep(1.2)  # settled: S3's Last-Modified has one-second resolution


def test_snapshot_and_watermark_retries_never_move_the_window(
    stack: TideConfig, tmp_path: Path
) -> None:
    """Issue 13 part 6: a snapshot retry reads back the frozen window even after new data;
    a retried advance_watermark keeps it; an older cycle's never moves it backwards."""
    config = _config(stack, tmp_path)
    _write(config, 0)
    first = cycle.snapshot_window(config, "c1")
    _write(config, 1)
    assert cycle.snapshot_window(config, "c1") == first
    assert cycle.advance_watermark(config, first) == first.watermark_after
    assert cycle.advance_watermark(config, first) == first.watermark_after

    second = cycle.snapshot_window(config, "c2")
    assert second.watermark_before == first.watermark_after
    assert cycle.advance_watermark(config, second) == second.watermark_after
    assert cycle.advance_watermark(config, first) == second.watermark_after  # not backwards
    assert cycle.read_watermark(config) == second.watermark_after


def test_a_retention_retry_finishes_a_half_deleted_shard(stack: TideConfig, tmp_path: Path) -> None:
    """Issue 13 part 6, tide_lake_retention: an attempt that died between deleting a shard
    and its marker is finished by the retry; a second retry deletes nothing."""
    config = _config(stack, tmp_path)
    old = datetime.now(UTC) - timedelta(days=config.lake.retention_days + 5)
    _write(config, 0, old)
    _write(config, 1, old)
    consumed = cycle.snapshot_window(config, "c1")
    cycle.advance_watermark(config, consumed)
    _write(config, 2, old)  # old, not consumed: kept
    store = ObjectStore(config.store, config.store.lake_bucket)
    reader = LakeReader(store, config.lake)
    slug = target_slug(config.cycle.target_id)
    half = reader.list_shards(slug)[0]
    store.remove(half.shard_key)  # the attempt died here, before removing the marker

    assert cycle.apply_retention(config) == {"deleted": 2, "kept_unconsumed": 1}
    assert cycle.apply_retention(config) == {"deleted": 0, "kept_unconsumed": 1}
    left = {sample.request_id for sample in reader.iter_records(reader.list_shards(slug))}
    assert left == {"req-2"}
