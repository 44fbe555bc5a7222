"""Shared fixtures: one real local stack (SeaweedFS S3 + MLflow) per test session."""

from __future__ import annotations

import os
import secrets
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tide_lib.config import LakeConfig, TideConfig, load_config
from tide_lib.lake import CapturedRecord, ObjectStore
from tide_lib.stack import StackManager, free_ports

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The session's secrets, fresh per session and given as production gives them: in the
# environment (there are no defaults in code). Subprocesses inherit them.
TEST_SECRETS = (
    "TIDE_STORE__SECRET_KEY",
    "MLFLOW_TRACKING_PASSWORD",
    "TIDE_STACK__AIRFLOW_ADMIN_PASSWORD",
    "TIDE_STACK__AIRFLOW_VIEWER_PASSWORD",
    "TIDE_SERVE__ADMIN_API_KEY",  # engines refuse swaps without it; fleet clients send it
)
for _name in TEST_SECRETS:
    os.environ.setdefault(_name, secrets.token_urlsafe(24))
os.environ.setdefault("MLFLOW_TRACKING_USERNAME", "admin")
ADMIN_AUTH = {"Authorization": f"Bearer {os.environ['TIDE_SERVE__ADMIN_API_KEY']}"}

_GRPC_OFFSET = 10000
# Port bases stay below Linux's ephemeral range (32768-60999), gRPC twins included (at
# the default offset 0): an outgoing connection can never take a port between its probe
# and its bind.
# TIDE_TEST_PORT_OFFSET (a multiple of 3000, at most 9000) moves them all, so that two
# pytest sessions on one machine never probe the same ports.
_OFFSET = int(os.environ.get("TIDE_TEST_PORT_OFFSET", "0"))
STACK_PORTS = 20000 + _OFFSET  # the session's stack
DEMO_STACK_PORTS = 20100 + _OFFSET
SPARE_PORTS = 20200 + _OFFSET
OUTAGE_STACK_PORTS = 20300 + _OFFSET  # stacks of single tests, each started and stopped there
TAKEN_PORT_STACK_PORTS = 20400 + _OFFSET
STOPPED_STACK_PORTS = 20500 + _OFFSET
ENGINE_PORTS = 21000 + _OFFSET  # + up to 1000 by pid: engine processes
DEMO_ENGINE_PORTS = 22000 + _OFFSET
# The multi-host test's `data` host. Its namespace has ports to itself, but SeaweedFS
# names its unix sockets by port in /tmp, which every namespace shares: at the default
# ports they would take over the sockets of a developer's `tide stack` on this machine.
MULTIHOST_DATA_PORTS = 20600 + _OFFSET


def stack_config(state_dir: Path, port_base: int, **sections: object) -> TideConfig:
    """A config whose stack runs on free ports under ``state_dir``; the store points at it."""
    s3, master, volume, filer, admin, mlflow, airflow = free_ports(
        7,
        port_base,
        twin_offset=_GRPC_OFFSET,  # SeaweedFS binds gRPC at port + 10000
    )
    return load_config(
        stack={
            "state_dir": state_dir,
            "s3_port": s3,
            "master_port": master,
            "volume_port": volume,
            "filer_port": filer,
            "admin_port": admin,
            "mlflow_port": mlflow,
            "airflow_port": airflow,
            "airflow": False,  # the Airflow processes have a test of their own
            "start_timeout_s": 300,  # services share 2 loaded cores with the tests
        },
        store={"endpoint": f"http://127.0.0.1:{s3}", "timeout_s": 2.0},
        mlflow={"tracking_uri": f"http://127.0.0.1:{mlflow}"},
        **sections,
    )


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TideConfig]:
    """The real stack, started once per session; yields its configuration."""
    config = stack_config(tmp_path_factory.mktemp("stack"), port_base=STACK_PORTS)
    manager = StackManager(config)
    manager.up()
    yield config
    manager.down()


@pytest.fixture
def lake_config(tmp_path: Path) -> LakeConfig:
    return LakeConfig(
        prefix=f"test-{uuid.uuid4().hex[:8]}",
        spool_dir=tmp_path / "spool",
        shard_max_age_s=0.5,
        retry_interval_s=0.2,
    )


@pytest.fixture
def lake_store(stack: TideConfig) -> ObjectStore:
    return ObjectStore(stack.store, stack.store.lake_bucket)


def make_record(
    index: int = 0,
    *,
    tokens: int = 12,
    hidden: int = 16,
    target_id: str = "demo/target",
    finished_at: datetime | None = None,
    seed: int | None = None,
) -> CapturedRecord:
    """A valid record with distinct random float16 states (seeded by ``index``)."""
    rng = np.random.default_rng(index if seed is None else seed)
    finished = finished_at or datetime.now(UTC)
    return CapturedRecord(
        request_id=f"req-{index}",
        target_id=target_id,
        draft_version="v1",
        started_at=finished - timedelta(seconds=1),
        finished_at=finished,
        input_ids=rng.integers(0, 1000, tokens, dtype=np.int64),
        loss_mask=(np.arange(tokens) >= tokens // 2).astype(np.int8),
        hidden_states=rng.standard_normal((tokens, hidden)).astype(np.float16),
        aux_hidden_states=rng.standard_normal((tokens, 3 * hidden)).astype(np.float16),
        spec_verify_ct=3,
        spec_accept_tokens=4,
        completion_tokens=tokens - tokens // 2,
    )


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 'tiny' demo target, built once per session (a few seconds)."""
    from tide_lib.target_model import build_target

    path = tmp_path_factory.mktemp("targets") / "tiny"
    build_target(path, preset_name="tiny", seed=0)
    return path


@pytest.fixture(scope="session")
def captured(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Teacher-forced captures of the tiny target in SpecForge's offline layout.

    Keys: ``en_train``, ``en_heldout``, ``ko_train``, ``ko_heldout``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tide_lib.target_model import load_corpus
    from tide_lib.target_model.hidden import capture_records

    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    corpus = load_corpus()
    root = tmp_path_factory.mktemp("captured")
    dirs = {}
    for language in ("en", "ko"):
        for split, held_out in (("train", False), ("heldout", True)):
            out = root / f"{language}_{split}"
            out.mkdir()
            documents = corpus.domain(f"{language}_chat", held_out=held_out)[:120]
            for index, record in enumerate(
                capture_records(model, tokenizer, documents, target_id="tiny")
            ):
                record.save_specforge(out, index)
            dirs[f"{language}_{split}"] = out
    return dirs


def _train_tiny_draft(tiny_target: Path, data: Path, out: Path, steps: int = 40) -> Path:
    from tide_lib.config import TrainConfig
    from tide_lib.training.trainer import train_draft

    config = TrainConfig(
        steps=steps, batch_size=4, ttt_length=3, draft_vocab_size=512, learning_rate=3e-3
    )
    return train_draft(data, tiny_target, out, config).draft_dir


@pytest.fixture(scope="session")
def tiny_drafts(
    tiny_target: Path, captured: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Two exported drafts of the tiny target: ``en`` and ``ko`` (different weights)."""
    root = tmp_path_factory.mktemp("drafts")
    return {
        language: _train_tiny_draft(tiny_target, captured[f"{language}_train"], root / language)
        for language in ("en", "ko")
    }


@pytest.fixture(scope="session", params=["0.5.14", "0.5.23"], ids=lambda v: f"sglang-{v}")
def sglang(request: pytest.FixtureRequest) -> Any:
    """Each supported released SGLang wheel (``tests.contract.sglang_release.Release``)."""
    from tests.contract.sglang_release import VERSIONS, release

    assert request.param in VERSIONS, "the wheels tested are the supported set"
    return release(request.param)
