"""One adaptation cycle, as the steps ``tide_adaptation`` runs (one function per task).

Each step takes the typed configuration and what earlier steps returned (small
JSON-able dicts, fit for XCom), and is safe to rerun:

- the **snapshot** of a cycle is written once to the lake and read back on a rerun;
- **registration** finds the version a cycle already registered;
- **promotion** of a version that is already champion does nothing;
- the **watermark** only moves forward, and only in the last step.

State lives in the lake bucket under ``<prefix>/_state/target=<slug>/``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path
from typing import Any

import torch

from tide_lib.config import DEFAULT_HOME, TideConfig
from tide_lib.lake import LakeReader, ObjectStore, target_slug
from tide_lib.lake.layout import CommitMarker
from tide_lib.lake.reader import TrainingSample

__all__ = [
    "advance_watermark",
    "apply_retention",
    "evaluate_and_gate",
    "new_tokens",
    "promote",
    "read_watermark",
    "register",
    "rollback",
    "snapshot_window",
    "train",
]

logger = logging.getLogger(__name__)

_MAX_OLDER_EVAL = 64  # held-out requests of older traffic evaluated per cycle


def _store(config: TideConfig) -> ObjectStore:
    return ObjectStore(config.store, config.store.lake_bucket)


def _reader(config: TideConfig) -> LakeReader:
    return LakeReader(_store(config), config.lake)


def _state_key(config: TideConfig, name: str) -> str:
    return f"{config.lake.prefix}/_state/target={target_slug(config.cycle.target_id)}/{name}"


def read_watermark(config: TideConfig) -> str | None:
    store, key = _store(config), _state_key(config, "watermark.json")
    if not store.exists(key):
        return None
    value: str | None = json.loads(store.get_bytes(key))["watermark"]
    return value


def new_tokens(config: TideConfig) -> int:
    """Captured tokens committed after the watermark (what the sensor waits on)."""
    slug = target_slug(config.cycle.target_id)
    return _reader(config).count_tokens(slug, after=read_watermark(config), settled=True)


def cycle_tokens(config: TideConfig, cycle_id: str) -> int:
    """What the sensor compares with ``min_new_tokens``.

    A cycle that already froze its window (a rerun) has its window's tokens: the
    data it consumes no longer counts as new once the watermark moved past it.
    """
    saved = _saved_snapshot(config, cycle_id)
    return int(saved["window_tokens"]) if saved is not None else new_tokens(config)


def _snapshot_key(config: TideConfig, cycle_id: str) -> str:
    return _state_key(config, f"cycles/{cycle_id}.json")


def _saved_snapshot(config: TideConfig, cycle_id: str) -> dict[str, Any] | None:
    store, key = _store(config), _snapshot_key(config, cycle_id)
    if not store.exists(key):
        return None
    snapshot: dict[str, Any] = json.loads(store.get_bytes(key))
    return snapshot


def snapshot_window(config: TideConfig, cycle_id: str) -> dict[str, Any]:
    """Freeze the shards of this cycle: the new window, and older shards for replay."""
    saved = _saved_snapshot(config, cycle_id)
    if saved is not None:
        logger.info("cycle %s: reusing its snapshot (%d shards)", cycle_id, len(saved["window"]))
        return saved
    store, key = _store(config), _snapshot_key(config, cycle_id)
    slug = target_slug(config.cycle.target_id)
    reader = _reader(config)
    before = read_watermark(config)
    window = reader.list_shards(slug, after=before, settled=True)
    if not window:
        raise RuntimeError(
            f"no committed shards for {slug} after watermark {before} that are at least "
            f"{config.lake.commit_settle_s:g} s old (lake.commit_settle_s)"
        )
    older = [m for m in reader.list_shards(slug) if before is not None and m.key <= before]
    window_tokens = sum(m.num_tokens for m in window)
    budget = config.cycle.replay_share * window_tokens
    replay: list[CommitMarker] = []
    for marker in random.Random(cycle_id).sample(older, len(older)):
        if sum(m.num_tokens for m in replay) >= budget:
            break
        replay.append(marker)
    snapshot = {
        "cycle_id": cycle_id,
        "target_id": config.cycle.target_id,
        "watermark_before": before,
        "watermark_after": window[-1].key,
        "window": [m.key for m in window],
        "replay": [m.key for m in replay],
        "window_tokens": window_tokens,
        "replay_tokens": sum(m.num_tokens for m in replay),
        "older": [m.key for m in older],
    }
    store.put_bytes(key, json.dumps(snapshot).encode(), content_type="application/json")
    logger.info(
        "cycle %s: window of %d shards (%d tokens), replay of %d shards",
        cycle_id,
        len(window),
        window_tokens,
        len(replay),
    )
    return snapshot


def _markers(reader: LakeReader, keys: list[str]) -> list[CommitMarker]:
    markers = []
    for key in keys:
        marker = reader.marker(key)
        if marker is not None:
            markers.append(marker)
    return markers


def _held_out(sample: TrainingSample, percent: int) -> bool:
    return hashlib.sha256(sample.request_id.encode()).digest()[0] * 100 // 256 < percent


def _save(sample: TrainingSample, directory: Path, index: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(sample.to_specforge(), directory / f"data_{index:08d}.ckpt")


def _export(config: TideConfig, snapshot: dict[str, Any], work: Path) -> dict[str, Path]:
    """Train (window minus held-out, plus replay), recent held-out and older held-out dirs."""
    reader = _reader(config)
    dirs = {name: work / name for name in ("train", "recent", "older")}
    percent = config.cycle.held_out_percent
    count = 0
    stride = max(2, 100 // percent)  # every stride-th window request, the first included
    for position, sample in enumerate(reader.iter_samples(_markers(reader, snapshot["window"]))):
        _save(sample, dirs["recent" if position % stride == 0 else "train"], count)
        count += 1
    older_kept = 0
    for sample in reader.iter_samples(_markers(reader, snapshot["older"])):
        if older_kept < _MAX_OLDER_EVAL and _held_out(sample, percent):
            _save(sample, dirs["older"], count)
            older_kept += 1
            count += 1
    for sample in reader.iter_samples(_markers(reader, snapshot["replay"])):
        if not _held_out(sample, percent):
            _save(sample, dirs["train"], count)
        count += 1
    return dirs


def train(config: TideConfig, snapshot: dict[str, Any], work_dir: Path) -> dict[str, Any]:
    """Train the cycle's challenger, warm-started from the champion; logs to an MLflow run."""
    import mlflow  # noqa: PLC0415

    from tide_lib.registry import CHAMPION, DraftRegistry  # noqa: PLC0415
    from tide_lib.training.tracking import MlflowMetricSink  # noqa: PLC0415
    from tide_lib.training.trainer import train_draft  # noqa: PLC0415

    work = work_dir / snapshot["cycle_id"]
    dirs = _export(config, snapshot, work / "data")
    registry = DraftRegistry(config.mlflow.tracking_uri, config.cycle.target_id)
    registered = registry.find_by_tag("tide.cycle_id", snapshot["cycle_id"])
    if registered is not None and registered.run_id:
        cycle_id = snapshot["cycle_id"]
        logger.info("cycle %s trained v%s before: reusing it", cycle_id, registered.version)
        return {
            "run_id": registered.run_id,
            "draft_dir": str(registry.download(registered.version, work / "registered")),
            "data_dir": str(work / "data"),
            "parent_version": registered.tags.get("tide.parent_version") or None,
        }
    champion = registry.alias(CHAMPION)
    parent = registry.download(champion.version, work / "parent") if champion else None
    client = mlflow.MlflowClient(config.mlflow.tracking_uri)
    run = client.create_run(
        registry.experiment_id(),
        run_name=f"cycle-{snapshot['cycle_id']}",
        tags={
            "tide.cycle_id": snapshot["cycle_id"],
            "tide.parent_version": champion.version if champion else "",
        },
    )
    result = train_draft(
        dirs["train"],
        config.cycle.target_path,
        work / "run",
        config.training,
        parent_dir=parent,
        metrics=MlflowMetricSink(config.mlflow.tracking_uri, run.info.run_id),
    )
    client.log_param(run.info.run_id, "window_tokens", snapshot["window_tokens"])
    client.log_param(run.info.run_id, "replay_tokens", snapshot["replay_tokens"])
    client.set_terminated(run.info.run_id)
    return {
        "run_id": run.info.run_id,
        "draft_dir": str(result.draft_dir),
        "data_dir": str(work / "data"),
        "parent_version": champion.version if champion else None,
    }


def register(config: TideConfig, snapshot: dict[str, Any], trained: dict[str, Any]) -> str:
    import specforge  # noqa: PLC0415

    from tide_lib.registry import DraftRegistry  # noqa: PLC0415

    registry = DraftRegistry(config.mlflow.tracking_uri, config.cycle.target_id)
    version = registry.register(
        Path(trained["draft_dir"]),
        trained["run_id"],
        cycle_id=snapshot["cycle_id"],
        tags={
            "tide.window.after": str(snapshot["watermark_before"]),
            "tide.window.until": snapshot["watermark_after"],
            "tide.window.tokens": str(snapshot["window_tokens"]),
            "tide.replay.tokens": str(snapshot["replay_tokens"]),
            "tide.parent_version": str(trained["parent_version"] or ""),
            "tide.specforge_version": getattr(specforge, "__version__", "0.2.0"),
        },
    )
    return version.version


def evaluate_and_gate(
    config: TideConfig, snapshot: dict[str, Any], trained: dict[str, Any], version: str
) -> dict[str, Any]:
    """Offline acceptance of challenger and champion per segment; the gate's decision."""
    from tide_lib.evaluation.gate import decide, decision_from_tags  # noqa: PLC0415
    from tide_lib.evaluation.offline import offline_acceptance  # noqa: PLC0415
    from tide_lib.evaluation.tracking import log_decision  # noqa: PLC0415
    from tide_lib.registry import CHAMPION, DraftRegistry  # noqa: PLC0415
    from tide_lib.training.draft import load_draft  # noqa: PLC0415
    from tide_lib.training.specforge_runtime import prepare_specforge  # noqa: PLC0415
    from tide_lib.training.trainer import list_samples, load_sample  # noqa: PLC0415

    prepare_specforge("cpu")
    data = Path(trained["data_dir"])
    target = config.cycle.target_path
    k = config.gate.k

    def segments() -> dict[str, list[TrainingSample]]:
        result: dict[str, list[TrainingSample]] = {}
        for name in ("recent", "older"):
            if (data / name).is_dir() and any((data / name).glob("*.ckpt")):
                result[name] = [
                    _as_sample(load_sample(p), p.name) for p in list_samples(data / name)
                ]
        return result

    def figures(draft_dir: Path) -> dict[str, float]:
        counts = offline_acceptance(load_draft(draft_dir, target), target, segments(), [k])
        return {segment: by_k[k].accept_length for segment, by_k in counts.items()}

    registry = DraftRegistry(config.mlflow.tracking_uri, config.cycle.target_id)
    decision = decision_from_tags(registry.get(version).tags, k)
    if decision is not None:
        logger.info("v%s was judged before: %s", version, decision.reason)
    else:
        challenger = figures(Path(trained["draft_dir"]))
        champion_version = registry.alias(CHAMPION)
        champion = None
        if champion_version is not None and champion_version.version != version:
            champion_dir = registry.download(champion_version.version, data.parent / "champion")
            champion = figures(champion_dir)
        weights = {"recent": 1.0, "older": 1.0}
        decision = decide(challenger, champion, config.gate, weights)
        log_decision(config.mlflow.tracking_uri, registry.name, version, decision, k)
    return {
        "promote": decision.promote or config.cycle.force_promote,
        "reason": decision.reason,
        "challenger": decision.challenger,
        "champion": decision.champion,
    }


def _as_sample(raw: dict[str, torch.Tensor], name: str) -> TrainingSample:
    from datetime import UTC, datetime  # noqa: PLC0415

    return TrainingSample(
        request_id=name,
        draft_version="",
        finished_at=datetime.now(UTC),
        input_ids=raw["input_ids"],
        loss_mask=raw["loss_mask"],
        hidden_state=raw["hidden_state"],
        aux_hidden_state=raw["aux_hidden_state"],
        spec_verify_ct=0,
        spec_accept_tokens=0,
    )


def promote(config: TideConfig, version: str, decision: dict[str, Any]) -> dict[str, Any]:
    """Roll the version out to the fleet, then move ``champion``/``previous-champion``."""
    from tide_lib.registry import CHAMPION, DraftRegistry  # noqa: PLC0415
    from tide_lib.serving.fleet import FleetManager  # noqa: PLC0415

    registry = DraftRegistry(config.mlflow.tracking_uri, config.cycle.target_id)
    if not decision["promote"] or config.cycle.dry_run:
        why = "dry run" if config.cycle.dry_run else decision["reason"]
        logger.info("not promoting v%s: %s", version, why)
        return {"promoted": False, "reason": why}
    current = registry.alias(CHAMPION)
    if current is not None and current.version == version:
        return {"promoted": False, "reason": f"v{version} is already champion"}
    if registry.get(version).tags.get("tide.promoted") == "true":
        why = f"v{version} was promoted before; serve it again with tide_rollback"
        logger.info("not promoting: %s", why)
        return {"promoted": False, "reason": why}
    if config.cycle.servers:
        drafts = (DEFAULT_HOME / "drafts" / registry.name).resolve()
        local = registry.download(version, drafts / f"v{version}")
        FleetManager(config.cycle.servers).promote(local, f"{registry.name}-v{version}")
    registry.promote(version)
    return {"promoted": True, "reason": decision["reason"]}


def advance_watermark(config: TideConfig, snapshot: dict[str, Any]) -> str:
    """Mark the window consumed; never moves backwards."""
    store, key = _store(config), _state_key(config, "watermark.json")
    current = read_watermark(config)
    target = snapshot["watermark_after"]
    if current is not None and current >= target:
        return current
    store.put_bytes(
        key, json.dumps({"watermark": target, "cycle_id": snapshot["cycle_id"]}).encode()
    )
    return str(target)


def rollback(config: TideConfig, version: str) -> dict[str, Any]:
    """Serve an earlier version (a number, or an alias such as ``previous-champion``)."""
    from tide_lib.registry import DraftRegistry  # noqa: PLC0415
    from tide_lib.serving.fleet import FleetManager  # noqa: PLC0415

    registry = DraftRegistry(config.mlflow.tracking_uri, config.cycle.target_id)
    resolved = registry.alias(version) if not version.isdigit() else None
    number = resolved.version if resolved is not None else version
    if not number.isdigit():
        raise ValueError(f"{registry.name} has no version or alias {version!r}")
    if config.cycle.servers:
        drafts = (DEFAULT_HOME / "drafts" / registry.name).resolve()
        local = registry.download(number, drafts / f"v{number}")
        FleetManager(config.cycle.servers).promote(local, f"{registry.name}-v{number}")
    registry.promote(number)
    logger.info("rolled %s back to v%s", registry.name, number)
    return {"version": number}


def apply_retention(config: TideConfig, now: Any = None) -> dict[str, int]:
    """Delete consumed shards older than ``lake.retention_days``; never unconsumed ones."""
    from datetime import UTC, datetime, timedelta  # noqa: PLC0415

    store, reader = _store(config), _reader(config)
    slug = target_slug(config.cycle.target_id)
    watermark = read_watermark(config)
    cutoff = (now or datetime.now(UTC)) - timedelta(days=config.lake.retention_days)
    deleted = kept_unconsumed = 0
    for marker in reader.list_shards(slug):
        if marker.max_finished_at >= cutoff:
            continue
        if watermark is None or marker.key > watermark:
            kept_unconsumed += 1
            continue
        store.remove(marker.shard_key)
        store.remove(marker.key)
        deleted += 1
    logger.info(
        "retention on %s: deleted %d shards older than %s, kept %d not yet consumed",
        slug,
        deleted,
        cutoff.isoformat(),
        kept_unconsumed,
    )
    return {"deleted": deleted, "kept_unconsumed": kept_unconsumed}
