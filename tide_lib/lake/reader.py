"""Reading the lake: committed shards only, by time window or after a watermark.

Listing and token counting read commit markers only (small JSON objects, cached:
they are immutable). Samples stream one shard at a time through a temporary file
and small record batches, so memory stays bounded by a batch, not by the window.
A shard whose bytes do not match its marker, or that Parquet cannot decode, is
moved to ``<prefix>/_quarantine/`` with its marker, logged, and skipped.
"""

from __future__ import annotations

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
from tide_lib.lake.layout import CommitMarker, commit_prefix, commit_time, quarantine_key
from tide_lib.lake.schema import NUM_AUX_LAYERS, RECORD_SCHEMA
from tide_lib.lake.store import ObjectStore

if TYPE_CHECKING:
    import torch

__all__ = [
    "CorruptShardError",
    "LakeReader",
    "PartitionStats",
    "TrainingSample",
    "partition_stats",
    "watermark",
]

logger = logging.getLogger(__name__)

_BATCH_ROWS = 8


class CorruptShardError(ValueError):
    """A committed shard cannot be read as its marker promises."""


@dataclasses.dataclass(frozen=True, slots=True)
class TrainingSample:
    """One captured request as training and evaluation consume it (torch tensors)."""

    request_id: str
    draft_version: str
    finished_at: datetime
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] int64, 1 on output tokens
    hidden_state: torch.Tensor  # [T, H] final-layer state
    aux_hidden_state: torch.Tensor  # [T, 3H] EAGLE3 aux-layer states
    spec_verify_ct: int
    spec_accept_tokens: int

    def to_specforge(self) -> dict[str, torch.Tensor]:
        """The dict SpecForge's ``OfflineEagle3Dataset`` loads from a ``.ckpt`` file."""
        return {
            "input_ids": self.input_ids,
            "loss_mask": self.loss_mask,
            "hidden_state": self.hidden_state,
            "aux_hidden_state": self.aux_hidden_state,
        }


class LakeReader:
    """Lists, counts and streams committed shards of one target."""

    def __init__(self, store: ObjectStore, config: LakeConfig) -> None:
        self.store = store
        self.config = config
        self._markers: dict[str, CommitMarker] = {}

    # -- listing ---------------------------------------------------------------------

    def list_shards(
        self,
        slug: str,
        *,
        after: str | None = None,
        start: datetime | None = None,
        end: datetime | None = None,
        settled: bool = False,
    ) -> list[CommitMarker]:
        """Committed shards in commit order.

        ``after`` is a watermark (a marker key, see :func:`watermark`): only shards
        committed after it. ``start``/``end`` keep shards holding requests that
        finished in ``[start, end)``. ``settled`` keeps only commits at least
        ``commit_settle_s`` old: use it where the result moves a watermark.
        """
        settled_before = datetime.now(UTC) - timedelta(seconds=self.config.commit_settle_s)
        markers = []
        for info in self.store.list(commit_prefix(self.config.prefix, slug), start_after=after):
            if not info.key.endswith(".json"):
                continue
            if settled and commit_time(info.key) > settled_before:
                break  # the listing is in key order, which is stamp order: the rest are newer
            marker = self.marker(info.key)
            if marker is None:
                continue
            if start is not None and marker.max_finished_at < start:
                continue
            if end is not None and marker.min_finished_at >= end:
                continue
            markers.append(marker)
        return markers

    def commit_keys(self, slug: str, *, after: str | None, until: str) -> list[str]:
        """Commit-marker keys in ``(after, until]``, from one listing; no marker is read."""
        keys = []
        for info in self.store.list(commit_prefix(self.config.prefix, slug), start_after=after):
            if info.key > until:
                break
            if info.key.endswith(".json"):
                keys.append(info.key)
        return keys

    def count_tokens(self, slug: str, *, after: str | None = None, settled: bool = False) -> int:
        """Tokens in shards committed after the watermark, without opening any shard."""
        shards = self.list_shards(slug, after=after, settled=settled)
        return sum(marker.num_tokens for marker in shards)

    def list_targets(self) -> list[str]:
        prefix = f"{self.config.prefix}/_commits/"
        slugs = {
            info.key.removeprefix(prefix).split("/", 1)[0].removeprefix("target=")
            for info in self.store.list(prefix)
        }
        return sorted(slugs)

    def marker(self, key: str) -> CommitMarker | None:
        """The commit marker at ``key`` (cached: markers are immutable); None if unreadable."""
        if key not in self._markers:
            try:
                self._markers[key] = CommitMarker.from_json(self.store.get_bytes(key), key=key)
            except (ValueError, KeyError, TypeError) as error:
                logger.error("unreadable commit marker %s (%s); quarantining it", key, error)
                self.store.move(key, quarantine_key(self.config.prefix, key))
                return None
        return self._markers[key]

    # -- streaming -------------------------------------------------------------------

    def iter_samples(
        self,
        shards: Iterable[CommitMarker],
        *,
        start: datetime | None = None,
        end: datetime | None = None,
    ) -> Iterator[TrainingSample]:
        """Stream samples shard by shard; corrupt shards are quarantined and skipped.

        ``start``/``end`` keep only requests that finished in ``[start, end)`` (a shard
        listed for a window may also hold requests just outside it).
        """
        for marker in shards:
            try:
                for sample in self._iter_shard(marker):
                    if (start is None or sample.finished_at >= start) and (
                        end is None or sample.finished_at < end
                    ):
                        yield sample
            except CorruptShardError as error:
                self.quarantine(marker, str(error))

    def _iter_shard(self, marker: CommitMarker) -> Iterator[TrainingSample]:
        with tempfile.TemporaryDirectory(prefix="tide-shard-") as tmp:
            path = Path(tmp) / "shard.parquet"
            self.store.get_file(marker.shard_key, path)
            _verify_bytes(path, marker)
            try:
                parquet = pq.ParquetFile(path)
                if not parquet.schema_arrow.remove_metadata().equals(
                    RECORD_SCHEMA.remove_metadata()
                ):
                    raise CorruptShardError(
                        f"shard {marker.shard_key} has schema {parquet.schema_arrow}, "
                        "not the capture schema"
                    )
                for batch in parquet.iter_batches(batch_size=_BATCH_ROWS):
                    for row in batch.to_pylist():
                        yield _to_sample(row, marker)
            except (pa.ArrowException, OSError) as error:
                raise CorruptShardError(
                    f"shard {marker.shard_key} cannot be decoded: {error}"
                ) from error

    def quarantine(self, marker: CommitMarker, reason: str) -> None:
        """Move a bad shard and its marker aside so that no reader meets it again."""
        logger.error("quarantining shard %s: %s", marker.shard_key, reason)
        for key in (marker.shard_key, marker.key):
            if key and self.store.exists(key):
                self.store.move(key, quarantine_key(self.config.prefix, key))
        self._markers.pop(marker.key, None)

    def export_specforge(self, shards: Iterable[CommitMarker], out_dir: Path) -> int:
        """Write SpecForge's offline layout: one ``.ckpt`` per sample. Returns the count."""
        import torch  # noqa: PLC0415

        out_dir.mkdir(parents=True, exist_ok=True)
        count = 0
        for sample in self.iter_samples(shards):
            torch.save(sample.to_specforge(), out_dir / f"data_{count:08d}.ckpt")
            count += 1
        logger.info("wrote %d SpecForge samples to %s", count, out_dir)
        return count


def watermark(shards: list[CommitMarker], previous: str | None = None) -> str | None:
    """The watermark after consuming ``shards``: the last commit key, or ``previous``."""
    return shards[-1].key if shards else previous


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


def _to_sample(row: dict[str, Any], marker: CommitMarker) -> TrainingSample:
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

    return TrainingSample(
        request_id=row["request_id"],
        draft_version=row["draft_version"],
        finished_at=row["finished_at"],
        input_ids=torch.tensor(row["input_ids"], dtype=torch.long),
        loss_mask=torch.tensor(row["loss_mask"], dtype=torch.long),
        hidden_state=tensor(hidden_bytes, hidden_size),
        aux_hidden_state=tensor(aux_bytes, hidden_size * NUM_AUX_LAYERS),
        spec_verify_ct=row["spec_verify_ct"],
        spec_accept_tokens=row["spec_accept_tokens"],
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
