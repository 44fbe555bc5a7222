"""The hidden-state lake: captured target states of real requests, in S3.

Serving writes through :class:`LakeWriter`; training, evaluation and the Airflow
sensors read through :class:`LakeReader`. Only committed shards are ever read.
"""

__all__ = [
    "RECORD_SCHEMA",
    "CapturedRecord",
    "CommitMarker",
    "CorruptShardError",
    "InvalidRecordError",
    "LakeReader",
    "LakeWriter",
    "ObjectStore",
    "StoreUnavailableError",
    "WriterStats",
    "target_slug",
    "watermark",
]

from tide_lib.lake.layout import CommitMarker, target_slug
from tide_lib.lake.reader import CorruptShardError, LakeReader, watermark
from tide_lib.lake.schema import RECORD_SCHEMA, CapturedRecord, InvalidRecordError
from tide_lib.lake.store import ObjectStore, StoreUnavailableError
from tide_lib.lake.writer import LakeWriter, WriterStats
