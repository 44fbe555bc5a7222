"""Inside DAG tasks the store and MLflow come from Airflow connections, else from TIDE_*."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tide_lib.config import ConfigError, load_config
from tide_lib.lake.store import ObjectStore
from tide_lib.orchestration.params import config_from_params

# Every variable a connection may set: monkeypatch restores them after each test.
_TOUCHED = (
    "TIDE_STORE__ENDPOINT",
    "TIDE_STORE__REGION",
    "TIDE_STORE__CA_BUNDLE",
    "TIDE_STORE__ACCESS_KEY",
    "TIDE_STORE__SECRET_KEY",
    "TIDE_STORE__SESSION_TOKEN",
    "TIDE_MLFLOW__TRACKING_URI",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
)


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    secrets = tmp_path / "secrets"  # a real secrets dir: a stale token file waits in it
    secrets.mkdir()
    (secrets / "TIDE_STORE__SESSION_TOKEN").write_text("stale-file-token")
    monkeypatch.setenv("TIDE_SECRETS_DIR", str(secrets))
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "airflow"))
    for name in _TOUCHED:
        monkeypatch.setenv(name, "from-env")
    monkeypatch.delenv("TIDE_STORE__SESSION_TOKEN")
    monkeypatch.delenv("TIDE_STORE__CA_BUNDLE")
    monkeypatch.setenv("TIDE_STORE__ENDPOINT", "http://env-store:8333")
    monkeypatch.setenv("TIDE_STORE__REGION", "env-region")
    monkeypatch.setenv("TIDE_MLFLOW__TRACKING_URI", "http://env-mlflow:5000")
    monkeypatch.setenv("TIDE_STORE__LAKE_BUCKET", "env-lake")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "ambient-aws-key")  # never picked up
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "ambient-aws-secret")
    return monkeypatch


def _aws(monkeypatch: pytest.MonkeyPatch, conn_id: str = "tide_store", **fields: object) -> None:
    connection: dict[str, object] = {"conn_type": "aws", "login": "conn-key"}
    connection["password"] = "conn-secret-1"
    connection.update(fields)
    extra = connection.pop("extra", {})
    connection["extra"] = {"endpoint_url": "https://objects.example:9000", **extra}  # type: ignore[dict-item]
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(connection))


def _http(monkeypatch: pytest.MonkeyPatch, **fields: object) -> None:
    connection = {"conn_type": "http", "host": "mlflow.example", "port": 5443, **fields}
    monkeypatch.setenv("AIRFLOW_CONN_TIDE_MLFLOW", json.dumps(connection))


def test_a_defined_connection_wins_for_what_it_carries_and_the_rest_stays(
    environment: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ca = tmp_path / "ca.pem"
    _aws(environment, extra={"region_name": "eu-central-1", "verify": str(ca)})
    _http(environment, schema="https", login="tide-bot", password="mlflow-pass-1")
    config = config_from_params({})
    assert config.store.endpoint == "https://objects.example:9000"
    assert config.store.region == "eu-central-1"
    assert config.store.access_key == "conn-key" and config.store.secret() == "conn-secret-1"
    assert config.store.session_token is None  # static keys: not the stale token file's
    assert config.store.ca_bundle == ca
    assert config.store.lake_bucket == "env-lake"  # not carried by the connection
    assert config.mlflow.tracking_uri == "https://mlflow.example:5443"
    # exported for what the task starts, and a child process reads the same settings
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "tide-bot"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "mlflow-pass-1"
    assert os.environ["TIDE_STORE__SESSION_TOKEN"] == ""  # removed: the file cannot return
    child = load_config()
    assert child.store.session_token is None and child.store.secret() == "conn-secret-1"


def test_without_connections_the_environment_alone_counts(
    environment: pytest.MonkeyPatch,
) -> None:
    config = config_from_params({})
    assert config.store.endpoint == "http://env-store:8333"
    assert config.store.secret() == "from-env"
    assert config.mlflow.tracking_uri == "http://env-mlflow:5000"


def test_a_connection_without_credentials_keeps_tide_keys_and_ignores_ambient_aws(
    environment: pytest.MonkeyPatch,
) -> None:
    _aws(environment, login=None, password=None)
    config = config_from_params({})
    assert config.store.endpoint == "https://objects.example:9000"
    assert (config.store.access_key, config.store.secret()) == ("from-env", "from-env")


def test_a_trigger_reads_the_connection_without_touching_the_shared_environment(
    environment: pytest.MonkeyPatch,
) -> None:
    _aws(environment)
    _http(environment, login="tide-bot", password="mlflow-pass-1")
    config = config_from_params({}, export=False)
    assert config.store.secret() == "conn-secret-1"
    assert config.mlflow.tracking_uri == "http://mlflow.example:5443"
    assert os.environ["TIDE_STORE__SECRET_KEY"] == "from-env"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "from-env"


def test_an_mlflow_connection_is_the_whole_server_login_included(
    environment: pytest.MonkeyPatch,
) -> None:
    _http(environment)  # no login: anonymous, the environment's password is not sent there
    config_from_params({})
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == os.environ["MLFLOW_TRACKING_PASSWORD"] == ""


def test_an_empty_connection_id_turns_the_connection_off(
    environment: pytest.MonkeyPatch,
) -> None:
    _aws(environment)
    environment.setenv("TIDE_STORE__AIRFLOW_CONN_ID", "")
    assert config_from_params({}).store.endpoint == "http://env-store:8333"
    environment.setenv("TIDE_STORE__AIRFLOW_CONN_ID", "other_store")
    _aws(environment, conn_id="other_store")
    assert config_from_params({}).store.endpoint == "https://objects.example:9000"


def test_temporary_credentials_carry_their_session_token_to_the_s3_client(
    environment: pytest.MonkeyPatch,
) -> None:
    _aws(environment, extra={"aws_session_token": "conn-session-token"})
    config = config_from_params({})
    assert config.store.session_token is not None
    assert config.store.session_token.get_secret_value() == "conn-session-token"
    credentials = ObjectStore(config.store, "bucket")._client._provider.retrieve()
    assert (credentials.access_key, credentials.session_token) == ("conn-key", "conn-session-token")


def test_the_ca_bundle_reaches_the_s3_client(environment: pytest.MonkeyPatch) -> None:
    bundle = Path("/etc/ssl/certs/ca-certificates.crt")
    _aws(environment, extra={"verify": str(bundle)})
    store = ObjectStore(config_from_params({}).store, "bucket")
    pool = store._client._http.connection_pool_kw
    assert pool["ca_certs"] == str(bundle) and pool["cert_reqs"] == "CERT_REQUIRED"


@pytest.mark.parametrize("verify", [False, "false", "0"])
def test_turning_tls_verification_off_is_refused_with_the_fix(
    environment: pytest.MonkeyPatch, verify: object
) -> None:
    _aws(environment, extra={"verify": verify})
    with pytest.raises(ConfigError, match="CA bundle"):
        config_from_params({})


def test_the_tracking_uri_from_an_http_connection(environment: pytest.MonkeyPatch) -> None:
    _http(environment, host="")
    with pytest.raises(ConfigError, match="no host"):
        config_from_params({})
    for fields, uri in [
        ({"host": "https://mlflow.example/prefix", "port": None}, "https://mlflow.example/prefix"),
        ({"host": "https://mlflow.example", "port": 8443}, "https://mlflow.example:8443"),
        ({"schema": "HTTPS"}, "https://mlflow.example:5443"),
    ]:
        _http(environment, **fields)
        assert config_from_params({}).mlflow.tracking_uri == uri
