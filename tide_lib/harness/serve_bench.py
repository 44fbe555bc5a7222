"""``tide bench serve``: what capture costs, what speculation gains, and what a swap costs.

Runs the reference engine in-process on the demo target, with a draft bootstrapped
from the target's own greedy answers to English training prompts (or a given
one), and measures on held-out English prompts, engines side by side in one
run (each prompt on every engine, in an order shuffled for each prompt, so
machine noise hits all of them): output tokens/s with capture on and off;
speculative decoding at the fixed k, with the adaptive k (the engine picks k in
0..k per request from the costs and acceptance it measures, 0 = plain) and plain
decoding, with the k the adaptive engine chose; the pooled acceptance length;
and the latency of a draft swap while three threads keep sending requests, with
the number of requests that failed. Every engine first serves the same few
untimed warm-up requests (training prompts), so the figures are steady state.
"""

from __future__ import annotations

__all__ = [
    "HEADLINE_KEYS",
    "PlainOn",
    "ServeBenchParams",
    "adaptive_report",
    "bootstrap_draft",
    "greedy_records",
    "paired_ratio",
    "pass_ratios",
    "run_serve_bench",
    "settle",
    "side_by_side",
    "turn_orders",
]

import concurrent.futures
import dataclasses
import json
import logging
import math
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from tide_lib.config import TideConfig, TrainConfig
from tide_lib.evaluation.gate import t95
from tide_lib.harness.params import ServeBenchParams
from tide_lib.lake import CapturedRecord
from tide_lib.serving.acceptance import AcceptanceCount
from tide_lib.serving.engine import Engine, EngineRequest, EngineResult
from tide_lib.serving.speculative import SpeculativeDecoder
from tide_lib.target_model import build_target, load_corpus, render_prompt
from tide_lib.training.trainer import train_draft

logger = logging.getLogger(__name__)

HEADLINE_KEYS = (
    "capture_on_tokens_per_s",
    "capture_off_tokens_per_s",
    "spec_tokens_per_s",
    "adaptive_tokens_per_s",
    "plain_tokens_per_s",
    "adaptive_vs_plain_same_engine",
    "adaptive_k",
    "accept_length",
    "swap_seconds",
    "failed_requests",
)


def bootstrap_draft(
    target_dir: Path,
    prompts: list[str],
    out_dir: Path,
    *,
    max_new_tokens: int,
    train: TrainConfig,
) -> Path:
    """A draft trained on the target's own greedy answers to ``prompts`` (no lake needed)."""
    data = out_dir / "bootstrap-data"
    data.mkdir(parents=True, exist_ok=True)
    requests = [(prompt, max_new_tokens) for prompt in prompts]
    answers = greedy_records(target_dir, requests, "bootstrap")
    for index, record in enumerate(
        tqdm(answers, total=len(prompts), desc="bootstrap answers", unit="req")
    ):
        record.save_specforge(data, index)
    return train_draft(data, target_dir, out_dir / "bootstrap-run", train).draft_dir


def greedy_records(
    target_dir: Path, requests: list[tuple[str, int]], name: str
) -> Iterator[CapturedRecord]:
    """The target's greedy answers to ``(prompt, max_new_tokens)`` requests, with their
    states, as serving captures them (request ids ``<name>-<index>``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    decoder = SpeculativeDecoder(target, None, 1, tokenizer.eos_token_id)
    for index, (prompt, max_new_tokens) in enumerate(requests):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        started = datetime.now(UTC)
        generation = decoder.generate(ids, max_new_tokens, speculative=False)
        yield generation.captured_record(
            f"{name}-{index}", target_id=target_dir.name, started_at=started
        )


def reference_engine(config: TideConfig, target: Path, draft: Path, **serve: Any) -> Engine:
    settings = config.serve.model_copy(
        update={"model_path": target, "speculative_draft_model_path": str(draft), **serve}
    )
    return Engine(config.model_copy(update={"serve": settings}))


class Submits(Protocol):
    """What :func:`side_by_side` times: an engine, or plain decoding on one."""

    def submit(self, request: EngineRequest) -> concurrent.futures.Future[EngineResult]: ...


@dataclasses.dataclass(frozen=True)
class PlainOn:
    """Plain decoding on ``engine`` itself, kept out of its adaptive k's measurements:
    beside what the engine serves, the instance's own speed cancels (three identical
    plain engines side by side differed by 2-4% a pass here)."""

    engine: Engine

    def submit(self, request: EngineRequest) -> concurrent.futures.Future[EngineResult]:
        return self.engine.submit(dataclasses.replace(request, reference_plain=True))


def warm_up(engines: Mapping[str, Submits], prompts: list[list[int]], max_new_tokens: int) -> None:
    """Untimed requests: first calls pay one-off allocation costs, adaptive k learns."""
    for index, ids in enumerate(prompts):
        for name, engine in engines.items():
            request = EngineRequest(ids, max_new_tokens, 0.0, None, f"warmup-{name}-{index}")
            engine.submit(request).result()


@dataclasses.dataclass
class EngineRun:
    """What one engine did in :func:`side_by_side`: output tokens, seconds, acceptance,
    and the output tokens/s of each pass over the prompts (their spread is the noise)."""

    tokens: int = 0
    seconds: float = 0.0
    acceptance: AcceptanceCount = dataclasses.field(default_factory=AcceptanceCount)
    pass_tokens_per_s: list[float] = dataclasses.field(default_factory=list)
    request_tokens_per_s: list[float] = dataclasses.field(default_factory=list)  # in order

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def paired_ratio(runs: Mapping[str, EngineRun], name: str, baseline: str) -> dict[str, float]:
    """``name``'s tokens/s over ``baseline``'s read request by request (the same prompt,
    one after the other): the geometric mean of the paired ratios and its one-sided 95%
    bounds (``low``, ``high``). Identical plain engines differ by 2-4% a pass over 24
    prompts on this machine: a ratio whose bounds hold 1.0 is not told from parity."""
    logs = [
        math.log(mine / theirs)
        for mine, theirs in zip(
            runs[name].request_tokens_per_s, runs[baseline].request_tokens_per_s, strict=True
        )
        if mine > 0 and theirs > 0
    ]
    if len(logs) < 2:
        return {}
    mean = statistics.fmean(logs)
    margin = t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return {
        "ratio": math.exp(mean),
        "low": math.exp(mean - margin),
        "high": math.exp(mean + margin),
        "requests": len(logs),
    }


def pass_ratios(runs: Mapping[str, EngineRun], name: str, baseline: str) -> list[float]:
    """``name``'s tokens/s over ``baseline``'s, pass by pass (the same prompts each pass)."""
    return [
        mine / theirs if theirs else 0.0
        for mine, theirs in zip(
            runs[name].pass_tokens_per_s, runs[baseline].pass_tokens_per_s, strict=True
        )
    ]


def settle(
    adaptive: Engine, plain: Engine, prompts: list[list[int]], max_new_tokens: int, requests: int
) -> dict[str, Any]:
    """``requests`` requests (the prompts in turn) served by adaptive k beside plain
    decoding while it learns which k pays, before the timed passes; what they cost:
    adaptive k's tokens/s over plain decoding's, and the k's it served."""
    if not requests or not prompts:
        return {"requests": 0}
    before = dict(adaptive.k_controller.snapshot()["requests_by_k"])
    ids = (prompts * (requests // len(prompts) + 1))[:requests]
    runs = side_by_side({"adaptive": adaptive, "plain": plain}, ids, max_new_tokens)
    after = adaptive.k_controller.snapshot()["requests_by_k"]
    return {
        "requests": requests,
        "adaptive_vs_plain": runs["adaptive"].tokens_per_s / runs["plain"].tokens_per_s,
        "requests_by_k": _served_since(before, after),
    }


def _served_since(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """Requests served at each k between two of the controller's ``requests_by_k``."""
    return {k: count - before.get(k, 0) for k, count in after.items()}


def adaptive_report(warm_by_k: Mapping[str, int], chosen: Mapping[str, Any]) -> dict[str, Any]:
    """What adaptive k did while timed: requests served at each k after the warm-up
    (``warm_by_k``, the controller's ``requests_by_k`` then), and from the controller's
    final snapshot (``chosen``) its modelled tokens/s, acceptance, costs, what each k
    delivered against plain decoding measured beside it, the model's error and the
    probes it served."""
    return {
        "timed_requests_by_k": _served_since(warm_by_k, chosen["requests_by_k"]),
        "expected_tokens_per_s": chosen["expected_tokens_per_s"],
        "acceptance": chosen["acceptance"],
        "costs": chosen["costs"],
        "realized_vs_plain": chosen["realized_vs_plain"],
        "model_error": chosen["model_error"],
        "probes": chosen.get("probes", 0),  # over the engine's life: explorations cut short
    }


def turn_orders(names: list[str], prompts: int, seed: int = 0) -> list[list[str]]:
    """The order the engines serve each of ``prompts`` prompts in: shuffled (seeded) for
    each prompt, so each engine follows every other about as often, and never one engine
    twice in a row (a shuffle that would start with the last engine is rotated by one).
    A fixed predecessor biases an engine's figure: rotated by one every prompt, the
    adaptive engine followed the fixed-k engine (its draft's buffers through the caches)
    three times in four and plain decoding on it followed the plain engine; flipped
    every other prompt, the first and the last engine served twice in a row."""
    rng = random.Random(seed)
    orders: list[list[str]] = []
    for _ in range(prompts):
        order = rng.sample(names, len(names))
        if orders and len(order) > 1 and order[0] == orders[-1][-1]:
            order = order[1:] + order[:1]
        orders.append(order)
    return orders


def side_by_side(
    engines: Mapping[str, Submits], prompts: list[list[int]], max_new_tokens: int, passes: int = 1
) -> dict[str, EngineRun]:
    """Each prompt on every engine (in :func:`turn_orders`), ``passes`` times over the
    prompts; each pass's tokens/s is kept apart."""
    totals = {name: EngineRun() for name in engines}
    names = list(engines)
    orders = turn_orders(names, len(prompts) * passes)
    for index, ids in enumerate(tqdm(prompts * passes, desc=" vs ".join(names), unit="req")):
        if index % len(prompts) == 0:
            this_pass = {name: EngineRun() for name in names}
        for name in orders[index]:
            request = EngineRequest(ids, max_new_tokens, 0.0, None, f"bench-{name}-{index}")
            started = time.perf_counter()
            result = engines[name].submit(request).result()
            seconds = time.perf_counter() - started
            for run in (totals[name], this_pass[name]):
                run.seconds += seconds
                run.tokens += result.completion_tokens
            rate = result.completion_tokens / seconds if seconds > 0 else 0.0
            totals[name].request_tokens_per_s.append(rate)
            totals[name].acceptance.add_pooled(result.spec_accept_length, result.spec_verify_ct)
        if (index + 1) % len(prompts) == 0:
            for name in names:
                totals[name].pass_tokens_per_s.append(this_pass[name].tokens_per_s)
    return totals


def _swap_under_load(
    engine: Engine, draft: Path, prompts: list[list[int]]
) -> tuple[float, int, int]:
    stop = threading.Event()
    futures: list[concurrent.futures.Future[Any]] = []

    def load(offset: int) -> None:
        index = offset
        while not stop.is_set():
            request = EngineRequest(
                prompts[index % len(prompts)], 24, 0.0, None, f"swap-{offset}-{index}"
            )
            future = engine.submit(request)
            futures.append(future)
            try:
                future.result()
            except Exception:  # counted below
                logger.exception("request failed during the swap")
            index += 3

    threads = [threading.Thread(target=load, args=(offset,)) for offset in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(2.0)
    started = time.perf_counter()
    engine.swap_draft(str(draft), "bench-swap")
    swap_seconds = time.perf_counter() - started
    time.sleep(2.0)
    stop.set()
    for thread in threads:
        thread.join()
    failed = sum(1 for future in futures if future.exception() is not None)
    return swap_seconds, failed, len(futures)


def _bench_engines(
    config: TideConfig, target_dir: Path, draft_dir: Path, num_steps: int
) -> dict[str, Engine]:
    """The four engines compared: capture on, capture off (fixed k), adaptive k, plain."""
    fixed = {"speculative_num_steps": num_steps}
    return {
        "on": reference_engine(config, target_dir, draft_dir, capture=True, **fixed),
        "spec": reference_engine(config, target_dir, draft_dir, capture=False, **fixed),
        "adaptive": reference_engine(
            config, target_dir, draft_dir, capture=False, speculative_adaptive=True, **fixed
        ),
        "plain": reference_engine(
            config, target_dir, draft_dir, capture=False, disable_speculation=True
        ),
    }


def run_serve_bench(
    config: TideConfig,
    target_dir: Path,
    json_path: Path | None,
    params: ServeBenchParams | None = None,
    *,
    preset: str = "demo",
) -> dict[str, Any]:
    params = params or ServeBenchParams()
    draft_dir, prompts, warmup = params.draft, params.prompts, params.warmup
    max_new_tokens, num_steps = params.max_new_tokens, params.speculative_num_steps
    build_target(target_dir, preset_name=preset)
    bootstrapped = draft_dir is None
    corpus = load_corpus()
    train_prompts = [
        render_prompt(doc.turns[0]) for doc in corpus.domain("en_chat", held_out=False)
    ]
    eval_prompts = [render_prompt(doc.turns[0]) for doc in corpus.domain("en_chat", held_out=True)]
    with tempfile.TemporaryDirectory(prefix="tide-bench-serve-") as tmp:
        work = Path(tmp)
        if draft_dir is None:
            draft_dir = bootstrap_draft(
                target_dir,
                train_prompts[:128],
                work,
                max_new_tokens=max_new_tokens,
                train=TrainConfig(
                    steps=160, batch_size=4, ttt_length=num_steps, learning_rate=2e-3
                ),
            )
        lake = config.lake.model_copy(update={"spool_dir": work / "spool", "prefix": "bench-serve"})
        config = config.model_copy(update={"lake": lake})
        engines = _bench_engines(config, target_dir, draft_dir, num_steps)
        capture_on, capture_off, adaptive = engines["on"], engines["spec"], engines["adaptive"]
        plain = engines["plain"]
        try:
            ids = [capture_off.encode(prompt) for prompt in eval_prompts[:prompts]]
            warm = [capture_off.encode(prompt) for prompt in train_prompts[: max(warmup, 1)]]
            warm_up(engines, warm, max_new_tokens)
            capture = side_by_side({"on": capture_on, "off": capture_off}, ids, max_new_tokens)
            settled = settle(adaptive, plain, ids, max_new_tokens, params.settle)
            warm_by_k = adaptive.k_controller.snapshot()["requests_by_k"]
            speculation = side_by_side(
                {
                    "spec": capture_off,
                    "adaptive": adaptive,
                    "plain": plain,
                    "plain_on_adaptive": PlainOn(adaptive),
                },
                ids,
                max_new_tokens,
                passes=params.passes,
            )
            chosen = adaptive.k_controller.snapshot()
            swap_seconds, failed, swap_requests = _swap_under_load(capture_off, draft_dir, ids)
            dropped = capture_on.writer.stats().dropped_records if capture_on.writer else 0
        finally:
            for engine in engines.values():
                engine.close()

    rate = {name: run.tokens_per_s for name, run in speculation.items()}
    spec = speculation["spec"]
    result: dict[str, Any] = {
        "capture_on_tokens_per_s": capture["on"].tokens_per_s,
        "capture_off_tokens_per_s": capture["off"].tokens_per_s,
        "spec_tokens_per_s": rate["spec"],
        "adaptive_tokens_per_s": rate["adaptive"],
        "plain_tokens_per_s": rate["plain"],
        "adaptive_vs_plain": rate["adaptive"] / rate["plain"],
        "spec_vs_plain": rate["spec"] / rate["plain"],
        "adaptive_vs_plain_by_pass": pass_ratios(speculation, "adaptive", "plain"),
        "adaptive_vs_plain_paired": paired_ratio(speculation, "adaptive", "plain"),
        # plain decoding on the adaptive engine itself: the instance's own speed cancels
        "adaptive_vs_plain_same_engine": rate["adaptive"] / rate["plain_on_adaptive"],
        "adaptive_vs_plain_same_engine_paired": paired_ratio(
            speculation, "adaptive", "plain_on_adaptive"
        ),
        "spec_vs_plain_by_pass": pass_ratios(speculation, "spec", "plain"),
        "adaptive_k": chosen["chosen_k"],
        "adaptive": adaptive_report(warm_by_k, chosen) | {"settling": settled},
        "accept_length": spec.acceptance.accept_length,
        "swap_seconds": swap_seconds,
        "failed_requests": failed,
        "swap_load_requests": swap_requests,
        "capture_dropped_records": dropped,
        "params": {
            "prompts": prompts,
            "max_new_tokens": max_new_tokens,
            "speculative_num_steps": num_steps,
            "warmup_requests": max(warmup, 1),
            "settle_requests": params.settle,
            "passes": params.passes,
            "temperature": 0.0,
            "target": str(target_dir),
            "draft": "bootstrapped from the target's greedy English answers"
            if bootstrapped
            else str(draft_dir),
        },
        "device": "cpu",
        "measured_at": datetime.now(UTC).isoformat(),
    }
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return result
