"""A lake that tolerates its own debris (issue 13, part 5), against the real S3 server.

Each test names the defect it covers: markers without shards (1), strays under
``_commits/`` (2), untrusted markers (3), bad record values (4), clock skew (7).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import time
from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.conftest import make_record
from tide_lib.config import LakeConfig
from tide_lib.lake import (
    CapturedRecord,
    LakeReader,
    LakeWriter,
    ObjectStore,
    target_slug,
    watermark,
)
from tide_lib.lake.layout import CommitMarker, commit_key, commit_prefix, new_shard_id, shard_key
from tide_lib.lake.schema import TargetLimits, records_to_table

pytestmark = pytest.mark.slow
SLUG = target_slug("demo/target")


def _write(store: ObjectStore, config: LakeConfig, records: list[CapturedRecord]) -> None:
    with LakeWriter(store, config) as writer:
        for record in records:
            assert writer.submit(record)
        assert writer.flush(timeout=30)


def _commit_raw(
    store: ObjectStore, config: LakeConfig, records: list[CapturedRecord], stamp: datetime
) -> CommitMarker:
    """Commit records as a writer without value checks would (an older writer, another tool)."""
    buffer = io.BytesIO()
    pq.write_table(records_to_table(records), buffer)
    data = buffer.getvalue()
    finished = [r.finished_at for r in records]
    shard_id = new_shard_id(stamp)
    marker = CommitMarker(
        shard_key=shard_key(config.prefix, SLUG, min(finished), shard_id),
        target_slug=SLUG,
        num_records=len(records),
        num_tokens=sum(int(r.input_ids.shape[0]) for r in records),
        num_output_tokens=sum(int(r.loss_mask.sum()) for r in records),
        size_bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        min_finished_at=min(finished),
        max_finished_at=max(finished),
        committed_at=stamp,
        writer_id="raw-writer",
        key=commit_key(config.prefix, SLUG, stamp, shard_id),
    )
    store.put_bytes(marker.shard_key, data)
    store.put_bytes(marker.key, marker.to_json())
    return marker


def _quarantined(store: ObjectStore, config: LakeConfig) -> set[str]:
    return {info.key for info in store.list(f"{config.prefix}/_quarantine/")}


def test_defect1_marker_whose_shard_is_gone_is_quarantined_not_fatal(
    lake_store: ObjectStore, lake_config: LakeConfig
) -> None:
    for index in range(3):
        _write(lake_store, lake_config, [make_record(index)])
    reader = LakeReader(lake_store, lake_config)
    shards = reader.list_shards(SLUG)
    lake_store.remove(shards[1].shard_key)  # retention crashed between shard and marker

    assert [s.request_id for s in reader.iter_records(shards)] == ["req-0", "req-2"]
    assert reader.debris.missing_shards == 1
    assert [m.key for m in reader.list_shards(SLUG)] == [shards[0].key, shards[2].key]
    assert any(
        key.endswith(shards[1].key.rsplit("/", 1)[1])
        for key in _quarantined(lake_store, lake_config)
    )


def test_defect2_stray_objects_under_commits_are_skipped_and_counted(
    lake_store: ObjectStore, lake_config: LakeConfig, caplog: pytest.LogCaptureFixture
) -> None:
    _write(lake_store, lake_config, [make_record(0), make_record(1)])
    commits = commit_prefix(lake_config.prefix, SLUG)
    strays = [f"{commits}README.txt", f"{commits}notes.json", f"{commits}sub/dir/x.json"]
    for key in strays:
        lake_store.put_bytes(key, b"{}")
    # a marker's name, not a marker; stamped a moment before it lands, as writers do
    garbage = commit_key(lake_config.prefix, SLUG, datetime.now(UTC), "garbage")
    lake_store.put_bytes(garbage, b"\x00not json")
    config = lake_config.model_copy(update={"commit_settle_s": 0.0})
    reader = LakeReader(lake_store, config)
    time.sleep(1.2)  # a marker settles no sooner than S3's one-second Last-Modified allows

    with caplog.at_level(logging.WARNING, logger="tide_lib.lake.reader"):
        settled = reader.list_shards(SLUG, settled=True)
        assert reader.count_tokens(SLUG, settled=True) == 24
    assert [m.num_records for m in settled] == [2]  # one shard of two records
    assert reader.commit_keys(SLUG, after=None, until=settled[-1].order) == [settled[-1].key]
    assert reader.list_targets() == [SLUG]
    assert reader.debris.stray_objects >= len(strays)
    assert reader.debris.invalid_markers == 1
    assert all(key in caplog.text for key in strays)
    assert all(lake_store.exists(key) for key in strays)  # skipped, not moved
    assert not lake_store.exists(garbage)  # an unreadable marker is quarantined


def test_defect3_marker_pointing_outside_its_shards_is_refused(
    lake_store: ObjectStore, lake_config: LakeConfig
) -> None:
    _write(lake_store, lake_config, [make_record(0)])
    reader = LakeReader(lake_store, lake_config)
    (good,) = reader.list_shards(SLUG)
    state = f"{lake_config.prefix}/_state/target={SLUG}/watermark.json"
    lake_store.put_bytes(state, b'{"watermark": null}')
    now = datetime.now(UTC)
    hostile = []
    for offset, target in enumerate(
        [state, f"{lake_config.prefix}/target={SLUG}/../_state/target={SLUG}/watermark.json"]
    ):
        shard_id = new_shard_id(now)
        key = commit_key(lake_config.prefix, SLUG, now + timedelta(seconds=offset), shard_id)
        lake_store.put_bytes(key, dataclasses.replace(good, shard_key=target).to_json())
        hostile.append(key)

    listed = reader.list_shards(SLUG)
    assert [m.key for m in listed] == [good.key]
    assert reader.debris.invalid_markers == 2
    assert [
        s.request_id
        for s in reader.iter_records(
            [*listed, *(dataclasses.replace(good, key=key, shard_key=state) for key in hostile)]
        )
    ] == ["req-0"]
    assert lake_store.exists(state), "a marker's word never moves an object outside the shards"
    assert not any("_state" in key for key in _quarantined(lake_store, lake_config))


def test_defect3_marker_counts_must_match_the_shard(
    lake_store: ObjectStore, lake_config: LakeConfig
) -> None:
    stamp = datetime.now(UTC)
    marker = _commit_raw(lake_store, lake_config, [make_record(0), make_record(1)], stamp)
    lying = dataclasses.replace(marker, num_tokens=marker.num_tokens + 100)
    lake_store.put_bytes(marker.key, lying.to_json())  # the sensor would count 100 phantom tokens
    reader = LakeReader(lake_store, lake_config)
    (listed,) = reader.list_shards(SLUG)
    assert list(reader.iter_records([listed])) == []
    assert reader.debris.corrupt_shards == 1
    assert not lake_store.exists(marker.key) and not lake_store.exists(marker.shard_key)


def _bad_records() -> list[CapturedRecord]:
    inf_state = make_record(1)
    inf_state.hidden_states[3, 2] = np.inf
    nan_aux = make_record(2)
    nan_aux.aux_hidden_states[0, 0] = np.nan
    out_of_vocab = make_record(3)
    out_of_vocab.input_ids[5] = 5000
    return [inf_state, nan_aux, out_of_vocab, make_record(4, hidden=8)]


def test_defect4_writer_refuses_bad_values_with_a_count(
    lake_store: ObjectStore, lake_config: LakeConfig, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="tide_lib.lake.writer"),
        LakeWriter(lake_store, lake_config, limits=TargetLimits(16, 1000)) as writer,
    ):
        assert writer.submit(make_record(0))
        for record in _bad_records():
            assert writer.submit(record)
        assert writer.flush(timeout=30)
        stats = writer.stats()
    assert (stats.refused_records, stats.records_uploaded, stats.dropped_records) == (4, 1, 0)
    assert "refused captured request req-1: hidden_states holds NaN or inf" in caplog.text
    reader = LakeReader(lake_store, lake_config)
    assert [s.request_id for s in reader.iter_records(reader.list_shards(SLUG))] == ["req-0"]


def test_defect4_writer_checks_finiteness_without_target_sizes(
    lake_store: ObjectStore, lake_config: LakeConfig
) -> None:
    with LakeWriter(lake_store, lake_config) as writer:
        for record in [make_record(0), *_bad_records()[:2]]:
            assert writer.submit(record)
        assert writer.flush(timeout=30)
        assert writer.stats().refused_records == 2


def test_defect4_reader_skips_bad_records_that_reached_the_lake(
    lake_store: ObjectStore, lake_config: LakeConfig
) -> None:
    good = [make_record(0), make_record(5)]
    bad = _bad_records()
    _commit_raw(lake_store, lake_config, [good[0], *bad[:3]], datetime.now(UTC))
    _commit_raw(lake_store, lake_config, [bad[3], good[1]], datetime.now(UTC))
    reader = LakeReader(lake_store, lake_config, limits=TargetLimits(16, 1000))
    samples = list(reader.iter_records(reader.list_shards(SLUG)))
    assert [s.request_id for s in samples] == ["req-0", "req-5"]
    assert reader.debris.invalid_records == 4
    assert reader.debris.corrupt_shards == 0  # the shards are fine; some records are not
    unchecked = LakeReader(lake_store, lake_config)  # finiteness is checked always
    assert len(list(unchecked.iter_records(unchecked.list_shards(SLUG)))) == 4


def _land_late(
    store: ObjectStore, config: LakeConfig, marker: CommitMarker, behind: timedelta
) -> CommitMarker:
    """Re-commit ``marker`` as a writer whose clock is ``behind`` the store's would."""
    store.remove(marker.key)
    stamped = datetime.now(UTC) - behind
    shard_id = marker.shard_key.rsplit("part-", 1)[1].removesuffix(".parquet")
    late = dataclasses.replace(
        marker,
        key=commit_key(config.prefix, SLUG, stamped, shard_id),
        committed_at=stamped,
        writer_id="slow-clock",
    )
    store.put_bytes(late.key, late.to_json())
    return late


def test_defect7_marker_of_a_writer_behind_the_store_is_counted_once_and_logged(
    lake_store: ObjectStore, lake_config: LakeConfig, caplog: pytest.LogCaptureFixture
) -> None:
    config = lake_config.model_copy(update={"commit_settle_s": 1.0, "max_clock_skew_s": 3600})
    _write(lake_store, config, [make_record(0)])
    time.sleep(1.1)  # stamps come from the store's clock, which tells whole seconds
    _write(lake_store, config, [make_record(1)])
    reader = LakeReader(lake_store, config)
    written = reader.list_shards(SLUG)
    lake_store.remove(written[1].key)  # its writer has not committed yet
    time.sleep(2)
    on_time = LakeReader(lake_store, config).list_shards(SLUG, settled=True)
    mark = watermark(on_time)  # a cycle consumes the on-time commit
    assert [m.key for m in on_time] == [written[0].key]

    late = _land_late(lake_store, config, written[1], behind=timedelta(minutes=30))
    assert late.key < str(mark), "the skewed stamp sorts behind the watermark"
    time.sleep(3)
    with caplog.at_level(logging.WARNING, logger="tide_lib.lake.reader"):
        fresh = LakeReader(lake_store, config)
        assert fresh.count_tokens(SLUG, after=mark, settled=True) == 12
        after = fresh.list_shards(SLUG, after=mark, settled=True)
    assert [m.key for m in after] == [late.key]
    assert fresh.debris.skewed_markers == 1
    assert "slow-clock" in caplog.text and late.key in caplog.text and "behind" in caplog.text
    assert [s.request_id for s in fresh.iter_records(after)] == ["req-1"]
    again = watermark(after, mark)
    assert again is not None and again > str(mark)
    assert fresh.list_shards(SLUG, after=again, settled=True) == []  # never counted twice
    assert fresh.commit_keys(SLUG, after=None, until=again) == [late.key, written[0].key]
    assert fresh.commit_keys(SLUG, after=None, until=str(mark)) == [written[0].key]


def test_defect7_a_writer_whose_clock_is_an_hour_behind_stamps_by_the_stores_clock(
    lake_store: ObjectStore,
    lake_config: LakeConfig,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A writer whose clock is behind stamped its markers below the watermark: never counted,
    later deleted by retention. Markers now carry the store's time; the skew is logged."""
    import tide_lib.lake.writer as writer_module

    class _Behind(datetime):
        @classmethod
        def now(cls, tz: object = None) -> datetime:  # type: ignore[override]
            return datetime.now(UTC) - timedelta(hours=1)

    monkeypatch.setattr(writer_module, "datetime", _Behind)
    reader = LakeReader(lake_store, lake_config)
    watermark = commit_key(lake_config.prefix, SLUG, datetime.now(UTC) - timedelta(minutes=5), "w")
    with caplog.at_level(logging.WARNING, logger="tide_lib.lake.writer"):
        _write(lake_store, lake_config, [make_record(0)])
    assert "clock is 3600 s behind" in caplog.text or "clock is 3599 s behind" in caplog.text
    (marker,) = reader.list_shards(SLUG)
    assert abs(marker.committed_at - datetime.now(UTC)) < timedelta(seconds=30)
    assert [m.key for m in reader.list_shards(SLUG, after=watermark)] == [marker.key]
