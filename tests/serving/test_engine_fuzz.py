"""D: every route of the reference engine fuzzed from its own OpenAPI, /health watched throughout.

Requests are drawn with Hypothesis (derandomized: the same inputs on every run, so CI
cannot flake) from the schemas the app publishes, plus arbitrary JSON, raw bytes and
hostile strings. No input may produce a 5xx, and /health, polled from another thread
the whole time, must answer within 1 s.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import ADMIN_AUTH
from tests.serving.conftest import HealthWatch, start_engine
from tide_lib.config import TideConfig
from tide_lib.serving.process import EngineProcess

pytestmark = pytest.mark.slow

EXAMPLES_PER_ROUTE = 60
HOSTILE_STRINGS = [
    "",
    " ",
    "\ud800",
    "\x00",
    "../../etc/passwd",
    "/etc",
    "/",
    "s3://",
    "s3://tide-artifacts/drafts/../x",
    "models:/",
    "models:/tide-draft-tiny/champion",
    "runs:/nope/draft",
    "mlflow-artifacts:/x",
    "a" * 5000,
]
JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(st.characters(exclude_categories=[]), max_size=40),
    st.sampled_from(HOSTILE_STRINGS),
)
ANY_JSON = st.recursive(
    JSON_LEAF,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def fuzzed(
    stack: TideConfig,
    tiny_target: Path,
    tiny_drafts: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcess]:
    tmp = tmp_path_factory.mktemp("fuzz")
    draft = ["--speculative-draft-model-path", str(tiny_drafts["en"])]
    engine = start_engine(
        tmp,
        tiny_target,
        *draft,
        "--max-new-tokens-limit",
        "8",
        "--speculative-num-steps",
        "2",
        stack=stack,
    )
    yield engine
    engine.stop()


def _from_schema(schema: dict[str, Any], components: dict[str, Any], paths: list[str]) -> Any:
    """A Hypothesis strategy for values of a JSON schema (the subset FastAPI emits)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return _from_schema(components[name], components, paths)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([_from_schema(s, components, paths) for s in schema[key]])
    kind = schema.get("type")
    if kind == "object":
        props = {
            name: _from_schema(sub, components, paths)
            for name, sub in schema.get("properties", {}).items()
        }
        return st.fixed_dictionaries({}, optional=props)
    simple = {
        "integer": st.integers(min_value=-(2**70), max_value=2**70) | st.integers(-2, 1100),
        "number": st.floats(allow_nan=False) | st.floats(0, 2),
        "boolean": st.booleans(),
        "null": st.none(),
        "string": st.sampled_from(paths + HOSTILE_STRINGS)
        | st.text(st.characters(exclude_categories=[]), max_size=60),
    }
    if kind == "array":
        return st.lists(_from_schema(schema.get("items", {}), components, paths), max_size=12)
    return simple.get(kind, JSON_LEAF)


def _bodies(operation: dict[str, Any], components: dict[str, Any], paths: list[str]) -> Any:
    content = operation.get("requestBody", {}).get("content", {}).get("application/json")
    raw = st.binary(max_size=200) | st.sampled_from([b"", b"{", b"null", b"[]", b"1e999999"])
    encoded = ANY_JSON.map(lambda value: json.dumps(value).encode())
    if content is None:
        return st.one_of(st.none(), raw)
    shaped = _from_schema(content["schema"], components, paths).map(
        lambda value: json.dumps(value).encode()
    )
    return st.one_of(shaped, shaped, encoded, raw)


def test_d_no_input_to_any_route_gives_a_5xx_or_stalls_health(
    fuzzed: EngineProcess, tiny_drafts: dict[str, Path], tiny_target: Path
) -> None:
    """D: schemas from /openapi.json; every route, every method it declares."""
    spec = httpx.get(f"{fuzzed.url}/openapi.json", timeout=30).json()
    components = spec.get("components", {}).get("schemas", {})
    paths = [str(tiny_drafts["ko"]), str(tiny_drafts["en"]), str(tiny_target)]
    routes = [(path, method) for path, item in spec["paths"].items() for method in item]
    assert {"/generate", "/update_weights_from_disk", "/health", "/metrics"} <= {
        path for path, _ in routes
    }
    health = HealthWatch(fuzzed.url)
    failures: list[str] = []
    with httpx.Client(base_url=fuzzed.url, timeout=60) as client:
        for path, method in routes:
            operation = spec["paths"][path][method]
            _fuzz_route(client, path, method, _bodies(operation, components, paths), failures)
    latencies = health.stop()
    assert not failures, failures[:10]
    assert latencies and max(latencies) < 1.0, sorted(latencies)[-5:]
    assert httpx.get(f"{fuzzed.url}/health", timeout=5).status_code == 200


def _fuzz_route(
    client: httpx.Client, path: str, method: str, bodies: Any, failures: list[str]
) -> None:
    query = st.dictionaries(st.text(max_size=6), st.text(max_size=12), max_size=3)

    @settings(
        max_examples=EXAMPLES_PER_ROUTE,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(body=bodies, params=query)
    def one(body: bytes | None, params: dict[str, str]) -> None:
        # The admin key, so the swap handler itself is fuzzed rather than the key check.
        headers = {**ADMIN_AUTH, "content-type": "application/json"} if body is not None else {}
        response = client.request(
            method.upper(), path, content=body, params=params, headers=headers
        )
        if response.status_code >= 500:
            failures.append(f"{method.upper()} {path} {body!r:.200} -> {response.status_code}")

    one()
