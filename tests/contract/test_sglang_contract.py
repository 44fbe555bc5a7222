"""Every SGLang name TIDE relies on, checked against the released sglang==0.5.14 source.

A rename in a future pin fails here, not in a production promotion. What is
checked: the HTTP routes the fleet client calls and their auth levels, the
fields of ``UpdateWeightFromDiskReqInput`` and of ``/model_info``, the auth
rules (run from SGLang's own ``auth.py`` against TIDE's), the Prometheus names
the reference engine shares with SGLang, the ``ServerArgs`` fields and flags
behind ``sglang_launch_args``, the capture plugin's hook targets and their
signatures, and the ``Req`` fields it reads. Then the fleet client against a
stub made of SGLang's own request models and auth middleware, keys on.
"""

from __future__ import annotations

import itertools
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from tests.contract import sglang_release as release
from tests.contract.sglang_stub import StubServer, StubState, create_stub
from tide_lib.serving import auth, sglang_plugin
from tide_lib.serving.fleet import (
    EngineClient,
    FleetError,
    FleetManager,
    RestartLauncher,
    sglang_launch_args,
)

HTTP = "sglang.srt.entrypoints.http_server"
IO = "sglang.srt.managers.io_struct"


@pytest.fixture(scope="module")
def routes() -> dict[tuple[str, str], tuple[str, str | None]]:
    return release.routes(HTTP)


def test_the_wheel_is_the_pinned_release() -> None:
    version = release.module_file("sglang._version").read_text()
    assert f'"{release.VERSION}"' in version or f"'{release.VERSION}'" in version
    assert sglang_plugin.SUPPORTED_SGLANG_VERSION == release.VERSION


@pytest.mark.parametrize(
    ("method", "path", "level"),
    [
        ("GET", "/health", None),
        ("GET", "/model_info", None),
        ("GET", "/server_info", None),
        ("POST", "/generate", None),
        ("POST", "/update_weights_from_disk", "ADMIN_OPTIONAL"),
    ],
)
def test_the_routes_the_fleet_calls_exist(
    routes: dict[tuple[str, str], tuple[str, str | None]], method: str, path: str, level: str | None
) -> None:
    assert (method, path) in routes, f"sglang {release.VERSION} has no {method} {path}"
    assert routes[(method, path)][1] == level
    assert (path in auth.ADMIN_ROUTES) == (level is not None)  # TIDE's engine agrees


def test_get_weight_version_is_gone_and_model_info_carries_the_version() -> None:
    body = release.function(HTTP, "weight_version")
    raised = [n for n in body.body if type(n).__name__ == "Raise"]
    assert raised and "404" in release.ast.unparse(raised[0])  # the fleet must not use it
    keys = {
        node.value
        for node in release.ast.walk(release.function(HTTP, "model_info"))
        if isinstance(node, release.ast.Constant)
    }
    assert "weight_version" in keys


def test_update_weights_request_has_the_fields_the_client_sends() -> None:
    fields = release.dataclass_fields(IO, "UpdateWeightFromDiskReqInput")
    assert {"model_path", "weight_version"} <= fields
    assert "is_draft_model" not in fields  # dropped: a draft-only swap needs TIDE's plugin
    sent = _sent_update_fields()
    assert sent <= fields, f"the fleet client sends fields SGLang drops: {sent - fields}"


def _sent_update_fields() -> set[str]:
    """The JSON keys ``EngineClient.update_draft`` posts (read from its source)."""
    import inspect

    source = inspect.getsource(EngineClient.update_draft)
    payload = re.search(r"json=\{(.*?)\}", source, re.S)
    assert payload is not None
    return set(re.findall(r'"(\w+)":', payload.group(1)))


def test_tide_auth_decides_as_sglang_does() -> None:
    sglang = release.load_file_module("sglang.srt.utils.auth")
    keys = [None, "k-api", "k-admin"]
    headers = [None, "Bearer k-api", "Bearer k-admin", "Bearer wrong", "Basic k-api"]
    paths = {
        "/generate": sglang.AuthLevel.NORMAL,
        "/model_info": sglang.AuthLevel.NORMAL,
        "/update_weights_from_disk": sglang.AuthLevel.ADMIN_OPTIONAL,
        "/health": sglang.AuthLevel.NORMAL,
        "/metrics": sglang.AuthLevel.NORMAL,
    }
    for (path, level), api, admin, header in itertools.product(
        paths.items(), keys[:2], [None, "k-admin"], headers
    ):
        theirs = sglang.decide_request_auth(
            method="GET",
            path=path,
            authorization_header=header,
            api_key=api,
            admin_api_key=admin,
            auth_level=level,
        ).allowed
        ours = auth.allowed(
            path, header, SecretStr(api) if api else None, SecretStr(admin) if admin else None
        )
        assert ours == theirs, (path, api, admin, header)
        # TIDE's default for admin routes is SGLang's stricter ADMIN_FORCE level.
        force = sglang.AuthLevel.ADMIN_FORCE if level == sglang.AuthLevel.ADMIN_OPTIONAL else level
        theirs_forced = sglang.decide_request_auth(
            method="GET",
            path=path,
            authorization_header=header,
            api_key=api,
            admin_api_key=admin,
            auth_level=force,
        )
        ours_forced = auth.decide(
            path,
            header,
            SecretStr(api) if api else None,
            SecretStr(admin) if admin else None,
            admin_force=True,
        )
        expected = 200 if theirs_forced.allowed else theirs_forced.error_status_code or 401
        assert ours_forced == expected, ("forced", path, api, admin, header)
        sent = auth.bearer_for(
            path, SecretStr(api) if api else None, SecretStr(admin) if admin else None
        ).get("Authorization")
        assert sglang.decide_request_auth(
            method="GET",
            path=path,
            authorization_header=sent,
            api_key=api,
            admin_api_key=admin,
            auth_level=level,
        ).allowed, f"the fleet client's header is refused on {path} ({api=}, {admin=})"


def test_prometheus_names_shared_with_sglang_exist() -> None:
    names = release.string_constants("sglang.srt.observability.metrics_collector")
    shared = {
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:num_requests_total",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:spec_accept_length",
    }
    # Counters are registered without the _total suffix prometheus_client adds.
    found = names | {f"{name}_total" for name in names}
    assert shared <= found, shared - found


def test_launch_args_name_real_server_args() -> None:
    fields = release.dataclass_fields("sglang.srt.server_args", "ServerArgs")
    flags = [arg for arg in sglang_launch_args("/t", "/d") if arg.startswith("--")]
    for flag in flags:
        assert flag[2:].replace("-", "_") in fields, f"ServerArgs has no field for {flag}"
    # the CLI flags are derived from the field names (dashes for underscores)
    derive = release.module_file("sglang.srt.arg_groups.arg_utils").read_text()
    assert 'replace("_", "-")' in derive
    assert {"api_key", "admin_api_key", "weight_version"} <= fields


def test_plugin_hook_targets_and_signatures() -> None:
    module, _, qualified = sglang_plugin._LOGITS_TARGET.rpartition(".")
    module, _, class_name = module.rpartition(".")
    forward = release.parameters(release.method(module, class_name, qualified))
    # _keep_final_states reads args[1] after (input_ids, hidden_states): logits_metadata
    assert forward[:5] == ["self", "input_ids", "hidden_states", "lm_head", "logits_metadata"]
    worker_module, _, worker = sglang_plugin._WORKER.rpartition(".")
    generate = release.parameters(release.method(worker_module, worker, "forward_batch_generation"))
    assert generate[:2] == ["self", "batch"]
    update = release.parameters(release.method(worker_module, worker, "update_weights_from_disk"))
    assert update == ["self", "recv_req"]
    registry = release.class_def("sglang.srt.plugins.hook_registry", "HookRegistry")
    assert any(getattr(node, "name", "") == "register" for node in registry.body)


def test_the_label_hooks_match_sglang() -> None:
    """custom_labels reaches the tokenizer only; the tokenized request carries it over."""
    assert "custom_labels" in release.dataclass_fields(IO, "GenerateReqInput")
    assert "custom_labels" not in release.dataclass_fields(IO, "TokenizedGenerateReqInput")
    for name in ("TokenizedGenerateReqInput", "BaseReq"):  # no slots: an attribute pickles along
        decorators = release.class_def(IO, name).decorator_list
        assert [release.ast.unparse(d) for d in decorators] == ["dataclass"], name
    module, _, qualified = sglang_plugin._TOKENIZE_TARGET.rpartition(".")
    module, _, class_name = module.rpartition(".")
    assert release.parameters(release.method(module, class_name, qualified))[:2] == ["self", "obj"]
    module, _, qualified = sglang_plugin._RECEIVE_TARGET.rpartition(".")
    module, _, class_name = module.rpartition(".")
    handler = release.method(module, class_name, qualified)
    assert release.parameters(handler) == ["self", "recv_req"]
    first_args = [  # Req(recv_req.rid, ...): the id capture looks the label up by
        release.ast.unparse(node.args[0])
        for node in release.ast.walk(handler)
        if isinstance(node, release.ast.Call)
        and release.ast.unparse(node.func) == "Req"
        and node.args
    ]
    assert first_args and set(first_args) == {"recv_req.rid"}


def test_req_fields_the_plugin_reads() -> None:
    fields = release.self_attributes("sglang.srt.managers.schedule_batch", "Req")
    read = {
        "rid",
        "origin_input_ids",
        "output_ids",
        "spec_verify_ct",
        "spec_num_correct_drafts",
        "finished_reason",
        "finished_len",
    }
    assert read <= fields, read - fields
    methods = release.class_def("sglang.srt.managers.schedule_batch", "Req").body
    assert any(getattr(node, "name", "") == "finished" for node in methods)


def test_sglang_own_requests_are_recognisable() -> None:
    """Health checks (rid prefix) and the warm-up prompt, which the plugin never captures."""
    constants = release.module_ast("sglang.srt.constants")
    assigned = {
        node.targets[0].id: node.value.value
        for node in constants.body
        if isinstance(node, release.ast.Assign)
        and isinstance(node.targets[0], release.ast.Name)
        and isinstance(node.value, release.ast.Constant)
    }
    assert assigned["HEALTH_CHECK_RID_PREFIX"] == sglang_plugin.HEALTH_CHECK_RID_PREFIX
    warmup = release.function(HTTP, "_execute_server_warmup")
    texts = {
        node.value for node in release.ast.walk(warmup) if isinstance(node, release.ast.Constant)
    }
    assert sglang_plugin.WARMUP_TEXT in texts


def test_the_checker_catches_a_renamed_name() -> None:
    """The checks above can fail: a name SGLang does not have is reported."""
    with pytest.raises(AssertionError, match="has no method"):
        release.method(IO, "UpdateWeightFromDiskReqInput", "renamed_method")
    with pytest.raises(AssertionError, match="no class"):
        release.class_def(IO, "UpdateWeightFromDiskReqInputRenamed")
    fields = release.dataclass_fields(IO, "UpdateWeightFromDiskReqInput")
    assert "is_draft_model_renamed" not in fields


# -- the fleet client against SGLang's own request models and auth, keys on -----------------


@pytest.fixture
def stub() -> Iterator[tuple[StubServer, StubState]]:
    state = StubState(loadable={"models:/tide-draft-tiny/2", "models:/tide-draft-tiny/1"})
    server = StubServer(create_stub(state, api_key="k-api", admin_api_key="k-admin"))
    yield server, state
    server.stop()


def _client(url: str, api: str | None, admin: str | None) -> EngineClient:
    return EngineClient(
        url,
        api_key=SecretStr(api) if api else None,
        admin_api_key=SecretStr(admin) if admin else None,
        read_attempts=1,
    )


def test_the_client_needs_the_right_keys(stub: tuple[StubServer, StubState]) -> None:
    server, state = stub
    for api, admin in ((None, None), ("wrong", "wrong"), ("k-api", None)):
        client = _client(server.url, api, admin)
        with pytest.raises(FleetError):
            client.update_draft("models:/tide-draft-tiny/2", "v2")
    assert state.updates == []  # refused before SGLang's handler saw them
    assert not _client(server.url, None, None).state().healthy  # /server_info needs the key
    client = _client(server.url, "k-api", "k-admin")
    assert client.weight_version() == "default"
    client.update_draft("models:/tide-draft-tiny/2", "tide-draft-tiny-v2")
    assert client.weight_version() == "tide-draft-tiny-v2"
    assert state.updates[-1]["model_path"] == "models:/tide-draft-tiny/2"
    assert client.state().avg_accept_length is None  # no verify yet: guarded


def test_a_failed_promotion_ends_on_the_registry_champion(
    stub: tuple[StubServer, StubState],
) -> None:
    """The rollback target is the registry's champion, not /server_info's launch draft."""
    server, state = stub
    other_state = StubState(loadable={"models:/tide-draft-tiny/1"})  # cannot load v2
    other = StubServer(create_stub(other_state, api_key="k-api", admin_api_key="k-admin"))
    try:
        fleet = FleetManager(
            [server.url, other.url], api_key=SecretStr("k-api"), admin_api_key=SecretStr("k-admin")
        )
        with pytest.raises(FleetError, match="rolled back"):
            fleet.promote(
                "models:/tide-draft-tiny/2",
                "tide-draft-tiny-v2",
                rollback_to=("models:/tide-draft-tiny/1", "tide-draft-tiny-v1"),
            )
        assert state.updates[-1]["model_path"] == "models:/tide-draft-tiny/1"
        assert state.weight_version == "tide-draft-tiny-v1"
        assert all(u["model_path"] != state.launch_draft for u in state.updates)
    finally:
        other.stop()


_LAUNCHER = """
import sys, httpx
url, draft, version = sys.argv[1:4]
if url.endswith(sys.argv[4]):
    sys.exit("this host's launcher is broken")
# a relaunch with --speculative-draft-model-path draft --weight-version version
httpx.post(f"{url}/update_weights_from_disk", json={"model_path": draft, "weight_version": version},
           headers={"Authorization": "Bearer k-admin"}).raise_for_status()
"""


def test_restart_rollout_relaunches_in_turn_and_rolls_back_the_same_way(
    stub: tuple[StubServer, StubState], tmp_path: Path
) -> None:
    """For fleets without TIDE's plugin: each server relaunched with the new draft, in turn."""
    server, state = stub
    other_state = StubState(loadable={"models:/tide-draft-tiny/1", "models:/tide-draft-tiny/2"})
    other = StubServer(create_stub(other_state, api_key="k-api", admin_api_key="k-admin"))
    script = tmp_path / "launcher.py"
    script.write_text(_LAUNCHER)
    keys = {"api_key": SecretStr("k-api"), "admin_api_key": SecretStr("k-admin")}
    try:
        template = f"{sys.executable} {script} {{url}} {{draft}} {{weight_version}} no-such-port"
        fleet = FleetManager(
            [server.url, other.url], launcher=RestartLauncher(template, poll_s=0.1), **keys
        )
        fleet.promote("models:/tide-draft-tiny/2", "tide-draft-tiny-v2")
        assert state.weight_version == other_state.weight_version == "tide-draft-tiny-v2"
        broken = f"{sys.executable} {script} {{url}} {{draft}} {{weight_version}} {other.port}"
        fleet = FleetManager(
            [server.url, other.url], launcher=RestartLauncher(broken, poll_s=0.1), **keys
        )
        with pytest.raises(FleetError, match="broken"):
            fleet.promote(
                "models:/tide-draft-tiny/1",
                "tide-draft-tiny-v1",
                rollback_to=("models:/tide-draft-tiny/2", "tide-draft-tiny-v2"),
            )
        # the first server was relaunched with v1, then back with the champion
        assert [u["weight_version"] for u in state.updates[-2:]] == [
            "tide-draft-tiny-v1",
            "tide-draft-tiny-v2",
        ]
        assert state.weight_version == other_state.weight_version == "tide-draft-tiny-v2"
    finally:
        other.stop()
