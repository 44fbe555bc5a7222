"""The traffic-weighted trade: the one rule that weighs what a draft gains against what it loses.

The gate (a challenger against the champion) and the trainer (a step against its
parent) both judge with it, on the same held-out requests, so the step a run keeps is
one the gate would promote. Two parts:

- **The gain.** Each segment's gain counts by its share of current traffic (the
  window's tokens): a step that gains a lot on most of the traffic while losing a
  little on a small share gains. It must reach ``gate.margin``
  (:func:`~tide_lib.evaluation.gate.weighted_figure`).
- **The floor.** A segment may end below its best served acceptance (the best of the
  drafts measured on its requests: the champion's, the floor draft's) by at most
  ``gate.max_loss`` times one minus its share of current traffic, of that best:
  traffic that no longer arrives keeps ``1 - max_loss`` of its best, and a segment's
  floor tightens towards its best as its share of the window grows. A loss counts only
  beyond its margin of error (paired on the same requests, one-sided 95%), and only
  where the challenger also falls below the reference: a segment the reference already
  serves below its floor only may not fall further. The floor does not move with
  each promotion's small losses when a floor draft is measured (``gate.floor``).
"""

from __future__ import annotations

__all__ = ["SegmentTrade", "below_floor", "floor_of"]

import dataclasses
from collections.abc import Mapping

_EPSILON = 1e-9  # a figure at its floor passes it, whatever float rounding did


def floor_of(best: float, share: float, max_loss: float) -> float:
    """The least acceptance length a segment may end at: ``best`` less ``max_loss`` times
    one minus its ``share`` of current traffic (clamped to [0, 1]), of ``best``."""
    return best * (1.0 - max_loss * (1.0 - min(max(share, 0.0), 1.0)))


@dataclasses.dataclass(frozen=True)
class SegmentTrade:
    """One segment's evidence: the reference's and the challenger's acceptance length on
    the same held-out requests, the margin of error of the challenger's drop, its share
    of current traffic, and the best served figure there (``None``: the reference's)."""

    share: float
    before: float
    after: float
    margin: float = 0.0
    best: float | None = None

    def floor(self, max_loss: float) -> float:
        best = self.before if self.best is None else max(self.best, self.before)
        return floor_of(best, self.share, max_loss)

    def shortfall(self, max_loss: float) -> float | None:
        """How far beyond its margin of error the challenger ends below both its floor
        and the reference; None when it does not."""
        bound = min(self.floor(max_loss), self.before)
        short = bound - self.after - self.margin
        return short if short > _EPSILON else None

    def describe(self, name: str, max_loss: float) -> str:
        best = "" if self.best is None else f", best served {max(self.best, self.before):.3f}"
        noise = f" beyond its margin of error {self.margin:.3f}" if self.margin else ""
        floor = self.floor(max_loss)
        bound = (
            f"below its floor {floor:.3f}"
            if floor <= self.before
            else f"below its floor {floor:.3f} and the reference"
        )
        return (
            f"segment {name!r} ({self.share:.0%} of current traffic): {self.after:.3f} vs "
            f"{self.before:.3f}{best}, {bound}{noise} "
            f"(gate.max_loss {max_loss:.3f} of its best, scaled by 1 - share)"
        )


def below_floor(trades: Mapping[str, SegmentTrade], max_loss: float) -> str | None:
    """Why a challenger loses too much (the first segment below its floor, the largest
    shortfall first), or None when every segment keeps its floor."""
    short = {name: trade.shortfall(max_loss) for name, trade in trades.items()}
    fallen = sorted((s, name) for name, s in short.items() if s is not None)
    if not fallen:
        return None
    name = fallen[-1][1]
    return trades[name].describe(name, max_loss)
