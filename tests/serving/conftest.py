"""Real engine processes (``tide serve``) for the serving tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_ports
from tide_lib.config import TideConfig


class EngineProcess:
    def __init__(self, port: int, process: subprocess.Popen[bytes], log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.process = process
        self.log = log

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"engine exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"engine at {self.url} not healthy: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start_engine(
    tmp: Path,
    target: Path,
    *args: str,
    stack: TideConfig,
    capture: bool = False,
    prefix: str = "serving",
) -> EngineProcess:
    (port,) = free_ports(1, start=43000 + (os.getpid() % 500) * 2)
    env = {**os.environ, "TIDE_LAKE__SPOOL_DIR": str(tmp / f"spool-{port}")}
    env |= {
        "TIDE_STORE__ENDPOINT": stack.store.endpoint,
        "TIDE_LAKE__PREFIX": prefix,
        "TIDE_LAKE__SHARD_MAX_AGE_S": "0.5",
    }
    log = tmp / f"engine-{port}.log"
    command = [str(Path(sys.executable).parent / "tide"), "serve", "--model-path", str(target)]
    command += ["--port", str(port), *args]
    if not capture:
        command.append("--no-capture")
    with log.open("wb") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
    engine = EngineProcess(port, process, log)
    engine.wait_healthy()
    return engine


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
