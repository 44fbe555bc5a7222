"""The promotion gate: a challenger is promoted only on measured acceptance length.

Rules, in order:
1. No champion yet: the first valid challenger wins.
2. On the recent traffic the challenger must beat the champion by ``margin``
   (absolute acceptance length).
3. On every older segment it must not fall by more than ``tolerance``.
4. The traffic-weighted acceptance length (segments weighted by their share of
   current traffic) must not fall either: a gain on a sliver of traffic cannot
   pay for a loss on most of it.

The decision carries its figures; :func:`decision_tags` turns it into MLflow
version tags (``tide.gate.*``), :func:`decision_from_tags` reads it back (a
rerun of a cycle reuses it) and :func:`decision_report` makes a short readable
report.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tide_lib.config import GateConfig

__all__ = ["GateDecision", "decide", "decision_from_tags", "decision_report", "decision_tags"]

_EPSILON = 1e-9  # figures at a threshold pass it, whatever float rounding did to them


@dataclasses.dataclass(frozen=True)
class GateDecision:
    promote: bool
    reason: str
    challenger: dict[str, float]
    champion: dict[str, float] | None
    weights: dict[str, float]
    weighted_challenger: float
    weighted_champion: float | None


def _weighted(figures: dict[str, float], weights: dict[str, float]) -> float:
    total = sum(weights.get(segment, 0.0) for segment in figures)
    if total <= 0:
        return sum(figures.values()) / len(figures)
    return sum(value * weights.get(segment, 0.0) for segment, value in figures.items()) / total


def decide(
    challenger: dict[str, float],
    champion: dict[str, float] | None,
    config: GateConfig,
    weights: dict[str, float] | None = None,
) -> GateDecision:
    """Promote or not; ``challenger``/``champion`` map segment -> acceptance length at k."""
    if config.recent_segment not in challenger:
        raise ValueError(
            f"the challenger has no figure for the recent segment {config.recent_segment!r}; "
            f"segments: {sorted(challenger)}"
        )
    shares = weights or dict.fromkeys(challenger, 1.0)
    weighted_challenger = _weighted(challenger, shares)

    def verdict(promote: bool, reason: str, weighted_champion: float | None = None) -> GateDecision:
        return GateDecision(
            promote,
            reason,
            dict(challenger),
            dict(champion) if champion else None,
            shares,
            weighted_challenger,
            weighted_champion,
        )

    if not champion:
        return verdict(True, "no champion yet: the first valid challenger wins")
    weighted_champion = _weighted({s: champion[s] for s in challenger if s in champion}, shares)
    recent = config.recent_segment
    gain = challenger[recent] - champion.get(recent, 0.0)
    if gain < config.margin - _EPSILON:
        return verdict(
            False,
            f"recent traffic: {challenger[recent]:.3f} vs champion {champion.get(recent, 0.0):.3f} "
            f"(gain {gain:+.3f} < margin {config.margin:.3f})",
            weighted_champion,
        )
    for segment, value in sorted(challenger.items()):
        if segment == recent or segment not in champion:
            continue
        drop = champion[segment] - value
        if drop > config.tolerance + _EPSILON:
            return verdict(
                False,
                f"older traffic {segment!r}: {value:.3f} vs champion {champion[segment]:.3f} "
                f"(drop {drop:.3f} > tolerance {config.tolerance:.3f})",
                weighted_champion,
            )
    if weighted_challenger < weighted_champion - _EPSILON:
        return verdict(
            False,
            f"traffic-weighted acceptance length falls: {weighted_challenger:.3f} vs "
            f"{weighted_champion:.3f}",
            weighted_champion,
        )
    return verdict(
        True,
        f"recent traffic +{gain:.3f} (>= margin {config.margin:.3f}); no older segment drops "
        f"by more than {config.tolerance:.3f}; weighted {weighted_challenger:.3f} "
        f"vs {weighted_champion:.3f}",
        weighted_champion,
    )


def decision_tags(decision: GateDecision, k: int) -> dict[str, str]:
    """MLflow version tags of a decision (``tide.gate.*``, ``tide.al.<segment>.k<k>``)."""
    tags = {
        "tide.gate.reason": decision.reason,
        "tide.gate.weighted_accept_length": f"{decision.weighted_challenger:.4f}",
    }
    if decision.weighted_champion is not None:
        tags["tide.gate.weighted_champion_accept_length"] = f"{decision.weighted_champion:.4f}"
    for segment, value in decision.challenger.items():
        tags[f"tide.al.{segment}.k{k}"] = f"{value:.4f}"
    if decision.champion:
        for segment, value in decision.champion.items():
            tags[f"tide.gate.champion_al.{segment}.k{k}"] = f"{value:.4f}"
    for segment, share in decision.weights.items():
        tags[f"tide.gate.weight.{segment}"] = f"{share:.4f}"
    tags["tide.gate.decision"] = "promote" if decision.promote else "reject"  # last: it marks
    return tags  # the record complete for decision_from_tags


def decision_from_tags(tags: dict[str, str], k: int) -> GateDecision | None:
    """The decision :func:`decision_tags` recorded, read back; ``None`` if none was recorded.

    Tags are written in order with ``tide.gate.decision`` last, so a version that has it
    holds the whole record; one without (never judged, or judging died midway) is judged anew.
    """
    if "tide.gate.decision" not in tags:
        return None

    def by_segment(prefix: str, suffix: str = "") -> dict[str, float]:
        return {
            key[len(prefix) : len(key) - len(suffix)]: float(value)
            for key, value in tags.items()
            if key.startswith(prefix) and key.endswith(suffix)
        }

    challenger = by_segment("tide.al.", f".k{k}")
    weighted_champion = tags.get("tide.gate.weighted_champion_accept_length")
    return GateDecision(
        promote=tags["tide.gate.decision"] == "promote",
        reason=tags["tide.gate.reason"],
        challenger=challenger,
        champion=by_segment("tide.gate.champion_al.", f".k{k}") or None,
        weights=by_segment("tide.gate.weight.") or dict.fromkeys(challenger, 1.0),
        weighted_challenger=float(tags["tide.gate.weighted_accept_length"]),
        weighted_champion=float(weighted_champion) if weighted_champion is not None else None,
    )


def decision_report(decision: GateDecision, k: int, names: dict[str, Any] | None = None) -> str:
    """A short Markdown report of the decision and its figures."""
    names = names or {}
    lines = [
        f"# Gate: {'PROMOTE' if decision.promote else 'REJECT'} "
        f"{names.get('challenger', 'challenger')}",
        "",
        decision.reason,
        "",
        f"| segment | share | challenger (k={k}) | champion |",
        "| --- | --- | --- | --- |",
    ]
    for segment, value in sorted(decision.challenger.items()):
        champion = decision.champion.get(segment) if decision.champion else None
        champion_text = f"{champion:.3f}" if champion is not None else "-"
        share = decision.weights.get(segment, 0.0)
        lines.append(f"| {segment} | {share:.2f} | {value:.3f} | {champion_text} |")
    return "\n".join(lines) + "\n"
