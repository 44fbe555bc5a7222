"""Writer and reader against the real S3 server: round trip, commit visibility, drops, spool."""

from __future__ import annotations

import dataclasses
import io
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.conftest import make_record
from tide_lib.config import LakeConfig, TideConfig
from tide_lib.lake import (
    InvalidRecordError,
    LakeReader,
    LakeWriter,
    ObjectStore,
    target_slug,
    watermark,
)
from tide_lib.lake.layout import CommitMarker, commit_key, shard_key
from tide_lib.lake.schema import RECORD_SCHEMA

pytestmark = pytest.mark.slow
SLUG = target_slug("demo/target")


def _write(store: ObjectStore, config: LakeConfig, records: list) -> None:
    with LakeWriter(store, config) as writer:
        for record in records:
            assert writer.submit(record)
        assert writer.flush(timeout=30)


def test_a_marker_landing_after_the_settle_time_is_logged_unless_the_rule_is_off(
    lake_store: ObjectStore, lake_config: LakeConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """Every marker lands a few milliseconds after its stamp: beyond a settle time of a
    microsecond, but with the rule off (0, one writer flushed before each read) that is
    no news, and a benchmark's log was a warning per commit."""
    with caplog.at_level(logging.WARNING, logger="tide_lib.lake.writer"):
        _write(
            lake_store, lake_config.model_copy(update={"commit_settle_s": 1e-6}), [make_record(0)]
        )
        assert "after its stamp, beyond lake.commit_settle_s" in caplog.text
        caplog.clear()
        _write(
            lake_store, lake_config.model_copy(update={"commit_settle_s": 0.0}), [make_record(1)]
        )
        assert "after its stamp" not in caplog.text


def test_round_trip_keeps_tensors_equal(lake_store: ObjectStore, lake_config: LakeConfig) -> None:
    records = [make_record(i, tokens=5 + i) for i in range(6)]
    bf16 = dataclasses.replace(
        make_record(99),
        hidden_states=torch.randn(12, 16).bfloat16(),
        aux_hidden_states=torch.randn(12, 48).bfloat16(),
    )
    _write(lake_store, lake_config, [*records, bf16])

    reader = LakeReader(lake_store, lake_config)
    shards = reader.list_shards(SLUG)
    assert sum(m.num_records for m in shards) == 7
    assert reader.count_tokens(SLUG) == sum(5 + i for i in range(6)) + 12
    samples = {s.request_id: s for s in reader.iter_records(shards)}
    assert set(samples) == {f"req-{i}" for i in [*range(6), 99]}
    for record in records:
        sample = samples[record.request_id]
        assert torch.equal(sample.input_ids, torch.from_numpy(record.input_ids))
        assert torch.equal(sample.loss_mask, torch.from_numpy(record.loss_mask).long())
        assert torch.equal(sample.hidden_states, torch.from_numpy(record.hidden_states))
        assert torch.equal(sample.aux_hidden_states, torch.from_numpy(record.aux_hidden_states))
        assert (sample.spec_verify_ct, sample.spec_accept_tokens) == (3, 4)
    assert samples["req-99"].hidden_states.dtype == torch.bfloat16
    assert torch.equal(samples["req-99"].hidden_states, bf16.hidden_states)
    assert torch.equal(samples["req-99"].aux_hidden_states, bf16.aux_hidden_states)


def test_shards_follow_the_hive_layout(lake_store: ObjectStore, lake_config: LakeConfig) -> None:
    hour_a = datetime(2026, 11, 28, 22, 15, tzinfo=UTC)
    hour_b = datetime(2026, 11, 28, 23, 5, tzinfo=UTC)
    _write(
        lake_store,
        lake_config,
        [make_record(0, finished_at=hour_a), make_record(1, finished_at=hour_b)],
    )
    keys = [info.key for info in lake_store.list(f"{lake_config.prefix}/target={SLUG}/")]
    assert len(keys) == 2
    assert any("/dt=2026-11-28/hour=22/part-" in key for key in keys)
    assert any("/dt=2026-11-28/hour=23/part-" in key for key in keys)
    reader = LakeReader(lake_store, lake_config)
    in_window = reader.list_shards(
        SLUG, start=hour_b - timedelta(minutes=5), end=hour_b + timedelta(hours=1)
    )
    assert [m.num_records for m in in_window] == [1]
    assert "hour=23" in in_window[0].shard_key


def test_uncommitted_shard_is_invisible(lake_store: ObjectStore, lake_config: LakeConfig) -> None:
    # A shard uploaded without its commit marker, as if the writer died in between.
    buffer = io.BytesIO()
    table = pa.Table.from_pylist([], schema=RECORD_SCHEMA)
    pq.write_table(table, buffer)
    key = shard_key(lake_config.prefix, SLUG, datetime.now(UTC), "orphan")
    lake_store.put_bytes(key, buffer.getvalue())
    reader = LakeReader(lake_store, lake_config)
    assert reader.list_shards(SLUG) == []
    assert reader.count_tokens(SLUG) == 0

    _write(lake_store, lake_config, [make_record(1)])
    shards = reader.list_shards(SLUG)
    assert [m.num_records for m in shards] == [1]
    assert key not in {m.shard_key for m in shards}


def test_watermark_lists_only_newer_commits(
    lake_store: ObjectStore, lake_config: LakeConfig
) -> None:
    reader = LakeReader(lake_store, lake_config)
    _write(lake_store, lake_config, [make_record(i) for i in range(3)])
    first = reader.list_shards(SLUG)
    mark = watermark(first)
    assert reader.count_tokens(SLUG, after=mark) == 0
    _write(lake_store, lake_config, [make_record(i, tokens=7) for i in range(10, 12)])
    newer = reader.list_shards(SLUG, after=mark)
    assert reader.count_tokens(SLUG, after=mark) == 14
    assert {s.request_id for s in reader.iter_records(newer)} == {"req-10", "req-11"}
    assert watermark([], previous=mark) == mark


def test_corrupt_and_truncated_shards_are_quarantined(
    lake_store: ObjectStore, lake_config: LakeConfig
) -> None:
    for index in range(3):  # three shards, one record each
        _write(lake_store, lake_config, [make_record(index)])
    reader = LakeReader(lake_store, lake_config)
    shards = reader.list_shards(SLUG)
    assert len(shards) == 3
    good = lake_store.get_bytes(shards[1].shard_key)
    lake_store.put_bytes(shards[1].shard_key, good[: len(good) // 2])  # truncated
    lake_store.put_bytes(shards[2].shard_key, b"PAR1" + bytes(len(good) - 8) + b"PAR1")  # garbage

    read = [s.request_id for s in reader.iter_records(shards)]
    assert read == ["req-0"]
    assert [m.shard_key for m in reader.list_shards(SLUG)] == [shards[0].shard_key]
    quarantined = {info.key for info in lake_store.list(f"{lake_config.prefix}/_quarantine/")}
    for marker in shards[1:]:
        assert any(key.endswith(marker.shard_key.split("/")[-1]) for key in quarantined)
        assert any(key.endswith(marker.key.split("/")[-1]) for key in quarantined)
        assert not lake_store.exists(marker.shard_key)


def test_bad_record_is_refused_and_nothing_else_is_lost(
    lake_store: ObjectStore, lake_config: LakeConfig
) -> None:
    with LakeWriter(lake_store, lake_config) as writer:
        assert writer.submit(make_record(0))
        with pytest.raises(InvalidRecordError, match="aux_hidden_states has shape"):
            writer.submit(
                dataclasses.replace(make_record(1), aux_hidden_states=np.zeros((12, 3), np.float16))
            )
        assert writer.submit(make_record(2))
    reader = LakeReader(lake_store, lake_config)
    assert {s.request_id for s in reader.iter_records(reader.list_shards(SLUG))} == {
        "req-0",
        "req-2",
    }


def test_full_queue_drops_and_counts(
    lake_store: ObjectStore, tmp_path: Path, stack: TideConfig
) -> None:
    config = LakeConfig(prefix="test-drops", spool_dir=tmp_path / "spool", queue_max_records=2)
    writer = LakeWriter(lake_store, config)
    gate = threading.Event()
    original = writer._batcher._add  # hold the batcher so that the queue fills up
    writer._batcher._add = lambda buffers, record: (gate.wait(), original(buffers, record))  # type: ignore[method-assign]
    results = [writer.submit(make_record(i)) for i in range(6)]
    gate.set()
    stats = writer.close(timeout=30)
    assert results.count(False) == stats.dropped_records >= 3
    assert stats.submitted_records == results.count(True)
    assert stats.records_uploaded == stats.submitted_records


def test_age_flush_commits_without_close(lake_store: ObjectStore, lake_config: LakeConfig) -> None:
    reader = LakeReader(lake_store, lake_config)
    with LakeWriter(lake_store, lake_config) as writer:
        writer.submit(make_record(0))
        deadline = time.monotonic() + 15
        while not reader.list_shards(SLUG) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert reader.count_tokens(SLUG) == 12, "shard_max_age_s should have flushed the record"


def test_size_flush_splits_shards(lake_store: ObjectStore, lake_config: LakeConfig) -> None:
    config = lake_config.model_copy(update={"shard_max_bytes": 3000, "shard_max_age_s": 60})
    hour = datetime(2026, 11, 1, 12, 30, tzinfo=UTC)  # one partition, whenever this runs
    _write(lake_store, config, [make_record(i, tokens=8, finished_at=hour) for i in range(6)])
    shards = LakeReader(lake_store, config).list_shards(SLUG)
    assert len(shards) == 2
    assert [m.num_records for m in shards] == [3, 3]


def test_unreachable_store_spools_then_a_new_writer_uploads(
    stack: TideConfig, lake_config: LakeConfig
) -> None:
    dead = stack.store.model_copy(update={"endpoint": "http://127.0.0.1:9", "timeout_s": 0.5})
    dead_store = ObjectStore(dead, stack.store.lake_bucket)
    writer = LakeWriter(dead_store, lake_config.model_copy(update={"shard_max_age_s": 60}))
    for index in range(4):
        assert writer.submit(make_record(index))
    stats = writer.close(timeout=3)
    assert stats.spooled_shards == 1 and stats.shards_uploaded == 0
    assert stats.upload_errors >= 1 and not stats.store_reachable

    live_store = ObjectStore(stack.store, stack.store.lake_bucket)
    with LakeWriter(live_store, lake_config) as recovered:
        assert recovered.flush(timeout=30)
        assert recovered.stats().records_uploaded == 4
    reader = LakeReader(live_store, lake_config)
    assert sorted(s.request_id for s in reader.iter_records(reader.list_shards(SLUG))) == [
        f"req-{i}" for i in range(4)
    ]


def test_one_spool_dir_per_writer(lake_store: ObjectStore, lake_config: LakeConfig) -> None:
    with LakeWriter(lake_store, lake_config), pytest.raises(RuntimeError, match="used by another"):
        LakeWriter(lake_store, lake_config)


def test_export_loads_in_specforge(
    lake_store: ObjectStore, lake_config: LakeConfig, tmp_path: Path
) -> None:
    from specforge.data.preprocessing import OfflineEagle3Dataset, list_local_files

    records = [make_record(i, tokens=10) for i in range(3)]
    _write(lake_store, lake_config, records)
    reader = LakeReader(lake_store, lake_config)
    assert reader.export_specforge(reader.list_shards(SLUG), tmp_path / "offline") == 3
    dataset = OfflineEagle3Dataset(list_local_files(str(tmp_path / "offline")), max_len=64)
    item = dataset[0]
    by_ids = {tuple(r.input_ids.tolist()): r for r in records}
    record = by_ids[tuple(item["input_ids"][0].tolist())]
    assert torch.equal(item["hidden_state"][0], torch.from_numpy(record.aux_hidden_states))
    assert torch.equal(item["target"][0], torch.from_numpy(record.hidden_states))


def test_memory_bound_drops_oversized_backlog(
    lake_store: ObjectStore, lake_config: LakeConfig
) -> None:
    one_record = 12 * 16 * 2 * 4 + 12 * 5  # raw bytes of make_record(tokens=12, hidden=16)
    config = lake_config.model_copy(update={"memory_max_bytes": 2 * one_record})
    writer = LakeWriter(lake_store, config)
    gate = threading.Event()
    original = writer._batcher._add
    writer._batcher._add = lambda buffers, record: (gate.wait(), original(buffers, record))  # type: ignore[method-assign]
    results = [writer.submit(make_record(i)) for i in range(5)]
    gate.set()
    stats = writer.close(timeout=30)
    assert results[:2] == [True, True] and results.count(False) == stats.dropped_records >= 2
    assert stats.records_uploaded == results.count(True)


class _HookedSpool(type(Path())):  # type: ignore[misc]
    """A spool dir whose listings pass through ``on_glob``: forces thread interleavings."""

    on_glob: Callable[[list[Path]], list[Path]]

    def glob(self, pattern: str):  # type: ignore[no-untyped-def, override]
        return iter(self.on_glob(list(super().glob(pattern))))


def _hook_spool(writer: LakeWriter, on_glob: Callable[[list[Path]], list[Path]]) -> None:
    spool = _HookedSpool(writer._spool.path)
    spool.on_glob = on_glob
    writer._spool.path = spool  # the one spool both threads list


def test_close_uploads_the_shard_written_while_the_uploader_was_listing(
    lake_store: ObjectStore, lake_config: LakeConfig
) -> None:
    writer = LakeWriter(lake_store, lake_config)

    def listed_before_the_last_shard(listed: list[Path]) -> list[Path]:
        # the uploader lists an empty spool; the batcher writes its last shard and says done
        if threading.current_thread().name == "tide-lake-uploader" and not listed:
            writer._batcher.thread.join(timeout=10)
        return listed

    _hook_spool(writer, listed_before_the_last_shard)
    assert writer.submit(make_record(0))
    stats = writer.close(timeout=30)
    assert (stats.records_uploaded, stats.spooled_shards) == (1, 0)
    assert sum(m.num_records for m in LakeReader(lake_store, lake_config).list_shards(SLUG)) == 1


def test_a_shard_uploaded_while_the_spool_is_sized_does_not_stop_capture(
    lake_store: ObjectStore, lake_config: LakeConfig
) -> None:
    writer = LakeWriter(lake_store, lake_config)
    ghost = writer._spool.path / "uploaded-meanwhile.parquet"
    _hook_spool(  # the batcher sizes the spool and finds a shard gone by the time it looks
        writer,
        lambda listed: (
            [*listed, ghost] if threading.current_thread().name == "tide-lake-batcher" else listed
        ),
    )
    for i in range(3):
        assert writer.submit(make_record(i))
        assert writer.flush(timeout=30)
    assert writer.stats().spooled_bytes == 0
    stats = writer.close(timeout=30)
    assert (stats.records_uploaded, stats.dropped_records) == (3, 0)


def test_settled_readers_do_not_jump_over_a_marker_that_lands_late(
    lake_store: ObjectStore, lake_config: LakeConfig
) -> None:
    """Writer A stamps its marker before writer B but B's PUT lands first."""
    _write(lake_store, lake_config, [make_record(0)])
    _write(lake_store, lake_config, [make_record(1)])
    written = LakeReader(lake_store, lake_config).list_shards(SLUG)
    for marker in written:
        lake_store.remove(marker.key)
    now = datetime.now(UTC)

    def land(marker: CommitMarker, age_s: float) -> None:
        stamped = now - timedelta(seconds=age_s)
        shard_id = marker.shard_key.rsplit("part-", 1)[1].removesuffix(".parquet")
        key = commit_key(lake_config.prefix, SLUG, stamped, shard_id)
        lake_store.put_bytes(key, dataclasses.replace(marker, committed_at=stamped).to_json())

    land(written[1], age_s=10)  # B: stamped later, landed first
    eager = LakeReader(lake_store, lake_config.model_copy(update={"commit_settle_s": 0}))
    settled = LakeReader(lake_store, lake_config.model_copy(update={"commit_settle_s": 100}))
    # B stays too fresh for the settled reader for 90 s: slack for a slow store on a busy host
    assert settled.list_shards(SLUG, settled=True) == []  # B is too fresh to move a watermark
    time.sleep(2.5)  # B landed 10 s after its stamp: an eager reader takes it once it landed
    eager_first = eager.list_shards(SLUG, settled=True)
    assert [m.shard_key for m in eager_first] == [written[1].shard_key]
    land(written[0], age_s=300)  # A lands now, 300 s after its stamp: later than settle
    time.sleep(2.5)  # so it counts from when it landed (to the second), once that passed
    first = settled.list_shards(SLUG, settled=True)
    assert [m.shard_key for m in first] == [written[0].shard_key]
    assert settled.count_tokens(SLUG, settled=True) == first[0].num_tokens
    later = eager.list_shards(SLUG, after=watermark(first), settled=True)  # once B settled
    # (a late marker's order depends on commit_settle_s: one setting per watermark)
    assert written[1].shard_key in [m.shard_key for m in later]
    # Even the eager watermark does not lose A: A counts from when it landed, not its stamp.
    missed = eager.list_shards(SLUG, after=watermark(eager_first), settled=True)
    assert [m.shard_key for m in missed] == [written[0].shard_key]


def test_time_window_filters_records_not_only_shards(
    lake_store: ObjectStore, lake_config: LakeConfig
) -> None:
    early = datetime(2026, 11, 28, 10, 0, tzinfo=UTC)
    late = early + timedelta(minutes=10)
    _write(
        lake_store,
        lake_config,
        [make_record(0, finished_at=early), make_record(1, finished_at=late)],
    )
    reader = LakeReader(lake_store, lake_config)
    cut = early + timedelta(minutes=5)
    shards = reader.list_shards(SLUG, start=cut)
    assert len(shards) == 1  # one shard holds both requests
    assert [s.request_id for s in reader.iter_records(shards, start=cut)] == ["req-1"]
    assert [
        s.request_id for s in reader.iter_records(reader.list_shards(SLUG, end=cut), end=cut)
    ] == ["req-0"]
