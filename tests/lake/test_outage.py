"""The S3 server goes down mid-stream and comes back: nothing lost, nothing twice."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import OUTAGE_STACK_PORTS, make_record, stack_config
from tide_lib.config import LakeConfig
from tide_lib.lake import LakeReader, LakeWriter, ObjectStore, target_slug
from tide_lib.stack import SERVICES, StackManager

pytestmark = pytest.mark.slow


def test_store_restart_mid_stream_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    # A private S3 server: the session stack's MLflow must not see this outage.
    config = stack_config(tmp_path / "stack", port_base=OUTAGE_STACK_PORTS)
    s3_only = StackManager(config, services=tuple(s for s in SERVICES if s.name == "seaweedfs"))
    s3_only.up()
    try:
        store = ObjectStore(config.store, config.store.lake_bucket)
        lake = LakeConfig(
            prefix="outage", spool_dir=tmp_path / "spool", shard_max_age_s=0.3, retry_interval_s=0.3
        )
        writer = LakeWriter(store, lake)
        submitted = 0

        def stream(count: int) -> None:
            nonlocal submitted
            for _ in range(count):
                assert writer.submit(make_record(submitted, tokens=6))
                submitted += 1
                time.sleep(0.02)

        stream(20)
        s3_only.stop_service("seaweedfs")
        stream(30)  # serving goes on; shards spool locally
        time.sleep(1.0)
        during = writer.stats()
        assert not during.store_reachable
        assert during.spooled_shards >= 1
        s3_only.start_service("seaweedfs")
        stream(20)
        assert writer.flush(timeout=60), "spooled shards should upload once the store is back"
        stats = writer.close()
        assert stats.dropped_records == 0
        assert stats.records_uploaded == submitted == 70

        reader = LakeReader(store, lake)
        ids = Counter(
            s.request_id
            for s in reader.iter_records(reader.list_shards(target_slug("demo/target")))
        )
        assert set(ids) == {f"req-{i}" for i in range(70)}
        assert max(ids.values()) == 1, f"duplicated: {[k for k, v in ids.items() if v > 1]}"
        assert reader.count_tokens(target_slug("demo/target")) == 70 * 6
    finally:
        s3_only.down()
