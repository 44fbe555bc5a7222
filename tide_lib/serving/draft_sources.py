"""Where a server may load drafts from, and its on-disk cache of downloaded drafts.

``/update_weights_from_disk`` names a path or a URI, and an admin key is no licence
to make the engine read whatever its filesystem or its S3 credentials reach. A
draft loads only from a configured source (``serve.draft_sources``: local roots and
``s3://bucket/prefix`` prefixes), the directory holding the startup draft, or the
configured MLflow server (``models:/``, ``runs:/``, ``mlflow-artifacts:/``). A
refused path and a missing one get the same answer, so the route tells nothing
about what exists elsewhere. MLflow URIs that name a host are refused: MLflow's
client would send this server's MLflow login to that host. Downloads land in
``<scratch>/drafts/pid-<pid>``, a directory per serving process (tensor-parallel
ranks and engines sharing a scratch dir never touch each other's downloads), one
entry per (URI, weight version): kept while among the newest few, removed at once
when the download, validation or load fails. A swap without a weight version is
never cached (an alias or a re-published prefix must be fetched again). Directories
of processes that died are removed when the next one starts.
"""

from __future__ import annotations

__all__ = ["DraftCache", "DraftRefusedError", "DraftSources", "local_draft"]

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Final
from urllib.parse import urlparse

from tide_lib.config import ServeConfig, TideConfig
from tide_lib.errors import TideError
from tide_lib.registry.uris import MLFLOW_SCHEMES, fetch_draft
from tide_lib.stack.manager import pid_alive

logger = logging.getLogger(__name__)

_PARTIAL: Final = ".partial-"
_SOURCE_FILE: Final = ".tide-source.json"


class DraftRefusedError(TideError, ValueError):
    """A draft path outside the configured sources, or one that does not exist."""


def _s3_parts(uri: str) -> tuple[str, str] | None:
    """``(bucket, key prefix)`` of a clean ``s3://`` URI, None for anything odd."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    key = key.rstrip("/")
    segments = key.split("/") if key else []
    if not bucket or any(part in {"", ".", ".."} for part in segments):
        return None
    return bucket, key


def _under(key: str, prefix: str) -> bool:
    return not prefix or key == prefix or key.startswith(prefix + "/")


@dataclasses.dataclass(frozen=True)
class DraftSources:
    """The allow-list: local roots (resolved) and S3 ``(bucket, prefix)`` pairs."""

    roots: tuple[Path, ...]
    prefixes: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, serve: ServeConfig, startup: str | None) -> DraftSources:
        """``serve.draft_sources`` plus the directory holding the startup draft."""
        roots: list[Path] = []
        prefixes: list[tuple[str, str]] = []
        for source in serve.draft_sources:
            if source.startswith("s3://"):
                parts = _s3_parts(source)
                if parts is None:
                    raise ValueError(f"draft source {source!r} is not s3://bucket/prefix")
                prefixes.append(parts)
            else:
                roots.append(Path(source).resolve())
        # The startup draft itself, never its parent (a draft in /tmp/x must not open /tmp).
        if startup and not startup.startswith(("s3://", *MLFLOW_SCHEMES)):
            roots.append(Path(startup).resolve())
        elif startup and startup.startswith("s3://"):
            parts = _s3_parts(startup)
            if parts is not None and parts[1]:  # never a whole bucket
                prefixes.append(parts)
        return cls(tuple(roots), tuple(prefixes))

    def describe(self) -> str:
        named = [str(root) for root in self.roots]
        named += [f"s3://{bucket}/{prefix}" for bucket, prefix in self.prefixes]
        return ", ".join([*named, "models:/ runs:/ mlflow-artifacts:/ URIs"])

    def _refused(self, model_path: str) -> DraftRefusedError:
        return DraftRefusedError(
            f"{model_path!r} is not a draft under this server's draft sources, or does not "
            f"exist. Drafts load from: {self.describe()}. Put the draft there, or add its root "
            "or s3:// prefix to TIDE_SERVE__DRAFT_SOURCES"
        )

    def resolve(self, model_path: str) -> str | Path:
        """The allowed URI, or the resolved local directory; else :class:`DraftRefusedError`."""
        if "\0" in model_path or ".." in model_path.split("/"):
            raise self._refused(model_path)
        if model_path.startswith(MLFLOW_SCHEMES):
            if urlparse(model_path).netloc:  # mlflow-artifacts://elsewhere/: our login goes there
                raise self._refused(model_path)
            return model_path
        if model_path.startswith("s3://"):
            parts = _s3_parts(model_path)
            if parts is None or not any(
                parts[0] == bucket and _under(parts[1], prefix) for bucket, prefix in self.prefixes
            ):
                raise self._refused(model_path)
            return model_path
        try:
            local = Path(model_path).resolve()
            allowed = any(local.is_relative_to(root) for root in self.roots) and local.is_dir()
        except (OSError, ValueError, RuntimeError):
            allowed = False
        if not allowed:
            raise self._refused(model_path)
        return local


class DraftCache:
    """Downloaded drafts under ``root``, one directory per (URI, weight version)."""

    def __init__(self, root: Path, keep: int) -> None:
        self.root = root / f"pid-{os.getpid()}"
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in self.root.glob(f"{_PARTIAL}*"):
            shutil.rmtree(leftover, ignore_errors=True)
        for other in root.glob("pid-*"):
            pid = other.name.removeprefix("pid-")
            if pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(other, ignore_errors=True)

    def _entry(self, uri: str, version: str) -> Path:
        digest = hashlib.sha256(f"{uri}\0{version}".encode()).hexdigest()[:20]
        return self.root / digest

    @contextlib.contextmanager
    def fetch(self, uri: str, version: str, config: TideConfig) -> Iterator[Path]:
        """The draft directory of ``uri``; the download is dropped if the body raises, and
        never kept when ``version`` is the URI itself (no weight version was given)."""
        if version == uri:
            partial = self.root / f"{_PARTIAL}{uuid.uuid4().hex}"
            try:
                yield fetch_draft(uri, config, partial)
            finally:
                shutil.rmtree(partial, ignore_errors=True)
            return
        entry = self._entry(uri, version)
        source = entry / _SOURCE_FILE
        if source.is_file():
            try:
                yield entry / json.loads(source.read_text())["draft"]
            except BaseException:
                shutil.rmtree(entry, ignore_errors=True)
                raise
            entry.touch()
            return
        partial = self.root / f"{_PARTIAL}{uuid.uuid4().hex}"
        try:
            local = fetch_draft(uri, config, partial)
            relative = local.resolve().relative_to(partial.resolve())
            yield local
            (partial / _SOURCE_FILE).write_text(json.dumps({"uri": uri, "draft": str(relative)}))
            shutil.rmtree(entry, ignore_errors=True)
            partial.rename(entry)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        self._prune()

    def _prune(self) -> None:
        entries = [path for path in self.root.iterdir() if (path / _SOURCE_FILE).is_file()]
        entries.sort(key=lambda path: path.stat().st_mtime, reverse=True)
        for stale in entries[self.keep :]:
            shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def local_draft(
    model_path: str, version: str, sources: DraftSources, cache: DraftCache, config: TideConfig
) -> Iterator[Path]:
    """The local directory of an allowed draft, downloading (and caching) a URI's."""
    resolved = sources.resolve(model_path)
    if isinstance(resolved, Path):
        yield resolved
        return
    with cache.fetch(resolved, version, config) as local:
        yield local
