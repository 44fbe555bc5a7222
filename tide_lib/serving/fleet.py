"""The serving fleet as TIDE drives it: SGLang launch arguments, a client, and rollouts.

Everything here speaks SGLang's HTTP API (0.5.14, 0.5.23), with its bearer keys, so it
works the same against real SGLang servers and against TIDE's reference engine.
A promotion updates one server at a time (``/update_weights_from_disk`` with a
draft URI each server resolves itself), then checks that server's health,
weight version (``/model_info``) and, with probe prompts, its acceptance length;
if any check fails, or anything else goes wrong (a reset connection, an answer
that is not SGLang's), every server already touched is rolled back to the
registry's champion, and the promotion fails loudly: never a mixed fleet.
"""

from __future__ import annotations

__all__ = [
    "EngineClient",
    "FleetError",
    "FleetManager",
    "RestartLauncher",
    "ServerState",
    "sglang_launch_args",
    "write_sglang_key_file",
]

import dataclasses
import logging
import os
import shlex
import string
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import yaml
from pydantic import SecretStr

from tide_lib.errors import TideError
from tide_lib.serving.acceptance import AcceptanceCount
from tide_lib.serving.auth import bearer_for
from tide_lib.serving.k_policy import KChoice, recommend_k
from tide_lib.serving.sglang_api import SUPPORTED_SGLANG_VERSIONS

logger = logging.getLogger(__name__)


_SECRET_FLAGS = ("--api-key", "--admin-api-key")


def sglang_launch_args(
    target: str,
    draft: str,
    *,
    num_steps: int = 4,
    port: int = 30000,
    host: str = "127.0.0.1",
    key_file: str | Path | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """``python -m sglang.launch_server`` arguments for an EAGLE3 server TIDE can manage.

    The server listens on loopback unless ``host`` says otherwise. Keys never go on
    the command line, where ``ps`` shows them: SGLang reads no key from the
    environment, but its ``--config <file.yaml>`` is merged into the options inside
    the server process, so ``key_file`` (written by :func:`write_sglang_key_file`)
    carries ``api-key``/``admin-api-key`` and the command line only its path.
    """
    for arg in extra:
        if arg.split("=", 1)[0] in _SECRET_FLAGS:
            raise ValueError(
                f"{arg.split('=', 1)[0]} would show the key in `ps`: write the keys with "
                "write_sglang_key_file() and pass its path as key_file"
            )
    config = ["--config", str(key_file)] if key_file is not None else []
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
        *config,
        *extra,
    ]


def write_sglang_key_file(
    path: Path, *, api_key: SecretStr | None, admin_api_key: SecretStr | None = None
) -> Path:
    """Write SGLang's ``--config`` YAML with the server's keys, readable by its owner only."""
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise ValueError(f"SGLang reads --config only from a .yaml/.yml file, not {path.name}")
    keys = {
        name: key.get_secret_value()
        for name, key in (("api-key", api_key), ("admin-api-key", admin_api_key))
        if key is not None
    }
    if not keys:
        raise ValueError("no key given: set serve.api_key (TIDE_SERVE__API_KEY)")
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)  # an existing file keeps its mode otherwise
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        yaml.safe_dump(keys, handle)
    return path


class FleetError(TideError, RuntimeError):
    """A fleet operation failed; the message names the server and the check."""


@dataclasses.dataclass(frozen=True)
class ServerState:
    url: str
    healthy: bool
    draft_path: str | None
    weight_version: str | None
    avg_accept_length: float | None
    error: str | None = None
    speculative_num_steps: int | None = None  # k the server was launched with
    sglang_version: str | None = None  # /server_info's version (absent: not SGLang)


class EngineClient:
    """One SGLang server (a supported release) or TIDE's engine, spoken to with its bearer keys.

    The weight version comes from ``/model_info`` (``/get_weight_version`` answers
    404 in 0.5.14, gone in 0.5.23), server state from ``/server_info``; each call has its own
    timeout, and reads are retried on connection errors. Keys follow SGLang's
    rules: the API key on ordinary routes, the admin key (else the API key) on
    ``/update_weights_from_disk``.
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: SecretStr | None = None,
        admin_api_key: SecretStr | None = None,
        timeout: float = 600.0,
        read_attempts: int = 3,
    ) -> None:
        self.url = url.rstrip("/")
        self._keys = (api_key, admin_api_key)
        self._read_attempts = read_attempts
        self._http = httpx.Client(base_url=self.url, timeout=timeout)

    def _get(self, path: str, timeout: float = 30.0) -> dict[str, Any]:
        for attempt in range(self._read_attempts):
            try:
                response = self._http.get(
                    path, headers=bearer_for(path, *self._keys), timeout=timeout
                )
                break
            except httpx.TransportError:
                if attempt + 1 == self._read_attempts:
                    raise
                time.sleep(1.0)
        if response.status_code in (401, 403):
            raise FleetError(f"{self.url}{path} refused TIDE's key ({response.status_code})")
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body

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
        return self._get("/server_info")

    def weight_version(self) -> str:
        return str(self._get("/model_info")["weight_version"])

    def generate(
        self, text: str, max_new_tokens: int = 64, temperature: float = 0.0
    ) -> dict[str, Any]:
        response = self._http.post(
            "/generate",
            json={
                "text": text,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature},
            },
            headers=bearer_for("/generate", *self._keys),
        )
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    def update_draft(self, model_path: str, weight_version: str) -> None:
        """SGLang's ``/update_weights_from_disk`` with a draft directory or URI."""
        path = "/update_weights_from_disk"
        response = self._http.post(
            path,
            json={"model_path": model_path, "weight_version": weight_version},
            headers=bearer_for(path, *self._keys),
        )
        if response.status_code != 200:
            raise FleetError(
                f"{self.url} refused draft {model_path} ({response.status_code}): "
                f"{response.text[:500]}"
            )

    def state(self) -> ServerState:
        try:
            info = self.server_info()
            states = info.get("internal_states") or [{}]
            accept = states[0].get("avg_spec_accept_length")  # absent before the first verify
            steps = info.get("speculative_num_steps")
            return ServerState(
                url=self.url,
                healthy=self.health(attempts=1),
                draft_path=info.get("speculative_draft_model_path"),
                weight_version=self.weight_version(),
                avg_accept_length=float(accept) if accept is not None else None,
                speculative_num_steps=int(steps) if steps is not None else None,
                sglang_version=info.get("version"),
            )
        except (httpx.HTTPError, FleetError, ValueError, KeyError, TypeError) as error:
            return ServerState(self.url, False, None, None, None, error=str(error))


class RestartLauncher:
    """Applies a draft by relaunching a server: the rollout for fleets without TIDE's plugin.

    SGLang fixes the draft (and k) at launch, so a fleet without the draft-only swap
    gets a new draft by a restart with a new ``--speculative-draft-model-path``.
    ``template`` is the operator's launcher command, split like a shell would split
    it and run without one; its placeholders ``{url}``, ``{host}``, ``{port}``,
    ``{draft}``, ``{weight_version}`` and ``{num_steps}`` (k: SGLang's
    ``--speculative-num-steps``; ``--speculative-num-draft-tokens`` is k + 1 for chain
    drafting) are filled per server (a Kubernetes example:
    ``kubectl -n llm set env deploy/sglang-{port} TIDE_DRAFT={draft}
    TIDE_WEIGHT_VERSION={weight_version} TIDE_NUM_STEPS={num_steps}``). The server
    counts as updated once it is healthy again and ``/model_info`` reports the new
    weight version (and ``/server_info`` the new k, when one was asked for).
    """

    def __init__(self, template: str, timeout_s: float = 1800.0, poll_s: float = 5.0) -> None:
        self.argv = shlex.split(template)
        if not self.argv:
            raise FleetError("the restart command template is empty")
        allowed = {"url", "host", "port", "draft", "weight_version", "num_steps"}
        for part in self.argv:
            try:
                names = {name for _, name, _, _ in string.Formatter().parse(part) if name}
            except ValueError as error:
                raise FleetError(f"restart command {template!r}: {error}") from error
            if names - allowed:
                raise FleetError(
                    f"restart command {template!r} uses {sorted(names - allowed)}; "
                    f"placeholders are {sorted(allowed)} (double a literal brace: {{{{ }}}})"
                )
        self.uses_num_steps = any("{num_steps}" in part for part in self.argv)
        self._last_k: dict[str, int] = {}
        self.timeout_s, self.poll_s = timeout_s, poll_s

    def __call__(
        self, client: EngineClient, draft: str, weight_version: str, num_steps: int | None = None
    ) -> None:
        """Relaunch ``client``'s server; ``num_steps`` None keeps the k it runs with."""
        keep = num_steps is None
        if keep and self.uses_num_steps:
            # a server that failed to come back (a rollback) keeps the k it last reported
            num_steps = client.state().speculative_num_steps or self._last_k.get(client.url)
            if num_steps is None:
                raise FleetError(
                    f"{client.url}: /server_info reports no speculative_num_steps to keep for "
                    "the restart command's {num_steps}"
                )
        parsed = urlparse(client.url)
        fields = {
            "url": client.url,
            "host": parsed.hostname or "",
            "port": str(parsed.port or ""),
            "draft": draft,
            "weight_version": weight_version,
            "num_steps": str(num_steps if num_steps is not None else ""),
        }
        argv = [part.format(**fields) for part in self.argv]
        if num_steps is not None:
            self._last_k[client.url] = num_steps
        logger.info(
            "relaunching %s with draft %s (%s), k %s", client.url, draft, weight_version, num_steps
        )
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=self.timeout_s, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            raise FleetError(f"restart command for {client.url} failed: {error}") from error
        if done.returncode != 0:
            raise FleetError(
                f"restart command for {client.url} exited {done.returncode}: {done.stderr[-500:]}"
            )
        wanted_k = None if keep else num_steps
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if client.health(attempts=1):
                state = client.state()
                if state.weight_version == weight_version and (
                    wanted_k is None or state.speculative_num_steps == wanted_k
                ):
                    return
            time.sleep(self.poll_s)
        with_k = f" at k={wanted_k}" if wanted_k is not None else ""
        raise FleetError(
            f"{client.url} did not come back serving {weight_version}{with_k} within "
            f"{self.timeout_s:.0f} s"
        )


def _hot_swap(client: EngineClient, draft: str, weight_version: str) -> None:
    client.update_draft(draft, weight_version)


class FleetManager:
    """Rolls a draft out to a list of servers, one at a time, with rollback.

    Each server gets the draft by a hot swap (``/update_weights_from_disk``), or,
    with ``launcher``, by a restart (:class:`RestartLauncher`).
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        api_key: SecretStr | None = None,
        admin_api_key: SecretStr | None = None,
        launcher: RestartLauncher | None = None,
    ) -> None:
        if not urls:
            raise FleetError("no servers given")
        self._launcher = launcher
        self._apply: Callable[[EngineClient, str, str], None] = launcher or _hot_swap
        self._hot_swaps = launcher is None
        self.clients = [
            EngineClient(url, api_key=api_key, admin_api_key=admin_api_key) for url in urls
        ]

    def status(self) -> list[ServerState]:
        return [client.state() for client in self.clients]

    def recommended_k(
        self,
        *,
        draft_cost_ratio: float,
        verify_token_cost_ratio: float = 0.0,
        max_k: int | None = None,
    ) -> dict[str, KChoice | None]:
        """Per server, the k that pays for the acceptance it reports (None: nothing yet).

        SGLang fixes k at launch; this is the k to relaunch with (restart rollout), from
        ``/server_info``'s ``avg_spec_accept_length`` at the launch k and the cost of a
        draft forward and of each verified token relative to a plain decode step
        (:func:`~tide_lib.serving.k_policy.recommend_k`). ``max_k`` defaults to the launch k.
        """
        choices: dict[str, KChoice | None] = {}
        for state in self.status():
            launch_k = state.speculative_num_steps
            if state.avg_accept_length is None or not launch_k:
                choices[state.url] = None
                continue
            choices[state.url] = recommend_k(
                state.avg_accept_length,
                launch_k,
                draft_cost_ratio=draft_cost_ratio,
                verify_token_cost_ratio=verify_token_cost_ratio,
                max_k=max_k,
            )
        return choices

    def apply_k(self, choices: Mapping[str, KChoice | None]) -> list[str]:
        """Relaunch, one at a time, each server whose recommended k differs from its own.

        Needs the restart rollout (SGLang fixes k at launch); each server keeps its
        draft and weight version. A recommendation of 0 (plain decoding pays more) is
        logged, not applied: relaunching without speculation is the operator's call.
        Returns the servers relaunched; the first failure stops the rollout.
        """
        launcher = self._launcher
        if launcher is None or not launcher.uses_num_steps:
            raise FleetError(
                "applying k relaunches servers: set fleet.rollout=restart and a "
                "fleet.restart_command that passes {num_steps} to --speculative-num-steps"
            )
        relaunched: list[str] = []
        for client in self.clients:
            choice, state = choices.get(client.url), client.state()
            if choice is None or choice.k == state.speculative_num_steps:
                continue
            if choice.k == 0:
                logger.warning(
                    "%s: plain decoding would beat speculation at every k; not applied",
                    client.url,
                )
                continue
            if not state.healthy or state.draft_path is None or state.weight_version is None:
                raise FleetError(f"{client.url} is not healthy ({state.error}); k not applied")
            launcher(client, state.draft_path, state.weight_version, choice.k)
            relaunched.append(client.url)
        return relaunched

    def promote(
        self,
        model_path: str | Path,
        weight_version: str,
        *,
        probe_prompts: Sequence[str] = (),
        min_accept_length: float | None = None,
        probe_max_new_tokens: int = 32,
        rollback_to: tuple[str, str] | None = None,
    ) -> list[ServerState]:
        """Serve ``model_path`` everywhere, or nowhere: a failed check rolls back every server.

        ``rollback_to`` is the (draft URI, weight version) to go back to, from the
        registry's champion: SGLang's ``/server_info`` reports the *launch* draft
        path, never a later one, so it is only the fallback.
        """
        path = str(model_path)
        touched: list[tuple[EngineClient, ServerState]] = []
        where = "the fleet"
        try:
            for client in self.clients:
                where = client.url
                before = client.state()
                if not before.healthy:
                    raise FleetError(
                        f"{client.url} is not healthy before the update: {before.error}"
                    )
                self._check_swappable(before)
                touched.append((client, before))
                logger.info("promoting %s (%s) on %s", path, weight_version, client.url)
                self._apply(client, path, weight_version)
                self._check(
                    client, weight_version, probe_prompts, min_accept_length, probe_max_new_tokens
                )
        except Exception as error:
            # Any error (a refusal, a reset connection, an answer that is not what SGLang
            # sends): no server may keep the new draft while the others serve the old one.
            left = self._roll_back(touched, rollback_to)
            raise FleetError(_failure(path, where, left, error)) from error
        except BaseException:
            self._roll_back(touched, rollback_to)  # interrupted: still leave no mixed fleet
            raise
        return self.status()

    def _check_swappable(self, state: ServerState) -> None:
        """A hot swap only where TIDE's plugin runs: stock SGLang of a release the plugin
        does not support would load the draft into the target."""
        version = state.sglang_version
        if self._hot_swaps and version is not None and version not in SUPPORTED_SGLANG_VERSIONS:
            raise FleetError(
                f"{state.url} runs sglang {version}, which TIDE's plugin does not support "
                f"({', '.join(SUPPORTED_SGLANG_VERSIONS)}): a draft sent there would be "
                "loaded into the target. Run a supported release, or roll out by restart "
                "(fleet.rollout restart with fleet.restart_command)"
            )

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
            count = AcceptanceCount(keep_requests=False)
            for prompt in probe_prompts:
                count.add_meta(client.generate(prompt, max_new_tokens)["meta_info"])
            accept_length = count.accept_length
            if accept_length < min_accept_length:
                raise FleetError(
                    f"{client.url} reaches acceptance length {accept_length:.2f} on the probe "
                    f"prompts, below the floor {min_accept_length:.2f}"
                )

    def _roll_back(
        self, touched: list[tuple[EngineClient, ServerState]], rollback_to: tuple[str, str] | None
    ) -> list[str]:
        """Put every touched server back on the previous draft; the URLs that could not be."""
        left: list[str] = []
        for client, before in reversed(touched):
            draft, version = rollback_to or (before.draft_path, before.weight_version)
            if draft is None or version is None:
                logger.error("cannot roll back %s: its previous draft is unknown", client.url)
                left.append(client.url)
                continue
            try:
                self._apply(client, draft, version)
                logger.warning("rolled %s back to %s", client.url, version)
            except Exception as error:
                logger.error("rollback of %s failed: %s", client.url, _describe(error))
                left.append(client.url)
        return left


def _describe(error: BaseException) -> str:
    return str(error) if isinstance(error, FleetError) else f"{type(error).__name__}: {error}"


def _failure(path: str, where: str, left: list[str], error: Exception) -> str:
    if not left:
        return f"promotion of {path} failed and was rolled back: {where}: {_describe(error)}"
    return (
        f"promotion of {path} failed ({where}: {_describe(error)}) and {', '.join(left)} could "
        "not be rolled back: they may serve the new draft; serve the champion everywhere "
        "with the tide_rollback DAG (version=champion) once they answer"
    )
