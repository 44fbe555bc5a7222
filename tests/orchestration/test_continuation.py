"""A run that kept its champion leaves its best step in the lake, keyed by that champion,
for the next cycle on it (:mod:`tide_lib.orchestration.continuation`), over real S3."""

from __future__ import annotations

from pathlib import Path

from tide_lib.config import LakeConfig, TideConfig
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
    stack: TideConfig, lake_config: LakeConfig, tmp_path: Path
) -> None:
    config = stack.model_copy(update={"lake": lake_config})
    assert fetch_continuation(config, "3", tmp_path / "none") is None  # nothing kept yet
    keep_continuation(config, "3", _draft(tmp_path / "run", b"step 20"))
    assert fetch_continuation(config, None, tmp_path / "fresh") is None  # a first draft
    assert fetch_continuation(config, "4", tmp_path / "other") is None  # another champion's
    fetched = fetch_continuation(config, "3", tmp_path / "trainer-b")  # any trainer host
    assert fetched is not None
    assert (fetched / "model.safetensors").read_bytes() == b"step 20"
    assert (fetched / "config.json").is_file()
    off = config.model_copy(
        update={"cycle": config.cycle.model_copy(update={"continue_training": False})}
    )
    assert fetch_continuation(off, "3", tmp_path / "off") is None
    keep_continuation(config, "3", _draft(tmp_path / "later", b"step 40"))  # the next run's
    again = fetch_continuation(config, "3", tmp_path / "again")
    assert again is not None and (again / "model.safetensors").read_bytes() == b"step 40"
    drop_continuation(config, "3")
    assert fetch_continuation(config, "3", tmp_path / "gone") is None
    drop_continuation(config, "3")  # dropping what is gone is no error (a retry)
