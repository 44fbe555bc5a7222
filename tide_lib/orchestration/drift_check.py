"""The cycle's check before training: is there headroom on this window's traffic?

Train only when it pays (:mod:`tide_lib.evaluation.headroom` holds the rule as pure
functions). Before training, the champion is replayed offline on an even sample of
the window, per segment, and each segment's figure is compared with an estimate of
what a draft reaches on that traffic, from what the cycles' training found there
(:func:`record_trial`), kept in the lake (``_state/.../headroom.json``). No headroom:
the cycle trains nothing. The verdict is decided once per cycle
(``cycles/<id>/drift.json``) and read back by a rerun or a retry.
"""

from __future__ import annotations

__all__ = [
    "REPLAY_RULE",
    "check_drift",
    "drift_key",
    "read_headroom",
    "record_trial",
    "saved_drift",
    "version_acceptance",
]

import dataclasses
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from tide_lib.config import TideConfig
from tide_lib.evaluation.headroom import HeadroomState, SegmentFigure, judge_headroom
from tide_lib.evaluation.offline import (
    AcceptanceCount,
    acceptance_ceiling,
    content_digest,
    content_fraction,
    length_margin,
)
from tide_lib.evaluation.segments import Segmenter, segment_of
from tide_lib.lake.schema import CapturedRecord
from tide_lib.lake.store import StoreUnavailableError
from tide_lib.names import Tags
from tide_lib.orchestration import state
from tide_lib.orchestration.handoff import Drift, Snapshot

if TYPE_CHECKING:
    from tide_lib.registry import DraftRegistry

logger = logging.getLogger(__name__)

# How the cycle replays drafts it compares (version_acceptance); recorded with every
# figure a later cycle compares against, so figures of another rule are never mixed in.
REPLAY_RULE: Final = "every_position"
_HEADROOM: Final = "headroom.json"


def _drift_name(cycle_id: str) -> str:
    return f"cycles/{cycle_id}/drift.json"


def drift_key(config: TideConfig, cycle_id: str) -> str:
    return state.state_key(config, _drift_name(cycle_id))


def saved_drift(config: TideConfig, cycle_id: str) -> Drift | None:
    saved = state.read_state(config, _drift_name(cycle_id))
    return Drift.model_validate_json(saved) if saved is not None else None


def check_drift(config: TideConfig, snapshot: Snapshot) -> Drift:
    """Is there headroom on this window? Decided once per cycle (a rerun reads it).

    The champion is replayed offline on an even sample of the window (every request,
    held out or not: it never trained on them), per segment, and judged against each
    segment's estimate by :func:`~tide_lib.evaluation.headroom.judge_headroom`. No
    headroom: the cycle trains nothing and only moves the watermark. A cycle that
    trains a champion a warm start promoted consolidates (:func:`_consolidation`).
    """
    saved = saved_drift(config, snapshot.cycle_id)
    if saved is not None:
        return saved
    try:
        drift = _measure_drift(config, snapshot)
    except StoreUnavailableError:
        raise  # the lake is down: Airflow retries the task rather than train on a guess
    except Exception as error:  # a check that cannot measure must not stop adaptation
        logger.exception("cycle %s: the headroom check failed; training", snapshot.cycle_id)
        drift = Drift(
            drift=True,
            reason=f"training: the headroom check failed ({type(error).__name__}: {error})",
            champion_version=None,
            measured={},
            baseline={},
        )
    state.write_state(config, _drift_name(snapshot.cycle_id), drift.model_dump_json().encode())
    if drift.consolidate and drift.champion_version is not None:  # after the verdict
        _mark_consolidating(config, drift.champion_version, snapshot.cycle_id)
    logger.info("cycle %s: %s", snapshot.cycle_id, drift.reason)
    return drift


def read_headroom(config: TideConfig) -> HeadroomState:
    """The target's headroom state (empty before the first check, or when its figures were
    taken at another ``gate.k`` or replay rule: they do not compare)."""
    saved = state.read_state(config, _HEADROOM)
    if saved is None:
        return HeadroomState()
    stored = json.loads(saved)
    if stored.get("k") != config.gate.k or stored.get("replay") != REPLAY_RULE:
        return HeadroomState()
    return HeadroomState.model_validate(stored["state"])


def _write_headroom(config: TideConfig, headroom: HeadroomState) -> None:
    payload = {"k": config.gate.k, "replay": REPLAY_RULE, "state": headroom.model_dump()}
    state.write_state(config, _HEADROOM, json.dumps(payload).encode())


@dataclasses.dataclass(frozen=True)
class _Window:
    """The champion measured on the window, per segment, and the segmenter that grouped it."""

    figures: dict[str, SegmentFigure]
    segmenter_key: str


def _measure_drift(config: TideConfig, snapshot: Snapshot) -> Drift:
    from tide_lib.registry import CHAMPION  # noqa: PLC0415

    registry = state.draft_registry(config)
    champion = registry.alias(CHAMPION)
    unconditional = _trains_unconditionally(config, champion)
    if unconditional is not None:
        return unconditional
    assert champion is not None  # no champion trains unconditionally
    window = _measure_window(config, registry, snapshot, version=champion.version)
    figures = window.figures
    known = read_headroom(config).with_reached({s: f.lower for s, f in figures.items()})
    verdict = judge_headroom(
        figures,
        known,
        tolerance=config.cycle.drift_tolerance,
        min_share=config.gate.min_segment_share,
    )
    _write_headroom(config, known)
    drift = Drift(
        drift=verdict.train,
        reason=f"champion v{champion.version}: {verdict.reason}",
        champion_version=champion.version,
        measured={s: f.accept_length for s, f in figures.items()},
        margins={s: f.margin for s, f in figures.items() if math.isfinite(f.margin)},
        shares={s: f.share for s, f in figures.items()},
        ceilings={s: f.ceiling for s, f in figures.items() if f.ceiling is not None},
        baseline={s: e for s, e in verdict.estimates.items() if math.isfinite(e)},
        drifted=verdict.learn,
        fitting=verdict.keep or None,
        segmenter_key=window.segmenter_key,
        champion_judged=_promoted(config, champion),
    )
    if not drift.drift:
        return drift.model_copy(update={"saved_train_seconds": registry.last_run_seconds()})
    return _consolidation(config, registry, champion, drift, found_cycle=snapshot.cycle_id)


def record_trial(
    config: TideConfig, cycle_id: str, gains: Mapping[str, float], *, gain: float | None
) -> None:
    """What the cycle's training found, kept for the next checks: each segment it learned
    gained ``gains[segment]`` (else ``gain``, on all its held-out traffic; None: nothing
    measured, nothing kept) over the champion (:meth:`HeadroomState.after_trial`).

    Idempotent: a retry records the same. Only while the champion the check measured
    still serves (a rerun of an older cycle would overwrite what later ones found), and
    not for a consolidation (it learns every segment, not the ones with headroom)."""
    from tide_lib.registry import CHAMPION  # noqa: PLC0415

    drift = saved_drift(config, cycle_id)
    if drift is None or not drift.drift or drift.consolidate or drift.champion_version is None:
        return
    champion = state.draft_registry(config).alias(CHAMPION)
    if champion is None or champion.version != drift.champion_version:
        return
    learned = {
        s: gains.get(s, gain)
        for s in drift.drifted
        if s in drift.measured and gains.get(s, gain) is not None
    }
    found = {s: g for s, g in learned.items() if g is not None}
    reached = {s: drift.measured[s] + g for s, g in found.items() if g > 0}
    served = {s: drift.measured[s] - drift.margins[s] for s in found if s in drift.margins}
    known = read_headroom(config).with_reached(reached)
    tolerance = config.cycle.drift_tolerance
    _write_headroom(config, known.after_trial(found, served, tolerance, drift.shares))
    logger.info(
        "cycle %s on v%s gained %s",
        cycle_id,
        drift.champion_version,
        ", ".join(f"{s} {g:+.3f}" for s, g in sorted(found.items())) or "nothing measured",
    )


def _trains_unconditionally(config: TideConfig, champion: Any) -> Drift | None:
    """Training without a check: no champion yet, or the check turned off or overridden."""
    forced = config.cycle.force_promote
    if config.cycle.skip_without_drift and not forced and champion is not None:
        return None
    why = (
        "no champion yet"
        if champion is None
        else "cycle.force_promote is on"
        if forced
        else "cycle.skip_without_drift is off"
    )
    return Drift(
        drift=True, reason=f"training: {why}", champion_version=None, measured={}, baseline={}
    )


def _measure_window(
    config: TideConfig, registry: DraftRegistry, snapshot: Snapshot, *, version: str
) -> _Window:
    """The champion replayed on a sample of the window, grouped by this cycle's segmenter."""
    current, current_key = state.cycle_segmenter(config, snapshot)
    samples, shares = _window_sample(config, snapshot, current)
    counts = _champion_counts(config, registry, version, samples)
    figures = {
        segment: SegmentFigure(
            accept_length=count.accept_length,
            margin=length_margin(count.per_request),
            share=shares.get(segment, 0.0),
            ceiling=acceptance_ceiling(samples[segment], config.gate.k, every_position=True),
        )
        for segment, count in counts.items()
    }
    return _Window(figures, current_key)


def _promoted(config: TideConfig, champion: Any) -> bool:
    """Did a cycle's gate promote the champion over a measured one (judged on the traffic
    it was trained for), rather than seed it?"""
    from tide_lib.evaluation.gate import decision_from_tags  # noqa: PLC0415

    judged = decision_from_tags(dict(champion.tags or {}), config.gate.k)
    return judged is not None and judged.promote and bool(judged.champion)


_CONSOLIDATING = "consolidation.json"


def _consolidation_tried(config: TideConfig, version: str) -> str | None:
    """The cycle that consolidated on champion ``version``, if one did
    (``consolidation.json`` names the latest such champion and its cycle)."""
    saved = state.read_state(config, _CONSOLIDATING)
    if saved is None:
        return None
    tried = json.loads(saved)
    return str(tried["cycle_id"]) if tried.get("version") == version else None


def _mark_consolidating(config: TideConfig, version: str, cycle_id: str) -> None:
    """Record the cycle that consolidates on champion ``version`` (see
    :func:`_consolidation_tried`). Written as is: :func:`_consolidation` decided it after
    reading the record, which named no other cycle for this champion."""
    payload = {"version": version, "cycle_id": cycle_id}
    state.write_state(config, _CONSOLIDATING, json.dumps(payload).encode())


def _consolidation(
    config: TideConfig,
    registry: DraftRegistry,
    champion: Any,
    found: Drift,
    *,
    found_cycle: str,
) -> Drift:
    """``found``, or a consolidation cycle: when it trains a champion a warm start
    promoted.

    Warm starts learn each segment from its own windows, one after the other, and each
    loses a little of the older traffic within the gate's tolerance: along a chain of
    six, English fell 2.33 -> 1.89 while a draft trained on every segment's traffic at
    once read above the chain's end on every segment (English 2.45, Korean 3.43 against
    2.59). So a warm start answers a shift, and the next cycle that trains on its draft
    learns all of the lookback together instead (``cycle.consolidate``; from the floor,
    ``cycle.consolidate_from``); the gate judges the result like any challenger.
    Once per champion: when its consolidation (``found_cycle``'s, or a retry's) replaced
    nothing, later cycles warm-start it again, continuing where their runs left off.
    With ``cycle.consolidate_each_drift`` every cycle that trains a champion a cycle's
    gate promoted consolidates, whatever trained it (:func:`_each_drift`).
    """
    if not config.cycle.consolidate:
        return found
    linked = _chain_link(config, champion)
    if not (linked or _each_drift(config, found)):
        return found
    tried = _consolidation_tried(config, champion.version)
    if tried is not None and tried != found_cycle:
        logger.info(
            "champion v%s: its consolidation (cycle %s) replaced nothing: a warm start again",
            champion.version,
            tried,
        )
        return found
    why = found.reason.removeprefix("training: ").removeprefix(f"champion v{champion.version}: ")
    which = "was warm-started" if linked else "was promoted (cycle.consolidate_each_drift)"
    return found.model_copy(
        update={
            "drift": True,
            "consolidate": True,
            "reason": f"training: champion v{champion.version} {which} ({why}): one "
            "consolidation cycle learns every segment's traffic in the lookback together "
            "(cycle.consolidate)",
            "fitting": None,
            "saved_train_seconds": None,
        }
    )


def _each_drift(config: TideConfig, found: Drift) -> bool:
    """Does ``cycle.consolidate_each_drift`` consolidate this drift? Not on a champion no
    cycle's gate promoted (``champion_judged`` false: a seeded one): nothing shifted yet,
    and a consolidation that kept it would use up its one try on the first real shift's
    behalf."""
    return config.cycle.consolidate_each_drift and found.champion_judged


def _chain_link(config: TideConfig, version: Any) -> bool:
    """Was ``version`` promoted by a cycle's gate over a measured champion, and trained
    by an ordinary cycle (not a consolidation)?"""
    consolidated = (version.tags or {}).get(Tags.CONSOLIDATED) == "true"
    return not consolidated and _promoted(config, version)


def _window_sample(
    config: TideConfig, snapshot: Snapshot, segmenter: Segmenter
) -> tuple[dict[str, list[CapturedRecord]], dict[str, float]]:
    """An even sample of the window's distinct requests by segment (as the cycle's
    ``segmenter`` names them), and each segment's token share (copies included: they
    are traffic).

    Copies of a request (the same prompt answered the same way) are measured once:
    n copies are one piece of evidence, and counting them n times shrinks a figure's
    margin of error below the spread between windows, so the check saw drift in noise.
    """
    reader = state.sample_reader(config)
    rate = min(1.0, config.cycle.drift_sample_tokens / max(snapshot.window_tokens, 1))
    samples: dict[str, list[CapturedRecord]] = {}
    tokens: dict[str, int] = {}
    seen: set[bytes] = set()
    for sample in reader.iter_records(state.markers_of(reader, snapshot.window)):
        segment = segment_of(sample, segmenter)
        tokens[segment] = tokens.get(segment, 0) + int(sample.input_ids.numel())
        digest = content_digest(sample.input_ids)
        if digest not in seen and content_fraction(sample.input_ids, b"drift") < rate:
            samples.setdefault(segment, []).append(sample)
        seen.add(digest)
    state.log_debris(reader, f"cycle {snapshot.cycle_id} drift check")
    total = sum(tokens.values()) or 1
    return samples, {segment: count / total for segment, count in tokens.items()}


def _champion_counts(
    config: TideConfig,
    registry: DraftRegistry,
    version: str,
    samples: dict[str, list[CapturedRecord]],
) -> dict[str, AcceptanceCount]:
    """Offline acceptance counts of ``version`` per segment at ``gate.k``."""
    from tide_lib.training.specforge_runtime import prepare_specforge  # noqa: PLC0415

    prepare_specforge("cpu")
    k = config.gate.k
    with state.task_scratch(config, f"drift-v{version}") as work:
        return version_acceptance(config, registry, version, samples, ks=[k], work=work)[k]


def version_acceptance(
    config: TideConfig,
    registry: DraftRegistry,
    version: str,
    samples: dict[str, list[CapturedRecord]],
    *,
    ks: list[int],
    work: Path,
) -> dict[int, dict[str, AcceptanceCount]]:
    """Download ``version`` into ``work`` and replay it offline: k -> segment -> counts.

    Rounds start at every output position: the cycle compares drafts (the gate, the
    headroom check against what was reached), and this evidence pairs them position by position
    (:func:`~tide_lib.evaluation.offline.acceptance_counts`).
    """
    from tide_lib.evaluation.offline import offline_acceptance  # noqa: PLC0415
    from tide_lib.training.draft import load_draft  # noqa: PLC0415

    target = config.cycle.target_path
    draft = load_draft(registry.download(version, work / f"v{version}"), target)
    counts = offline_acceptance(draft, target, samples, ks, every_position=True)  # REPLAY_RULE
    return {k: {segment: by_k[k] for segment, by_k in counts.items()} for k in ks}
