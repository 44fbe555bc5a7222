"""``tide bench suite``: the adaptation policy judged on generated shifts, by seed.

A policy tuned on two or three fixed workloads works on them and fails on the next,
so it is judged here on workloads drawn from the packaged corpora by seed: the
``i``-th workload of a run is of kind ``KINDS[i % 6]`` and draws from seed
``seed_base + i`` which segments it uses, in which order, and how long each lasts;
every second one sends client labels. Each spans about six cycles of traffic.

- ``new``: the static draft's segment, then one it never served, for most of the run;
- ``turns``: three or four segments in turn;
- ``gradual``: a mix that drifts from one segment to another over every cycle;
- ``return``: a segment, another, then the first again;
- ``served``: a shift to a segment the static draft was fitted to as well;
- ``none``: one segment throughout.

Shared by every workload, so that they compare and the run fits an hour: each
segment's *pool* (its first ``pool`` distinct corpus requests), the pool's held-out
requests (chosen by prompt, never served) with the target's answers, the static
drafts, and one *oracle* per segment: a fresh draft trained with a fixed recipe on
all of its pool but the held-out requests. Neither depends on the policy, so both
are cached between runs (``.tide/suite``). Figures are acceptance lengths at
``params.k`` on the held-out requests; the suite reports each workload and, for each
figure, the median and the worst case.
"""

from __future__ import annotations

__all__ = [
    "KINDS",
    "SuiteError",
    "SuiteWorkload",
    "draw_workload",
    "run_suite",
    "suite_summary",
    "workload_figures",
]

import dataclasses
import hashlib
import json
import logging
import math
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from tqdm import tqdm

from tide_lib.config import TideConfig, TrainConfig
from tide_lib.errors import TideError
from tide_lib.harness.adaptation_bench import (
    WORKLOAD_SEGMENTS,
    acceptance,
    held_out_indices,
    request_prompt,
    run_config,
    samples_by_segment,
    serve_workload,
    start_loop,
)
from tide_lib.harness.params import SuiteParams
from tide_lib.lake import CapturedRecord

logger = logging.getLogger(__name__)

KINDS: Final = ("new", "turns", "gradual", "return", "served", "none")
SEGMENTS: Final = tuple(WORKLOAD_SEGMENTS)
SERVES_WELL: Final = 0.8  # of the oracle: a draft that serves a segment (the lag's bar)
NEVER_FITTED: Final = 0.7  # of the oracle: a static draft that never fitted the new segment


class SuiteError(TideError, ValueError):
    """The suite's settings draw no workload to run."""


@dataclasses.dataclass(frozen=True)
class SuiteWorkload:
    """One generated workload: its requests in arrival order and what its static draft
    was fitted to."""

    name: str
    kind: str
    seed: int
    labels: bool
    static_segments: tuple[str, ...]
    requests: list[dict[str, Any]] = dataclasses.field(repr=False)

    @property
    def segments(self) -> list[str]:
        """Segments in order of first arrival."""
        return list(dict.fromkeys(item["segment"] for item in self.requests))

    @property
    def new_segment(self) -> str | None:
        """The last segment to arrive after the first request (None: no shift)."""
        later = self.segments[1:]
        return later[-1] if later else None

    def first_request(self, segment: str) -> int:
        return next(i for i, item in enumerate(self.requests) if item["segment"] == segment)


def _phases(kind: str, rng: random.Random, order: list[str]) -> list[tuple[str, float]]:
    """``(segment, relative length)`` in arrival order for one kind."""
    a, b = order[0], order[1]
    if kind == "new":
        return [(a, rng.uniform(0.15, 0.25)), (b, 1.0)]
    if kind == "turns":
        return [(segment, rng.uniform(1.0, 1.5)) for segment in order[: rng.choice((3, 4))]]
    if kind == "return":
        return [(a, rng.uniform(0.15, 0.25)), (b, rng.uniform(0.35, 0.45)), (a, 0.4)]
    if kind == "served":
        return [(a, rng.uniform(0.2, 0.3)), (b, 0.75)]
    return [(a, 1.0)]  # none; gradual is drawn request by request


def draw_workload(
    index: int,
    seed: int,
    pools: Mapping[str, list[str]],
    tokens_per_request: Mapping[str, float],
    params: SuiteParams,
) -> SuiteWorkload:
    """The ``index``-th workload of a suite, drawn from ``seed``: its kind is
    ``KINDS[index % 6]``; its segments, their order and lengths come from the seed.
    Lengths are in cycles of traffic (``params.cycles`` in all, give or take a tenth),
    turned into requests by each segment's ``tokens_per_request``; each segment's
    requests walk its ``pools`` entry in a shuffled order (a prompt comes again only
    once the pool is spent)."""
    kind, rng = KINDS[index % len(KINDS)], random.Random(seed)
    order = rng.sample(list(pools), len(pools))
    walks = {segment: _walk(pools[segment], rng) for segment in order}
    total = params.cycles * rng.uniform(0.95, 1.1) * params.cycle_tokens
    segments: list[str]
    if kind == "gradual":
        a, b = order[0], order[1]
        count = round(total / statistics.fmean((tokens_per_request[a], tokens_per_request[b])))
        segments = [b if rng.random() < i / count else a for i in range(count)]
        segments[0] = a
    else:
        phases = _phases(kind, rng, order)
        scale = total / sum(length for _, length in phases)
        segments = [
            segment
            for segment, length in phases
            for _ in range(max(1, round(length * scale / tokens_per_request[segment])))
        ]
    static = (order[0], order[1]) if kind == "served" else (order[0],)
    requests = [
        {
            "prompt": next(walks[segment]),
            "segment": segment,
            "max_new_tokens": params.max_new_tokens,
        }
        for segment in segments
    ]
    return SuiteWorkload(f"{kind}-s{seed}", kind, seed, index % 2 == 1, static, requests)


def _walk(prompts: list[str], rng: random.Random) -> Iterator[str]:
    while True:
        yield from rng.sample(prompts, len(prompts))


def _pools(params: SuiteParams) -> dict[str, list[str]]:
    """Each segment's first ``params.pool`` distinct requests of its packaged corpus."""
    from tide_lib.target_model import load_corpus  # noqa: PLC0415

    corpus = load_corpus()
    return {
        segment: list(
            dict.fromkeys(request_prompt(doc) for doc in corpus.domain(WORKLOAD_SEGMENTS[segment]))
        )[: params.pool]
        for segment in SEGMENTS
    }


def _split(
    pools: Mapping[str, list[str]], percent: int
) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Each pool as (served, held out): held out by prompt, as ``tide bench adaptation``."""
    items = [{"prompt": p, "segment": s} for s, prompts in pools.items() for p in prompts]
    held = {items[i]["prompt"] for i in held_out_indices(items, percent)}
    served = {s: [p for p in prompts if p not in held] for s, prompts in pools.items()}
    return served, {s: [p for p in prompts if p in held] for s, prompts in pools.items()}


@dataclasses.dataclass
class _Shared:
    """What every workload of a run measures against: each segment's served pool and
    held-out answers, the static drafts and oracles, and their figures."""

    served: dict[str, list[str]]
    held_out: dict[str, list[CapturedRecord]]
    statics: dict[tuple[str, ...], Path] = dataclasses.field(default_factory=dict)
    # "oracle" and "static:<a>+<b>" -> segment -> acceptance length at params.k
    lengths: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

    def tokens_per_request(self) -> dict[str, float]:
        return {
            s: statistics.fmean(len(r.input_ids) for r in records)
            for s, records in self.held_out.items()
        }

    def static_lengths(self, workload: SuiteWorkload) -> dict[str, float]:
        return self.lengths["static:" + "+".join(workload.static_segments)]


def _held_out(params: SuiteParams, target_dir: Path) -> _Shared:
    """Each segment's pool split into served and held-out requests, with the target's
    answers to the held-out ones (what every draft is measured on)."""
    served, held = _split(_pools(params), params.held_out_percent)
    items = [
        {"prompt": p, "segment": s, "max_new_tokens": params.max_new_tokens}
        for s, prompts in held.items()
        for p in prompts
    ]
    records = samples_by_segment(target_dir, items, params.max_new_tokens, "held", list(held))
    return _Shared(served, records)


def _cache_dir(params: SuiteParams, train: TrainConfig, target_dir: Path) -> Path:
    """Where a run's shared drafts live: one folder per target build, pool and recipe."""
    stamp = (target_dir / "config.json").stat().st_mtime_ns
    recipe = [params.pool, params.held_out_percent, params.max_new_tokens, params.static_steps]
    key = json.dumps(
        [str(target_dir.resolve()), stamp, recipe, train.model_dump(mode="json")], sort_keys=True
    )
    return params.cache_dir / hashlib.sha256(key.encode()).hexdigest()[:16]


def _shared_draft(
    cache: Path,
    name: str,
    prompts: list[str],
    target_dir: Path,
    *,
    params: SuiteParams,
    train: TrainConfig,
) -> Path:
    """A fresh draft trained with the fixed recipe on ``prompts``, cached under ``name``."""
    from tide_lib.harness.serve_bench import bootstrap_draft  # noqa: PLC0415

    done = cache / name
    if (done / "config.json").exists():
        return done
    logger.info("suite: training the shared %s draft on %d requests", name, len(prompts))
    recipe = train.model_copy(update={"steps": params.static_steps})
    with tempfile.TemporaryDirectory(prefix=f"tide-suite-{name}-") as tmp:
        trained = bootstrap_draft(
            target_dir, prompts, Path(tmp), max_new_tokens=params.max_new_tokens, train=recipe
        )
        done.parent.mkdir(parents=True, exist_ok=True)
        trained.rename(done)
    return done


def _shared_drafts(
    shared: _Shared,
    workloads: Sequence[SuiteWorkload],
    params: SuiteParams,
    config: TideConfig,
    target_dir: Path,
) -> None:
    """One oracle per segment and the workloads' static drafts (a static draft of one
    segment is its oracle: the same recipe on the same requests), with their figures."""
    train, gate_k = config.training, config.gate.k
    cache = _cache_dir(params, train, target_dir)
    oracles = {
        s: _shared_draft(cache, f"oracle-{s}", served, target_dir, params=params, train=train)
        for s, served in shared.served.items()
    }
    for key in dict.fromkeys(w.static_segments for w in workloads):
        prompts = [p for s in key for p in shared.served[s]]
        shared.statics[key] = (
            oracles[key[0]]
            if len(key) == 1
            else _shared_draft(
                cache, "static-" + "+".join(key), prompts, target_dir, params=params, train=train
            )
        )
    drafts = {"oracle:" + s: path for s, path in oracles.items()}
    drafts |= {"static:" + "+".join(key): path for key, path in shared.statics.items()}
    counts = acceptance(drafts, target_dir, shared.held_out, tuple({params.k, gate_k}))

    def at(k: int) -> dict[str, dict[str, float]]:
        return {
            name: {s: by_k[k].accept_length for s, by_k in by.items()}
            for name, by in counts.items()
        }

    lengths = at(params.k)
    shared.lengths = {"oracle": {s: lengths["oracle:" + s][s] for s in oracles}} | {
        name: figures for name, figures in lengths.items() if name.startswith("static:")
    }
    # the headroom check's estimates are at the gate's k: its error against the oracle there
    shared.lengths["oracle_at_gate_k"] = {s: at(gate_k)["oracle:" + s][s] for s in oracles}


def _run_workload(
    config: TideConfig,
    workload: SuiteWorkload,
    shared: _Shared,
    params: SuiteParams,
    target_dir: Path,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, float]]]:
    """Serve one workload through the loop; its cycle log and every served draft's
    acceptance length per segment on the held-out requests."""
    target_id = f"suite-{workload.kind}-{uuid.uuid4().hex[:6]}"
    static = shared.statics[workload.static_segments]
    with tempfile.TemporaryDirectory(prefix="tide-suite-") as tmp:
        work = Path(tmp)
        loop_config = run_config(
            config,
            work,
            target_id=target_id,
            target_dir=target_dir,
            cycle_tokens=params.cycle_tokens,
            train=config.training,
        )
        loop, engine = start_loop(config, loop_config, work, static)
        try:
            serve_workload(loop, engine, workload.requests, params.max_new_tokens, workload.labels)
        finally:
            engine.close()
        adapted = {name: path for name, path in loop.versions.items() if name != "static"}
        held = {s: shared.held_out[s] for s in workload.segments}
        counts = acceptance(adapted, target_dir, held, (params.k,))
    lengths = {
        name: {s: by_k[params.k].accept_length for s, by_k in by.items()}
        for name, by in counts.items()
    }
    static_lengths = shared.static_lengths(workload)
    return loop.cycles, {"static": {s: static_lengths[s] for s in workload.segments}} | lengths


def _champions(cycles: Sequence[Mapping[str, Any]]) -> list[str]:
    """The draft serving after each cycle (``static`` until a promotion)."""
    serving, after = "static", []
    for entry in cycles:
        if entry["outcome"] == "promoted":
            serving = f"adapted-v{entry['version']}"
        after.append(serving)
    return after


def _lag(
    workload: SuiteWorkload,
    segment: str,
    cycles: Sequence[Mapping[str, Any]],
    lengths: Mapping[str, Mapping[str, float]],
    oracle: float,
) -> int | str:
    """Cycles from the first window that holds ``segment`` to the first champion that
    serves it at :data:`SERVES_WELL` of its oracle, both counted (0: the champion serving
    when it arrived already did; ``"never"``: none did; ``"unheld"``: no window held it)."""
    first = workload.first_request(segment)
    served = [entry["requests_served"] for entry in cycles]
    holding = next((c for c, upto in enumerate(served) if upto > first), None)
    if holding is None:
        return "unheld"
    champions = _champions(cycles)
    before = champions[holding - 1] if holding else "static"
    if lengths[before][segment] >= SERVES_WELL * oracle:
        return 0
    for c in range(holding, len(cycles)):
        if lengths[champions[c]][segment] >= SERVES_WELL * oracle:
            return c - holding + 1
    return "never"


def workload_figures(
    workload: SuiteWorkload,
    cycles: Sequence[Mapping[str, Any]],
    lengths: Mapping[str, Mapping[str, float]],
    oracle: Mapping[str, float],
    *,
    estimator_oracle: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """One workload's figures from its cycle log and every served draft's acceptance
    length per segment (``static`` and ``adapted-v<N>``) against each segment's oracle
    (``estimator_oracle``: the oracle at the gate's k, where the check estimates)."""
    champions = _champions(cycles)
    final = champions[-1] if champions else "static"
    served = ["static", *dict.fromkeys(champions)]
    new = workload.new_segment
    figures: dict[str, Any] = {
        "name": workload.name,
        "kind": workload.kind,
        "seed": workload.seed,
        "labels": workload.labels,
        "segments": workload.segments,
        "static_segments": list(workload.static_segments),
        "new_segment": new,
        "requests": len(workload.requests),
        "final": final,
        "accept_length": {name: dict(by) for name, by in lengths.items()},
        "oracle": {s: oracle[s] for s in workload.segments},
    }
    if new is not None:
        figures["static_oracle"] = _ratio(lengths["static"][new], oracle[new])
        figures["adapted_static"] = _ratio(lengths[final][new], lengths["static"][new])
        figures["adapted_oracle"] = _ratio(lengths[final][new], oracle[new])
    figures["retention"] = {
        s: _ratio(lengths[final][s], max(lengths[v][s] for v in served))
        for s in workload.segments
        if s != new
    }
    figures["lag"] = {
        s: _lag(workload, s, cycles, lengths, oracle[s]) for s in workload.segments[1:]
    }
    figures["estimator_error"] = _estimator_error(workload, cycles, estimator_oracle or oracle)
    outcomes = [entry["outcome"] for entry in cycles]
    figures["cycles"] = len(cycles)
    figures["cycle_outcomes"] = {o: outcomes.count(o) for o in sorted(set(outcomes))}
    figures["cycles_trained"] = sum(1 for entry in cycles if "training_s" in entry)
    figures["training_s"] = sum(entry.get("training_s", 0.0) for entry in cycles)
    figures["cycle_log"] = [dict(entry) for entry in cycles]
    return figures


def _ratio(value: float, over: float) -> float | None:
    """``value / over``; None where ``over`` is no figure (0: nothing measured)."""
    return value / over if over > 0 else None


def _estimator_error(
    workload: SuiteWorkload, cycles: Sequence[Mapping[str, Any]], oracle: Mapping[str, float]
) -> dict[str, float]:
    """The headroom check's last finite estimate of each segment over its oracle, less 1
    (labelled workloads only: clusters name other traffic than the workload's segments)."""
    if not workload.labels:
        return {}
    last: dict[str, float] = {}
    for entry in cycles:
        for segment, estimate in (entry.get("estimates") or {}).items():
            if segment in oracle and math.isfinite(estimate) and oracle[segment] > 0:
                last[segment] = estimate / oracle[segment] - 1
    return last


def _spread(values: Sequence[float | None], worst: str) -> dict[str, Any]:
    """Median and worst case (``"min"`` or ``"max"``) of ``values`` (None left out; an
    infinite figure is written ``"never"``); None when empty."""
    kept = [v for v in values if v is not None]
    if not kept:
        return {"median": None, "worst": None, "n": 0}
    pick = min if worst == "min" else max
    figures = {"median": statistics.median(kept), "worst": pick(kept)}
    return {k: "never" if math.isinf(v) else v for k, v in figures.items()} | {"n": len(kept)}


def _lags(lags: Mapping[str, int | str]) -> list[float]:
    """Lags as numbers: ``"never"`` is infinite; a segment no window held is left out."""
    return [math.inf if lag == "never" else float(lag) for lag in lags.values() if lag != "unheld"]


def suite_summary(workloads: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The suite's median and worst case for each figure, and whether each goal holds."""
    shifted = [w for w in workloads if w["new_segment"] is not None]
    unfitted = [w for w in shifted if (w["static_oracle"] or 0.0) < NEVER_FITTED]
    retention = [
        min(v for v in w["retention"].values() if v is not None)
        for w in workloads
        if any(v is not None for v in w["retention"].values())
    ]
    lags = [lag for w in workloads for lag in _lags(w["lag"])]
    never = [lag for w in unfitted for lag in _lags({w["new_segment"]: w["lag"][w["new_segment"]]})]
    trained = sum(w["cycles_trained"] for w in workloads)
    promoted = sum(w["cycle_outcomes"].get("promoted", 0) for w in workloads)
    training = [e["training_s"] for w in workloads for e in w["cycle_log"] if "training_s" in e]
    skipped = sum(w["cycle_outcomes"].get("no-drift", 0) for w in workloads)
    figures = {
        "adapted_static_unfitted": _spread([w["adapted_static"] for w in unfitted], "min"),
        "adapted_oracle": _spread([w["adapted_oracle"] for w in shifted], "min"),
        "retention": _spread(retention, "min"),
        "lag": _spread(lags, "max"),
        "lag_unfitted_new_segment": _spread(never, "max"),
        "estimator_error_abs": _spread(
            [abs(e) for w in workloads for e in w.get("estimator_error", {}).values()], "max"
        ),
        "no_shift_cycles_trained": _spread(
            [w["cycles_trained"] for w in workloads if w["kind"] == "none"], "max"
        ),
        "promoted_of_trained": promoted / trained if trained else None,
        "training_s": sum(training),
        "training_s_saved_estimate": skipped * statistics.median(training) if training else 0.0,
        "unfitted_workloads": len(unfitted),
    }
    return figures | {"goals": _goals(figures)}


def _goals(f: Mapping[str, Any]) -> dict[str, bool]:
    """The issue's bars, each true or false (an empty figure fails its bar)."""

    def holds(figure: str, which: str, ok: Any) -> bool:
        value = f[figure][which]
        return value is not None and value != "never" and bool(ok(value))

    return {
        "adapted_static_unfitted_worst_ge_1.5": holds(
            "adapted_static_unfitted", "worst", lambda v: v >= 1.5
        ),
        "adapted_oracle_median_ge_0.9": holds("adapted_oracle", "median", lambda v: v >= 0.9),
        "adapted_oracle_worst_ge_0.75": holds("adapted_oracle", "worst", lambda v: v >= 0.75),
        "retention_worst_ge_0.9": holds("retention", "worst", lambda v: v >= 0.9),
        "retention_median_ge_0.97": holds("retention", "median", lambda v: v >= 0.97),
        "no_shift_trains_at_most_once": holds("no_shift_cycles_trained", "worst", lambda v: v <= 1),
        "promoted_of_trained_ge_0.7": f["promoted_of_trained"] is not None
        and f["promoted_of_trained"] >= 0.7,
        "lag_median_le_2": holds("lag", "median", lambda v: v <= 2),
        "lag_worst_le_3": holds("lag", "worst", lambda v: v <= 3),
        "unfitted_new_segment_served_within_2": holds(
            "lag_unfitted_new_segment", "worst", lambda v: v <= 2
        ),
        "at_least_3_unfitted": f["unfitted_workloads"] >= 3,
    }


def run_suite(
    config: TideConfig, params: SuiteParams, target_dir: Path, json_path: Path | None
) -> dict[str, Any]:
    """Draw ``params.seeds`` workloads, run each through the loop, and report them with
    the suite's medians and worst cases (written to ``json_path``)."""
    from tide_lib.target_model import build_target  # noqa: PLC0415

    started = time.perf_counter()
    build_target(target_dir, preset_name="demo", seed=params.target_seed)
    shared = _held_out(params, target_dir)
    tokens = shared.tokens_per_request()
    workloads = [
        draw_workload(i, params.seed_base + i, shared.served, tokens, params)
        for i in range(params.seeds)
        if not params.kinds or KINDS[i % len(KINDS)] in params.kinds
    ]
    if not workloads:
        raise SuiteError(f"no workload of the kinds {list(params.kinds)} among {params.seeds}")
    _shared_drafts(shared, workloads, params, config, target_dir)
    shared_s = time.perf_counter() - started
    results: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    for workload in tqdm(workloads, desc="suite", unit="workload"):
        began = time.perf_counter()
        cycles, lengths = _run_workload(config, workload, shared, params, target_dir)
        figures = workload_figures(
            workload,
            cycles,
            lengths,
            shared.lengths["oracle"],
            estimator_oracle=shared.lengths["oracle_at_gate_k"],
        )
        results.append(figures | {"seconds": time.perf_counter() - began})
        logger.info("suite %s: %s", workload.name, _headline(figures))
        result = {  # written after every workload: a run cut short keeps what it measured
            "summary": suite_summary(results),
            "workloads": results,
            "workloads_planned": len(workloads),
            "oracle": shared.lengths["oracle"],
            "static": {n: v for n, v in shared.lengths.items() if n.startswith("static:")},
            "held_out_requests": {s: len(r) for s, r in shared.held_out.items()},
            "tokens_per_request": tokens,
            "seconds": {"shared": shared_s, "total": time.perf_counter() - started},
            "params": params.model_dump(mode="json"),
            "training": config.training.model_dump(mode="json"),
            "measured_at": datetime.now(UTC).isoformat(),
        }
        if json_path is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def _headline(figures: Mapping[str, Any]) -> str:
    parts = [f"{figures['cycle_outcomes']}"]
    for key in ("static_oracle", "adapted_static", "adapted_oracle"):
        if key in figures:
            parts.append(f"{key} {figures[key]:.2f}")
    parts.append(f"retention {figures['retention']}")
    parts.append(f"lag {figures['lag']}")
    return ", ".join(parts)
