"""``tide serve``: the reference engine behind SGLang 0.5.14's HTTP API (the subset TIDE uses).

Same paths, field names and shapes as SGLang: ``POST /generate``, ``GET /health``,
``GET /model_info`` (``weight_version``), ``GET /server_info`` (``/get_server_info``
is its deprecated alias), ``GET /metrics`` (``sglang:`` names) and
``POST /update_weights_from_disk`` (``model_path`` a draft directory or a
``models:/``, ``runs:/`` or ``s3://`` URI; ``is_draft_model`` is accepted and
ignored, as SGLang drops it), behind SGLang's bearer keys (:mod:`.auth`).
``GET /get_weight_version`` stays for TIDE's own tools; SGLang answers it 404.
Anything TIDE does against this server it can do against a real SGLang fleet.
A request names its traffic segment as SGLang labels requests, ``custom_labels``
(``{"segment": "ko_law"}``) in the body or the ``x-custom-labels`` JSON header,
or with ``X-TIDE-Segment``; ``/server_info`` and ``/metrics`` show the k the
engine serves with (``sglang:spec_num_steps``), its cost estimates and the
expected tokens/s at each k.
Malformed or hostile requests get a 400 with a message; the server keeps serving.

Nothing a client sends can stall it: bodies over ``serve.max_request_bytes`` get
413 before they are parsed, text is tokenised off the event loop, a full queue
answers 503 with ``Retry-After``, and a request whose client hung up is
cancelled before it takes the worker. Drafts load only from the configured
sources (:mod:`.draft_sources`); a server bound beyond loopback refuses to start
without both bearer keys.
"""

from __future__ import annotations

__all__ = ["GenerateRequest", "UpdateWeightsRequest", "create_app", "run_server"]

import asyncio
import json
import logging
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tide_lib.config import ServeConfig, TideConfig
from tide_lib.lake.schema import SEGMENT_LABEL, segment_problem
from tide_lib.serving.auth import InsecureBindError, decide, require_keys_off_loopback
from tide_lib.serving.draft_sources import DraftRefusedError
from tide_lib.serving.engine import (
    Engine,
    EngineBusyError,
    EngineRequest,
    EngineResult,
    RequestError,
)
from tide_lib.serving.metrics import CONTENT_TYPE
from tide_lib.serving.sglang_swap import is_draft_reference
from tide_lib.training.draft import InvalidCheckpointError

logger = logging.getLogger(__name__)


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    ignore_eos: bool = False


def _encodable(value: str | None) -> str | None:
    """Text must be valid Unicode (JSON admits lone surrogates, UTF-8 does not)."""
    if value is not None:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError("is not valid Unicode (it holds a lone surrogate)") from error
    return value


SEGMENT_HEADER = "x-tide-segment"
CUSTOM_LABELS_HEADER = "x-custom-labels"  # SGLang's --tokenizer-metrics-custom-labels-header
_MAX_CUSTOM_LABELS = 16


def _labels(value: dict[str, str] | None) -> dict[str, str] | None:
    """SGLang's ``custom_labels``: a few short labels; ``segment`` must be a valid segment."""
    if value is None:
        return None
    if len(value) > _MAX_CUSTOM_LABELS:
        raise ValueError(f"at most {_MAX_CUSTOM_LABELS} labels, got {len(value)}")
    for key, label in value.items():
        _encodable(key)
        _encodable(label)
        if len(key) > 64 or len(label) > 256:
            raise ValueError(f"label {key[:64]!r} is too long (keys 64, values 256 characters)")
    problem = segment_problem(value.get(SEGMENT_LABEL))
    if problem is not None:
        raise ValueError(f"{SEGMENT_LABEL}: {problem}")
    return value


class GenerateRequest(BaseModel):
    """SGLang's ``GenerateReqInput`` subset: ``text`` or ``input_ids``, sampling params, labels.

    ``custom_labels`` is SGLang's per-request label dict; its ``segment`` entry names the
    traffic segment, which capture records and the adaptive k keys its acceptance by.
    """

    model_config = ConfigDict(extra="forbid")

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = SamplingParams()
    rid: str | None = Field(None, max_length=256)
    custom_labels: dict[str, str] | None = None

    _unicode = field_validator("text", "rid")(_encodable)
    _custom_labels = field_validator("custom_labels")(_labels)

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        if self.text is not None and not self.text.strip():
            raise ValueError("text is empty")
        return self


class UpdateWeightsRequest(BaseModel):
    """SGLang's ``UpdateWeightFromDiskReqInput`` subset."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(min_length=1, max_length=4096)
    is_draft_model: bool = False  # dropped by SGLang 0.5.14; accepted here, ignored
    weight_version: str | None = Field(None, max_length=256)
    load_format: str | None = None

    _unicode = field_validator("model_path", "weight_version", "load_format")(_encodable)


class _JSON(JSONResponse):
    """JSON with non-ASCII escaped: an echoed odd character can never fail a response."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False).encode("ascii")


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    content = {"error": {"message": message, "code": status}}
    return _JSON(status_code=status, content=content, headers=headers)


class _Guard:
    """Bearer keys and the body-size limit, checked before FastAPI reads a request."""

    def __init__(self, app: ASGIApp, serve: ServeConfig) -> None:
        self.app = app
        self.serve = serve

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        serve = self.serve
        status = decide(
            scope["path"],
            headers.get("authorization"),
            serve.api_key,
            serve.admin_api_key,
            admin_force=serve.admin_key_required,
        )
        if status != 200:
            message = (
                "missing or wrong bearer key (Authorization: Bearer <key>)"
                if status == 401
                else "admin routes are off: this server has no admin key; start it with "
                "TIDE_SERVE__ADMIN_API_KEY set"
            )
            await _error(status, message)(scope, receive, send)
            return
        body = await self._body(headers, receive)
        if body is None:
            limit = serve.max_request_bytes
            message = f"the request body exceeds {limit} bytes (--max-request-bytes)"
            await _error(413, message)(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _body(self, headers: Headers, receive: Receive) -> bytes | None:
        """The whole body, or None past the limit (read no further than the limit)."""
        limit = self.serve.max_request_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return None
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client went away; the app sees it on its next receive
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()  # http.disconnect once the client hangs up
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


_DISCONNECT_POLL_S = 0.2


async def _result(future: Any, request: Request) -> EngineResult | None:
    """The engine's result, or None once the client hung up (its request is cancelled)."""
    waiting = asyncio.wrap_future(future)
    while True:
        done, _ = await asyncio.wait({waiting}, timeout=_DISCONNECT_POLL_S)
        if done:
            result: EngineResult = waiting.result()
            return result
        if await request.is_disconnected():
            future.cancel()  # frees its place in the queue unless the worker took it
            return None


def create_app(engine: Engine) -> FastAPI:
    """SGLang's HTTP API over ``engine``: each route is a few lines; the answers are built
    by the functions below it."""
    app = FastAPI(title="TIDE reference engine", description=__doc__, default_response_class=_JSON)
    app.add_middleware(_Guard, serve=engine.serve)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, error: RequestValidationError) -> JSONResponse:
        def where(item: dict[str, Any]) -> str:
            return ".".join(str(part) for part in item["loc"] if part != "body") or "body"

        details = "; ".join(f"{where(item)}: {item['msg']}" for item in error.errors())
        return _error(400, f"invalid request: {details}")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": str(engine.target_dir),
            "is_generation": True,
            "weight_version": engine.weight_version,
            "architectures": list(engine.target.config.architectures or []),
        }

    @app.post("/generate")
    async def generate(body: GenerateRequest, http: Request) -> Any:
        try:
            segment = request_segment(body, http.headers)
            future = engine.submit(await _engine_request(engine, body, segment))
        except RequestError as error:
            return _error(400, str(error))
        except EngineBusyError as error:
            return _error(503, str(error), headers={"Retry-After": "1"})
        result = await _result(future, http)
        if result is None:
            return _error(499, "the client closed the request")
        return _generate_response(result)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return _server_info(engine)

    @app.get("/get_weight_version")
    async def weight_version() -> dict[str, str]:
        return {"weight_version": engine.weight_version}

    @app.post("/update_weights_from_disk")
    async def update_weights(body: UpdateWeightsRequest) -> Any:
        return await _update_weights(engine, body)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    return app


def _generate_response(result: EngineResult) -> dict[str, Any]:
    """``/generate``'s answer, with SGLang's ``meta_info`` names."""
    return {
        "text": result.text,
        "output_ids": result.output_ids,
        "meta_info": {
            "id": result.rid,
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "finish_reason": {"type": result.finish_reason},
            "spec_verify_ct": result.spec_verify_ct,
            "spec_accept_length": result.spec_accept_length,
            "weight_version": result.weight_version,
            "e2e_latency": result.e2e_latency,
        },
    }


def _server_info(engine: Engine) -> dict[str, Any]:
    """``/server_info``: SGLang's fields; ``internal_states`` holds the acceptance length
    pooled since the last draft swap."""
    serve = engine.serve
    choice = engine.k_controller.snapshot()
    return {
        "model_path": str(engine.target_dir),
        "served_model_name": engine.target_id,
        "speculative_algorithm": "EAGLE3" if engine.speculative else None,
        "speculative_draft_model_path": engine.draft_path,
        "speculative_num_steps": serve.speculative_num_steps,
        "speculative_eagle_topk": serve.speculative_eagle_topk,
        "speculative_num_draft_tokens": serve.speculative_num_steps + 1,
        "weight_version": engine.weight_version,
        "capture": serve.capture,
        "speculative_adaptive": serve.speculative_adaptive,
        "internal_states": [
            {
                "avg_spec_accept_length": engine.avg_accept_length(),
                "num_requests": engine.counters.requests,
                "spec_num_steps": choice["chosen_k"],
                "speculation": choice,
            }
        ],
    }


async def _update_weights(engine: Engine, body: UpdateWeightsRequest) -> Any:
    """A draft-only hot swap: 400 for a draft refused or flawed (the old one keeps
    serving), 503 when queued requests hold it back."""
    try:
        local = engine.sources.resolve(body.model_path)
    except DraftRefusedError as error:
        logger.warning("refused draft: %s", error)
        return _JSON(status_code=400, content={"success": False, "message": str(error)})
    if isinstance(local, Path) and not is_draft_reference(str(local)):
        return _error(
            400,
            f"{body.model_path} is not an EAGLE3 draft (config.json architectures lacks "
            "LlamaForCausalLMEagle3): this engine hot-swaps draft models only",
        )
    version = body.weight_version or body.model_path
    try:
        await asyncio.to_thread(engine.swap_draft, body.model_path, version)
    except TimeoutError as error:
        logger.warning("draft swap to %s is late: %s", version, error)
        return _JSON(
            status_code=503,
            content={
                "success": False,
                "message": f"{error}: the requests queued before it are still running; it "
                "applies once they finish (watch /model_info)",
            },
        )
    except (InvalidCheckpointError, ValueError, OSError, KeyError) as error:
        logger.warning("refused draft %s: %s", body.model_path, error)
        return _JSON(
            status_code=400,
            content={"success": False, "message": f"refused draft {body.model_path}: {error}"},
        )
    return {"success": True, "message": f"serving {body.model_path}", "weight_version": version}


def request_segment(body: GenerateRequest, headers: Headers) -> str | None:
    """The request's segment label: ``custom_labels.segment``, or a header naming one.

    Headers: ``X-TIDE-Segment: <label>``, or SGLang's ``x-custom-labels`` JSON object with a
    ``segment`` key. Labels given twice must agree. Raises :class:`RequestError` (400).
    """
    given: dict[str, str] = {}
    if body.custom_labels and SEGMENT_LABEL in body.custom_labels:
        given["custom_labels.segment"] = body.custom_labels[SEGMENT_LABEL]
    raw = headers.get(CUSTOM_LABELS_HEADER)
    if raw is not None:
        try:
            labels = json.loads(_header_text(raw, CUSTOM_LABELS_HEADER))
        except ValueError as error:
            raise RequestError(
                f"{CUSTOM_LABELS_HEADER} header: not a JSON object of labels ({error})"
            ) from error
        if not isinstance(labels, dict):
            raise RequestError(f"{CUSTOM_LABELS_HEADER} header: not a JSON object of labels")
        if SEGMENT_LABEL in labels:
            given[f"{CUSTOM_LABELS_HEADER} header"] = labels[SEGMENT_LABEL]
    raw = headers.get(SEGMENT_HEADER)
    if raw is not None:
        given["X-TIDE-Segment header"] = _header_text(raw, "X-TIDE-Segment")
    for where, label in given.items():
        problem = segment_problem(label)
        if problem is not None:
            raise RequestError(f"{where}: {problem}")
    if len(set(given.values())) > 1:
        raise RequestError(f"the segment label is given twice, differently: {given}")
    return next(iter(given.values()), None)


def _header_text(raw: str, name: str) -> str:
    """A header's value as UTF-8 text (Starlette hands it over decoded as Latin-1)."""
    try:
        return raw.encode("latin-1").decode("utf-8")
    except UnicodeError as error:
        raise RequestError(f"{name} header: not UTF-8 text") from error


async def _engine_request(
    engine: Engine, body: GenerateRequest, segment: str | None = None
) -> EngineRequest:
    """The engine's request; text is tokenised in a thread, never on the event loop."""
    input_ids = body.input_ids
    if input_ids is None:
        try:
            input_ids = await asyncio.to_thread(engine.encode, body.text or "")
        except Exception as error:  # the tokenizer's own errors: reported, never a 500
            raise RequestError(f"text cannot be tokenised: {error}") from error
    params = body.sampling_params
    return EngineRequest(
        input_ids=input_ids,
        max_new_tokens=params.max_new_tokens,
        temperature=params.temperature,
        seed=params.seed,
        rid=body.rid or uuid.uuid4().hex,
        ignore_eos=params.ignore_eos,
        segment=segment,
    )


def run_server(config: TideConfig) -> None:
    """Serve until stopped; refuses to start beyond loopback without both bearer keys."""
    import uvicorn  # noqa: PLC0415

    try:
        require_keys_off_loopback(config.serve)
    except InsecureBindError as error:
        logger.error("%s", error)
        raise SystemExit(2) from error
    engine = Engine(config)
    logger.info(
        "serving %s on http://%s:%d (draft %s, k=%d, capture %s)",
        engine.target_id,
        config.serve.host,
        config.serve.port,
        engine.draft_path or "none",
        config.serve.speculative_num_steps,
        "on" if engine.writer else "off",
    )
    try:
        uvicorn.run(
            create_app(engine), host=config.serve.host, port=config.serve.port, log_level="warning"
        )
    finally:
        engine.close()
