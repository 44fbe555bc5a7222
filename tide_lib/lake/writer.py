"""The capture writer: serving hands it finished requests and never waits for S3.

``submit`` validates shapes, then puts the record on a bounded queue and returns.
A batcher thread groups records by partition into Parquet shards (flushed by size
or age) and writes each shard to a local spool directory; an uploader thread
moves spooled shards to the object store and commits each with a marker. The
spool is the outbox: when the store is unreachable shards wait there (bounded by
``spool_max_bytes``) and go up when it is back, including after a restart of the
process. Memory is bounded by ``queue_max_records`` and ``memory_max_bytes``;
a full queue, full memory or a full spool drops records and counts them.
The batcher refuses (counts and logs) records whose values would poison training:
NaN/inf states, token ids outside the target's vocabulary, another hidden size,
and records whose client segment label is not a short printable string.

Exactly-once: a shard is uploaded before its marker; a retried upload rewrites
the same shard key, and a marker whose PUT may have landed is looked up before a
new one is written, so a record is never committed twice.

The writer is two parts with one thread and one lock each, which share nothing but
the spool directory: the :class:`_Batcher` (queue, buffers, shards into the spool)
and the :class:`_Uploader` (spool to S3, commit markers). The invariant that keeps
them apart: a name ``<id>.parquet`` in the spool always has its sidecar
``<id>.json`` and complete bytes (the batcher writes the sidecar, then renames the
finished ``.parquet.tmp``), and only the uploader removes a shard, once committed.
"""

from __future__ import annotations

__all__ = ["LakeWriter", "WriterStats"]

import dataclasses
import fcntl
import hashlib
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final, Literal, TextIO

import pyarrow.parquet as pq

from tide_lib.config import LakeConfig
from tide_lib.lake.layout import CommitMarker, commit_key, new_shard_id, shard_key, target_slug
from tide_lib.lake.schema import (
    CapturedRecord,
    TargetLimits,
    record_nbytes,
    records_to_table,
    segment_problem,
    validate_record,
    values_problem,
)
from tide_lib.lake.store import ObjectStore, StoreUnavailableError

logger = logging.getLogger(__name__)
_TICK = timedelta(microseconds=1)
# S3 tells Last-Modified in whole seconds: a smaller skew cannot be measured.
_CLOCK_RESOLUTION = timedelta(seconds=2)

_POLL_S: Final = 0.2
_DROP_LOG_EVERY_S: Final = 10.0
_BINARY_COLUMNS: Final = ("hidden_states", "aux_hidden_states")


@dataclasses.dataclass(frozen=True, slots=True)
class WriterStats:
    """Counters of a writer's life so far; ``dropped_records`` is never silently lost.

    ``refused_records`` were accepted by ``submit`` but their values were bad
    (NaN/inf states, out-of-vocabulary ids, another hidden size, a segment label
    that is not a short printable string): never written.
    """

    submitted_records: int
    dropped_records: int
    shards_written: int
    shards_uploaded: int
    records_uploaded: int
    tokens_uploaded: int
    spooled_shards: int
    spooled_bytes: int
    upload_errors: int
    store_reachable: bool
    refused_records: int = 0


@dataclasses.dataclass(slots=True)
class _Buffer:
    records: list[CapturedRecord] = dataclasses.field(default_factory=list)
    nbytes: int = 0
    opened_at: float = dataclasses.field(default_factory=time.monotonic)


class _Spool:
    """The outbox directory: this writer's alone (an exclusive lock on ``.lock``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self._lock_file = self._lock()
        self._recover()

    def shards(self) -> list[Path]:
        """The complete shards waiting for upload, oldest name first."""
        return sorted(self.path.glob("*.parquet"))

    def sizes(self) -> list[int]:
        """Sizes of the spooled shards; one the uploader removes meanwhile is skipped."""
        sizes = []
        for path in self.path.glob("*.parquet"):
            try:
                sizes.append(path.stat().st_size)
            except FileNotFoundError:
                continue
        return sizes

    def close(self) -> None:
        self._lock_file.close()

    def _lock(self) -> TextIO:
        handle = (self.path / ".lock").open("w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise RuntimeError(
                f"spool directory {self.path} is used by another LakeWriter; "
                "give each serving process its own TIDE_LAKE__SPOOL_DIR"
            ) from None
        return handle

    def _recover(self) -> None:
        """Drop half-written files from a crash; keep complete shards for upload."""
        for leftover in self.path.glob("*.tmp"):
            logger.warning("removing half-written spool file %s left by a crash", leftover)
            leftover.unlink()
        for sidecar in self.path.glob("*.json"):
            if not sidecar.with_suffix(".parquet").exists():
                sidecar.unlink()
        recovered = list(self.path.glob("*.parquet"))
        if recovered:
            logger.info(
                "found %d spooled shard(s) in %s; uploading them", len(recovered), self.path
            )


class _Batcher:
    """Submitted records -> partition buffers -> Parquet shards in the spool.

    One thread (``tide-lake-batcher``) and one lock, which guards the counters, the
    bytes held and the flush generation (its condition ``_flushed`` shares the lock).
    """

    def __init__(
        self,
        config: LakeConfig,
        spool: _Spool,
        on_shard: Callable[[], None],
        limits: TargetLimits | None,
    ) -> None:
        self.config = config
        self.spool = spool
        self._on_shard = on_shard
        self.limits = limits
        self._queue: queue.Queue[CapturedRecord] = queue.Queue(maxsize=config.queue_max_records)
        self._lock = threading.Lock()
        self._flushed = threading.Condition(self._lock)
        self._flush_generation = 0
        self._flush_requested = threading.Event()
        self._stopping = threading.Event()
        self.submitted = self.shards_written = 0
        self._losses = {"dropped": 0, "refused": 0}  # records lost, by why (see _count_loss)
        self._last_loss_log = {"dropped": 0.0, "refused": 0.0}
        self._held_bytes = 0  # raw bytes of records queued or buffered, not yet spooled
        self.thread = threading.Thread(target=self._loop, name="tide-lake-batcher", daemon=True)
        self.thread.start()

    def submit(self, record: CapturedRecord) -> bool:
        nbytes = record_nbytes(record)
        with self._lock:  # stop() cannot slip between the check and the put
            if self._stopping.is_set():
                raise RuntimeError("LakeWriter is closed; records can no longer be submitted")
            if self._held_bytes + nbytes > self.config.memory_max_bytes:
                full = f"capture memory is full ({self._held_bytes} bytes held)"
            else:
                try:
                    self._queue.put_nowait(record)
                except queue.Full:
                    full = "capture queue is full"
                else:
                    full = ""
                    self._held_bytes += nbytes
                    self.submitted += 1
        if full:
            self._count_drops(1, full)
            return False
        return True

    def flush(self, deadline: float) -> bool:
        """Ask for every buffer to be written; False if that did not happen by ``deadline``."""
        with self._flushed:
            generation = self._flush_generation
            self._flush_requested.set()
            while self._flush_generation == generation:
                if not self._flushed.wait(timeout=max(0.0, deadline - time.monotonic())):
                    return False
        return True

    def stop(self) -> None:
        """Write what is queued and buffered, then end the thread."""
        with self._lock:
            self._stopping.set()
        self.thread.join()

    def _loop(self) -> None:
        buffers: dict[tuple[str, str], _Buffer] = {}
        while True:
            try:
                record = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                record = None
            if record is not None:
                self._add(buffers, record)
            stopping = self._stopping.is_set() and self._queue.empty()
            if self._flush_requested.is_set() or stopping:
                self._flush_requested.clear()
                drained = self._drain_queue(buffers)
                for partition in list(buffers):
                    self._write_shard(buffers.pop(partition).records)
                with self._flushed:
                    self._flush_generation += 1
                    self._flushed.notify_all()
                if stopping and not drained:
                    return
                continue
            now = time.monotonic()
            for partition, buffer in list(buffers.items()):
                if now - buffer.opened_at >= self.config.shard_max_age_s:
                    self._write_shard(buffers.pop(partition).records)

    def _drain_queue(self, buffers: dict[tuple[str, str], _Buffer]) -> int:
        drained = 0
        while True:
            try:
                self._add(buffers, self._queue.get_nowait())
            except queue.Empty:
                return drained
            drained += 1

    def _add(self, buffers: dict[tuple[str, str], _Buffer], record: CapturedRecord) -> None:
        problem = self._values_problem(record)
        if problem is not None:
            with self._lock:
                self._held_bytes -= record_nbytes(record)
            self._count_refused(record.request_id, problem)
            return
        finished = record.finished_at.astimezone(UTC)
        partition = (target_slug(record.target_id), f"{finished:%Y-%m-%d %H}")
        buffer = buffers.setdefault(partition, _Buffer())
        buffer.records.append(record)
        buffer.nbytes += record_nbytes(record)
        if buffer.nbytes >= self.config.shard_max_bytes:
            self._write_shard(buffers.pop(partition).records)

    def _write_shard(self, records: list[CapturedRecord]) -> None:
        """Encode records as one Parquet shard in the spool, with a sidecar describing it."""
        estimated = sum(record_nbytes(record) for record in records)
        try:
            self._spool_records(records, estimated)
        except Exception:  # a bad shard costs its records, never the capture thread
            logger.exception("could not spool %d captured records as a shard", len(records))
            self._count_drops(len(records), "writing the shard to the spool failed")
        finally:
            with self._lock:
                self._held_bytes -= estimated

    def _spool_records(self, records: list[CapturedRecord], estimated: int) -> None:
        spooled_bytes = sum(self.spool.sizes())
        if spooled_bytes + estimated > self.config.spool_max_bytes:
            self._count_drops(
                len(records),
                f"spool {self.spool.path} is full ({spooled_bytes} bytes of "
                f"{self.config.spool_max_bytes}); the store has been unreachable too long",
            )
            return
        self._encode_to_spool(records)
        with self._lock:
            self.shards_written += 1
        self._on_shard()

    def _encode_to_spool(self, records: list[CapturedRecord]) -> None:
        shard_id = new_shard_id()
        slug = target_slug(records[0].target_id)
        finished = [record.finished_at.astimezone(UTC) for record in records]
        table = records_to_table(records)
        tmp_path = self.spool.path / f"{shard_id}.parquet.tmp"
        tensor_codec = self.config.tensor_compression
        pq.write_table(
            table,
            tmp_path,
            compression={
                name: (tensor_codec if name in _BINARY_COLUMNS else "zstd")
                for name in table.column_names
            },
            use_dictionary=[name for name in table.column_names if name not in _BINARY_COLUMNS],
            write_statistics=[name for name in table.column_names if name not in _BINARY_COLUMNS],
            row_group_size=len(records),
        )
        with tmp_path.open("rb") as handle:
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
        sidecar = {
            "shard_id": shard_id,
            "shard_key": shard_key(self.config.prefix, slug, min(finished), shard_id),
            "target_slug": slug,
            "num_records": len(records),
            "num_tokens": sum(int(record.input_ids.shape[0]) for record in records),
            "num_output_tokens": sum(int(record.loss_mask.sum()) for record in records),
            "size_bytes": tmp_path.stat().st_size,
            "sha256": digest,
            "min_finished_at": min(finished).isoformat(),
            "max_finished_at": max(finished).isoformat(),
            "commit_key": None,
        }
        # the invariant: the sidecar first, then the complete shard under its final name
        _write_json_atomic(self.spool.path / f"{shard_id}.json", sidecar)
        tmp_path.replace(self.spool.path / f"{shard_id}.parquet")

    def _values_problem(self, record: CapturedRecord) -> str | None:
        label_problem = segment_problem(record.segment)
        if label_problem is not None:
            return label_problem
        try:
            return values_problem(
                record.input_ids,
                record.hidden_states,
                record.aux_hidden_states,
                self.limits,
            )
        except Exception as error:  # a record that cannot even be checked is not written
            return f"its values could not be checked ({error})"

    # Read without the lock (an int's read is atomic): LakeWriter.stats() already holds it.
    @property
    def dropped(self) -> int:
        """Records lost to a full queue or a failed spool write."""
        return self._losses["dropped"]

    @property
    def refused(self) -> int:
        """Records refused as invalid (never written)."""
        return self._losses["refused"]

    def _count_loss(self, kind: Literal["dropped", "refused"], count: int) -> int | None:
        """Add ``count`` lost records of ``kind``: the new total when a log line is due
        (at most one a kind every ``_DROP_LOG_EVERY_S``, so a flood cannot flood the
        log), else None."""
        with self._lock:
            self._losses[kind] += count
            now = time.monotonic()
            if now - self._last_loss_log[kind] < _DROP_LOG_EVERY_S:
                return None
            self._last_loss_log[kind] = now
            return self._losses[kind]

    def _count_refused(self, request_id: str, reason: str) -> None:
        total = self._count_loss("refused", 1)
        if total is not None:
            logger.warning(
                "refused captured request %s: %s (%d refused so far; fix the capture hook or "
                "the target it reads from)",
                request_id,
                reason,
                total,
            )

    def _count_drops(self, count: int, reason: str) -> None:
        total = self._count_loss("dropped", count)
        if total is not None:
            logger.warning(
                "dropped %d captured record(s): %s (%d dropped so far)", count, reason, total
            )


class _Uploader:
    """Spooled shards -> the object store, each committed by its marker.

    One thread (``tide-lake-uploader``) and one lock, which guards the counters and
    whether the store answers. ``wake`` tells it a shard arrived; it polls anyway.
    """

    def __init__(self, store: ObjectStore, config: LakeConfig, spool: _Spool) -> None:
        self.store = store
        self.config = config
        self.spool = spool
        self.writer_id = uuid.uuid4().hex[:12]
        self._last_stamp = datetime.min.replace(tzinfo=UTC)
        self._lock = threading.Lock()
        self.shards_uploaded = self.records_uploaded = self.tokens_uploaded = 0
        self.upload_errors = 0
        self.store_reachable = True
        self._wake = threading.Event()
        self._abandon = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="tide-lake-uploader", daemon=True)
        self.thread.start()

    def wake(self) -> None:
        self._wake.set()

    def wait_uploaded(self, deadline: float) -> bool:
        """True once the spool is empty; False at ``deadline`` or if the thread ended."""
        while self.spool.shards():
            if time.monotonic() >= deadline or not self.thread.is_alive():
                return False
            time.sleep(0.05)
        return True

    def stop(self, timeout: float) -> None:
        """Stop after the shard in flight; the rest stays spooled for the next writer."""
        self._abandon.set()
        self._wake.set()
        self.thread.join(timeout=timeout)

    def _loop(self) -> None:
        while not self._abandon.is_set():
            self._wake.clear()  # before listing: a shard spooled after this wakes the wait
            pending = self.spool.shards()
            if not pending:
                self._wake.wait(timeout=_POLL_S)
                continue
            for path in pending:
                if self._abandon.is_set():
                    return
                try:
                    self._upload(path)
                except StoreUnavailableError as error:
                    self._note_outage(error)
                    self._abandon.wait(timeout=self.config.retry_interval_s)
                    break
                except Exception:
                    logger.exception("uploading spooled shard %s failed; will retry", path)
                    with self._lock:
                        self.upload_errors += 1
                    self._abandon.wait(timeout=self.config.retry_interval_s)
                    break

    def _note_outage(self, error: StoreUnavailableError) -> None:
        with self._lock:
            self.upload_errors += 1
            was_reachable = self.store_reachable
            self.store_reachable = False
        if was_reachable:
            logger.warning("%s; spooling shards in %s until it is back", error, self.spool.path)

    def _store_clock(self, shard_key: str) -> timedelta:
        """How far the store's clock is ahead of this host's (never less than what the
        shard just uploaded shows). Markers are stamped by the store's clock, so a serving
        host whose clock is off can neither hide its data behind a watermark nor get it
        deleted unread. The store tells its time to the second (the shard landed before
        this call, so the estimate errs early by at most that second): a skew within two
        seconds is taken as none, and this host's clock stamps as it always did."""
        asked = datetime.now(UTC)
        landed = self.store.last_modified(shard_key)
        if landed is None:
            return timedelta(0)
        skew = landed.astimezone(UTC) - asked
        if abs(skew) <= _CLOCK_RESOLUTION:  # within what the store's clock can tell: ours
            return timedelta(0)
        if abs(skew) > timedelta(seconds=self.config.commit_settle_s):
            logger.warning(
                "this host's clock is %.0f s %s the S3 store's (writer %s): commit markers "
                "are stamped by the store's clock; sync this host with NTP",
                abs(skew.total_seconds()),
                "behind" if skew.total_seconds() > 0 else "ahead of",
                self.writer_id,
            )
        return skew

    def _upload(self, path: Path) -> None:
        sidecar_path = path.with_suffix(".json")
        sidecar = json.loads(sidecar_path.read_text())
        self.store.put_file(sidecar["shard_key"], path)
        previous_commit = sidecar.get("commit_key")
        if previous_commit is None or not self.store.exists(previous_commit):
            skew = self._store_clock(sidecar["shard_key"])
            # Never before this writer's previous stamp: the store's second-resolution
            # clock must not reorder one writer's own commits.
            committed_at = max(datetime.now(UTC) + skew, self._last_stamp + _TICK)
            self._last_stamp = committed_at
            key = commit_key(
                self.config.prefix, sidecar["target_slug"], committed_at, sidecar["shard_id"]
            )
            sidecar["commit_key"] = key
            _write_json_atomic(sidecar_path, sidecar)  # remembered before the PUT that may land
            marker = CommitMarker(
                shard_key=sidecar["shard_key"],
                target_slug=sidecar["target_slug"],
                num_records=sidecar["num_records"],
                num_tokens=sidecar["num_tokens"],
                num_output_tokens=sidecar["num_output_tokens"],
                size_bytes=sidecar["size_bytes"],
                sha256=sidecar["sha256"],
                min_finished_at=datetime.fromisoformat(sidecar["min_finished_at"]),
                max_finished_at=datetime.fromisoformat(sidecar["max_finished_at"]),
                committed_at=committed_at,
                writer_id=self.writer_id,
            )
            self.store.put_bytes(key, marker.to_json(), content_type="application/json")
            late = (datetime.now(UTC) + skew - committed_at).total_seconds()
            # 0 turns the settle rule off (one writer, flushed before each read): no warning
            if 0 < self.config.commit_settle_s < late:
                logger.warning(
                    "commit marker %s landed %.0f s after its stamp, beyond lake.commit_settle_s "
                    "(%.0f s): a cycle may have moved its watermark past it; raise "
                    "commit_settle_s above the slowest marker PUT",
                    key,
                    late,
                    self.config.commit_settle_s,
                )
        with self._lock:  # counted before the spool empties: flush() then sees them
            if not self.store_reachable:
                logger.info(
                    "S3 store %s is reachable again; uploading spool", self.store.config.endpoint
                )
            self.store_reachable = True
            self.shards_uploaded += 1
            self.records_uploaded += sidecar["num_records"]
            self.tokens_uploaded += sidecar["num_tokens"]
        path.unlink()
        sidecar_path.unlink()
        logger.debug("committed shard %s (%d tokens)", sidecar["shard_key"], sidecar["num_tokens"])


class LakeWriter:
    """Batches captured records into committed Parquet shards in the lake.

    Use as a context manager, or call :meth:`close` on shutdown: it flushes the
    queue and uploads what it can within ``timeout``; the rest stays spooled.
    ``limits`` are the target's (:func:`~tide_lib.lake.schema.target_limits`):
    records that disagree are refused; NaN/inf states are refused always.
    """

    def __init__(
        self,
        store: ObjectStore,
        config: LakeConfig,
        *,
        limits: TargetLimits | None = None,
    ) -> None:
        self._spool = _Spool(Path(config.spool_dir))
        self._uploader = _Uploader(store, config, self._spool)
        self._batcher = _Batcher(config, self._spool, self._uploader.wake, limits)
        self._closed = False

    @property
    def writer_id(self) -> str:
        return self._uploader.writer_id

    def submit(self, record: CapturedRecord) -> bool:
        """Queue a finished request; ``False`` if it was dropped because the queue is full.

        Raises :class:`~tide_lib.lake.schema.InvalidRecordError` for a malformed record.
        """
        validate_record(record)
        return self._batcher.submit(record)

    def stats(self) -> WriterStats:
        spooled = self._spool.sizes()
        batcher, uploader = self._batcher, self._uploader
        with batcher._lock, uploader._lock:
            return WriterStats(
                submitted_records=batcher.submitted,
                dropped_records=batcher.dropped,
                shards_written=batcher.shards_written,
                shards_uploaded=uploader.shards_uploaded,
                records_uploaded=uploader.records_uploaded,
                tokens_uploaded=uploader.tokens_uploaded,
                spooled_shards=len(spooled),
                spooled_bytes=sum(spooled),
                upload_errors=uploader.upload_errors,
                store_reachable=uploader.store_reachable,
                refused_records=batcher.refused,
            )

    def flush(self, timeout: float = 60.0) -> bool:
        """Write every buffered record as a shard and wait until the spool is uploaded.

        Returns ``False`` if the store could not take everything within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        return self._batcher.flush(deadline) and self._uploader.wait_uploaded(deadline)

    def close(self, timeout: float = 60.0) -> WriterStats:
        """Flush everything and stop; shards that cannot be uploaded in time stay spooled."""
        if self._closed:
            return self.stats()
        self._closed = True
        deadline = time.monotonic() + timeout
        self._batcher.stop()
        uploaded = self._uploader.wait_uploaded(deadline)
        self._uploader.stop(timeout=max(1.0, deadline - time.monotonic()))
        stats = self.stats()
        if not uploaded:
            logger.warning(
                "lake writer closed with %d shard(s) (%d bytes) still spooled in %s: the store "
                "could not take them within %.0f s; a writer started with the same spool_dir "
                "uploads them",
                stats.spooled_shards,
                stats.spooled_bytes,
                self._spool.path,
                timeout,
            )
        self._spool.close()
        return stats

    def __enter__(self) -> LakeWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload))
    tmp.replace(path)
