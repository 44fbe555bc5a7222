"""Train only when it pays: does the champion still fit the traffic of this window?

A cycle trains a challenger whenever enough new tokens arrived, but when the
champion serves the new window as well as it served the traffic it was
promoted on, the accelerator hours buy a draft the gate then rejects (or that
regresses). So before training, the cycle measures the champion's acceptance
length on the window, per segment, and compares it with a *baseline*: the
champion's acceptance as the gate last measured it: at its promotion (the
gate's figures on its version), or, for a champion never promoted by a cycle (a
seeded one), when a challenger failed to beat it. A champion without either
(seeded, or promoted on the window-weighted figure alone, no segment held out
enough to count) takes the figures its first check measured (with their
margins) as its baseline; they then stay (a sample of the whole window, with
margins, is better evidence than the gate's held-out figures). That first check
trains a seeded champion, never judged on any traffic; a promoted one only when
a segment is far below its best beyond the margin of error (new traffic).

The rule (:func:`judge_drift`, a pure function): only segments holding at least
``min_share`` of the window's tokens count. A known segment has drifted when it
fell more than ``tolerance`` below its baseline; a segment the baseline does
not know (new traffic) has drifted when the champion serves it more than
``tolerance`` below the average of the baseline's segments. No segment is held
above its *ceiling*, the acceptance its requests' output lengths allow a draft that
is never wrong: traffic the target answers in a token or two cannot drift, and
training on it is spent in vain. The champion is
measured on a sample of the window, so a fall counts only beyond its margin of
error (``margins``, one-sided 95%, combined with the baseline's own when it was
measured on a sample too): a segment of three requests that the champion serves
at 2.0 against a baseline of 2.2 is noise, not drift. Segments are judged alone,
and the window as a whole too (:func:`judge_window`): every request held to its
segment's reference, so a shift spread over segments too small to judge alone is
seen (a new language's first window fell 0.57 and 1.70 on two clusters, each within
its margin of 0.53 and 1.66, and read as "no drift"). No drift either way: the
cycle records "no drift", moves the watermark and trains nothing.

A champion that the gate promoted for a large gain is the exception
(:func:`still_learning`): it was fitted on one window of traffic that is new to
the fleet, and it serves the next window of that traffic as well as it served
the last, so the drift rule would stop adapting it at the level one window
reaches. The first check after such a promotion trains once more (if it found
no drift; drift trains anyway); the chain stops as soon as a cycle gains less
(rejected, its best checkpoint the parent, or promoted for a smaller gain).
"""

from __future__ import annotations

__all__ = [
    "DriftVerdict",
    "capped_reference",
    "carried_gain",
    "judge_drift",
    "judge_window",
    "pooled_gain",
    "still_learning",
]

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from tide_lib.evaluation.offline import fall_below

if TYPE_CHECKING:
    from tide_lib.evaluation.gate import GateDecision


@dataclasses.dataclass(frozen=True)
class DriftVerdict:
    drift: bool
    reason: str
    drifted: dict[str, float]  # segment -> how far it fell below its reference


def _reference_of_new_segments(baseline: dict[str, float]) -> float:
    return sum(baseline.values()) / len(baseline)


def capped_reference(reference: float, ceiling: float | None) -> float:
    """What a segment is held to: its reference, or its acceptance ceiling when that
    is lower (None: not known; 0.0: no request with a token to verify, nothing to hold)."""
    return reference if ceiling is None else min(reference, ceiling)


def judge_drift(
    measured: dict[str, float],
    shares: dict[str, float],
    baseline: dict[str, float],
    *,
    tolerance: float,
    min_share: float,
    margins: Mapping[str, float] | None = None,
    baseline_margins: Mapping[str, float] | None = None,
    ceilings: Mapping[str, float] | None = None,
) -> DriftVerdict:
    """Drift or not; ``measured``/``baseline`` map segment -> acceptance length at one k,
    ``margins``/``baseline_margins`` segment -> margin of error of each figure (none:
    exact). Two independent samples: the fall's margin is the root of their squares.
    ``ceilings``: segment -> the most any draft can reach on the window's requests
    (:func:`~tide_lib.evaluation.offline.acceptance_ceiling`); a segment is held to
    no more than that, so traffic answered in a token or two is never drift."""
    if not baseline:
        return DriftVerdict(True, "the champion has no baseline to compare with", {})
    counted = {s: v for s, v in measured.items() if shares.get(s, 0.0) >= min_share}
    if not counted:
        return DriftVerdict(
            True, f"no segment holds {min_share:.0%} of the window: cannot judge", {}
        )
    drifted: dict[str, float] = {}
    notes: list[str] = []
    for segment, value in sorted(counted.items()):
        known = segment in baseline
        reference = baseline[segment] if known else _reference_of_new_segments(baseline)
        what = "baseline" if known else "baseline average (new segment)"
        ceiling = capped_reference(reference, (ceilings or {}).get(segment))
        if ceiling < reference:
            what, reference = f"its ceiling (below the {what} {reference:.3f})", ceiling
        fall = reference - value
        margin = math.hypot(
            (margins or {}).get(segment, 0.0),
            (baseline_margins or {}).get(segment, 0.0) if known else 0.0,
        )
        notes.append(f"{segment} {value:.3f}{_plus_minus(margin)} vs {what} {reference:.3f}")
        if fall - margin > tolerance:
            drifted[segment] = fall
    if drifted:
        worst = max(drifted, key=drifted.__getitem__)
        return DriftVerdict(
            True,
            f"drift: {', '.join(sorted(drifted))} fell by more than {tolerance:.3f} "
            "beyond the margin of error "
            f"(worst {worst}, {drifted[worst]:.3f}); " + "; ".join(notes),
            drifted,
        )
    return DriftVerdict(
        False, f"no drift: every segment within {tolerance:.3f}; " + "; ".join(notes), {}
    )


def judge_window(
    per_request: Mapping[str, Sequence[tuple[int, int]]],
    references: Mapping[str, float],
    *,
    tolerance: float,
    reference_margins: Mapping[str, float] | None = None,
    nameable: Collection[str] | None = None,
) -> DriftVerdict:
    """Did the window as a whole fall? Each segment's requests (``(emitted, verify)``
    each) held to its reference (the figure :func:`judge_drift` holds it to), pooled as
    acceptance length is (:func:`~tide_lib.evaluation.offline.fall_below`): drift when
    the fall exceeds ``tolerance`` beyond its margin of error, combined with the
    references' own (``reference_margins``, weighted by each segment's verify steps).
    The segments named are those of ``nameable`` (all when None) that fell by more than
    ``tolerance``: a cycle relearns the older traffic of a segment named, and one
    request's fall is no reason to. Segments without a reference are left out."""
    held = {s: pairs for s, pairs in per_request.items() if s in references and pairs}
    fall, margin = fall_below([(references[s], pairs) for s, pairs in held.items()])
    verify = {s: sum(v for _, v in pairs) for s, pairs in held.items()}
    total = sum(verify.values())
    if not total:
        return DriftVerdict(False, "no request to judge the window on", {})
    weighted = [verify[s] / total * (reference_margins or {}).get(s, 0.0) for s in held]
    margin = math.hypot(margin, *weighted)
    moved = "fell" if fall >= 0 else "rose"
    summary = f"the window as a whole {moved} {abs(fall):.3f} against its segments' references"
    if not fall - margin > tolerance:  # NaN included: nothing to judge is no drift
        return DriftVerdict(False, f"{summary}{_plus_minus(margin)}", {})
    falls = {s: references[s] - sum(e for e, _ in held[s]) / verify[s] for s in held if verify[s]}
    drifted = {
        s: f for s, f in falls.items() if f > tolerance and (nameable is None or s in nameable)
    }
    named = ", ".join(sorted(drifted)) or "none measured well enough alone to name"
    return DriftVerdict(
        True,
        f"drift: {summary} (+/- {margin:.3f}), more than {tolerance:.3f} beyond the margin "
        f"of error; fell by more than {tolerance:.3f}: {named}",
        drifted,
    )


def _plus_minus(margin: float) -> str:
    if not margin:
        return ""
    return " (+/- inf: too few requests)" if math.isinf(margin) else f" (+/- {margin:.3f})"


def still_learning(
    promotion: GateDecision, *, min_gain: float, min_share: float
) -> dict[str, float]:
    """Segments a promotion gained at least ``min_gain`` on (segment -> gain): the gate's
    figures of the promoted draft against the draft it replaced, on segments the gate
    protected (measured on enough held-out traffic) that held ``min_share`` of the
    window's tokens. Empty when ``min_gain`` is 0 (the rule is off) or the decision was
    not a promotion over a measured champion."""
    gains = carried_gain(promotion, min_gain=min_gain, min_share=min_share)
    return {segment: gain for segment, gain in gains.items() if segment in promotion.protected}


def pooled_gain(promotion: GateDecision) -> float:
    """What a promotion gained on the window-weighted figure (0 if it was no promotion over
    a measured champion): the evidence of every held-out request together, for when no
    segment alone had enough to count for :func:`still_learning`."""
    if not promotion.promote or promotion.weighted_champion is None:
        return 0.0
    return promotion.weighted_challenger - promotion.weighted_champion


def carried_gain(promotion: GateDecision, *, min_gain: float, min_share: float) -> dict[str, float]:
    """The segments that carried a window-weighted gain (segment -> gain): those holding
    ``min_share`` of the window's tokens that the promoted draft serves at least
    ``min_gain`` better than the one it replaced, on however few held-out requests. Too
    thin alone to count for :func:`still_learning`, together they are what the promotion
    learned; the next cycle learns them from every window (their earlier requests too,
    not kept by distillation toward the draft that did not serve them), the rest of the
    window kept."""
    if min_gain <= 0 or not promotion.promote:
        return {}
    gains = {  # on the window's held-out requests, where the gate measured some
        segment: gain
        for segment, gain in promotion.gains().items()
        if promotion.weights.get(segment, 0.0) >= min_share
    }
    return {segment: gain for segment, gain in sorted(gains.items()) if gain >= min_gain}
