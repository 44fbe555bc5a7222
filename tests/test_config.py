"""The typed configuration: environment and file sources, strictness, validation."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from tide_lib.config import load_config


def test_defaults_describe_the_local_stack() -> None:
    config = load_config()
    assert config.store.endpoint == f"http://127.0.0.1:{config.stack.s3_port}"
    assert config.lake.prefix == "hidden_states"


def test_environment_overrides_nested_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDE_STORE__ENDPOINT", "https://minio.internal:9000/")
    monkeypatch.setenv("TIDE_LAKE__SHARD_MAX_AGE_S", "5")
    config = load_config()
    assert config.store.endpoint == "https://minio.internal:9000"
    assert config.store.secure and config.store.host_port == "minio.internal:9000"
    assert config.lake.shard_max_age_s == 5.0


def test_config_file_is_read_and_environment_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tide.yaml"
    path.write_text("lake:\n  prefix: from-file\n  queue_max_records: 7\n")
    monkeypatch.setenv("TIDE_CONFIG", str(path))
    monkeypatch.setenv("TIDE_LAKE__QUEUE_MAX_RECORDS", "9")
    config = load_config()
    assert config.lake.prefix == "from-file"
    assert config.lake.queue_max_records == 9


def test_missing_config_file_says_where(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TIDE_CONFIG", str(tmp_path / "nope.yaml"))
    with pytest.raises(FileNotFoundError, match=r"nope\.yaml"):
        load_config()


def test_unknown_keys_are_rejected() -> None:
    with pytest.raises(ValidationError, match="shard_max_byte"):
        load_config(lake={"shard_max_byte": 1})


def test_bad_endpoint_is_explained() -> None:
    with pytest.raises(ValidationError, match="http://host:port"):
        load_config(store={"endpoint": "minio:9000"})


def test_secret_is_not_printed() -> None:
    config = load_config(store={"secret_key": "hunter2"})
    assert "hunter2" not in repr(config)
    assert config.store.secret_key.get_secret_value() == "hunter2"
