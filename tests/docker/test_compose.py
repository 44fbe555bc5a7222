"""The production deployment (docker/) is checked here against the tested topology.

No Docker engine runs on CI machines: the compose file is read as YAML and, where a
Compose binary is installed, validated by ``docker compose config``; the Helm values are
read as YAML. ``tests/multihost/topology.py`` is the reference for hosts, services and
the variable names each role reads.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.multihost.topology import AIRFLOW_ENV, ENGINE_ENV, HOSTS, TIDE_ENV, TRAINER_ENV
from tide_lib.serving.fleet import sglang_launch_args
from tide_lib.serving.sglang_api import SUPPORTED_SGLANG_VERSIONS

DOCKER = Path(__file__).resolve().parents[2] / "docker"
COMPOSE_FILE = DOCKER / "compose.yaml"
ENV_EXAMPLE = DOCKER / ".env.example"
HELM_VALUES = DOCKER / "helm" / "values-celery.yaml"

# An interpolated variable, `${NAME}` or `${NAME:?message}`; `$${...}` is an escaped `$`.
INTERPOLATION = re.compile(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)")
SECRET_NAME = re.compile(r"PASSWORD|SECRET|ACCESS_KEY|FERNET|JWT")


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())  # type: ignore[no-any-return]


def _services() -> dict[str, dict[str, Any]]:
    return _compose()["services"]  # type: ignore[no-any-return]


def _environment(service: dict[str, Any]) -> dict[str, str]:
    environment = service.get("environment", {})
    if isinstance(environment, list):
        return dict(item.split("=", 1) for item in environment)
    return {key: str(value) for key, value in environment.items()}


def _argv(value: Any) -> str:
    return " ".join(value) if isinstance(value, list) else str(value or "")


def _example_variables() -> set[str]:
    return {
        line.split("=", 1)[0]
        for line in ENV_EXAMPLE.read_text().splitlines()
        if "=" in line and not line.lstrip().startswith("#")
    }


def _dockerfile(service: dict[str, Any]) -> Path:
    build = service["build"]
    return DOCKER / build["context"] / build.get("dockerfile", "Dockerfile")


def _roles() -> dict[str, tuple[str, ...]]:
    """Each topology service -> the variable names its role reads (topology.py)."""
    required: dict[str, tuple[str, ...]] = {}
    for host, services in HOSTS.items():
        for name in services:
            if host in {"control", "trainer"}:
                required[name] = TIDE_ENV + AIRFLOW_ENV
            elif host.startswith("engine"):
                required[name] = TIDE_ENV + ENGINE_ENV
            else:
                required[name] = ()
            if host == "trainer":
                required[name] += TRAINER_ENV
    return required


# --- the topology --------------------------------------------------------------------


def test_every_topology_service_runs_on_its_host() -> None:
    services = _services()
    for host, names in HOSTS.items():
        for name in names:
            assert name in services, f"{name} ({host}) is missing from compose.yaml"
            assert services[name].get("labels", {}).get("tide.host") == host, (
                f"{name}: label tide.host should be {host!r}"
            )


def test_helper_services_are_one_shot_and_placed_on_a_host() -> None:
    in_topology = {name for names in HOSTS.values() for name in names}
    for name, service in _services().items():
        if name in in_topology:
            continue
        assert service.get("labels", {}).get("tide.host") in HOSTS, f"{name}: no host"
        assert service.get("restart", "no") == "no", f"{name}: a helper must run once"


def test_each_service_reads_the_variables_of_its_role() -> None:
    services = _services()
    for name, variables in _roles().items():
        missing = set(variables) - set(_environment(services[name]))
        assert not missing, f"{name} lacks {sorted(missing)}"


def test_tide_processes_agree_on_store_mlflow_and_fleet() -> None:
    services = _services()
    tide_services = [name for name, variables in _roles().items() if variables]
    for variable in TIDE_ENV:
        values = {_environment(services[name])[variable] for name in tide_services}
        if variable != "TIDE_SCRATCH_DIR":
            assert len(values) == 1, f"{variable} differs between services: {values}"
    airflow = [name for name in tide_services if name.startswith("airflow-")]
    for variable in AIRFLOW_ENV:
        values = {_environment(services[name])[variable] for name in airflow}
        assert len(values) == 1, f"{variable} differs between Airflow services: {values}"
    servers = json.loads(_environment(services["airflow-scheduler"])["TIDE_CYCLE__SERVERS"])
    engines = [name for host, names in HOSTS.items() if host.startswith("engine") for name in names]
    assert servers == [f"http://{name}:30000" for name in engines]


# --- credentials ---------------------------------------------------------------------


def test_no_credentials_are_written_in_the_file() -> None:
    text = COMPOSE_FILE.read_text()
    for key in re.findall(r"(?:PASSWORD|SECRET_KEY|ACCESS_KEY_ID|ROOT_USER):\s+(\S+)", text):
        assert key.startswith("${"), f"hard-coded credential {key!r}"
    for name, service in _services().items():
        for key, value in _environment(service).items():
            names_a_secret = SECRET_NAME.search(key) and not key.endswith("_FILE")
            if names_a_secret or ("://" in value and "@" in value):
                assert INTERPOLATION.search(value), f"{name}: {key} is not read from .env"


def test_every_interpolated_variable_is_documented() -> None:
    example = _example_variables()
    for variable in set(INTERPOLATION.findall(COMPOSE_FILE.read_text())):
        assert variable in example, f"{variable} is not documented in .env.example"


def test_no_secret_reaches_a_command_line() -> None:
    secrets = {name for name in _example_variables() if SECRET_NAME.search(name)}
    assert {"TIDE_POSTGRES_PASSWORD", "TIDE_S3_SECRET_KEY", "TIDE_MLFLOW_ADMIN_PASSWORD"} <= secrets
    for name, service in _services().items():
        for field in ("command", "entrypoint"):
            argv = _argv(service.get(field))
            leaked = set(INTERPOLATION.findall(argv)) & secrets
            assert not leaked, f"{name}: {field} carries {sorted(leaked)}"
            assert "--api-key" not in argv and "--password" not in argv, f"{name}: {field}"
    mlflow = _services()["mlflow"]
    assert "--backend-store-uri" not in _argv(mlflow["command"])
    assert "MLFLOW_BACKEND_STORE_URI" in _environment(mlflow)


def test_logins_are_on_in_production() -> None:
    """Issue 13: the production-shaped stack used the all-admins airflow.cfg and an MLflow
    without auth. Airflow has users with passwords (from .env, via a file), MLflow basic auth."""
    services = _services()
    for name in (n for names in HOSTS.values() for n in names if n.startswith("airflow-")):
        env = _environment(services[name])
        assert env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS"] == "False", name
        assert "admin:admin" in env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"], name
        assert env["MLFLOW_TRACKING_PASSWORD"].startswith("${"), name
    passwords = _environment(services["airflow-api-server"])[
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"
    ]
    init = services["airflow-init"]
    assert "SIMPLE_AUTH_MANAGER_PASSWORDS_FILE" in _argv(init["command"])
    assert {"AIRFLOW_ADMIN_PASSWORD", "AIRFLOW_VIEWER_PASSWORD"} <= set(_environment(init))
    assert passwords.startswith("/opt/airflow/auth/")
    mlflow = services["mlflow"]
    assert "--app-name basic-auth" in _argv(mlflow["command"])
    assert _environment(mlflow)["MLFLOW_AUTH_ADMIN_PASSWORD"].startswith("${")
    assert "mlflow-auth.ini" in _dockerfile(mlflow).read_text()
    ini = (DOCKER / "mlflow-auth.ini").read_text()
    assert "admin_password" not in ini


def test_mlflow_keeps_artifacts_in_the_object_store() -> None:
    mlflow = _services()["mlflow"]
    assert "--artifacts-destination s3://tide-mlflow" in mlflow["command"]
    assert _environment(mlflow)["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"


# --- images --------------------------------------------------------------------------


def test_every_service_has_an_image_or_a_buildable_dockerfile() -> None:
    for name, service in _services().items():
        assert "image" in service or "build" in service, name
        if "build" in service:
            assert _dockerfile(service).is_file(), f"{name}: {_dockerfile(service)} missing"


def test_dockerfiles_install_the_tested_pins() -> None:
    services = _services()
    assert "mlflow[auth]==3.17.2" in _dockerfile(services["mlflow"]).read_text()
    airflow = _dockerfile(services["airflow-scheduler"]).read_text()
    trainer = _dockerfile(services["airflow-worker-mi250"]).read_text()
    engine = _dockerfile(services["engine-1"]).read_text()
    for text in (airflow, trainer):  # the pyproject extras at the tested pins
        assert '-c constraints.txt ".[airflow,train]"' in text.replace("/tmp/", "")
        assert "requirements-nodeps.txt" in text  # SpecForge, --no-deps
    assert re.search(r"^ARG ROCM_PYTORCH_IMAGE=rocm/pytorch:\S+py3\.11", trainer, re.M)
    assert "torchrun" in trainer
    image = re.search(r"^ARG SGLANG_IMAGE=lmsysorg/sglang:v(\S+)$", engine, re.M)
    assert image is not None and image.group(1) in SUPPORTED_SGLANG_VERSIONS
    assert "detect(SourceTree.installed())" in engine and "sglang.srt.plugins" in engine
    airflow_services = [n for n in services if n.startswith("airflow-") and n != "airflow-init"]
    for name in airflow_services:
        expected = "trainer" if name == "airflow-worker-mi250" else "airflow"
        assert _dockerfile(services[name]).name == f"{expected}.Dockerfile", name


def test_dependencies_name_existing_services() -> None:
    services = _services()
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown {dependency}"


# --- workers, pool, engines ----------------------------------------------------------


def test_celery_workers_serve_their_queues() -> None:
    services = _services()
    assert "--queues default" in _argv(services["airflow-worker-default"]["command"])
    mi250 = services["airflow-worker-mi250"]
    assert "--queues mi250" in _argv(mi250["command"])
    assert {"/dev/kfd", "/dev/dri"} <= set(mi250["devices"])
    assert "video" in mi250["group_add"]


def test_the_mi250_pool_is_created_at_deploy_time() -> None:
    pools = json.loads((DOCKER / "pools.json").read_text())
    mi250 = pools["mi250"]
    assert mi250["slots"] >= 1 and mi250["description"]  # `airflow pools import` format
    services = _services()
    init = services["airflow-init"]
    assert "airflow db migrate" in _argv(init["command"])
    target = "/opt/tide/docker/pools.json"
    assert f"airflow pools import {target}" in _argv(init["command"])
    assert f"./pools.json:{target}:ro" in init["volumes"]
    for name in (n for names in HOSTS.values() for n in names if n.startswith("airflow-")):
        dependency = services[name]["depends_on"]["airflow-init"]
        assert dependency["condition"] == "service_completed_successfully", name


def test_engines_launch_like_the_fleet_launcher() -> None:
    def options(argv: list[str]) -> dict[str, str | None]:
        parsed: dict[str, str | None] = {}
        for index, item in enumerate(argv):
            if item.startswith("--"):
                following = argv[index + 1] if index + 1 < len(argv) else "--"
                parsed[item] = None if following.startswith("--") else following
        return parsed

    expected = options(sglang_launch_args("TARGET", "DRAFT", host="0.0.0.0", port=30000))
    for host, names in HOSTS.items():
        if not host.startswith("engine"):
            continue
        for name in names:
            service = _services()[name]
            command = [str(item) for item in service["command"]]
            assert command[1:3] == ["-m", "sglang.launch_server"], name
            got = options(command)
            # a key on a command line shows in `ps`: sglang_launch_args(key_file=) uses --config
            assert not {"--api-key", "--admin-api-key"} & set(got), f"{name}: key in argv"
            for option, value in expected.items():
                assert option in got, f"{name}: {option} missing"
                if value not in {"TARGET", "DRAFT"}:
                    assert got[option] == value, f"{name}: {option} {got[option]} != {value}"
            assert _environment(service)["TIDE_SGLANG_CAPTURE"] == "1"
            assert _dockerfile(service).name == "engine.Dockerfile"


# --- Helm ------------------------------------------------------------------------------


def test_helm_values_mirror_the_compose_workers() -> None:
    values = yaml.safe_load(HELM_VALUES.read_text())
    assert values["executor"] == "CeleryExecutor"
    celery = values["workers"]["celery"]
    assert celery["enableDefault"] is True and celery["queue"] == "default"
    (mi250,) = [worker for worker in celery["sets"] if worker["queue"] == "mi250"]
    assert "--queues mi250" in _argv(mi250["args"])
    assert mi250["resources"]["limits"]["amd.com/gpu"] >= 1
    assert set(TRAINER_ENV) <= {item["name"] for item in mi250["env"]}
    names = {item["name"] for item in values["env"]} | {i["envName"] for i in values["secret"]}
    tide_names = {name for name in TIDE_ENV + AIRFLOW_ENV if name.startswith("TIDE_")}
    assert tide_names <= names, f"missing {sorted(tide_names - names)}"
    assert "pools import" in _argv(values["migrateDatabaseJob"]["args"])


# --- docker compose config -------------------------------------------------------------


def _compose_command() -> list[str] | None:
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run(
            [docker, "compose", "version"], capture_output=True, timeout=60, check=False
        )
        if probe.returncode == 0:
            return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def _run_config(env_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    compose = _compose_command()
    if compose is None:
        pytest.skip(
            "no Compose binary: install the docker compose v2 plugin, or "
            "`apt-get install docker-compose` (1.29 validates this file too)"
        )
    # Interpolation prefers the process environment: keep ours out of it.
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("TIDE_", "COMPOSE_"))}
    return subprocess.run(
        [*compose, "--env-file", str(env_file), "-f", str(COMPOSE_FILE), "config", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=environ,
    )


def test_docker_compose_config_validates_with_the_example_env(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    shutil.copy(ENV_EXAMPLE, env_file)
    checked = _run_config(env_file, "-q")
    assert checked.returncode == 0, checked.stderr
    listed = _run_config(env_file, "--services")
    assert listed.returncode == 0, listed.stderr
    assert set(listed.stdout.split()) == set(_services())


def test_docker_compose_config_refuses_a_missing_secret(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    lines = ENV_EXAMPLE.read_text().splitlines()
    env_file.write_text(
        "\n".join(line for line in lines if not line.startswith("TIDE_POSTGRES_PASSWORD="))
    )
    refused = _run_config(env_file, "-q")
    assert refused.returncode != 0
    assert "TIDE_POSTGRES_PASSWORD" in refused.stderr + refused.stdout


def test_engines_take_their_keys_through_a_file(tmp_path: Path) -> None:
    """Issue 13: engines ran without keys (SGLang reads them from argv only); the compose
    engines' entrypoint writes them into SGLang's --config YAML and execs the server."""
    for host, names in HOSTS.items():
        for name in names if host.startswith("engine") else ():
            service = _services()[name]
            assert service["entrypoint"][-1] == "tide_lib.serving.launch_with_keys", name
            env = _environment(service)
            assert {"TIDE_SERVE__API_KEY", "TIDE_SERVE__ADMIN_API_KEY"} <= set(env), name
    keys = {"TIDE_SERVE__API_KEY": "k" * 20, "TIDE_SERVE__ADMIN_API_KEY": "a" * 20}
    key_file = tmp_path / "keys.yaml"
    shown = tmp_path / "argv.json"
    script = f"import json, sys; json.dump(sys.argv[1:], open({str(shown)!r}, 'w'))"
    subprocess.run(
        [sys.executable, "-m", "tide_lib.serving.launch_with_keys", sys.executable, "-c", script],
        env={**os.environ, **keys, "TIDE_SGLANG_KEY_FILE": str(key_file)},
        check=True,
        timeout=120,
    )
    argv = json.loads(shown.read_text())
    assert argv == ["--config", str(key_file)]
    assert yaml.safe_load(key_file.read_text()) == {"api-key": "k" * 20, "admin-api-key": "a" * 20}
    assert key_file.stat().st_mode & 0o077 == 0
