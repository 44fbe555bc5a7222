"""The serving fleet as TIDE drives it: SGLang launch arguments, a client, and rollouts.

Everything here speaks SGLang's HTTP API, so it works the same against real
SGLang servers and against TIDE's reference engine. A promotion updates one
server at a time (``/update_weights_from_disk`` with ``is_draft_model``), then
checks that server's health, weight version and, with probe prompts, its
acceptance length; if any check fails every server already touched is rolled
back to the draft it served before, and the promotion fails loudly.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

__all__ = [
    "EngineClient",
    "FleetError",
    "FleetManager",
    "ServerState",
    "sglang_launch_args",
]

logger = logging.getLogger(__name__)


def sglang_launch_args(
    target: str,
    draft: str,
    *,
    num_steps: int = 4,
    port: int = 30000,
    host: str = "0.0.0.0",
    extra: Sequence[str] = (),
) -> list[str]:
    """``python -m sglang.launch_server`` arguments for an EAGLE3 server TIDE can manage."""
    return [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        target,
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        draft,
        "--speculative-num-steps",
        str(num_steps),
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        str(num_steps + 1),
        "--enable-metrics",
        "--host",
        host,
        "--port",
        str(port),
        *extra,
    ]


class FleetError(RuntimeError):
    """A fleet operation failed; the message names the server and the check."""


@dataclasses.dataclass(frozen=True)
class ServerState:
    url: str
    healthy: bool
    draft_path: str | None
    weight_version: str | None
    avg_accept_length: float | None
    error: str | None = None


class EngineClient:
    """One SGLang-compatible server."""

    def __init__(self, url: str, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout)

    def health(self, attempts: int = 3) -> bool:
        """``/health`` answers 200; a busy server gets ``attempts`` tries of 10 s."""
        for attempt in range(attempts):
            try:
                if self._http.get("/health", timeout=10).status_code == 200:
                    return True
            except httpx.HTTPError as error:
                logger.debug("%s /health: %s", self.url, error)
            if attempt + 1 < attempts:
                time.sleep(1.0)
        return False

    def server_info(self) -> dict[str, Any]:
        response = self._http.get("/get_server_info")
        response.raise_for_status()
        info: dict[str, Any] = response.json()
        return info

    def weight_version(self) -> str:
        response = self._http.get("/get_weight_version")
        response.raise_for_status()
        return str(response.json()["weight_version"])

    def generate(
        self, text: str, max_new_tokens: int = 64, temperature: float = 0.0
    ) -> dict[str, Any]:
        response = self._http.post(
            "/generate",
            json={
                "text": text,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature},
            },
        )
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    def update_draft(self, model_path: str, weight_version: str) -> None:
        response = self._http.post(
            "/update_weights_from_disk",
            json={
                "model_path": model_path,
                "is_draft_model": True,
                "weight_version": weight_version,
            },
        )
        if response.status_code != 200:
            raise FleetError(f"{self.url} refused draft {model_path}: {response.text}")

    def state(self) -> ServerState:
        try:
            info = self.server_info()
            return ServerState(
                url=self.url,
                healthy=self.health(attempts=1),
                draft_path=info.get("speculative_draft_model_path"),
                weight_version=self.weight_version(),
                avg_accept_length=(info.get("internal_states") or [{}])[0].get(
                    "avg_spec_accept_length"
                ),
            )
        except (httpx.HTTPError, ValueError, KeyError) as error:
            return ServerState(self.url, False, None, None, None, error=str(error))


class FleetManager:
    """Rolls a draft out to a list of servers, one at a time, with rollback."""

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise FleetError("no servers given")
        self.clients = [EngineClient(url) for url in urls]

    def status(self) -> list[ServerState]:
        return [client.state() for client in self.clients]

    def promote(
        self,
        model_path: str | Path,
        weight_version: str,
        *,
        probe_prompts: Sequence[str] = (),
        min_accept_length: float | None = None,
        probe_max_new_tokens: int = 32,
    ) -> list[ServerState]:
        """Serve ``model_path`` everywhere, or nowhere: a failed check rolls back every server."""
        path = str(model_path)
        previous: list[tuple[EngineClient, ServerState]] = []
        try:
            for client in self.clients:
                before = client.state()
                if not before.healthy:
                    raise FleetError(
                        f"{client.url} is not healthy before the update: {before.error}"
                    )
                previous.append((client, before))
                logger.info("promoting %s (%s) on %s", path, weight_version, client.url)
                client.update_draft(path, weight_version)
                self._check(
                    client, weight_version, probe_prompts, min_accept_length, probe_max_new_tokens
                )
        except (FleetError, httpx.HTTPError) as error:
            self._roll_back(previous)
            raise FleetError(f"promotion of {path} failed and was rolled back: {error}") from error
        return self.status()

    @staticmethod
    def _check(
        client: EngineClient,
        weight_version: str,
        probe_prompts: Sequence[str],
        min_accept_length: float | None,
        max_new_tokens: int,
    ) -> None:
        if not client.health():
            raise FleetError(f"{client.url} is unhealthy after the update")
        served = client.weight_version()
        if served != weight_version:
            raise FleetError(
                f"{client.url} serves weight version {served}, expected {weight_version}"
            )
        if probe_prompts and min_accept_length is not None:
            emitted = verify = 0
            for prompt in probe_prompts:
                meta = client.generate(prompt, max_new_tokens)["meta_info"]
                verify += meta["spec_verify_ct"]
                emitted += meta["spec_accept_length"] * meta["spec_verify_ct"]
            accept_length = emitted / verify if verify else 0.0
            if accept_length < min_accept_length:
                raise FleetError(
                    f"{client.url} reaches acceptance length {accept_length:.2f} on the probe "
                    f"prompts, below the floor {min_accept_length:.2f}"
                )

    @staticmethod
    def _roll_back(previous: list[tuple[EngineClient, ServerState]]) -> None:
        for client, before in reversed(previous):
            if before.draft_path is None or before.weight_version is None:
                logger.error("cannot roll back %s: its previous draft is unknown", client.url)
                continue
            try:
                client.update_draft(before.draft_path, before.weight_version)
                logger.warning("rolled %s back to %s", client.url, before.weight_version)
            except (FleetError, httpx.HTTPError) as error:
                logger.error("rollback of %s failed: %s", client.url, error)
