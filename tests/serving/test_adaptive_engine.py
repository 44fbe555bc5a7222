"""The engine's per-request k: k=0 is plain decoding, the choice is shown, segments travel.

Real models throughout: the tiny target and a freshly initialised draft exported
for it (its acceptance is poor, which is what an unfitted draft looks like).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.prometheus import metric_value
from tide_lib.config import ServeConfig, TideConfig
from tide_lib.lake import LakeReader, ObjectStore, target_slug
from tide_lib.serving.engine import Engine, EngineRequest
from tide_lib.serving.server import create_app
from tide_lib.serving.speculative import SpeculativeDecoder
from tide_lib.training.draft import export_draft, load_draft, new_draft
from tide_lib.training.specforge_runtime import prepare_specforge

PROMPT = "Tell me about the weather today."


@pytest.fixture(scope="module")
def random_draft(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    prepare_specforge("cpu")
    torch.manual_seed(0)
    vocab = AutoTokenizer.from_pretrained(tiny_target).vocab_size
    draft = new_draft(tiny_target, 512, Counter(range(min(vocab, 600))))
    return export_draft(draft, tmp_path_factory.mktemp("random-draft") / "draft")


def _decoder(tiny_target: Path, draft_dir: Path, num_steps: int = 3) -> SpeculativeDecoder:
    target = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    eos = AutoTokenizer.from_pretrained(tiny_target).eos_token_id
    return SpeculativeDecoder(target, load_draft(draft_dir, tiny_target), num_steps, eos)


def test_k0_is_exactly_plain_decoding_greedy_and_sampled(
    tiny_target: Path, random_draft: Path
) -> None:
    decoder = _decoder(tiny_target, random_draft)
    ids = AutoTokenizer.from_pretrained(tiny_target).encode(PROMPT, add_special_tokens=False)
    plain = decoder.generate(ids, 24, speculative=False, ignore_eos=True)
    k0 = decoder.generate(ids, 24, num_steps=0, ignore_eos=True)
    k3 = decoder.generate(ids, 24, num_steps=3, ignore_eos=True)
    default = decoder.generate(ids, 24, ignore_eos=True)
    assert k0.output_ids == plain.output_ids == k3.output_ids == default.output_ids
    assert torch.equal(k0.final_states, plain.final_states)
    assert torch.equal(k0.aux_states, plain.aux_states)
    assert (k0.verify_steps, k0.drafted_tokens, k0.timings.draft_forwards) == (0, 0, 0)
    assert k0.timings.k == 0 and k0.timings.rounds == []
    assert {tokens for tokens, _ in k0.timings.target_forwards} == {1}
    assert len(k0.timings.target_forwards) == 23  # one per token after the prefill's
    assert default.timings.k == k3.timings.k == 3 and k3.verify_steps > 0
    assert {tokens for tokens, _ in k3.timings.target_forwards} <= {2, 3, 4}
    assert k3.timings.draft_forwards > 0 and k3.timings.draft_seconds > 0
    assert all(drafted <= 3 and accepted <= drafted for drafted, accepted in k3.timings.rounds)
    sampled = [
        decoder.generate(
            ids, 16, temperature=0.8, generator=torch.Generator().manual_seed(7), **kw
        ).output_ids
        for kw in ({"speculative": False}, {"num_steps": 0})
    ]
    assert sampled[0] == sampled[1]
    with pytest.raises(ValueError, match="num_steps"):
        decoder.generate(ids, 4, num_steps=-1)


def _config(tmp: Path, target: Path, draft: Path, **serve: object) -> TideConfig:
    base = TideConfig()
    settings = base.serve.model_copy(
        update={
            "model_path": target,
            "speculative_draft_model_path": str(draft),
            "speculative_num_steps": 3,
            "capture": False,
            **serve,
        }
    )
    lake = base.lake.model_copy(update={"spool_dir": tmp / "spool"})
    return base.model_copy(update={"serve": settings, "lake": lake, "scratch_dir": tmp / "scratch"})


@pytest.fixture(scope="module")
def adaptive(
    tiny_target: Path, random_draft: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Engine, TestClient]]:
    tmp = tmp_path_factory.mktemp("adaptive")
    engine = Engine(_config(tmp, tiny_target, random_draft, speculative_adaptive=True))
    yield engine, TestClient(create_app(engine))
    engine.close()


def _post(client: TestClient, body: dict[str, object], **headers: str) -> httpx.Response:
    return client.post("/generate", json=body, headers=headers)


def test_server_info_and_metrics_show_the_choice(adaptive: tuple[Engine, TestClient]) -> None:
    engine, client = adaptive
    for index in range(4):
        body = {"text": f"{PROMPT} {index}", "sampling_params": {"max_new_tokens": 12}}
        assert _post(client, body).status_code == 200
    info = client.get("/server_info").json()
    assert info["speculative_adaptive"] is True and info["speculative_num_steps"] == 3
    state = info["internal_states"][0]
    speculation = state["speculation"]
    assert state["spec_num_steps"] == speculation["chosen_k"] in range(4)
    assert speculation["adaptive"] is True and speculation["max_k"] == 3
    costs = speculation["costs"]
    assert costs["draft_step_s"] > 0
    assert set(costs["verify_s"]) == {"0", "1", "2", "3"}
    assert costs["measured_target_tokens"] == [1, 2, 3, 4]  # probed before serving
    assert speculation["calibrated"] is True
    rates = speculation["expected_tokens_per_s"]
    assert set(rates) == {"0", "1", "2", "3"} and min(rates.values()) > 0
    paying = [rate for rate in rates.values() if rate > rates["0"] * 1.02]  # min_gain
    assert rates[str(speculation["recommended_k"])] == max([rates["0"], *paying])
    assert speculation["requests_by_k"]["3"] >= 1  # untried positions: optimism
    metrics = client.get("/metrics").text
    model = {"model_name": engine.target_id}
    assert metric_value(metrics, "sglang:spec_num_steps", **model) == speculation["chosen_k"]
    for k in range(4):
        expected = metric_value(metrics, "tide:spec_expected_tokens_per_s", **model, k=str(k))
        assert expected == pytest.approx(rates[str(k)])
        assert metric_value(metrics, "tide:spec_verify_seconds", **model, k=str(k)) > 0
    assert metric_value(metrics, "tide:spec_draft_step_seconds", **model) > 0
    for k, ratio in speculation["realized_vs_plain"].items():  # measured k's only
        assert metric_value(metrics, "tide:spec_realized_vs_plain", **model, k=k) == ratio
    if speculation["model_error"] is None:  # before a k has a realized figure: no sample
        assert "tide:spec_model_error{" not in metrics
    else:
        error = metric_value(metrics, "tide:spec_model_error", **model)
        assert error == pytest.approx(speculation["model_error"])


def test_segments_are_read_from_custom_labels_or_headers_and_checked(
    adaptive: tuple[Engine, TestClient],
) -> None:
    _, client = adaptive
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6}}
    assert _post(client, {**body, "custom_labels": {"segment": "ko_law"}}).status_code == 200
    assert _post(client, body, **{"X-TIDE-Segment": "en_docs"}).status_code == 200
    sglang_header = {"x-custom-labels": json.dumps({"segment": "py.docs v2"})}
    assert _post(client, body, **sglang_header).status_code == 200
    segments = client.get("/server_info").json()["internal_states"][0]["speculation"]["segments"]
    assert {"ko_law", "en_docs", "py.docs v2"} <= set(segments)
    metrics = client.get("/metrics").text
    assert metric_value(metrics, "tide:spec_segment_num_steps", segment="py.docs v2") >= 0
    bad = [
        (_post(client, {**body, "custom_labels": {"segment": "x" * 65}}), "custom_labels"),
        (_post(client, {**body, "custom_labels": {"segment": "a\nb"}}), "custom_labels"),
        (_post(client, {**body, "custom_labels": {"segment": ""}}), "custom_labels"),
        (_post(client, {**body, "custom_labels": {"segment": 'a"b'}}), "custom_labels"),
        (_post(client, body, **{"X-TIDE-Segment": "   "}), "X-TIDE-Segment"),
        (_post(client, body, **{"x-custom-labels": "not json"}), "x-custom-labels"),
        (
            _post(client, {**body, "custom_labels": {"segment": "a"}}, **{"X-TIDE-Segment": "b"}),
            "twice",
        ),
    ]
    for response, named in bad:
        assert response.status_code == 400, response.text
        assert named in response.json()["error"]["message"]
    assert client.get("/health").status_code == 200


def test_the_cost_probe_measures_every_k_before_serving_and_can_be_off(
    tiny_target: Path, random_draft: Path, tmp_path: Path
) -> None:
    engines = {
        tokens: Engine(
            _config(
                tmp_path / str(tokens),
                tiny_target,
                random_draft,
                speculative_adaptive=True,
                speculative_adaptive_calibration_tokens=tokens,
            )
        )
        for tokens in (12, 0)
    }
    try:
        probed, unprobed = (engines[n].k_controller.snapshot() for n in (12, 0))
        assert probed["calibrated"] is True and unprobed["calibrated"] is False
        assert probed["costs"]["measured_target_tokens"] == [1, 2, 3, 4]
        assert probed["costs"]["draft_step_s"] > 0 and probed["modelled_k"] is not None
        assert probed["acceptance"] == [1.0, 1.0, 1.0]  # a probe is no traffic
        assert sum(probed["requests_by_k"].values()) == 0
        assert unprobed["costs"]["measured_target_tokens"] == []
        assert unprobed["modelled_k"] is None
        for engine in engines.values():  # probed or not, the first request runs at max k
            request = EngineRequest(engine.encode(PROMPT), 6, 0.0, None, "first", ignore_eos=True)
            assert engine.submit(request).result().spec_num_steps == 3
    finally:
        for engine in engines.values():
            engine.close()


def test_an_engine_started_without_a_draft_probes_the_costs_of_the_first_one_swapped_in(
    tiny_target: Path, random_draft: Path, tmp_path: Path
) -> None:
    config = _config(tmp_path, tiny_target, random_draft, speculative_adaptive=True)
    serve = config.serve.model_copy(
        update={
            "speculative_draft_model_path": None,
            "draft_sources": [str(random_draft.parent)],
            "speculative_adaptive_calibration_tokens": 8,
        }
    )
    engine = Engine(config.model_copy(update={"serve": serve}))
    try:
        assert engine.k_controller.snapshot()["calibrated"] is False  # nothing to probe
        engine.swap_draft(str(random_draft), "v1")
        snapshot = engine.k_controller.snapshot()
        assert snapshot["calibrated"] is True
        assert snapshot["costs"]["measured_target_tokens"] == [1, 2, 3, 4]
    finally:
        engine.close()


def test_a_cost_probe_too_short_to_time_a_draft_step_is_refused() -> None:
    with pytest.raises(ValidationError, match="CALIBRATION_TOKENS to 0"):
        ServeConfig(speculative_adaptive_calibration_tokens=3)
    assert ServeConfig(speculative_adaptive_calibration_tokens=0)


def test_disable_speculation_forces_plain_decoding(
    tiny_target: Path, random_draft: Path, tmp_path: Path
) -> None:
    config = _config(
        tmp_path, tiny_target, random_draft, speculative_adaptive=True, disable_speculation=True
    )
    engine = Engine(config)
    try:
        for index in range(3):
            request = EngineRequest(engine.encode(PROMPT), 8, 0.0, None, f"plain-{index}")
            result = engine.submit(request).result()
            assert result.spec_num_steps == 0 and result.spec_verify_ct == 0
        assert engine.k_controller.snapshot()["chosen_k"] == 0
    finally:
        engine.close()


@pytest.mark.slow
def test_the_segment_label_reaches_the_captured_record(
    stack: TideConfig, tiny_target: Path, random_draft: Path, tmp_path: Path
) -> None:
    prefix = f"segments-{time.time_ns()}"
    lake = stack.lake.model_copy(
        update={"prefix": prefix, "spool_dir": tmp_path / "spool", "shard_max_age_s": 0.3}
    )
    serve = stack.serve.model_copy(
        update={
            "model_path": tiny_target,
            "speculative_draft_model_path": str(random_draft),
            "speculative_num_steps": 3,
            "speculative_adaptive": True,
            "capture": True,
        }
    )
    engine = Engine(stack.model_copy(update={"lake": lake, "serve": serve}))
    client = TestClient(create_app(engine))
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6}}
    try:
        labelled = _post(client, {**body, "custom_labels": {"segment": "ko_law"}}).json()
        headed = _post(client, body, **{"X-TIDE-Segment": "en_docs"}).json()
        plain = _post(client, body).json()
    finally:
        engine.close()  # flushes the capture writer
    wanted = {
        labelled["meta_info"]["id"]: "ko_law",
        headed["meta_info"]["id"]: "en_docs",
        plain["meta_info"]["id"]: None,
    }
    reader = LakeReader(ObjectStore(stack.store, stack.store.lake_bucket), lake)
    deadline = time.monotonic() + 30
    samples: dict[str, object] = {}
    while time.monotonic() < deadline and not wanted.keys() <= samples.keys():
        shards = reader.list_shards(target_slug("tiny"))
        samples = {s.request_id: s.segment for s in reader.iter_records(shards)}
        time.sleep(0.5)
    assert {rid: samples.get(rid) for rid in wanted} == wanted


def test_the_decoding_thread_calibrates_and_a_failed_start_fails_the_engine(
    tiny_target: Path, random_draft: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Costs are measured in the thread that decodes, with its ``serve.decode_threads``
    (a worker thread with torch's two threads decoded at half the speed the main thread
    did); an error there fails ``Engine()`` instead of leaving one whose requests never
    complete."""
    threads: list[int] = []
    calibrated_in: list[str] = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)

    def broken_probe(engine: Engine) -> None:
        calibrated_in.append(threading.current_thread().name)
        raise RuntimeError("the probe broke")

    monkeypatch.setattr(Engine, "_calibrate_speculation", broken_probe)
    config = _config(tmp_path, tiny_target, random_draft, speculative_adaptive=True)
    with pytest.raises(RuntimeError, match="the probe broke"):
        Engine(config)
    assert threads == [config.serve.decode_threads] == [1]
    assert calibrated_in == ["tide-engine"]


def test_a_reference_request_decodes_plainly_unseen_by_adaptive_k(
    adaptive: tuple[Engine, TestClient],
) -> None:
    """The benches time plain decoding on the adaptive engine itself (identical engines
    differ by 2-4% here): such a request runs at k=0 and teaches the controller nothing."""
    engine, _client = adaptive
    ids = engine.encode(PROMPT)
    before = engine.k_controller.snapshot()
    reference = EngineRequest(ids, 12, 0.0, None, "reference", reference_plain=True)
    result = engine.submit(reference).result(timeout=120)
    served = engine.submit(EngineRequest(ids, 12, 0.0, None, "served")).result(timeout=120)
    assert result.output_ids == served.output_ids  # greedy: the same answer
    after = engine.k_controller.snapshot()
    picked = {
        k: after["requests_by_k"][k] - before["requests_by_k"][k] for k in after["requests_by_k"]
    }
    assert sum(picked.values()) == 1  # the served request alone
    assert result.spec_verify_ct == 0
