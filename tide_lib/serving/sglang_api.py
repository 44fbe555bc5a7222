"""What TIDE's SGLang plugin needs of the SGLang it runs in, read from that SGLang's source.

SGLang's internals move between releases (the draft-only swap's load path, the flush
signature, request types that became ``msgspec`` Structs), so the plugin detects
features, never version strings: :func:`detect` reads the installed tree with
``ast`` (no import: SGLang does not import without its GPU stack, and a feature
found in the source is there whatever imports later fail) and answers one
:class:`SGLangApi`, or refuses with every missing feature named. The contract tests
run the same function on each released wheel, so the features the tests find are
the ones the plugin finds at run time.

A version outside :data:`SUPPORTED_SGLANG_VERSIONS` is refused even when its
features read right: nothing has checked its semantics.
"""

from __future__ import annotations

__all__ = [
    "SUPPORTED_SGLANG_VERSIONS",
    "SGLangApi",
    "SourceTree",
    "UnsupportedSGLangError",
    "detect",
]

import ast
import dataclasses
import importlib.util
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal

from tide_lib.errors import TideError

SUPPORTED_SGLANG_VERSIONS = ("0.5.14", "0.5.23")
"""The released SGLang versions the plugin is tested against (contract suite per wheel)."""

IO = "sglang.srt.managers.io_struct"
SCHEDULER = "sglang.srt.managers.scheduler"
UPDATER = "sglang.srt.managers.scheduler_components.weight_updater"
TOKENIZER = "sglang.srt.managers.tokenizer_manager"
WORKER = "sglang.srt.speculative.eagle_worker_v2"
BASE_SPEC = "sglang.srt.speculative.base_spec_worker"
RUNNER_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater"
LOGITS = "sglang.srt.layers.logits_processor"
HOOKS = "sglang.srt.plugins.hook_registry"
PARALLEL = "sglang.srt.distributed.parallel_state"
DP_ATTENTION = "sglang.srt.layers.dp_attention"

_Function = ast.FunctionDef | ast.AsyncFunctionDef


class UnsupportedSGLangError(TideError, RuntimeError):
    """This SGLang lacks what the plugin needs, or is not a supported release."""


class SourceTree:
    """The modules of one SGLang tree, parsed on demand (``root`` holds ``sglang/``).

    ``edits`` replaces the text of some modules (module name -> source): a tree
    edited in memory, as the contract tests make to show a missing feature is found.
    """

    def __init__(self, root: Path, edits: Mapping[str, str] | None = None) -> None:
        self.root = root
        self._edits = dict(edits or {})
        self._parsed: dict[str, ast.Module | None] = {}

    @classmethod
    def installed(cls) -> SourceTree:
        """The SGLang this process would import."""
        spec = importlib.util.find_spec("sglang")
        if spec is None or spec.origin is None:
            raise UnsupportedSGLangError("sglang is not installed; pip install sglang==0.5.23")
        return cls(Path(spec.origin).parent.parent)

    def edited(self, module: str, old: str, new: str) -> SourceTree:
        """This tree with ``old`` replaced by ``new`` in ``module`` (which must hold it)."""
        text = self.text(module)
        if text is None or old not in text:
            raise ValueError(f"{module} has no {old!r} to edit")
        edited = SourceTree(self.root, {**self._edits, module: text.replace(old, new)})
        edited._parsed = {name: tree for name, tree in self._parsed.items() if name != module}
        return edited

    def file(self, module: str) -> Path:
        return self.root / (module.replace(".", "/") + ".py")

    def text(self, module: str) -> str | None:
        if module in self._edits:
            return self._edits[module]
        path = self.file(module)
        return path.read_text(encoding="utf-8") if path.is_file() else None

    def module(self, module: str) -> ast.Module | None:
        if module not in self._parsed:
            text = self.text(module)
            self._parsed[module] = None if text is None else ast.parse(text)
        return self._parsed[module]

    def version(self) -> str:
        text = self.text("sglang._version") or self.text("sglang.version") or ""
        found = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", text)
        return found.group(1) if found else "unknown"

    def class_def(self, module: str, name: str) -> ast.ClassDef | None:
        tree = self.module(module)
        for node in tree.body if tree is not None else []:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        return None

    def method(self, module: str, class_name: str, name: str) -> _Function | None:
        node = self.class_def(module, class_name)
        for item in node.body if node is not None else []:
            if isinstance(item, _Function) and item.name == name:
                return item
        return None

    def function(self, module: str, name: str) -> _Function | None:
        tree = self.module(module)
        for node in tree.body if tree is not None else []:
            if isinstance(node, _Function) and node.name == name:
                return node
        return None

    def parameters(self, module: str, class_name: str, name: str) -> list[str] | None:
        """Positional parameter names of a method (None: no such method)."""
        found = self.method(module, class_name, name)
        return None if found is None else [arg.arg for arg in found.args.args]

    def self_attributes(self, module: str, class_name: str) -> set[str]:
        """Names any method of the class assigns as ``self.X``."""
        node = self.class_def(module, class_name)
        names: set[str] = set()
        for item in ast.walk(node) if node is not None else []:
            targets = item.targets if isinstance(item, ast.Assign) else []
            if isinstance(item, ast.AnnAssign):
                targets = [item.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self":
                    names.add(target.attr)
        return names

    def fields(self, module: str, class_name: str) -> set[str]:
        """Annotated fields of a class, with those of its bases in the same module."""
        node = self.class_def(module, class_name)
        if node is None:
            return set()
        found = {
            item.target.id
            for item in node.body
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
        }
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id != class_name:
                found |= self.fields(module, base.id)
        return found

    def bases(self, module: str, class_name: str) -> list[str]:
        node = self.class_def(module, class_name)
        return [] if node is None else [ast.unparse(base) for base in node.bases]


@dataclasses.dataclass(frozen=True)
class SGLangApi:
    """The SGLang features the plugin's hooks take their path by."""

    version: str
    draft_load: Literal["worker", "runners"]
    """``worker``: ``EAGLEWorkerV2.update_weights_from_disk(recv_req)``; ``runners``: each
    ``("draft", runner)`` of ``weight_update_runners()`` loads through ``runner.weight_updater``"""
    flush_reports: bool
    """``flush_cache_after_weight_update(recv_req, success, message) -> (success, message)``
    (else ``(recv_req)``, asserting on failure)"""
    records_weight_version: bool
    """the manager records the loaded version (``record_weight_version_after_update``)"""


@dataclasses.dataclass(frozen=True)
class _Need:
    what: str
    holds: Callable[[SourceTree], bool]


def _has_method(module: str, class_name: str, name: str, prefix: list[str]) -> _Need:
    def holds(tree: SourceTree) -> bool:
        found = tree.parameters(module, class_name, name)
        return found is not None and found[: len(prefix)] == prefix

    return _Need(f"{class_name}.{name}({', '.join(prefix)}, ...) in {module}", holds)


def _dispatches_disk_updates(tree: SourceTree) -> bool:
    """The scheduler hands ``UpdateWeightFromDiskReqInput`` to the manager the swap hooks."""
    dispatcher = tree.method(SCHEDULER, "Scheduler", "init_request_dispatcher")
    for node in ast.walk(dispatcher) if dispatcher is not None else []:
        if isinstance(node, ast.Tuple) and len(node.elts) == 2:
            kind, handler = (ast.unparse(element) for element in node.elts)
            if kind == "UpdateWeightFromDiskReqInput":
                return handler == "self.weight_updater.update_weights_from_disk"
    return False


_NEEDS = [
    _Need(
        "Scheduler.init_request_dispatcher handing UpdateWeightFromDiskReqInput to "
        "self.weight_updater.update_weights_from_disk (where the draft-only swap hooks in)",
        _dispatches_disk_updates,
    ),
    _has_method(
        UPDATER, "SchedulerWeightUpdaterManager", "update_weights_from_disk", ["self", "recv_req"]
    ),
    _Need(
        "SchedulerWeightUpdaterManager fields tp_worker, draft_worker and tp_cpu_group (the "
        "group TP ranks agree on a swap over)",
        lambda t: (
            {"tp_worker", "draft_worker", "tp_cpu_group"}
            <= t.fields(UPDATER, "SchedulerWeightUpdaterManager")
        ),
    ),
    _Need(
        "EAGLEWorkerV2._draft_worker (the draft worker the swap reloads)",
        lambda t: "_draft_worker" in t.self_attributes(WORKER, "EAGLEWorkerV2"),
    ),
    _Need(
        "EagleDraftWorker.draft_runner (the draft's model runner)",
        lambda t: "draft_runner" in t.self_attributes(WORKER, "EagleDraftWorker"),
    ),
    _Need(
        "EagleDraftWorker.hot_token_id (the token map the draft's CUDA graphs read)",
        lambda t: "hot_token_id" in t.self_attributes(WORKER, "EagleDraftWorker"),
    ),
    _Need(
        "UpdateWeightFromDiskReqInput fields model_path, load_format, weight_version, "
        "recapture_cuda_graph",
        lambda t: (
            {"model_path", "load_format", "weight_version", "recapture_cuda_graph"}
            <= t.fields(IO, "UpdateWeightFromDiskReqInput")
        ),
    ),
    _Need(
        "UpdateWeightFromDiskReqOutput fields success, message, num_paused_requests",
        lambda t: (
            {"success", "message", "num_paused_requests"}
            <= t.fields(IO, "UpdateWeightFromDiskReqOutput")
        ),
    ),
    _has_method(TOKENIZER, "TokenizerManager", "_update_model_path_info", ["self", "model_path"]),
    _has_method(TOKENIZER, "TokenizerManager", "_create_tokenized_object", ["self", "obj"]),
    _has_method(SCHEDULER, "Scheduler", "handle_generate_request", ["self", "recv_req"]),
    _has_method(
        LOGITS,
        "LogitsProcessor",
        "forward",
        ["self", "input_ids", "hidden_states", "lm_head", "logits_metadata"],
    ),
    _has_method(WORKER, "EAGLEWorkerV2", "forward_batch_generation", ["self", "batch"]),
    _has_method(HOOKS, "HookRegistry", "register", ["cls", "target", "hook"]),
    _Need(
        f"get_tensor_model_parallel_rank() in {PARALLEL}",
        lambda t: t.function(PARALLEL, "get_tensor_model_parallel_rank") is not None,
    ),
    _Need(
        f"is_dp_attention_enabled() in {DP_ATTENTION}",
        lambda t: t.function(DP_ATTENTION, "is_dp_attention_enabled") is not None,
    ),
]


def _draft_load(tree: SourceTree) -> Literal["worker", "runners"] | None:
    if tree.parameters(WORKER, "EAGLEWorkerV2", "update_weights_from_disk") == ["self", "recv_req"]:
        return "worker"
    runners = tree.method(BASE_SPEC, "BaseSpecWorker", "weight_update_runners")
    load = tree.parameters(RUNNER_UPDATER, "WeightUpdater", "update_weights_from_disk") or []
    loads = load[:3] == ["self", "model_path", "load_format"] and "recapture_cuda_graph" in load
    return "runners" if runners is not None and loads else None


def _flush_reports(tree: SourceTree) -> bool | None:
    found = tree.parameters(
        UPDATER, "SchedulerWeightUpdaterManager", "flush_cache_after_weight_update"
    )
    return {
        ("self", "recv_req"): False,
        ("self", "recv_req", "success", "message"): True,
    }.get(tuple(found or ()))


def detect(tree: SourceTree) -> SGLangApi:
    """The features of ``tree`` the plugin takes its path by; refuses (every missing
    feature named) a tree that lacks one or is not a supported release."""
    version = tree.version()
    missing = [need.what for need in _NEEDS if not need.holds(tree)]
    draft_load, flush_reports = _draft_load(tree), _flush_reports(tree)
    if draft_load is None:
        missing.append(
            "a draft-only load: EAGLEWorkerV2.update_weights_from_disk(self, recv_req) "
            "(sglang 0.5.14) or BaseSpecWorker.weight_update_runners with "
            "WeightUpdater.update_weights_from_disk(self, model_path, load_format, ..., "
            "recapture_cuda_graph) (sglang 0.5.21 and later)"
        )
    if flush_reports is None:
        missing.append(
            "SchedulerWeightUpdaterManager.flush_cache_after_weight_update(self, recv_req) "
            "or (self, recv_req, success, message)"
        )
    supported = ", ".join(SUPPORTED_SGLANG_VERSIONS)
    if missing:
        raise UnsupportedSGLangError(
            f"sglang {version} at {tree.root} lacks what TIDE's plugin needs: "
            f"{'; '.join(missing)}. Install one of the supported releases ({supported})"
        )
    if version not in SUPPORTED_SGLANG_VERSIONS:
        raise UnsupportedSGLangError(
            f"sglang {version} is not a release TIDE supports ({supported}); install one of those"
        )
    assert draft_load is not None and flush_reports is not None
    return SGLangApi(
        version=version,
        draft_load=draft_load,
        flush_reports=flush_reports,
        records_weight_version=tree.method(
            UPDATER, "SchedulerWeightUpdaterManager", "record_weight_version_after_update"
        )
        is not None,
    )
