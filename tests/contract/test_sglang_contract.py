"""Every SGLang name TIDE relies on, checked against each supported released wheel.

A rename in a release fails here, not in a production promotion. What is
checked, per wheel (the ``sglang`` fixture: 0.5.14 and 0.5.23): what the plugin
detects in it (:func:`~tide_lib.serving.sglang_api.detect`, the function the plugin
runs at load), and that the detection bites on wheels edited to lack what the
swap depends on; the HTTP routes the fleet client calls and their auth levels, the
fields of ``UpdateWeightFromDiskReqInput`` and of ``/model_info``, the auth rules
(run from SGLang's own ``auth.py`` against TIDE's), the Prometheus names the
reference engine shares with SGLang, the ``ServerArgs`` fields behind
``sglang_launch_args``, the hook targets the capture plugin uses, and the ``Req``
fields it reads. Then the fleet client against a stub made of each wheel's own
request models and auth middleware, keys on.
"""

from __future__ import annotations

import ast
import itertools
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from tests.contract.sglang_release import Release
from tests.contract.sglang_stub import StubServer, StubState, create_stub
from tide_lib.serving import auth, sglang_plugin
from tide_lib.serving.fleet import (
    EngineClient,
    FleetError,
    FleetManager,
    RestartLauncher,
    sglang_launch_args,
)
from tide_lib.serving.sglang_api import (
    BASE_SPEC,
    SCHEDULER,
    SUPPORTED_SGLANG_VERSIONS,
    WORKER,
    UnsupportedSGLangError,
    detect,
)

HTTP = "sglang.srt.entrypoints.http_server"
IO = "sglang.srt.managers.io_struct"


def test_each_wheel_is_its_release_and_the_plugin_reads_its_paths(sglang: Release) -> None:
    version = sglang.module_file("sglang._version").read_text()
    assert f"'{sglang.version}'" in version or f'"{sglang.version}"' in version
    api = detect(sglang.tree)
    assert api.version == sglang.version in SUPPORTED_SGLANG_VERSIONS
    # 0.5.14: the worker loads its draft, the flush asserts; since 0.5.21/0.5.22 the draft
    # runners' weight updaters load, the flush reports, the scheduler records the version
    latest = sglang.version != "0.5.14"
    assert api.draft_load == ("runners" if latest else "worker")
    assert api.flush_reports is api.records_weight_version is sglang.msgspec is latest


@pytest.mark.parametrize(
    ("module", "old", "new", "named"),
    [
        (  # the scheduler's dispatcher bypasses the manager the swap hooks
            SCHEDULER,
            "self.weight_updater.update_weights_from_disk",
            "self.update_weights_from_disk",
            "init_request_dispatcher",
        ),
        (
            WORKER,
            "self.draft_runner =",
            "self.draft_model_runner =",
            "EagleDraftWorker.draft_runner",
        ),
        ("sglang._version", "version = ", "version = '0.5.99' or ", "not a release TIDE supports"),
    ],
    ids=["dispatcher-bypass", "draft-runner-renamed", "unsupported-version"],
)
def test_a_wheel_edited_to_lack_what_the_swap_needs_is_refused_naming_it(
    sglang: Release, module: str, old: str, new: str, named: str
) -> None:
    with pytest.raises(UnsupportedSGLangError, match=re.escape(named)):
        detect(sglang.edited(module, old, new).tree)


def test_a_tree_without_its_draft_load_is_refused_naming_it(sglang: Release) -> None:
    """0.5.23 edited to lack ``weight_update_runners``, 0.5.14 to lack its worker's load."""
    if sglang.api.draft_load == "runners":
        edited = sglang.edited(BASE_SPEC, "def weight_update_runners(", "def _no_runners(")
    else:
        edited = sglang.edited(
            WORKER, "def update_weights_from_disk(self, recv_req", "def _gone(self, recv_req"
        )
    with pytest.raises(
        UnsupportedSGLangError, match=r"lacks .*a draft-only load.*weight_update_runners"
    ):
        detect(edited.tree)


def test_the_manager_loads_the_target_first_which_is_why_drafts_are_hooked(
    sglang: Release,
) -> None:
    """Stock SGLang's disk update reloads the target from ``model_path``: a draft sent
    there without TIDE's hook would load into the target."""
    updater = "sglang.srt.managers.scheduler_components.weight_updater"
    manager = "SchedulerWeightUpdaterManager"
    body = ast.unparse(sglang.method(updater, manager, "update_weights_from_disk"))
    if sglang.api.draft_load == "runners":
        assert "runner.weight_updater.update_weights_from_disk(recv_req.model_path" in body
        select = ast.unparse(sglang.method(updater, manager, "_select_runners"))
        assert 0 <= select.find("tp_worker") < select.find("draft_worker")  # target first
    else:
        target = body.find("self.tp_worker.update_weights_from_disk(recv_req)")
        assert 0 <= target < body.find("self.draft_worker.update_weights_from_disk(recv_req)")


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
    sglang: Release, method: str, path: str, level: str | None
) -> None:
    routes = sglang.routes(HTTP)
    assert (method, path) in routes, f"sglang {sglang.version} has no {method} {path}"
    assert routes[(method, path)][1] == level
    assert (path in auth.ADMIN_ROUTES) == (level is not None)  # TIDE's engine agrees


def test_get_weight_version_is_gone_and_model_info_carries_the_version(sglang: Release) -> None:
    if ("GET", "/get_weight_version") in sglang.routes(HTTP):
        body = sglang.function(HTTP, "weight_version")
        raised = [n for n in body.body if isinstance(n, ast.Raise)]
        assert raised and "404" in ast.unparse(raised[0])  # the fleet must not use it
    keys = {
        node.value
        for node in ast.walk(sglang.function(HTTP, "model_info"))
        if isinstance(node, ast.Constant)
    }
    assert "weight_version" in keys


def test_update_weights_request_has_the_fields_the_client_sends(sglang: Release) -> None:
    fields = sglang.dataclass_fields(IO, "UpdateWeightFromDiskReqInput")
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


def test_tide_auth_decides_as_sglang_does(sglang: Release) -> None:
    sglang_auth = sglang.load_file_module("sglang.srt.utils.auth")
    keys = [None, "k-api", "k-admin"]
    headers = [None, "Bearer k-api", "Bearer k-admin", "Bearer wrong", "Basic k-api"]
    paths = {
        "/generate": sglang_auth.AuthLevel.NORMAL,
        "/model_info": sglang_auth.AuthLevel.NORMAL,
        "/update_weights_from_disk": sglang_auth.AuthLevel.ADMIN_OPTIONAL,
        "/health": sglang_auth.AuthLevel.NORMAL,
        "/metrics": sglang_auth.AuthLevel.NORMAL,
    }
    for (path, level), api, admin, header in itertools.product(
        paths.items(), keys[:2], [None, "k-admin"], headers
    ):
        theirs = sglang_auth.decide_request_auth(
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
        force = (
            sglang_auth.AuthLevel.ADMIN_FORCE
            if level == sglang_auth.AuthLevel.ADMIN_OPTIONAL
            else level
        )
        theirs_forced = sglang_auth.decide_request_auth(
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
        assert sglang_auth.decide_request_auth(
            method="GET",
            path=path,
            authorization_header=sent,
            api_key=api,
            admin_api_key=admin,
            auth_level=level,
        ).allowed, f"the fleet client's header is refused on {path} ({api=}, {admin=})"


def test_prometheus_names_shared_with_sglang_exist(sglang: Release) -> None:
    names = sglang.string_constants("sglang.srt.observability.metrics_collector")
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


def test_launch_args_name_real_server_args(sglang: Release) -> None:
    fields = sglang.server_args_fields()
    flags = [arg for arg in sglang_launch_args("/t", "/d") if arg.startswith("--")]
    for flag in flags:
        assert flag[2:].replace("-", "_") in fields, f"ServerArgs has no field for {flag}"
    # the CLI flags are derived from the field names (dashes for underscores)
    derive = sglang.module_file("sglang.srt.arg_groups.arg_utils").read_text()
    assert 'replace("_", "-")' in derive
    assert {"api_key", "admin_api_key", "weight_version"} <= fields


def test_plugin_hook_targets_and_signatures(sglang: Release) -> None:
    module, _, qualified = sglang_plugin._LOGITS_TARGET.rpartition(".")
    module, _, class_name = module.rpartition(".")
    forward = sglang.parameters(sglang.method(module, class_name, qualified))
    # _keep_final_states reads args[1] after (input_ids, hidden_states): logits_metadata
    assert forward[:5] == ["self", "input_ids", "hidden_states", "lm_head", "logits_metadata"]
    worker_module, _, worker = sglang_plugin._WORKER.rpartition(".")
    generate = sglang.method(worker_module, worker, "forward_batch_generation")
    assert sglang.parameters(generate)[:2] == ["self", "batch"]
    registry = sglang.class_def("sglang.srt.plugins.hook_registry", "HookRegistry")
    assert any(getattr(node, "name", "") == "register" for node in registry.body)


def test_the_label_hooks_match_sglang(sglang: Release) -> None:
    """custom_labels reaches the tokenizer only; the tokenized request carries it over."""
    assert "custom_labels" in sglang.dataclass_fields(IO, "GenerateReqInput")
    assert "custom_labels" not in sglang.dataclass_fields(IO, "TokenizedGenerateReqInput")
    for name in ("TokenizedGenerateReqInput", "BaseReq"):
        decorators = [ast.unparse(d) for d in sglang.class_def(IO, name).decorator_list]
        # a dataclass without slots: an attribute pickles along (else sglang_labels' subclass)
        assert decorators == ([] if sglang.msgspec else ["dataclass"]), name
    module, _, qualified = sglang_plugin._TOKENIZE_TARGET.rpartition(".")
    module, _, class_name = module.rpartition(".")
    assert sglang.parameters(sglang.method(module, class_name, qualified))[:2] == ["self", "obj"]
    module, _, qualified = sglang_plugin._RECEIVE_TARGET.rpartition(".")
    module, _, class_name = module.rpartition(".")
    assert sglang.parameters(sglang.method(module, class_name, qualified)) == ["self", "recv_req"]
    # the scheduler's Req takes the request's id, which capture looks the label up by
    scheduler = sglang.class_def(module, class_name)
    builds = [
        node
        for node in ast.walk(scheduler)
        if isinstance(node, ast.Call)
        and ast.unparse(node.func) in ("Req", "self._create_generation_req")
    ]
    assert any("recv_req.rid" in [ast.unparse(a) for a in node.args[:2]] for node in builds)


def test_req_fields_the_plugin_reads(sglang: Release) -> None:
    fields = sglang.self_attributes("sglang.srt.managers.schedule_batch", "Req")
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
    assert sglang.has_method("sglang.srt.managers.schedule_batch", "Req", "finished")


def test_sglang_own_requests_are_recognisable(sglang: Release) -> None:
    """Health checks (rid prefix) and the warm-up prompt, which the plugin never captures."""
    constants = sglang.module_ast("sglang.srt.constants")
    assigned = {
        node.targets[0].id: node.value.value
        for node in constants.body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
    }
    assert assigned["HEALTH_CHECK_RID_PREFIX"] == sglang_plugin.HEALTH_CHECK_RID_PREFIX
    warmup = sglang.function(HTTP, "_execute_server_warmup")
    texts = {node.value for node in ast.walk(warmup) if isinstance(node, ast.Constant)}
    assert sglang_plugin.WARMUP_TEXT in texts


def test_the_checker_catches_a_renamed_name(sglang: Release) -> None:
    """The checks above can fail: a name SGLang does not have is reported."""
    with pytest.raises(AssertionError, match="has no method"):
        sglang.method(IO, "UpdateWeightFromDiskReqInput", "renamed_method")
    with pytest.raises(AssertionError, match="no class"):
        sglang.class_def(IO, "UpdateWeightFromDiskReqInputRenamed")
    fields = sglang.dataclass_fields(IO, "UpdateWeightFromDiskReqInput")
    assert "is_draft_model_renamed" not in fields


# -- the fleet client against SGLang's own request models and auth, keys on -----------------


@pytest.fixture
def stub(sglang: Release) -> Iterator[tuple[StubServer, StubState]]:
    state = StubState(loadable={"models:/tide-draft-tiny/2", "models:/tide-draft-tiny/1"})
    server = StubServer(create_stub(state, api_key="k-api", admin_api_key="k-admin", wheel=sglang))
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
    stub: tuple[StubServer, StubState], sglang: Release
) -> None:
    """The rollback target is the registry's champion, not /server_info's launch draft."""
    server, state = stub
    other_state = StubState(loadable={"models:/tide-draft-tiny/1"})  # cannot load v2
    other = StubServer(
        create_stub(other_state, api_key="k-api", admin_api_key="k-admin", wheel=sglang)
    )
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
    stub: tuple[StubServer, StubState], tmp_path: Path, sglang: Release
) -> None:
    """For fleets without TIDE's plugin: each server relaunched with the new draft, in turn."""
    server, state = stub
    other_state = StubState(loadable={"models:/tide-draft-tiny/1", "models:/tide-draft-tiny/2"})
    other = StubServer(
        create_stub(other_state, api_key="k-api", admin_api_key="k-admin", wheel=sglang)
    )
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


def test_the_fleet_refuses_a_hot_swap_on_an_sglang_the_plugin_does_not_support(
    sglang: Release,
) -> None:
    """Stock SGLang of another release would load the draft into the target."""
    state = StubState(loadable={"models:/tide-draft-tiny/2"})
    newer = sglang.edited("sglang._version", "version = ", "version = '0.5.99' or ")
    newer.version = "0.5.99"
    server = StubServer(create_stub(state, api_key="k-api", admin_api_key="k-admin", wheel=newer))
    try:
        fleet = FleetManager(
            [server.url], api_key=SecretStr("k-api"), admin_api_key=SecretStr("k-admin")
        )
        with pytest.raises(FleetError, match=r"runs sglang 0\.5\.99, which TIDE's plugin does not"):
            fleet.promote("models:/tide-draft-tiny/2", "tide-draft-tiny-v2")
        assert state.updates == []  # nothing was sent
    finally:
        server.stop()


def test_the_docs_name_each_supported_release_and_its_launch_flags() -> None:
    text = (Path(__file__).parents[2] / "docs" / "sglang.md").read_text()
    for version in SUPPORTED_SGLANG_VERSIONS:
        assert f"| {version} |" in text, f"docs/sglang.md has no row for sglang {version}"
    for flag in [a for a in sglang_launch_args("/t", "/d", key_file="/k") if a.startswith("--")]:
        assert flag in text, f"docs/sglang.md does not explain {flag}"
