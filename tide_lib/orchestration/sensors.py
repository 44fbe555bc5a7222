"""A deferrable sensor that waits in the triggerer until the lake holds enough new tokens.

While it waits, no worker slot is held: the trigger polls commit markers (cheap
LIST + small GETs) from the triggerer's event loop.
"""

from __future__ import annotations

__all__ = ["LakeTokensSensor", "LakeTokensTrigger", "LakeUnreadableError"]

import asyncio
import logging
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseSensorOperator
from airflow.triggers.base import BaseTrigger, TriggerEvent

from tide_lib.errors import TideError

logger = logging.getLogger(__name__)


def _measure(params: dict[str, Any], run_id: str, *, export: bool = True) -> tuple[int, int]:
    """``(new tokens, cycle.min_new_tokens)`` of this run, from one reading of its
    configuration (connections included). The trigger passes ``export=False``: the
    triggerer's process is shared by every trigger, so connection values must not land
    in its environment."""
    from tide_lib.orchestration.cycle import cycle_tokens  # noqa: PLC0415
    from tide_lib.orchestration.params import config_from_params  # noqa: PLC0415

    config = config_from_params(params, export=export)
    return cycle_tokens(config, run_id), config.cycle.min_new_tokens


def _count(params: dict[str, Any], run_id: str, *, export: bool = True) -> int:
    """New tokens for this run (what the trigger polls)."""
    return _measure(params, run_id, export=export)[0]


class LakeTokensTrigger(BaseTrigger):  # type: ignore[misc]  # untyped base class
    def __init__(
        self, params: dict[str, Any], run_id: str, min_tokens: int, poke_interval: float
    ) -> None:
        super().__init__()
        self.params = params
        self.run_id = run_id
        self.min_tokens = min_tokens
        self.poke_interval = poke_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "params": self.params,
                "run_id": self.run_id,
                "min_tokens": self.min_tokens,
                "poke_interval": self.poke_interval,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:
            try:
                tokens = await asyncio.to_thread(_count, self.params, self.run_id, export=False)
            except Exception as error:  # the lake failed, not the wait: fail (and retry)
                yield TriggerEvent({"error": f"{type(error).__name__}: {error}"})
                return
            if tokens >= self.min_tokens:
                yield TriggerEvent({"tokens": tokens})
                return
            logger.info("lake holds %d new tokens, waiting for %d", tokens, self.min_tokens)
            await asyncio.sleep(self.poke_interval)


class LakeTokensSensor(BaseSensorOperator):
    """Succeeds once ``min_new_tokens`` (a DAG param) tokens arrived since the watermark.

    A rerun of a cycle that already froze its window passes at once (its data is
    behind the watermark by then, yet it is still the cycle's data).
    """

    def __init__(self, *, deferrable: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.deferrable = deferrable

    def poke(self, context: Any) -> bool:
        params = dict(context["params"])
        tokens, needed = _measure(params, context["run_id"])
        return tokens >= needed

    def execute(self, context: Any) -> Any:
        params = dict(context["params"])
        tokens, needed = _measure(params, context["run_id"])
        if tokens >= needed:
            return tokens
        if not self.deferrable:
            return super().execute(context)
        self.defer(
            trigger=LakeTokensTrigger(params, context["run_id"], needed, self.poke_interval),
            method_name="execute_complete",
            timeout=timedelta(seconds=self.timeout),
        )
        return None

    def execute_complete(self, context: Any, event: dict[str, Any]) -> int:
        if "error" in event:  # not an AirflowException: soft_fail must not turn it into a skip
            raise LakeUnreadableError(f"counting new tokens in the lake failed: {event['error']}")
        return int(event["tokens"])


class LakeUnreadableError(TideError, RuntimeError):
    """The sensor could not count the lake's new tokens (the task fails and is retried;
    only a window that stays quiet until the timeout skips the run)."""
