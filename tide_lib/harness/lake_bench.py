"""``tide bench lake``: what capture costs serving, and what the lake costs in bytes and time.

Writes synthetic records of a given shape through the real writer into the real
S3 server, reads them back through the real reader, and reports throughput,
storage per token and the writer's per-record cost on the caller's thread. The
records are random float16, which compresses about as badly as real hidden
states do; the benchmark's own shards are deleted afterwards.
"""

from __future__ import annotations

__all__ = ["HEADLINE_KEYS", "LakeBenchParams", "run_lake_bench"]

import dataclasses
import json
import logging
import os
import platform
import statistics
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from tide_lib.config import TideConfig
from tide_lib.harness.params import LakeBenchParams
from tide_lib.lake.layout import target_slug
from tide_lib.lake.reader import LakeReader
from tide_lib.lake.schema import NUM_AUX_LAYERS, CapturedRecord
from tide_lib.lake.store import ObjectStore, StoreUnavailableError
from tide_lib.lake.writer import LakeWriter

logger = logging.getLogger(__name__)

HEADLINE_KEYS = (
    "write_tokens_per_s",
    "write_mb_per_s",
    "bytes_per_token",
    "raw_fp16_bytes_per_token",
    "read_tokens_per_s",
    "writer_us_per_record",
)


def _payloads(
    params: LakeBenchParams, target_id: str, rng: np.random.Generator
) -> list[CapturedRecord]:
    """Records of random tokens and float16 states that the benchmark submits in turn."""
    tokens, hidden = params.tokens_per_record, params.hidden_size
    created = datetime.now(UTC)
    return [
        CapturedRecord(
            request_id="bench",
            target_id=target_id,
            draft_version="bench",
            started_at=created,
            finished_at=created,
            input_ids=rng.integers(0, 32000, tokens, dtype=np.int32),
            loss_mask=(rng.random(tokens) < 0.7).astype(np.int8),
            hidden_states=rng.standard_normal((tokens, hidden), dtype=np.float32).astype(
                np.float16
            ),
            aux_hidden_states=rng.standard_normal(
                (tokens, hidden * NUM_AUX_LAYERS), dtype=np.float32
            ).astype(np.float16),
        )
        for _ in range(params.distinct_payloads)
    ]


def run_lake_bench(
    config: TideConfig, params: LakeBenchParams, json_path: Path | None
) -> dict[str, Any]:
    store = ObjectStore(config.store, config.store.lake_bucket)
    if not store.is_reachable():
        raise StoreUnavailableError(
            f"S3 store {config.store.endpoint} is not reachable; start it with `tide stack up`"
        )
    store.ensure_bucket()
    target_id = f"tide-bench/lake-{uuid.uuid4().hex[:8]}"
    payloads = _payloads(params, target_id, np.random.default_rng(0))
    total_tokens = params.records * params.tokens_per_record
    raw_fp16_per_token = params.hidden_size * (1 + NUM_AUX_LAYERS) * 2

    with tempfile.TemporaryDirectory(prefix="tide-bench-spool-") as spool:
        lake_config = config.lake.model_copy(
            update={"spool_dir": Path(spool), "queue_max_records": params.records + 1}
        )
        writer = LakeWriter(store, lake_config)
        submit_seconds: list[float] = []
        started = time.perf_counter()
        for index in tqdm(range(params.records), desc="write", unit="rec"):
            now = datetime.now(UTC)
            record = dataclasses.replace(
                payloads[index % len(payloads)],
                request_id=f"bench-{index}",
                started_at=now,
                finished_at=now,
            )
            before = time.perf_counter()
            accepted = writer.submit(record)
            submit_seconds.append(time.perf_counter() - before)
            if not accepted:
                raise RuntimeError("benchmark queue overflowed; this is a bug in the benchmark")
        if not writer.flush(timeout=600):
            raise RuntimeError("writer could not upload every shard within 10 minutes")
        write_seconds = time.perf_counter() - started
        writer_stats = writer.close()

    reader = LakeReader(store, config.lake)
    shards = reader.list_shards(target_slug(target_id))
    stored_bytes = sum(marker.size_bytes for marker in shards)
    started = time.perf_counter()
    read_tokens = 0
    for sample in tqdm(reader.iter_records(shards), total=params.records, desc="read", unit="rec"):
        read_tokens += int(sample.input_ids.shape[0])
    read_seconds = time.perf_counter() - started
    for marker in shards:
        store.remove(marker.shard_key)
        store.remove(marker.key)

    if read_tokens != total_tokens or writer_stats.dropped_records:
        raise RuntimeError(
            f"benchmark lost data: wrote {total_tokens} tokens, read {read_tokens}, "
            f"dropped {writer_stats.dropped_records} records"
        )
    result: dict[str, Any] = {
        "write_tokens_per_s": total_tokens / write_seconds,
        "write_mb_per_s": total_tokens * raw_fp16_per_token / write_seconds / 1e6,
        "bytes_per_token": stored_bytes / total_tokens,
        "raw_fp16_bytes_per_token": raw_fp16_per_token,
        "read_tokens_per_s": read_tokens / read_seconds,
        "writer_us_per_record": statistics.mean(submit_seconds) * 1e6,
        "writer_us_per_record_p99": float(np.percentile(submit_seconds, 99) * 1e6),
        "shards": len(shards),
        "params": params.model_dump(),
        "tensor_compression": config.lake.tensor_compression,
        "store_endpoint": config.store.endpoint,
        "machine": {"cpus": len(os.sched_getaffinity(0)), "python": platform.python_version()},
        "measured_at": datetime.now(UTC).isoformat(),
    }
    logger.info("lake benchmark: %s", json.dumps(result, indent=2))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return result
