"""The reference engine: an HF target with EAGLE3 speculative decoding, capture and hot swap.

Requests go through a queue to one worker thread that owns the models, so the
HTTP server never blocks on model work. When a request finishes, its target
states (prefill and every token the target read) are handed to the lake writer,
which returns at once; a sampling rate and a selective-capture threshold (skip
requests the draft already serves well, as Moreh's SGLang fork does) decide
which requests are kept. A draft swap is validated and loaded off the worker,
then applied by the worker between requests: in-flight requests finish on the
draft they started with and none fail.

The engine cannot be stalled or steered by what it is sent: the queue is bounded
(a full one is refused, :class:`EngineBusyError`), a request whose client went
away is cancelled before it takes the worker, and drafts load only from the
configured sources (:mod:`.draft_sources`), validated completely against this
target (:func:`~tide_lib.training.draft.validate_draft_dir`) and run once on
this engine's device before a swap is acknowledged.

Each request runs at the k its :class:`~.k_policy.KController` picks: with
``serve.speculative_adaptive`` the k in ``0..speculative_num_steps`` that the
costs and acceptance measured so far (per segment label) say is fastest, 0 being
plain decoding; otherwise the launch k. A request's segment label goes to its
captured record.
"""

from __future__ import annotations

__all__ = ["Engine", "EngineBusyError", "EngineRequest", "EngineResult", "RequestError"]

import concurrent.futures
import dataclasses
import logging
import queue
import random
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from tide_lib.config import ConfigError, ServeConfig, TideConfig
from tide_lib.errors import TideError
from tide_lib.lake import LakeWriter, ObjectStore
from tide_lib.lake.schema import segment_problem, target_limits
from tide_lib.registry.uris import DraftFetchError
from tide_lib.serving.acceptance import AcceptanceCount
from tide_lib.serving.capture import capture_wanted
from tide_lib.serving.draft_sources import DraftCache, DraftSources, local_draft
from tide_lib.serving.k_policy import KController, KPlan
from tide_lib.serving.metrics import EngineMetrics
from tide_lib.serving.speculative import DraftRunner, Generation, SpeculativeDecoder
from tide_lib.training.draft import DraftTarget, InvalidCheckpointError, load_draft
from tide_lib.training.specforge_runtime import prepare_specforge

logger = logging.getLogger(__name__)

# Adaptive k's cost probe: any text does (its acceptance is not kept), a sentence of
# ordinary length keeps the probe's cache near a request's.
_CALIBRATION_PROMPT = (
    "Speculative decoding drafts a few tokens with a small model, then the target model "
    "checks them all in one forward pass and keeps the ones it agrees with."
)


class RequestError(TideError, ValueError):
    """A request the engine refuses; the message is returned to the client (HTTP 400)."""


class EngineBusyError(TideError, RuntimeError):
    """The request queue is full; the client should retry later (HTTP 503, Retry-After)."""


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    seed: int | None
    rid: str
    ignore_eos: bool = False
    segment: str | None = None  # the client's traffic label: captured, and keys acceptance
    # Decode plainly, unseen by adaptive k: a reference measured on this very engine
    # beside what it serves (identical engines differ by 2-4% here; `tide bench`).
    reference_plain: bool = False


@dataclasses.dataclass(frozen=True)
class EngineResult:
    rid: str
    output_ids: list[int]
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    spec_verify_ct: int
    spec_accept_length: float
    weight_version: str
    e2e_latency: float
    spec_num_steps: int = 0  # draft tokens per verify this request ran with (0: plain)


@dataclasses.dataclass
class EngineCounters:
    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # since the last swap: what /server_info and /metrics report as the average
    acceptance: AcceptanceCount = dataclasses.field(
        default_factory=lambda: AcceptanceCount(keep_requests=False)
    )
    captured: int = 0
    capture_skipped: int = 0
    swaps: int = 0


@dataclasses.dataclass
class _PendingSwap:
    draft: Any
    path: str
    version: str
    applied: threading.Event = dataclasses.field(default_factory=threading.Event)


class Engine:
    """Owns the target, the draft, the request queue and the capture writer."""

    def __init__(self, config: TideConfig) -> None:
        serve = config.serve
        if serve.model_path is None:
            raise ConfigError("--model-path (the HF target directory) is required")
        if serve.speculative_num_draft_tokens not in (None, serve.speculative_num_steps + 1):
            raise ConfigError(
                "chain drafting verifies num_steps + 1 tokens: set --speculative-num-draft-tokens "
                f"to {serve.speculative_num_steps + 1} or leave it out"
            )
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

        prepare_specforge("cpu")
        self.config = config
        self.serve: ServeConfig = serve
        self.target_dir = Path(serve.model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.target_dir)
        self.target = AutoModelForCausalLM.from_pretrained(self.target_dir).eval()
        self.target_id = serve.served_model_name or self.target_dir.name
        self.draft_path = serve.speculative_draft_model_path
        self.weight_version = serve.weight_version
        self.draft_target = DraftTarget.of(self.target.config)
        self.sources = DraftSources.of(serve, self.draft_path)
        self.cache = DraftCache(config.scratch_dir / "drafts", serve.draft_cache_versions)
        self._swap_lock = threading.Lock()
        draft = self._load_draft(self.draft_path, self.weight_version) if self.draft_path else None
        self.decoder = SpeculativeDecoder(
            self.target, draft, serve.speculative_num_steps, self.tokenizer.eos_token_id
        )
        self.speculative = draft is not None and not serve.disable_speculation
        self.k_controller = KController(
            serve.speculative_num_steps,
            adaptive=serve.speculative_adaptive,
            speculative=self.speculative,
            explore_every=serve.speculative_adaptive_explore_every,
            min_gain=serve.speculative_adaptive_min_gain,
            probe_rounds=serve.speculative_adaptive_probe_rounds,
        )
        self.writer = self._capture_writer(config) if serve.capture else None
        self.counters = EngineCounters()
        self.metrics = EngineMetrics(self)
        self._lock = threading.Lock()
        self._queue: queue.Queue[Any] = queue.Queue()
        self._running = 0
        self._waiting = 0  # requests queued, not yet taken by the worker nor cancelled
        self._rng = random.Random(0)
        ready = threading.Event()
        self._start_error: BaseException | None = None
        self._worker = threading.Thread(
            target=self._work, args=(ready,), name="tide-engine", daemon=True
        )
        self._worker.start()
        ready.wait()  # calibrated, in the thread that decodes: its costs are that thread's
        if self._start_error is not None:  # the worker is gone: no engine to hand out
            if self.writer is not None:
                self.writer.close()
            raise self._start_error

    # -- requests ------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def check(self, request: EngineRequest) -> None:
        if not request.input_ids:
            raise RequestError("the prompt is empty")
        problem = segment_problem(request.segment)
        if problem is not None:
            raise RequestError(f"custom_labels.segment: {problem}")
        if len(request.input_ids) > self.serve.max_prompt_tokens:
            raise RequestError(
                f"the prompt has {len(request.input_ids)} tokens; this server takes at most "
                f"{self.serve.max_prompt_tokens} (--max-prompt-tokens)"
            )
        if request.max_new_tokens > self.serve.max_new_tokens_limit:
            raise RequestError(
                f"max_new_tokens {request.max_new_tokens} exceeds this server's limit "
                f"{self.serve.max_new_tokens_limit} (--max-new-tokens-limit)"
            )
        vocab = self.target.config.vocab_size
        bad = [token for token in request.input_ids if not 0 <= token < vocab]
        if bad:
            raise RequestError(f"input_ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def submit(self, request: EngineRequest) -> concurrent.futures.Future[EngineResult]:
        """Queue a checked request; cancelling the future before it runs frees its place."""
        self.check(request)
        with self._lock:
            if self._waiting >= self.serve.max_queued_requests:
                raise EngineBusyError(
                    f"{self._waiting} requests are queued, the most this server holds "
                    "(--max-queued-requests): retry later"
                )
            self._waiting += 1
        future: concurrent.futures.Future[EngineResult] = concurrent.futures.Future()
        future.add_done_callback(self._left_if_cancelled)
        self._queue.put((request, future))
        return future

    def _left_if_cancelled(self, future: concurrent.futures.Future[EngineResult]) -> None:
        if future.cancelled():
            with self._lock:
                self._waiting -= 1

    def queue_depth(self) -> int:
        return self._waiting

    def running(self) -> int:
        return self._running

    def _work(self, ready: threading.Event) -> None:
        try:
            if self.serve.decode_threads:
                # this thread's team; torch also makes it the default of threads started later
                torch.set_num_threads(self.serve.decode_threads)
            self._calibrate_speculation()
        except BaseException as error:  # raised by __init__, which waits for this
            self._start_error = error
            return
        finally:
            ready.set()
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, _PendingSwap):
                self._apply_swap(item)
                continue
            request, future = item
            if not future.set_running_or_notify_cancel():
                continue  # its client went away while it waited
            with self._lock:
                self._waiting -= 1
            self._running = 1
            try:
                future.set_result(self._generate(request))
            except Exception as error:  # reported to the client, the worker keeps serving
                logger.exception("request %s failed", request.rid)
                future.set_exception(error)
            finally:
                self._running = 0

    def _generate(self, request: EngineRequest) -> EngineResult:
        started = time.perf_counter()
        started_at = datetime.now(UTC)
        generator = (
            torch.Generator().manual_seed(request.seed) if request.seed is not None else None
        )
        version = self.weight_version
        reference = request.reference_plain
        plan = KPlan(0) if reference else self.k_controller.plan(request.segment)
        generation = self.decoder.generate(
            request.input_ids,
            request.max_new_tokens,
            temperature=request.temperature,
            speculative=self.speculative,
            generator=generator,
            ignore_eos=request.ignore_eos,
            num_steps=plan.k,
            probe_rounds=plan.probe_rounds,
        )
        if not reference:
            self.k_controller.observe(generation.timings, request.segment)
        with self._lock:
            self.counters.requests += 1
            self.counters.prompt_tokens += len(request.input_ids)
            self.counters.generation_tokens += len(generation.output_ids)
            self.counters.acceptance.add_accepted(
                generation.accepted_draft_tokens, generation.verify_steps
            )
        if generation.verify_steps:
            self.metrics.observe_accept_length(self.target_id, version, generation.accept_length)
        if self.writer is not None:
            with self.metrics.capture_latency.labels(self.target_id).time():
                self._capture(request, generation, started_at, version)
        self.metrics.e2e_latency.labels(self.target_id).observe(time.perf_counter() - started)
        return EngineResult(
            rid=request.rid,
            output_ids=generation.output_ids,
            text=self.tokenizer.decode(generation.output_ids, skip_special_tokens=True),
            prompt_tokens=len(request.input_ids),
            completion_tokens=len(generation.output_ids),
            finish_reason=generation.finish_reason,
            spec_verify_ct=generation.verify_steps,
            spec_accept_length=generation.accept_length,
            weight_version=version,
            e2e_latency=time.perf_counter() - started,
            spec_num_steps=generation.timings.k,
        )

    # -- capture ---------------------------------------------------------------------------

    @staticmethod
    def _capture_writer(config: TideConfig) -> LakeWriter:
        """The lake writer; it refuses records unfit for the served target (sizes, NaN)."""
        store = ObjectStore(config.store, config.store.lake_bucket)
        return LakeWriter(store, config.lake, limits=target_limits(config.serve.model_path))

    def _capture(
        self, request: EngineRequest, generation: Generation, started_at: datetime, version: str
    ) -> None:
        if self.writer is None:
            return
        if not capture_wanted(
            self.serve, generation.accepted_draft_tokens, generation.drafted_tokens, self._rng
        ):
            with self._lock:
                self.counters.capture_skipped += 1
            return
        record = generation.captured_record(
            request.rid,
            target_id=self.target_id,
            draft_version=version,
            started_at=started_at,
            segment=request.segment,
        )
        if self.writer.submit(record):
            with self._lock:
                self.counters.captured += 1

    # -- drafts ------------------------------------------------------------------------------

    def _load_draft(self, path: str, version: str) -> Any:
        """An allowed draft, validated against this target and probed; nothing kept on failure.

        Raises :class:`DraftRefusedError` (not an allowed source, or missing) or
        :class:`InvalidCheckpointError` (download, validation or probe failed).
        """
        try:
            with local_draft(path, version, self.sources, self.cache, self.config) as local:
                draft = load_draft(local, self.target_dir, self.draft_target)
                self._probe(draft)
        except DraftFetchError as error:
            raise InvalidCheckpointError(str(error)) from error
        return draft

    def _probe(self, draft: Any) -> None:
        """One draft forward pass on this engine's device: a draft that cannot run is refused."""
        device = next(self.target.parameters()).device
        hidden = self.draft_target.hidden_size
        try:
            runner = DraftRunner(draft.to(device))
            aux = torch.randn(2, 3 * hidden, generator=torch.Generator().manual_seed(0))
            states, logits = runner.step(torch.tensor([0, 1]), runner.project(aux.to(device)))
            ids = runner.to_target_ids(torch.arange(int(logits.shape[-1]), device=device))
        except Exception as error:  # any failure here would fail every request later
            message = f"the draft fails a forward pass on {device}: {error}"
            raise InvalidCheckpointError(message) from error
        vocab = self.draft_target.vocab_size
        if not (bool(torch.isfinite(logits).all()) and bool(torch.isfinite(states).all())):
            raise InvalidCheckpointError("the draft's probe forward pass gives non-finite values")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise InvalidCheckpointError(
                f"d2t maps draft tokens outside the vocabulary [0, {vocab})"
            )

    def swap_draft(self, path: str, version: str, timeout: float = 540.0) -> None:
        """Validate and load a draft here, then let the worker swap it in between requests."""
        with self._swap_lock:  # one download and load at a time
            draft = self._load_draft(path, version)  # raises: the old draft keeps serving
        pending = _PendingSwap(draft=draft, path=path, version=version)
        self._queue.put(pending)  # requests queued before it finish on the old draft
        if not pending.applied.wait(timeout):
            raise TimeoutError(f"draft swap to {version} was not applied within {timeout:.0f}s")

    def _apply_swap(self, pending: _PendingSwap) -> None:
        self.decoder = SpeculativeDecoder(
            self.target,
            pending.draft,
            self.serve.speculative_num_steps,
            self.tokenizer.eos_token_id,
        )
        self.draft_path, self.weight_version = pending.path, pending.version
        self.speculative = not self.serve.disable_speculation
        self.k_controller.speculative = self.speculative
        self.k_controller.draft_swapped()
        self._calibrate_speculation()  # an engine that started without a draft
        with self._lock:
            self.counters.swaps += 1
            self.counters.acceptance = AcceptanceCount(keep_requests=False)
        logger.info("serving draft %s as weight version %s", pending.path, pending.version)
        pending.applied.set()

    def _calibrate_speculation(self) -> None:
        """Probe generations at every k on a fixed prompt, once, before adaptive k serves.

        Without them the first requests are the measurement: a token count read only by
        requests' short last verifies was costed from a few noisy forwards, and the serve
        bench served k=4 on 14 of 24 requests at 0.83x plain decoding.
        """
        tokens = self.serve.speculative_adaptive_calibration_tokens
        controller = self.k_controller
        if not (controller.adaptive and self.speculative) or controller.calibrated or not tokens:
            return
        started = time.perf_counter()
        ids = self.encode(_CALIBRATION_PROMPT)  # not chat-rendered: only its costs count
        try:
            self.decoder.generate(ids, 4, ignore_eos=True)  # untimed: one-off allocations
            probes = [
                self.decoder.generate(ids, tokens, ignore_eos=True, num_steps=k).timings
                for k in range(controller.max_k + 1)
            ]
        except Exception:  # serving must not hang on it: the first requests measure instead
            logger.exception("adaptive k's cost probe failed; the first requests measure costs")
            return
        controller.calibrate(probes)
        costs = controller.costs.snapshot(controller.max_k)
        logger.info(
            "adaptive k calibrated in %.1fs: draft step %s s, verify seconds by k %s",
            time.perf_counter() - started,
            costs["draft_step_s"],
            costs["verify_s"],
        )

    def avg_accept_length(self) -> float:
        with self._lock:
            return self.counters.acceptance.accept_length

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join(timeout=60)
        if self.writer is not None:
            self.writer.close()
