"""A run that kept its champion leaves its best step in the lake, keyed by that champion,
for the next cycle on it (:mod:`tide_lib.orchestration.continuation`), over real S3."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tide_lib.config import LakeConfig, TideConfig
from tide_lib.lake import ObjectStore
from tide_lib.orchestration.continuation import (
    drop_continuation,
    fetch_continuation,
    keep_continuation,
)


def _draft(directory: Path, weights: bytes) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    (directory / "model.safetensors").write_bytes(weights)
    return directory


def test_a_continuation_is_handed_on_per_champion_and_consumed(
    stack: TideConfig, lake_config: LakeConfig, tmp_path: Path, tiny_drafts: dict[str, Path]
) -> None:
    config = stack.model_copy(update={"lake": lake_config})
    weights = "model.safetensors"
    first, later = tiny_drafts["en"], tiny_drafts["ko"]  # two runs' best steps
    assert fetch_continuation(config, "3", tmp_path / "none") is None  # nothing kept yet
    keep_continuation(config, "3", first)
    assert fetch_continuation(config, None, tmp_path / "fresh") is None  # a first draft
    assert fetch_continuation(config, "4", tmp_path / "other") is None  # another champion's
    fetched = fetch_continuation(config, "3", tmp_path / "trainer-b")  # any trainer host
    assert fetched is not None
    assert (fetched / weights).read_bytes() == (first / weights).read_bytes()
    assert (fetched / "config.json").is_file()
    off = config.model_copy(
        update={"cycle": config.cycle.model_copy(update={"continue_training": False})}
    )
    assert fetch_continuation(off, "3", tmp_path / "off") is None
    keep_continuation(config, "3", later)  # the next run's
    again = fetch_continuation(config, "3", tmp_path / "again")
    assert again is not None and (again / weights).read_bytes() == (later / weights).read_bytes()
    drop_continuation(config, "3")
    assert fetch_continuation(config, "3", tmp_path / "gone") is None
    drop_continuation(config, "3")  # dropping what is gone is no error (a retry)


def test_a_bad_continuation_is_dropped_not_trained_from(
    stack: TideConfig, lake_config: LakeConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A corrupt object in the lake must not fail every later train task of its champion."""
    config = stack.model_copy(update={"lake": lake_config})
    keep_continuation(config, "5", _draft(tmp_path / "bad", b"not safetensors"))
    with caplog.at_level(logging.WARNING):
        assert fetch_continuation(config, "5", tmp_path / "fetched") is None
    assert "dropping the continuation of champion v5" in caplog.text
    store = ObjectStore(config.store, config.store.lake_bucket)
    assert not list(store.list(f"{config.lake.prefix}/_state/"))  # dropped, not retried forever
