"""Draft-only hot swap on stock SGLang 0.5.14, as a hook of TIDE's SGLang plugin.

SGLang 0.5.14's ``/update_weights_from_disk`` has no ``is_draft_model`` (FastAPI
drops it), and the scheduler's ``update_weights_from_disk`` loads ``model_path``
into the *target* first, then into the draft: promoting a draft directory
reloads the target from it (an untied ``lm_head`` fails and the scheduler
exits; a tied one serves the draft as the model). Upstream's draft-only swap
was closed unmerged. This AROUND hook on
``SchedulerWeightUpdaterManager.update_weights_from_disk`` recognises an EAGLE3
draft (``LlamaForCausalLMEagle3`` in its ``config.json``) or a ``models:/``,
``runs:/`` or ``s3://`` URI of one, from the sources this host allows
(:mod:`.draft_sources`, ``TIDE_SERVE__DRAFT_SOURCES``), downloads it into the
per-version draft cache, validates it with the check the reference engine uses
(:func:`~tide_lib.training.draft.validate_draft_dir`, against the serving
draft's hidden and vocabulary sizes), and reloads the draft worker alone:
weights in place, CUDA graphs recaptured, the hot token map (``d2t``, which
the draft's graphs bake in) copied into the tensor the graphs read, the cache
flushed. Any other ``model_path`` goes to
SGLang's method untouched, so upstream clients keep working. A draft that
fails to download or validate is refused with SGLang's failure output; the
old draft keeps serving.
"""

from __future__ import annotations

__all__ = [
    "MODEL_INFO_TARGET",
    "SWAP_TARGET",
    "draft_only_swap",
    "is_draft_reference",
    "keep_target_model_info",
]

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

from tide_lib.errors import TideError

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


def _swap(manager: Any, recv_req: Any, local: Path) -> tuple[bool, str]:
    worker = manager.draft_worker
    if worker is None:
        raise DraftSwapError("this server runs no draft model (no --speculative-algorithm)")
    draft = getattr(worker, "_draft_worker", worker)
    _check_vocabulary(local, getattr(draft, "hot_token_id", None))
    # Weights load in place, so the captured CUDA graphs stay valid; SGLang's recapture
    # cannot rebuild an EAGLE draft runner's graphs (it raises), so it is not asked for.
    request = dataclasses.replace(recv_req, model_path=str(local), recapture_cuda_graph=False)
    args = getattr(getattr(draft, "draft_runner", None), "server_args", None)
    launched = (args.model_path, args.load_format) if args is not None else None
    try:
        success, message = worker.update_weights_from_disk(request)
    finally:
        if args is not None and launched is not None:
            # the model runner records the loaded path as the server's model path
            args.model_path, args.load_format = launched
    if success:
        _refresh_hot_tokens(worker)
        manager.flush_cache_after_weight_update(recv_req)
    return bool(success), str(message)


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


def draft_only_swap(original: Any, manager: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    """The AROUND hook: drafts reload the draft worker alone; anything else goes to SGLang."""
    path = str(recv_req.model_path)
    if not is_draft_reference(path):
        return original(manager, recv_req, *args, **kwargs)
    from tide_lib.registry.uris import DraftFetchError  # noqa: PLC0415
    from tide_lib.serving.draft_sources import DraftRefusedError  # noqa: PLC0415

    try:
        message = _fetch_validate_swap(manager, recv_req, path)
    except _LoadFailedError as failed:
        return _output_type()(False, str(failed), 0)
    except (DraftSwapError, DraftFetchError, DraftRefusedError, OSError) as error:
        logger.error("draft swap to %s refused: %s", path, error)
        return _output_type()(False, f"TIDE draft swap refused {path}: {error}", 0)
    except Exception as error:  # the scheduler must never see TIDE's exceptions
        logger.exception("draft swap to %s failed inside TIDE's plugin", path)
        return _output_type()(False, f"TIDE draft swap of {path} failed: {error!r}", 0)
    logger.info("serving draft %s (%s); the target was not touched", path, recv_req.weight_version)
    return _output_type()(True, message, 0)


def _fetch_validate_swap(manager: Any, recv_req: Any, path: str) -> str:
    """An allowed draft, downloaded (cached per version), validated, then swapped in."""
    from tide_lib.config import TideConfig  # noqa: PLC0415
    from tide_lib.serving.draft_sources import DraftCache, DraftSources, local_draft  # noqa: PLC0415

    config = TideConfig()
    sources = DraftSources.of(config.serve, _startup_draft(manager))
    cache = DraftCache(config.scratch_dir / "drafts", config.serve.draft_cache_versions)
    version = str(recv_req.weight_version or path)
    with local_draft(path, version, sources, cache, config) as local:
        _validate(local, _draft_target(manager))
        success, message = _swap(manager, recv_req, local)
        if not success:
            raise _LoadFailedError(message)  # leaves the with: a downloaded copy is dropped
    return message
