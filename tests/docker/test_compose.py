"""The production compose file is validated here (no Docker engine on CI machines)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

DOCKER = Path(__file__).resolve().parents[2] / "docker"


def _compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_every_service_has_an_image_or_a_buildable_dockerfile() -> None:
    for name, service in _compose()["services"].items():
        assert "image" in service or "build" in service, name
        if "build" in service:
            dockerfile = DOCKER / service["build"]["context"] / service["build"]["dockerfile"]
            assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
            assert "mlflow==3.17.2" in dockerfile.read_text()


def test_dependencies_name_existing_services() -> None:
    services = _compose()["services"]
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown {dependency}"


def test_no_credentials_are_written_in_the_file() -> None:
    text = (DOCKER / "compose.yaml").read_text()
    for key in re.findall(r"(?:PASSWORD|SECRET_KEY|ACCESS_KEY_ID|ROOT_USER):\s+(\S+)", text):
        assert key.startswith("${"), f"hard-coded credential {key!r}"
    example = (DOCKER / ".env.example").read_text()
    for variable in set(re.findall(r"\$\{(TIDE_[A-Z0-9_]+)", text)):
        assert f"{variable}=" in example, f"{variable} is not documented in .env.example"


def test_mlflow_keeps_artifacts_in_the_object_store() -> None:
    mlflow = _compose()["services"]["mlflow"]
    assert "--artifacts-destination s3://tide-mlflow" in mlflow["command"]
    assert mlflow["environment"]["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
