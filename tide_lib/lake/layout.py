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

__all__ = [
    "CommitMarker",
    "InvalidMarkerError",
    "commit_key",
    "commit_position",
    "commit_prefix",
    "commit_stamp_key",
    "commit_time",
    "new_shard_id",
    "parse_commit_key",
    "quarantine_key",
    "shard_key",
    "target_prefix",
    "target_slug",
]

import dataclasses
import json
import re
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from tide_lib.errors import TideError
from tide_lib.names import target_slug

MARKER_VERSION: Final = 1
_MARKER_NAME = re.compile(
    r"(?P<stamp>\d{8}T\d{12})Z-(?P<shard_id>[A-Za-z0-9_-][A-Za-z0-9._-]*)\.json"
)
_SHARD_TAIL = re.compile(
    r"dt=\d{4}-\d{2}-\d{2}/hour=\d{2}/part-(?P<shard_id>[A-Za-z0-9._-]+)\.parquet"
)
_SHA256 = re.compile(r"[0-9a-f]{64}")
# S3 reports Last-Modified to the second: the time a marker landed is at most this later.
LAST_MODIFIED_RESOLUTION: Final = timedelta(seconds=1)


class InvalidMarkerError(TideError, ValueError):
    """A commit marker (or an object where one should be) cannot be trusted; says why."""


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
    """When the marker at ``key`` was stamped: the time its key sorts by.

    Also takes a stamp key (:func:`commit_stamp_key`); raises ``ValueError`` for others.
    """
    stamp = key.rsplit("/", 1)[-1].split("Z", 1)[0]
    return datetime.strptime(stamp, "%Y%m%dT%H%M%S%f").replace(tzinfo=UTC)


def parse_commit_key(prefix: str, key: str) -> tuple[str, datetime, str] | None:
    """``(slug, stamp, shard_id)`` of a marker key; None for any other object (a stray)."""
    head = f"{prefix}/_commits/target="
    if not key.startswith(head):
        return None
    slug, _, name = key.removeprefix(head).partition("/")
    match = _MARKER_NAME.fullmatch(name)
    if not slug or match is None or ".." in name:
        return None
    try:
        stamp = datetime.strptime(match["stamp"], "%Y%m%dT%H%M%S%f").replace(tzinfo=UTC)
    except ValueError:
        return None
    return slug, stamp, match["shard_id"]


def commit_position(key: str, last_modified: datetime | None, settle_s: float) -> str:
    """Where a commit sorts for watermarks: its key, unless it landed late.

    A marker that landed more than ``settle_s`` after its stamp may be behind a
    watermark that moved on meanwhile; its position is then a key of the same shape
    stamped ``settle_s`` before it landed (by the store's clock), which is past every
    watermark set before it landed, so it is counted once, and late rather than never.
    """
    if last_modified is None:
        return key
    stamp = commit_time(key)
    landed = last_modified.astimezone(UTC) + LAST_MODIFIED_RESOLUTION  # an upper bound
    moment = landed - timedelta(seconds=settle_s)
    # No tolerance band: a marker landing even slightly after ``stamp + settle`` may
    # already be behind a watermark, so it always takes the later of the two positions.
    if moment <= stamp:
        return key
    head, name = key.rsplit("/", 1)
    return f"{head}/{moment:%Y%m%dT%H%M%S%f}Z-{name.split('Z-', 1)[1]}"


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
    position: str = ""  # where it sorts for watermarks (see commit_position); key if empty

    @property
    def order(self) -> str:
        """The string a watermark is compared with: ``position``, else ``key``."""
        return self.position or self.key

    def to_json(self) -> bytes:
        payload: dict[str, Any] = dataclasses.asdict(self)
        payload.pop("key")
        payload.pop("position")
        for name in ("min_finished_at", "max_finished_at", "committed_at"):
            payload[name] = payload[name].isoformat()
        payload["version"] = MARKER_VERSION
        return json.dumps(payload, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, key: str = "") -> CommitMarker:
        """Parse a marker; :class:`InvalidMarkerError` names what breaks the schema."""
        try:
            payload = json.loads(raw)
        except ValueError as error:
            raise InvalidMarkerError(f"commit marker {key} is not JSON: {error}") from None
        if not isinstance(payload, dict):
            raise InvalidMarkerError(f"commit marker {key} is not a JSON object")
        if payload.pop("version", None) != MARKER_VERSION:
            raise InvalidMarkerError(f"commit marker {key} has an unknown version")
        expected = {f.name for f in dataclasses.fields(cls)} - {"key", "position"}
        if set(payload) != expected:
            raise InvalidMarkerError(
                f"commit marker {key}: missing fields {sorted(expected - set(payload))}, "
                f"unknown fields {sorted(set(payload) - expected)}"
            )
        for name in ("min_finished_at", "max_finished_at", "committed_at"):
            payload[name] = _aware_time(payload[name], name, key)
        for name in ("num_records", "num_tokens", "num_output_tokens", "size_bytes"):
            value = payload[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidMarkerError(f"commit marker {key}: {name}={value!r} is not a count")
        for name in ("shard_key", "target_slug", "sha256", "writer_id"):
            if not isinstance(payload[name], str):
                raise InvalidMarkerError(f"commit marker {key}: {name} is not a string")
        return cls(key=key, **payload)

    def validate(self, prefix: str) -> None:
        """Raise :class:`InvalidMarkerError` unless this marker may be acted on.

        Its ``shard_key`` must be a shard of its own target under ``prefix`` (the
        shard its key names), and its counts must add up.
        """
        parsed = parse_commit_key(prefix, self.key)
        if parsed is None:
            raise InvalidMarkerError(f"{self.key!r} is not a commit-marker key under {prefix}/")
        slug, _, shard_id = parsed
        if self.target_slug != slug:
            raise InvalidMarkerError(
                f"commit marker {self.key} says target {self.target_slug!r}, its key {slug!r}"
            )
        tail = self.shard_key.removeprefix(f"{prefix}/target={slug}/")
        match = _SHARD_TAIL.fullmatch(tail)
        if tail == self.shard_key or match is None or match["shard_id"] != shard_id:
            raise InvalidMarkerError(
                f"commit marker {self.key} points at {self.shard_key!r}, not at its own shard "
                f"{prefix}/target={slug}/dt=.../hour=../part-{shard_id}.parquet"
            )
        problems = [
            "num_records is 0" if self.num_records < 1 else "",
            "fewer tokens than records" if self.num_tokens < self.num_records else "",
            "more output tokens than tokens" if self.num_output_tokens > self.num_tokens else "",
            "size_bytes is 0" if self.size_bytes < 1 else "",
            "sha256 is not 64 hex digits" if not _SHA256.fullmatch(self.sha256) else "",
            "min_finished_at > max_finished_at"
            if self.min_finished_at > self.max_finished_at
            else "",
        ]
        if any(problems):
            raise InvalidMarkerError(
                f"commit marker {self.key}: {'; '.join(p for p in problems if p)}"
            )


def _aware_time(value: Any, name: str, key: str) -> datetime:
    try:
        moment = datetime.fromisoformat(value)
    except (TypeError, ValueError):
        raise InvalidMarkerError(f"commit marker {key}: {name}={value!r} is no time") from None
    if moment.tzinfo is None:
        raise InvalidMarkerError(f"commit marker {key}: {name} has no time zone")
    return moment
