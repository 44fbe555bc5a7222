"""Inside DAG tasks the store and MLflow come from Airflow connections, else from TIDE_*."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tide_lib.config import ConfigError
from tide_lib.lake.store import ObjectStore
from tide_lib.orchestration.params import config_from_params

# Every variable a connection may set or remove: monkeypatch restores them after each test.
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
    monkeypatch.setenv("TIDE_SECRETS_DIR", str(tmp_path / "no-secrets"))
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "airflow"))
    for name in _TOUCHED:
        monkeypatch.setenv(name, "from-env")
    monkeypatch.setenv("TIDE_STORE__ENDPOINT", "http://env-store:8333")
    monkeypatch.setenv("TIDE_STORE__SESSION_TOKEN", "stale-token")
    monkeypatch.setenv("TIDE_STORE__CA_BUNDLE", str(tmp_path / "env-ca.pem"))
    monkeypatch.setenv("TIDE_STORE__REGION", "env-region")
    monkeypatch.setenv("TIDE_MLFLOW__TRACKING_URI", "http://env-mlflow:5000")
    monkeypatch.setenv("TIDE_STORE__LAKE_BUCKET", "env-lake")
    return monkeypatch


def _aws(monkeypatch: pytest.MonkeyPatch, conn_id: str = "tide_store", **extra: object) -> None:
    connection = {
        "conn_type": "aws",
        "login": "conn-key",
        "password": "conn-secret-1",
        "extra": {"endpoint_url": "https://objects.example:9000", **extra},
    }
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(connection))


def _http(monkeypatch: pytest.MonkeyPatch, **fields: object) -> None:
    connection = {"conn_type": "http", "host": "mlflow.example", "port": 5443, **fields}
    monkeypatch.setenv("AIRFLOW_CONN_TIDE_MLFLOW", json.dumps(connection))


def test_a_defined_connection_wins_for_what_it_carries_and_the_rest_stays(
    environment: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ca = tmp_path / "ca.pem"
    _aws(environment, region_name="eu-central-1", verify=str(ca))
    _http(environment, schema="https", login="tide-bot", password="mlflow-pass-1")
    config = config_from_params({})
    assert config.store.endpoint == "https://objects.example:9000"
    assert config.store.region == "eu-central-1"
    assert config.store.access_key == "conn-key" and config.store.secret() == "conn-secret-1"
    assert config.store.session_token is None  # static keys: the stale token is gone
    assert config.store.ca_bundle == ca
    assert config.store.lake_bucket == "env-lake"  # not carried by the connection
    assert config.mlflow.tracking_uri == "https://mlflow.example:5443"
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "tide-bot"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "mlflow-pass-1"


def test_without_connections_the_environment_alone_counts(
    environment: pytest.MonkeyPatch,
) -> None:
    config = config_from_params({})
    assert config.store.endpoint == "http://env-store:8333"
    assert config.store.secret() == "from-env"
    assert config.mlflow.tracking_uri == "http://env-mlflow:5000"


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
    _aws(environment, aws_session_token="conn-session-token")
    config = config_from_params({})
    assert config.store.session_token is not None
    assert config.store.session_token.get_secret_value() == "conn-session-token"
    credentials = ObjectStore(config.store, "bucket")._client._provider.retrieve()
    assert (credentials.access_key, credentials.session_token) == ("conn-key", "conn-session-token")


def test_the_ca_bundle_reaches_the_s3_client(environment: pytest.MonkeyPatch) -> None:
    bundle = Path("/etc/ssl/certs/ca-certificates.crt")
    _aws(environment, verify=str(bundle))
    store = ObjectStore(config_from_params({}).store, "bucket")
    pool = store._client._http.connection_pool_kw
    assert pool["ca_certs"] == str(bundle) and pool["cert_reqs"] == "CERT_REQUIRED"


def test_turning_tls_verification_off_is_refused_with_the_fix(
    environment: pytest.MonkeyPatch,
) -> None:
    _aws(environment, verify=False)
    with pytest.raises(ConfigError, match="CA bundle"):
        config_from_params({})


def test_an_mlflow_connection_without_a_host_is_refused(environment: pytest.MonkeyPatch) -> None:
    _http(environment, host="")
    with pytest.raises(ConfigError, match="no host"):
        config_from_params({})
    _http(environment, host="https://mlflow.example/prefix", port=None)
    assert config_from_params({}).mlflow.tracking_uri == "https://mlflow.example/prefix"
