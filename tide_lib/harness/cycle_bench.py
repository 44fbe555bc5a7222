"""``tide bench cycle``: does a cycle's I/O follow its window, or the lake's age?

For each scale (1x, 10x, 100x) the benchmark builds a lake whose older part
holds ``scale`` times as many consumed shards, at the same traffic rate, so a
larger scale is an older lake; then a fresh window of new shards arrives. It
runs the cycle's data steps exactly as ``tide_adaptation`` does (sensor count,
snapshot, training export, the gate's held-out read) and reports per scale the
wall time of those steps, the bytes they read from S3, and the objects listed
and fetched. Training itself is left out: its cost is the window's by
construction.

The shards are real: a few template shards go through the real capture writer,
and the older lake is made of byte copies of them under commit markers stamped
back in time (a marker per copy, as a writer long ago would have left). The
benchmark's objects are deleted afterwards.
"""

from __future__ import annotations

__all__ = ["CycleBenchParams", "CycleBenchResult", "ScaleFigures", "run_cycle_bench"]

import dataclasses
import logging
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from tide_lib.config import TideConfig
from tide_lib.harness.params import CycleBenchParams
from tide_lib.lake import CapturedRecord, LakeReader, LakeWriter, ObjectStore, target_slug
from tide_lib.lake.layout import commit_key, new_shard_id, shard_key
from tide_lib.lake.schema import NUM_AUX_LAYERS
from tide_lib.lake.store import StoreIO, process_io

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ScaleFigures:
    scale: int
    older_shards: int
    seconds: dict[str, float]  # per step, and "total"
    bytes_read: int
    objects_listed: int
    gets: int
    lists: int
    sensor_objects_listed: int
    window_shards: int
    replay_shards: int
    held_out_older_shards: int
    training_samples: int


@dataclasses.dataclass(frozen=True)
class CycleBenchResult:
    params: CycleBenchParams
    scales: list[ScaleFigures]

    def ratios(self) -> dict[str, float]:
        """Largest scale over 1x: time, bytes and objects listed."""
        first, last = self.scales[0], self.scales[-1]
        return {
            "seconds": last.seconds["total"] / max(first.seconds["total"], 1e-9),
            "bytes_read": last.bytes_read / max(first.bytes_read, 1),
            "objects_listed": last.objects_listed / max(first.objects_listed, 1),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "benchmark": "cycle",
            "params": self.params.model_dump(mode="json"),
            "scales": [dataclasses.asdict(figures) for figures in self.scales],
            f"ratio_{self.scales[-1].scale}x_over_{self.scales[0].scale}x": self.ratios(),
        }


def _record(index: int, params: CycleBenchParams, target_id: str) -> CapturedRecord:
    rng = np.random.default_rng(index)
    tokens, hidden = params.tokens_per_record, params.hidden_size
    now = datetime.now(UTC)
    return CapturedRecord(
        request_id=f"bench-{index}",
        target_id=target_id,
        draft_version="bench",
        started_at=now - timedelta(seconds=1),
        finished_at=now,
        input_ids=rng.integers(0, 1000, tokens, dtype=np.int64),
        loss_mask=(np.arange(tokens) >= tokens // 2).astype(np.int8),
        hidden_states=rng.standard_normal((tokens, hidden)).astype(np.float16),
        aux_hidden_states=rng.standard_normal((tokens, NUM_AUX_LAYERS * hidden)).astype(np.float16),
        spec_verify_ct=4,
        spec_accept_tokens=6,
        completion_tokens=tokens // 2,
    )


def _templates(config: TideConfig, params: CycleBenchParams, target_id: str) -> list[Any]:
    """Template shards written by the real capture writer: (marker, shard bytes)."""
    store = ObjectStore(config.store, config.store.lake_bucket)
    lake = config.lake.model_copy(update={"shard_max_age_s": 3600.0, "commit_settle_s": 120.0})
    with LakeWriter(store, lake) as writer:
        for index in range(params.window_shards * params.records_per_shard):
            writer.submit(_record(index, params, target_id))
            if (index + 1) % params.records_per_shard == 0:
                writer.flush(timeout=120)
    reader = LakeReader(
        store, config.lake.model_copy(update={"commit_settle_s": 0.0, "max_clock_skew_s": 0.0})
    )
    markers = reader.list_shards(target_slug(target_id))
    return [(marker, store.get_bytes(marker.shard_key)) for marker in markers]


def _older_lake(
    config: TideConfig, params: CycleBenchParams, target_id: str, count: int, templates: list[Any]
) -> str:
    """``count`` consumed shards going back in time; returns the newest one's commit key."""
    store = ObjectStore(config.store, config.store.lake_bucket)
    slug = target_slug(target_id)
    step = timedelta(hours=params.lookback_hours) / params.older_shards
    newest = datetime.now(UTC) - timedelta(minutes=10)
    keys = []
    for index in tqdm(
        range(count), desc=f"older lake x{count // params.older_shards}", unit="shard"
    ):
        template, data = templates[index % len(templates)]
        moment = newest - index * step
        shard_id = new_shard_id(moment)
        marker = dataclasses.replace(
            template,
            shard_key=shard_key(config.lake.prefix, slug, moment, shard_id),
            committed_at=moment,
            min_finished_at=moment,
            max_finished_at=moment,
        )
        key = commit_key(config.lake.prefix, slug, moment, shard_id)
        store.put_bytes(marker.shard_key, data)
        store.put_bytes(key, marker.to_json(), content_type="application/json")
        keys.append(key)
    return max(keys)


def _measure(
    config: TideConfig, cycle_id: str, work: Path
) -> tuple[dict[str, float], StoreIO, Any]:
    from tide_lib.orchestration import cycle, export  # noqa: PLC0415

    seconds: dict[str, float] = {}
    before = process_io()
    started = time.perf_counter()
    snapshot = cycle.snapshot_window(config, cycle_id)
    seconds["snapshot"] = time.perf_counter() - started
    mark = time.perf_counter()
    samples = export.export_training_data(config, snapshot, work / cycle_id).total
    seconds["export"] = time.perf_counter() - mark
    mark = time.perf_counter()
    export.held_out_samples(config, snapshot)
    seconds["evaluation_io"] = time.perf_counter() - mark
    seconds["total"] = time.perf_counter() - started
    after = process_io()
    used = StoreIO(
        bytes_read=after.bytes_read - before.bytes_read,
        objects_listed=after.objects_listed - before.objects_listed,
        gets=after.gets - before.gets,
        lists=after.lists - before.lists,
    )
    return seconds, used, (snapshot, samples)


def _one_scale(
    config: TideConfig, params: CycleBenchParams, scale: int, work: Path
) -> ScaleFigures:
    from tide_lib.orchestration import cycle  # noqa: PLC0415

    target_id = f"bench-cycle-{uuid.uuid4().hex[:6]}"
    run = config.model_copy(
        update={
            # Its older lake is history written now with past stamps: trust the stamps.
            "lake": config.lake.model_copy(
                update={"commit_settle_s": 0.0, "max_clock_skew_s": 0.0}
            ),
            "cycle": config.cycle.model_copy(
                update={
                    "target_id": target_id,
                    "replay_lookback_hours": params.lookback_hours,
                    "held_out_older_tokens": params.held_out_older_tokens,
                    "replay_share": params.replay_share,
                }
            ),
        }
    )
    templates = _templates(run, params, target_id)  # also the new window: committed just now
    older = params.older_shards * scale
    watermark = _older_lake(run, params, target_id, older, templates)
    store = ObjectStore(run.store, run.store.lake_bucket)
    store.put_bytes(
        f"{run.lake.prefix}/_state/target={target_slug(target_id)}/watermark.json",
        f'{{"watermark": "{watermark}", "cycle_id": "bench"}}'.encode(),
    )
    sensor_before = process_io().objects_listed
    cycle.new_tokens(run)
    sensor_listed = process_io().objects_listed - sensor_before
    seconds, used, (snapshot, samples) = _measure(run, f"bench-{scale}x", work)
    _remove_target(store, run.lake.prefix, target_slug(target_id))
    return ScaleFigures(
        scale=scale,
        older_shards=older,
        seconds={name: round(value, 4) for name, value in seconds.items()},
        bytes_read=used.bytes_read,
        objects_listed=used.objects_listed,
        gets=used.gets,
        lists=used.lists,
        sensor_objects_listed=sensor_listed,
        window_shards=len(snapshot.window),
        replay_shards=len(snapshot.replay),
        held_out_older_shards=len(snapshot.held_out_older),
        training_samples=samples,
    )


def _remove_target(store: ObjectStore, prefix: str, slug: str) -> None:
    for root in (f"{prefix}/target={slug}/", f"{prefix}/_commits/target={slug}/"):
        for info in list(store.list(root)):
            store.remove(info.key)
    for info in list(store.list(f"{prefix}/_state/target={slug}/")):
        store.remove(info.key)


def run_cycle_bench(config: TideConfig, params: CycleBenchParams, work: Path) -> CycleBenchResult:
    """Measure the cycle's data steps at each scale of the older lake."""
    ObjectStore(config.store, config.store.lake_bucket).ensure_bucket()
    figures = []
    for scale in params.scales:
        figures.append(_one_scale(config, params, scale, work))
        logger.info("cycle bench %dx: %s", scale, figures[-1])
    return CycleBenchResult(params=params, scales=figures)
