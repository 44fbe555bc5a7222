"""``tide serve`` as a child process: how the demo and the tests run a fleet on one machine."""

from __future__ import annotations

__all__ = ["EngineProcess"]

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx


class EngineProcess:
    """One reference engine in its own process, its output in ``log``."""

    def __init__(self, port: int, process: subprocess.Popen[bytes], log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.process = process
        self.log = log

    @classmethod
    def start(
        cls,
        target: Path,
        port: int,
        args: list[str],
        log: Path,
        env: dict[str, str] | None = None,
    ) -> EngineProcess:
        """Start ``tide serve --model-path TARGET --port PORT ARGS...`` and wait until healthy."""
        command = [str(Path(sys.executable).parent / "tide"), "serve", "--model-path", str(target)]
        command += ["--port", str(port), *args]
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as handle:
            process = subprocess.Popen(
                command, stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )
        engine = cls(port, process, log)
        engine.wait_healthy()
        return engine

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
        self.stop()
        raise TimeoutError(f"engine at {self.url} not healthy: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
