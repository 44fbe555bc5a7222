"""The plugin's draft-only hot swap, on SGLang-shaped objects and SGLang's released request types.

The scheduler side is a stand-in with the attributes 0.5.14's
``SchedulerWeightUpdaterManager`` and ``EAGLEWorkerV2`` have (checked against
the wheel first); the request and output are the released dataclasses; the
drafts are real exported checkpoints, one of them fetched from the real S3 lake.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.contract import sglang_release as release
from tests.contract.sglang_stub import request_models
from tide_lib.config import TideConfig
from tide_lib.lake import ObjectStore
from tide_lib.serving import sglang_swap

pytestmark = pytest.mark.slow
UPDATER = "sglang.srt.managers.scheduler_components.weight_updater"
WORKER = "sglang.srt.speculative.eagle_worker_v2"


def test_the_hooked_names_exist_in_the_release() -> None:
    module, _, method = sglang_swap.SWAP_TARGET.rpartition(".")
    module, _, class_name = module.rpartition(".")
    assert release.parameters(release.method(module, class_name, method)) == ["self", "recv_req"]
    manager = release.dataclass_fields(UPDATER, "SchedulerWeightUpdaterManager")
    assert {"tp_worker", "draft_worker"} <= manager
    release.method(UPDATER, "SchedulerWeightUpdaterManager", "flush_cache_after_weight_update")
    assert "_draft_worker" in release.self_attributes(WORKER, "EAGLEWorkerV2")
    draft = release.self_attributes(WORKER, "EagleDraftWorker") | release.self_attributes(
        WORKER, "EagleDraftWorker", "init_lm_head"
    )
    assert "hot_token_id" in draft
    fields = release.dataclass_fields(
        "sglang.srt.managers.io_struct", "UpdateWeightFromDiskReqInput"
    )
    assert {"model_path", "recapture_cuda_graph", "weight_version", "flush_cache"} <= fields
    eagle3 = release.module_file("sglang.srt.models.llama_eagle3").read_text()
    assert "self.hot_token_id = loaded_weight + torch.arange" in eagle3  # what the stand-in does


@dataclasses.dataclass
class _Model:
    hot_token_id: torch.Tensor | None = None


@dataclasses.dataclass
class _Args:
    model_path: str = "/models/target"
    load_format: str = "auto"


@dataclasses.dataclass
class _Runner:
    model: _Model
    server_args: _Args = dataclasses.field(default_factory=_Args)


class _DraftWorker:
    """``EAGLEWorkerV2``: reloads ``draft_runner`` in place; the model rebuilds its token map."""

    def __init__(self, hot_token_id: torch.Tensor) -> None:
        self._draft_worker = self
        self.hot_token_id = hot_token_id
        self.draft_runner = _Runner(_Model(hot_token_id.clone()))
        self.loaded: list[Any] = []

    def update_weights_from_disk(self, recv_req: Any) -> tuple[bool, str]:
        self.loaded.append(recv_req)
        self.draft_runner.server_args.model_path = recv_req.model_path  # as ModelRunner does
        d2t = load_file(Path(recv_req.model_path) / "model.safetensors")["d2t"]
        self.draft_runner.model.hot_token_id = d2t + torch.arange(d2t.shape[0])  # a new tensor
        return True, "Succeeded to update model weights."


class _TargetWorker:
    def update_weights_from_disk(self, recv_req: Any) -> tuple[bool, str]:
        raise AssertionError(f"the target was reloaded from {recv_req.model_path}")


class _Manager:
    def __init__(self, draft: _DraftWorker) -> None:
        self.tp_worker = _TargetWorker()
        self.draft_worker = draft
        self.flushed = 0

    def flush_cache_after_weight_update(self, _recv_req: Any) -> None:
        self.flushed += 1


@pytest.fixture(autouse=True)
def draft_sources(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_drafts: dict[str, Path]
) -> None:
    """This host allows drafts from the session's drafts, the test's dir and the lake's drafts."""
    roots = [os.path.commonpath([str(p) for p in tiny_drafts.values()]), str(tmp_path)]
    sources = [*roots, "s3://tide-lake/drafts", "s3://tide-lake/no"]
    monkeypatch.setenv("TIDE_SERVE__DRAFT_SOURCES", json.dumps(sources))
    monkeypatch.setenv("TIDE_SCRATCH_DIR", str(tmp_path / "scratch"))


@pytest.fixture
def sglang_types(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    models = request_models()
    monkeypatch.setattr(
        sglang_swap, "_output_type", lambda: models["UpdateWeightFromDiskReqOutput"]
    )
    return models


def _serving(draft_dir: Path) -> _DraftWorker:
    d2t = load_file(draft_dir / "model.safetensors")["d2t"]
    return _DraftWorker(d2t + torch.arange(d2t.shape[0]))


def _not_called(*_args: Any, **_kwargs: Any) -> Any:
    raise AssertionError("SGLang's own update_weights_from_disk ran for a draft")


def test_a_draft_reloads_the_draft_worker_alone(
    sglang_types: dict[str, Any], tiny_drafts: dict[str, Path]
) -> None:
    worker = _serving(tiny_drafts["en"])
    graphs_read = worker.hot_token_id  # the tensor the draft CUDA graphs captured
    manager = _Manager(worker)
    request = sglang_types["UpdateWeightFromDiskReqInput"](
        model_path=str(tiny_drafts["ko"]), weight_version="tide-draft-tiny-v2"
    )
    out = sglang_swap.draft_only_swap(_not_called, manager, request)
    assert out.success, out.message
    # in-place loads keep the graphs valid; SGLang's recapture raises for an EAGLE draft runner
    assert worker.loaded[0].recapture_cuda_graph is False
    assert worker.draft_runner.server_args.model_path == "/models/target"  # restored
    assert worker.loaded[0].weight_version == "tide-draft-tiny-v2"
    ko = load_file(tiny_drafts["ko"] / "model.safetensors")["d2t"]
    assert worker.hot_token_id is graphs_read  # refreshed in place, where the graphs read it
    assert torch.equal(graphs_read, ko + torch.arange(ko.shape[0]))
    assert manager.flushed == 1


def test_anything_else_goes_to_sglang_untouched(
    sglang_types: dict[str, Any], tiny_target: Path, tiny_drafts: dict[str, Path]
) -> None:
    manager = _Manager(_serving(tiny_drafts["en"]))
    request = sglang_types["UpdateWeightFromDiskReqInput"](model_path=str(tiny_target))
    calls: list[Any] = []

    def original(self: Any, recv_req: Any) -> str:
        calls.append((self, recv_req))
        return "sglang's answer"

    assert sglang_swap.draft_only_swap(original, manager, request) == "sglang's answer"
    assert calls == [(manager, request)]


def test_a_bad_or_mismatched_draft_is_refused_and_the_old_one_stays(
    sglang_types: dict[str, Any], tiny_drafts: dict[str, Path], tmp_path: Path
) -> None:
    broken = shutil.copytree(tiny_drafts["ko"], tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    worker = _serving(tiny_drafts["en"])
    before = worker.hot_token_id.clone()
    manager = _Manager(worker)
    make = sglang_types["UpdateWeightFromDiskReqInput"]
    out = sglang_swap.draft_only_swap(_not_called, manager, make(model_path=str(broken)))
    assert not out.success and "cannot be read" in out.message
    smaller = _DraftWorker(torch.arange(256))  # a server started with another draft vocabulary
    out = sglang_swap.draft_only_swap(
        _not_called, _Manager(smaller), make(model_path=str(tiny_drafts["ko"]))
    )
    assert not out.success and "restart rollout" in out.message
    out = sglang_swap.draft_only_swap(
        _not_called, manager, make(model_path="s3://tide-lake/no/such/draft")
    )
    assert not out.success
    assert worker.loaded == [] and smaller.loaded == [] and manager.flushed == 0
    assert torch.equal(worker.hot_token_id, before)


def test_a_draft_uri_is_fetched_on_this_host(
    sglang_types: dict[str, Any],
    stack: TideConfig,
    tiny_drafts: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    store = ObjectStore(stack.store, stack.store.lake_bucket)
    prefix = f"drafts/{uuid.uuid4().hex[:6]}/ko"
    for path in tiny_drafts["ko"].iterdir():
        store.put_file(f"{prefix}/{path.name}", path)
    monkeypatch.setenv("TIDE_STORE__ENDPOINT", stack.store.endpoint)
    worker = _serving(tiny_drafts["en"])
    request = sglang_types["UpdateWeightFromDiskReqInput"](
        model_path=f"s3://{stack.store.lake_bucket}/{prefix}", weight_version="from-s3"
    )
    out = sglang_swap.draft_only_swap(_not_called, _Manager(worker), request)
    assert out.success, out.message
    ko = load_file(tiny_drafts["ko"] / "model.safetensors")["d2t"]
    assert torch.equal(worker.hot_token_id, ko + torch.arange(ko.shape[0]))
    # one cached copy of this version, no temporary ones
    assert [p.name for p in (tmp_path / "scratch").iterdir()] == ["drafts"]
    assert len(list((tmp_path / "scratch" / "drafts").iterdir())) == 1


def test_the_hook_refuses_what_the_engine_refuses(
    sglang_types: dict[str, Any], tiny_drafts: dict[str, Path], tmp_path: Path
) -> None:
    """Issue 13 A and C in the SGLang hook: sources, and the one complete checkpoint check."""
    worker = _serving(tiny_drafts["en"])
    make = sglang_types["UpdateWeightFromDiskReqInput"]
    out_of_vocab = shutil.copytree(tiny_drafts["ko"], tmp_path / "d2t-out")
    state = load_file(out_of_vocab / "model.safetensors")
    state["d2t"][-1] = 5000
    save_file(state, out_of_vocab / "model.safetensors")
    out = sglang_swap.draft_only_swap(
        _not_called, _Manager(worker), make(model_path=str(out_of_vocab))
    )
    assert not out.success and "d2t" in out.message
    bad_dtype = shutil.copytree(tiny_drafts["ko"], tmp_path / "fc-int")
    state = load_file(bad_dtype / "model.safetensors")
    state["fc.weight"] = state["fc.weight"].to(torch.int32)
    save_file(state, bad_dtype / "model.safetensors")
    out = sglang_swap.draft_only_swap(
        _not_called, _Manager(worker), make(model_path=str(bad_dtype))
    )
    assert not out.success and "fc.weight has dtype int32" in out.message
    outside = shutil.copytree(tiny_drafts["ko"], tmp_path.parent / f"outside-{uuid.uuid4().hex}")
    for path in (str(outside), "s3://elsewhere/drafts/ko", "models:/../x"):
        out = sglang_swap.draft_only_swap(_not_called, _Manager(worker), make(model_path=path))
        assert not out.success and "TIDE_SERVE__DRAFT_SOURCES" in out.message
    assert worker.loaded == []


def test_the_served_model_keeps_its_name_after_a_draft_swap(tiny_drafts: dict[str, Path]) -> None:
    """SGLang's tokenizer manager renames the model to model_path; not for a draft."""
    calls: list[str] = []

    def original(_manager: Any, model_path: str, _load_format: Any) -> None:
        calls.append(model_path)

    sglang_swap.keep_target_model_info(original, object(), str(tiny_drafts["ko"]), None)
    sglang_swap.keep_target_model_info(original, object(), "models:/tide-draft-tiny/3", None)
    assert calls == []
    sglang_swap.keep_target_model_info(original, object(), "/models/new-target", None)
    assert calls == ["/models/new-target"]
    module, _, method = sglang_swap.MODEL_INFO_TARGET.rpartition(".")
    module, _, class_name = module.rpartition(".")
    params = release.parameters(release.method(module, class_name, method))
    assert params == ["self", "model_path", "load_format"]


def test_an_error_inside_the_hook_never_reaches_the_scheduler(
    sglang_types: dict[str, Any], tiny_drafts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_args: Any) -> Any:
        raise RuntimeError("a bug in TIDE")

    monkeypatch.setattr(sglang_swap, "_swap", broken)
    request = sglang_types["UpdateWeightFromDiskReqInput"](model_path=str(tiny_drafts["ko"]))
    out = sglang_swap.draft_only_swap(_not_called, _Manager(_serving(tiny_drafts["en"])), request)
    assert not out.success and "a bug in TIDE" in out.message
