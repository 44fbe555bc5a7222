"""The fleet recommends the k a fixed-k (SGLang) server should be relaunched with."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tide_lib.serving.fleet import FleetManager
from tide_lib.serving.k_policy import recommend_k


def _server(info: dict[str, Any]) -> ThreadingHTTPServer:
    """``/health``, ``/model_info`` and ``/server_info`` shaped as SGLang 0.5.14 answers.

    ``POST /relaunch`` (test only) stands in for the operator's launcher: the server
    comes back with the k it was given and no acceptance measured yet.
    """

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_args: object) -> None:
            return

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            info["speculative_num_steps"] = int(body["k"])
            info["internal_states"] = [{}]
            info["relaunches"] = info.get("relaunches", 0) + 1
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:
            bodies = {
                "/health": {},
                "/model_info": {"weight_version": "v1"},
                "/server_info": info,
            }
            body = json.dumps(bodies.get(self.path.split("?")[0], {})).encode()
            self.send_response(200 if self.path in bodies else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def servers() -> Iterator[dict[str, str]]:
    shapes = {
        "fits": {"speculative_num_steps": 4, "internal_states": [{"avg_spec_accept_length": 4.3}]},
        "misses": {
            "speculative_num_steps": 4,
            "internal_states": [{"avg_spec_accept_length": 1.1}],
        },
        "fresh": {"speculative_num_steps": 4, "internal_states": [{}]},
    }
    shapes["half"] = {
        "speculative_num_steps": 4,
        "speculative_draft_model_path": "/drafts/v3",
        "internal_states": [{"avg_spec_accept_length": 1.9}],
    }
    started = {name: _server(info) for name, info in shapes.items()}
    yield {name: f"http://127.0.0.1:{s.server_address[1]}" for name, s in started.items()}
    for server in started.values():
        server.shutdown()
        server.server_close()


def test_recommended_k_per_server(servers: dict[str, str]) -> None:
    fleet = FleetManager(list(servers.values()))
    choices = fleet.recommended_k(draft_cost_ratio=0.1)
    fits, misses = choices[servers["fits"]], choices[servers["misses"]]
    assert fits is not None and misses is not None
    assert fits.k == 4 and misses.k == 0
    assert choices[servers["fresh"]] is None  # no verify yet: nothing to recommend from
    assert fits == recommend_k(4.3, 4, draft_cost_ratio=0.1)
    states = {state.url: state for state in fleet.status()}
    assert states[servers["fits"]].speculative_num_steps == 4


_LAUNCHER = """
import sys, httpx
url, draft, version, k = sys.argv[1:5]
assert (draft, version) == ("/drafts/v3", "v1"), (draft, version)  # kept as served
httpx.post(f"{url}/relaunch", json={"k": int(k)}).raise_for_status()
"""


def test_tune_k_applies_the_recommendation_through_the_restart_command(
    servers: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tide fleet tune-k --apply``: a server whose acceptance pays a smaller k is
    relaunched at that k (draft and version kept); k=0 and unmeasured servers are not."""
    from tide_lib.cli import main

    half = recommend_k(1.9, 4, draft_cost_ratio=0.1)
    assert 1 <= half.k < 4  # the fixture's "half" server is one to relaunch
    urls = ",".join(servers.values())
    args = ["fleet", "tune-k", "--servers", urls, "--draft-cost-ratio", "0.1"]
    monkeypatch.delenv("TIDE_FLEET__ROLLOUT", raising=False)
    assert main([*args, "--apply"]) == 1  # hot-swap rollout: k cannot be applied
    script = tmp_path / "launcher.py"
    script.write_text(_LAUNCHER)
    monkeypatch.setenv("TIDE_FLEET__ROLLOUT", "restart")
    monkeypatch.setenv(
        "TIDE_FLEET__RESTART_COMMAND",
        f"{sys.executable} {script} {{url}} {{draft}} {{weight_version}} {{num_steps}}",
    )
    assert main(args) == 0  # a report only
    fleet = FleetManager(list(servers.values()))
    assert {s.url: s.speculative_num_steps for s in fleet.status()}[servers["half"]] == 4
    assert main([*args, "--apply"]) == 0
    states = {s.url: s.speculative_num_steps for s in fleet.status()}
    assert states == {
        servers["fits"]: 4,  # already right
        servers["misses"]: 4,  # plain decoding would pay: reported, not applied
        servers["fresh"]: 4,  # nothing measured yet
        servers["half"]: half.k,
    }
