"""The plugin's draft-only hot swap, on SGLang-shaped objects and each wheel's request types.

The scheduler side is a stand-in shaped as each supported release has it (checked
against the wheel first): 0.5.14's ``EAGLEWorkerV2`` loads its draft itself and its
manager's flush asserts; 0.5.23's worker hands out ``weight_update_runners()`` whose
``weight_updater`` loads, its ``ServerArgs`` are read-only, its flush reports and its
manager records the weight version. The request and output are the wheel's own
types (dataclasses, or msgspec Structs); the drafts are real exported checkpoints,
one of them fetched from the real S3 lake.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.contract.sglang_release import Release
from tide_lib.config import TideConfig
from tide_lib.lake import ObjectStore
from tide_lib.serving import sglang_swap
from tide_lib.serving.sglang_api import RUNNER_UPDATER, UPDATER, WORKER, SGLangApi

pytestmark = pytest.mark.slow
LOADED = "Succeeded to update model weights."


def test_the_stand_ins_have_the_wheels_shape(sglang: Release) -> None:
    manager = sglang.dataclass_fields(UPDATER, "SchedulerWeightUpdaterManager")
    assert {"tp_worker", "draft_worker"} <= manager
    flush = sglang.method(
        UPDATER, "SchedulerWeightUpdaterManager", "flush_cache_after_weight_update"
    )
    assert len(sglang.parameters(flush)) == (4 if sglang.api.flush_reports else 2)
    assert "_draft_worker" in sglang.self_attributes(WORKER, "EAGLEWorkerV2")
    assert "hot_token_id" in sglang.self_attributes(WORKER, "EagleDraftWorker")
    if sglang.api.draft_load == "runners":
        load = sglang.method(RUNNER_UPDATER, "WeightUpdater", "update_weights_from_disk")
        assert sglang.parameters(load)[:3] == ["self", "model_path", "load_format"]
        assert not sglang.has_method(WORKER, "EAGLEWorkerV2", "update_weights_from_disk")
    else:
        load = sglang.method(WORKER, "EAGLEWorkerV2", "update_weights_from_disk")
        assert sglang.parameters(load) == ["self", "recv_req"]
    fields = sglang.dataclass_fields(
        "sglang.srt.managers.io_struct", "UpdateWeightFromDiskReqInput"
    )
    assert {"model_path", "recapture_cuda_graph", "weight_version", "flush_cache"} <= fields
    eagle3 = sglang.module_file("sglang.srt.models.llama_eagle3").read_text()
    assert "self.hot_token_id = loaded_weight + torch.arange" in eagle3  # what the stand-in does


class _Model:
    def __init__(self, hot_token_id: torch.Tensor) -> None:
        self.hot_token_id = hot_token_id


class _Args:
    """A runner's ``server_args``: read-only after resolution where the release seals them."""

    def __init__(self, sealed: bool) -> None:
        self.model_path, self.load_format = "/models/target", "auto"
        self._sealed = sealed

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_sealed", False):
            raise AttributeError(f"server_args.{name} assigned after resolution; read-only")
        super().__setattr__(name, value)


class _Runner:
    """The draft's model runner; in 0.5.23 its ``weight_updater`` loads."""

    def __init__(self, hot_token_id: torch.Tensor, sealed: bool) -> None:
        self.model = _Model(hot_token_id.clone())
        self.server_args = _Args(sealed)
        self.weight_updater = self  # the stand-in is its own updater
        self.loads: list[tuple[str, str, bool]] = []

    def update_weights_from_disk(
        self,
        model_path: str,
        load_format: str,
        weight_name_filter: Any = None,
        recapture_cuda_graph: bool = False,
    ) -> tuple[bool, str]:
        self.loads.append((model_path, load_format, recapture_cuda_graph))
        d2t = load_file(Path(model_path) / "model.safetensors")["d2t"]
        self.model.hot_token_id = d2t + torch.arange(d2t.shape[0])  # a new tensor
        return True, LOADED


class _EagleDraft:
    """``EagleDraftWorker``: the draft runner and the token map its CUDA graphs read."""

    def __init__(self, hot_token_id: torch.Tensor, sealed: bool) -> None:
        self.hot_token_id = hot_token_id
        self.draft_runner = _Runner(hot_token_id, sealed)


class _DraftWorker:
    """``EAGLEWorkerV2`` of 0.5.14: reloads its draft worker's runner itself (the runner
    records the loaded path as the server's model path). ``hot`` and ``runner`` are the
    tests' handles on the inner draft worker, names SGLang does not have."""

    def __init__(self, hot_token_id: torch.Tensor, sealed: bool = False) -> None:
        self._draft_worker = _EagleDraft(hot_token_id, sealed)
        self.requests: list[Any] = []

    @property
    def hot(self) -> torch.Tensor:
        return self._draft_worker.hot_token_id

    @property
    def runner(self) -> _Runner:
        return self._draft_worker.draft_runner

    @property
    def loaded(self) -> list[tuple[str, str, bool]]:
        return self.runner.loads

    def update_weights_from_disk(self, recv_req: Any) -> tuple[bool, str]:
        self.requests.append(recv_req)
        self.runner.server_args.model_path = recv_req.model_path  # as ModelRunner does
        return self.runner.update_weights_from_disk(
            recv_req.model_path,
            recv_req.load_format,
            recapture_cuda_graph=recv_req.recapture_cuda_graph,
        )


class _RunnersWorker(_DraftWorker):
    """``EAGLEWorkerV2`` of 0.5.23: no load of its own; ``weight_update_runners()``."""

    update_weights_from_disk = None  # type: ignore[assignment]

    def weight_update_runners(self) -> list[tuple[str, _Runner]]:
        return [("draft", self.runner)]


class _TargetWorker:
    def update_weights_from_disk(self, recv_req: Any) -> tuple[bool, str]:
        raise AssertionError(f"the target was reloaded from {recv_req.model_path}")


class _Manager:
    def __init__(self, api: SGLangApi, draft: _DraftWorker) -> None:
        self.api = api
        self.tp_worker = _TargetWorker()
        self.tp_cpu_group = None  # one rank (the two-rank test gives it a gloo group)
        self.draft_worker = draft
        self.flushed = 0
        self.versions: list[str | None] = []

    def flush_cache_after_weight_update(self, *args: Any) -> Any:
        assert len(args) == (3 if self.api.flush_reports else 1), "the release's signature"
        self.flushed += 1
        return (args[1], args[2]) if self.api.flush_reports else None

    def record_weight_version_after_update(self, version: str | None) -> None:
        assert self.api.records_weight_version, "0.5.14's manager has no such method"
        self.versions.append(version)


@pytest.fixture(autouse=True)
def draft_sources(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_drafts: dict[str, Path]
) -> None:
    """This host allows drafts from the session's drafts, the test's dir and the lake's drafts."""
    roots = [os.path.commonpath([str(p) for p in tiny_drafts.values()]), str(tmp_path)]
    sources = [*roots, "s3://tide-lake/drafts", "s3://tide-lake/no"]
    monkeypatch.setenv("TIDE_SERVE__DRAFT_SOURCES", json.dumps(sources))
    monkeypatch.setenv("TIDE_SCRATCH_DIR", str(tmp_path / "scratch"))


class _Shapes:
    """One release's request types, swap hook and stand-ins."""

    def __init__(self, sglang: Release) -> None:
        self.api = sglang.api
        self.request = sglang.request_models["UpdateWeightFromDiskReqInput"]
        self.swapped: list[str] = []
        self.swap = sglang_swap.DraftSwap(self.api, self.swapped.append)

    def serving(self, draft_dir: Path, hot: torch.Tensor | None = None) -> _DraftWorker:
        if hot is None:
            d2t = load_file(draft_dir / "model.safetensors")["d2t"]
            hot = d2t + torch.arange(d2t.shape[0])
        runners = self.api.draft_load == "runners"
        return (_RunnersWorker if runners else _DraftWorker)(hot, sealed=runners)

    def manager(self, worker: _DraftWorker) -> _Manager:
        return _Manager(self.api, worker)


@pytest.fixture
def shapes(sglang: Release, monkeypatch: pytest.MonkeyPatch) -> _Shapes:
    output = sglang.request_models["UpdateWeightFromDiskReqOutput"]
    monkeypatch.setattr(sglang_swap, "_output_type", lambda: output)
    return _Shapes(sglang)


def _not_called(*_args: Any, **_kwargs: Any) -> Any:
    raise AssertionError("SGLang's own update_weights_from_disk ran for a draft")


def test_a_draft_reloads_the_draft_worker_alone(
    shapes: _Shapes, tiny_drafts: dict[str, Path]
) -> None:
    worker = shapes.serving(tiny_drafts["en"])
    graphs_read = worker.hot  # the tensor the draft CUDA graphs captured
    manager = shapes.manager(worker)
    request = shapes.request(model_path=str(tiny_drafts["ko"]), weight_version="tide-draft-tiny-v2")
    out = shapes.swap(_not_called, manager, request)
    assert out.success, out.message
    # in-place loads keep the graphs valid; SGLang's recapture raises for an EAGLE draft runner
    [(path, _format, recapture)] = worker.loaded
    assert Path(path).resolve() == tiny_drafts["ko"].resolve() and recapture is False
    assert worker.runner.server_args.model_path == "/models/target"  # restored or untouched
    if shapes.api.records_weight_version:  # the scheduler's own record (0.5.23)
        assert manager.versions == ["tide-draft-tiny-v2"]
    else:
        assert worker.requests[0].weight_version == "tide-draft-tiny-v2"
    assert shapes.swapped == ["tide-draft-tiny-v2"]  # capture names it in records
    ko = load_file(tiny_drafts["ko"] / "model.safetensors")["d2t"]
    assert worker.hot is graphs_read  # refreshed in place, where the graphs read it
    assert torch.equal(graphs_read, ko + torch.arange(ko.shape[0]))
    assert manager.flushed == 1


def test_anything_else_goes_to_sglang_untouched(
    shapes: _Shapes, tiny_target: Path, tiny_drafts: dict[str, Path]
) -> None:
    manager = shapes.manager(shapes.serving(tiny_drafts["en"]))
    request = shapes.request(model_path=str(tiny_target))
    calls: list[Any] = []

    def original(self: Any, recv_req: Any) -> str:
        calls.append((self, recv_req))
        return "sglang's answer"

    assert shapes.swap(original, manager, request) == "sglang's answer"
    assert calls == [(manager, request)]


def test_a_bad_or_mismatched_draft_is_refused_and_the_old_one_stays(
    shapes: _Shapes, tiny_drafts: dict[str, Path], tmp_path: Path
) -> None:
    broken = shutil.copytree(tiny_drafts["ko"], tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    worker = shapes.serving(tiny_drafts["en"])
    before = worker.hot.clone()
    manager = shapes.manager(worker)
    make = shapes.request
    out = shapes.swap(_not_called, manager, make(model_path=str(broken)))
    assert not out.success and "cannot be read" in out.message
    smaller = shapes.serving(tiny_drafts["en"], hot=torch.arange(256))  # another vocabulary
    out = shapes.swap(_not_called, shapes.manager(smaller), make(model_path=str(tiny_drafts["ko"])))
    assert not out.success and "restart rollout" in out.message
    out = shapes.swap(_not_called, manager, make(model_path="s3://tide-lake/no/such/draft"))
    assert not out.success
    assert worker.loaded == [] and smaller.loaded == [] and manager.flushed == 0
    assert torch.equal(worker.hot, before)


def test_a_draft_uri_is_fetched_on_this_host(
    shapes: _Shapes,
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
    worker = shapes.serving(tiny_drafts["en"])
    request = shapes.request(
        model_path=f"s3://{stack.store.lake_bucket}/{prefix}", weight_version="from-s3"
    )
    out = shapes.swap(_not_called, shapes.manager(worker), request)
    assert out.success, out.message
    ko = load_file(tiny_drafts["ko"] / "model.safetensors")["d2t"]
    assert torch.equal(worker.hot, ko + torch.arange(ko.shape[0]))
    # one cached copy of this version, no temporary ones
    assert [p.name for p in (tmp_path / "scratch").iterdir()] == ["drafts"]
    assert len(list((tmp_path / "scratch" / "drafts").iterdir())) == 1


def test_the_hook_refuses_what_the_engine_refuses(
    shapes: _Shapes, tiny_drafts: dict[str, Path], tmp_path: Path
) -> None:
    """Issue 13 A and C in the SGLang hook: sources, and the one complete checkpoint check."""
    worker = shapes.serving(tiny_drafts["en"])
    make = shapes.request
    out_of_vocab = shutil.copytree(tiny_drafts["ko"], tmp_path / "d2t-out")
    state = load_file(out_of_vocab / "model.safetensors")
    state["d2t"][-1] = 5000
    save_file(state, out_of_vocab / "model.safetensors")
    out = shapes.swap(_not_called, shapes.manager(worker), make(model_path=str(out_of_vocab)))
    assert not out.success and "d2t" in out.message
    bad_dtype = shutil.copytree(tiny_drafts["ko"], tmp_path / "fc-int")
    state = load_file(bad_dtype / "model.safetensors")
    state["fc.weight"] = state["fc.weight"].to(torch.int32)
    save_file(state, bad_dtype / "model.safetensors")
    out = shapes.swap(_not_called, shapes.manager(worker), make(model_path=str(bad_dtype)))
    assert not out.success and "fc.weight has dtype int32" in out.message
    # tensors SGLang's EAGLE3 loader would skip silently, or load over the target's embedding
    for extra, refusal in (
        ("midlayer.extra_proj.weight", "not part of an EAGLE3 draft"),
        ("embed_tokens.weight", "token embedding"),
    ):
        padded = shutil.copytree(tiny_drafts["ko"], tmp_path / f"extra-{extra}")
        state = load_file(padded / "model.safetensors")
        state[extra] = torch.zeros(2, 2)
        save_file(state, padded / "model.safetensors")
        out = shapes.swap(_not_called, shapes.manager(worker), make(model_path=str(padded)))
        assert not out.success and refusal in out.message and extra in out.message
    outside = shutil.copytree(tiny_drafts["ko"], tmp_path.parent / f"outside-{uuid.uuid4().hex}")
    for path in (str(outside), "s3://elsewhere/drafts/ko", "models:/../x"):
        out = shapes.swap(_not_called, shapes.manager(worker), make(model_path=path))
        assert not out.success and "TIDE_SERVE__DRAFT_SOURCES" in out.message
    assert worker.loaded == []


def test_the_served_model_keeps_its_name_after_a_draft_swap(
    sglang: Release, tiny_drafts: dict[str, Path]
) -> None:
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
    params = sglang.parameters(sglang.method(module, class_name, method))
    assert params == ["self", "model_path", "load_format"]


def test_an_error_inside_the_hook_never_reaches_the_scheduler(
    shapes: _Shapes, tiny_drafts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_args: Any) -> Any:
        raise RuntimeError("a bug in TIDE")

    monkeypatch.setattr(sglang_swap, "_swap", broken)
    request = shapes.request(model_path=str(tiny_drafts["ko"]))
    out = shapes.swap(_not_called, shapes.manager(shapes.serving(tiny_drafts["en"])), request)
    assert not out.success and "a bug in TIDE" in out.message


def test_a_refused_flush_leaves_the_new_draft_and_is_reported(
    shapes: _Shapes, tiny_drafts: dict[str, Path]
) -> None:
    """Requests still running: 0.5.14's flush asserts, 0.5.23's reports."""
    worker = shapes.serving(tiny_drafts["en"])
    manager = shapes.manager(worker)
    refused = "the cache was not flushed because requests are still running"

    def flush(*args: Any) -> Any:
        if shapes.api.flush_reports:
            return False, refused
        raise AssertionError(refused)

    manager.flush_cache_after_weight_update = flush  # type: ignore[method-assign]
    request = shapes.request(model_path=str(tiny_drafts["ko"]), weight_version="v2")
    out = shapes.swap(_not_called, manager, request)
    # the new draft serves (stale draft entries only cost acceptance); the reply says so
    assert out.success and f"the cache was not flushed: {refused}" in out.message
    ko = load_file(tiny_drafts["ko"] / "model.safetensors")["d2t"]
    assert torch.equal(worker.hot, ko + torch.arange(ko.shape[0]))
    assert manager.versions == (["v2"] if shapes.api.records_weight_version else [])


def test_an_sglang_the_plugin_refuses_still_refuses_drafts(
    shapes: _Shapes, tiny_drafts: dict[str, Path], tiny_target: Path
) -> None:
    """The guard an unsupported SGLang keeps: a draft never reaches SGLang's own load
    (it would load into the target); anything else does."""
    guard = sglang_swap.refuse_draft_swaps("sglang 0.5.99 is not a release TIDE supports")
    manager = shapes.manager(shapes.serving(tiny_drafts["en"]))
    out = guard(_not_called, manager, shapes.request(model_path=str(tiny_drafts["ko"])))
    assert not out.success and "0.5.99" in out.message
    target = shapes.request(model_path=str(tiny_target))
    assert guard(lambda _m, r: r.model_path, manager, target) == str(tiny_target)


def _corrupt_copy(real: Any, scratch: Path) -> Any:
    """``_local_draft`` of a rank whose copy of the draft is corrupt on disk."""

    @contextlib.contextmanager
    def local_draft(manager: Any, path: str, version: str) -> Iterator[Path]:
        with real(manager, path, version) as local:
            if "ko" not in path:
                yield local
                return
            broken = shutil.copytree(local, scratch / f"broken-{uuid.uuid4().hex[:6]}")
            (broken / "model.safetensors").write_bytes(b"torn by a full disk")
            yield broken

    return local_draft


def _rank(rank: int, version: str, port: int, drafts: dict[str, str], scratch: str) -> None:
    """One TP rank (its own process) of a two-rank server: swaps through a real gloo group."""
    import datetime

    import torch.distributed as dist

    from tests.contract.sglang_release import release

    os.environ["TIDE_SCRATCH_DIR"] = f"{scratch}/rank{rank}"
    url = f"tcp://127.0.0.1:{port}"
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=2, timeout=timeout)
    wheel = release(version)
    output = wheel.request_models["UpdateWeightFromDiskReqOutput"]
    sglang_swap._output_type = lambda: output  # type: ignore[assignment]
    shapes = _Shapes(wheel)
    worker = shapes.serving(Path(drafts["en"]))
    object.__setattr__(worker.runner.server_args, "speculative_draft_model_path", drafts["en"])
    manager = shapes.manager(worker)
    manager.tp_cpu_group = dist.group.WORLD  # type: ignore[attr-defined]
    before = worker.hot.clone()
    found: dict[str, Any] = {}
    real = sglang_swap._local_draft
    if rank == 1:  # 1: rank 1's copy of the new draft is corrupt on disk
        sglang_swap._local_draft = _corrupt_copy(real, Path(scratch))  # type: ignore[assignment]
    out = shapes.swap(_not_called, manager, shapes.request(model_path=drafts["ko"]))
    found["corrupt"] = [out.success, out.message, torch.equal(worker.hot, before)]
    found["corrupt_loads"] = len(worker.loaded)
    sglang_swap._local_draft = real  # type: ignore[assignment]
    if rank == 1:  # 2: rank 1 cannot load it (rank 0 already has)
        load = worker.runner.update_weights_from_disk

        def failing(path: str, *args: Any, **kwargs: Any) -> tuple[bool, str]:
            return (False, "out of device memory") if "ko" in path else load(path, *args, **kwargs)

        worker.runner.update_weights_from_disk = failing  # type: ignore[method-assign]
    out = shapes.swap(_not_called, manager, shapes.request(model_path=drafts["ko"]))
    found["load"] = [out.success, out.message, torch.equal(worker.hot, before)]
    found["load_paths"] = [Path(path).name for path, _, _ in worker.loaded]
    found["flushed_before"] = manager.flushed  # no rank flushed for a swap that failed
    if rank == 1:
        worker.runner.update_weights_from_disk = load  # type: ignore[method-assign]
    out = shapes.swap(_not_called, manager, shapes.request(model_path=drafts["ko"]))
    found["swap"] = [out.success, out.message, torch.equal(worker.hot, before)]
    found["flushed"] = manager.flushed
    (Path(scratch) / f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def test_two_tp_ranks_agree_and_every_failure_is_named(
    sglang: Release, tiny_drafts: dict[str, Path], tmp_path: Path
) -> None:
    """Two processes on a real gloo group, as SGLang's TP ranks: rank 1's checkpoint torn
    on disk stops both before either loads; rank 1 failing to load makes both reload the
    draft they served. Each reply names rank 1."""
    import socket

    import torch.multiprocessing as mp

    drafts = {name: str(path) for name, path in tiny_drafts.items()}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_rank, args=(sglang.version, port, drafts, str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for found in ranks:
        success, message, kept = found["corrupt"]
        assert not success and kept and found["corrupt_loads"] == 0
        assert "failed on 1 of 2 ranks (rank 1:" in message and "cannot be read" in message
        success, message, kept = found["load"]
        assert not success and kept, message  # the old draft serves on both
        assert "loading the draft failed on 1 of 2 ranks (rank 1: out of device memory)" in message
        assert "every rank reloaded the draft it served before" in message
        assert found["flushed_before"] == 0
        success, message, kept = found["swap"]  # then a swap every rank can make
        assert success and not kept and found["flushed"] == 1, message
    en, ko = Path(drafts["en"]).name, Path(drafts["ko"]).name
    assert ranks[0]["load_paths"] == [ko, en] and ranks[1]["load_paths"] == [en]
