"""A stand-in SGLang server made of one released wheel's own code, for the fleet client.

No GPU here, so no real SGLang server: this app mounts the routes TIDE calls
with the wheel's own pieces: ``UpdateWeightFromDiskReqInput`` and its output
(executed from ``srt/managers/io_struct.py``: dataclasses in 0.5.14, msgspec
Structs in 0.5.23), the auth middleware and levels (``srt/utils/auth.py``, loaded
from its file), the response shapes of ``/model_info`` and ``/server_info`` with
the wheel's version, and ``/get_weight_version`` only where the wheel routes it
(404). What it cannot have is a model: it "loads" any draft path listed in
``loadable`` and refuses the rest, as the scheduler would.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from typing import Any

from fastapi import FastAPI, HTTPException

from tests.contract.sglang_release import VERSIONS, Release, release

LATEST = VERSIONS[-1]


def _as_dict(request: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(request) and not isinstance(request, type):
        return dataclasses.asdict(request)
    import msgspec

    return msgspec.structs.asdict(request)


@dataclasses.dataclass
class StubState:
    weight_version: str = "default"  # SGLang's default
    launch_draft: str = "/models/launch-draft"
    loadable: set[str] = dataclasses.field(default_factory=set)
    updates: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def create_stub(
    state: StubState,
    *,
    api_key: str | None,
    admin_api_key: str | None,
    wheel: Release | None = None,
) -> FastAPI:
    """The stub of ``wheel`` (default: the latest supported release)."""
    wheel = wheel or release(LATEST)
    models = wheel.request_models
    update_input = models["UpdateWeightFromDiskReqInput"]
    update_output = models["UpdateWeightFromDiskReqOutput"]
    auth = wheel.load_file_module("sglang.srt.utils.auth")
    http = "sglang.srt.entrypoints.http_server"
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": "/models/target", "weight_version": state.weight_version}

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        # launch arguments: the draft path never changes after a swap
        return {
            "speculative_draft_model_path": state.launch_draft,
            "weight_version": state.weight_version,
            "internal_states": [{}],  # no verify yet: no avg_spec_accept_length
            "version": wheel.version,
        }

    if ("GET", "/get_weight_version") in wheel.routes(http):

        @app.get("/get_weight_version")
        async def weight_version() -> None:
            raise HTTPException(status_code=404, detail="deprecated, use /model_info")

    async def update_weights_from_disk(obj: Any) -> Any:
        state.updates.append(_as_dict(obj))
        success = obj.model_path in state.loadable
        if success and obj.weight_version is not None:
            state.weight_version = obj.weight_version
        result = update_output(success=success, message="ok" if success else "cannot load")
        status = 200 if success else 400
        from fastapi.responses import JSONResponse

        body = {"success": result.success, "message": result.message}
        return JSONResponse(body, status_code=status)

    # SGLang's signature, `obj: UpdateWeightFromDiskReqInput`, with the released class
    from typing import Annotated

    from fastapi import Body

    body = Annotated[update_input, Body()] if wheel.msgspec else update_input
    update_weights_from_disk.__annotations__["obj"] = body
    app.post("/update_weights_from_disk")(
        auth.auth_level(auth.AuthLevel.ADMIN_OPTIONAL)(update_weights_from_disk)
    )

    auth.add_api_key_middleware(app, api_key=api_key, admin_api_key=admin_api_key)
    return app


class StubServer:
    """The stub on a free loopback port, in a thread of this process."""

    def __init__(self, app: FastAPI) -> None:
        import uvicorn

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the SGLang stub did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
