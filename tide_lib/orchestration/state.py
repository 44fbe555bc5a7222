"""Where a cycle keeps its state, and the cycle's segmenter.

Every step of a cycle runs on a host of its own, so what steps share lives in
the lake bucket under ``<prefix>/_state/target=<slug>/`` (snapshots, drift
verdicts, baselines, segmenters, checkpoints) or in the MLflow registry; a step
downloads what it needs into a scratch directory of its own. This module names
those places and opens them.

Traffic is judged by segment (:mod:`tide_lib.evaluation.segments`): a client's
label, else a cluster of the target's states. Each cycle fits its segmenter once
(warm-started from the previous cycle's) and keeps it at
``_state/target=<slug>/cycles/<cycle_id>/segmenter.json``; the version it
registers is tagged with that key.
"""

from __future__ import annotations

__all__ = [
    "cycle_segmenter",
    "draft_registry",
    "lake_reader",
    "lake_store",
    "log_debris",
    "markers_of",
    "read_state",
    "sample_reader",
    "segmenter_key",
    "state_key",
    "stored_segmenter",
    "task_scratch",
    "write_state",
]

import contextlib
import dataclasses
import json
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tide_lib.config import TideConfig
from tide_lib.evaluation.segments import Segmenter, fit_segmenter
from tide_lib.lake import LakeReader, ObjectStore, target_slug
from tide_lib.lake.layout import CommitMarker
from tide_lib.lake.schema import target_limits
from tide_lib.orchestration.handoff import Snapshot

if TYPE_CHECKING:
    from tide_lib.registry import DraftRegistry

logger = logging.getLogger(__name__)


def lake_store(config: TideConfig) -> ObjectStore:
    return ObjectStore(config.store, config.store.lake_bucket)


def draft_registry(config: TideConfig) -> DraftRegistry:
    from tide_lib.registry import DraftRegistry  # noqa: PLC0415

    return DraftRegistry(config.mlflow.tracking_uri, config.cycle.target_id)


def state_key(config: TideConfig, name: str) -> str:
    return f"{config.lake.prefix}/_state/target={target_slug(config.cycle.target_id)}/{name}"


def read_state(config: TideConfig, name: str) -> bytes | None:
    """The cycle state kept under ``name`` (a JSON document, see :func:`state_key`); None
    when none is kept yet."""
    store, key = lake_store(config), state_key(config, name)
    return store.get_bytes(key) if store.exists(key) else None


def write_state(config: TideConfig, name: str, document: bytes) -> None:
    """Keep ``document`` (JSON) under ``name``: tasks on other hosts read it over S3."""
    lake_store(config).put_bytes(state_key(config, name), document, content_type="application/json")


def lake_reader(config: TideConfig) -> LakeReader:
    """A reader that lists and counts commits; it reads no record (see sample_reader)."""
    return LakeReader(lake_store(config), config.lake)


def sample_reader(config: TideConfig) -> LakeReader:
    """A reader that skips records not fit for this target: its hidden and vocabulary sizes.

    They come from the target's ``config.json`` where this host has the target; a
    host without it still skips records whose states are NaN/inf.
    """
    return LakeReader(
        lake_store(config), config.lake, limits=target_limits(config.cycle.target_path)
    )


def log_debris(reader: LakeReader, what: str) -> None:
    debris = {k: v for k, v in dataclasses.asdict(reader.debris).items() if v}
    if debris:
        logger.warning("%s skipped lake debris: %s", what, debris)


def markers_of(reader: LakeReader, keys: list[str]) -> list[CommitMarker]:
    markers = []
    for key in keys:
        marker = reader.marker(key)
        if marker is not None:
            markers.append(marker)
    return markers


@contextlib.contextmanager
def task_scratch(config: TideConfig, name: str) -> Iterator[Path]:
    """A scratch directory of this task's own under ``scratch_dir``, removed when it ends."""
    config.scratch_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{name}-", dir=config.scratch_dir) as tmp:
        yield Path(tmp)


_SEGMENTER_POINTER = "segmenter.json"  # names the latest cycle's segmenter (its warm start)


def segmenter_key(config: TideConfig, cycle_id: str) -> str:
    return state_key(config, f"cycles/{cycle_id}/segmenter.json")


def stored_segmenter(config: TideConfig, key: str | None) -> Segmenter | None:
    """The segmenter stored at ``key``; None (logged) when there is none at that key or it
    cannot be parsed. An error reaching the store is raised: the task is retried."""
    store = lake_store(config)
    if not key or not store.exists(key):
        if key:
            logger.warning("segmenter %s is not in the lake", key)
        return None
    raw = store.get_bytes(key)
    try:
        return Segmenter.from_json(raw)
    except (ValueError, KeyError, TypeError) as error:
        logger.warning("segmenter %s is unreadable: %s", key, error)
        return None


def _latest_segmenter(config: TideConfig, cycle_id: str) -> Segmenter | None:
    """The segmenter of the latest other cycle that fitted one (its centroids keep names);
    None costs only stable names: this cycle's clusters start afresh."""
    saved = read_state(config, _SEGMENTER_POINTER)
    if saved is None:
        return None
    latest = json.loads(saved)
    if latest.get("cycle_id") == cycle_id:
        return None  # this cycle's own (a rerun): never fit on itself
    return stored_segmenter(config, latest.get("key"))


def cycle_segmenter(config: TideConfig, snapshot: Snapshot) -> tuple[Segmenter, str]:
    """The cycle's segmenter and its lake key: fitted once, then read back on every host.

    Fitted on the unlabelled requests of the window and of the older held-out commits
    (what the gate judges), warm-started from the previous cycle's centroids.
    """
    store, key = lake_store(config), segmenter_key(config, snapshot.cycle_id)
    if store.exists(key):
        _point_to_segmenter(config, snapshot, key)  # a retry finishes what it began
        return Segmenter.from_json(store.get_bytes(key)), key
    reader = sample_reader(config)
    markers = markers_of(reader, [*snapshot.window, *snapshot.held_out_older])
    segmenter = fit_segmenter(
        reader.iter_records(markers),
        num_clusters=config.cycle.segment_clusters,
        min_share=config.gate.min_segment_share,
        max_labels=config.cycle.segment_labels_max,
        previous=_latest_segmenter(config, snapshot.cycle_id),
        seed=config.training.seed,
    )
    store.put_bytes(key, segmenter.to_json(), content_type="application/json")
    _point_to_segmenter(config, snapshot, key)
    log_debris(reader, f"cycle {snapshot.cycle_id} segmenter")
    return segmenter, key


def _point_to_segmenter(config: TideConfig, snapshot: Snapshot, key: str) -> None:
    """Point the next cycle's warm start at this segmenter, unless a later window has one."""
    saved = read_state(config, _SEGMENTER_POINTER)
    if saved is not None:
        current = json.loads(saved)
        if str(current.get("window_until", "")) >= snapshot.watermark_after:
            return  # this cycle's, or a later one's (a cleared older run never moves it back)
    payload = {"cycle_id": snapshot.cycle_id, "key": key, "window_until": snapshot.watermark_after}
    write_state(config, _SEGMENTER_POINTER, json.dumps(payload).encode())
