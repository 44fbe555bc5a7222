"""``tide bench adaptation``: the TIDE loop, headless, on any workload file.

The workload is JSONL, one request per line in order of arrival:
``{"prompt": "...", "segment": "...", "max_new_tokens": 48}`` (the last key is
optional); the last segment to appear is the new traffic. A share of each
segment's requests is held out for evaluation and never captured: chosen by prompt,
so copies of a request are all held out or all served.

1. A static draft is bootstrapped from the target's greedy answers to the first
   segment's requests (``static_steps``: by default trained to fit them, as a
   deployed draft is) and registered as champion.
2. The remaining requests are served in order by the reference engine (capture
   on, real S3 lake). Whenever the new captured tokens since the watermark cross
   ``cycle_tokens``, one adaptation cycle runs with the same library functions
   as the ``tide_adaptation`` DAG (snapshot, train warm-started from the
   champion with replay, register, evaluate + gate, promote), and the engine
   swaps the new champion in; the time from the threshold to serving is kept.
3. An oracle draft is trained offline on the new segment's traffic alone: the
   requests the cycles' windows held, so it learns from the same traffic the loop
   did (traffic served after the last cycle waits for the next one in both). One
   run per seed (``oracle_seeds``, ``oracle-seed<i>``); ``oracle`` pools them
   (each request's counts summed over the seeds), since one run's figure moves by
   tenths with its seed and with the last bits of the captured states. ``joint``
   (``params.joint``) is trained the same way on every segment's requests the windows
   held: one draft trained on all of them at once, a reference for the adapted one
   (``al_ratio_joint_oracle``: what a draft that serves every segment gives up against
   the oracle of the new one alone).
4. Every draft is evaluated offline on the held-out requests of each segment,
   for each k (and on a sample of the older segments' served requests, which the
   drafts trained on: ``accept_length_served``, ``retention_served``; and on
   ``fresh`` requests per segment that the workload never sent, from the packaged
   corpus: ``accept_length_fresh``, ``retention_fresh``, the new segment's
   ``al_ratio_adapted_*_fresh``; and on both, pooled: ``*_unseen``); the static
   and the final adapted draft are also timed side by side on held-out new-traffic
   prompts.
"""

from __future__ import annotations

__all__ = [
    "AdaptationBenchParams",
    "Loop",
    "WorkloadError",
    "acceptance",
    "demo_workload",
    "fresh_requests",
    "held_out_indices",
    "load_workload",
    "request_prompt",
    "run_adaptation_bench",
    "run_config",
    "samples_by_segment",
    "serve_workload",
    "start_loop",
]

import dataclasses
import hashlib
import json
import logging
import math
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from tqdm import tqdm

from tide_lib.config import TideConfig, TrainConfig
from tide_lib.errors import TideError
from tide_lib.harness.params import AdaptationBenchParams
from tide_lib.lake import CapturedRecord, target_slug

if TYPE_CHECKING:
    from tide_lib.harness.serve_bench import EngineRun
    from tide_lib.registry import DraftRegistry
    from tide_lib.serving.acceptance import AcceptanceCount
    from tide_lib.serving.engine import Engine

logger = logging.getLogger(__name__)
ORACLE: Final = "oracle"  # the oracle seeds' drafts pooled; each is oracle-seed<i>
JOINT: Final = "joint"  # the oracle's recipe on every segment's windowed traffic


class WorkloadError(TideError, ValueError):
    """A workload file line is malformed; the message names the line."""


def load_workload(path: Path) -> list[dict[str, Any]]:
    requests = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise WorkloadError(f"{path}:{number}: not JSON ({error})") from error
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("prompt"), str)
            or not item["prompt"]
        ):
            raise WorkloadError(f'{path}:{number}: needs a non-empty "prompt" string')
        if not isinstance(item.get("segment"), str) or not item["segment"]:
            raise WorkloadError(f'{path}:{number}: needs a non-empty "segment" string')
        unknown = set(item) - {"prompt", "segment", "max_new_tokens"}
        if unknown:
            raise WorkloadError(f"{path}:{number}: unknown keys {sorted(unknown)}")
        requests.append(item)
    if not requests:
        raise WorkloadError(f"{path}: no requests")
    return requests


DOC_PROMPT_WORDS: Final = 8  # a document request: its first words, the target continues

WORKLOAD_SEGMENTS: Final = {
    "english": "en_chat",
    "english-docs": "en_docs",
    "korean": "ko_chat",
    "korean-law": "ko_docs",
}


def request_prompt(doc: Any) -> str:
    """A chat turn as the engines are asked it; a document by its first words (continued)."""
    from tide_lib.target_model import render_prompt  # noqa: PLC0415
    from tide_lib.target_model.build import BOS  # noqa: PLC0415

    if doc.is_chat:
        return render_prompt(doc.turns[0])
    return BOS + " ".join(doc.turns[0].split()[:DOC_PROMPT_WORDS])


def segments_workload(path: Path, plan: list[tuple[str, int]], *, max_new_tokens: int = 48) -> Path:
    """Segments arriving in turn, ``plan`` = ``[(segment, requests), ...]`` from the corpus.

    Segment names are the keys of :data:`WORKLOAD_SEGMENTS` (packaged corpora:
    English and Korean conversation, Python documentation, Korean law).
    """
    from tide_lib.target_model import load_corpus  # noqa: PLC0415

    unknown = [name for name, _ in plan if name not in WORKLOAD_SEGMENTS]
    if unknown:
        raise WorkloadError(f"unknown segments {unknown}; choose from {sorted(WORKLOAD_SEGMENTS)}")
    corpus = load_corpus()
    lines = [
        json.dumps(
            {"prompt": request_prompt(doc), "segment": name, "max_new_tokens": max_new_tokens}
        )
        for name, count in plan
        for doc in corpus.domain(WORKLOAD_SEGMENTS[name])[:count]
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def demo_workload(
    path: Path, *, english: int = 60, korean: int = 120, max_new_tokens: int = 48
) -> Path:
    """The demo's traffic: English conversation, then Korean conversation (packaged corpus)."""
    return segments_workload(
        path, [("english", english), ("korean", korean)], max_new_tokens=max_new_tokens
    )


SERVED_SAMPLE: Final = 16  # distinct served prompts per older segment measured as well


def _prompt_fraction(prompt: str) -> float:
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") / 2**64


def held_out_indices(requests: list[dict[str, Any]], percent: int) -> list[int]:
    """The requests held out of serving, chosen by their prompt alone: copies of a prompt
    (a chat turn many users send) are all held out or all served. A held-out prompt whose
    copy was served, and so trained the drafts, measures their memory of that request,
    not the segment (up to 4846080, 9 of the 11 held-out English requests of both
    workloads had one). Each segment of two or more distinct prompts holds out one at
    least."""
    held = {item["prompt"] for item in requests if _prompt_fraction(item["prompt"]) * 100 < percent}
    for segment in dict.fromkeys(item["segment"] for item in requests):
        prompts = {item["prompt"] for item in requests if item["segment"] == segment}
        if len(prompts) > 1 and not prompts & held:
            held.add(min(prompts, key=_prompt_fraction))
    return [index for index, item in enumerate(requests) if item["prompt"] in held]


def samples_by_segment(
    target_dir: Path,
    items: list[dict[str, Any]],
    default_max: int,
    name: str,
    segments: list[str],
) -> dict[str, list[CapturedRecord]]:
    """The target's greedy answers to ``items``, with their states (as serving captures),
    by segment, in the order of ``items``; every one of ``segments`` is a key (a segment
    without items measures nothing, and says so as 0)."""
    from tide_lib.harness.serve_bench import greedy_records  # noqa: PLC0415

    requests = [(item["prompt"], int(item.get("max_new_tokens", default_max))) for item in items]
    by_segment: dict[str, list[CapturedRecord]] = {segment: [] for segment in segments}
    for sample, item in zip(greedy_records(target_dir, requests, name), items, strict=True):
        by_segment[item["segment"]].append(sample)
    return by_segment


def fresh_requests(
    requests: list[dict[str, Any]], segments: list[str], per_segment: int, max_new_tokens: int
) -> list[dict[str, Any]]:
    """Up to ``per_segment`` requests of each of ``segments`` that the workload never sent:
    the next documents of the segment's packaged corpus (:data:`WORKLOAD_SEGMENTS`; other
    segment names have none), asked as the workload asks them (the segment's first
    request's ``max_new_tokens``, else ``max_new_tokens``). Neither served nor held out,
    they measure retention on more requests than the workload's held-out share."""
    from tide_lib.target_model import load_corpus  # noqa: PLC0415

    known = [segment for segment in segments if segment in WORKLOAD_SEGMENTS]
    if not known or per_segment <= 0:
        return []
    corpus, sent = load_corpus(), {item["prompt"] for item in requests}
    fresh: list[dict[str, Any]] = []
    for segment in known:
        prompts = dict.fromkeys(
            request_prompt(doc) for doc in corpus.domain(WORKLOAD_SEGMENTS[segment])
        )
        unseen = [prompt for prompt in prompts if prompt not in sent][:per_segment]
        asked = next(
            (
                int(item.get("max_new_tokens", max_new_tokens))
                for item in requests
                if item["segment"] == segment
            ),
            max_new_tokens,
        )
        fresh += [
            {"prompt": prompt, "segment": segment, "max_new_tokens": asked} for prompt in unseen
        ]
    return fresh


def _served_sample(served: list[dict[str, Any]], segments: list[str]) -> list[dict[str, Any]]:
    """Up to :data:`SERVED_SAMPLE` distinct served prompts of each older segment: what the
    drafts trained on (the static one all of the first segment's), measured apart from
    the held-out requests: forgetting a request the fleet sends again is a loss too."""
    sample: list[dict[str, Any]] = []
    for segment in segments[:-1]:
        distinct = {item["prompt"]: item for item in served if item["segment"] == segment}
        sample += list(distinct.values())[:SERVED_SAMPLE]
    return sample


@dataclasses.dataclass
class Loop:
    """One bench run's moving parts: its configuration, registry and what the cycles did."""

    config: TideConfig
    registry: DraftRegistry
    work: Path
    versions: dict[str, Path]
    cycles: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    threshold_to_serving: list[float] = dataclasses.field(default_factory=list)
    champion: str = "static"
    champion_when_segment_ended: dict[str, str] = dataclasses.field(default_factory=dict)
    consumed: int = 0  # served requests (in order) that some cycle's window held
    oracle_data: str = "the new segment's requests the cycles' windows held"


def run_config(
    config: TideConfig,
    work: Path,
    *,
    target_id: str,
    target_dir: Path,
    cycle_tokens: int,
    train: TrainConfig,
) -> TideConfig:
    return config.model_copy(
        update={
            "scratch_dir": work / "scratch",
            "lake": config.lake.model_copy(
                update={
                    "prefix": f"bench-{target_id}",
                    "spool_dir": work / "spool",
                    "shard_max_age_s": 0.5,
                    "commit_settle_s": 0.0,  # one writer, flushed before each read
                    # and its stamps are this host's clock, the reader's: trusting them
                    # (not the store's whole-second Last-Modified + 1 s) counts a request
                    # as soon as it is flushed, so timing never moves a cut (runs serving
                    # the same drafts cut at the same requests)
                    "max_clock_skew_s": 0.0,
                }
            ),
            "cycle": config.cycle.model_copy(
                update={
                    "target_id": target_id,
                    "target_path": target_dir,
                    "servers": [],
                    "min_new_tokens": cycle_tokens,
                }
            ),
            "training": train,
        }
    )


def start_loop(
    config: TideConfig, cycle_config: TideConfig, work: Path, static_dir: Path
) -> tuple[Loop, Engine]:
    """A registry whose champion is ``static_dir`` (seeded), and a reference engine serving
    it with capture on (``cycle_config``, see :func:`run_config`), which can swap in each
    version a cycle promotes (downloaded under ``work/served``)."""
    from tide_lib.harness.serve_bench import reference_engine  # noqa: PLC0415
    from tide_lib.registry import DraftRegistry  # noqa: PLC0415

    target_id = cycle_config.cycle.target_id
    registry = DraftRegistry(config.mlflow.tracking_uri, target_id)
    registry.seed_champion(static_dir)
    engine = reference_engine(
        cycle_config,
        cycle_config.cycle.target_path,
        static_dir,
        capture=True,
        served_model_name=target_id,
        draft_sources=[str(work / "served")],  # where each promoted version is downloaded
    )
    return Loop(cycle_config, registry, work, {"static": static_dir}), engine


def _run_cycle(loop: Loop, engine: Engine, segment: str, cut: dict[str, int]) -> None:
    """One cycle through the DAG's functions; the engine swaps a new champion in.

    ``cut`` says where the window ends: the workload requests served by then, and the
    tokens of the last one (the request that crossed ``cycle_tokens``).
    """
    from tide_lib.orchestration import cycle  # noqa: PLC0415
    from tide_lib.registry import CHAMPION  # noqa: PLC0415

    config, crossed = loop.config, time.perf_counter()
    cycle_id = f"cycle-{len(loop.cycles) + 1}"
    entry: dict[str, Any] = {"cycle_id": cycle_id, "segment": segment, **cut}
    loop.cycles.append(entry)
    snapshot = cycle.snapshot_window(config, cycle_id)
    entry["window_tokens"] = snapshot.window_tokens
    drift = cycle.check_drift(config, snapshot)
    entry["drift"] = drift.reason
    entry["consolidation"] = drift.consolidate
    # the check's reference per segment (what a draft reaches there) and the champion's figure
    entry["estimates"], entry["measured"] = drift.baseline, drift.measured
    if not drift.drift:
        entry["outcome"] = "no-drift"
    else:
        training_started = time.perf_counter()
        trained = cycle.train(config, snapshot)
        entry["train_seconds"] = time.perf_counter() - crossed
        entry["training_s"] = time.perf_counter() - training_started  # the accelerator's share
        if not trained.improved:
            entry["outcome"] = "parent-best"
        else:
            version = cycle.register(config, snapshot, trained)
            decision = cycle.evaluate_and_gate(config, snapshot, trained, version)
            cycle.promote(config, version, decision)
            entry.update(version=version, reason=decision.reason)
            champion = loop.registry.alias(CHAMPION)
            entry["outcome"] = "rejected"
            if champion is not None and champion.version == version:
                local = loop.registry.download(version, loop.work / "served" / f"v{version}")
                engine.swap_draft(str(local), f"v{version}")
                loop.threshold_to_serving.append(time.perf_counter() - crossed)
                loop.champion = f"adapted-v{version}"
                loop.versions[loop.champion] = local
                entry["outcome"] = "promoted"
    cycle.advance_watermark(config, snapshot)
    entry["seconds"] = time.perf_counter() - crossed
    logger.info("bench %s on %s traffic: %s", cycle_id, segment, entry["outcome"])


def serve_workload(
    loop: Loop,
    engine: Engine,
    served: list[dict[str, Any]],
    max_new_tokens: int,
    labels: bool,
) -> None:
    """Serve the requests in order; a cycle whenever enough new tokens were captured."""
    from tide_lib.orchestration import cycle  # noqa: PLC0415
    from tide_lib.serving.engine import EngineRequest  # noqa: PLC0415

    assert engine.writer is not None
    for index, item in enumerate(tqdm(served, desc="workload", unit="req")):
        result = engine.submit(
            EngineRequest(
                engine.encode(item["prompt"]),
                int(item.get("max_new_tokens", max_new_tokens)),
                0.0,
                None,
                f"w-{index}",
                segment=item["segment"] if labels else None,
            )
        ).result()
        engine.writer.flush(timeout=60)
        if cycle.new_tokens(loop.config) >= loop.config.cycle.min_new_tokens:
            crossing = result.prompt_tokens + result.completion_tokens
            cut = {"requests_served": index + 1, "crossing_request_tokens": crossing}
            _run_cycle(loop, engine, item["segment"], cut)
            loop.consumed = index + 1
        following = served[index + 1]["segment"] if index + 1 < len(served) else None
        if following != item["segment"]:
            loop.champion_when_segment_ended[item["segment"]] = loop.champion
    engine.writer.flush(timeout=60)


def _train_oracles(
    loop: Loop,
    served: list[dict[str, Any]],
    new_segment: str,
    target_dir: Path,
    params: AdaptationBenchParams,
) -> dict[str, Path]:
    """Drafts trained from the static one on the new segment's traffic alone, one per
    seed (``oracle-seed<i>``): the same requests the cycles' windows held (what the loop
    had to learn from; held-out out), with a fresh draft's recipe: ``training.steps``
    for each cycle that trained, at the full learning rate. Each exports its last step:
    the loop's selection may keep a parent a small held-out sample cannot tell apart,
    and an oracle that is the static draft measures nothing. With ``params.joint``, one
    more (``joint``) on every segment's requests the windows held, with that recipe."""
    from tide_lib.lake import LakeReader, ObjectStore  # noqa: PLC0415
    from tide_lib.training.trainer import train_draft  # noqa: PLC0415

    config = loop.config
    reader = LakeReader(ObjectStore(config.store, config.store.lake_bucket), config.lake)
    data, joint_data = loop.work / "oracle-data", loop.work / "joint-data"

    def new_traffic(upto: int) -> set[str]:
        return {f"w-{i}" for i, item in enumerate(served[:upto]) if item["segment"] == new_segment}

    new_ids = new_traffic(loop.consumed)
    if not new_ids:  # no cycle reached it: the oracle still gets something to learn from
        logger.warning("no cycle ran on %r traffic: the oracle learns all of it", new_segment)
        loop.oracle_data = "all of the new segment's requests (no cycle reached them)"
        new_ids = new_traffic(len(served))
    every_id = {f"w-{i}" for i in range(loop.consumed)} | new_ids
    count = {data: 0, joint_data: 0}
    for sample in reader.iter_records(reader.list_shards(target_slug(config.cycle.target_id))):
        for folder, ids in ((data, new_ids), (joint_data, every_id if params.joint else set())):
            if sample.request_id in ids:
                sample.save_specforge(folder, count[folder])
                count[folder] += 1
    trained = sum(1 for c in loop.cycles if c.get("train_seconds"))
    recipe = {"steps": config.training.steps * max(1, trained), "warm_epochs": 0}
    runs = [(f"{ORACLE}-seed{offset}", data, offset) for offset in range(params.oracle_seeds)]
    runs += [(JOINT, joint_data, 0)] if params.joint else []
    oracles = {}
    for name, folder, offset in runs:
        seed = config.training.seed + offset
        train = config.training.model_copy(update=recipe | {"export": "last", "seed": seed})
        oracles[name] = train_draft(
            folder, target_dir, loop.work / name, train, parent_dir=loop.versions["static"]
        ).draft_dir
    return oracles


def _oracle_seeds(counts: Counts) -> list[str]:
    """The oracle seeds' drafts measured in ``counts`` (``oracle-seed<i>``), by seed."""
    prefix = f"{ORACLE}-seed"
    seeds = [name for name in counts if name.startswith(prefix)]
    return sorted(seeds, key=lambda name: int(name.removeprefix(prefix)))


def _with_pooled_oracle(counts: Counts) -> Counts:
    """``counts`` with ``oracle``: each request's ``(emitted, verify)`` summed over the
    oracle seeds' drafts (``oracle-seed<i>``), so its figure is theirs pooled and it pairs
    with every other draft on the same requests."""
    from tide_lib.serving.acceptance import AcceptanceCount  # noqa: PLC0415

    seeds = [counts[name] for name in _oracle_seeds(counts)]
    if not seeds:
        return counts
    pooled: dict[str, dict[int, AcceptanceCount]] = {}
    for segment, by_k in seeds[0].items():
        pooled[segment] = {}
        for k in by_k:
            runs = [seed[segment][k].per_request for seed in seeds]
            pooled[segment][k] = AcceptanceCount.of(
                (sum(e for e, _ in request), sum(v for _, v in request))
                for request in zip(*runs, strict=True)
            )
    return counts | {ORACLE: pooled}


Counts = dict[str, dict[str, dict[int, "AcceptanceCount"]]]  # draft -> segment -> k -> counts


def acceptance(
    versions: dict[str, Path],
    target_dir: Path,
    by_segment: dict[str, list[CapturedRecord]],
    ks: tuple[int, ...],
) -> Counts:
    """Offline acceptance counts per draft, segment and k, on the held-out requests
    (per request: every draft is replayed on the same ones, so drafts compare paired)."""
    from tide_lib.evaluation.offline import offline_acceptance  # noqa: PLC0415
    from tide_lib.training.draft import load_draft  # noqa: PLC0415

    return {
        name: offline_acceptance(load_draft(path, target_dir), target_dir, by_segment, list(ks))
        for name, path in versions.items()
    }


def _lengths(counts: Counts, ks: tuple[int, ...]) -> dict[str, dict[str, dict[str, float]]]:
    return {
        name: {
            segment: {f"k{k}": by_k[k].accept_length for k in ks}
            for segment, by_k in segments.items()
        }
        for name, segments in counts.items()
    }


Units = dict[str, list[str]]  # segment -> the prompt of each measured request, in order
Margins = dict[str, float | None]


def _by_unit(pairs: list[tuple[int, int]], units: list[str] | None) -> list[tuple[int, int]]:
    """Per-request ``(emitted, verify)`` pairs summed per unit (copies of one prompt are
    one piece of evidence, not several); as they are without units."""
    if units is None:
        return pairs
    summed: dict[str, tuple[int, int]] = {}
    for unit, (emitted, verify) in zip(units, pairs, strict=True):
        total = summed.get(unit, (0, 0))
        summed[unit] = (total[0] + emitted, total[1] + verify)
    return list(summed.values())


def _paired_ratio(
    before: AcceptanceCount, after: AcceptanceCount, units: list[str] | None = None
) -> tuple[float, float | None]:
    """``after / before`` and its one-sided 95% margin of error: the paired margin of the
    drop (both drafts on the same requests, copies of a prompt as one) over the ``before``
    figure. A dozen held-out requests move a ratio by tenths; the margin says how far.
    None where there is no estimate (under two prompts, or nothing measured)."""
    from tide_lib.evaluation.offline import drop_margin  # noqa: PLC0415

    if not before.accept_length:
        return 0.0, None
    pairs = (_by_unit(before.per_request, units), _by_unit(after.per_request, units))
    _, margin = drop_margin(*pairs)
    ratio = after.accept_length / before.accept_length
    return ratio, margin / before.accept_length if math.isfinite(margin) else None


def _ratios(
    counts: Counts,
    a: str,
    b: str,
    segment: str,
    ks: tuple[int, ...],
    *,
    units: Units | None = None,
) -> tuple[dict[str, float], Margins]:
    """Draft ``a`` over draft ``b`` on ``segment`` at each k, and the margins of error."""
    of = (units or {}).get(segment)
    pairs = {f"k{k}": _paired_ratio(counts[b][segment][k], counts[a][segment][k], of) for k in ks}
    return {k: r for k, (r, _) in pairs.items()}, {k: m for k, (_, m) in pairs.items()}


def _retention(
    counts: Counts,
    loop: Loop,
    segments: list[str],
    ks: tuple[int, ...],
    units: Units | None = None,
) -> dict[str, dict[str, Any]]:
    """Each older segment's acceptance under the final draft over that under the draft that
    served when its traffic ended (forgetting shows as a ratio under 1), with the ratio's
    one-sided 95% margin of error (``margin``)."""
    retention: dict[str, dict[str, Any]] = {}
    for segment in segments[:-1]:
        before_draft = loop.champion_when_segment_ended.get(segment, "static")
        ratios, margins = _ratios(counts, loop.champion, before_draft, segment, ks, units=units)
        retention[segment] = {"before_draft": before_draft, **ratios, "margin": margins}
    return retention


def _pooled(first: Counts, second: Counts) -> Counts:
    """Each draft's counts on ``first``'s requests and then ``second``'s, per segment and k
    (the drafts of ``first``; a segment or k either lacks counts the other's only)."""
    from tide_lib.serving.acceptance import AcceptanceCount  # noqa: PLC0415

    empty = AcceptanceCount()
    return {
        draft: {
            segment: {
                k: AcceptanceCount.of(
                    by_k[k].per_request
                    + second.get(draft, {}).get(segment, {}).get(k, empty).per_request
                )
                for k in by_k
            }
            for segment, by_k in segments.items()
        }
        for draft, segments in first.items()
    }


def _unseen_figures(
    loop: Loop,
    held_out: tuple[Counts, Units],
    fresh: tuple[Counts, list[dict[str, Any]]],
    segments: list[str],
    ks: tuple[int, ...],
) -> dict[str, Any]:
    """The figures on every request no draft trained on, pooled: the held-out ones, then
    the fresh ones (``*_unseen``). Each segment's 11-16 held-out requests put a margin of
    error of 0.1-0.4 on a ratio judged against 0.95 or 0.9; the fresh ones are as unseen
    and three times as many, so pooled they say most about the segment."""
    counts = _pooled(held_out[0], fresh[0])
    units = {
        segment: held_out[1].get(segment, [])
        + [item["prompt"] for item in fresh[1] if item["segment"] == segment]
        for segment in segments
    }
    figures: dict[str, Any] = {
        "accept_length_unseen": _lengths(counts, ks),
        "retention_unseen": _retention(counts, loop, segments, ks, units),
    }
    return figures | _new_segment_ratios(
        counts, loop.champion, segments[-1], ks, units=units, suffix="_unseen"
    )


def _new_segment_ratios(
    counts: Counts,
    final: str,
    new_segment: str,
    ks: tuple[int, ...],
    *,
    units: Units | None = None,
    suffix: str = "",
) -> dict[str, Any]:
    """The new segment's ratios at each k, each with its one-sided 95% paired margin
    (``..._margin``): ``al_ratio_adapted_static<suffix>`` and
    ``al_ratio_adapted_oracle<suffix>`` (the ``final`` draft over the static one and the
    oracle), and with a joint draft ``al_ratio_joint_oracle<suffix>``: what one draft
    trained on every segment at once reached.

    The margins count the requests' noise, not the oracle's: its seeds, trained on the
    same requests, spread its figure by tenths (the README quotes runs). So
    ``al_ratio_adapted_oracle<suffix>_by_seed`` gives the ratio over each seed's draft,
    and ``..._seed_range`` its lowest and highest.
    """
    pairs = [("adapted", final, "static"), ("adapted", final, ORACLE)]
    pairs += [(JOINT, JOINT, ORACLE)] if JOINT in counts else []
    figures: dict[str, Any] = {}
    for label, draft, over in pairs:
        ratios, margins = _ratios(counts, draft, over, new_segment, ks, units=units)
        figures[f"al_ratio_{label}_{over}{suffix}"] = ratios
        figures[f"al_ratio_{label}_{over}{suffix}_margin"] = margins
    by_seed = {
        seed: _ratios(counts, final, seed, new_segment, ks, units=units)[0]
        for seed in _oracle_seeds(counts)
    }
    if by_seed:
        figures[f"al_ratio_adapted_{ORACLE}{suffix}_by_seed"] = by_seed
        per_k = {f"k{k}": [ratios[f"k{k}"] for ratios in by_seed.values()] for k in ks}
        figures[f"al_ratio_adapted_{ORACLE}{suffix}_seed_range"] = {
            k: [min(values), max(values)] for k, values in per_k.items()
        }
    return figures


def _timing(
    loop: Loop,
    target_dir: Path,
    prompts: list[str],
    max_new_tokens: int,
    params: AdaptationBenchParams,
) -> tuple[dict[str, EngineRun], dict[str, Any]]:
    """Output tokens/s of static, final adapted (fixed and adaptive k) and plain decoding,
    side by side on the same prompts, ``timing_passes`` times, once adaptive k has settled
    (``settle`` requests beside plain decoding, reported apart); and what it did."""
    from tide_lib.harness.serve_bench import (  # noqa: PLC0415
        PlainOn,
        Submits,
        adaptive_report,
        reference_engine,
        settle,
        side_by_side,
        warm_up,
    )

    static = loop.versions["static"]
    engines = {
        "static": reference_engine(loop.config, target_dir, static, capture=False),
        "adapted": reference_engine(
            loop.config, target_dir, loop.versions[loop.champion], capture=False
        ),
        "adapted_adaptive_k": reference_engine(
            loop.config,
            target_dir,
            loop.versions[loop.champion],
            capture=False,
            speculative_adaptive=True,
        ),
        "plain": reference_engine(
            loop.config, target_dir, static, capture=False, disable_speculation=True
        ),
    }
    try:
        ids = [engines["static"].encode(prompt) for prompt in prompts]
        warm_up(engines, ids[:4], max_new_tokens)  # adaptive k learns acceptance first
        adaptive_engine, plain = engines["adapted_adaptive_k"], engines["plain"]
        settled = settle(adaptive_engine, plain, ids, max_new_tokens, params.settle)
        controller = adaptive_engine.k_controller
        warm_by_k = controller.snapshot()["requests_by_k"]
        timed: dict[str, Submits] = {**engines, "plain_on_adaptive_k": PlainOn(adaptive_engine)}
        totals = side_by_side(timed, ids, max_new_tokens, passes=params.timing_passes)
        adaptive = adaptive_report(warm_by_k, controller.snapshot()) | {"settling": settled}
    finally:
        for engine in engines.values():
            engine.close()
    return totals, adaptive


def run_adaptation_bench(
    config: TideConfig,
    workload: Path,
    json_path: Path | None,
    params: AdaptationBenchParams | None = None,
    *,
    target_dir: Path,
    preset: str = "demo",
    train: TrainConfig | None = None,
) -> dict[str, Any]:
    """Run the benchmark; returns its figures (and writes them to ``json_path``).

    With ``params.labels`` the engine is told each request's segment (a client
    label); without, segments come from the cycle's segmenter, as for
    unlabelled traffic.
    """
    params = params or AdaptationBenchParams()
    cycle_tokens, max_new_tokens, ks = params.cycle_tokens, params.max_new_tokens, params.ks
    held_out_percent, labels = params.held_out_percent, params.labels
    from tide_lib.harness.serve_bench import bootstrap_draft  # noqa: PLC0415
    from tide_lib.target_model import build_target  # noqa: PLC0415

    requests = load_workload(workload)
    build_target(target_dir, preset_name=preset, seed=params.target_seed)
    train = train or config.training
    static_steps = params.static_steps or 4 * train.steps
    segments = list(dict.fromkeys(item["segment"] for item in requests))
    new_segment = segments[-1]
    held = held_out_indices(requests, held_out_percent)
    served = [item for i, item in enumerate(requests) if i not in set(held)]
    target_id = f"bench-adapt-{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory(prefix="tide-bench-adapt-") as tmp:
        work = Path(tmp)
        cycle_config = run_config(
            config,
            work,
            target_id=target_id,
            target_dir=target_dir,
            cycle_tokens=cycle_tokens,
            train=train,
        )
        first = [item["prompt"] for item in served if item["segment"] == segments[0]]
        static_train = train.model_copy(update={"steps": static_steps})
        static_dir = bootstrap_draft(
            target_dir, first, work / "static", max_new_tokens=max_new_tokens, train=static_train
        )
        loop, engine = start_loop(config, cycle_config, work, static_dir)
        try:
            serve_workload(loop, engine, served, max_new_tokens, labels)
        finally:
            engine.close()
        loop.versions |= _train_oracles(loop, served, new_segment, target_dir, params)
        held_items = [requests[i] for i in held]
        by_segment = samples_by_segment(
            target_dir, held_items, max_new_tokens, "held-out", segments
        )
        counts = _with_pooled_oracle(acceptance(loop.versions, target_dir, by_segment, ks))
        seen = samples_by_segment(
            target_dir, _served_sample(served, segments), max_new_tokens, "served", segments[:-1]
        )
        served_counts = _with_pooled_oracle(acceptance(loop.versions, target_dir, seen, ks))
        unseen = fresh_requests(requests, segments, params.fresh, max_new_tokens)
        fresh: dict[str, list[CapturedRecord]] = {segment: [] for segment in segments}
        fresh_counts: Counts = {}
        if unseen:  # else no target to load, no draft to replay
            fresh = samples_by_segment(target_dir, unseen, max_new_tokens, "fresh", segments)
            fresh_counts = _with_pooled_oracle(acceptance(loop.versions, target_dir, fresh, ks))
        units = {
            segment: [item["prompt"] for item in held_items if item["segment"] == segment]
            for segment in segments
        }
        timed, adaptive = _timing(loop, target_dir, units[new_segment], max_new_tokens, params)
    result = _result(loop, counts, timed, segments, ks, units=units)
    result["accept_length_served"] = _lengths(served_counts, ks)
    result["retention_served"] = _retention(served_counts, loop, segments, ks)
    result["accept_length_fresh"] = _lengths(fresh_counts, ks)
    retention_fresh = _retention(fresh_counts, loop, segments, ks) if fresh_counts else {}
    # segments the corpus had unseen requests of
    result["retention_fresh"] = {s: f for s, f in retention_fresh.items() if fresh[s]}
    if fresh[new_segment]:  # the new segment's ratios on fresh requests too
        result |= _new_segment_ratios(fresh_counts, loop.champion, new_segment, ks, suffix="_fresh")
    if fresh_counts:
        result |= _unseen_figures(loop, (counts, units), (fresh_counts, unseen), segments, ks)
    result["adaptive_k"] = adaptive
    result["requests"] = {
        "served": len(served),
        "held_out": len(held),
        "held_out_new_segment": len(units[new_segment]),  # the timed prompts
        "held_out_distinct_prompts": len({requests[i]["prompt"] for i in held}),
        "served_measured": {segment: len(samples) for segment, samples in seen.items()},
        "fresh_measured": {segment: len(samples) for segment, samples in fresh.items()},
    }
    result["params"] = _recorded_params(
        params, train, workload, static_steps=static_steps, oracle_data=loop.oracle_data
    )
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _recorded_params(
    params: AdaptationBenchParams,
    train: TrainConfig,
    workload: Path,
    *,
    static_steps: int,
    oracle_data: str,
) -> dict[str, Any]:
    """The settings a run's JSON records, so that its figures can be told apart."""
    return {
        "cycle_tokens": params.cycle_tokens,
        "max_new_tokens": params.max_new_tokens,
        "ks": list(params.ks),
        "held_out_percent": params.held_out_percent,
        "timing_passes": params.timing_passes,
        "settle_requests": params.settle,
        "train_steps_per_cycle": train.steps,
        "warm_lr_scale": train.warm_lr_scale,
        "static_steps": static_steps,
        "fresh_per_segment": params.fresh,
        "labels": params.labels,
        "workload": str(workload),
        "oracle_data": oracle_data,
        "oracle_seeds": params.oracle_seeds,
        "joint": params.joint,
        "target_seed": params.target_seed,
    }


def _result(
    loop: Loop,
    counts: Counts,
    timed: dict[str, EngineRun],
    segments: list[str],
    ks: tuple[int, ...],
    *,
    units: Units,
) -> dict[str, Any]:
    from tide_lib.harness.serve_bench import paired_ratio, pass_ratios  # noqa: PLC0415

    new_segment, final = segments[-1], loop.champion
    tokens_per_s = {name: run.tokens_per_s for name, run in timed.items()}
    outcomes = [c["outcome"] for c in loop.cycles]
    return {
        "accept_length": _lengths(counts, ks),
        "held_out_requests": {
            segment: by_k[ks[0]].requests for segment, by_k in counts["static"].items()
        },
        **_new_segment_ratios(counts, final, new_segment, ks, units=units),
        "retention": _retention(counts, loop, segments, ks, units),
        "tokens_per_s_static": tokens_per_s["static"],
        "tokens_per_s_adapted": tokens_per_s["adapted"],
        "tokens_per_s_plain": tokens_per_s["plain"],
        "tokens_per_s_adapted_adaptive_k": tokens_per_s["adapted_adaptive_k"],
        "tokens_per_s_by_pass": {name: run.pass_tokens_per_s for name, run in timed.items()},
        "adapted_vs_plain_by_pass": pass_ratios(timed, "adapted", "plain"),
        "adapted_adaptive_k_vs_plain_by_pass": pass_ratios(timed, "adapted_adaptive_k", "plain"),
        "adapted_adaptive_k_vs_plain_paired": paired_ratio(timed, "adapted_adaptive_k", "plain"),
        "adapted_vs_plain_paired": paired_ratio(timed, "adapted", "plain"),
        # plain decoding on the adaptive-k engine itself: the instance's speed cancels
        "adapted_adaptive_k_vs_plain_same_engine": tokens_per_s["adapted_adaptive_k"]
        / tokens_per_s["plain_on_adaptive_k"],
        "adapted_adaptive_k_vs_plain_same_engine_paired": paired_ratio(
            timed, "adapted_adaptive_k", "plain_on_adaptive_k"
        ),
        "threshold_to_serving_s": loop.threshold_to_serving,
        "final_adapted": final,
        "cycles": len(loop.cycles),
        "cycles_trained": sum(1 for c in loop.cycles if "train_seconds" in c),
        "cycles_skipped_no_drift": outcomes.count("no-drift"),
        "cycles_consolidating": sum(1 for c in loop.cycles if c["consolidation"]),
        "cycle_outcomes": {o: outcomes.count(o) for o in sorted(set(outcomes))},
        "cycle_log": loop.cycles,
        "new_segment": new_segment,
        "segments": segments,
        "measured_at": datetime.now(UTC).isoformat(),
    }
