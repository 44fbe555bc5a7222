"""The sensor: a window that stays quiet skips the run; a lake it cannot read fails it."""

from __future__ import annotations

import asyncio
import importlib
import json

import pytest
from airflow.exceptions import AirflowException

from tide_lib.orchestration import sensors
from tide_lib.orchestration.sensors import LakeTokensSensor, LakeTokensTrigger, LakeUnreadableError


def test_a_lake_error_while_waiting_fails_the_task_rather_than_skipping_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unreachable(params: dict[str, object], run_id: str, **_: object) -> int:
        raise ConnectionError("store at 127.0.0.1:1 refused the connection")

    monkeypatch.setattr(sensors, "_count", unreachable)
    trigger = LakeTokensTrigger({}, "manual__1", min_tokens=10, poke_interval=0.01)

    async def first_event() -> dict[str, object]:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("the trigger ended without an event")

    payload = asyncio.run(first_event())
    assert "ConnectionError" in str(payload["error"])
    sensor = LakeTokensSensor(task_id="wait_for_new_tokens", soft_fail=True)
    with pytest.raises(LakeUnreadableError, match="refused the connection") as raised:
        sensor.execute_complete({}, payload)
    # soft_fail skips on AirflowException (the timeout); this one stays a failure, retried
    assert not isinstance(raised.value, AirflowException)


def test_new_tokens_complete_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = iter([3, 12])
    monkeypatch.setattr(sensors, "_count", lambda params, run_id, **_: next(counts))
    trigger = LakeTokensTrigger({}, "manual__1", min_tokens=10, poke_interval=0.01)

    async def first_event() -> dict[str, object]:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("the trigger ended without an event")

    assert asyncio.run(first_event()) == {"tokens": 12}


def test_the_trigger_survives_its_serialise_round_trip() -> None:
    """The triggerer rebuilds the trigger from ``serialize()``: class path and kwargs, which
    hold the run's form values and never a secret or a local path."""
    params = {"min_new_tokens": 500, "target_id": "tiny", "gate_margin": None}
    trigger = LakeTokensTrigger(params, "scheduled__2026", min_tokens=500, poke_interval=30.0)
    classpath, kwargs = trigger.serialize()
    module, _, name = classpath.rpartition(".")
    rebuilt = getattr(importlib.import_module(module), name)(**kwargs)
    assert isinstance(rebuilt, LakeTokensTrigger)
    assert rebuilt.serialize() == (classpath, kwargs)
    assert json.loads(json.dumps(kwargs)) == kwargs  # plain JSON, as the metadata DB stores it
    assert set(kwargs) == {"params", "run_id", "min_tokens", "poke_interval"}
