"""tide_rollback and tide_lake_retention with dag.test() against the real services."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import mlflow
import pytest

from tests.conftest import make_record
from tests.e2e.conftest import dag_test
from tests.serving.conftest import start_engine
from tide_lib.config import LakeConfig, TideConfig, load_config
from tide_lib.lake import LakeReader, LakeWriter, ObjectStore, target_slug
from tide_lib.orchestration import cycle
from tide_lib.orchestration.handoff import Snapshot
from tide_lib.registry import CHAMPION, PREVIOUS_CHAMPION, DraftRegistry
from tide_lib.serving.process import EngineProcess

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_rollback_serves_the_previous_champion(
    stack: TideConfig,
    tiny_target: Path,
    tiny_drafts: dict[str, Path],
    tmp_path: Path,
    airflow_env: dict[str, str],
) -> None:
    target_id = f"rollback-{uuid.uuid4().hex[:6]}"
    registry = DraftRegistry(stack.mlflow.tracking_uri, target_id)
    client = mlflow.MlflowClient(stack.mlflow.tracking_uri)
    experiment = client.create_experiment(registry.name)
    versions = []
    for language in ("en", "ko"):
        run = client.create_run(experiment).info.run_id
        versions.append(registry.register(tiny_drafts[language], run, cycle_id=language).version)
        registry.promote(versions[-1])
    engines: list[EngineProcess] = []
    try:
        draft = ["--speculative-draft-model-path", str(tiny_drafts["ko"])]
        engines = [start_engine(tmp_path, tiny_target, *draft, stack=stack) for _ in range(2)]
        env = {
            **airflow_env,
            "TIDE_CYCLE__TARGET_ID": target_id,
            "TIDE_CYCLE__SERVERS": json.dumps([engine.url for engine in engines]),
        }
        dag_test(env, "tide_rollback", tmp_path, {"version": PREVIOUS_CHAMPION})
        assert registry.alias(CHAMPION).version == versions[0]
        assert registry.alias(PREVIOUS_CHAMPION).version == versions[1]
        for engine in engines:
            served = httpx.get(f"{engine.url}/get_weight_version").json()["weight_version"]
            assert served == f"{registry.name}-v{versions[0]}"
    finally:
        for engine in engines:
            engine.stop()


def test_retention_deletes_only_old_consumed_shards(
    stack: TideConfig, tmp_path: Path, airflow_env: dict[str, str]
) -> None:
    prefix = f"retention-{uuid.uuid4().hex[:6]}"
    lake = LakeConfig(prefix=prefix, spool_dir=tmp_path / "spool")
    store = ObjectStore(stack.store, stack.store.lake_bucket)
    old = datetime.now(UTC) - timedelta(days=60)

    def write(index: int, finished_at: datetime) -> None:
        with LakeWriter(store, lake) as writer:
            writer.submit(make_record(index, finished_at=finished_at, target_id="ret"))

    write(0, old)  # old and consumed: deleted
    write(1, datetime.now(UTC))  # recent and consumed: kept
    config = load_config(
        store=stack.store.model_dump(), lake=lake.model_dump(), cycle={"target_id": "ret"}
    )
    reader = LakeReader(store, lake)
    consumed = reader.list_shards(target_slug("ret"))
    consumed_keys = [marker.key for marker in consumed]
    window = Snapshot(
        cycle_id="c0",
        target_id="ret",
        watermark_before=None,
        watermark_after=consumed_keys[-1],
        window=consumed_keys,
        replay=[],
        held_out_older=[],
        window_tokens=sum(marker.num_tokens for marker in consumed),
        replay_tokens=0,
        older_listed=0,
    )
    cycle.advance_watermark(config, window)
    write(2, old)  # old but not consumed yet: kept

    env = {**airflow_env, "TIDE_LAKE__PREFIX": prefix, "TIDE_CYCLE__TARGET_ID": "ret"}
    dag_test(env, "tide_lake_retention", tmp_path)
    left = {s.request_id for s in reader.iter_records(reader.list_shards(target_slug("ret")))}
    assert left == {"req-1", "req-2"}
