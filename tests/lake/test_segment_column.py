"""The ``segment`` column (issue 14): client labels round-trip, bad ones are refused and
counted, and shards written before the column existed read as unlabelled."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import make_record
from tide_lib.config import LakeConfig
from tide_lib.lake import LakeReader, LakeWriter, ObjectStore, target_slug
from tide_lib.lake.schema import (
    LEGACY_RECORD_SCHEMAS,
    MAX_SEGMENT_CHARS,
    records_to_table,
    segment_problem,
)

SLUG = target_slug("demo/target")


@pytest.mark.parametrize("label", [None, "english", "한국어 법률", "py-docs_v2.1"])
def test_segment_labels_that_are_short_names_pass(label: str | None) -> None:
    assert segment_problem(label) is None


@pytest.mark.parametrize(
    "label",
    ["", " leading", "new\nline", "a/b", "colon:x", "x" * (MAX_SEGMENT_CHARS + 1), 7, ".."],
)
def test_segment_labels_that_would_break_tags_or_keys_are_refused(label: object) -> None:
    assert segment_problem(label) is not None


def test_records_to_table_carries_the_segment() -> None:
    table = records_to_table([dataclasses.replace(make_record(0), segment="law"), make_record(1)])
    assert table.column("segment").to_pylist() == ["law", None]


@pytest.mark.slow
def test_segment_round_trips_and_bad_labels_are_refused_and_counted(
    lake_store: ObjectStore, lake_config: LakeConfig
) -> None:
    records = [
        dataclasses.replace(make_record(0), segment="korean law"),
        make_record(1),  # no label
        dataclasses.replace(make_record(2), segment="bad\x00label"),
        dataclasses.replace(make_record(3), segment="x" * 100),
    ]
    with LakeWriter(lake_store, lake_config) as writer:
        for record in records:
            assert writer.submit(record)  # serving is never raised at for a label
        assert writer.flush(timeout=30)
        assert writer.stats().refused_records == 2
    reader = LakeReader(lake_store, lake_config)
    samples = {s.request_id: s for s in reader.iter_records(reader.list_shards(SLUG))}
    assert {rid: s.segment for rid, s in samples.items()} == {"req-0": "korean law", "req-1": None}


@pytest.mark.slow
def test_shards_written_before_the_column_read_as_unlabelled(
    lake_store: ObjectStore, lake_config: LakeConfig, tmp_path: Path
) -> None:
    with LakeWriter(lake_store, lake_config) as writer:
        assert writer.submit(make_record(0))
        assert writer.flush(timeout=30)
    reader = LakeReader(lake_store, lake_config)
    (marker,) = reader.list_shards(SLUG)
    # Rewrite the shard as a schema-1 writer did: no segment column (its marker to match).
    legacy = records_to_table([make_record(0)]).drop_columns(["segment"])
    assert legacy.schema.remove_metadata().equals(LEGACY_RECORD_SCHEMAS[0].remove_metadata())
    path = tmp_path / "legacy.parquet"
    pq.write_table(legacy, path)
    lake_store.put_file(marker.shard_key, path)
    rewritten = dataclasses.replace(
        marker,
        size_bytes=path.stat().st_size,
        sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
    )
    lake_store.put_bytes(marker.key, rewritten.to_json())

    fresh = LakeReader(lake_store, lake_config)
    (sample,) = list(fresh.iter_records(fresh.list_shards(SLUG)))
    assert sample.request_id == "req-0" and sample.segment is None
    assert fresh.debris.corrupt_shards == 0
