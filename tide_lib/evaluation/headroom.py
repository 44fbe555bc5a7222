"""Train when there is headroom: traffic served well below what a draft reaches on it.

A cycle trains when some segment holding a real share of the window is served by
the champion well below an *estimate* of what a draft reaches on that traffic;
otherwise it records "no headroom" and spends nothing. The estimate never comes
from the champion's own failure there (a draft at 1.0 on traffic it never served
well has not "not drifted": it never fitted):

- ``reached``: the most any draft reached on the segment: the champions measured on
  the windows, and the challengers a cycle trained (each cycle's training is a probe
  of what the traffic allows);
- a segment no cycle has tried in vain is also credited the most reached on any
  segment (*the prior*): traffic is assumed as learnable as the best served until a
  cycle tried it and gained nothing;
- no segment is held above its *ceiling*, what its requests' output lengths allow a
  draft that is never wrong.

So a new language trains from its first window and keeps training while cycles
gain on it; a cycle that trains on it and gains nothing (its best checkpoint the
parent, or a challenger no better there) marks it *tried*, and its estimate falls
back to what was reached there, until a later cycle gains on it. A segment that
falls below what was reached there has headroom too: drift is one case of it.

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


class HeadroomState(StrictModel):
    """What the cycles learned of each segment, kept across cycles (one per target)."""

    reached: dict[str, float] = Field(default_factory=dict)
    """the most any draft reached on each segment (a lower bound: figure less its margin)"""
    tried: dict[str, str] = Field(default_factory=dict)
    """segment -> the champion version under which a cycle trained on it and gained nothing
    (until a later cycle gains on it)"""

    def estimate(self, segment: str, ceiling: float | None = None) -> float:
        """What a draft reaches on ``segment``: the most reached there, or, untried, the
        most reached on any segment; at most ``ceiling``."""
        own = self.reached.get(segment, 0.0)
        prior = max(self.reached.values(), default=0.0)
        value = own if segment in self.tried else max(own, prior)
        return value if ceiling is None else min(value, ceiling)

    def with_reached(self, figures: Mapping[str, float]) -> HeadroomState:
        """This state with ``figures`` (segment -> a draft's lower bound) counted as reached."""
        reached = dict(self.reached)
        for segment, value in figures.items():
            if math.isfinite(value):
                reached[segment] = max(reached.get(segment, 0.0), value)
        return self.model_copy(update={"reached": reached})

    def after_trial(
        self, gains: Mapping[str, float], champion: str, tolerance: float
    ) -> HeadroomState:
        """This state after a cycle trained on the segments of ``gains`` (segment -> what its
        best draft gained there over ``champion``): one gained on is untried again (there is
        more to learn), one gained ``tolerance`` or less on is tried in vain."""
        tried = {s: v for s, v in self.tried.items() if gains.get(s, 0.0) <= tolerance}
        tried |= {s: champion for s, gain in gains.items() if gain <= tolerance}
        return self.model_copy(update={"tried": tried})


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
    estimates = {s: state.estimate(s, f.ceiling) for s, f in window.items()}
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
