"""The captured record: one finished request, as serving hands it to the lake.

The schema is the contract between the serving fleet (producer) and training and
evaluation (consumers). Hidden states travel as raw little-endian float16/bfloat16
bytes: Parquet has no bfloat16 type, and raw buffers keep the writer's per-record
cost to a memory copy. ``validate_record`` runs on the caller's thread, so it only
inspects shapes and dtypes; it never touches tensor data. ``values_problem`` does:
it finds states that are NaN/inf, token ids outside the target's vocabulary and a
hidden size that is not the target's (one such record made a whole cycle's loss
NaN), and runs where reading every value costs serving nothing (the writer's
batcher thread, the reader).

``segment`` is the traffic segment a client named (a header or request field the
engines pass through), or None. Labels come from clients, so ``segment_problem``
keeps them short and printable; a record with a bad label is refused and counted
like one with bad values, never raised on a serving thread. Shards written before
schema version 2 have no ``segment`` column and read as unlabelled.
"""

from __future__ import annotations

__all__ = [
    "CLUSTER_PREFIX",
    "HIDDEN_DTYPES",
    "LEGACY_RECORD_SCHEMAS",
    "MAX_SEGMENT_CHARS",
    "RECORD_SCHEMA",
    "SCHEMA_VERSION",
    "SEGMENT_LABEL",
    "UNSEGMENTED",
    "CapturedRecord",
    "InvalidRecordError",
    "TargetLimits",
    "record_nbytes",
    "records_to_table",
    "reserved_segment",
    "segment_problem",
    "specforge_file_name",
    "target_limits",
    "validate_record",
    "values_problem",
]

import dataclasses
import json
import logging
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import numpy as np
import pyarrow as pa

from tide_lib.errors import TideError

logger = logging.getLogger(__name__)

SCHEMA_VERSION: Final = 2
MAX_SEGMENT_CHARS: Final = 64
SEGMENT_LABEL: Final = "segment"  # the key of SGLang's custom_labels that names the segment
# Names TIDE gives segments itself; a client label may not take them.
CLUSTER_PREFIX: Final = "cluster-"  # clusters of unlabelled traffic: cluster-0, cluster-1, ...
UNSEGMENTED: Final = "all"  # the one segment when nothing was labelled and no cluster exists
_SEGMENT_LABEL: Final = re.compile(r"\w[\w.\- ]*")
HIDDEN_DTYPES: Final = ("float16", "bfloat16")
NUM_AUX_LAYERS: Final = 3

RECORD_SCHEMA: Final = pa.schema(
    [
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("target_id", pa.string(), nullable=False),
        pa.field("draft_version", pa.string(), nullable=False),
        pa.field("started_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("finished_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
        pa.field("hidden_size", pa.int32(), nullable=False),
        pa.field("hidden_dtype", pa.string(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("hidden_states", pa.large_binary(), nullable=False),
        pa.field("aux_hidden_states", pa.large_binary(), nullable=False),
        pa.field("spec_verify_ct", pa.int32(), nullable=False),
        pa.field("spec_accept_tokens", pa.int32(), nullable=False),
        pa.field("completion_tokens", pa.int32(), nullable=False),
        pa.field("segment", pa.string(), nullable=True),
    ],
    metadata={
        "tide.schema_version": str(SCHEMA_VERSION),
        "tide.doc": (
            "hidden_states: final-layer states [num_tokens, hidden_size]; aux_hidden_states: "
            "EAGLE3 aux-layer states [num_tokens, 3*hidden_size]; both row-major raw "
            "little-endian bytes of hidden_dtype. loss_mask marks output tokens. segment: "
            "the client's traffic label, null when the request carried none."
        ),
    },
)
# Schemas of shards older writers committed; readers accept them (missing columns read
# as their default: no segment).
LEGACY_RECORD_SCHEMAS: Final = (RECORD_SCHEMA.remove(RECORD_SCHEMA.get_field_index("segment")),)


class InvalidRecordError(TideError, ValueError):
    """A record does not satisfy the capture contract; the message says which field."""


@dataclasses.dataclass(slots=True)
class CapturedRecord:
    """One finished request with the target's hidden states.

    The one record type of a captured request: serving builds it, the lake writes and
    reads it (:class:`~tide_lib.lake.reader.LakeReader` yields it with torch tensors,
    ``input_ids`` and ``loss_mask`` as int64), training and evaluation consume it.

    Tensors may be numpy arrays or torch tensors (CPU). ``hidden_states`` is
    ``[T, H]``, ``aux_hidden_states`` is ``[T, 3H]``, both float16 or bfloat16;
    ``input_ids`` and ``loss_mask`` are ``[T]``. ``spec_verify_ct`` counts target
    verify steps and ``spec_accept_tokens`` the draft tokens they accepted.
    ``segment`` is the client's traffic label (see :func:`segment_problem`), or None.
    """

    request_id: str
    target_id: str
    draft_version: str
    started_at: datetime
    finished_at: datetime
    input_ids: Any
    loss_mask: Any
    hidden_states: Any
    aux_hidden_states: Any
    spec_verify_ct: int = 0
    spec_accept_tokens: int = 0
    completion_tokens: int = 0
    segment: str | None = None

    @classmethod
    def of_forward(
        cls,
        request_id: str,
        started_at: datetime,
        tokens: tuple[list[int], list[int]],
        states: tuple[Any, Any],
        **fields: Any,
    ) -> CapturedRecord:
        """A request the target has just run, finished now, in the lake's dtypes: ``tokens``
        = (ids, loss mask) as int32/int8, ``states`` = (final ``[T, H]``, aux ``[T, 3H]``)
        torch tensors as float16; ``fields`` the rest (``target_id``, ``draft_version``,
        counts, ``segment``)."""
        import torch  # noqa: PLC0415  (callers ran the target: torch is loaded)

        (ids, mask), (final, aux) = tokens, states
        return cls(
            request_id=request_id,
            started_at=started_at,
            finished_at=datetime.now(UTC),
            input_ids=torch.tensor(ids, dtype=torch.int32),
            loss_mask=torch.tensor(mask, dtype=torch.int8),
            hidden_states=final.to(torch.float16),
            aux_hidden_states=aux.to(torch.float16),
            **fields,
        )

    def to_specforge(self) -> dict[str, Any]:
        """The dict SpecForge's ``OfflineEagle3Dataset`` loads from a ``.ckpt`` file (its
        names: ``hidden_state``, ``aux_hidden_state``; ids and mask as int64)."""
        import torch  # noqa: PLC0415

        return {
            "input_ids": torch.as_tensor(self.input_ids).long(),
            "loss_mask": torch.as_tensor(self.loss_mask).long(),
            "hidden_state": torch.as_tensor(self.hidden_states),
            "aux_hidden_state": torch.as_tensor(self.aux_hidden_states),
        }

    def save_specforge(self, folder: Path, index: int, **extra: object) -> Path:
        """Write the record as SpecForge's offline file ``folder/data_<index>.ckpt`` (with
        ``extra`` keys, such as its segment): the one writer of that format."""
        import torch  # noqa: PLC0415

        folder.mkdir(parents=True, exist_ok=True)
        path = folder / specforge_file_name(index)
        torch.save({**self.to_specforge(), **extra}, path)
        return path


def reserved_segment(segment: str) -> bool:
    """Is ``segment`` one of TIDE's own names (``all``, ``cluster-*``, any case)?"""
    folded = segment.casefold()
    return folded == UNSEGMENTED or folded.startswith(CLUSTER_PREFIX)


def segment_problem(segment: object) -> str | None:
    """Why ``segment`` cannot label a record, or None if it can (None itself can).

    A label is at most :data:`MAX_SEGMENT_CHARS` characters: letters (any script),
    digits, ``_``, ``-``, ``.`` and spaces, starting with a letter, digit or ``_``.
    It comes from clients and becomes a dictionary key, a metric label and part of
    MLflow tag names (which allow no other characters).
    """
    if segment is None:
        return None
    if not isinstance(segment, str):
        return f"segment label must be a string, got {type(segment).__name__}"
    if len(segment) > MAX_SEGMENT_CHARS:
        return f"segment label is {len(segment)} characters, at most {MAX_SEGMENT_CHARS} allowed"
    if not _SEGMENT_LABEL.fullmatch(segment):
        return (
            f"segment label {segment!r} is not a short name (letters, digits, '_', '-', '.', "
            "spaces; starting with a letter, digit or '_')"
        )
    if reserved_segment(segment):
        return (
            f"segment label {segment!r} is reserved ({UNSEGMENTED!r} and {CLUSTER_PREFIX}* name "
            "TIDE's own segments of unlabelled traffic); choose another name"
        )
    return None


def _shape(value: Any) -> tuple[int, ...]:
    shape = getattr(value, "shape", None)
    if shape is None:
        raise TypeError
    return tuple(int(d) for d in shape)


def _dtype_name(value: Any) -> str:
    """'float16', 'bfloat16', 'int64', ... for numpy arrays and torch tensors alike."""
    return str(value.dtype).removeprefix("torch.")


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch")


def validate_record(record: CapturedRecord) -> None:
    """Raise :class:`InvalidRecordError` naming the first field that breaks the contract."""
    if not isinstance(record, CapturedRecord):
        raise InvalidRecordError(f"expected a CapturedRecord, got {type(record).__name__}")
    for name in ("request_id", "target_id"):
        value = getattr(record, name)
        if not isinstance(value, str) or not value:
            raise InvalidRecordError(f"{name} must be a non-empty string, got {value!r}")
    if not isinstance(record.draft_version, str):
        raise InvalidRecordError(f"draft_version must be a string, got {record.draft_version!r}")
    for name in ("started_at", "finished_at"):
        value = getattr(record, name)
        if not isinstance(value, datetime) or value.tzinfo is None:
            raise InvalidRecordError(f"{name} must be a timezone-aware datetime, got {value!r}")
    if record.finished_at < record.started_at:
        raise InvalidRecordError(
            f"request {record.request_id}: finished_at {record.finished_at} "
            f"is before started_at {record.started_at}"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    for name in ("input_ids", "loss_mask", "hidden_states", "aux_hidden_states"):
        try:
            shapes[name] = _shape(getattr(record, name))
        except TypeError:
            raise InvalidRecordError(
                f"request {record.request_id}: {name} must be a numpy array or torch tensor, "
                f"got {type(getattr(record, name)).__name__}"
            ) from None
    if len(shapes["input_ids"]) != 1 or shapes["input_ids"][0] == 0:
        raise InvalidRecordError(
            f"request {record.request_id}: input_ids must be 1-D and non-empty, "
            f"got shape {shapes['input_ids']}"
        )
    num_tokens = shapes["input_ids"][0]
    if shapes["loss_mask"] != (num_tokens,):
        raise InvalidRecordError(
            f"request {record.request_id}: loss_mask has shape {shapes['loss_mask']}, "
            f"expected ({num_tokens},) to match input_ids"
        )
    hidden = shapes["hidden_states"]
    if len(hidden) != 2 or hidden[0] != num_tokens or hidden[1] == 0:
        raise InvalidRecordError(
            f"request {record.request_id}: hidden_states has shape {hidden}, "
            f"expected ({num_tokens}, H)"
        )
    expected_aux = (num_tokens, NUM_AUX_LAYERS * hidden[1])
    if shapes["aux_hidden_states"] != expected_aux:
        raise InvalidRecordError(
            f"request {record.request_id}: aux_hidden_states has shape "
            f"{shapes['aux_hidden_states']}, expected {expected_aux} (3 aux layers x H={hidden[1]})"
        )
    hidden_dtype = _dtype_name(record.hidden_states)
    if hidden_dtype not in HIDDEN_DTYPES:
        raise InvalidRecordError(
            f"request {record.request_id}: hidden_states dtype is {hidden_dtype}, "
            f"expected one of {HIDDEN_DTYPES}"
        )
    if _dtype_name(record.aux_hidden_states) != hidden_dtype:
        raise InvalidRecordError(
            f"request {record.request_id}: aux_hidden_states dtype "
            f"{_dtype_name(record.aux_hidden_states)} differs from hidden_states {hidden_dtype}"
        )
    if not _dtype_name(record.input_ids).startswith(("int", "uint")):
        raise InvalidRecordError(
            f"request {record.request_id}: input_ids must hold integers, "
            f"got {_dtype_name(record.input_ids)}"
        )
    for name in ("spec_verify_ct", "spec_accept_tokens", "completion_tokens"):
        value = getattr(record, name)
        if not isinstance(value, int) or value < 0:
            raise InvalidRecordError(
                f"request {record.request_id}: {name} must be a non-negative int, got {value!r}"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class TargetLimits:
    """What a record must fit: the target's hidden size and vocabulary (None: unknown,
    and then unchecked). The writer refuses records beyond them, the reader skips them."""

    hidden_size: int | None = None
    vocab_size: int | None = None


def target_limits(target_dir: str | Path | None) -> TargetLimits:
    """The :class:`TargetLimits` of an HF target (its ``config.json``, or the
    ``text_config`` inside it); unknown where there is none or a host lacks it."""
    if target_dir is None:
        return TargetLimits()
    path = Path(target_dir) / "config.json"
    try:
        declared = json.loads(path.read_text())
    except (OSError, ValueError):
        logger.info("no readable target config at %s: records are checked for NaN/inf only", path)
        return TargetLimits()
    text = declared.get("text_config") if isinstance(declared.get("text_config"), dict) else {}
    values = {name: declared.get(name, text.get(name)) for name in ("hidden_size", "vocab_size")}
    return TargetLimits(**{k: v if isinstance(v, int) else None for k, v in values.items()})


def values_problem(
    input_ids: Any,
    hidden_states: Any,
    aux_hidden_states: Any,
    limits: TargetLimits | None = None,
) -> str | None:
    """Why a record's values must not train a draft, or None if they may.

    Checks a shape-valid record's hidden size against the target's (when known),
    its token ids against the target's vocabulary (when known) and every state
    for NaN/inf (always). Reads every value: never call it on a serving thread.
    """
    hidden_size, vocab_size = (limits.hidden_size, limits.vocab_size) if limits else (None, None)
    width = _shape(hidden_states)[-1]
    if hidden_size is not None and width != hidden_size:
        return f"hidden size {width}, the target's is {hidden_size}"
    ids = _int_list(input_ids, "int64")
    if ids.size and int(ids.min()) < 0:
        return f"token id {int(ids.min())} is negative"
    if vocab_size is not None and ids.size and int(ids.max()) >= vocab_size:
        return f"token id {int(ids.max())} is outside the target's vocabulary of {vocab_size}"
    for name, value in (("hidden_states", hidden_states), ("aux_hidden_states", aux_hidden_states)):
        if not _all_finite(value):
            return f"{name} holds NaN or inf"
    return None


def _all_finite(value: Any) -> bool:
    if _is_torch(value):
        import torch  # noqa: PLC0415  (only torch tensors get here)

        return bool(torch.isfinite(value).all())
    return bool(np.isfinite(np.asarray(value)).all())


def specforge_file_name(index: int) -> str:
    """The name of the ``index``-th file of a folder :meth:`CapturedRecord.save_specforge`
    writes: SpecForge's ``data_<index>.ckpt``."""
    return f"data_{index:08d}.ckpt"


def record_nbytes(record: CapturedRecord) -> int:
    """Raw size of a validated record's tensors (what it costs in memory and on the wire)."""
    num_tokens, hidden_size = _shape(record.hidden_states)
    return num_tokens * hidden_size * 2 * (1 + NUM_AUX_LAYERS) + num_tokens * 5


def _raw_bytes(value: Any) -> bytes:
    if _is_torch(value):
        import torch  # noqa: PLC0415  (serving passes torch tensors; the lake itself does not need torch)

        tensor = value.detach().to("cpu").contiguous()
        return bytes(tensor.view(torch.int16).numpy().tobytes())
    return bytes(np.ascontiguousarray(value).astype("<f2", copy=False).tobytes())


def _int_list(value: Any, dtype: str) -> np.ndarray:
    array = value.detach().to("cpu").numpy() if _is_torch(value) else np.asarray(value)
    return array.astype(dtype, copy=False)


def _utc(value: datetime) -> datetime:
    return value.astimezone(UTC)


def records_to_table(records: list[CapturedRecord]) -> pa.Table:
    """Encode validated records into one Arrow table of :data:`RECORD_SCHEMA`."""
    columns: dict[str, list[Any]] = {field.name: [] for field in RECORD_SCHEMA}
    for record in records:
        num_tokens, hidden_size = _shape(record.hidden_states)
        columns["request_id"].append(record.request_id)
        columns["target_id"].append(record.target_id)
        columns["draft_version"].append(record.draft_version)
        columns["started_at"].append(_utc(record.started_at))
        columns["finished_at"].append(_utc(record.finished_at))
        columns["num_tokens"].append(num_tokens)
        columns["hidden_size"].append(hidden_size)
        columns["hidden_dtype"].append(_dtype_name(record.hidden_states))
        columns["input_ids"].append(_int_list(record.input_ids, "int32"))
        columns["loss_mask"].append(_int_list(record.loss_mask, "int8"))
        columns["hidden_states"].append(_raw_bytes(record.hidden_states))
        columns["aux_hidden_states"].append(_raw_bytes(record.aux_hidden_states))
        columns["spec_verify_ct"].append(record.spec_verify_ct)
        columns["spec_accept_tokens"].append(record.spec_accept_tokens)
        columns["completion_tokens"].append(record.completion_tokens)
        columns["segment"].append(record.segment)
    return pa.Table.from_pydict(columns, schema=RECORD_SCHEMA)
