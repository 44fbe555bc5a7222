"""Real engine processes (``tide serve``) for the serving tests."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ENGINE_PORTS
from tests.prometheus import metric_value
from tide_lib.config import TideConfig
from tide_lib.serving.process import EngineProcess
from tide_lib.stack import free_ports


class HealthWatch:
    """Poll ``url``/health from a separate process until :meth:`stop`; a failure counts as 99 s.

    A process, not a thread: the test's own Python work (Hypothesis drawing inputs, building
    10 MB bodies) holds this process's GIL, and a poller sharing it measured that wait as the
    server's latency (a 1.04 s "stall" in CI while the engine answered in 0.1 s).
    """

    def __init__(self, url: str) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        ready = context.Event()
        self._results: multiprocessing.SimpleQueue[list[float]] = context.SimpleQueue()
        self._process = context.Process(
            target=_poll_health, args=(url, self._stop, ready, self._results), daemon=True
        )
        self._process.start()
        if not ready.wait(60):
            self._process.terminate()
            raise RuntimeError(f"the /health poller for {url} did not start within 60 s")

    def stop(self) -> list[float]:
        """The latencies (s) of every poll since the start."""
        self._stop.set()
        try:
            deadline = time.monotonic() + 60
            while self._results.empty():  # a poller that died never answers
                if not self._process.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError("the /health poller died before reporting")
                time.sleep(0.05)
            latencies: list[float] = self._results.get()
            return latencies
        finally:
            self._process.join(10)
            if self._process.is_alive():
                self._process.terminate()


def _poll_health(url: str, stop: Any, ready: Any, results: Any) -> None:
    latencies: list[float] = []
    with httpx.Client(timeout=5) as client:
        while not stop.is_set():
            started = time.monotonic()
            try:
                ok = client.get(f"{url}/health").status_code == 200
            except Exception:  # any failure to answer counts as a stall
                ok = False
            latencies.append(time.monotonic() - started if ok else 99.0)
            ready.set()
            time.sleep(0.05)
    results.put(latencies)


def engine_metric(engine: EngineProcess, name: str) -> float:
    """The value of one metric in the engine's Prometheus ``/metrics``."""
    return metric_value(httpx.get(f"{engine.url}/metrics", timeout=30).text, name)


def start_engine(
    tmp: Path,
    target: Path,
    *args: str,
    stack: TideConfig,
    capture: bool = False,
    prefix: str = "serving",
    env: dict[str, str] | None = None,
) -> EngineProcess:
    """An engine whose drafts may come from this session's temp dirs and ``s3://<artifacts>/drafts``.

    Its scratch dir is ``tmp/scratch-<port>`` and its ``TMPDIR`` ``tmp/tmp-<port>``, so a
    test can list what it leaves behind.
    """
    (port,) = free_ports(1, start=ENGINE_PORTS + (os.getpid() % 500) * 2)
    sources = [str(tmp.parent), f"s3://{stack.store.artifact_bucket}/drafts"]
    (tmp / f"tmp-{port}").mkdir(parents=True, exist_ok=True)
    base = {
        "TIDE_SERVE__DRAFT_SOURCES": json.dumps(sources),
        "TMPDIR": str(tmp / f"tmp-{port}"),
        "TIDE_LAKE__SPOOL_DIR": str(tmp / f"spool-{port}"),
        "TIDE_STORE__ENDPOINT": stack.store.endpoint,
        "TIDE_MLFLOW__TRACKING_URI": stack.mlflow.tracking_uri,
        "TIDE_SCRATCH_DIR": str(tmp / f"scratch-{port}"),
        "TIDE_LAKE__PREFIX": prefix,
        "TIDE_LAKE__SHARD_MAX_AGE_S": "0.5",
    }
    arguments = [*args] if capture else [*args, "--no-capture"]
    return EngineProcess.start(
        target, port, arguments, tmp / f"engine-{port}.log", {**base, **(env or {})}
    )


@pytest.fixture(scope="module")
def engines(
    stack: TideConfig,
    tiny_target: Path,
    tiny_drafts: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, EngineProcess]]:
    """``spec`` (EAGLE3 k=3, capture on), ``plain`` (no speculation), ``spec2`` (for fleets)."""
    tmp = tmp_path_factory.mktemp("engines")
    draft = [
        "--speculative-draft-model-path",
        str(tiny_drafts["en"]),
        "--speculative-num-steps",
        "3",
    ]
    started = {
        "spec": start_engine(
            tmp, tiny_target, *draft, stack=stack, capture=True, prefix="serving-capture"
        ),
        "plain": start_engine(tmp, tiny_target, *draft, "--disable-speculation", stack=stack),
        "spec2": start_engine(tmp, tiny_target, *draft, stack=stack),
    }
    yield started
    for engine in started.values():
        engine.stop()
