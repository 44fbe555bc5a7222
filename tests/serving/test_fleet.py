"""The fleet: no mixed fleet on any promotion error, and SGLang launch args without secrets.

Promotions run against real HTTP servers: the SGLang stub (SGLang 0.5.14's own
request models and auth) and a tiny local ``http.server`` that misbehaves the
way a broken engine or proxy does. Launch arguments are checked against the
released SGLang source (its ``--config`` merger, run from the wheel).
"""

from __future__ import annotations

import argparse
import ast
import json
import stat
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from tests.contract.sglang_release import Release
from tests.contract.sglang_stub import StubServer, StubState, create_stub
from tide_lib.serving.fleet import (
    FleetError,
    FleetManager,
    sglang_launch_args,
    write_sglang_key_file,
)

V1 = ("models:/tide-draft-tiny/1", "tide-draft-tiny-v1")
V2 = ("models:/tide-draft-tiny/2", "tide-draft-tiny-v2")
API_KEY, ADMIN_KEY = SecretStr("k-api"), SecretStr("k-admin")


def _fleet(*urls: str) -> FleetManager:
    return FleetManager(list(urls), api_key=API_KEY, admin_api_key=ADMIN_KEY)


class _Broken:
    """An engine that takes a draft, then answers ``/model_info`` wrongly (``how``)."""

    def __init__(self, how: str, *, dead_after_update: bool = False) -> None:
        self.how, self.dead_after_update = how, dead_after_update
        self.weight_version = V1[1]
        self.updates: list[dict[str, Any]] = []
        broken = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: object) -> None:
                return

            def _send(self, body: bytes, kind: str = "application/json") -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _json(self, value: object) -> None:
                self._send(json.dumps(value).encode())

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._send(b"")
                elif self.path == "/server_info":
                    self._json({"speculative_draft_model_path": V1[0], "internal_states": [{}]})
                elif self.path == "/model_info" and not broken.updates:
                    self._json({"weight_version": broken.weight_version})
                elif self.path == "/model_info":
                    broken.answer_wrongly(self)
                else:
                    self.send_error(404)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length))
                if broken.dead_after_update and broken.updates:
                    self.close_connection = True  # a reset: no answer at all
                    return
                broken.updates.append(body)
                broken.weight_version = body["weight_version"]
                self._json({"success": True, "message": "ok"})

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def answer_wrongly(self, handler: Any) -> None:
        if self.how == "json-list":  # JSON, but not the object SGLang sends
            handler._json([self.weight_version])
        elif self.how == "non-json":  # a proxy's error page with a 200
            handler._send(b"<html>bad gateway</html>", "text/html")
        else:  # "reset": the connection drops without an answer
            handler.close_connection = True

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def stub() -> Iterator[tuple[StubServer, StubState]]:
    state = StubState(loadable={V1[0], V2[0]}, weight_version=V1[1])
    server = StubServer(create_stub(state, api_key="k-api", admin_api_key="k-admin"))
    yield server, state
    server.stop()


@pytest.mark.parametrize("how", ["json-list", "non-json", "reset"])
def test_any_error_after_the_first_engine_took_the_draft_rolls_it_back(
    stub: tuple[StubServer, StubState], how: str
) -> None:
    """Defect 'fleet left mixed': a non-HTTP error on the second engine (an answer that is
    not SGLang's, a reset connection) rolls back the first engine, which had the new draft,
    and the second, then fails with a FleetError naming the server."""
    server, state = stub
    broken = _Broken(how)
    try:
        fleet = _fleet(server.url, broken.url)
        with pytest.raises(FleetError, match="rolled back") as raised:
            fleet.promote(*V2, rollback_to=V1)
        assert broken.url in str(raised.value)
        assert [u["weight_version"] for u in state.updates] == [V2[1], V1[1]]
        assert state.weight_version == V1[1]  # the first engine is back on the champion
        assert [u["model_path"] for u in broken.updates] == [V2[0], V1[0]]
    finally:
        broken.stop()


def test_a_server_that_cannot_be_rolled_back_is_named_with_what_to_do(
    stub: tuple[StubServer, StubState],
) -> None:
    """Defect 'fleet left mixed': when a rollback fails too, the error says where and how
    to repair; the other servers are still rolled back."""
    server, state = stub
    broken = _Broken("json-list", dead_after_update=True)
    try:
        fleet = _fleet(server.url, broken.url)
        with pytest.raises(FleetError, match="could not be rolled back") as raised:
            fleet.promote(*V2, rollback_to=V1)
        assert broken.url in str(raised.value) and "tide_rollback" in str(raised.value)
        assert state.weight_version == V1[1]
    finally:
        broken.stop()


def test_http_refusals_keep_their_contract(stub: tuple[StubServer, StubState]) -> None:
    """A refused update is still a FleetError naming the refusal, after the rollback."""
    server, state = stub
    other_state = StubState(loadable={V1[0]}, weight_version=V1[1])
    other = StubServer(create_stub(other_state, api_key="k-api", admin_api_key="k-admin"))
    try:
        with pytest.raises(FleetError, match=r"rolled back: .*refused draft"):
            _fleet(server.url, other.url).promote(*V2, rollback_to=V1)
        assert state.weight_version == other_state.weight_version == V1[1]
    finally:
        other.stop()


# -- launch arguments ----------------------------------------------------------------------


def _value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_launch_args_listen_on_loopback_by_default() -> None:
    """Defect 5: the default host was 0.0.0.0 (every interface, no key)."""
    assert _value(sglang_launch_args("/t", "/d"), "--host") == "127.0.0.1"
    assert _value(sglang_launch_args("/t", "/d", host="0.0.0.0"), "--host") == "0.0.0.0"


def test_keys_reach_sglang_through_its_config_file_never_argv(
    sglang: Release, tmp_path: Path
) -> None:
    """Defect 5: keys go in SGLang's --config YAML (mode 0600), merged by SGLang's own
    ConfigArgumentMerger into --api-key/--admin-api-key inside the server process."""
    key_file = write_sglang_key_file(
        tmp_path / "sglang-keys.yaml", api_key=API_KEY, admin_api_key=ADMIN_KEY
    )
    args = sglang_launch_args("/t", "/d", key_file=key_file)
    assert not any("k-api" in arg or "k-admin" in arg for arg in args)
    assert not {"--api-key", "--admin-api-key"} & set(args)
    assert _value(args, "--config") == str(key_file)
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600

    # SGLang's launcher merges --config before parsing (prepare_server_args)
    prepare = sglang.function("sglang.srt.server_args", "prepare_server_args")
    names = {getattr(node, "id", getattr(node, "value", None)) for node in ast.walk(prepare)}
    assert {"--config", "ConfigArgumentMerger"} <= names
    assert {"api_key", "admin_api_key"} <= sglang.server_args_fields()

    parser = argparse.ArgumentParser()
    for flag in [arg for arg in args[3:] if arg.startswith("--")] + [
        "--api-key",
        "--admin-api-key",
    ]:
        if flag == "--enable-metrics":
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag)
    parsers = ["sglang.srt.server_args_config_parser", "sglang.srt.utils.server_args_config_parser"]
    merger = sglang.load_file_module(next(m for m in parsers if sglang.module_file(m).is_file()))
    merged = merger.ConfigArgumentMerger(parser).merge_config_with_args(args[3:])
    parsed = parser.parse_args(merged)
    assert (parsed.api_key, parsed.admin_api_key) == ("k-api", "k-admin")
    assert parsed.host == "127.0.0.1" and parsed.enable_metrics


def test_a_key_on_the_command_line_is_refused(tmp_path: Path) -> None:
    """Defect 5: extra args cannot smuggle a key into argv; a key file must be YAML."""
    for extra in (["--api-key", "k"], ["--admin-api-key=k"]):
        with pytest.raises(ValueError, match="key_file"):
            sglang_launch_args("/t", "/d", extra=extra)
    with pytest.raises(ValueError, match="yaml"):
        write_sglang_key_file(tmp_path / "keys.txt", api_key=SecretStr("k"))
