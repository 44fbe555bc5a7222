"""The SGLang capture plugin, everything of it that runs without a GPU and SGLang.

SGLang itself cannot run here, so its per-request objects are stand-ins carrying the
attributes of ``sglang.srt.managers.schedule_batch.Req`` (0.5.14) that the plugin
reads, and its batches are fed in SGLang's layout: prefill rows concatenated in
request order, verify blocks of ``num_draft_tokens`` rows with the accepted path in
front. The states are a real forward pass of the tiny target, the lake is the real
S3 server.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.metadata
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tide_lib.config import LakeConfig, TideConfig
from tide_lib.lake import LakeReader, ObjectStore, target_slug
from tide_lib.serving import sglang_plugin
from tide_lib.serving.sglang_plugin import ENABLE_ENV, SGLangCapture

pytestmark = pytest.mark.slow
NUM_STEPS = 3
DRAFT_TOKENS = NUM_STEPS + 1


@dataclasses.dataclass
class Req:
    """The fields of SGLang's ``Req`` the plugin reads."""

    rid: str
    origin_input_ids: list[int]
    output_ids: list[int] = dataclasses.field(default_factory=list)
    spec_verify_ct: int = 0
    spec_num_correct_drafts: int = 0
    done: bool = False

    def finished(self) -> bool:
        return self.done


@pytest.fixture(scope="module")
def true_states(tiny_target: Path) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """A 20-token sequence and the tiny target's final and aux states of every token."""
    from transformers import AutoModelForCausalLM

    from tide_lib.target_model.hidden import HiddenStateCapture

    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    ids = list(range(5, 25))
    capture = HiddenStateCapture(model)
    with torch.no_grad(), capture.capturing():
        model(input_ids=torch.tensor([ids]))
    final, aux = capture.take()
    return ids, final[0], aux[0]


def _verify_block(final: torch.Tensor, aux: torch.Tensor, start: int, accepted: int) -> Any:
    """``DRAFT_TOKENS`` rows: the states of the accepted path first, then rejected noise."""
    noise_final = torch.randn(DRAFT_TOKENS, final.shape[1])
    noise_aux = torch.randn(DRAFT_TOKENS, aux.shape[1])
    real = final[start : start + accepted]
    noise_final[: real.shape[0]] = real
    noise_aux[: real.shape[0]] = aux[start : start + accepted]
    return noise_final, noise_aux


def _config(stack: TideConfig, lake: LakeConfig, **serve: Any) -> TideConfig:
    return TideConfig(store=stack.store, lake=lake, serve=serve)


def _read_back(store: ObjectStore, lake: LakeConfig, target: str) -> dict[str, Any]:
    reader = LakeReader(store, lake)
    return {s.request_id: s for s in reader.iter_records(reader.list_shards(target_slug(target)))}


def test_chunked_prefill_prefix_cache_and_verify_blocks_land_as_the_target_computed(
    stack: TideConfig, lake_config: LakeConfig, lake_store: ObjectStore, true_states: Any
) -> None:
    ids, final, aux = true_states
    capture = SGLangCapture(_config(stack, lake_config), "sglang/target", "v7", NUM_STEPS)
    # a: 10-token prompt prefilled in two chunks (6 + 4); b: 8-token prompt whose first 4
    # tokens hit the radix cache, so SGLang computes (and the plugin sees) 4 rows.
    a = Req("a", ids[:10])
    b = Req("b", ids[:8])
    capture.on_prefill(
        [a, b], [0, 4], [6, 4], torch.cat([final[0:6], final[4:8]]), torch.cat([aux[0:6], aux[4:8]])
    )
    capture.on_prefill([a], [6], [4], final[6:10], aux[6:10])
    a.output_ids, b.output_ids = [ids[10]], [ids[8]]

    # verify 1: a accepts 3 (2 drafts + bonus), b accepts 2; verify 2: a accepts 1;
    # verify 3: a accepts 4 but max_new_tokens stops it after 7 outputs in all.
    blocks = [_verify_block(final, aux, 10, 3), _verify_block(final, aux, 8, 2)]
    capture.on_verify(
        [a, b],
        DRAFT_TOKENS,
        torch.cat([blocks[0][0], blocks[1][0]]),
        torch.cat([blocks[0][1], blocks[1][1]]),
        torch.tensor([3, 2]),
    )
    b.output_ids, b.spec_verify_ct, b.spec_num_correct_drafts, b.done = ids[8:11], 1, 1, True
    capture.on_verify([a], DRAFT_TOKENS, *_verify_block(final, aux, 13, 1), torch.tensor([1]))
    capture.on_verify([a], DRAFT_TOKENS, *_verify_block(final, aux, 14, 4), torch.tensor([4]))
    a.output_ids, a.spec_verify_ct, a.spec_num_correct_drafts, a.done = ids[10:17], 3, 5, True
    capture.close()

    samples = _read_back(lake_store, lake_config, "sglang/target")
    assert set(samples) == {"a", "b"}
    # a: every prompt and output token but the last has states (positions 0..16)
    sample = samples["a"]
    assert sample.input_ids.tolist() == ids[:17]
    assert sample.loss_mask.tolist() == [0] * 10 + [1] * 7
    torch.testing.assert_close(sample.hidden_states, final[:17].half())
    torch.testing.assert_close(sample.aux_hidden_states, aux[:17].half())
    assert (sample.spec_verify_ct, sample.spec_accept_tokens) == (3, 5)
    # b: starts after its cached prefix, positions 4..9
    sample = samples["b"]
    assert sample.input_ids.tolist() == ids[4:10]
    assert sample.loss_mask.tolist() == [0] * 4 + [1] * 2
    torch.testing.assert_close(sample.hidden_states, final[4:10].half())
    torch.testing.assert_close(sample.aux_hidden_states, aux[4:10].half())
    assert (capture.captured, capture.skipped, capture.dropped) == (2, 0, 0)


def _tokenized(kind: type, rid: str) -> Any:
    """A released ``TokenizedGenerateReqInput``, its required fields left empty."""
    if dataclasses.is_dataclass(kind):
        required = [
            f.name
            for f in dataclasses.fields(kind)
            if f.init
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        return kind(**{name: None for name in required if name != "rid"}, rid=rid)
    given: dict[str, Any] = {"rid": rid}
    while True:  # a Struct names its missing arguments one at a time
        try:
            return kind(**given)
        except TypeError as error:
            missing = re.fullmatch(r"Missing required argument '(\w+)'", str(error))
            if missing is None:
                raise
            given[missing.group(1)] = None


def test_a_client_label_rides_from_the_tokenizer_to_the_record(
    sglang: Any,
    *,
    stack: TideConfig,
    lake_config: LakeConfig,
    lake_store: ObjectStore,
    true_states: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``custom_labels`` stays in SGLang's tokenizer process: the hooks carry the segment
    on the tokenized request of each release (an attribute on 0.5.14's dataclass, a
    declared field of a subclass on 0.5.23's Struct), pickled as SGLang's IPC sends it,
    and note it in the scheduler."""
    import pickle

    from tide_lib.serving import sglang_labels

    kind = sglang.request_models["TokenizedGenerateReqInput"]
    monkeypatch.setattr(sglang_labels, "_base", lambda: kind)
    monkeypatch.setattr(sglang_labels, "_pickled_ipc", lambda: True)
    ids, final, aux = true_states
    pending = sglang_plugin.PendingSegments()
    monkeypatch.setattr(sglang_plugin._Process, "segments", pending)
    for rid, labels in (("k", {"segment": "korean law"}), ("x", {"segment": "no/slashes"})):
        request = SimpleNamespace(rid=rid, custom_labels=labels)
        tokenized = sglang_plugin._label_tokenized(_tokenized(kind, rid), object(), request, "")
        assert isinstance(tokenized, kind)  # SGLang's dispatcher routes it as before
        sglang_plugin._note_segment(object(), pickle.loads(pickle.dumps(tokenized)))
    sglang_plugin._note_segment(object(), _tokenized(kind, "u"))  # no label at all
    assert len(pending) == 1  # the invalid label was dropped, the request still served
    # msgpack IPC would refuse a type it does not know: the request goes unlabelled
    monkeypatch.setattr(sglang_labels, "_pickled_ipc", lambda: False)
    plain = _tokenized(kind, "m")
    request = SimpleNamespace(rid="m", custom_labels={"segment": "korean law"})
    labelled = sglang_plugin._label_tokenized(plain, object(), request, "")
    assert labelled is plain and (sglang.msgspec or plain.tide_segment == "korean law")

    target = "sglang/labelled"
    capture = SGLangCapture(_config(stack, lake_config), target, "v1", NUM_STEPS, segments=pending)
    requests = [Req(rid, ids[:6], output_ids=[ids[6]], done=True) for rid in ("k", "x", "u")]
    capture.on_prefill(requests, [0, 0, 0], [6, 6, 6], final[:6].repeat(3, 1), aux[:6].repeat(3, 1))
    capture.close()
    samples = _read_back(lake_store, lake_config, target)
    assert {rid: sample.segment for rid, sample in samples.items()} == {
        "k": "korean law",
        "x": None,
        "u": None,
    }
    assert len(pending) == 0

    bounded = sglang_plugin.PendingSegments(limit=2)
    for rid in ("a", "b", "c"):
        bounded.note(rid, "s")
    assert (bounded.take("a"), bounded.take("c"), len(bounded)) == (None, "s", 1)


def test_threshold_sampling_retraction_and_aborts_keep_requests_out(
    stack: TideConfig, lake_config: LakeConfig, lake_store: ObjectStore, true_states: Any
) -> None:
    ids, final, aux = true_states
    config = _config(stack, lake_config, capture_skip_accept_rate=0.5)
    capture = SGLangCapture(config, "sglang/skips", "v1", NUM_STEPS)
    served_well, kept, retracted, aborted = (Req(name, ids[:4]) for name in "wkra")
    reqs = [served_well, kept, retracted, aborted]
    capture.on_prefill(reqs, [0] * 4, [4] * 4, final[:4].repeat(4, 1), aux[:4].repeat(4, 1))
    block = _verify_block(final, aux, 4, 2)
    capture.on_verify(
        reqs, DRAFT_TOKENS, block[0].repeat(4, 1), block[1].repeat(4, 1), torch.tensor([2] * 4)
    )
    capture.on_prefill([retracted], [0], [4], final[:4], aux[:4])  # re-prefill: dropped
    aborted.finished_reason = type("FINISH_ABORT", (), {})()  # type: ignore[attr-defined]
    for req in reqs:
        req.output_ids, req.spec_verify_ct, req.done = ids[4:7], 1, True
    served_well.spec_num_correct_drafts = 3  # 3 of 3 drafted tokens accepted
    capture.close()

    assert set(_read_back(lake_store, lake_config, "sglang/skips")) == {"k"}
    assert (capture.captured, capture.skipped, capture.dropped) == (1, 1, 1)

    unsampled = SGLangCapture(_config(stack, lake_config, capture_sample_rate=0.0), "x", "v", 3)
    unsampled.on_prefill([Req("u", ids[:4])], [0], [4], final[:4], aux[:4])
    assert unsampled._open["u"][1] is None  # nothing kept on the GPU for unsampled requests
    unsampled.close()


def test_worker_hook_routes_sglang_batches_and_hides_its_states_from_the_scheduler(
    stack: TideConfig, lake_config: LakeConfig, true_states: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids, final, aux = true_states
    monkeypatch.setenv(ENABLE_ENV, "1")
    capture = SGLangCapture(_config(stack, lake_config), "sglang/hook", "v1", NUM_STEPS)
    monkeypatch.setattr(sglang_plugin._Process, "capture", capture)
    worker = SimpleNamespace(tp_rank=0, speculative_num_draft_tokens=DRAFT_TOKENS)
    req = Req("h", ids[:6])

    def forward(mode: str, rows: torch.Tensor, aux_rows: torch.Tensor, **extra: Any) -> Any:
        logits = SimpleNamespace(
            hidden_states=aux_rows,
            customized_info={sglang_plugin.FINAL_STATES_KEY: rows, "user": [1]},
        )
        result = SimpleNamespace(logits_output=logits, **extra)
        batch = SimpleNamespace(
            reqs=[req],
            prefix_lens=[0],
            extend_lens=[6],
            is_extend_in_batch=False,
            forward_mode=SimpleNamespace(is_idle=lambda: False, is_extend=lambda: mode == "extend"),
        )
        out = sglang_plugin._capture_batch(lambda _w, _b: result, worker, batch)
        assert out.logits_output.customized_info == {"user": [1]}
        return out

    forward("extend", final[:6], aux[:6])
    forward("verify", *_verify_block(final, aux, 6, 2), accept_lens=torch.tensor([2]))
    states = capture._open["h"][1]
    assert states is not None
    assert (states.prefill_rows, states.verify_steps) == (6, 1)
    token_ids, got_final, got_aux = states.assemble(ids[:9])
    assert token_ids == ids[:8]
    torch.testing.assert_close(got_final, final[:8])
    torch.testing.assert_close(got_aux, aux[:8])
    capture.close()


def test_plugin_is_declared_to_sglang_and_off_unless_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    points = importlib.metadata.entry_points(group="sglang.srt.plugins")
    assert [p.value for p in points if p.name == "tide_capture"] == [
        "tide_lib.serving.sglang_plugin:register"
    ]
    monkeypatch.delenv(ENABLE_ENV, raising=False)
    sglang_plugin.register()  # off: registers nothing, needs no SGLang
    monkeypatch.setenv(ENABLE_ENV, "1")
    with pytest.raises(RuntimeError, match=r"install one of sglang 0\.5\.14, 0\.5\.23"):
        sglang_plugin.register()


def _counter(kind: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(f"tide:capture_{kind}_total") or 0.0


def test_self_requests_stop_and_budget(
    stack: TideConfig, lake_config: LakeConfig, lake_store: ObjectStore, true_states: Any
) -> None:
    """Health checks and warm-up are not traffic; records end at the real stop; the host
    byte budget drops a request (counted) instead of holding more."""
    ids, final, aux = true_states
    row_bytes = (final.shape[1] + aux.shape[1]) * final.element_size()
    config = _config(stack, lake_config, capture_max_held_bytes=12 * row_bytes)
    warmup = tuple(ids[:3])
    capture = SGLangCapture(config, "sglang/self", "v1", NUM_STEPS, warmup_prompts={warmup})
    dropped_before, records_before = _counter("dropped"), _counter("records")
    health = Req("HEALTH_CHECK_0f3a", ids[:4])
    warm = Req("warm", list(warmup))
    stop = Req("stop", ids[:6])
    big = Req("big", ids[:8])  # 8 prefill rows: over the 12-row budget with stop's 6
    capture.on_prefill(
        [health, warm, stop, big],
        [0] * 4,
        [4, 3, 6, 8],
        torch.cat([final[:4], final[:3], final[:6], final[:8]]),
        torch.cat([aux[:4], aux[:3], aux[:6], aux[:8]]),
    )
    assert capture._open["HEALTH_CHECK_0f3a"][1] is None and capture._open["warm"][1] is None
    assert capture._open["big"][1] is None  # dropped by the budget
    assert capture.held_bytes == 6 * row_bytes
    capture.on_verify([stop], DRAFT_TOKENS, *_verify_block(final, aux, 6, 4), torch.tensor([4]))
    # SGLang's output_ids run past the stop token; finished_len marks where it stopped
    stop.output_ids = ids[6:10]
    stop.finished_len = 2  # type: ignore[attr-defined]
    stop.spec_verify_ct, stop.done = 1, True
    for req in (health, warm, big):
        req.output_ids, req.done = ids[4:5], True
    capture.close()
    assert capture.held_bytes == 0
    samples = _read_back(lake_store, lake_config, "sglang/self")
    assert set(samples) == {"stop"}
    assert samples["stop"].input_ids.tolist() == ids[:8]  # 6 prompt + 2 output, no overshoot
    assert samples["stop"].loss_mask.tolist() == [0] * 6 + [1] * 2
    assert (capture.captured, capture.dropped) == (1, 1)
    assert _counter("dropped") == dropped_before + 1
    assert _counter("records") == records_before + 1


def test_an_error_inside_a_hook_costs_capture_never_the_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENABLE_ENV, "1")
    monkeypatch.setattr(sglang_plugin._Process, "disabled", False)
    monkeypatch.setattr(sglang_plugin._Process, "errors", collections.Counter())
    errors_before = _counter("errors")
    logits = SimpleNamespace(
        hidden_states=torch.zeros(2, 6), customized_info={sglang_plugin.FINAL_STATES_KEY: 1}
    )
    result = SimpleNamespace(logits_output=logits)
    batch = SimpleNamespace()  # no forward_mode: TIDE's code fails on it
    worker = SimpleNamespace(tp_rank=0)
    for _ in range(2):
        out = sglang_plugin._capture_batch(lambda _w, _b: result, worker, batch)
        assert out is result  # the scheduler gets SGLang's result
    assert logits.customized_info is None  # and never TIDE's key
    assert sglang_plugin._Process.disabled  # capture switched itself off after the first
    assert sglang_plugin._Process.errors["batch"] == 1
    assert _counter("errors") == errors_before + 1
    # the logits hook adds nothing once capture is off, and never raises
    processor = SimpleNamespace(config=SimpleNamespace(architectures=["LlamaForCausalLM"]))
    output = SimpleNamespace(customized_info=None)
    assert sglang_plugin._keep_final_states(lambda *a: output, processor, 0, 0) is output
    assert output.customized_info is None


def test_two_capturing_processes_on_one_host_spool_apart(
    stack: TideConfig, lake_config: LakeConfig, tmp_path: Path
) -> None:
    """Several servers per node (or a tp_rank 0 per DP replica) share TIDE_LAKE__SPOOL_DIR."""
    import os
    import socket
    import subprocess
    import sys

    from tide_lib.lake import LakeWriter

    base = tmp_path / "spool"
    writers = []
    for pid in (os.getpid(), os.getppid()):  # two live processes
        spool = sglang_plugin.process_spool(base, rank=0, pid=pid)
        lake = lake_config.model_copy(update={"spool_dir": spool})
        writers.append(LakeWriter(ObjectStore(stack.store, stack.store.lake_bucket), lake))
    assert len({w._spool for w in writers}) == 2  # no lock clash: each has its own
    for writer in writers:
        writer.close()
    # a process that died with a spooled shard: the next one adopts it for upload
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    ).stdout.strip()
    orphan = base / f"{socket.gethostname()}-tp0-pid{dead}"
    orphan.mkdir()
    (orphan / "shard-1.parquet").write_bytes(b"x")
    (orphan / "shard-1.json").write_text("{}")
    own = sglang_plugin.process_spool(base, rank=0, pid=12345678)
    assert not orphan.exists()
    assert {p.name for p in own.iterdir()} == {"shard-1.parquet", "shard-1.json"}


def _wheel_hook_registry(sglang: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The wheel's own ``HookRegistry`` (a self-contained file), importable as SGLang's."""
    import sys
    import types

    hooks = sglang.load_file_module("sglang.srt.plugins.hook_registry")
    for name in ("sglang", "sglang.srt", "sglang.srt.plugins"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", hooks)
    monkeypatch.setattr(hooks.HookRegistry, "_hooks", collections.defaultdict(list))
    return hooks.HookRegistry


def test_the_plugin_loads_on_each_release_and_refuses_one_lacking_a_feature(
    sglang: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from tide_lib.serving.sglang_api import SCHEDULER, SourceTree
    from tide_lib.serving.sglang_swap import MODEL_INFO_TARGET, SWAP_TARGET, DraftSwap

    registry = _wheel_hook_registry(sglang, monkeypatch)
    monkeypatch.setenv(ENABLE_ENV, "1")
    monkeypatch.setattr(SourceTree, "installed", classmethod(lambda _cls: sglang.tree))
    sglang_plugin.register()
    worker = f"{sglang_plugin._WORKER}.forward_batch_generation"
    assert set(registry._hooks) == {
        SWAP_TARGET,
        MODEL_INFO_TARGET,
        sglang_plugin._LOGITS_TARGET,
        worker,
        sglang_plugin._TOKENIZE_TARGET,
        sglang_plugin._RECEIVE_TARGET,
    }
    [(_, swap, _)] = registry._hooks[SWAP_TARGET]
    assert isinstance(swap, DraftSwap) and swap.api == sglang.api

    registry._hooks.clear()
    bypassed = sglang.edited(
        SCHEDULER, "self.weight_updater.update_weights_from_disk", "self.update_weights_from_disk"
    )
    monkeypatch.setattr(SourceTree, "installed", classmethod(lambda _cls: bypassed.tree))
    with caplog.at_level("ERROR", logger=sglang_plugin.__name__):
        sglang_plugin.register()
    assert "refuses to load" in caplog.text and "init_request_dispatcher" in caplog.text
    [(_, guard, _)] = registry._hooks[SWAP_TARGET]  # only the guard that refuses drafts
    assert list(registry._hooks) == [SWAP_TARGET] and not isinstance(guard, DraftSwap)


def test_capture_finds_its_rank_and_dp_attention_where_the_release_keeps_them(
    sglang: Any, lake_config: LakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker shaped as each wheel's ``EAGLEWorkerV2`` (the attributes its source sets):
    0.5.14's has ``tp_rank``, 0.5.23's has not (the parallel state has it); DP attention
    asked for by an attention DP size shows only in SGLang's own check."""
    import sys
    import types

    from tide_lib.serving.sglang_api import WORKER

    state = {"rank": 1, "dp": False}
    parallel = types.ModuleType("sglang.srt.distributed.parallel_state")
    parallel.get_tensor_model_parallel_rank = lambda: state["rank"]  # type: ignore[attr-defined]
    dp = types.ModuleType("sglang.srt.layers.dp_attention")
    dp.is_dp_attention_enabled = lambda: state["dp"]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, parallel.__name__, parallel)
    monkeypatch.setitem(sys.modules, dp.__name__, dp)
    monkeypatch.setattr(sglang_plugin._Process, "capture", None)
    monkeypatch.setenv("TIDE_LAKE__SPOOL_DIR", str(lake_config.spool_dir))
    args = SimpleNamespace(enable_dp_attention=False, model_path="/m", tokenizer_path=None)
    wheel = sglang.self_attributes(WORKER, "EAGLEWorkerV2")
    read = {"topk", "server_args", "speculative_num_steps", "speculative_num_draft_tokens"}
    assert read <= wheel, read - wheel  # what capture reads of the worker
    shaped = {
        "topk": 1,
        "server_args": args,
        "speculative_num_steps": NUM_STEPS,
        "speculative_num_draft_tokens": DRAFT_TOKENS,
        "tp_rank": 1,
    }
    worker = SimpleNamespace(**{name: value for name, value in shaped.items() if name in wheel})
    assert hasattr(worker, "tp_rank") is (sglang.version == "0.5.14")
    assert sglang_plugin._tp_rank(worker) == 1
    assert sglang_plugin._start_capture(worker) is None  # rank 1 never captures
    state.update(rank=0, dp=True)
    if hasattr(worker, "tp_rank"):
        worker.tp_rank = 0
    monkeypatch.setenv(ENABLE_ENV, "1")
    assert sglang_plugin._start_capture(worker) is None  # DP attention: capture refused
    assert os.environ[ENABLE_ENV] == "0"
