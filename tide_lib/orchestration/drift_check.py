"""The cycle's drift check: does the champion still fit this window's traffic?

Train only when it pays (:mod:`tide_lib.evaluation.drift` holds the rules as pure
functions). Before training, the champion is replayed offline on an even sample
of the window, per segment, and compared with its *baseline*, kept in the lake
(``_state/.../baseline.json``) with the segmenter that grouped its figures: as
the gate measured it at its promotion, as the champion a rejected challenger
could not beat, or as the first check measured it. No drift: the cycle trains
nothing. The verdict is decided once per cycle (``cycles/<id>/drift.json``) and
read back by a rerun or a retry.
"""

from __future__ import annotations

__all__ = [
    "REPLAY_RULE",
    "Baseline",
    "champion_baseline",
    "check_drift",
    "drift_key",
    "evidenced_figures",
    "keep_champion_baseline",
    "saved_drift",
    "settle_tried_segments",
    "store_baseline",
    "version_acceptance",
]

import dataclasses
import json
import logging
import math
import statistics
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from tide_lib.config import TideConfig
from tide_lib.evaluation.drift import DriftVerdict, capped_reference, judge_drift, judge_window
from tide_lib.evaluation.offline import (
    AcceptanceCount,
    acceptance_ceiling,
    content_digest,
    content_fraction,
    length_margin,
)
from tide_lib.evaluation.segments import Segmenter, segment_as_grouped
from tide_lib.lake.schema import CapturedRecord, reserved_segment
from tide_lib.lake.store import StoreUnavailableError
from tide_lib.names import Tags
from tide_lib.orchestration import state
from tide_lib.orchestration.handoff import Drift, Snapshot

if TYPE_CHECKING:
    from tide_lib.evaluation.gate import GateDecision
    from tide_lib.registry import DraftRegistry

logger = logging.getLogger(__name__)


def _drift_name(cycle_id: str) -> str:
    return f"cycles/{cycle_id}/drift.json"


def drift_key(config: TideConfig, cycle_id: str) -> str:
    return state.state_key(config, _drift_name(cycle_id))


def saved_drift(config: TideConfig, cycle_id: str) -> Drift | None:
    saved = state.read_state(config, _drift_name(cycle_id))
    return Drift.model_validate_json(saved) if saved is not None else None


def check_drift(config: TideConfig, snapshot: Snapshot) -> Drift:
    """Does the champion still fit this window? Decided once per cycle (a rerun reads it).

    The champion is replayed offline on an even sample of the window (every request,
    held out or not: it never trained on them), per segment, and judged against its
    baseline by :func:`tide_lib.evaluation.drift.judge_drift`. No drift: the cycle
    trains nothing and only moves the watermark, unless this is the first check since
    a promotion for a large gain (:func:`tide_lib.evaluation.drift.still_learning`) or
    since the promotion that ended a learning chain. A cycle that trains a champion a
    warm start promoted consolidates (:func:`_consolidation`).
    """
    saved = saved_drift(config, snapshot.cycle_id)
    if saved is not None:
        return saved
    try:
        drift = _measure_drift(config, snapshot)
    except StoreUnavailableError:
        raise  # the lake is down: Airflow retries the task rather than train on a guess
    except Exception as error:  # a check that cannot measure must not stop adaptation
        logger.exception("cycle %s: the drift check failed; training", snapshot.cycle_id)
        drift = Drift(
            drift=True,
            reason=f"training: the drift check failed ({type(error).__name__}: {error})",
            champion_version=None,
            measured={},
            baseline={},
        )
    state.write_state(config, _drift_name(snapshot.cycle_id), drift.model_dump_json().encode())
    if drift.champion_version is not None:  # after the verdict: a run that died checked nothing
        _mark_checked(config, drift.champion_version, snapshot.cycle_id)
        if drift.consolidate:
            _mark_consolidating(config, drift.champion_version, snapshot.cycle_id)
    logger.info("cycle %s: %s", snapshot.cycle_id, drift.reason)
    return drift


@dataclasses.dataclass(frozen=True)
class _Window:
    """The champion measured on the window: acceptance per segment, the margins of those
    measured on two requests or more, token shares, the segmenter that grouped them, and
    each segment's ceiling (what its output lengths allow)."""

    measured: dict[str, float]
    margins: dict[str, float]  # finite ones only
    all_margins: dict[str, float]
    shares: dict[str, float]
    segmenter_key: str
    # the most any draft reaches on each segment's requests (absent: not known)
    ceilings: dict[str, float] = dataclasses.field(default_factory=dict)
    # each segment's requests as (emitted, verify steps): the window judged as a whole
    per_request: dict[str, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)

    def held_to(self, segment: str, reference: float) -> float:
        """``reference``, or the segment's ceiling when that is lower."""
        return capped_reference(reference, self.ceilings.get(segment))


def _measure_drift(config: TideConfig, snapshot: Snapshot) -> Drift:
    from tide_lib.registry import CHAMPION  # noqa: PLC0415

    registry = state.draft_registry(config)
    champion = registry.alias(CHAMPION)
    unconditional = _trains_unconditionally(config, champion)
    if unconditional is not None:
        return unconditional
    assert champion is not None  # no champion trains unconditionally
    cycle_id = snapshot.cycle_id
    first_check = _first_check_since_promotion(config, champion.version, cycle_id)
    # Segments as the baseline's figures were grouped: clusters are refit every cycle,
    # and a cluster of another fit holds other requests (a different figure, not drift).
    known = champion_baseline(config, registry, champion, cycle_id=snapshot.cycle_id)
    known, grouping = _comparable(config, known)
    window = _measure_window(
        config, registry, snapshot, version=champion.version, known=known, grouping=grouping
    )
    if not known.accept_length:
        promoted = _promoted(config, champion)
        drift = _first_measurement(
            config, champion.version, window, snapshot.cycle_id, promoted=promoted
        )
    else:
        drift = _judged_against(config, champion.version, window, known)
    if drift.drift:  # a warm-started champion is not warm-started again
        return _consolidation(config, registry, champion, drift, chain=1, found_cycle=cycle_id)
    drift = drift.model_copy(update={"saved_train_seconds": registry.last_run_seconds()})
    # Traffic it was just promoted for, served as well as then, may still be learning.
    why = drift.reason.removeprefix(f"champion v{champion.version}: ")
    if not first_check:
        return drift
    learning = _still_learning(config, champion, why)
    if learning is not None:
        return _consolidation(config, registry, champion, learning, chain=1, found_cycle=cycle_id)
    return _consolidation(config, registry, champion, drift, chain=2, found_cycle=cycle_id)


def _judged_against(config: TideConfig, version: str, window: _Window, known: Baseline) -> Drift:
    """The window judged against the champion's baseline (:func:`judge_drift`); without
    drift, the segments it serves well join the baseline."""
    tolerance = config.cycle.drift_tolerance
    verdict = judge_drift(
        window.measured,
        window.shares,
        known.accept_length,
        tolerance=tolerance,
        min_share=config.gate.min_segment_share,
        margins=window.all_margins,
        baseline_margins=known.margins,
        ceilings=window.ceilings,
    )
    average = statistics.fmean(known.accept_length.values())
    if not verdict.drift:  # segments too thin to judge alone may have fallen together
        verdict = _judged_whole(
            window,
            known,
            average,
            verdict,
            tolerance=tolerance,
            min_share=config.gate.min_segment_share,
        )
    fitting = _fitting(
        window, lambda s: known.accept_length.get(s, average), verdict.drifted, tolerance
    )
    if not verdict.drift:  # segments it serves well from now on join its baseline
        fits = set(window.margins) if fitting is None else set(fitting)
        # not one that fits only by its ceiling: it would lower what new traffic is held to
        new = {
            s: window.measured[s]
            for s in fits
            if s not in known.accept_length and window.measured[s] >= average - tolerance
        }
        grown = Baseline(
            version,
            {**known.accept_length, **new},
            {**known.margins, **{s: window.margins[s] for s in new}},
            window.segmenter_key,
        )
        store_baseline(config, grown, "measured")
    return Drift(
        drift=verdict.drift,
        reason=f"champion v{version}: {verdict.reason}",
        champion_version=version,
        measured=window.measured,
        margins=window.margins,
        ceilings=window.ceilings,
        baseline=known.accept_length,
        drifted=sorted(verdict.drifted),
        fitting=fitting,
        segmenter_key=window.segmenter_key,
    )


def _judged_whole(
    window: _Window,
    known: Baseline,
    average: float,
    alone: DriftVerdict,
    *,
    tolerance: float,
    min_share: float,
) -> DriftVerdict:
    """The window judged as a whole (:func:`judge_window`), each segment held to what
    :func:`judge_drift` held it to, when no segment fell alone (``alone``). A baseline's
    margin counts where the segment is held to it (a ceiling is exact); segments named
    are those :func:`judge_drift` could have named (two requests or more, ``min_share``
    of the window)."""
    references = {
        s: window.held_to(s, known.accept_length.get(s, average)) for s in window.measured
    }
    whole = judge_window(
        window.per_request,
        references,
        tolerance=tolerance,
        reference_margins={
            s: m
            for s, m in known.margins.items()
            if references.get(s) == known.accept_length.get(s)
        },
        nameable={s for s in window.margins if window.shares.get(s, 0.0) >= min_share},
    )
    if whole.drift:
        return dataclasses.replace(whole, reason=f"{whole.reason}; by segment, {alone.reason}")
    return dataclasses.replace(alone, reason=f"{alone.reason}; {whole.reason}")


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
    config: TideConfig,
    registry: DraftRegistry,
    snapshot: Snapshot,
    *,
    version: str,
    known: Baseline,
    grouping: Segmenter | None,
) -> _Window:
    """The champion replayed on a sample of the window, grouped as its baseline was
    (``grouping``), else by this cycle's segmenter."""
    current, current_key = state.cycle_segmenter(config, snapshot)
    segmenter_key = known.segmenter_key if grouping is not None else None
    if grouping is None or segmenter_key is None:
        grouping, segmenter_key = current, current_key
    samples, shares = _window_sample(config, snapshot, grouping, current)
    counts = _champion_counts(config, registry, version, samples)
    margins = {segment: length_margin(count.per_request) for segment, count in counts.items()}
    return _Window(
        measured={segment: count.accept_length for segment, count in counts.items()},
        margins={segment: m for segment, m in margins.items() if math.isfinite(m)},
        all_margins=margins,
        shares=shares,
        segmenter_key=segmenter_key,
        ceilings={
            segment: acceptance_ceiling(records, config.gate.k, every_position=True)
            for segment, records in samples.items()
        },
        per_request={segment: list(count.per_request) for segment, count in counts.items()},
    )


def _promoted(config: TideConfig, champion: Any) -> bool:
    """Did a cycle's gate promote the champion over a measured one? Without a baseline
    its gate protected no segment alone (or grouped or measured them otherwise than
    this check can compare), but it was judged on the traffic it was trained for."""
    from tide_lib.evaluation.gate import decision_from_tags  # noqa: PLC0415

    judged = decision_from_tags(dict(champion.tags or {}), config.gate.k)
    return judged is not None and judged.promote and bool(judged.champion)


def _standards(config: TideConfig, window: _Window, *, promoted: bool) -> list[str]:
    """Segments a first measurement may hold the others to, and keep as baseline: those
    measured on two requests or more (one request is no standard); for a promoted
    champion, those holding ``min_segment_share`` of the window too (a small lucky
    segment is no standard for the traffic it serves)."""
    min_share = config.gate.min_segment_share if promoted else 0.0
    return [s for s in window.margins if window.shares.get(s, 0.0) >= min_share]


def _far_below(config: TideConfig, window: _Window, top: str | None) -> set[str]:
    """Segments a promoted champion serves more than ``drift_tolerance`` below its best
    segment ``top``: :func:`judge_drift` with every segment's reference at the best
    figure and its margin (new traffic; small segments and single requests count not)."""
    if top is None:
        return set()
    verdict = judge_drift(
        window.measured,
        window.shares,
        dict.fromkeys(window.measured, window.measured[top]),
        tolerance=config.cycle.drift_tolerance,
        min_share=config.gate.min_segment_share,
        margins=window.all_margins,
        baseline_margins=dict.fromkeys(window.measured, window.margins[top]),
        ceilings=window.ceilings,
    )
    return set(verdict.drifted)


def _first_measurement(
    config: TideConfig, version: str, window: _Window, cycle_id: str, *, promoted: bool = False
) -> Drift:
    """A champion's first figures on a window (segments of two requests or more, with
    their margins) are its baseline from then on, but for those far below its best
    segment: traffic it does not fit is what the cycle learns, never the standard later
    windows are held to (it would read as "no drift" ever after).

    A seeded champion (never judged) trains. One a cycle ``promoted`` was judged, on
    the window it was trained for: it trains only for new traffic
    (:func:`_far_below`), else this is "no drift". Training it again on the
    traffic it was just fitted to buys a draft the gate then rejects."""
    standards = _standards(config, window, promoted=promoted)
    top = max(standards, key=window.measured.__getitem__, default=None)
    best = window.measured[top] if top is not None else 0.0
    tolerance = config.cycle.drift_tolerance
    drifted = (
        _far_below(config, window, top)
        if promoted
        else {s for s, v in window.measured.items() if v < window.held_to(s, best) - tolerance}
    )
    # a segment at its ceiling far below the best is no drift, and no standard either
    kept = [s for s in standards if window.measured[s] >= best - tolerance]
    first = Baseline(
        version,
        {s: window.measured[s] for s in kept},
        {s: window.margins[s] for s in kept},
        window.segmenter_key,
    )
    if first.accept_length:
        store_baseline(config, first, _FIRST, cycle_id=cycle_id)
    drift, why = _first_verdict(
        version, promoted, sorted(drifted), measurable=bool(kept), tolerance=tolerance
    )
    return Drift(
        drift=drift,
        reason=why,
        champion_version=version,
        measured=window.measured,
        margins=window.margins,
        ceilings=window.ceilings,
        baseline={},
        drifted=sorted(drifted),
        fitting=_fitting(window, lambda _: best, drifted, tolerance),
        segmenter_key=window.segmenter_key,
        champion_judged=promoted,
    )


def _first_verdict(
    version: str,
    promoted: bool,
    drifted: list[str],
    *,
    measurable: bool,
    tolerance: float,
) -> tuple[bool, str]:
    """Whether a first measurement trains, and why (see :func:`_first_measurement`)."""
    kept = (
        "its figures on this window are its baseline from now on (but for segments far below "
        "its best)"
        if measurable
        else "no segment of this window has two requests to measure one on"
    )
    if not promoted:
        why = "had no baseline (never judged on enough held-out traffic)"
        return True, f"training: champion v{version} {why}; {kept}"
    promoted_thin = "was promoted without a baseline this window can be judged against"
    margins = f"by more than {tolerance:.3f} beyond the margins of error"
    if drifted:
        far = f"serves {', '.join(drifted)} below its best segment {margins}"
        return True, f"training: champion v{version} {promoted_thin}, and {far}; {kept}"
    if not measurable:
        return True, f"training: champion v{version} {promoted_thin}; {kept}"
    fits = f"serves no segment below its best segment {margins} (or below its ceiling)"
    return False, f"no drift: champion v{version} {promoted_thin}, and {fits}; {kept}"


def _fitting(
    window: _Window, reference: Callable[[str], float], drifted: Iterable[str], tolerance: float
) -> list[str] | None:
    """Segments whose figure, less its margin of error, is within ``tolerance`` of their
    ``reference``, and those served within ``tolerance`` of their ceiling (nothing is
    left to learn there): a cycle keeps their window traffic rather than learn it. A segment
    measured on one request (no margin), or too loosely to tell, is learned: new
    traffic the check could not judge is the traffic a cycle exists for. None when
    every segment fits: a cycle that trains anyway learns its whole window."""
    fallen = set(drifted)
    fitting = {
        segment
        for segment, margin in window.margins.items()
        if segment not in fallen
        and window.measured[segment] - margin >= reference(segment) - tolerance
    }
    # at its ceiling, margin or not: the ceiling is exact for the requests measured
    fitting |= {
        segment
        for segment, ceiling in window.ceilings.items()
        if segment not in fallen and window.measured.get(segment, 0.0) >= ceiling - tolerance
    }
    return sorted(fitting) if set(window.measured) - fitting else None


_LEARNING = "learning.json"


def _first_check_since_promotion(config: TideConfig, version: str, cycle_id: str) -> bool:
    """Is this cycle's check the champion's first since it was promoted? ``learning.json``
    names the latest champion and the cycle whose check of it was saved first (a retry
    of that cycle is still the first; a later cycle is not, whatever it decided)."""
    saved = state.read_state(config, _LEARNING)
    if saved is None:
        return True
    first = json.loads(saved)
    return bool(first.get("version") != version or first.get("cycle_id") == cycle_id)


def _mark_checked(config: TideConfig, version: str, cycle_id: str) -> None:
    """Record the first saved check of ``version`` (see :func:`_first_check_since_promotion`)."""
    saved = state.read_state(config, _LEARNING)
    if saved is not None and json.loads(saved).get("version") == version:
        return
    payload = {"version": version, "cycle_id": cycle_id}
    state.write_state(config, _LEARNING, json.dumps(payload).encode())


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


def _comparable(config: TideConfig, known: Baseline) -> tuple[Baseline, Segmenter | None]:
    """The baseline's figures that can be compared with this window, and the segmenter
    that grouped them. Without that segmenter (lost, or a baseline stored before it was
    kept) its clusters mean nothing to this cycle: only client labels, which every
    segmenter keeps alike, stay."""
    if not known.accept_length:
        return known, None
    grouping = state.stored_segmenter(config, known.segmenter_key)
    if grouping is not None:
        return known, grouping
    labelled = {s: v for s, v in known.accept_length.items() if not reserved_segment(s)}
    dropped = sorted(set(known.accept_length) - set(labelled))
    if dropped:
        logger.warning(
            "the segmenter of v%s's baseline (%s) is not readable: its figures for %s "
            "cannot be compared with this window's and are left out",
            known.version,
            known.segmenter_key,
            ", ".join(dropped),
        )
    margins = {s: m for s, m in known.margins.items() if s in labelled}
    return Baseline(known.version, labelled, margins, None), None


def _still_learning(config: TideConfig, champion: Any, no_drift: str) -> Drift | None:
    """A champion without drift that was promoted for a large gain trains once more (see
    :func:`tide_lib.evaluation.drift.still_learning`): the segments it gained on (as its
    gate grouped them) are learned, the rest of the window kept. When the gain was the
    window-weighted figure's (:func:`~tide_lib.evaluation.drift.pooled_gain`, every
    held-out request together), the segments that carried it are learned
    (:func:`~tide_lib.evaluation.drift.carried_gain`); the whole window when none did
    or that segmenter is gone. None when the rule does not apply. Checked only
    on the first check after the promotion, and after the drift rule: new traffic is
    drift, and is learned as such, not as the segments of an older promotion."""
    from tide_lib.evaluation.drift import (  # noqa: PLC0415
        carried_gain,
        pooled_gain,
        still_learning,
    )
    from tide_lib.evaluation.gate import decision_from_tags  # noqa: PLC0415

    tags = dict(champion.tags or {})
    judged = decision_from_tags(tags, config.gate.k)
    if judged is None:
        return None
    min_gain = config.cycle.learning_gain
    gains = still_learning(judged, min_gain=min_gain, min_share=config.gate.min_segment_share)
    pooled = pooled_gain(judged)
    if not gains and (min_gain <= 0 or pooled < min_gain):
        return None
    share = config.gate.min_segment_share
    named = gains or carried_gain(judged, min_gain=min_gain, min_share=share)
    key = tags.get(Tags.SEGMENTER)
    readable = bool(named) and state.stored_segmenter(config, key) is not None
    listed = ", ".join(f"{segment} +{gain:.3f}" for segment, gain in named.items())
    if not gains:
        carried = f"; carried by {listed}" if named else ""
        listed = (
            f"+{pooled:.3f} window-weighted (no segment alone held out enough to count{carried})"
        )
    return Drift(
        drift=True,
        reason=f"training: champion v{champion.version} was promoted for {listed} "
        f"(at least cycle.learning_gain {config.cycle.learning_gain:.3f}): that traffic is "
        f"still being learned, so one more cycle trains on it ({no_drift})",
        champion_version=champion.version,
        measured={},
        baseline=evidenced_figures(judged.challenger, judged.protected),
        drifted=sorted(named) if readable else [],
        segmenter_key=key if readable else None,
    )


def _consolidation(
    config: TideConfig,
    registry: DraftRegistry,
    champion: Any,
    found: Drift,
    *,
    chain: int,
    found_cycle: str,
) -> Drift:
    """``found``, or a consolidation cycle: when it trains a champion a warm start
    promoted (``chain`` 1: drift, or traffic still being learned), or, without drift
    (``chain`` 2), when that champion's parent was promoted by a warm start too.

    Warm starts learn each segment from its own windows, one after the other, and each
    loses a little of the older traffic within the gate's tolerance: along a chain of
    six, English fell 2.33 -> 1.89 while a draft trained on every segment's traffic at
    once read above the chain's end on every segment (English 2.45, Korean 3.43 against
    2.59). So a warm start answers a shift, and the next cycle that trains on its draft
    learns all of the lookback together instead (``cycle.consolidate``; from the floor,
    ``cycle.consolidate_from``); the gate judges the result like any challenger. A
    single promotion without drift after it (traffic without shift) spends nothing.
    Once per champion: when its consolidation (``found_cycle``'s, or a retry's) replaced
    nothing, later cycles warm-start it again, continuing where their runs left off.
    With ``cycle.consolidate_each_drift`` every drift (``chain`` 1) consolidates, whatever
    promoted the champion (:func:`_each_drift`).
    """
    if not config.cycle.consolidate:
        return found
    linked = _chain_link(config, champion)
    if not (linked or (chain == 1 and _each_drift(config, found))):
        return found
    tried = _consolidation_tried(config, champion.version)
    if tried is not None and tried != found_cycle:
        logger.info(
            "champion v%s: its consolidation (cycle %s) replaced nothing: a warm start again",
            champion.version,
            tried,
        )
        return found
    parent = (champion.tags or {}).get(Tags.PARENT_VERSION)
    if chain > 1:
        parent_version = registry.find(parent) if parent else None
        if parent_version is None:
            logger.info(
                "champion v%s: its parent v%s is gone: no chain to consolidate",
                champion.version,
                parent,
            )
            return found
        if not _chain_link(config, parent_version):
            return found
    why = found.reason.removeprefix("training: ").removeprefix(f"champion v{champion.version}: ")
    which = f"ends a learning chain over v{parent}" if chain > 1 else "was warm-started"
    if not linked:  # only cycle.consolidate_each_drift consolidates an unlinked champion
        which = "drifted (cycle.consolidate_each_drift)"
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
    """Does ``cycle.consolidate_each_drift`` consolidate this drift? Not a seeded
    champion's first check (``champion_judged`` false): nothing shifted yet, the window
    holds all the traffic there is, and a consolidation that kept the champion there
    would use up its one try on the first real drift's behalf (on the demo that drift
    then warm-started; the final figures were the same either way, English 0.88)."""
    return config.cycle.consolidate_each_drift and found.champion_judged


def _chain_link(config: TideConfig, version: Any) -> bool:
    """Was ``version`` promoted by a cycle's gate over a measured champion, and trained
    by an ordinary cycle (not a consolidation)?"""
    consolidated = (version.tags or {}).get(Tags.CONSOLIDATED) == "true"
    return not consolidated and _promoted(config, version)


def _window_sample(
    config: TideConfig, snapshot: Snapshot, grouping: Segmenter, current: Segmenter
) -> tuple[dict[str, list[CapturedRecord]], dict[str, float]]:
    """An even sample of the window's distinct requests by segment (as ``grouping``
    names them, see :func:`segment_as_grouped`), and each segment's token share (copies
    included: they are traffic).

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
        segment = segment_as_grouped(sample, grouping, current)
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
    drift check against a baseline), and this evidence pairs them position by position
    (:func:`~tide_lib.evaluation.offline.acceptance_counts`).
    """
    from tide_lib.evaluation.offline import offline_acceptance  # noqa: PLC0415
    from tide_lib.training.draft import load_draft  # noqa: PLC0415

    target = config.cycle.target_path
    draft = load_draft(registry.download(version, work / f"v{version}"), target)
    counts = offline_acceptance(draft, target, samples, ks, every_position=True)  # REPLAY_RULE
    return {k: {segment: by_k[k] for segment, by_k in counts.items()} for k in ks}


# How the cycle replays drafts it compares (version_acceptance); recorded with every
# figure a later cycle compares against, so figures of another rule are never mixed in.
REPLAY_RULE: Final = "every_position"
_FIRST = "first measurement"  # baseline.json's source when the drift check set it
_TRIED = "a cycle learned it and kept the champion"
_BASELINE = "baseline.json"


@dataclasses.dataclass(frozen=True)
class Baseline:
    """A champion's acceptance per segment, each figure's margin of error (absent: exact
    or unknown), and the lake key of the segmenter that grouped the requests measured."""

    version: str
    accept_length: dict[str, float]
    margins: dict[str, float]
    segmenter_key: str | None


def champion_baseline(
    config: TideConfig, registry: DraftRegistry, champion: Any, cycle_id: str | None = None
) -> Baseline:
    """The champion's baseline: as the gate measured it at its promotion (the figures on
    its version), as the champion a rejected challenger could not beat (stored by
    :func:`evaluate_and_gate`), or as the drift check first measured it (not in
    ``cycle_id`` itself: a retry of the check that set it must not compare the window
    with itself). Empty figures if none happened yet."""
    from tide_lib.evaluation.gate import decision_from_tags  # noqa: PLC0415

    none = Baseline(champion.version, {}, {}, None)
    saved = state.read_state(config, _BASELINE)
    if saved is not None:
        stored = json.loads(saved)
        own = stored.get("source") == _FIRST and stored.get("cycle_id") == cycle_id
        same_rule = stored.get("k") == config.gate.k and stored.get("replay") == REPLAY_RULE
        if stored.get("version") == champion.version and same_rule:
            if own:
                return none
            return Baseline(
                champion.version,
                {str(s): float(v) for s, v in stored["accept_length"].items()},
                {str(s): float(v) for s, v in stored.get("margins", {}).items()},
                stored.get("segmenter"),
            )
    tags = dict(champion.tags or {})
    judged = decision_from_tags(tags, config.gate.k)
    if tags.get(Tags.GATE_REPLAY) != REPLAY_RULE:
        judged = None  # an older release's engine-round figures: measured afresh instead
    figures = evidenced_figures(judged.challenger, judged.protected) if judged is not None else {}
    if not figures:
        return none
    baseline = Baseline(champion.version, figures, {}, tags.get(Tags.SEGMENTER))
    store_baseline(config, baseline, "gate")
    return baseline


def evidenced_figures(figures: dict[str, float], protected: tuple[str, ...]) -> dict[str, float]:
    """The figures a baseline may hold: those of segments the gate protected, i.e. measured
    on enough held-out requests (a one-request figure of 4.0 is no baseline to drift from)."""
    return {segment: value for segment, value in figures.items() if segment in protected}


def store_baseline(
    config: TideConfig, baseline: Baseline, source: str, *, cycle_id: str | None = None
) -> None:
    payload = {
        "version": baseline.version,
        "k": config.gate.k,
        "replay": REPLAY_RULE,
        "accept_length": baseline.accept_length,
        "margins": baseline.margins,
        "segmenter": baseline.segmenter_key,
        "cycle_id": cycle_id,
    }
    state.write_state(config, _BASELINE, json.dumps({**payload, "source": source}).encode())


def keep_champion_baseline(
    config: TideConfig,
    registry: DraftRegistry,
    version: str,
    decision: GateDecision,
    *,
    segmenter_key: str,
    cycle_id: str,
) -> None:
    """A champion that held its place against the challenger of ``cycle_id``: never judged
    before (a seeded one), the gate's figures on it are its baseline, so later cycles
    train only if its traffic drifts; segments the cycle learned in vain join that
    baseline (:func:`settle_tried_segments`)."""
    from tide_lib.registry import CHAMPION  # noqa: PLC0415

    champion = registry.alias(CHAMPION)
    if decision.promote or not decision.champion or champion is None:
        return
    if champion.version == version:
        return
    if not champion_baseline(config, registry, champion).accept_length:
        figures = evidenced_figures(decision.champion, decision.protected)
        if figures:
            held = Baseline(champion.version, figures, {}, segmenter_key)
            store_baseline(config, held, "gate: held its place")
    settle_tried_segments(
        config,
        registry,
        cycle_id,
        champion.version,
        gain=decision.weighted_challenger - (decision.weighted_champion or 0.0),
        segment_gains={  # a segment's own gain only on enough held-out traffic to count
            s: gain for s, gain in decision.gains().items() if s in decision.protected
        },
        gains_key=segmenter_key,
    )


def settle_tried_segments(
    config: TideConfig,
    registry: DraftRegistry,
    cycle_id: str,
    champion_version: str,
    *,
    gain: float,
    segment_gains: Mapping[str, float] | None = None,
    gains_key: str | None = None,
) -> list[str]:
    """Segments a cycle learned in vain join the champion's baseline at its figures there.

    A segment the baseline holds no figure for (new to it, or left out of a first
    measurement as far below the champion's best) is held to a guess: the baseline's
    average, or the best segment. Held to it, every later window trains again for
    nothing (the no-shift benchmark at abbe80c: a cluster of coding questions the fitted
    draft serves at 2.6, held to 4.3; three cycles trained, none promoted). A cycle
    that learned it and kept its champion refutes the guess, and from then on the
    segment is held to what the champion serves: it trains again when it falls below.

    ``gain``: what the cycle's draft gained on all its held-out traffic (0 when no
    checkpoint beat the parent beyond the noise; a step within it is left to continue
    from); ``segment_gains``: the gate's gains per segment, grouped by the segmenter
    ``gains_key``, which speak for a segment when the check grouped alike (a client
    label, under any segmenter). A gain of
    ``cycle.learning_gain`` or more means it learned, and was rejected for something
    else: not settled. A known segment that fell keeps its baseline (its traffic
    changed: the next cycle learns it again).
    """
    from tide_lib.registry import CHAMPION  # noqa: PLC0415

    drift = saved_drift(config, cycle_id)
    champion = registry.alias(CHAMPION)
    if drift is None or champion is None or not drift.drift or drift.consolidate:
        return []  # a retrain from the floor that kept its champion refutes no guess
    if drift.champion_version != champion_version or champion.version != champion_version:
        return []
    known = champion_baseline(config, registry, champion)
    if known.accept_length and known.segmenter_key != drift.segmenter_key:
        return []  # grouped otherwise since: its figures do not name the same traffic
    min_gain = config.cycle.learning_gain
    gains = {  # clusters of another fit name other traffic; client labels name the same
        segment: value
        for segment, value in (segment_gains or {}).items()
        if gains_key == drift.segmenter_key or not reserved_segment(segment)
    }
    tried = {
        segment: drift.measured[segment]
        for segment in drift.drifted
        if segment in drift.margins
        and segment not in known.accept_length
        and gains.get(segment, gain) < min_gain
    }
    if not tried:
        return []
    grown = Baseline(
        champion_version,
        {**known.accept_length, **tried},
        {**known.margins, **{segment: drift.margins[segment] for segment in tried}},
        drift.segmenter_key,
    )
    store_baseline(config, grown, _TRIED)
    logger.info(
        "cycle %s learned %s and kept champion v%s: it is held to what v%s serves there "
        "from now on (%s)",
        cycle_id,
        ", ".join(sorted(tried)),
        champion_version,
        champion_version,
        ", ".join(f"{segment} {value:.3f}" for segment, value in sorted(tried.items())),
    )
    return sorted(tried)
