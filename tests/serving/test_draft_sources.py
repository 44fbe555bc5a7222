"""The engine's draft allow-list and download cache, without a server (issue 13, review)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tide_lib.config import ServeConfig
from tide_lib.serving.draft_sources import DraftCache, DraftRefusedError, DraftSources


def test_mlflow_uris_naming_another_host_are_refused(tmp_path: Path) -> None:
    """mlflow-artifacts://host/... made MLflow's client send this server's MLflow login to
    that host; registry URIs without a host still resolve against the tracking server."""
    sources = DraftSources.of(ServeConfig(), str(tmp_path / "draft"))
    for uri in (
        "mlflow-artifacts://evil.example:80/x",
        "models://profile@elsewhere/tide-draft-x/1",
        "runs://attacker/abc/draft",
    ):
        with pytest.raises(DraftRefusedError):
            sources.resolve(uri)
    for uri in ("models:/tide-draft-x/3", "runs:/abc123/draft", "mlflow-artifacts:/1/a/draft"):
        assert sources.resolve(uri) == uri


def test_only_the_startup_draft_itself_is_allowed(tmp_path: Path) -> None:
    """A startup draft in /tmp/x allowed all of /tmp, an s3:// one its whole parent prefix."""
    startup, sibling = tmp_path / "drafts" / "v1", tmp_path / "drafts" / "v2"
    startup.mkdir(parents=True)
    sibling.mkdir()
    sources = DraftSources.of(ServeConfig(), str(startup))
    assert sources.resolve(str(startup)) == startup.resolve()
    with pytest.raises(DraftRefusedError) as refused:
        sources.resolve(str(sibling))
    with pytest.raises(DraftRefusedError) as missing:
        sources.resolve(str(tmp_path / "nowhere"))
    assert str(refused.value).replace(str(sibling), "X") == str(missing.value).replace(
        str(tmp_path / "nowhere"), "X"
    )
    s3 = DraftSources.of(ServeConfig(), "s3://bucket/drafts/v1")
    assert s3.resolve("s3://bucket/drafts/v1") == "s3://bucket/drafts/v1"
    with pytest.raises(DraftRefusedError):
        s3.resolve("s3://bucket/drafts/v2")
    assert DraftSources.of(ServeConfig(), "s3://bucket").prefixes == ()


def test_each_process_has_its_own_cache_and_dead_ones_are_cleared(tmp_path: Path) -> None:
    """Tensor-parallel ranks (and engines sharing a scratch dir) deleted each other's
    downloads in progress; now each process works in its own directory."""
    root = tmp_path / "drafts"
    alive = root / f"pid-{os.getppid()}" / ".partial-inflight"
    alive.mkdir(parents=True)
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead = root / f"pid-{int(ended.stdout)}"
    (dead / "entry").mkdir(parents=True)
    cache = DraftCache(root, keep=2)
    assert cache.root == root / f"pid-{os.getpid()}" and cache.root.is_dir()
    assert alive.is_dir(), "another live process's download was deleted"
    assert not dead.exists(), "a dead process's cache was left behind"
