"""The object store as TIDE sees it: a few S3 calls through the ``minio`` client.

The same code talks to MinIO in production and SeaweedFS locally; it never asks
which. Calls fail fast (short timeouts, few retries) and raise
:class:`StoreUnavailableError` when the server cannot be reached, so that the
capture writer can spool instead of stalling serving threads.
"""

from __future__ import annotations

__all__ = [
    "NoSuchObjectError",
    "ObjectInfo",
    "ObjectStore",
    "StoreIO",
    "StoreUnavailableError",
    "process_io",
]

import dataclasses
import io
import logging
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import urllib3
from minio import Minio
from minio.commonconfig import CopySource
from minio.error import S3Error

from tide_lib.config import ObjectStoreConfig
from tide_lib.errors import TideError

logger = logging.getLogger(__name__)
T = TypeVar("T")


class StoreUnavailableError(TideError, ConnectionError):
    """The S3 server did not answer; the message names the endpoint and what to check."""


class NoSuchObjectError(TideError, LookupError):
    """The object asked for is not in the bucket (deleted meanwhile, or never written)."""


_MISSING_CODES = frozenset({"NoSuchKey", "NoSuchObject", "ResourceNotFound"})


def _missing(error: S3Error, key: str) -> Exception:
    if error.code in _MISSING_CODES:
        return NoSuchObjectError(f"{key} is not in the bucket")
    return error


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    last_modified: datetime | None


@dataclasses.dataclass
class StoreIO:
    """What a store object has read: bytes downloaded, objects listed, GETs and LISTs sent."""

    bytes_read: int = 0
    objects_listed: int = 0
    gets: int = 0
    lists: int = 0

    def add(self, *, bytes_read: int = 0, listed: int = 0, gets: int = 0, lists: int = 0) -> None:
        self.bytes_read += bytes_read
        self.objects_listed += listed
        self.gets += gets
        self.lists += lists


_PROCESS_IO = StoreIO()


def process_io() -> StoreIO:
    """What every store of this process has read so far (a copy; subtract two to measure)."""
    return dataclasses.replace(_PROCESS_IO)


def _count(store_io: StoreIO, **amounts: int) -> None:
    store_io.add(**amounts)
    _PROCESS_IO.add(**amounts)


class ObjectStore:
    """One bucket on one S3 endpoint; ``io`` counts what it read (benchmarks report it)."""

    def __init__(self, config: ObjectStoreConfig, bucket: str) -> None:
        self.config = config
        self.bucket = bucket
        self.io = StoreIO()
        tls: dict[str, Any] = (
            {"cert_reqs": "CERT_REQUIRED", "ca_certs": str(config.ca_bundle)}
            if config.ca_bundle is not None
            else {}
        )
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=config.timeout_s, read=config.timeout_s * 6),
            # No retry on refused connections: callers spool or report instead of hanging.
            retries=urllib3.Retry(
                total=2, connect=0, backoff_factor=0.1, status_forcelist=[502, 503, 504]
            ),
            maxsize=8,
            **tls,
        )
        token = config.session_token
        self._client = Minio(
            config.host_port,
            access_key=config.access_key,
            secret_key=config.secret(),
            session_token=token.get_secret_value() if token is not None else None,
            secure=config.secure,
            region=config.region,
            http_client=http,
        )

    def __repr__(self) -> str:
        return f"ObjectStore({self.config.endpoint}, bucket={self.bucket})"

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}"

    def _unavailable(self, action: str, error: Exception) -> StoreUnavailableError:
        return StoreUnavailableError(
            f"S3 store {self.config.endpoint} unreachable while {action}: {error}. "
            "Is the server up (`tide stack status`) and TIDE_STORE__ENDPOINT right?"
        )

    def _call(self, action: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except (urllib3.exceptions.HTTPError, OSError) as error:
            raise self._unavailable(action, error) from error

    def ensure_bucket(self) -> None:
        if not self._call("checking the bucket", self._client.bucket_exists, self.bucket):
            self._call("creating the bucket", self._client.make_bucket, self.bucket)
            logger.info("created bucket %s on %s", self.bucket, self.config.endpoint)

    def is_reachable(self) -> bool:
        try:
            self._call("probing", self._client.bucket_exists, self.bucket)
        except StoreUnavailableError:
            return False
        return True

    def put_bytes(
        self, key: str, data: bytes, content_type: str = "application/octet-stream"
    ) -> None:
        self._call(
            f"writing {key}",
            self._client.put_object,
            self.bucket,
            key,
            io.BytesIO(data),
            len(data),
            content_type=content_type,
        )

    def put_file(self, key: str, path: Path) -> None:
        self._call(
            f"uploading {path} to {key}", self._client.fput_object, self.bucket, key, str(path)
        )

    def get_bytes(self, key: str) -> bytes:
        """The object's bytes; :class:`NoSuchObjectError` if it is not there."""
        try:
            response = self._call(f"reading {key}", self._client.get_object, self.bucket, key)
        except S3Error as error:
            raise _missing(error, key) from error
        try:
            data = bytes(response.read())
        except (urllib3.exceptions.HTTPError, OSError) as error:
            raise self._unavailable(f"reading {key}", error) from error
        finally:
            response.close()
            response.release_conn()
        _count(self.io, gets=1, bytes_read=len(data))
        return data

    def get_file(self, key: str, path: Path) -> None:
        """Download to ``path``; :class:`NoSuchObjectError` if the object is not there."""
        try:
            self._call(f"downloading {key}", self._client.fget_object, self.bucket, key, str(path))
        except S3Error as error:
            raise _missing(error, key) from error
        _count(self.io, gets=1, bytes_read=path.stat().st_size)

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """Objects under ``prefix`` in key order, optionally only those after ``start_after``."""
        _count(self.io, lists=1)
        try:
            for obj in self._client.list_objects(
                self.bucket, prefix=prefix, recursive=True, start_after=start_after
            ):
                if obj.object_name is None or obj.is_dir:
                    continue
                _count(self.io, listed=1)
                yield ObjectInfo(obj.object_name, obj.size or 0, obj.last_modified)
        except (urllib3.exceptions.HTTPError, OSError) as error:
            raise self._unavailable(f"listing {prefix}", error) from error

    def exists(self, key: str) -> bool:
        try:
            self._call(f"checking {key}", self._client.stat_object, self.bucket, key)
        except S3Error as error:
            if error.code in _MISSING_CODES:
                return False
            raise
        return True

    def last_modified(self, key: str) -> datetime | None:
        """When the store received ``key``, by its own clock (to the second)."""
        try:
            info = self._call(f"checking {key}", self._client.stat_object, self.bucket, key)
        except S3Error as error:
            raise _missing(error, key) from error
        stamp: datetime | None = info.last_modified
        return stamp

    def move(self, key: str, new_key: str) -> None:
        """Copy then delete; :class:`NoSuchObjectError` if ``key`` is not there."""
        try:
            self._call(
                f"copying {key}",
                self._client.copy_object,
                self.bucket,
                new_key,
                CopySource(self.bucket, key),
            )
        except S3Error as error:
            raise _missing(error, key) from error
        self.remove(key)

    def remove(self, key: str) -> None:
        self._call(f"deleting {key}", self._client.remove_object, self.bucket, key)
