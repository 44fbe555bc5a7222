"""Capture inside a real SGLang server, as a plugin of SGLang's own plugin framework.

Why a plugin and not a fork: SGLang (0.5.14 and 0.5.23, the releases of
:data:`~tide_lib.serving.sglang_api.SUPPORTED_SGLANG_VERSIONS`) loads the entry points
of group ``sglang.srt.plugins`` in every scheduler process and applies the hooks they
register with its ``HookRegistry``. TIDE's package declares ``tide_capture`` there, so
a GPU host needs ``pip install tide sglang==0.5.23`` and ``TIDE_SGLANG_CAPTURE=1``;
nothing in SGLang is edited. What differs between releases is detected from the
installed SGLang's source (:func:`~tide_lib.serving.sglang_api.detect`); an SGLang
that lacks a feature, or is not a supported release, is refused at load with every
missing feature named, and only a guard stays on: drafts sent to
``/update_weights_from_disk`` are refused rather than loaded into the target.

What is hooked (chain drafting, ``--speculative-eagle-topk 1``, the overlap worker
``EAGLEWorkerV2`` both releases use for EAGLE3):

- ``LogitsProcessor.forward`` of the *target*: when the batch captures all hidden
  states (target prefill and target verify), the final-layer states after the final
  norm are kept in ``customized_info``. That field survives CUDA-graph replay, so
  verify steps under graphs are captured too. The worker hook removes it again
  before the scheduler sees it.
- ``EAGLEWorkerV2.forward_batch_generation``: after each prefill, the aux states
  (``logits_output.hidden_states``, ``[tokens, 3H]``) and final states of every
  prompt token; after each verify, the ``[bs * num_draft_tokens]`` blocks and the
  accept lengths. Only GPU-side copies are made here; nothing waits on the GPU.
- ``TokenizerManager._create_tokenized_object`` (the HTTP process) and
  ``Scheduler.handle_generate_request``: a request's ``custom_labels["segment"]``
  stays behind in the tokenizer (``TokenizedGenerateReqInput`` has no labels), so
  the first hook carries it on the tokenized request (:mod:`.sglang_labels`) to the
  scheduler, and the second notes it by request id for the record.
- ``SchedulerWeightUpdaterManager.update_weights_from_disk`` (always, capture or
  not): a draft-only hot swap for drafts and draft URIs, see
  :mod:`tide_lib.serving.sglang_swap`; the version it swaps in is written into records.

A background thread turns each finished request into a ``CapturedRecord``: it waits
on a CUDA event, keeps the accepted rows of each verify block, applies the same
sampling rate and selective-capture threshold as the reference engine, and hands
the record to the ``LakeWriter`` (which batches, uploads and spools).

It can only lose captures, never requests: every hook body is guarded (an error
is counted, logged once per kind, and switches capture off for the process; the
scheduler gets SGLang's own result); rows leave the GPU every step through a side
stream into pinned host memory, within ``serve.capture_max_held_bytes`` (over it,
the request's capture is dropped and counted); each process spools in a directory
of its own (``tp<rank>-pid<pid>``, adopting a dead process's shards); records end
at the request's real stop (``finished_len``); SGLang's health checks and warm-up
are not captured. Counters ``tide:capture_{records,dropped,errors,bytes}_total``
go through prometheus_client, so SGLang's ``/metrics`` shows them.

Limits: the prompt's radix-cached prefix has no states (the record starts at the
first computed token); a retracted request is dropped; tensor parallelism captures
on TP rank 0 only; tree drafting (topk > 1) and data-parallel attention are refused.
This module cannot run on the CPU machine TIDE is tested on (no GPU, no SGLang);
the assembly of records is tested there on SGLang-shaped blocks, see
``tests/serving/test_sglang_plugin.py``.
"""

from __future__ import annotations

__all__ = [
    "ENABLE_ENV",
    "RequestStates",
    "SGLangCapture",
    "register",
]

import collections
import dataclasses
import logging
import os
import queue
import random
import shutil
import socket
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import torch

from tide_lib.config import TideConfig
from tide_lib.lake import CapturedRecord, LakeWriter, ObjectStore
from tide_lib.lake.schema import SEGMENT_LABEL, segment_problem, target_limits
from tide_lib.serving.capture import sampled, serves_well
from tide_lib.serving.sglang_api import (
    SUPPORTED_SGLANG_VERSIONS,
    SourceTree,
    detect,
)
from tide_lib.serving.sglang_labels import SEGMENT_ATTRIBUTE, with_segment
from tide_lib.serving.sglang_swap import (
    MODEL_INFO_TARGET,
    SWAP_TARGET,
    DraftSwap,
    keep_target_model_info,
    refuse_draft_swaps,
)
from tide_lib.stack.manager import pid_alive

logger = logging.getLogger(__name__)

ENABLE_ENV = "TIDE_SGLANG_CAPTURE"
FINAL_STATES_KEY = "tide_final_hidden"
_LOGITS_TARGET = "sglang.srt.layers.logits_processor.LogitsProcessor.forward"
_WORKER = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2"
_TOKENIZE_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object"
_RECEIVE_TARGET = "sglang.srt.managers.scheduler.Scheduler.handle_generate_request"
_POLL_SECONDS = 0.5
# Requests SGLang makes of itself, never traffic (checked against each wheel by tests/contract):
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # sglang.srt.constants, /health's one-token request
WARMUP_TEXT = "The capital city of France is"  # http_server._execute_server_warmup's prompt


class _HostCopier:
    """Rows leave the GPU as they are produced: a side stream copies them into pinned memory.

    Nothing on the decoding path waits: the copy is enqueued after the work that
    produced the rows, and the finalizer thread waits on the event instead.
    """

    def __init__(self) -> None:
        available = torch.cuda.is_available()
        self._stream = torch.cuda.Stream() if available else None  # type: ignore[no-untyped-call]

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._stream is None or not tensor.is_cuda:
            return tensor.detach().clone()
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            out.copy_(tensor, non_blocking=True)
        tensor.record_stream(self._stream)
        return out

    def event(self) -> Any:
        """A CUDA event after the copies enqueued so far (None on CPU).

        The serving stream waits for it on the GPU (the CPU never does): rows of a
        CUDA-graph replay live in the graph's static buffers, which the next replay
        overwrites, so they must be copied before it runs.
        """
        if self._stream is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._stream)
        torch.cuda.current_stream().wait_event(event)
        return event


@dataclasses.dataclass
class _Block:
    final: torch.Tensor  # [rows, H]
    aux: torch.Tensor  # [rows, 3H]
    accepted: torch.Tensor | None  # verify blocks: accepted rows (bonus included); None: all rows


class RequestStates:
    """The target states one request has produced so far, in SGLang's batch layout.

    ``offset`` is the first token position with states (the radix-cached prefix has
    none). Verify blocks keep all ``num_draft_tokens`` rows and the accept length as
    GPU tensors; :meth:`assemble` keeps the accepted front of each block (chain
    drafting puts the accepted path first), in order.
    """

    def __init__(self, request_id: str, offset: int, segment: str | None = None) -> None:
        self.request_id = request_id
        self.offset = offset
        self.segment = segment  # the client's label, if the request had one
        self.started_at = datetime.now(UTC)
        self.prefill_rows = 0
        self.verify_steps = 0
        self.ready: Any = None  # CUDA event recorded after the latest copies
        self.nbytes = 0  # host memory its rows hold
        self._blocks: list[_Block] = []

    def add_prefill(self, final: torch.Tensor, aux: torch.Tensor) -> None:
        """States of one (chunk of a) prefill, one row per computed prompt token."""
        if self.verify_steps:
            raise ValueError(f"request {self.request_id}: prefill after decoding (retracted)")
        self._blocks.append(_Block(final, aux, None))
        self.prefill_rows += int(final.shape[0])
        self.nbytes += _nbytes(final, aux)

    def add_verify(self, final: torch.Tensor, aux: torch.Tensor, accepted: torch.Tensor) -> None:
        """One verify block: ``num_draft_tokens`` rows and the accept length (bonus included)."""
        self._blocks.append(_Block(final, aux, accepted))
        self.verify_steps += 1
        self.nbytes += _nbytes(final, aux)

    def assemble(self, token_ids: list[int]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """``(token ids, final [T, H], aux [T, 3H])`` on the CPU, trimmed to the tokens."""
        finals: list[torch.Tensor] = []
        auxes: list[torch.Tensor] = []
        for block in self._blocks:
            rows = block.final.shape[0] if block.accepted is None else int(block.accepted.item())
            finals.append(block.final[:rows])
            auxes.append(block.aux[:rows])
        final = torch.cat(finals).cpu()
        aux = torch.cat(auxes).cpu()
        length = min(int(final.shape[0]), len(token_ids) - self.offset)
        if length <= 0:
            raise ValueError(f"request {self.request_id}: no states for its tokens")
        return token_ids[self.offset : self.offset + length], final[:length], aux[:length]


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class PendingSegments:
    """Segment labels of requests the scheduler received but capture has not yet seen.

    Bounded: a request that never reaches a batch (aborted in the queue) is forgotten
    once ``limit`` newer labels arrived, so labels cannot grow the scheduler's memory.
    """

    def __init__(self, limit: int = 65536) -> None:
        self._labels: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def note(self, request_id: str, segment: str) -> None:
        with self._lock:
            self._labels[request_id] = segment
            while len(self._labels) > self._limit:
                self._labels.popitem(last=False)

    def take(self, request_id: str) -> str | None:
        with self._lock:
            return self._labels.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._labels)


def _is_self_request(req: Any, warmup_prompts: set[tuple[int, ...]]) -> bool:
    """SGLang's own health checks and warm-up: never traffic, never captured."""
    rid = getattr(req, "rid", "")
    if isinstance(rid, str) and rid.startswith(HEALTH_CHECK_RID_PREFIX):
        return True
    return tuple(req.origin_input_ids) in warmup_prompts


def _aborted(req: Any) -> bool:
    return type(getattr(req, "finished_reason", None)).__name__ == "FINISH_ABORT"


def _output_through_stop(req: Any) -> list[int]:
    """The output up to the request's real stop: ``output_ids`` can run past it."""
    output = list(req.output_ids)
    end = getattr(req, "finished_len", None)
    return output[:end] if end is not None else output


@dataclasses.dataclass
class _Finished:
    states: RequestStates
    prompt_len: int
    output_ids: list[int]
    token_ids: list[int]
    drafted_tokens: int
    accepted_draft_tokens: int
    draft_version: str
    ready: Any  # torch.cuda.Event or None


class SGLangCapture:
    """Per-process capture state: open requests, the finalizer thread and the lake writer."""

    def __init__(
        self,
        config: TideConfig,
        target_id: str,
        draft_version: str,
        num_steps: int,
        writer: LakeWriter | None = None,
        *,
        warmup_prompts: set[tuple[int, ...]] | None = None,
        target_dir: str | None = None,
        segments: PendingSegments | None = None,
    ) -> None:
        self.config = config
        self.target_id = target_id
        self.draft_version = draft_version
        self.num_steps = num_steps
        self.writer = writer or LakeWriter(
            ObjectStore(config.store, config.store.lake_bucket),
            config.lake,
            limits=target_limits(target_dir),
        )
        self.max_held_bytes = config.serve.capture_max_held_bytes
        self.warmup_prompts = warmup_prompts or set()
        self.segments = segments if segments is not None else PendingSegments()
        self.captured = 0
        self.skipped = 0
        self.dropped = 0
        self.held_bytes = 0
        # None: a request that is not captured (not sampled, dropped, SGLang's own)
        self._open: dict[str, tuple[Any, RequestStates | None]] = {}
        self._lock = threading.Lock()
        self._rng = random.Random()
        self._host = _HostCopier()
        self._finished: queue.Queue[_Finished | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="tide-capture", daemon=True)
        self._thread.start()

    # -- called from the scheduler's forward path (no GPU waits) -----------------------------

    def _states(self, req: Any, prefix: int) -> RequestStates | None:
        """The request's states, opened at first sight (caller holds the lock)."""
        entry = self._open.get(req.rid)
        if entry is None:
            segment = self.segments.take(req.rid)
            keep = sampled(self.config.serve, self._rng) and not _is_self_request(
                req, self.warmup_prompts
            )
            entry = (req, RequestStates(req.rid, prefix, segment) if keep else None)
            self._open[req.rid] = entry
        return entry[1]

    def _drop(self, req: Any, states: RequestStates, why: str) -> None:
        """Stop capturing a request and free what it held (caller holds the lock)."""
        logger.debug("capture of %s dropped: %s", req.rid, why)
        self._open[req.rid] = (req, None)
        self.held_bytes -= states.nbytes
        self.dropped += 1
        _metric("dropped").inc()

    def _fits(self, rows: int, width: int, element: int) -> bool:
        return self.held_bytes + rows * width * element <= self.max_held_bytes

    def on_prefill(
        self,
        reqs: list[Any],
        prefix_lens: list[int],
        extend_lens: list[int],
        final: torch.Tensor,
        aux: torch.Tensor,
    ) -> None:
        """Rows of one prefill batch: ``sum(extend_lens)`` rows in request order."""
        start = 0
        touched: list[RequestStates] = []
        width = final.shape[1] + aux.shape[1]
        for req, prefix, rows in zip(reqs, prefix_lens, extend_lens, strict=True):
            end = start + rows
            with self._lock:
                states = self._states(req, prefix)
                if states is not None:
                    if prefix != states.offset + states.prefill_rows:
                        self._drop(req, states, "prefill chunk not contiguous (retracted)")
                    elif not self._fits(rows, width, final.element_size()):
                        self._drop(req, states, "host byte budget (serve.capture_max_held_bytes)")
                    else:
                        states.add_prefill(
                            self._host.copy(final[start:end]), self._host.copy(aux[start:end])
                        )
                        self.held_bytes += _nbytes(final[start:end], aux[start:end])
                        touched.append(states)
            start = end
        ready = self._host.event()
        for states in touched:
            states.ready = ready

    def on_verify(
        self,
        reqs: list[Any],
        num_draft_tokens: int,
        final: torch.Tensor,
        aux: torch.Tensor,
        accept_lens: torch.Tensor,
    ) -> None:
        """One verify batch: a block of ``num_draft_tokens`` rows per request."""
        touched: list[RequestStates] = []
        width = final.shape[1] + aux.shape[1]
        with self._lock:
            for index, req in enumerate(reqs):
                states = self._open.get(req.rid, (None, None))[1]
                if states is None:
                    continue
                if not self._fits(num_draft_tokens, width, final.element_size()):
                    self._drop(req, states, "host byte budget (serve.capture_max_held_bytes)")
                    continue
                rows = slice(index * num_draft_tokens, (index + 1) * num_draft_tokens)
                states.add_verify(
                    self._host.copy(final[rows]),
                    self._host.copy(aux[rows]),
                    self._host.copy(accept_lens[index]),
                )
                self.held_bytes += _nbytes(final[rows], aux[rows])
                touched.append(states)
        ready = self._host.event()
        for states in touched:
            states.ready = ready

    def sweep(self) -> None:
        """Hand every finished request to the finalizer thread."""
        with self._lock:
            done = [rid for rid, (req, _) in self._open.items() if req.finished()]
            entries = [self._open.pop(rid) for rid in done]
            # rows of requests that will not be finalized are freed now; the others when
            # the finalizer is done with them (the budget covers its queue too)
            self.held_bytes -= sum(
                states.nbytes for req, states in entries if states is not None and _aborted(req)
            )
        for req, states in entries:
            if states is None or _aborted(req):
                continue
            prompt = list(req.origin_input_ids)
            output = _output_through_stop(req)
            self._finished.put(
                _Finished(
                    states=states,
                    prompt_len=len(prompt),
                    output_ids=output,
                    token_ids=prompt + output,
                    drafted_tokens=int(req.spec_verify_ct) * self.num_steps,
                    accepted_draft_tokens=int(req.spec_num_correct_drafts),
                    draft_version=self.draft_version,
                    ready=states.ready,
                )
            )

    # -- the finalizer thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                item = self._finished.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                try:
                    self.sweep()  # requests that finished while the scheduler idles
                except Exception:  # a bad request costs its capture, never the finalizer
                    logger.exception("sweeping finished requests failed")
                continue
            if item is None:
                return
            try:
                self.finalize(item)
            except Exception:
                logger.exception("capture of request %s failed", item.states.request_id)
                self._count_drop()
            finally:
                with self._lock:
                    self.held_bytes -= item.states.nbytes

    def finalize(self, item: _Finished) -> bool:
        """Build the record of one finished request and submit it; False when skipped."""
        if serves_well(self.config.serve, item.accepted_draft_tokens, item.drafted_tokens):
            self.skipped += 1
            return False
        if item.ready is not None:
            item.ready.synchronize()
        states = item.states
        token_ids, final, aux = states.assemble(item.token_ids)
        positions = range(states.offset, states.offset + len(token_ids))
        loss_mask = [int(position >= item.prompt_len) for position in positions]
        record = CapturedRecord(
            request_id=states.request_id,
            target_id=self.target_id,
            draft_version=item.draft_version,
            started_at=states.started_at,
            finished_at=datetime.now(UTC),
            input_ids=torch.tensor(token_ids, dtype=torch.int32),
            loss_mask=torch.tensor(loss_mask, dtype=torch.int8),
            hidden_states=final.to(torch.float16),
            aux_hidden_states=aux.to(torch.float16),
            spec_verify_ct=states.verify_steps,
            spec_accept_tokens=item.accepted_draft_tokens,
            completion_tokens=len(item.output_ids),
            segment=states.segment,
        )
        if self.writer.submit(record):
            self.captured += 1
            _metric("records").inc()
            _metric("bytes").inc(_nbytes(record.hidden_states, record.aux_hidden_states))
            return True
        self._count_drop()
        return False

    def _count_drop(self) -> None:
        with self._lock:  # the scheduler thread counts drops too
            self.dropped += 1
        _metric("dropped").inc()

    def close(self) -> None:
        """Finish what is queued and flush the writer."""
        self.sweep()
        self._finished.put(None)
        self._thread.join()
        self.writer.close()


# -- the SGLang hooks (run only inside an SGLang scheduler process) ------------------------------


class _Process:
    """This scheduler process's capture, started by the first batch TP rank 0 runs."""

    capture: SGLangCapture | None = None
    segments = PendingSegments()  # labels received before (or without) capture starting
    disabled = False  # set by the first error inside a hook: capture stops, serving goes on
    errors: ClassVar[collections.Counter[str]] = collections.Counter()


_METRIC_HELP = {
    "records": "requests captured into the lake",
    "dropped": "requests whose capture was dropped (budget, queue, retraction, errors)",
    "errors": "exceptions inside TIDE's hooks (capture switches itself off)",
    "bytes": "hidden-state bytes of captured requests",
}
_METRICS: dict[str, Any] = {}


def _metric(kind: str) -> Any:
    """``tide:capture_<kind>_total``, a prometheus_client counter.

    With ``--enable-metrics`` SGLang runs prometheus_client in multiprocess mode,
    so counters of the scheduler processes appear on the server's own ``/metrics``.
    """
    if kind not in _METRICS:
        from prometheus_client import Counter  # noqa: PLC0415

        _METRICS[kind] = Counter(f"tide:capture_{kind}", _METRIC_HELP[kind])
    return _METRICS[kind]


def _hook_failed(kind: str) -> None:
    """A TIDE error inside an SGLang hook: counted, logged once per kind, capture off."""
    _Process.errors[kind] += 1
    _metric("errors").inc()
    if _Process.errors[kind] == 1:
        logger.exception("TIDE capture hook %s failed; capture is off, serving goes on", kind)
    _Process.disabled = True


def _capture_on() -> bool:
    return os.environ.get(ENABLE_ENV) == "1" and not _Process.disabled


def _is_target_processor(processor: Any) -> bool:
    architectures = getattr(getattr(processor, "config", None), "architectures", None) or []
    return not any("Eagle" in name for name in architectures)


def _keep_final_states(
    original: Any, processor: Any, input_ids: Any, hidden_states: Any, *args: Any, **kwargs: Any
) -> Any:
    output = original(processor, input_ids, hidden_states, *args, **kwargs)
    if not _capture_on():
        return output
    try:
        metadata = args[1] if len(args) > 1 else kwargs.get("logits_metadata")
        mode = getattr(metadata, "capture_hidden_mode", None)
        if mode is not None and mode.is_full() and _is_target_processor(processor):
            info = output.customized_info or {}
            output.customized_info = {**info, FINAL_STATES_KEY: hidden_states}
    except Exception:  # TIDE's error: the scheduler never sees it
        _hook_failed("logits")
    return output


def _take_final_states(logits_output: Any) -> torch.Tensor | None:
    info = logits_output.customized_info
    if not info or FINAL_STATES_KEY not in info:
        return None
    rest = {key: value for key, value in info.items() if key != FINAL_STATES_KEY}
    logits_output.customized_info = rest or None
    final: torch.Tensor = info[FINAL_STATES_KEY]
    return final


def process_spool(base: Path, rank: int, pid: int | None = None) -> Path:
    """This process's own spool directory, having adopted those of dead processes.

    Several capturing processes share a host (several servers per node, or one
    ``tp_rank`` 0 per DP replica), so each spools under ``<host>-tp<rank>-pid<pid>``;
    shards a crashed process left behind move into the new one's spool and upload.
    """
    pid = os.getpid() if pid is None else pid
    host = socket.gethostname()
    own = base / f"{host}-tp{rank}-pid{pid}"
    own.mkdir(parents=True, exist_ok=True)
    for other in base.glob(f"{host}-tp*-pid*"):  # pids mean something on this host only
        other_pid = other.name.rsplit("-pid", 1)[-1]
        if other == own or not other_pid.isdigit() or pid_alive(int(other_pid)):
            continue
        for path in [*other.glob("*.parquet"), *other.glob("*.json")]:
            try:
                path.replace(own / path.name)
            except FileNotFoundError:  # another new process adopted it first
                continue
        logger.info("adopted the spool of ended process %s into %s", other_pid, own)
        shutil.rmtree(other, ignore_errors=True)
    return own


def _warmup_prompts(args: Any) -> set[tuple[int, ...]]:
    """Token ids of SGLang's warm-up prompt, with and without special tokens."""
    try:
        from transformers import AutoTokenizer  # noqa: PLC0415

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        return {
            tuple(tokenizer.encode(WARMUP_TEXT, add_special_tokens=special))
            for special in (True, False)
        }
    except Exception:  # no tokenizer here: the warm-up (one request a start) is captured
        logger.warning("cannot tokenize SGLang's warm-up prompt; it may be captured")
        return set()


def _tp_rank(worker: Any) -> int:
    """This process's tensor-parallel rank (0.5.14's worker has it; later, the parallel state)."""
    rank = getattr(worker, "tp_rank", None)
    if rank is None:
        from sglang.srt.distributed.parallel_state import (  # noqa: PLC0415
            get_tensor_model_parallel_rank,
        )

        rank = get_tensor_model_parallel_rank()
    return int(rank)


def _dp_attention() -> bool:
    """Is DP attention on, however it was asked for (a flag, or an attention DP size)?"""
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled  # noqa: PLC0415

    return bool(is_dp_attention_enabled())


def _start_capture(worker: Any) -> SGLangCapture | None:
    if _Process.capture is not None:
        return _Process.capture
    rank = _tp_rank(worker)
    if rank != 0:
        return None
    args = worker.server_args
    if worker.topk != 1 or _dp_attention():
        logger.error("TIDE capture supports chain drafting without DP attention; capture is off")
        os.environ[ENABLE_ENV] = "0"
        return None
    config = TideConfig()
    spool = process_spool(config.lake.spool_dir, rank)
    config = config.model_copy(update={"lake": config.lake.model_copy(update={"spool_dir": spool})})
    target_id = config.serve.served_model_name or Path(args.model_path).name
    draft = args.speculative_draft_model_path or ""
    version = getattr(args, "weight_version", None) or Path(draft).name or "initial"
    _Process.capture = SGLangCapture(
        config,
        target_id,
        version,
        worker.speculative_num_steps,
        warmup_prompts=_warmup_prompts(args),
        target_dir=args.model_path,  # the writer refuses records unfit for this target
        segments=_Process.segments,
    )
    logger.info("TIDE capture on: target %s, draft %s, spool %s", target_id, version, spool)
    return _Process.capture


def _capture_batch(original: Any, worker: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    result = original(worker, batch, *args, **kwargs)
    try:
        logits_output = getattr(result, "logits_output", None)
        if logits_output is None:
            return result
        final = _take_final_states(logits_output)
        if final is None or not _capture_on() or batch.forward_mode.is_idle():
            return result
        capture = _start_capture(worker)
        if capture is None:
            return result
        capture.sweep()
        aux = logits_output.hidden_states
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            capture.on_prefill(batch.reqs, batch.prefix_lens, batch.extend_lens, final, aux)
        elif result.accept_lens is not None:
            capture.on_verify(
                batch.reqs, worker.speculative_num_draft_tokens, final, aux, result.accept_lens
            )
    except Exception:  # TIDE's error: the scheduler never sees it
        _hook_failed("batch")
    return result


def _label_tokenized(result: Any, _manager: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
    """Tokenizer process: the request's segment label rides on the tokenized request."""
    try:
        labels = getattr(obj, "custom_labels", None)
        segment = labels.get(SEGMENT_LABEL) if isinstance(labels, dict) else None
        if segment is not None:
            problem = segment_problem(segment)
            if problem is None:
                return with_segment(result, segment)
            # the request is served; only its record goes unlabelled
            logger.debug("request %s: %s; its record is unlabelled", obj.rid, problem)
    except Exception:
        _hook_failed("label")
    return result


def _note_segment(_scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any) -> None:
    """Scheduler process: remember the label by request id until capture opens the request."""
    try:
        segment = getattr(recv_req, SEGMENT_ATTRIBUTE, None)
        if segment is not None and isinstance(recv_req.rid, str):
            _Process.segments.note(recv_req.rid, segment)
    except Exception:
        _hook_failed("label")


def _note_swapped_version(version: str) -> None:
    """A draft swap succeeded in this process: records name the version that now serves."""
    if _Process.capture is not None:
        _Process.capture.draft_version = version


def register() -> None:
    """The ``sglang.srt.plugins`` entry point.

    Reads what the installed SGLang offers (:func:`~tide_lib.serving.sglang_api.detect`).
    Supported: the draft-only hot swap (:mod:`tide_lib.serving.sglang_swap`), which leaves
    every non-draft ``update_weights_from_disk`` to SGLang, and with
    ``TIDE_SGLANG_CAPTURE=1`` the capture hooks. Not supported: an error that names
    what is missing, and a guard that refuses drafts sent for a swap (SGLang would
    load them into the target); serving is otherwise untouched.
    """
    capture = os.environ.get(ENABLE_ENV) == "1"
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: PLC0415
    except ImportError as error:
        if not capture:
            logger.info("TIDE plugin loaded outside SGLang (%s): nothing to register", error)
            return
        raise RuntimeError(
            f"{ENABLE_ENV}=1 but SGLang's plugin framework is not importable ({error}); "
            f"install one of sglang {', '.join(SUPPORTED_SGLANG_VERSIONS)}"
        ) from error
    try:
        api = detect(SourceTree.installed())
    except Exception as error:  # unsupported, or TIDE's own failure: fail closed
        logger.error(
            "TIDE's SGLang plugin refuses to load: %s. Draft swaps are refused; "
            "capture is off; serving is otherwise unaffected",
            error,
        )
        HookRegistry.register(SWAP_TARGET, refuse_draft_swaps(str(error)), HookType.AROUND)
        return
    HookRegistry.register(SWAP_TARGET, DraftSwap(api, _note_swapped_version), HookType.AROUND)
    HookRegistry.register(MODEL_INFO_TARGET, keep_target_model_info, HookType.AROUND)
    if not capture:
        logger.info("TIDE capture off (set %s=1 to capture); draft-only swap on", ENABLE_ENV)
        return
    HookRegistry.register(_LOGITS_TARGET, _keep_final_states, HookType.AROUND)
    HookRegistry.register(f"{_WORKER}.forward_batch_generation", _capture_batch, HookType.AROUND)
    HookRegistry.register(_TOKENIZE_TARGET, _label_tokenized, HookType.AFTER)
    HookRegistry.register(_RECEIVE_TARGET, _note_segment, HookType.BEFORE)
    logger.info("TIDE plugin on sglang %s: draft-only swap and capture on", api.version)
