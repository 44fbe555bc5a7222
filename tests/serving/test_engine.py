"""The reference engine as a real process: exactness, capture, hot swap, fleets, hostile input."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from pydantic import SecretStr
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.conftest import ADMIN_AUTH
from tests.prometheus import metric_value, samples
from tests.serving.conftest import engine_metric, start_engine
from tide_lib.config import TideConfig
from tide_lib.lake import LakeReader, ObjectStore, target_slug
from tide_lib.serving.fleet import FleetError, FleetManager, sglang_launch_args
from tide_lib.serving.process import EngineProcess
from tide_lib.target_model import HiddenStateCapture, load_corpus, render_prompt

pytestmark = pytest.mark.slow

PROMPTS = [
    render_prompt(doc.turns[0]) for doc in load_corpus().domain("en_chat", held_out=True)[:6]
]


def _generate(engine: EngineProcess, text: str, max_new_tokens: int = 24, **params: object) -> dict:
    response = httpx.post(
        f"{engine.url}/generate",
        json={"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, **params}},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_greedy_speculative_output_equals_plain_greedy(engines: dict[str, EngineProcess]) -> None:
    for prompt in PROMPTS:
        spec = _generate(engines["spec"], prompt)
        plain = _generate(engines["plain"], prompt)
        assert spec["output_ids"] == plain["output_ids"]
        assert spec["meta_info"]["spec_verify_ct"] > 0
        assert plain["meta_info"]["spec_verify_ct"] == 0
    info = httpx.get(f"{engines['spec'].url}/get_server_info").json()
    assert info["speculative_algorithm"] == "EAGLE3" and info["speculative_num_draft_tokens"] == 4
    assert info["internal_states"][0]["avg_spec_accept_length"] >= 1.0


def test_sampling_is_seeded_and_in_vocabulary(engines: dict[str, EngineProcess]) -> None:
    first = _generate(engines["spec"], PROMPTS[0], temperature=0.9, seed=7)
    again = _generate(engines["spec"], PROMPTS[0], temperature=0.9, seed=7)
    assert first["output_ids"] == again["output_ids"]
    assert all(0 <= token < 1024 for token in first["output_ids"])


def test_captured_requests_read_back_equal_to_the_engine_states(
    engines: dict[str, EngineProcess], stack: TideConfig, tiny_target: Path
) -> None:
    results = [_generate(engines["spec"], prompt, max_new_tokens=12) for prompt in PROMPTS[:3]]
    reader = LakeReader(
        ObjectStore(stack.store, stack.store.lake_bucket),
        stack.lake.model_copy(update={"prefix": "serving-capture"}),
    )
    wanted = {result["meta_info"]["id"] for result in results}
    deadline = time.monotonic() + 30
    samples = {}
    while time.monotonic() < deadline and not wanted <= samples.keys():
        samples = {
            s.request_id: s for s in reader.iter_records(reader.list_shards(target_slug("tiny")))
        }
        time.sleep(0.5)
    assert wanted <= samples.keys()
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    capture = HiddenStateCapture(model, [0, 1, 2])
    for result in results:
        sample = samples[result["meta_info"]["id"]]
        prompt_len = result["meta_info"]["prompt_tokens"]
        tokens = sample.input_ids.tolist()
        assert tokens[prompt_len:] == result["output_ids"][: len(tokens) - prompt_len]
        assert sample.loss_mask[:prompt_len].sum() == 0 and sample.loss_mask[prompt_len:].all()
        with torch.no_grad(), capture.capturing():
            model(input_ids=torch.tensor([tokens]))
        final, aux = capture.take()
        assert torch.allclose(sample.hidden_states.float(), final[0], atol=2e-2)
        assert torch.allclose(sample.aux_hidden_states.float(), aux[0], atol=2e-2)
    _metrics_parse_and_carry_the_capture(engines["spec"], captured=len(results))


def _metrics_parse_and_carry_the_capture(engine: EngineProcess, captured: int) -> None:
    """Issue 15: ``/metrics`` is valid Prometheus text (prometheus_client's parser reads
    it) with the capture counters and the per-version acceptance histogram."""
    metrics = httpx.get(f"{engine.url}/metrics").text
    assert metric_value(metrics, "tide:capture_records_total") >= captured
    assert metric_value(metrics, "tide:capture_dropped_records_total") == 0
    assert metric_value(metrics, "tide:capture_latency_seconds_count") >= captured
    assert metric_value(metrics, "sglang:spec_accept_length") >= 1.0
    per_version = [
        s for s in samples(metrics) if s.name == "tide:spec_accept_length_per_request_count"
    ]
    assert per_version and all(s.labels["weight_version"] for s in per_version)
    assert sum(s.value for s in per_version) >= captured
    requests = metric_value(metrics, "sglang:num_requests_total")
    assert metric_value(metrics, "sglang:e2e_request_latency_seconds_count") == requests


def test_swap_under_load_fails_no_request(
    engines: dict[str, EngineProcess], tiny_drafts: dict[str, Path]
) -> None:
    engine = engines["spec2"]
    statuses: list[int] = []
    versions: list[str] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            response = httpx.post(
                f"{engine.url}/generate",
                json={"text": PROMPTS[1], "sampling_params": {"max_new_tokens": 16}},
                timeout=120,
            )
            statuses.append(response.status_code)
            versions.append(response.json()["meta_info"]["weight_version"])

    threads = [threading.Thread(target=load) for _ in range(3)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while not versions and time.monotonic() < deadline:  # the old draft has served under load
        time.sleep(0.1)
    swap = httpx.post(
        f"{engine.url}/update_weights_from_disk",
        json={
            "model_path": str(tiny_drafts["ko"]),
            "is_draft_model": True,
            "weight_version": "ko-1",
        },
        headers=ADMIN_AUTH,
        timeout=120,
    )
    time.sleep(1.0)
    stop.set()
    for thread in threads:
        thread.join()
    assert swap.status_code == 200 and swap.json()["weight_version"] == "ko-1"
    assert statuses and set(statuses) == {200}
    assert "initial" in versions and versions[-1] == "ko-1"
    assert httpx.get(f"{engine.url}/get_weight_version").json() == {"weight_version": "ko-1"}


def test_bad_checkpoint_is_refused_and_serving_continues(
    engines: dict[str, EngineProcess], tiny_drafts: dict[str, Path], tmp_path: Path
) -> None:
    engine = engines["spec"]
    before = httpx.get(f"{engine.url}/get_weight_version").json()["weight_version"]
    broken = tmp_path / "broken"
    shutil.copytree(tiny_drafts["ko"], broken)
    state = load_file(broken / "model.safetensors")
    state["fc.weight"][0, 0] = float("inf")
    save_file(state, broken / "model.safetensors")
    response = httpx.post(
        f"{engine.url}/update_weights_from_disk",
        json={"model_path": str(broken), "is_draft_model": True, "weight_version": "broken"},
        headers=ADMIN_AUTH,
        timeout=60,
    )
    assert response.status_code == 400
    assert "fc.weight has non-finite values" in response.json()["message"]
    assert httpx.get(f"{engine.url}/get_weight_version").json()["weight_version"] == before
    assert _generate(engine, PROMPTS[0], max_new_tokens=4)["meta_info"]["weight_version"] == before


def test_draft_from_s3_uri(
    engines: dict[str, EngineProcess], tiny_drafts: dict[str, Path], stack: TideConfig
) -> None:
    store = ObjectStore(stack.store, stack.store.artifact_bucket)
    for path in tiny_drafts["en"].iterdir():
        store.put_file(f"drafts/en-s3/{path.name}", path)
    engine = engines["spec2"]
    response = httpx.post(
        f"{engine.url}/update_weights_from_disk",
        json={
            "model_path": f"s3://{stack.store.artifact_bucket}/drafts/en-s3",
            "is_draft_model": True,
            "weight_version": "en-s3",
        },
        headers=ADMIN_AUTH,
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert _generate(engine, PROMPTS[0], max_new_tokens=4)["meta_info"]["weight_version"] == "en-s3"


def test_concurrent_swaps_both_apply_in_turn(
    engines: dict[str, EngineProcess], tiny_drafts: dict[str, Path]
) -> None:
    engine = engines["spec2"]
    responses: dict[str, httpx.Response] = {}

    def swap(language: str) -> None:
        responses[language] = httpx.post(
            f"{engine.url}/update_weights_from_disk",
            json={
                "model_path": str(tiny_drafts[language]),
                "is_draft_model": True,
                "weight_version": f"both-{language}",
            },
            headers=ADMIN_AUTH,
            timeout=120,
        )

    def busy() -> None:
        _generate(engine, PROMPTS[2], max_new_tokens=200)

    # Both swaps wait behind queued requests, so both are pending at once.
    load = [threading.Thread(target=busy) for _ in range(6)]
    for thread in load:
        thread.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and engine_metric(engine, "sglang:num_queue_reqs") == 0:
        time.sleep(0.05)
    threads = [threading.Thread(target=swap, args=(language,)) for language in ("en", "ko")]
    for thread in threads:
        thread.start()
    for thread in [*threads, *load]:
        thread.join()
    assert {language: r.status_code for language, r in responses.items()} == {"en": 200, "ko": 200}
    serving = httpx.get(f"{engine.url}/get_weight_version").json()["weight_version"]
    assert serving in {"both-en", "both-ko"}
    assert _generate(engine, PROMPTS[0], max_new_tokens=4)["meta_info"]["weight_version"] == serving


def test_fleet_of_two_is_promoted_and_rolled_back(
    engines: dict[str, EngineProcess], tiny_drafts: dict[str, Path]
) -> None:
    admin = SecretStr(os.environ["TIDE_SERVE__ADMIN_API_KEY"])
    fleet = FleetManager([engines["spec"].url, engines["spec2"].url], admin_api_key=admin)
    fleet.promote(tiny_drafts["en"], "fleet-en")
    assert [s.weight_version for s in fleet.status()] == ["fleet-en", "fleet-en"]

    # A promotion whose acceptance gate cannot pass updates the first server, fails,
    # and leaves both servers on the draft they served before.
    with pytest.raises(FleetError, match="rolled back"):
        fleet.promote(
            tiny_drafts["ko"], "fleet-ko", probe_prompts=PROMPTS[:2], min_accept_length=99.0
        )
    states = fleet.status()
    assert [s.weight_version for s in states] == ["fleet-en", "fleet-en"]
    assert all(s.healthy and s.draft_path == str(tiny_drafts["en"]) for s in states)

    fleet.promote(tiny_drafts["ko"], "fleet-ko")
    fleet.promote(tiny_drafts["en"], "fleet-en-again")  # rollback = promote the earlier draft
    assert [s.weight_version for s in fleet.status()] == ["fleet-en-again"] * 2


def test_keys_are_required_as_sglang_requires_them(
    stack: TideConfig, tiny_target: Path, tiny_drafts: dict[str, Path], tmp_path: Path
) -> None:
    """SGLang's --api-key/--admin-api-key rules on the reference engine; the fleet sends them."""
    keys = {"TIDE_SERVE__API_KEY": "k-api", "TIDE_SERVE__ADMIN_API_KEY": "k-admin"}
    draft = ["--speculative-draft-model-path", str(tiny_drafts["en"])]
    engine = start_engine(tmp_path, tiny_target, *draft, stack=stack, env=keys)
    try:
        api, admin = {"Authorization": "Bearer k-api"}, {"Authorization": "Bearer k-admin"}
        body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}}
        update = {"model_path": str(tiny_drafts["ko"]), "weight_version": "keyed-ko"}
        assert httpx.get(f"{engine.url}/health").status_code == 200  # probes carry no key
        assert httpx.get(f"{engine.url}/metrics").status_code == 200
        assert httpx.post(f"{engine.url}/generate", json=body).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert httpx.post(f"{engine.url}/generate", json=body, headers=wrong).status_code == 401
        assert httpx.post(f"{engine.url}/generate", json=body, headers=api).status_code == 200
        url = f"{engine.url}/update_weights_from_disk"
        assert httpx.post(url, json=update, headers=api, timeout=120).status_code == 401
        assert httpx.get(f"{engine.url}/model_info", headers=api).json()["weight_version"] == (
            "initial"
        )
        with pytest.raises(FleetError, match="refused"):
            FleetManager([engine.url], api_key=SecretStr("k-api")).promote(
                tiny_drafts["ko"], "keyed-ko"
            )
        fleet = FleetManager(
            [engine.url], api_key=SecretStr("k-api"), admin_api_key=SecretStr("k-admin")
        )
        fleet.promote(tiny_drafts["ko"], "keyed-ko")
        assert httpx.get(f"{engine.url}/model_info", headers=api).json()["weight_version"] == (
            "keyed-ko"
        )
        assert httpx.post(url, json=update, headers=admin, timeout=120).status_code == 200
    finally:
        engine.stop()


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"{not json", "JSON decode error"),
        (b'{"text": "hi", "bogus": 1}', "bogus: Extra inputs are not permitted"),
        (b'{"sampling_params": {}}', "exactly one of text or input_ids"),
        (b'{"text": "   "}', "text is empty"),
        (b'{"input_ids": []}', "the prompt is empty"),
        (b'{"input_ids": [1, 5000]}', "outside the vocabulary"),
        (
            b'{"text": "hi", "sampling_params": {"max_new_tokens": -1}}',
            "greater than or equal to 1",
        ),
        (
            b'{"text": "hi", "sampling_params": {"max_new_tokens": 10000000}}',
            "exceeds this server's limit",
        ),
        (b'{"text": "' + b"x" * 20000 + b'"}', "this server takes at most"),
        (b'{"text": "hi", "sampling_params": {"temperature": "hot"}}', "valid number"),
    ],
)
def test_hostile_inputs_get_400_and_the_server_still_answers(
    engines: dict[str, EngineProcess], payload: bytes, message: str
) -> None:
    engine = engines["plain"]
    response = httpx.post(
        f"{engine.url}/generate", content=payload, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]
    assert _generate(engine, "hello", max_new_tokens=2)["meta_info"]["completion_tokens"] == 2


def test_update_of_the_target_is_refused(
    engines: dict[str, EngineProcess], tiny_target: Path
) -> None:
    url = f"{engines['plain'].url}/update_weights_from_disk"
    response = httpx.post(url, json={"model_path": str(tiny_target)}, headers=ADMIN_AUTH)
    assert response.status_code == 400 and "draft models only" in response.text
    response = httpx.post(url, json={"model_path": "/x"}, headers=ADMIN_AUTH)
    assert response.status_code == 400 and "not a draft under this server's" in response.text


def test_sglang_launch_args_name_eagle3_options() -> None:
    args = sglang_launch_args("meta-llama/Llama-3.1-8B-Instruct", "s3://b/d", num_steps=5)
    joined = " ".join(args)
    assert "--speculative-algorithm EAGLE3" in joined
    assert "--speculative-num-steps 5" in joined and "--speculative-num-draft-tokens 6" in joined
    assert "--speculative-eagle-topk 1" in joined


def test_an_engine_without_an_admin_key_refuses_every_swap(
    stack: TideConfig, tiny_target: Path, tiny_drafts: dict[str, Path], tmp_path: Path
) -> None:
    """Issue 13: an anonymous POST /update_weights_from_disk swapped the draft (200) on an
    engine started without keys. The admin route is SGLang's ADMIN_FORCE by default: 403."""
    draft = ["--speculative-draft-model-path", str(tiny_drafts["en"])]
    no_keys = {"TIDE_SERVE__ADMIN_API_KEY": "", "TIDE_SERVE__API_KEY": ""}
    engine = start_engine(tmp_path, tiny_target, *draft, stack=stack, env=no_keys)
    try:
        update = {"model_path": str(tiny_drafts["en"]), "weight_version": "anonymous"}
        url = f"{engine.url}/update_weights_from_disk"
        refused = httpx.post(url, json=update, timeout=120)
        assert refused.status_code == 403 and "TIDE_SERVE__ADMIN_API_KEY" in refused.text
        assert httpx.post(url, json=update, headers=ADMIN_AUTH, timeout=120).status_code == 403
        assert httpx.get(f"{engine.url}/model_info").json()["weight_version"] == "initial"
        assert _generate(engine, PROMPTS[0], max_new_tokens=2)["meta_info"]["completion_tokens"]
    finally:
        engine.stop()
