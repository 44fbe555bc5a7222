"""The fleet recommends the k a fixed-k (SGLang) server should be relaunched with."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tide_lib.serving.fleet import FleetManager
from tide_lib.serving.k_policy import recommend_k


def _server(info: dict[str, Any]) -> ThreadingHTTPServer:
    """``/health``, ``/model_info`` and ``/server_info`` shaped as SGLang 0.5.14 answers."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_args: object) -> None:
            return

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
