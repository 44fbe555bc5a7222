"""Draft-only hot swap on stock SGLang, as a hook of TIDE's SGLang plugin.

SGLang's ``/update_weights_from_disk`` has no ``is_draft_model`` (FastAPI drops it,
in 0.5.14 and 0.5.23 alike), and the scheduler's ``update_weights_from_disk`` loads
``model_path`` into the *target* first, then into the draft: promoting a draft
directory reloads the target from it (an untied ``lm_head`` fails and the scheduler
exits; a tied one serves the draft as the model). Upstream's draft-only swap was
closed unmerged. This AROUND hook on
``SchedulerWeightUpdaterManager.update_weights_from_disk`` (:class:`DraftSwap`)
recognises an EAGLE3 draft (``LlamaForCausalLMEagle3`` in its ``config.json``) or a
``models:/``, ``runs:/`` or ``s3://`` URI of one, from the sources this host allows
(:mod:`.draft_sources`, ``TIDE_SERVE__DRAFT_SOURCES``), downloads it into the
per-version draft cache, validates it with the check the reference engine uses
(:func:`~tide_lib.training.draft.validate_draft_dir`, against the serving draft's
hidden and vocabulary sizes), and reloads the draft alone, by the path the running
SGLang has (:class:`~tide_lib.serving.sglang_api.SGLangApi`: the worker's own load in
0.5.14, the draft runners' weight updaters in 0.5.23): weights in place, CUDA graphs
kept, the hot token map (``d2t``, which the draft's graphs bake in) copied into the
tensor the graphs read, the cache flushed, and the scheduler's weight version
recorded where it keeps one. Any other ``model_path`` goes to SGLang's method
untouched, so upstream clients keep working. A draft that fails to download or
validate is refused with SGLang's failure output; the old draft keeps serving.
"""

from __future__ import annotations

__all__ = [
    "MODEL_INFO_TARGET",
    "SWAP_TARGET",
    "DraftSwap",
    "is_draft_reference",
    "keep_target_model_info",
    "refuse_draft_swaps",
]

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from tide_lib.errors import TideError
from tide_lib.serving.sglang_api import SGLangApi

logger = logging.getLogger(__name__)

SWAP_TARGET = (
    "sglang.srt.managers.scheduler_components.weight_updater."
    "SchedulerWeightUpdaterManager.update_weights_from_disk"
)
# After a successful update the tokenizer manager renames the served model to model_path.
MODEL_INFO_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._update_model_path_info"
DRAFT_ARCHITECTURE = "LlamaForCausalLMEagle3"


class DraftSwapError(TideError, ValueError):
    """A draft cannot be swapped in; the message names what is wrong."""


class _LoadFailedError(TideError, RuntimeError):
    """SGLang's own load answered failure: its message goes back, the download is dropped."""


def is_draft_reference(model_path: str) -> bool:
    """A draft URI, or a local directory whose ``config.json`` names an EAGLE3 draft."""
    from tide_lib.registry.uris import is_portable  # noqa: PLC0415

    if is_portable(model_path):
        return True
    config = Path(model_path) / "config.json"
    try:
        architectures = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return DRAFT_ARCHITECTURE in architectures


def _output_type() -> Any:
    """SGLang's ``UpdateWeightFromDiskReqOutput`` (a seam for tests without SGLang)."""
    from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqOutput  # noqa: PLC0415

    return UpdateWeightFromDiskReqOutput


def _draft_target(manager: Any) -> Any:
    """The serving draft's hidden and vocabulary sizes (the target's), when SGLang shows them."""
    from tide_lib.training.draft import DraftTarget  # noqa: PLC0415

    worker = getattr(manager, "draft_worker", None)
    draft = getattr(worker, "_draft_worker", worker)
    runner = getattr(draft, "draft_runner", None)
    hf_config = getattr(getattr(runner, "model_config", None), "hf_config", None)
    if hf_config is None:
        return None
    return DraftTarget(int(hf_config.hidden_size), int(hf_config.vocab_size))


def _startup_draft(manager: Any) -> str | None:
    """The draft the server was launched with: the resolved value where SGLang keeps one
    (0.5.23's runtime context; its ``server_args`` hold the operator's raw input)."""
    try:
        from sglang.srt.runtime_context import get_context  # noqa: PLC0415

        path = get_context().config_leaf("speculative_draft_model_path")
    except Exception:  # 0.5.14 (no runtime context), or nothing published
        worker = getattr(manager, "draft_worker", None)
        draft = getattr(worker, "_draft_worker", worker)
        args = getattr(getattr(draft, "draft_runner", None), "server_args", None)
        path = getattr(args, "speculative_draft_model_path", None)
    return str(path) if path else None


def _validate(draft_dir: Path, target: Any = None) -> None:
    from tide_lib.training.draft import InvalidCheckpointError, validate_draft_dir  # noqa: PLC0415

    try:
        validate_draft_dir(draft_dir, target)
    except InvalidCheckpointError as error:
        raise DraftSwapError(str(error)) from error


def _refresh_hot_tokens(worker: Any) -> None:
    """Copy the reloaded draft's token map into the tensor the draft CUDA graphs read."""
    draft = getattr(worker, "_draft_worker", worker)
    fresh = getattr(draft.draft_runner.model, "hot_token_id", None)
    current = getattr(draft, "hot_token_id", None)
    if fresh is None or current is None or fresh.shape != current.shape:
        return  # shapes were checked before loading (_check_vocabulary)
    with torch.no_grad():
        current.copy_(fresh.to(current.device))


def _replace(request: Any, **changes: Any) -> Any:
    """A copy of an SGLang request with ``changes``: a dataclass (0.5.14) or a Struct."""
    if dataclasses.is_dataclass(request) and not isinstance(request, type):
        return dataclasses.replace(request, **changes)
    import msgspec  # noqa: PLC0415

    return msgspec.structs.replace(request, **changes)


def _load_draft(api: SGLangApi, worker: Any, recv_req: Any, local: Path) -> tuple[bool, str]:
    """Load ``local`` into the draft worker alone, by the path this SGLang has."""
    if api.draft_load == "runners":
        success, message = False, "this server's speculative worker has no draft weights"
        for role, runner in worker.weight_update_runners():
            if role != "draft":
                continue
            success, message = runner.weight_updater.update_weights_from_disk(
                str(local), recv_req.load_format, recapture_cuda_graph=False
            )
            if not success:
                break
        return bool(success), str(message)
    # Weights load in place, so the captured CUDA graphs stay valid; SGLang's recapture
    # cannot rebuild an EAGLE draft runner's graphs (it raises), so it is not asked for.
    request = _replace(recv_req, model_path=str(local), recapture_cuda_graph=False)
    draft = getattr(worker, "_draft_worker", worker)
    args = getattr(getattr(draft, "draft_runner", None), "server_args", None)
    launched = (args.model_path, args.load_format) if args is not None else None
    try:
        success, message = worker.update_weights_from_disk(request)
    finally:
        if args is not None and launched is not None:
            # 0.5.14's model runner records the loaded path as the server's model path
            args.model_path, args.load_format = launched
    return bool(success), str(message)


def _flush(api: SGLangApi, manager: Any, recv_req: Any) -> tuple[bool, str]:
    """SGLang's cache flush after a load, by the signature this SGLang has."""
    loaded = "Succeeded to update model weights."
    if api.flush_reports:
        success, message = manager.flush_cache_after_weight_update(recv_req, True, loaded)
        return bool(success), str(message)
    try:
        manager.flush_cache_after_weight_update(recv_req)
    except AssertionError as error:  # 0.5.14 asserts the flush succeeded
        return False, f"the draft loaded but the cache was not flushed: {error}"
    return True, loaded


def _check_swappable(manager: Any, local: Path) -> None:
    """Refuse, before anything loads, a swap this rank cannot make."""
    _validate(local, _draft_target(manager))
    worker = manager.draft_worker
    if worker is None:
        raise DraftSwapError("this server runs no draft model (no --speculative-algorithm)")
    draft = getattr(worker, "_draft_worker", worker)
    if draft is None:
        raise DraftSwapError("this rank holds no draft (a pipeline stage before the last)")
    _check_vocabulary(local, getattr(draft, "hot_token_id", None))


def _swap(api: SGLangApi, manager: Any, recv_req: Any, local: Path) -> tuple[bool, str]:
    """Load ``local`` into this rank's draft and refresh its token map (nothing shared
    yet: the cache and the weight version follow once every rank loaded)."""
    worker = manager.draft_worker
    success, message = _load_draft(api, worker, recv_req, local)
    if success:
        _refresh_hot_tokens(worker)
    return success, message


def _settle(api: SGLangApi, manager: Any, recv_req: Any, message: str) -> str:
    """Every rank loaded: flush the cache the old draft filled and record the version.
    A refused flush leaves the new draft serving (stale draft entries only cost
    acceptance until they age out); the reply says so."""
    if api.records_weight_version and recv_req.weight_version is not None:
        manager.record_weight_version_after_update(recv_req.weight_version)
    flushed, flush_message = _flush(api, manager, recv_req)
    if flushed:
        return message
    logger.warning("draft swapped in, cache not flushed: %s", flush_message)
    return f"{message} (the cache was not flushed: {flush_message})"


def keep_target_model_info(
    original: Any, tokenizer_manager: Any, model_path: str, *args: Any, **kwargs: Any
) -> Any:
    """AROUND hook: a draft swap leaves the served model's name and path as they were."""
    try:
        if is_draft_reference(str(model_path)):
            return None
    except Exception:  # never fail SGLang's own bookkeeping on TIDE's account
        logger.exception("checking %s for a draft failed", model_path)
    return original(tokenizer_manager, model_path, *args, **kwargs)


def _check_vocabulary(local: Path, current: Any) -> None:
    """Refuse before loading a draft whose draft vocabulary differs from the serving one."""
    if current is None:
        return
    size = json.loads((local / "config.json").read_text()).get("draft_vocab_size")
    if size is not None and int(size) != int(current.shape[0]):
        raise DraftSwapError(
            f"the new draft's vocabulary has {size} tokens, the serving one "
            f"{current.shape[0]}: a different draft_vocab_size needs a restart rollout"
        )


class DraftSwap:
    """The AROUND hook on ``SchedulerWeightUpdaterManager.update_weights_from_disk`` for
    one SGLang (:class:`~tide_lib.serving.sglang_api.SGLangApi`): drafts reload the
    draft worker alone; anything else goes to SGLang. ``on_swapped`` hears each draft
    version that now serves (capture writes it into records).

    Under tensor parallelism every rank runs this hook on the same request; the ranks
    agree (over SGLang's TP CPU group) after fetching and validating, and after
    loading. A rank that cannot use the draft stops every rank before any loads; a
    load that fails anywhere makes every rank reload the draft it served before. The
    reply names each rank that failed and why.
    """

    def __init__(self, api: SGLangApi, on_swapped: Callable[[str], None] | None = None) -> None:
        self.api = api
        self.on_swapped = on_swapped
        self._serving: tuple[str, str] | None = None  # (model_path, weight version) swapped in

    def _output(self, success: bool, message: str) -> Any:
        return _output_type()(success=success, message=message, num_paused_requests=0)

    def __call__(
        self, original: Any, manager: Any, recv_req: Any, *args: Any, **kwargs: Any
    ) -> Any:
        path = str(recv_req.model_path)
        try:
            draft = _agreed_draft_reference(getattr(manager, "tp_cpu_group", None), path)
        except Exception as error:  # ranks disagree, or their group failed: nothing loads
            logger.error("update to %s refused: %s", path, error)
            return self._output(False, f"TIDE refused {path}: {error}")
        if not draft:
            return original(manager, recv_req, *args, **kwargs)
        try:
            message = self._fetch_validate_swap(manager, recv_req, path)
        except _LoadFailedError as failed:
            logger.error("draft swap to %s failed: %s", path, failed)
            return self._output(False, str(failed))
        except DraftSwapError as error:
            logger.error("draft swap to %s refused: %s", path, error)
            return self._output(False, f"TIDE draft swap refused {path}: {error}")
        except Exception as error:  # the scheduler must never see TIDE's exceptions
            logger.exception("draft swap to %s failed inside TIDE's plugin", path)
            return self._output(False, f"TIDE draft swap of {path} failed: {error!r}")
        version = str(recv_req.weight_version or Path(path).name)
        self._serving = (path, str(recv_req.weight_version or path))
        logger.info("serving draft %s (%s); the target was not touched", path, version)
        if self.on_swapped is not None:
            try:
                self.on_swapped(version)
            except Exception:  # capture's bookkeeping never fails a swap that happened
                logger.exception("noting draft version %s failed", version)
        return self._output(True, message)

    def _fetch_validate_swap(self, manager: Any, recv_req: Any, path: str) -> str:
        """An allowed draft, downloaded (cached per version), validated, then swapped in,
        on every TP rank or on none."""
        group = getattr(manager, "tp_cpu_group", None)
        version = str(recv_req.weight_version or path)
        with contextlib.ExitStack() as stack:
            local: Path | None = None
            problem: str | None = None
            try:
                local = stack.enter_context(_local_draft(manager, path, version))
                _check_swappable(manager, local)
            except Exception as error:  # every rank must reach the agreement
                problem = _reason(error)
            _agree(group, problem, "fetching and validating the draft")
            assert local is not None
            try:
                success, message = _swap(self.api, manager, recv_req, local)
                problem = None if success else message
            except Exception as error:
                problem = _reason(error)
            try:
                _agree(group, problem, "loading the draft")
            except DraftSwapError as failed:
                problem = self._restore(manager, recv_req)
                try:
                    _agree(group, problem, "reloading the previous draft")
                    restored = "every rank reloaded the draft it served before"
                except DraftSwapError as unrestored:
                    restored = f"{unrestored}: restart those servers"
                raise _LoadFailedError(f"{failed}; {restored}") from failed  # drops the download
        return _settle(self.api, manager, recv_req, message)

    def _restore(self, manager: Any, recv_req: Any) -> str | None:
        """Reload the draft this rank served before a failed load (SGLang's own recovery
        may re-read the bad checkpoint); None when it serves again, else why not."""
        path, version = self._serving or (_startup_draft(manager) or "", "")
        if not path:
            return "no previous draft is known"
        try:
            with _local_draft(manager, path, version or path) as local:
                success, message = _load_draft(self.api, manager.draft_worker, recv_req, local)
            if success:
                _refresh_hot_tokens(manager.draft_worker)
                logger.info("reloaded the previous draft %s", path)
                return None
        except Exception as error:
            message = _reason(error)
        logger.error("reloading the previous draft %s failed: %s", path, message)
        return f"{path}: {message}"


def _reason(error: BaseException) -> str:
    """What went wrong, for the reply: TIDE's own refusals by message, bugs by repr."""
    from tide_lib.registry.uris import DraftFetchError  # noqa: PLC0415
    from tide_lib.serving.draft_sources import DraftRefusedError  # noqa: PLC0415

    known = (DraftSwapError, DraftFetchError, DraftRefusedError, OSError)
    if not isinstance(error, known):
        logger.exception("draft swap failed inside TIDE's plugin")
        return repr(error)
    return str(error)


def _agreed_draft_reference(group: Any, path: str) -> bool:
    """Is ``path`` a draft, as every TP rank sees it? A rank that cannot see a local
    draft directory would run SGLang's own load while the others wait on TIDE's."""
    draft = is_draft_reference(path)
    if group is None:
        return draft
    import torch.distributed as dist  # noqa: PLC0415

    seen: list[bool | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, draft, group=group)
    if len(set(seen)) > 1:
        drafts = [rank for rank, value in enumerate(seen) if value]
        raise DraftSwapError(
            f"only ranks {drafts} of {len(seen)} see a draft at {path}: every TP rank must "
            "see the same path (a URI, or a directory on every node)"
        )
    return draft


def _agree(group: Any, problem: str | None, step: str) -> None:
    """Every TP rank's outcome of one step (``problem``: None for success); raises on
    every rank, naming each rank that failed, when any did."""
    if group is None:
        if problem is not None:
            raise DraftSwapError(problem)
        return
    import torch.distributed as dist  # noqa: PLC0415

    outcomes: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, problem, group=group)
    failed = [f"rank {rank}: {why}" for rank, why in enumerate(outcomes) if why is not None]
    if failed:
        ranks = f"{len(failed)} of {len(outcomes)} ranks"
        raise DraftSwapError(f"{step} failed on {ranks} ({'; '.join(failed)})")


@contextlib.contextmanager
def _local_draft(manager: Any, path: str, version: str) -> Iterator[Path]:
    """This rank's local copy of an allowed draft (downloaded into its own cache)."""
    from tide_lib.config import TideConfig  # noqa: PLC0415
    from tide_lib.serving.draft_sources import DraftCache, DraftSources, local_draft  # noqa: PLC0415

    config = TideConfig()
    sources = DraftSources.of(config.serve, _startup_draft(manager))
    cache = DraftCache(config.scratch_dir / "drafts", config.serve.draft_cache_versions)
    with local_draft(path, version, sources, cache, config) as local:
        yield local


def refuse_draft_swaps(why: str) -> Callable[..., Any]:
    """An AROUND hook for an SGLang the plugin does not support: a draft sent to
    ``/update_weights_from_disk`` is refused (stock SGLang would load it into the
    target); anything else goes to SGLang."""

    def hook(original: Any, manager: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
        path = str(recv_req.model_path)
        if not is_draft_reference(path):
            return original(manager, recv_req, *args, **kwargs)
        message = f"TIDE draft swap refused {path}: {why}"
        return _output_type()(success=False, message=message, num_paused_requests=0)

    return hook
