"""Train when there is headroom: traffic served well below what a draft reaches on it.

A cycle trains when some segment holding a real share of the window is served by
the champion well below an *estimate* of what a draft reaches on that traffic;
otherwise it records "no headroom" and spends nothing. The estimate never comes
from the champion's own figure there (a draft at 1.0 on traffic it never served
well has not "not drifted": it never fitted). It comes from what training did:

- a segment no cycle has trained on yet is estimated at its *ceiling*, what its
  requests' output lengths allow a draft that is never wrong: new traffic is
  probed by the next cycle, whatever the champion served before;
- once a cycle trained on it, at what was *reached* there (the most any draft
  reached: the champions measured on the windows, and the cycles' challengers) plus
  half the *last gain* a cycle made there: a learning curve that flattens. A cycle
  that gained a lot trains again; one that gained little (its best checkpoint the
  parent, or a challenger no better there) settles the segment at what the champion
  serves there, and leaves no headroom;
- a segment that falls below what was reached there has headroom again: drift is
  one case of it. No estimate exceeds the ceiling;
- a trial speaks for a segment only as far as the segment was trained on: once its
  share of the window has doubled since its last trial (a thin first sight of new
  traffic, then windows mostly of it), it is estimated at its ceiling again and
  probed, whatever that thin trial found.

Everything here is a pure function of one :class:`HeadroomState` and the
champion's figures on the window; :mod:`tide_lib.orchestration.drift_check` reads
and writes the state in the lake.
"""

from __future__ import annotations

__all__ = [
    "HeadroomState",
    "HeadroomVerdict",
    "SegmentFigure",
    "judge_headroom",
]


import dataclasses
import math
from collections.abc import Mapping

from pydantic import Field

from tide_lib.config import StrictModel

OUTGROWN = 2.0
"""A segment whose share of the window has grown this many times since its last trial
has outgrown what that trial found: it is probed again at its ceiling."""


class HeadroomState(StrictModel):
    """What the cycles learned of each segment, kept across cycles (one per target)."""

    reached: dict[str, float] = Field(default_factory=dict)
    """the most any draft reached on each segment (a lower bound: figure less its margin)"""
    last_gain: dict[str, float] = Field(default_factory=dict)
    """what the last cycle that trained on each segment gained there over its champion"""
    trial_share: dict[str, float] = Field(default_factory=dict)
    """each segment's share of the window its last trial trained on (absent: all of it)"""

    def estimate(self, segment: str, ceiling: float | None, share: float = 0.0) -> float:
        """What a draft reaches on ``segment``, ``share`` of the window now: its ``ceiling``
        (None: unknown, no bound) until a cycle trained on it, or again once its share has
        doubled since that trial; else what was reached there plus half the last gain."""
        bound = math.inf if ceiling is None else ceiling
        if segment not in self.last_gain:
            return bound
        if share >= OUTGROWN * self.trial_share.get(segment, 1.0):
            return bound
        return min(bound, self.reached.get(segment, 0.0) + max(self.last_gain[segment], 0.0) / 2)

    def with_reached(self, figures: Mapping[str, float]) -> HeadroomState:
        """This state with ``figures`` (segment -> a draft's lower bound) counted as reached."""
        reached = dict(self.reached)
        for segment, value in figures.items():
            if math.isfinite(value):
                reached[segment] = max(reached.get(segment, 0.0), value)
        return self.model_copy(update={"reached": reached})

    def after_trial(
        self,
        gains: Mapping[str, float],
        served: Mapping[str, float],
        tolerance: float,
        shares: Mapping[str, float] | None = None,
    ) -> HeadroomState:
        """This state after a cycle trained on the segments of ``gains`` (segment -> what
        its draft gained there over the champion, whose lower bound there was
        ``served``; ``shares``: each one's share of the window, all of it if absent). A
        segment gained ``tolerance`` or less on is *settled*: what was reached there
        becomes what the champion serves (a higher figure reached before, on other
        requests or by luck, would otherwise keep it training in vain)."""
        reached = dict(self.reached)
        for segment, gain in gains.items():
            lower = served.get(segment, math.nan)
            if gain <= tolerance and math.isfinite(lower):
                reached[segment] = lower
        trial = {s: (shares or {}).get(s, 1.0) for s in gains}
        return self.model_copy(
            update={
                "reached": reached,
                "last_gain": self.last_gain | dict(gains),
                "trial_share": self.trial_share | trial,
            }
        )


@dataclasses.dataclass(frozen=True)
class SegmentFigure:
    """The champion on one segment of the window: acceptance length, its one-sided 95%
    margin of error (inf: one request, no estimate), token share, and ceiling."""

    accept_length: float
    margin: float
    share: float
    ceiling: float | None = None

    @property
    def lower(self) -> float:
        return self.accept_length - self.margin


@dataclasses.dataclass(frozen=True)
class HeadroomVerdict:
    """Whether the cycle trains; the segments it learns (headroom) and keeps (the rest),
    each segment's estimate, and a sentence that says why."""

    train: bool
    reason: str
    learn: list[str]
    keep: list[str]
    estimates: dict[str, float]


def judge_headroom(
    window: Mapping[str, SegmentFigure],
    state: HeadroomState,
    *,
    tolerance: float,
    min_share: float,
) -> HeadroomVerdict:
    """Train when a segment holding ``min_share`` of the window, measured on two requests
    or more, lies more than ``tolerance`` beyond its margin of error below its estimate
    (:meth:`HeadroomState.estimate`). Thinner segments are learned with them when the
    cycle trains (their traffic is what the cycle exists for), never a reason alone."""
    estimates = {s: state.estimate(s, f.ceiling, f.share) for s, f in window.items()}
    headroom = {s: estimates[s] - f.accept_length for s, f in window.items()}
    counted = {s for s, f in window.items() if f.share >= min_share and math.isfinite(f.margin)}
    room = sorted(s for s in counted if headroom[s] - window[s].margin > tolerance)
    notes = "; ".join(
        f"{s} {f.accept_length:.3f} (+/- {f.margin:.3f}, {f.share:.0%}) of {estimates[s]:.3f}"
        for s, f in sorted(window.items())
    )
    if not room:
        why = f"no headroom: no segment of {min_share:.0%} of the window or more lies "
        return HeadroomVerdict(
            False, f"{why}more than {tolerance:.3f} below its estimate; {notes}", [], [], estimates
        )
    thin = sorted(s for s in window if s not in counted and headroom[s] > tolerance)
    learn = sorted({*room, *thin})
    keep = sorted(set(window) - set(learn))
    why = f"headroom on {', '.join(room)} (more than {tolerance:.3f} below its estimate)"
    return HeadroomVerdict(True, f"training: {why}; {notes}", learn, keep, estimates)
