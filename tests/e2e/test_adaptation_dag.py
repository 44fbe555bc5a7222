"""tide_adaptation end to end with dag.test(): real S3, real MLflow, two real engines.

Captured Korean traffic -> sensor -> snapshot -> train (queue/pool mi250) -> register
-> evaluate + gate -> promote to both engines -> watermark. Then a rerun of the
finished cycle (dag.test on the same logical date) trains, registers and promotes
nothing new.
"""

from __future__ import annotations

import json
import os
import secrets
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.conftest import TEST_SECRETS
from tests.e2e.conftest import asset_events, dag_test, xcoms
from tests.serving.conftest import engine_metric, start_engine
from tide_lib.config import LakeConfig, TideConfig, load_config
from tide_lib.lake import LakeReader, ObjectStore, target_slug
from tide_lib.orchestration import cycle
from tide_lib.orchestration.handoff import Decision
from tide_lib.registry import CHAMPION, DraftRegistry
from tide_lib.serving.process import EngineProcess
from tide_lib.target_model import load_corpus, render_prompt

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
# The engines' SGLang keys; the fleet client of the promote task sends them.
KEYS = {
    "TIDE_SERVE__API_KEY": secrets.token_urlsafe(16),
    "TIDE_SERVE__ADMIN_API_KEY": secrets.token_urlsafe(16),
}
AUTH = {"Authorization": f"Bearer {KEYS['TIDE_SERVE__API_KEY']}"}


def _wait_until_captures_are_committed(
    engines: list[EngineProcess], stack: TideConfig, prefix: str, requests: int
) -> None:
    """Every request is captured or skipped, and every capture is committed to the lake."""
    store = ObjectStore(stack.store, stack.store.lake_bucket)
    reader = LakeReader(store, LakeConfig(prefix=prefix))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        captured = sum(engine_metric(e, "tide:capture_records_total") for e in engines)
        skipped = sum(
            engine_metric(e, "tide:capture_skipped_total")
            + engine_metric(e, "tide:capture_dropped_records_total")
            for e in engines
        )
        committed = sum(m.num_records for m in reader.list_shards(target_slug("tiny")))
        if captured + skipped >= requests and committed >= captured:
            return
        time.sleep(0.5)
    raise AssertionError(f"captures not committed: {captured=} {skipped=} {committed=}")


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        try:
            return [value, *_strings(json.loads(value))]
        except ValueError:
            return [value]
    if isinstance(value, dict):
        return [s for item in value.items() for s in _strings(list(item))]
    if isinstance(value, list):
        return [s for item in value for s in _strings(item)]
    return []


def _assert_no_secret_left(secret_values: list[str], texts: list[str], folders: list[Path]) -> None:
    """Issue 13: no secret a run was given shows up in what it leaves behind: its task
    logs, XComs, MLflow params, tags and metrics, and every file it wrote."""
    for secret in secret_values:
        assert len(secret) >= 16
        for text in texts:
            assert secret not in text, "a secret leaked into a log, an XCom or MLflow"
        for folder in folders:
            for path in folder.rglob("*"):
                if path.is_file() and path.name != "passwords.json":
                    assert secret.encode() not in path.read_bytes(), f"a secret is in {path}"


def _mlflow_texts(registry: DraftRegistry) -> list[str]:
    experiment = registry.client.get_experiment_by_name(registry.name)
    runs = registry.client.search_runs([experiment.experiment_id])
    versions = registry.client.search_model_versions(f"name = '{registry.name}'")
    return [json.dumps(run.data.to_dictionary(), default=str) for run in runs] + [
        json.dumps(dict(version.tags or {})) for version in versions
    ]


def _assert_no_local_path(values: dict[str, object], local_roots: list[Path]) -> None:
    """No XCom of the run names a file of the host it ran on (tasks run on other hosts)."""
    tasks = {key.split("/")[0] for key in values}
    expected = {"snapshot", "train", "register", "evaluate", "promote", "advance_watermark"}
    assert expected <= tasks, sorted(tasks)
    roots = [str(root) for root in local_roots] + [str(Path.cwd()), ".tide/", "/tmp/"]
    for key, value in values.items():
        for text in _strings(value):
            assert not text.startswith(("/", "./", "~")), f"{key} hands over a path: {text}"
            assert not any(root in text for root in roots), f"{key} hands over a path: {text}"
    train = (
        json.loads(values["train/return_value"])
        if isinstance(values["train/return_value"], str)
        else values["train/return_value"]
    )
    assert isinstance(train, dict) and train["draft_uri"].startswith("models:/m-")


def _connections_only(airflow_env: dict[str, str], stack: TideConfig, tmp_path: Path) -> dict:
    """The Airflow environment with S3 and MLflow given only as Airflow connections."""
    env = {
        name: value
        for name, value in airflow_env.items()
        if not name.startswith(("TIDE_STORE__", "TIDE_MLFLOW__", "MLFLOW_TRACKING_"))
    }
    env["TIDE_SECRETS_DIR"] = str(tmp_path / "no-secret-files")  # no TIDE_STORE__* from files
    env["AIRFLOW_CONN_TIDE_STORE"] = json.dumps(
        {
            "conn_type": "aws",
            "login": stack.store.access_key,
            "password": stack.store.secret(),
            "extra": {"endpoint_url": stack.store.endpoint, "region_name": stack.store.region},
        }
    )
    mlflow = urlparse(stack.mlflow.tracking_uri)
    env["AIRFLOW_CONN_TIDE_MLFLOW"] = json.dumps(
        {
            "conn_type": "http",
            "host": mlflow.hostname,
            "port": mlflow.port,
            "login": os.environ["MLFLOW_TRACKING_USERNAME"],
            "password": os.environ["MLFLOW_TRACKING_PASSWORD"],
        }
    )
    return env


@pytest.mark.timeout(1800)  # first user of the session's stack: its setup counts here too
def test_adaptation_cycle_promotes_a_new_champion(
    stack: TideConfig,
    tiny_target: Path,
    tiny_drafts: dict[str, Path],
    tmp_path: Path,
    airflow_env: dict[str, str],
) -> None:
    prefix = f"e2e-{uuid.uuid4().hex[:6]}"
    engines: list[EngineProcess] = []
    try:
        draft = [
            "--speculative-draft-model-path",
            str(tiny_drafts["en"]),
            "--speculative-num-steps",
            "3",
        ]
        for _ in range(2):
            engines.append(
                start_engine(
                    tmp_path,
                    tiny_target,
                    *draft,
                    "--served-model-name",
                    "tiny",
                    stack=stack,
                    capture=True,
                    prefix=prefix,
                    env=KEYS,
                )
            )
        prompts = [render_prompt(doc.turns[0]) for doc in load_corpus().domain("ko_chat")[:24]]
        for index, prompt in enumerate(prompts):
            response = httpx.post(
                f"{engines[index % 2].url}/generate",
                json={"text": prompt, "sampling_params": {"max_new_tokens": 16}},
                headers=AUTH,
                timeout=120,
            )
            assert response.status_code == 200
        _wait_until_captures_are_committed(engines, stack, prefix, requests=len(prompts))

        env = {
            **_connections_only(airflow_env, stack, tmp_path),
            "TIDE_LAKE__PREFIX": prefix,
            "TIDE_LAKE__SPOOL_DIR": str(tmp_path / "dag-spool"),
            "TIDE_LAKE__COMMIT_SETTLE_S": "1",
            "TIDE_CYCLE__TARGET_ID": "tiny",
            "TIDE_CYCLE__TARGET_PATH": str(tiny_target),
            "TIDE_CYCLE__MIN_NEW_TOKENS": "200",
            "TIDE_CYCLE__SERVERS": json.dumps([engine.url for engine in engines]),
            "TIDE_TRAINING__STEPS": "20",
            "TIDE_TRAINING__TTT_LENGTH": "3",
            "TIDE_TRAINING__DRAFT_VOCAB_SIZE": "512",
            "TIDE_TRAINING__LEARNING_RATE": "0.003",
            "TIDE_GATE__K": "3",
            **KEYS,
        }
        logical_date = "2026-11-01T00:00:00+00:00"
        outcome = dag_test(env, "tide_adaptation", tmp_path, logical_date=logical_date)
        # Issue 15: S3 and MLflow were configured only through Airflow connections.
        for conn_id in ("tide_store", "tide_mlflow"):
            assert f"from Airflow connection '{conn_id}'" in outcome["output"]

        config = load_config(
            store=stack.store.model_dump(),
            mlflow={"tracking_uri": stack.mlflow.tracking_uri},
            lake={"prefix": prefix, "spool_dir": tmp_path / "check-spool", "commit_settle_s": 1},
            cycle={
                "target_id": "tiny",
                "target_path": tiny_target,
                "servers": [e.url for e in engines],
            },
        )
        registry = DraftRegistry(stack.mlflow.tracking_uri, "tiny")
        champion = registry.alias(CHAMPION)
        assert champion is not None and champion.tags["tide.gate.decision"] == "promote"
        assert champion.tags["tide.cycle_id"] == outcome["run_id"]
        for engine in engines:
            served = httpx.get(f"{engine.url}/get_weight_version", headers=AUTH).json()
            served = served["weight_version"]
            assert served == f"{registry.name}-v{champion.version}"
        snapshot = cycle.snapshot_window(config, outcome["run_id"])
        assert cycle.read_watermark(config) == snapshot.watermark_after
        # Issue 15: the window, the new version and the champion are asset events.
        events = {
            e["asset"]: e for e in asset_events(airflow_env, "tide_adaptation", outcome["run_id"])
        }
        assert set(events) == {"tide_lake_tiny", "tide_draft_tiny", "tide_draft_tiny_champion"}
        assert events["tide_lake_tiny"]["extra"]["window_tokens"] == snapshot.window_tokens
        assert events["tide_draft_tiny"]["extra"]["version"] == champion.version
        assert events["tide_draft_tiny_champion"]["extra"]["version"] == champion.version
        assert events["tide_draft_tiny_champion"]["uri"] == "models:/tide-draft-tiny@champion"
        assert {e["extra"]["target_id"] for e in events.values()} == {"tiny"}
        _assert_no_local_path(
            xcoms(airflow_env, "tide_adaptation", outcome["run_id"]), [tmp_path, tiny_target]
        )
        assert cycle.new_tokens(config) == 0
        _assert_no_secret_left(
            [os.environ[name] for name in TEST_SECRETS] + list(KEYS.values()),
            [
                outcome["output"],
                json.dumps(xcoms(airflow_env, "tide_adaptation", outcome["run_id"]), default=str),
                *_mlflow_texts(registry),
            ],
            [tmp_path, Path(airflow_env["AIRFLOW_HOME"])],
        )

        experiment = registry.client.get_experiment_by_name(registry.name)
        runs_before = registry.client.search_runs([experiment.experiment_id])

        # Rerun the finished cycle (what "Clear" does in the UI): same run, same window,
        # no new training run, no second version, no second promotion.
        rerun = dag_test(env, "tide_adaptation", tmp_path, logical_date=logical_date)
        assert rerun["run_id"] == outcome["run_id"]
        versions = registry.client.search_model_versions(f"name = '{registry.name}'")
        assert [v.version for v in versions] == [champion.version]
        assert registry.alias(CHAMPION) == champion  # same version, same tags
        assert len(registry.client.search_runs([experiment.experiment_id])) == len(runs_before)
        for engine in engines:
            served = httpx.get(f"{engine.url}/get_weight_version", headers=AUTH).json()
            served = served["weight_version"]
            assert served == f"{registry.name}-v{champion.version}"
        assert cycle.read_watermark(config) == snapshot.watermark_after

        # Once a later cycle has moved on, the old version is not promoted again.
        registry.client.delete_registered_model_alias(registry.name, CHAMPION)
        decision = Decision(promote=True, reason="rerun", challenger={}, champion=None)
        again = cycle.promote(config, champion.version, decision)
        assert again.promoted is False and "promoted before" in again.reason
    finally:
        for engine in engines:
            engine.stop()
