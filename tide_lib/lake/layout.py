"""Where shards and their commit markers live in the bucket, and what a marker says.

Shards are Hive-partitioned by the hour their requests finished::

    <prefix>/target=<slug>/dt=YYYY-MM-DD/hour=HH/part-<shard_id>.parquet

A shard exists for readers only once its commit marker is written::

    <prefix>/_commits/target=<slug>/<commit_key>.json

Commit keys sort by commit time, so "everything committed after a watermark" is a
single ``ListObjects(start_after=...)`` call, and a window snapshot is a frozen
list of commit keys. A marker is stamped before its PUT, so with several writers
one stamped earlier can land after one stamped later; readers that move a
watermark take only commits older than ``lake.commit_settle_s`` (``settled``).
Markers are small and immutable; they hold the shard's token
count so that sensors sum tokens without opening a shard. Directories starting
with ``_`` are skipped by Hive-style readers (pyarrow, DuckDB, Spark), so the
marker log does not pollute queries over the shards.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from datetime import UTC, datetime
from typing import Any, Final

__all__ = [
    "CommitMarker",
    "commit_key",
    "commit_prefix",
    "commit_stamp_key",
    "commit_time",
    "new_shard_id",
    "quarantine_key",
    "shard_key",
    "target_prefix",
    "target_slug",
]

MARKER_VERSION: Final = 1
_SLUG_UNSAFE = re.compile(r"[^a-z0-9._-]+")


def target_slug(target_id: str) -> str:
    """A path- and registry-safe name.

    ``meta-llama/Llama-3.1-8B`` becomes ``meta-llama--llama-3.1-8b``.
    """
    slug = _SLUG_UNSAFE.sub("-", target_id.strip().lower().replace("/", "--")).strip("-.")
    if not slug:
        raise ValueError(f"target id {target_id!r} has no characters usable in a slug")
    return slug


def new_shard_id(now: datetime | None = None) -> str:
    """Unique, roughly time-ordered shard id: ``<UTC timestamp>-<random hex>``."""
    moment = (now or datetime.now(UTC)).astimezone(UTC)
    return f"{moment:%Y%m%dT%H%M%S%f}Z-{uuid.uuid4().hex[:12]}"


def target_prefix(prefix: str, slug: str) -> str:
    return f"{prefix}/target={slug}/"


def shard_key(prefix: str, slug: str, finished_at: datetime, shard_id: str) -> str:
    hour = finished_at.astimezone(UTC)
    return f"{prefix}/target={slug}/dt={hour:%Y-%m-%d}/hour={hour:%H}/part-{shard_id}.parquet"


def commit_prefix(prefix: str, slug: str) -> str:
    return f"{prefix}/_commits/target={slug}/"


def commit_key(prefix: str, slug: str, committed_at: datetime, shard_id: str) -> str:
    moment = committed_at.astimezone(UTC)
    return f"{commit_prefix(prefix, slug)}{moment:%Y%m%dT%H%M%S%f}Z-{shard_id}.json"


def commit_stamp_key(prefix: str, slug: str, moment: datetime) -> str:
    """A key that sorts just before every commit stamped at ``moment`` or later.

    Use it as ``start_after`` to list the commits of a time range without the older ones.
    """
    return f"{commit_prefix(prefix, slug)}{moment.astimezone(UTC):%Y%m%dT%H%M%S%f}Z"


def commit_time(key: str) -> datetime:
    """When the marker at ``key`` was stamped: the time its key sorts by."""
    stamp = key.rsplit("/", 1)[-1].split("Z-", 1)[0]
    return datetime.strptime(stamp, "%Y%m%dT%H%M%S%f").replace(tzinfo=UTC)


def quarantine_key(prefix: str, key: str) -> str:
    """Where a corrupt object is moved: same relative path under ``<prefix>/_quarantine/``."""
    relative = key.removeprefix(f"{prefix}/")
    return f"{prefix}/_quarantine/{relative}"


@dataclasses.dataclass(frozen=True, slots=True)
class CommitMarker:
    """What a reader needs to know about a shard without opening it."""

    shard_key: str
    target_slug: str
    num_records: int
    num_tokens: int
    num_output_tokens: int
    size_bytes: int
    sha256: str
    min_finished_at: datetime
    max_finished_at: datetime
    committed_at: datetime
    writer_id: str
    key: str = ""  # the marker's own object key, filled in when listed

    def to_json(self) -> bytes:
        payload: dict[str, Any] = dataclasses.asdict(self)
        payload.pop("key")
        for name in ("min_finished_at", "max_finished_at", "committed_at"):
            payload[name] = payload[name].isoformat()
        payload["version"] = MARKER_VERSION
        return json.dumps(payload, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, key: str = "") -> CommitMarker:
        payload = json.loads(raw)
        if payload.pop("version", None) != MARKER_VERSION:
            raise ValueError(f"commit marker {key} has an unknown version")
        for name in ("min_finished_at", "max_finished_at", "committed_at"):
            payload[name] = datetime.fromisoformat(payload[name])
        return cls(key=key, **payload)
