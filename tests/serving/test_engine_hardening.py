"""Issue 13 on the reference engine, as a real process: what it loads, what stalls it, its defaults.

A: drafts load only from configured sources and leave no copies behind;
B: big bodies, full queues and vanished clients cannot stall it;
C: a draft checkpoint is validated completely before a swap is acknowledged;
E: it refuses to listen beyond loopback without its bearer keys, and never logs them.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import ADMIN_AUTH
from tests.serving.conftest import HealthWatch, engine_metric, start_engine
from tide_lib.config import TideConfig
from tide_lib.lake import ObjectStore
from tide_lib.registry.uris import DraftFetchError, object_destination
from tide_lib.serving.process import EngineProcess
from tide_lib.training.draft import DraftTarget, InvalidCheckpointError, validate_draft_dir

pytestmark = pytest.mark.slow

UPDATE = "/update_weights_from_disk"


@pytest.fixture(scope="module")
def guarded(
    stack: TideConfig,
    tiny_target: Path,
    tiny_drafts: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcess]:
    """An engine with small limits: 64 KiB bodies, 3 queued requests; drafts from ``sources``."""
    tmp = tmp_path_factory.mktemp("guarded")
    allowed = tmp / "sources"
    shutil.copytree(tiny_drafts["ko"], allowed / "ko")
    sources = [str(tiny_drafts["en"].parent), str(allowed), f"s3://{_bucket(stack)}/drafts"]
    engine = start_engine(
        tmp,
        tiny_target,
        "--speculative-draft-model-path",
        str(tiny_drafts["en"]),
        "--max-request-bytes",
        str(64 * 1024),
        "--max-queued-requests",
        "3",
        stack=stack,
        env={"TIDE_SERVE__DRAFT_SOURCES": json.dumps(sources)},
    )
    yield engine
    engine.stop()


def _bucket(stack: TideConfig) -> str:
    return stack.store.artifact_bucket


def _swap(engine: EngineProcess, model_path: str, version: str = "v") -> httpx.Response:
    body = {"model_path": model_path, "weight_version": version}
    return httpx.post(f"{engine.url}{UPDATE}", json=body, headers=ADMIN_AUTH, timeout=120)


def _version(engine: EngineProcess) -> str:
    version: str = httpx.get(f"{engine.url}/model_info", timeout=30).json()["weight_version"]
    return version


def _generate(engine: EngineProcess, max_new_tokens: int = 4, **params: object) -> httpx.Response:
    body = {"text": "hello there", "sampling_params": {"max_new_tokens": max_new_tokens, **params}}
    return httpx.post(f"{engine.url}/generate", json=body, timeout=120)


def _scratch(engine: EngineProcess) -> list[str]:
    port = engine.url.rsplit(":", 1)[1]
    root = engine.log.parent
    found = [p for d in (f"scratch-{port}", f"tmp-{port}") for p in (root / d).rglob("*")]
    return sorted(str(p.relative_to(root)) for p in found if p.is_dir())


# -- A: what the engine loads ---------------------------------------------------------


def test_a_drafts_outside_the_sources_get_the_answer_missing_ones_get(
    guarded: EngineProcess,
    stack: TideConfig,
    tiny_drafts: dict[str, Path],
    tiny_target: Path,
    tmp_path: Path,
) -> None:
    """A: a real draft outside the sources, a missing path and a system dir answer alike."""
    before = _version(guarded)
    outside = shutil.copytree(tiny_drafts["ko"], tmp_path / "outside-ko")
    paths = (
        str(outside),
        str(tmp_path / "no-such-draft"),
        "/etc",
        str(tiny_target),
        f"{tiny_drafts['en'].parent}/../../{tmp_path.name}/outside-ko",
        "s3://some-other-bucket/drafts/ko",
        f"s3://{_bucket(stack)}/elsewhere/ko",
        f"s3://{_bucket(stack)}/drafts/../elsewhere/ko",
    )
    messages = set()
    for path in paths:
        response = _swap(guarded, path)
        assert response.status_code == 400, (path, response.text)
        message = response.json()["message"]
        assert "TIDE_SERVE__DRAFT_SOURCES" in message
        messages.add(message.replace(repr(path), "<path>"))
    assert len(messages) == 1, messages  # nothing tells which of them exist
    assert _version(guarded) == before


def test_a_a_draft_inside_the_sources_swaps(guarded: EngineProcess, tmp_path: Path) -> None:
    """A: the configured local root is honoured (the startup draft's dir as well)."""
    sources = guarded.log.parent / "sources"
    response = _swap(guarded, str(sources / "ko"), "inside-ko")
    assert response.status_code == 200, response.text
    assert _version(guarded) == "inside-ko"


def test_a_s3_swaps_are_cached_per_version_and_failures_leave_nothing(
    guarded: EngineProcess, stack: TideConfig, tiny_drafts: dict[str, Path]
) -> None:
    """A: no ``tide-draft-*`` temp copies: one cache entry per good version, none for bad ones."""
    store = ObjectStore(stack.store, _bucket(stack))
    for path in tiny_drafts["ko"].iterdir():
        store.put_file(f"drafts/hardening-ko/{path.name}", path)
    broken = load_file(tiny_drafts["ko"] / "model.safetensors")
    broken["fc.weight"] = broken["fc.weight"].to(torch.int32)
    local = guarded.log.parent / "broken.safetensors"
    save_file(broken, local)
    store.put_file("drafts/hardening-bad/model.safetensors", local)
    store.put_file("drafts/hardening-bad/config.json", tiny_drafts["ko"] / "config.json")
    before = _scratch(guarded)

    assert _swap(guarded, f"s3://{_bucket(stack)}/drafts/hardening-bad", "bad").status_code == 400
    assert _swap(guarded, f"s3://{_bucket(stack)}/drafts/nothing-here", "none").status_code == 400
    assert _scratch(guarded) == before  # failed downloads are gone
    for _ in range(2):  # the same version twice: one cached copy
        response = _swap(guarded, f"s3://{_bucket(stack)}/drafts/hardening-ko", "s3-ko")
        assert response.status_code == 200, response.text
    added = sorted(set(_scratch(guarded)) - set(before))
    # scratch/drafts/pid-<engine>/<entry>: one cached copy
    assert len([p for p in added if p.count("/") == 3]) == 1, added
    assert not [p for p in _scratch(guarded) if "tide-draft-" in p or ".partial-" in p]


def test_a_object_keys_that_escape_the_draft_dir_are_refused(tmp_path: Path) -> None:
    """A: ``..``, absolute and empty segments in an object key never land outside ``dest``."""
    assert (
        object_destination(tmp_path, "drafts/ko/config.json", "drafts/ko/")
        == (tmp_path / "config.json").resolve()
    )
    for key in (
        "drafts/ko/../../etc/passwd",
        "drafts/ko//etc/passwd",
        "drafts/ko/a/../../x",
        "drafts/ko/./config.json",
        "drafts/ko/",
        "other/config.json",
    ):
        with pytest.raises(DraftFetchError, match="outside"):
            object_destination(tmp_path, key, "drafts/ko/")


# -- B: what stalls it -------------------------------------------------------------------


def test_b_big_bodies_get_413_and_health_keeps_answering(guarded: EngineProcess) -> None:
    """B: a body over --max-request-bytes is refused unread (declared or chunked)."""
    health = HealthWatch(guarded.url)
    big = json.dumps({"text": "word " * 2_000_000}).encode()  # 10 MB
    response = httpx.post(f"{guarded.url}/generate", content=big, timeout=60)
    assert response.status_code == 413 and "max-request-bytes" in response.text

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(big), 65536):
            yield big[start : start + 65536]

    response = httpx.post(f"{guarded.url}/generate", content=chunks(), timeout=60)
    assert response.status_code == 413
    # Under the limit, text is tokenised off the event loop: long text answers 400, not a stall.
    threads = [
        threading.Thread(target=_generate_text, args=(guarded, "xy " * 20000)) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    latencies = health.stop()
    assert latencies and max(latencies) < 1.0, sorted(latencies)[-5:]
    assert _generate(guarded).status_code == 200


def _generate_text(engine: EngineProcess, text: str) -> None:
    response = httpx.post(f"{engine.url}/generate", json={"text": text}, timeout=60)
    assert response.status_code == 400 and "this server takes at most" in response.text


def _busy(engine: EngineProcess) -> Callable[[], None]:
    """Occupy the worker with a long request (seconds: the tests check it is still running
    after their clients acted); returns a join function."""
    thread = threading.Thread(
        target=lambda: _generate(engine, max_new_tokens=512, ignore_eos=True), daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 60
    while engine_metric(engine, "sglang:num_running_reqs") < 1:
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.02)
    return lambda: thread.join(timeout=300)


def test_b_a_full_queue_answers_503_with_retry_after(guarded: EngineProcess) -> None:
    """B: --max-queued-requests waiting requests at most; the next gets 503 and Retry-After."""
    join = _busy(guarded)
    waiting = [threading.Thread(target=_generate, args=(guarded,)) for _ in range(3)]
    for thread in waiting:
        thread.start()
    deadline = time.monotonic() + 30
    while engine_metric(guarded, "sglang:num_queue_reqs") < 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert engine_metric(guarded, "sglang:num_running_reqs") == 1, "the long request ended early"
    response = _generate(guarded)
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    for thread in waiting:
        thread.join()
    join()
    assert _generate(guarded).status_code == 200


def test_b_requests_of_clients_that_left_never_run(guarded: EngineProcess) -> None:
    """B: fifteen clients that hang up while queued leave no work behind."""
    done_before = engine_metric(guarded, "sglang:num_requests_total")
    for _ in range(5):  # 3 at a time (the queue holds 3), each batch behind a long request
        join = _busy(guarded)
        clients = [threading.Thread(target=_hang_up, args=(guarded,)) for _ in range(3)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join()
        deadline = time.monotonic() + 10
        while engine_metric(guarded, "sglang:num_queue_reqs") > 0:  # cancelled, places free
            assert time.monotonic() < deadline, "requests of departed clients stay queued"
            time.sleep(0.05)
        running = engine_metric(guarded, "sglang:num_running_reqs")
        assert running == 1, "the long request ended before the clients left: inconclusive"
        join()
    assert _generate(guarded).status_code == 200
    # the five long requests and the last one ran; none of the fifteen did
    assert engine_metric(guarded, "sglang:num_requests_total") == done_before + 6


def _hang_up(engine: EngineProcess) -> None:
    with pytest.raises(httpx.ReadTimeout):
        _generate_with_timeout(engine, 0.3)


def _generate_with_timeout(engine: EngineProcess, timeout: float) -> None:
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 4}}
    httpx.post(f"{engine.url}/generate", json=body, timeout=timeout)


# -- C: what a draft must be ------------------------------------------------------------


def _tamper_tensors(draft: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    state = load_file(draft / "model.safetensors")
    edit(state)
    save_file(state, draft / "model.safetensors")


def _tamper_config(draft: Path, edit: Callable[[dict[str, object]], None]) -> None:
    config = json.loads((draft / "config.json").read_text())
    edit(config)
    (draft / "config.json").write_text(json.dumps(config))


def _d2t_out_of_vocab(state: dict[str, torch.Tensor]) -> None:
    state["d2t"][-1] = 5000  # the target has 1024 tokens


def _d2t_negative(state: dict[str, torch.Tensor]) -> None:
    state["d2t"][3] = -10


def _d2t_twice(state: dict[str, torch.Tensor]) -> None:
    state["d2t"][1] = state["d2t"][0] - 1  # draft tokens 0 and 1 map to one target id


TENSOR_HOLES = {
    "fc int32": (lambda s: s.update({"fc.weight": s["fc.weight"].to(torch.int32)}), "fc.weight"),
    "t2d float": (lambda s: s.update({"t2d": s["t2d"].to(torch.float32)}), "t2d"),
    "d2t float": (lambda s: s.update({"d2t": s["d2t"].to(torch.float32)}), "d2t"),
    "d2t out of vocabulary": (_d2t_out_of_vocab, "d2t"),
    "d2t negative": (_d2t_negative, "d2t"),
    "d2t not one-to-one": (_d2t_twice, "d2t"),
    "norm missing": (lambda s: s.pop("norm.weight"), "norm.weight"),
}
CONFIG_HOLES = {
    "eagle_config a string": (lambda c: c.update({"eagle_config": "x"}), "eagle_config"),
    "layer ids strings": (
        lambda c: c.update({"eagle_config": {"eagle_aux_hidden_state_layer_ids": ["a", "b", "c"]}}),
        "eagle_aux_hidden_state_layer_ids",
    ),
    "layer beyond the target": (
        lambda c: c.update({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 60]}}),
        "eagle_aux_hidden_state_layer_ids",
    ),
    "draft_vocab_size a string": (
        lambda c: c.update({"draft_vocab_size": "512"}),
        "draft_vocab_size",
    ),
    "hidden_size of another target": (
        lambda c: c.update({"hidden_size": int(c["hidden_size"]) * 2}),
        "hidden_size",
    ),
}


@pytest.mark.parametrize("hole", [*TENSOR_HOLES, *CONFIG_HOLES])
def test_c_a_flawed_checkpoint_is_400_naming_the_field_and_the_old_draft_serves(
    guarded: EngineProcess, tiny_drafts: dict[str, Path], hole: str
) -> None:
    """C: dtypes, d2t/t2d ranges, eagle_config types, target fit: all refused before a swap."""
    sources = guarded.log.parent / "sources"
    draft = shutil.copytree(tiny_drafts["ko"], sources / f"hole-{hole.replace(' ', '-')}")
    if hole in TENSOR_HOLES:
        edit, field = TENSOR_HOLES[hole]
        _tamper_tensors(draft, edit)
    else:
        edit_config, field = CONFIG_HOLES[hole]
        _tamper_config(draft, edit_config)
    before = _version(guarded)
    response = _swap(guarded, str(draft), f"hole-{hole}")
    assert response.status_code == 400, response.text
    assert field in response.json()["message"]
    assert _version(guarded) == before
    served = _generate(guarded)
    assert served.status_code == 200 and served.json()["meta_info"]["weight_version"] == before


def test_c_the_exported_drafts_pass_the_complete_check(
    tiny_drafts: dict[str, Path], tiny_target: Path
) -> None:
    """C: the checks refuse nothing the trainer exports."""
    from transformers import AutoConfig

    target = DraftTarget.of(AutoConfig.from_pretrained(tiny_target))
    for draft in tiny_drafts.values():
        assert validate_draft_dir(draft, target).draft_vocab_size == 512
    with pytest.raises(InvalidCheckpointError, match="vocab_size"):
        validate_draft_dir(tiny_drafts["en"], DraftTarget(target.hidden_size, 2048))


# -- E: defaults ----------------------------------------------------------------------------


def test_e_a_server_beyond_loopback_needs_both_keys(
    stack: TideConfig, tiny_target: Path, tmp_path: Path
) -> None:
    """E: --host 0.0.0.0 without keys refuses to start and names the variables to set."""
    with pytest.raises(RuntimeError, match="TIDE_SERVE__ADMIN_API_KEY") as refused:
        start_engine(
            tmp_path,
            tiny_target,
            "--host",
            "0.0.0.0",
            stack=stack,
            env={"TIDE_SERVE__API_KEY": "only-the-api-key-e1", "TIDE_SERVE__ADMIN_API_KEY": ""},
        )
    assert "only-the-api-key-e1" not in str(refused.value)
    assert "TIDE_SERVE__API_KEY and" not in str(refused.value)  # that one is set


def test_e_keys_are_never_logged(stack: TideConfig, tiny_target: Path, tmp_path: Path) -> None:
    """E: with both keys it serves beyond loopback; neither key appears in its log."""
    keys = {"TIDE_SERVE__API_KEY": "api-key-e2-xyz", "TIDE_SERVE__ADMIN_API_KEY": "admin-e2-xyz"}
    engine = start_engine(tmp_path, tiny_target, "--host", "0.0.0.0", stack=stack, env=keys)
    try:
        api = {"Authorization": "Bearer api-key-e2-xyz"}
        assert httpx.get(f"{engine.url}/model_info").status_code == 401
        assert httpx.get(f"{engine.url}/model_info", headers=api).status_code == 200
        swap = httpx.post(
            f"{engine.url}{UPDATE}", json={"model_path": "/nowhere"}, headers=api, timeout=30
        )
        assert swap.status_code == 401
    finally:
        engine.stop()
    log = engine.log.read_text()
    assert "api-key-e2-xyz" not in log and "admin-e2-xyz" not in log
