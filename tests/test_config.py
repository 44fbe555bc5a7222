"""The typed configuration: environment and file sources, strictness, validation."""

from __future__ import annotations

import ast
import inspect
import itertools
import os
from pathlib import Path
from types import ModuleType

import pytest
from pydantic import BaseModel

import tide_lib.config
import tide_lib.orchestration.handoff
from tide_lib.config import ConfigError, load_config, load_secret_files


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
    with pytest.raises(ConfigError, match="shard_max_byte"):
        load_config(lake={"shard_max_byte": 1})


def test_bad_endpoint_is_explained() -> None:
    with pytest.raises(ConfigError, match="http://host:port"):
        load_config(store={"endpoint": "minio:9000"})


def test_secret_is_not_printed() -> None:
    config = load_config(store={"secret_key": "hunter2"})
    assert "hunter2" not in repr(config)
    assert config.store.secret_key.get_secret_value() == "hunter2"


def test_no_secret_has_a_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Issue 13: config.py fell back to a hard-coded S3 secret when the variable was unset."""
    monkeypatch.delenv("TIDE_STORE__SECRET_KEY", raising=False)
    monkeypatch.setenv("TIDE_SECRETS_DIR", str(tmp_path / "none"))
    config = load_config()
    assert config.store.secret_key is None
    with pytest.raises(ValueError, match="TIDE_STORE__SECRET_KEY"):
        config.store.secret()
    source = Path(tide_lib.config.__file__).read_text()
    assert "tide-local-secret" not in source


def test_secret_files_are_read_and_the_environment_wins(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A secrets dir (a mounted Kubernetes secret) holds one file per variable."""
    monkeypatch.delenv("TIDE_STORE__SECRET_KEY", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "from-env")
    monkeypatch.setenv("TIDE_SECRETS_DIR", str(tmp_path))
    (tmp_path / "TIDE_STORE__SECRET_KEY").write_text("from-file\n")
    (tmp_path / "MLFLOW_TRACKING_PASSWORD").write_text("also-from-file")
    (tmp_path / "not a variable").write_text("ignored")
    exported = load_secret_files()
    assert exported == ["TIDE_STORE__SECRET_KEY"]
    assert load_config().store.secret() == "from-file"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "from-env"
    monkeypatch.delenv("TIDE_STORE__SECRET_KEY")


def test_stack_generates_missing_secrets_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`tide stack up` has nobody to ask: it generates what is missing, 0600, and reuses it."""
    from tide_lib.stack.secrets import AUTH_SECRETS, ENGINE_SECRETS, ensure_stack_secrets

    generated = ("TIDE_STORE__SECRET_KEY", *ENGINE_SECRETS, *AUTH_SECRETS)
    for name in generated:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TIDE_SECRETS_DIR", str(tmp_path / "secrets"))
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    first = ensure_stack_secrets(load_config())
    files = sorted(p.name for p in (tmp_path / "secrets").iterdir())
    assert files == sorted([*generated, "MLFLOW_TRACKING_USERNAME"])  # a login needs both
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME")
    load_config()  # what a later `tide` command does: it logs in as the stack's user
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "admin"
    assert all(((tmp_path / "secrets" / f).stat().st_mode & 0o077) == 0 for f in files)
    for name in generated:
        monkeypatch.delenv(name)
    again = ensure_stack_secrets(load_config())
    assert again.store.secret() == first.store.secret() and len(first.store.secret()) >= 32
    assert again.stack.airflow_admin_password == first.stack.airflow_admin_password


def test_a_config_error_never_shows_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 13: a section-level check printed the whole section, passwords included, and the
    CLI logged it."""
    monkeypatch.setenv("TIDE_STACK__AIRFLOW_ADMIN_PASSWORD", "pw-never-shown")
    monkeypatch.setenv("TIDE_STACK__EXECUTOR", "CeleryExecutor")  # without a Postgres URL
    monkeypatch.setenv("TIDE_SERVE__API_KEY", "key-never-shown")
    monkeypatch.setenv("TIDE_SERVE__PORT", "not-a-port")
    with pytest.raises(ConfigError) as raised:
        load_config()
    message = str(raised.value)
    assert "stack: Value error, CeleryExecutor needs a PostgreSQL" in message
    assert "serve.port" in message
    assert "never-shown" not in message and raised.value.__cause__ is None


def _documented_fields(module: ModuleType) -> set[tuple[str, str]]:
    """(class, field) of every annotated attribute followed by a docstring in ``module``."""
    documented = set()
    for node in ast.parse(Path(inspect.getfile(module)).read_text()).body:
        if isinstance(node, ast.ClassDef):
            for field, after in itertools.pairwise(node.body):
                if (
                    isinstance(field, ast.AnnAssign)
                    and isinstance(field.target, ast.Name)
                    and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant)
                ):
                    documented.add((node.name, field.target.id))
    return documented


@pytest.mark.parametrize(
    ("module", "at_least"), [(tide_lib.config, 100), (tide_lib.orchestration.handoff, 10)]
)
def test_every_attribute_docstring_is_its_fields_one_line_description(
    module: ModuleType, at_least: int
) -> None:
    """A field's docstring is its description: ``--help``, the trigger form and the JSON
    schema read it, joined into one line. Pydantic reads docstrings from the source, so a
    host that lost it would lose every description without an error."""
    described = set()
    for name, model in vars(module).items():
        if (
            isinstance(model, type)
            and issubclass(model, BaseModel)
            and model.__module__ == module.__name__
        ):
            schema = model.model_json_schema()["properties"]
            for field, info in model.model_fields.items():
                if info.description:
                    described.add((name, field))
                    assert "\n" not in info.description and "  " not in info.description
                    assert schema[field]["description"] == info.description
    documented = _documented_fields(module)
    assert len(documented) > at_least
    assert described == documented
    held_out = tide_lib.config.CycleConfig.model_fields["held_out_percent"].description
    assert held_out == "window requests kept for evaluation"
