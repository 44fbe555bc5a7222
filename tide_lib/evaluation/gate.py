"""The promotion gate: a challenger is promoted only on measured acceptance length.

Segments are the traffic's own (client labels, else clusters of the target's
states, see :mod:`tide_lib.evaluation.segments`), each measured on held-out
requests of the window and of the older traffic in the lookback. Rules, in order:

1. No champion yet: the first valid challenger wins.
2. No protected segment may fall by more than ``tolerance`` (absolute acceptance
   length). A segment is protected when its token share of the window, or of the
   older traffic, reaches ``min_segment_share``: traffic that stopped arriving is
   still protected while it is in the lookback. A cycle without older traffic
   (the first) protects every segment it has data for. Either way a segment needs
   ``min_segment_tokens`` held-out output tokens: the figure of two short requests
   is noise, and would block every promotion by chance. And the drop must exceed
   the tolerance by its one-sided 95% margin of error (Student's t over the held-out
   requests, both drafts replayed on the same ones, see :func:`drop_margin`).
   Traffic to keep is also judged together, its held-out requests pooled, once
   together it reaches ``min_segment_tokens``: older traffic (the clusters split it
   into parts, some too thin to protect alone), and segments the champion already
   serves better than the window as a whole (by more than the tolerance). Pooled,
   a loss spread over the parts is measured on all their requests, with a smaller
   margin of error than any part's (the window's other segments are left out: they
   are what the challenger learns, and their gain would hide the loss).
3. No protected segment may end more than ``tolerance`` (beyond its margin of error)
   below the floor draft (the registry's ``baseline`` alias, see ``gate.floor``)
   while also falling below the champion. Rule 2 compares with the champion alone, so
   a run of promotions that each lose a little within the tolerance would add up to
   a loss no single gate saw; the floor does not move with them. A segment already
   below the floor under the champion only needs not to fall further.
4. The acceptance length weighted by each segment's share of the window's tokens
   must gain at least ``margin``: the challenger has to pay off on what the fleet
   serves now. Each segment's figure here is measured on the window's held-out
   requests alone when they hold ``min_segment_tokens`` output tokens
   (``window_figures``; fewer are noise): a segment's older requests
   (Korean chat in the cluster that Korean law joined) would dilute the gain on
   what the window brought.

5. With ``net_gain``, the traffic to keep, judged together (rule 2), may not lose more
   than the window gains (rule 4's gain, point estimates, and never less than the
   tolerance). Rule 2 rejects only a loss beyond its margin of error, and on the few
   older requests a window holds that margin is wide: in the demo, cycles sent to go
   on learning Korean were promoted for +0.069 and +0.131 window-weighted while
   English, judged together, fell 3.060 -> 2.667 at k=4 (the benchmark's held-out
   English 3.40 -> 2.70 and 3.02 -> 2.83 at k=5).

The decision carries its figures; :func:`decision_tags` turns it into MLflow
version tags (``tide.gate.*``, ``tide.al.*``; every name is built here),
:func:`decision_from_tags` reads it back (a rerun of a cycle reuses it) and
:func:`decision_report` makes a short readable report.
"""

from __future__ import annotations

__all__ = [
    "GateDecision",
    "PooledFigures",
    "decide",
    "decision_from_tags",
    "decision_metrics",
    "decision_report",
    "decision_tags",
    "protected_segments",
    "t95",
    "weighted_figure",
]

import dataclasses
import json
import math
import re
from collections.abc import Callable
from typing import Any, Final

from tide_lib.config import GateConfig
from tide_lib.names import Tags

# One-sided 95% quantiles of Student's t by degrees of freedom (held-out requests - 1):
# a drop rejects (or, in the trainer, counts as forgetting) only beyond its margin.
_T95: Final = {
    1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860,
    9: 1.833, 10: 1.812, 15: 1.753, 20: 1.725, 30: 1.697, 60: 1.671, 120: 1.658,
}  # fmt: skip


def t95(degrees: int) -> float:
    """Student's t one-sided 95% quantile; between tabulated points, that of the
    fewer degrees (the larger, stricter margin)."""
    if degrees < 1:
        return math.inf
    return _T95[max(df for df in _T95 if df <= degrees)]


_EPSILON = 1e-9  # figures at a threshold pass it, whatever float rounding did to them

# Every MLflow tag the gate writes; ``tide.al.<segment>.k<k>`` is the design's per-segment figure.


@dataclasses.dataclass(frozen=True)
class GateDecision:
    """The verdict and what it was judged on (figures at the gate's k unless ``by_k``)."""

    promote: bool
    reason: str
    challenger: dict[str, float]
    champion: dict[str, float] | None
    weights: dict[str, float]  # share of the window's tokens per segment
    weighted_challenger: float
    weighted_champion: float | None
    older_shares: dict[str, float] = dataclasses.field(default_factory=dict)
    protected: tuple[str, ...] = ()
    # Traffic to keep judged together (its requests pooled), thin parts or not.
    protected_together: tuple[str, ...] = ()
    # Figures at the other ks evaluated, for the record: {k: {segment: acceptance length}}.
    challenger_by_k: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    champion_by_k: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    # The floor draft's figures at the gate's k (rule 3); None: judged without a floor.
    floor: dict[str, float] | None = None
    floor_version: str | None = None
    # Figures on the window's held-out requests alone (rule 4's), where a segment has some.
    window_challenger: dict[str, float] = dataclasses.field(default_factory=dict)
    window_champion: dict[str, float] = dataclasses.field(default_factory=dict)

    def gains(self) -> dict[str, float]:
        """Each segment's gain over the champion (none without one): on the window's
        held-out requests where both drafts were measured on some, else on all."""
        if not self.champion:
            return {}
        after, before = _window_preferred(
            self.challenger, self.champion, self.window_challenger, self.window_champion
        )
        return {s: value - before[s] for s, value in after.items() if s in before}


def _window_preferred(
    challenger: dict[str, float],
    champion: dict[str, float],
    window_challenger: dict[str, float],
    window_champion: dict[str, float],
) -> tuple[dict[str, float], dict[str, float]]:
    """Challenger and champion figures, each segment's on the window's held-out requests
    where both drafts were measured on some (rule 4's), else on all its requests."""
    both = window_challenger.keys() & window_champion.keys()
    return (
        {**challenger, **{s: window_challenger[s] for s in both}},
        {**champion, **{s: window_champion[s] for s in both}},
    )


PooledFigures = Callable[[tuple[str, ...]], tuple[float, float, float]]
"""Segments -> ``(champion, challenger, margin of error of the drop)``, their held-out
requests pooled (both drafts replayed on the same ones)."""


def weighted_figure(figures: dict[str, float], weights: dict[str, float]) -> float:
    """Segments' figures weighted by ``weights`` (their shares of the window's tokens):
    the gate's window-weighted acceptance length; equal weights where none has one."""
    if not figures:
        return 0.0
    total = sum(weights.get(segment, 0.0) for segment in figures)
    if total <= 0:
        return sum(figures.values()) / len(figures)
    return sum(value * weights.get(segment, 0.0) for segment, value in figures.items()) / total


def protected_segments(
    segments: list[str],
    weights: dict[str, float],
    older_shares: dict[str, float],
    min_share: float,
) -> tuple[str, ...]:
    """Segments whose share the tolerance protects: share of window or of older traffic
    >= ``min_share``. Without older traffic (a first cycle) every segment with figures.

    :func:`decide` then keeps those measured on enough held-out traffic.
    """
    if not older_shares:
        return tuple(sorted(segments))
    return tuple(
        sorted(
            segment
            for segment in segments
            if max(weights.get(segment, 0.0), older_shares.get(segment, 0.0))
            >= min_share - _EPSILON
        )
    )


def _forgotten(
    protected: tuple[str, ...],
    challenger: dict[str, float],
    champion: dict[str, float],
    *,
    margins: dict[str, float],
    tolerance: float,
    shares: tuple[dict[str, float], dict[str, float]],
) -> str | None:
    """Why the challenger forgot a protected segment (a drop beyond the tolerance and its
    margin of error), or None if it forgot none."""
    for segment in protected:
        if segment not in champion:
            continue
        drop, margin = champion[segment] - challenger[segment], margins.get(segment, 0.0)
        if drop - margin > tolerance + _EPSILON:
            noise = f" + margin of error {margin:.3f}" if margin else ""
            return (
                f"segment {segment!r} ({_share_text(segment, *shares)}): "
                f"{challenger[segment]:.3f} vs champion {champion[segment]:.3f} "
                f"(drop {drop:.3f} > tolerance {tolerance:.3f}{noise})"
            )
    return None


def _below_floor(
    protected: tuple[str, ...],
    challenger: dict[str, float],
    champion: dict[str, float],
    floor: dict[str, float],
    *,
    margins: dict[str, float],
    champion_margins: dict[str, float],
    tolerance: float,
) -> str | None:
    """Why the challenger ends a protected segment below the floor draft (more than the
    tolerance beyond its margin of error, and below the champion beyond that drop's
    margin of error too: a segment the champion already serves below the floor only
    must not fall further), or None."""
    for segment in protected:
        if segment not in floor or segment not in champion:
            continue
        drop, margin = floor[segment] - challenger[segment], margins.get(segment, 0.0)
        fell = champion[segment] - challenger[segment] > champion_margins.get(segment, 0.0)
        if drop - margin > tolerance + _EPSILON and fell:
            noise = f" + margin of error {margin:.3f}" if margin else ""
            return (
                f"segment {segment!r}: {challenger[segment]:.3f} vs floor {floor[segment]:.3f} "
                f"(drop {drop:.3f} > tolerance {tolerance:.3f}{noise}; champion "
                f"{champion[segment]:.3f}): small losses would add up"
            )
    return None


@dataclasses.dataclass(frozen=True)
class _Together:
    """Segments of traffic to keep judged together: which, their figures, why they were
    forgotten (None: they were not). Nothing judged: all empty."""

    judged: tuple[str, ...] = ()
    figures: str = ""
    forgotten: str | None = None
    # rule 5's evidence: champion minus challenger on the traffic to keep, pooled (a point
    # estimate; also for a pool of one segment judged alone by rule 2), and its figures
    drop: float = 0.0
    measured: str = ""


def _forgotten_together(
    shared: tuple[str, ...],
    thin: list[str],
    champion: dict[str, float],
    tokens: dict[str, int] | None,
    pooled: PooledFigures | None,
    *,
    config: GateConfig,
    shares: tuple[dict[str, float], dict[str, float]],
    weighted_champion: float,
) -> _Together:
    """Traffic to keep among the ``shared`` segments (protected by their share), judged
    together once its held-out output tokens reach ``min_segment_tokens``, whether or not
    each part is protected alone too (``thin``: those that are not): segments protected
    by their share of the older traffic alone, and those the champion already serves
    better than the window as a whole (``weighted_champion``, by more than the
    tolerance). A segment of the window the champion serves no better is what the
    challenger was trained to learn: pooled, its gain would hide what the others lost.
    A pool of one segment protected alone is judged alone only (rule 2), but its drop
    still counts for rule 5."""
    window, older = shares
    floor = config.min_segment_share - _EPSILON
    judged = tuple(
        segment
        for segment in shared
        if segment in champion
        and (
            (older.get(segment, 0.0) >= floor and window.get(segment, 0.0) < floor)
            or champion[segment] > weighted_champion + config.tolerance
        )
    )
    if pooled is None or tokens is None or not judged:
        return _Together()
    if sum(tokens.get(segment, 0) for segment in judged) < config.min_segment_tokens:
        return _Together()
    before, after, margin = pooled(judged)
    drop = before - after
    if len(judged) == 1 and judged[0] not in thin:  # rule 2 judged it alone already
        measured = f"{judged[0]} {after:.3f} vs champion {before:.3f}"
        return _Together(drop=drop, measured=measured)
    figures = f"{', '.join(judged)} together {after:.3f} vs champion {before:.3f}"
    if drop - margin <= config.tolerance + _EPSILON:
        within = (
            f"{figures}: no drop beyond the tolerance"
            if drop <= config.tolerance + _EPSILON
            else f"{figures}: no drop beyond the tolerance + margin of error {margin:.3f}"
        )
        return _Together(judged, within, drop=drop, measured=figures)
    return _Together(
        judged,
        figures,
        f"traffic to keep, judged together: {figures} "
        f"(drop {drop:.3f} > tolerance {config.tolerance:.3f} + margin of error {margin:.3f})",
        drop,
        figures,
    )


def decide(
    challenger: dict[str, float],
    champion: dict[str, float] | None,
    config: GateConfig,
    weights: dict[str, float] | None = None,
    older_shares: dict[str, float] | None = None,
    *,
    held_out_tokens: dict[str, int] | None = None,
    drop_margins: dict[str, float] | None = None,
    pooled: PooledFigures | None = None,
    floor: dict[str, float] | None = None,
    floor_margins: dict[str, float] | None = None,
    window_figures: tuple[dict[str, float], dict[str, float]] | None = None,
) -> GateDecision:
    """Promote or not; ``challenger``/``champion`` map segment -> acceptance length at k.

    ``weights`` are the segments' shares of the window's tokens (equal when not
    given: every segment then counts alike and is protected); ``older_shares`` their
    shares of the older traffic (none: a first cycle); ``held_out_tokens`` the output
    tokens each figure was measured on (not given: every figure counts as measured);
    ``drop_margins`` the one-sided 95% margin of error of each segment's drop, champion
    and challenger replayed on the same requests
    (:func:`~tide_lib.evaluation.offline.drop_margin`): a drop rejects only beyond it;
    ``pooled`` measures segments of traffic to keep together (none: they are not);
    ``floor`` the floor draft's figures on the same requests (rule 3; none: no floor) and
    ``floor_margins`` the margins of error of the challenger's drops below it;
    ``window_figures`` the challenger's and the champion's figures on the window's
    held-out requests alone, by segment: the weighted gain (rule 4) uses them where
    a segment has them (the figures above elsewhere).
    """
    if not challenger:
        raise ValueError("the challenger has no figures: no held-out traffic was evaluated")
    shares = dict(weights) if weights else dict.fromkeys(challenger, 1.0)
    older = dict(older_shares or {})
    on_window, champion_on_window = window_figures or ({}, {})
    weighted_challenger = weighted_figure({**challenger, **on_window}, shares)
    shared = protected_segments(list(challenger), shares, older, config.min_segment_share)
    tokens = held_out_tokens
    protected, thin = _evidenced(shared, tokens, config.min_segment_tokens)

    def verdict(
        promote: bool,
        reason: str,
        weighted_champion: float | None = None,
        together: tuple[str, ...] = (),
    ) -> GateDecision:
        return GateDecision(
            promote,
            reason,
            dict(challenger),
            dict(champion) if champion else None,
            shares,
            weighted_challenger,
            weighted_champion,
            older,
            protected,
            together,
            floor=dict(floor) if floor else None,
            window_challenger=dict(on_window),
            window_champion=dict(champion_on_window),
        )

    if not champion:
        return verdict(True, "no champion yet: the first valid challenger wins")
    # the gain on what the window brought: window figures where both drafts have them
    gain_challenger, gain_champion = _window_preferred(
        challenger, champion, on_window, champion_on_window
    )
    common = {s: v for s, v in gain_challenger.items() if s in gain_champion}
    weighted_champion = weighted_figure({s: gain_champion[s] for s in common}, shares)
    weighted_common = weighted_figure(common, shares)
    forgotten = _forgotten(
        protected,
        challenger,
        champion,
        margins=drop_margins or {},
        tolerance=config.tolerance,
        shares=(shares, older),
    )
    together = _forgotten_together(
        shared,
        thin,
        gain_champion,  # served well or not: on the window's requests where it has some
        tokens,
        pooled,
        config=config,
        shares=(shares, older),
        weighted_champion=weighted_champion,
    )
    below = _below_floor(
        protected,
        challenger,
        champion,
        floor or {},
        margins=floor_margins or {},
        champion_margins=drop_margins or {},
        tolerance=config.tolerance,
    )
    if forgotten or together.forgotten or below:
        why = forgotten or together.forgotten or below or ""
        return verdict(False, why, weighted_champion, together.judged)
    promote, reason = _gain_verdict(
        config, (weighted_common, weighted_champion), together, protected, thin
    )
    return verdict(promote, reason, weighted_champion, together.judged)


def _gain_verdict(
    config: GateConfig,
    weighted: tuple[float, float],
    together: _Together,
    protected: tuple[str, ...],
    thin: list[str],
) -> tuple[bool, str]:
    """Rules 4 and 5, once nothing protected is forgotten: the window-weighted gain
    (``weighted``: challenger, champion) must reach ``gate.margin``, and traffic to keep,
    pooled, may not lose more than both the tolerance and that gain (``gate.net_gain``)."""
    challenger, champion = weighted
    gain = challenger - champion
    if gain < config.margin - _EPSILON:
        return False, (
            f"window-weighted acceptance length: {challenger:.3f} vs champion "
            f"{champion:.3f} (gain {gain:+.3f} < margin {config.margin:.3f})"
        )
    if config.net_gain and together.drop > max(config.tolerance, gain) + _EPSILON:
        return False, (
            f"traffic to keep loses more than the window gains: {together.measured} (drop "
            f"{together.drop:.3f} > window-weighted gain {gain:+.3f} and tolerance "
            f"{config.tolerance:.3f})"
        )
    return True, (
        f"window-weighted acceptance length {challenger:.3f} vs champion "
        f"{champion:.3f} (gain {gain:+.3f} >= margin {config.margin:.3f}); no "
        f"protected segment ({', '.join(protected) or 'none'}) drops by more than "
        f"{config.tolerance:.3f}{_unjudged(thin, together.figures)}"
    )


def _evidenced(
    shared: tuple[str, ...], tokens: dict[str, int] | None, min_tokens: int
) -> tuple[tuple[str, ...], list[str]]:
    """``shared`` segments split into those measured on ``min_tokens`` held-out output
    tokens (protected alone; all when the tokens are not given) and the thin rest."""
    protected = tuple(s for s in shared if tokens is None or tokens.get(s, 0) >= min_tokens)
    return protected, [segment for segment in shared if segment not in protected]


def _unjudged(thin: list[str], together: str) -> str:
    """What a promotion's reason says of the segments too thin to protect alone."""
    if not thin:
        return ""
    alone = f"; too little held-out traffic to protect: {', '.join(thin)}"
    return f"{alone} ({together})" if together else alone


def _share_text(segment: str, shares: dict[str, float], older: dict[str, float]) -> str:
    text = f"{shares.get(segment, 0.0):.0%} of the window"
    if older:
        text += f", {older.get(segment, 0.0):.0%} of older traffic"
    return text


def decision_tags(decision: GateDecision, k: int) -> dict[str, str]:
    """MLflow version tags of a decision (``tide.gate.*``, ``tide.al.<segment>.k<k>``)."""
    tags = {
        Tags.REASON: decision.reason,
        Tags.WEIGHTED: f"{decision.weighted_challenger:.4f}",
        Tags.PROTECTED: json.dumps(list(decision.protected)),
        Tags.PROTECTED_TOGETHER: json.dumps(list(decision.protected_together)),
    }
    if decision.weighted_champion is not None:
        tags[Tags.WEIGHTED_CHAMPION] = f"{decision.weighted_champion:.4f}"
    if decision.floor_version is not None:
        tags[Tags.FLOOR_VERSION] = decision.floor_version
    for template, figures in (
        (Tags.FLOOR_ACCEPT_LENGTH, decision.floor or {}),
        (Tags.WINDOW_ACCEPT_LENGTH, decision.window_challenger),
        (Tags.CHAMPION_WINDOW_ACCEPT_LENGTH, decision.window_champion),
    ):
        for segment, value in figures.items():
            tags[template.format(segment=segment, k=k)] = f"{value:.4f}"
    for at_k, figures in {**decision.challenger_by_k, k: decision.challenger}.items():
        for segment, value in figures.items():
            tags[Tags.ACCEPT_LENGTH.format(segment=segment, k=at_k)] = f"{value:.4f}"
    champion_by_k = dict(decision.champion_by_k)
    if decision.champion:
        champion_by_k[k] = decision.champion
    for at_k, figures in champion_by_k.items():
        for segment, value in figures.items():
            tags[Tags.CHAMPION_ACCEPT_LENGTH.format(segment=segment, k=at_k)] = f"{value:.4f}"
    for segment, share in decision.weights.items():
        tags[Tags.WEIGHT.format(segment=segment)] = f"{share:.4f}"
    for segment, share in decision.older_shares.items():
        tags[Tags.OLDER_SHARE.format(segment=segment)] = f"{share:.4f}"
    tags[Tags.DECISION] = "promote" if decision.promote else "reject"  # last: it marks
    return tags  # the record complete for decision_from_tags


# MLflow metrics of a decision, on the version's run: charts across runs and versions.
_AL_METRIC: Final = "eval.accept_length.{segment}.k{k}"
_CHAMPION_AL_METRIC: Final = "eval.champion_accept_length.{segment}.k{k}"
_WEIGHTED_METRIC: Final = "eval.weighted_accept_length.k{k}"
_WEIGHTED_CHAMPION_METRIC: Final = "eval.weighted_champion_accept_length.k{k}"


def decision_metrics(decision: GateDecision, k: int) -> dict[str, float]:
    """MLflow metrics of a decision: acceptance length per segment and k, challenger and
    champion, and the window-weighted figures at the gate's k."""
    metrics = {_WEIGHTED_METRIC.format(k=k): decision.weighted_challenger}
    if decision.weighted_champion is not None:
        metrics[_WEIGHTED_CHAMPION_METRIC.format(k=k)] = decision.weighted_champion
    champion_by_k = dict(decision.champion_by_k)
    if decision.champion:
        champion_by_k[k] = decision.champion
    for template, by_k in (
        (_AL_METRIC, {**decision.challenger_by_k, k: decision.challenger}),
        (_CHAMPION_AL_METRIC, champion_by_k),
    ):
        for at_k, figures in by_k.items():
            for segment, value in figures.items():
                metrics[template.format(segment=segment, k=at_k)] = value
    return metrics


def accept_lengths_from_metrics(metrics: dict[str, float], k: int) -> dict[str, float]:
    """The challenger's acceptance length per segment at ``k`` among logged metrics."""
    return _by_k({key: str(value) for key, value in metrics.items()}, _AL_METRIC).get(k, {})


def _pattern(template: str) -> re.Pattern[str]:
    """A tag template as a regex capturing ``segment`` (and ``k``)."""
    escaped = re.escape(template).replace(r"\{segment\}", "(?P<segment>.+)")
    return re.compile(escaped.replace(r"\{k\}", r"(?P<k>\d+)"))


def _by_segment(tags: dict[str, str], template: str) -> dict[str, float]:
    pattern = _pattern(template)
    found = {}
    for key, value in tags.items():
        match = pattern.fullmatch(key)
        if match:
            found[match["segment"]] = float(value)
    return found


def _by_k(tags: dict[str, str], template: str) -> dict[int, dict[str, float]]:
    pattern = _pattern(template)
    found: dict[int, dict[str, float]] = {}
    for key, value in tags.items():
        match = pattern.fullmatch(key)
        if match:
            found.setdefault(int(match["k"]), {})[match["segment"]] = float(value)
    return found


def decision_from_tags(tags: dict[str, str], k: int) -> GateDecision | None:
    """The decision :func:`decision_tags` recorded, read back; ``None`` if none was recorded.

    Tags are written in order with ``tide.gate.decision`` last, so a version that has it
    holds the whole record; one without (never judged, or judging died midway) is judged anew.
    """
    if Tags.DECISION not in tags:
        return None
    challenger_by_k = _by_k(tags, Tags.ACCEPT_LENGTH)
    champion_by_k = _by_k(tags, Tags.CHAMPION_ACCEPT_LENGTH)
    challenger = challenger_by_k.pop(k, {})
    champion = champion_by_k.pop(k, None)
    weighted_champion = tags.get(Tags.WEIGHTED_CHAMPION)
    weights = _by_segment(tags, Tags.WEIGHT)
    return GateDecision(
        promote=tags[Tags.DECISION] == "promote",
        reason=tags[Tags.REASON],
        challenger=challenger,
        champion=champion or None,
        weights=weights or dict.fromkeys(challenger, 1.0),
        weighted_challenger=float(tags[Tags.WEIGHTED]),
        weighted_champion=float(weighted_champion) if weighted_champion is not None else None,
        older_shares=_by_segment(tags, Tags.OLDER_SHARE),
        protected=tuple(json.loads(tags.get(Tags.PROTECTED, "[]"))),
        protected_together=tuple(json.loads(tags.get(Tags.PROTECTED_TOGETHER, "[]"))),
        challenger_by_k=challenger_by_k,
        champion_by_k=champion_by_k,
        floor=_by_k(tags, Tags.FLOOR_ACCEPT_LENGTH).get(k),
        floor_version=tags.get(Tags.FLOOR_VERSION),
        window_challenger=_by_k(tags, Tags.WINDOW_ACCEPT_LENGTH).get(k, {}),
        window_champion=_by_k(tags, Tags.CHAMPION_WINDOW_ACCEPT_LENGTH).get(k, {}),
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
        f"| segment | window share | older share | protected | challenger (k={k}) | champion "
        "| floor |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for segment, value in sorted(decision.challenger.items()):
        champion = decision.champion.get(segment) if decision.champion else None
        champion_text = f"{champion:.3f}" if champion is not None else "-"
        floor = (decision.floor or {}).get(segment)
        floor_text = f"{floor:.3f}" if floor is not None else "-"
        share = decision.weights.get(segment, 0.0)
        older = decision.older_shares.get(segment)
        older_text = f"{older:.2f}" if older is not None else "-"
        guarded = (
            "yes"
            if segment in decision.protected
            else "together"
            if segment in decision.protected_together
            else "no"
        )
        lines.append(
            f"| {segment} | {share:.2f} | {older_text} | {guarded} | {value:.3f} "
            f"| {champion_text} | {floor_text} |"
        )
    return "\n".join(lines) + "\n"
