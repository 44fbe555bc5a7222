"""Reading the lake: committed shards only, by time window or after a watermark.

Listing and token counting read commit markers only (small JSON objects, cached:
they are immutable). Records stream one shard at a time through a temporary file
and small record batches, so memory stays bounded by a batch, not by the window.
A shard whose bytes or counts do not match its marker, or that Parquet cannot
decode, is moved to ``<prefix>/_quarantine/`` with its marker, logged, and skipped.

The lake's own debris never stops a cycle, and every piece is counted in
:class:`DebrisCounts` (``reader.debris``): a stray object under ``_commits/`` is
skipped; a marker that is not valid JSON, breaks the schema or points outside its
target's shards is quarantined (the marker alone: the reader never moves an object
outside the shard prefix on a marker's word); a marker whose shard is gone
(retention crashed between the two deletes) is quarantined; records with NaN/inf
states, out-of-vocabulary ids or another hidden size are skipped. A marker that
landed long after its stamp (a writer's clock behind the store's) is logged and
taken by when it landed (see :func:`~tide_lib.lake.layout.commit_position`).
"""

from __future__ import annotations

__all__ = [
    "CorruptShardError",
    "DebrisCounts",
    "LakeReader",
    "PartitionStats",
    "partition_stats",
    "watermark",
]

import contextlib
import dataclasses
import hashlib
import logging
import tempfile
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from tide_lib.config import LakeConfig
from tide_lib.errors import TideError
from tide_lib.lake.layout import (
    CommitMarker,
    InvalidMarkerError,
    commit_position,
    commit_prefix,
    commit_stamp_key,
    commit_time,
    parse_commit_key,
    quarantine_key,
)
from tide_lib.lake.schema import (
    LEGACY_RECORD_SCHEMAS,
    NUM_AUX_LAYERS,
    RECORD_SCHEMA,
    CapturedRecord,
    TargetLimits,
    reserved_segment,
    segment_problem,
    values_problem,
)
from tide_lib.lake.store import NoSuchObjectError, ObjectInfo, ObjectStore

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_BATCH_ROWS = 8


class CorruptShardError(TideError, ValueError):
    """A committed shard cannot be read as its marker promises."""


class _MissingShardError(CorruptShardError):
    """A marker's shard is not in the bucket."""


@dataclasses.dataclass
class DebrisCounts:
    """What a reader skipped so far, by kind; each was logged with its key."""

    stray_objects: int = 0  # objects under _commits/ that are not marker names
    invalid_markers: int = 0  # markers unreadable or untrustworthy: quarantined
    missing_shards: int = 0  # markers whose shard is gone: quarantined
    corrupt_shards: int = 0  # shards that do not match their marker: quarantined
    invalid_records: int = 0  # NaN/inf states, out-of-vocabulary ids, other hidden size
    skewed_markers: int = 0  # stamped far from the store's Last-Modified (a writer's clock)


@dataclasses.dataclass(eq=False, repr=False)  # no repr: never print the store's client
class LakeReader:
    """Lists, counts and streams committed shards of one target.

    ``limits`` are the target's (:func:`~tide_lib.lake.schema.target_limits`):
    records that disagree are skipped; records with NaN/inf states are skipped always.
    What it skips and passes over is counted in ``debris``.
    """

    store: ObjectStore
    config: LakeConfig
    limits: TargetLimits | None = dataclasses.field(default=None, kw_only=True)
    debris: DebrisCounts = dataclasses.field(default_factory=DebrisCounts, init=False)
    _markers: dict[str, CommitMarker] = dataclasses.field(default_factory=dict, init=False)
    # keys already logged (a sensor lists every poke)
    _noted: set[str] = dataclasses.field(default_factory=set, init=False)

    # -- listing ---------------------------------------------------------------------

    def _landed(self, info: ObjectInfo) -> datetime | None:
        """When a marker landed, or None to trust its stamp (``max_clock_skew_s`` = 0)."""
        return info.last_modified if self.config.max_clock_skew_s > 0 else None

    def list_shards(
        self,
        slug: str,
        *,
        after: str | None = None,
        start: datetime | None = None,
        end: datetime | None = None,
        settled: bool = False,
    ) -> list[CommitMarker]:
        """Committed shards in commit order (by :attr:`CommitMarker.order`).

        ``after`` is a watermark (see :func:`watermark`): only shards committed after
        it, including markers that landed late behind it (up to
        ``lake.max_clock_skew_s``). ``start``/``end`` keep shards holding requests
        that finished in ``[start, end)``. ``settled`` keeps only commits at least
        ``commit_settle_s`` old: use it where the result moves a watermark.
        """
        settled_before = datetime.now(UTC) - timedelta(seconds=self.config.commit_settle_s)
        markers = []
        for info, position in self._positions(slug, after):
            if settled and commit_time(info.key) > settled_before:
                break  # the listing is in stamp order, and no position is before its stamp
            if settled and commit_time(position) > settled_before:
                continue
            marker = self.marker(info.key)
            if marker is None:
                continue
            self._note_skew(marker, info)
            if start is not None and marker.max_finished_at < start:
                continue
            if end is not None and marker.min_finished_at >= end:
                continue
            markers.append(dataclasses.replace(marker, position=position))
        return sorted(markers, key=lambda marker: marker.order)

    def _positions(self, slug: str, after: str | None) -> Iterator[tuple[ObjectInfo, str]]:
        """Marker objects whose position is after ``after``, with it; strays are skipped."""
        prefix = commit_prefix(self.config.prefix, slug)
        for info in self.store.list(prefix, start_after=self._listing_start(slug, after)):
            if parse_commit_key(self.config.prefix, info.key) is None:
                self._stray(info.key)
                continue
            position = commit_position(info.key, self._landed(info), self.config.commit_settle_s)
            if after is None or position > after:
                yield info, position

    def _listing_start(self, slug: str, after: str | None) -> str | None:
        """Where a listing after ``after`` starts: ``max_clock_skew_s`` before it."""
        if after is None:
            return None
        try:
            moment = commit_time(after)
        except ValueError:
            return after  # not a watermark this reader wrote: list strictly after it
        lookback = timedelta(seconds=self.config.max_clock_skew_s)
        return min(after, commit_stamp_key(self.config.prefix, slug, moment - lookback))

    def commit_keys(self, slug: str, *, after: str | None, until: str) -> list[str]:
        """Commit-marker keys consumed by watermark ``until`` in ``(after, until]``.

        From one listing; no marker is read. A marker that landed late and sorts
        after ``until`` is left out (it is not consumed yet); strays are skipped.
        """
        keys = []
        for info in self.store.list(commit_prefix(self.config.prefix, slug), start_after=after):
            if info.key > until:
                break
            if parse_commit_key(self.config.prefix, info.key) is None:
                self._stray(info.key)
                continue
            position = commit_position(info.key, self._landed(info), self.config.commit_settle_s)
            if position <= until:
                keys.append(info.key)
        return keys

    def count_tokens(self, slug: str, *, after: str | None = None, settled: bool = False) -> int:
        """Tokens in shards committed after the watermark, without opening any shard."""
        shards = self.list_shards(slug, after=after, settled=settled)
        return sum(marker.num_tokens for marker in shards)

    def list_targets(self) -> list[str]:
        prefix = f"{self.config.prefix}/_commits/"
        slugs = set()
        for info in self.store.list(prefix):
            parsed = parse_commit_key(self.config.prefix, info.key)
            if parsed is None:
                self._stray(info.key)
            else:
                slugs.add(parsed[0])
        return sorted(slugs)

    def marker(self, key: str) -> CommitMarker | None:
        """The valid commit marker at ``key`` (cached: markers are immutable), else None.

        A key that is no marker name is a stray (skipped); a marker that is not
        valid JSON, breaks the schema or points outside its target's shards is
        quarantined (itself only) and counted.
        """
        if key in self._markers:
            return self._markers[key]
        if parse_commit_key(self.config.prefix, key) is None:
            self._stray(key)
            return None
        try:
            marker = CommitMarker.from_json(self.store.get_bytes(key), key=key)
            marker.validate(self.config.prefix)
        except NoSuchObjectError:
            return None  # removed meanwhile (retention, or another reader quarantined it)
        except (InvalidMarkerError, ValueError, KeyError, TypeError) as error:
            self.debris.invalid_markers += 1
            logger.error("invalid commit marker %s (%s); quarantining it", key, error)
            self._move_aside(key)
            return None
        self._markers[key] = marker
        return marker

    def _stray(self, key: str) -> None:
        self.debris.stray_objects += 1
        if key not in self._noted:
            self._noted.add(key)
            logger.warning(
                "skipping %s: an object under the commit log that is no commit marker "
                "(marker keys are <stamp>Z-<shard id>.json); delete it if nothing needs it",
                key,
            )

    def _note_skew(self, marker: CommitMarker, info: ObjectInfo) -> None:
        """Log a marker stamped far from when the store says it landed (once per marker)."""
        if info.last_modified is None or marker.key in self._noted:
            return
        skew = (commit_time(marker.key) - info.last_modified).total_seconds()
        if abs(skew) <= self.config.commit_settle_s + 2:
            return
        self._noted.add(marker.key)
        self.debris.skewed_markers += 1
        logger.warning(
            "commit marker %s of writer %s is stamped %.0f s %s the store's Last-Modified "
            "(%s): that capture host's clock is off (or its PUT took that long); its data "
            "counts from when it landed. Sync the host's clock (NTP)",
            marker.key,
            marker.writer_id,
            abs(skew),
            "behind" if skew < 0 else "ahead of",
            info.last_modified.isoformat(),
        )

    def _move_aside(self, key: str) -> None:
        with contextlib.suppress(NoSuchObjectError):  # another reader moved it first
            self.store.move(key, quarantine_key(self.config.prefix, key))

    # -- streaming -------------------------------------------------------------------

    def iter_records(
        self,
        shards: Iterable[CommitMarker],
        *,
        start: datetime | None = None,
        end: datetime | None = None,
    ) -> Iterator[CapturedRecord]:
        """Stream records shard by shard; bad shards are quarantined, bad records skipped.

        ``start``/``end`` keep only requests that finished in ``[start, end)`` (a shard
        listed for a window may also hold requests just outside it).
        """
        for marker in shards:
            try:
                marker.validate(self.config.prefix)
            except InvalidMarkerError as error:  # built by hand, not listed: never acted on
                self.debris.invalid_markers += 1
                logger.error("skipping shard of an invalid commit marker: %s", error)
                continue
            try:
                for sample in self._iter_shard(marker):
                    if (start is None or sample.finished_at >= start) and (
                        end is None or sample.finished_at < end
                    ):
                        yield sample
            except _MissingShardError as error:
                self.quarantine(marker, str(error), shard_missing=True)
            except CorruptShardError as error:
                self.quarantine(marker, str(error))

    def _iter_shard(self, marker: CommitMarker) -> Iterator[CapturedRecord]:
        with tempfile.TemporaryDirectory(prefix="tide-shard-") as tmp:
            path = Path(tmp) / "shard.parquet"
            try:
                self.store.get_file(marker.shard_key, path)
            except NoSuchObjectError:
                raise _MissingShardError(
                    f"shard {marker.shard_key} of commit marker {marker.key} is gone "
                    "(deleted before its marker); the marker is debris"
                ) from None
            _verify_bytes(path, marker)
            try:
                parquet = pq.ParquetFile(path)
                _verify_counts(parquet, marker)
                for batch in parquet.iter_batches(batch_size=_BATCH_ROWS):
                    for row in batch.to_pylist():
                        sample = self._checked_record(row, marker)
                        if sample is not None:
                            yield sample
            except (pa.ArrowException, OSError) as error:
                raise CorruptShardError(
                    f"shard {marker.shard_key} cannot be decoded: {error}"
                ) from error

    def _checked_record(self, row: dict[str, Any], marker: CommitMarker) -> CapturedRecord | None:
        """The row as a record, or None (counted, logged) if its values must not train."""
        sample = _to_record(row, marker)
        if sample.segment is not None and reserved_segment(sample.segment):
            # written before these names were reserved: the request still trains, unlabelled
            sample = dataclasses.replace(sample, segment=None)
        problem = segment_problem(sample.segment) or values_problem(
            sample.input_ids,
            sample.hidden_states,
            sample.aux_hidden_states,
            self.limits,
        )
        if problem is None:
            return sample
        self.debris.invalid_records += 1
        logger.warning(
            "skipping request %s of shard %s: %s (%d record(s) skipped by this reader)",
            sample.request_id,
            marker.shard_key,
            problem,
            self.debris.invalid_records,
        )
        return None

    def quarantine(self, marker: CommitMarker, reason: str, *, shard_missing: bool = False) -> None:
        """Move a bad shard and its marker aside so that no reader meets it again.

        Only objects of the commit log and of the target's shards are ever moved:
        a marker that fails validation moves alone.
        """
        try:
            marker.validate(self.config.prefix)
            keys = [marker.key] if shard_missing else [marker.shard_key, marker.key]
        except InvalidMarkerError:
            keys = [marker.key] if parse_commit_key(self.config.prefix, marker.key) else []
        if shard_missing:
            self.debris.missing_shards += 1
        else:
            self.debris.corrupt_shards += 1
        logger.error("quarantining commit %s: %s", marker.key, reason)
        for key in keys:
            self._move_aside(key)
        self._markers.pop(marker.key, None)

    def export_specforge(self, shards: Iterable[CommitMarker], out_dir: Path) -> int:
        """Write SpecForge's offline layout: one ``.ckpt`` per sample. Returns the count."""
        out_dir.mkdir(parents=True, exist_ok=True)
        count = 0
        for sample in self.iter_records(shards):
            sample.save_specforge(out_dir, count)
            count += 1
        logger.info("wrote %d SpecForge samples to %s", count, out_dir)
        return count


def watermark(shards: list[CommitMarker], previous: str | None = None) -> str | None:
    """The watermark after consuming ``shards`` (as listed): the last one's order, or ``previous``.

    That is its commit key, unless the marker landed late (see ``CommitMarker.order``).
    """
    return max(marker.order for marker in shards) if shards else previous


def _verify_bytes(path: Path, marker: CommitMarker) -> None:
    size = path.stat().st_size
    if size != marker.size_bytes:
        raise CorruptShardError(
            f"shard {marker.shard_key} is {size} bytes, its marker says {marker.size_bytes} "
            "(truncated or overwritten)"
        )
    with path.open("rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    if digest != marker.sha256:
        raise CorruptShardError(f"shard {marker.shard_key} does not match its marker's sha256")


def _verify_counts(parquet: pq.ParquetFile, marker: CommitMarker) -> None:
    """The shard holds the capture schema (or an older one) and the records and tokens its
    marker says."""
    schema = parquet.schema_arrow.remove_metadata()
    known = (RECORD_SCHEMA, *LEGACY_RECORD_SCHEMAS)
    if not any(schema.equals(candidate.remove_metadata()) for candidate in known):
        raise CorruptShardError(
            f"shard {marker.shard_key} has schema {parquet.schema_arrow}, not the capture schema"
        )
    rows = parquet.metadata.num_rows
    tokens = sum(parquet.read(columns=["num_tokens"]).column("num_tokens").to_pylist())
    if (rows, tokens) != (marker.num_records, marker.num_tokens):
        raise CorruptShardError(
            f"shard {marker.shard_key} holds {rows} records and {tokens} tokens, its marker "
            f"{marker.key} says {marker.num_records} and {marker.num_tokens}"
        )


def _to_record(row: dict[str, Any], marker: CommitMarker) -> CapturedRecord:
    """A Parquet row as the record serving wrote, with torch tensors (ids and mask int64)."""
    import torch  # noqa: PLC0415

    num_tokens, hidden_size = row["num_tokens"], row["hidden_size"]
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(row["hidden_dtype"])
    hidden_bytes, aux_bytes = row["hidden_states"], row["aux_hidden_states"]
    expected = num_tokens * hidden_size * 2
    if (
        dtype is None
        or len(row["input_ids"]) != num_tokens
        or len(row["loss_mask"]) != num_tokens
        or len(hidden_bytes) != expected
        or len(aux_bytes) != expected * NUM_AUX_LAYERS
    ):
        raise CorruptShardError(
            f"shard {marker.shard_key}: record {row['request_id']} has inconsistent lengths "
            f"or dtype {row['hidden_dtype']!r}"
        )

    def tensor(raw: bytes, width: int) -> torch.Tensor:
        return (
            torch.frombuffer(bytearray(raw), dtype=torch.int16).view(dtype).view(num_tokens, width)
        )

    return CapturedRecord(
        request_id=row["request_id"],
        target_id=row["target_id"],
        draft_version=row["draft_version"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        input_ids=torch.tensor(row["input_ids"], dtype=torch.long),
        loss_mask=torch.tensor(row["loss_mask"], dtype=torch.long),
        hidden_states=tensor(hidden_bytes, hidden_size),
        aux_hidden_states=tensor(aux_bytes, hidden_size * NUM_AUX_LAYERS),
        spec_verify_ct=row["spec_verify_ct"],
        spec_accept_tokens=row["spec_accept_tokens"],
        completion_tokens=row["completion_tokens"],
        segment=row.get("segment"),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class PartitionStats:
    """Committed data in one ``target/dt/hour`` partition."""

    target_slug: str
    partition: str
    shards: int
    records: int
    tokens: int
    output_tokens: int
    size_bytes: int


def partition_stats(reader: LakeReader, slugs: Iterable[str]) -> list[PartitionStats]:
    """Shards, records and tokens per partition, from commit markers alone."""
    rows: dict[tuple[str, str], list[CommitMarker]] = {}
    for slug in slugs:
        for marker in reader.list_shards(slug):
            partition = "/".join(
                part for part in marker.shard_key.split("/") if part.startswith(("dt=", "hour="))
            )
            rows.setdefault((slug, partition), []).append(marker)
    return [
        PartitionStats(
            target_slug=slug,
            partition=partition,
            shards=len(markers),
            records=sum(m.num_records for m in markers),
            tokens=sum(m.num_tokens for m in markers),
            output_tokens=sum(m.num_output_tokens for m in markers),
            size_bytes=sum(m.size_bytes for m in markers),
        )
        for (slug, partition), markers in sorted(rows.items())
    ]
