"""The cycle's lake steps against a lake with debris (issue 13, part 5), on the real S3 server.

Each test names the defect it covers: a marker without its shard (1), strays under
``_commits/`` (2), bad records (4), retention's delete order (6), clock skew (7).
"""

from __future__ import annotations

import dataclasses
import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.conftest import make_record
from tide_lib.config import LakeConfig, TideConfig
from tide_lib.lake import LakeReader, LakeWriter, ObjectStore, target_slug
from tide_lib.lake.layout import CommitMarker, commit_key, commit_prefix
from tide_lib.orchestration import cycle, export

pytestmark = pytest.mark.slow
TARGET = "demo/target"
SLUG = target_slug(TARGET)


@pytest.fixture
def config(stack: TideConfig, lake_config: LakeConfig, tmp_path: Path) -> TideConfig:
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"hidden_size": 16, "vocab_size": 1000}))
    return stack.model_copy(
        update={
            "lake": lake_config.model_copy(update={"commit_settle_s": 1.0}),
            "cycle": stack.cycle.model_copy(
                update={"target_id": TARGET, "target_path": target, "held_out_percent": 1}
            ),
            "scratch_dir": tmp_path / "scratch",
        }
    )


def _write(store: ObjectStore, config: TideConfig, indices: list[int], **kw: object) -> None:
    with LakeWriter(store, config.lake) as writer:
        for index in indices:
            assert writer.submit(make_record(index, target_id=TARGET, **kw))  # type: ignore[arg-type]
        assert writer.flush(timeout=30)


def _shards(store: ObjectStore, config: TideConfig) -> list[CommitMarker]:
    return LakeReader(store, config.lake).list_shards(SLUG)


def test_defect1_export_goes_on_when_a_window_shard_is_gone(
    config: TideConfig, lake_store: ObjectStore, tmp_path: Path
) -> None:
    for index in range(3):
        _write(lake_store, config, [10 * index, 10 * index + 1])
    time.sleep(1.5)
    snapshot = cycle.snapshot_window(config, "c1")
    assert len(snapshot.window) == 3
    gone = _shards(lake_store, config)[1]
    lake_store.remove(gone.shard_key)  # retention crashed between the shard and its marker

    count = export.export_training_data(config, snapshot, tmp_path / "data").total
    assert count == 3  # 4 requests of the other two shards, less the first (held out)
    assert not lake_store.exists(gone.key)  # quarantined: the next cycle does not meet it
    assert any(export.held_out_samples(config, snapshot).values())
    cycle.advance_watermark(config, snapshot)
    assert cycle.new_tokens(config) == 0


def test_defect2_sensor_and_snapshot_skip_strays(
    config: TideConfig, lake_store: ObjectStore
) -> None:
    _write(lake_store, config, [0, 1])
    commits = commit_prefix(config.lake.prefix, SLUG)
    lake_store.put_bytes(f"{commits}zzz-not-a-marker.txt", b"hello")
    lake_store.put_bytes(f"{commits}nested/99990101T000000000000Z-x.json", b"{}")
    time.sleep(1.5)
    assert cycle.new_tokens(config) == 24
    snapshot = cycle.snapshot_window(config, "c1")
    assert snapshot.window_tokens == 24 and len(snapshot.window) == 1
    assert cycle.cycle_tokens(config, "c1") == 24


def test_defect4_export_skips_records_unfit_for_the_target(
    config: TideConfig, lake_store: ObjectStore, tmp_path: Path
) -> None:
    _write(lake_store, config, [0, 1, 2])
    _write(lake_store, config, [3, 4], hidden=8)  # another target's width: wrong for this one
    time.sleep(1.5)
    snapshot = cycle.snapshot_window(config, "c1")
    assert export.export_training_data(config, snapshot, tmp_path / "data").total == 2  # req-0 out


def test_defect6_retention_deletes_the_marker_before_the_shard(
    config: TideConfig, lake_store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = datetime.now(UTC) - timedelta(days=40)
    _write(lake_store, config, [0], finished_at=old)
    time.sleep(1.5)
    cycle.advance_watermark(config, cycle.snapshot_window(config, "c1"))
    (marker,) = _shards(lake_store, config)

    original = ObjectStore.remove
    calls: list[str] = []

    def crash_after_one_delete(self: ObjectStore, key: str) -> None:
        if calls:
            raise SystemExit("retention host lost power")
        calls.append(key)
        original(self, key)

    monkeypatch.setattr(ObjectStore, "remove", crash_after_one_delete)
    with pytest.raises(SystemExit):
        cycle.apply_retention(config)
    monkeypatch.undo()
    assert calls == [marker.key]
    assert lake_store.exists(marker.shard_key)  # debris no reader sees
    assert _shards(lake_store, config) == []  # never a marker without its shard


def _land_behind(
    store: ObjectStore, config: TideConfig, marker: CommitMarker, behind: timedelta
) -> str:
    """Commit ``marker`` again as a capture host whose clock is ``behind`` the store's."""
    store.remove(marker.key)
    stamped = datetime.now(UTC) - behind
    shard_id = marker.shard_key.rsplit("part-", 1)[1].removesuffix(".parquet")
    key = commit_key(config.lake.prefix, SLUG, stamped, shard_id)
    store.put_bytes(
        key, dataclasses.replace(marker, committed_at=stamped, writer_id="skewed").to_json()
    )
    return key


def test_defect7_skewed_writer_is_counted_snapshotted_and_kept_by_retention(
    config: TideConfig, lake_store: ObjectStore
) -> None:
    _write(lake_store, config, [0, 1])
    time.sleep(1.5)
    first = cycle.snapshot_window(config, "c1")
    cycle.advance_watermark(config, first)

    old = datetime.now(UTC) - timedelta(days=40)
    _write(lake_store, config, [5], finished_at=old)  # a host whose clock is 40 days behind
    (skewed,) = [m for m in _shards(lake_store, config) if m.key not in first.window]
    deep = _land_behind(lake_store, config, skewed, timedelta(days=40))
    _write(lake_store, config, [6])
    (recent,) = [m for m in _shards(lake_store, config) if m.key not in {*first.window, deep}]
    shallow = _land_behind(lake_store, config, recent, timedelta(minutes=10))  # within skew
    time.sleep(2.5)

    assert cycle.new_tokens(config) == 12  # the 10-minute skew is counted
    second = cycle.snapshot_window(config, "c2")
    assert second.window == [shallow]
    cycle.advance_watermark(config, second)
    assert cycle.new_tokens(config) == 0  # and counted once

    result = cycle.apply_retention(config)  # the 40-day-behind one is old, yet unconsumed
    assert result["kept_unconsumed"] == 1 and result["deleted"] == 0
    assert lake_store.exists(deep) and lake_store.exists(skewed.shard_key)


def test_the_sensor_counts_settled_commits_and_a_frozen_window_keeps_its_count(
    config: TideConfig, lake_store: ObjectStore
) -> None:
    slow = config.model_copy(
        update={"lake": config.lake.model_copy(update={"commit_settle_s": 3600.0})}
    )
    _write(lake_store, config, [0, 1, 2])
    assert cycle.cycle_tokens(slow, "run-a") == 0  # committed, not settled yet: not counted
    time.sleep(1.2)  # past commit_settle_s = 1 (S3 stamps have one-second resolution)
    counted = cycle.cycle_tokens(config, "run-a")
    assert counted == cycle.new_tokens(config) > 0
    window = cycle.snapshot_window(config, "run-a")
    assert window.window_tokens == counted
    _write(lake_store, config, [3, 4])
    time.sleep(1.2)
    assert cycle.new_tokens(config) > counted  # new data since the watermark...
    assert cycle.cycle_tokens(config, "run-a") == counted  # ...not this frozen window's
    assert cycle.snapshot_window(config, "run-a") == window  # a retried snapshot reuses it
