"""The promotion gate: a challenger is promoted only on measured acceptance length.

Segments are the traffic's own (client labels, else clusters of the target's
states, see :mod:`tide_lib.evaluation.segments`), each measured on held-out
requests of the window and of the older traffic in the lookback. The trade itself is
:mod:`tide_lib.evaluation.tradeoff`'s, the trainer's too. Rules, in order:

1. No champion yet: the first valid challenger wins.
2. No protected segment may end below its floor: its best served acceptance (the
   champion's, or the floor draft's where higher: the registry's ``baseline`` alias,
   ``gate.floor``) less ``gate.max_loss`` times one minus its share of the window, of
   that best, beyond its margin of error (paired, one-sided 95%, see
   :func:`~tide_lib.evaluation.offline.drop_margin`), while falling below the champion.
   A segment is protected when its token share of the window, or of the older traffic,
   reaches ``min_segment_share``, and it is measured on ``min_segment_tokens`` held-out
   output tokens: the figure of two short requests is noise. Traffic to keep that is too
   thin to judge alone is judged together, its held-out requests pooled, once together
   it reaches ``min_segment_tokens``: older traffic (the clusters split it into parts),
   and segments the champion already serves better than the window as a whole (the
   window's other segments are what the challenger learns: their gain would hide the
   loss).
3. The acceptance length weighted by each segment's share of the window's tokens
   must gain at least ``margin``: the challenger has to pay off on what the fleet
   serves now. Each segment's figure here is measured on the window's held-out
   requests alone when they hold ``min_segment_tokens`` output tokens
   (``window_figures``; fewer are noise): a segment's older requests would dilute the
   gain on what the window brought.

The decision carries its figures; :func:`decision_tags` turns it into MLflow
version tags (``tide.gate.*``, ``tide.al.*``; every name is built here),
:func:`decision_from_tags` reads it back (a rerun of a cycle reuses it) and
:func:`decision_report` makes a short readable report.
"""

from __future__ import annotations

__all__ = [
    "GateDecision",
    "GateEvidence",
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
from tide_lib.evaluation.tradeoff import SegmentTrade, below_floor
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
    # The floor draft's figures at the gate's k (rule 2); None: judged without a floor.
    floor: dict[str, float] | None = None
    floor_version: str | None = None
    # Figures on the window's held-out requests alone (rule 3's), where a segment has some.
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
    where both drafts were measured on some (rule 3's), else on all its requests."""
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
    """Segments the floor protects: share of the window or of the older traffic
    >= ``min_share`` (a first cycle, without older traffic, alike).

    :func:`decide` then keeps those measured on enough held-out traffic.
    """
    total = sum(weights.values()) or 1.0
    return tuple(
        sorted(
            segment
            for segment in segments
            if max(weights.get(segment, 0.0) / total, older_shares.get(segment, 0.0))
            >= min_share - _EPSILON
        )
    )


def _trades(
    protected: tuple[str, ...],
    figures: tuple[dict[str, float], dict[str, float]],
    shares: dict[str, float],
    margins: tuple[dict[str, float], dict[str, float]],
    floor: dict[str, float],
) -> dict[str, SegmentTrade]:
    """Each protected segment's trade (:class:`~tide_lib.evaluation.tradeoff.SegmentTrade`):
    challenger against champion on its held-out requests, its share of the window, and
    its best served figure: the champion's, or the floor draft's where higher (the
    margin of error then the larger of the two drops')."""
    challenger, champion = figures
    drop_margins, floor_margins = margins
    return {
        segment: SegmentTrade(
            share=shares.get(segment, 0.0),
            before=champion[segment],
            after=challenger[segment],
            margin=max(drop_margins.get(segment, 0.0), floor_margins.get(segment, 0.0))
            if segment in floor
            else drop_margins.get(segment, 0.0),
            best=floor.get(segment),
        )
        for segment in protected
        if segment in champion and segment in challenger
    }


@dataclasses.dataclass(frozen=True)
class _Together:
    """Segments of traffic to keep judged together: which, their figures, why they fell
    below their floor (None: they did not). Nothing judged: all empty."""

    judged: tuple[str, ...] = ()
    figures: str = ""
    forgotten: str | None = None


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
    each part is judged alone too (``thin``: those too thin to be): segments protected by
    their share of the older traffic alone, and those the champion already serves better
    than the window as a whole (``weighted_champion``, by more than ``gate.margin``). A
    segment of the window the champion serves no better is what the challenger was trained
    to learn: pooled, its gain would hide what the others lost. Together they keep the floor
    of their pooled figure under the champion, at their summed share of the window."""
    window, older = shares
    least = config.min_segment_share - _EPSILON
    judged = tuple(
        segment
        for segment in shared
        if segment in champion
        and (
            (older.get(segment, 0.0) >= least and window.get(segment, 0.0) < least)
            or champion[segment] > weighted_champion + config.margin
        )
    )
    if pooled is None or tokens is None or not judged:
        return _Together()
    if len(judged) == 1 and judged[0] not in thin:  # judged alone already
        return _Together()
    if sum(tokens.get(segment, 0) for segment in judged) < config.min_segment_tokens:
        return _Together()
    before, after, margin = pooled(judged)
    share = sum(window.get(segment, 0.0) for segment in judged)
    trade = SegmentTrade(share=share, before=before, after=after, margin=margin)
    figures = f"{', '.join(judged)} together {after:.3f} vs champion {before:.3f}"
    if trade.shortfall(config.max_loss) is None:
        return _Together(judged, f"{figures}: above their floor {trade.floor(config.max_loss):.3f}")
    why = trade.describe(" + ".join(judged), config.max_loss)
    return _Together(judged, figures, f"traffic to keep, judged together: {why}")


@dataclasses.dataclass(frozen=True)
class GateEvidence:
    """What the gate judges a challenger on: figures map segment -> acceptance length at k.

    ``weights`` are the segments' shares of the window's tokens (equal when not given);
    ``older_shares`` their shares of the older traffic; ``held_out_tokens`` the output
    tokens each figure was measured on (not given: every figure counts as measured);
    ``drop_margins`` the one-sided 95% margin of error of each segment's drop, champion
    and challenger replayed on the same requests
    (:func:`~tide_lib.evaluation.offline.drop_margin`); ``pooled`` measures segments of
    traffic to keep together (none: they are not); ``floor`` the floor draft's figures on
    the same requests (none: no floor draft) and ``floor_margins`` the margins of error
    of the challenger's drops below it; ``window_figures`` the challenger's and the
    champion's figures on the window's held-out requests alone, by segment: the
    weighted gain (rule 3) uses them where a segment has them.
    """

    challenger: dict[str, float]
    champion: dict[str, float] | None
    weights: dict[str, float] | None = None
    older_shares: dict[str, float] | None = None
    held_out_tokens: dict[str, int] | None = None
    drop_margins: dict[str, float] | None = None
    pooled: PooledFigures | None = None
    floor: dict[str, float] | None = None
    floor_margins: dict[str, float] | None = None
    window_figures: tuple[dict[str, float], dict[str, float]] | None = None

    def shares(self) -> dict[str, float]:
        return dict(self.weights) if self.weights else dict.fromkeys(self.challenger, 1.0)


def decide(evidence: GateEvidence, config: GateConfig) -> GateDecision:
    """Promote or not, by the rules of this module, on ``evidence``."""
    if not evidence.challenger:
        raise ValueError("the challenger has no figures: no held-out traffic was evaluated")
    shares, older = evidence.shares(), dict(evidence.older_shares or {})
    shared = protected_segments(list(evidence.challenger), shares, older, config.min_segment_share)
    protected, thin = _evidenced(shared, evidence.held_out_tokens, config.min_segment_tokens)
    on_window, champion_on_window = evidence.window_figures or ({}, {})
    decision = GateDecision(
        True,
        "no champion yet: the first valid challenger wins",
        dict(evidence.challenger),
        dict(evidence.champion) if evidence.champion else None,
        shares,
        weighted_figure({**evidence.challenger, **on_window}, shares),
        None,
        older,
        protected,
        floor=dict(evidence.floor) if evidence.floor else None,
        window_challenger=dict(on_window),
        window_champion=dict(champion_on_window),
    )
    if not evidence.champion:
        return decision
    return _judged(evidence, decision, shared, thin, config)


def _judged(
    evidence: GateEvidence,
    decision: GateDecision,
    shared: tuple[str, ...],
    thin: list[str],
    config: GateConfig,
) -> GateDecision:
    """Rules 2 and 3 against a champion: ``decision`` carries the figures, ``shared`` the
    segments protected by their share, ``thin`` those too thin to judge alone."""
    champion = evidence.champion or {}
    gain_challenger, gain_champion = _window_preferred(
        evidence.challenger, champion, decision.window_challenger, decision.window_champion
    )
    common = {s: v for s, v in gain_challenger.items() if s in gain_champion}
    weighted_champion = weighted_figure({s: gain_champion[s] for s in common}, decision.weights)
    current = _normalised(decision.weights)
    trades = _trades(
        decision.protected,
        (evidence.challenger, champion),
        current,
        (evidence.drop_margins or {}, evidence.floor_margins or {}),
        evidence.floor or {},
    )
    together = _forgotten_together(
        shared,
        thin,
        gain_champion,  # served well or not: on the window's requests where it has some
        evidence.held_out_tokens,
        evidence.pooled,
        config=config,
        shares=(current, decision.older_shares),
        weighted_champion=weighted_champion,
    )
    judged = dataclasses.replace(
        decision, weighted_champion=weighted_champion, protected_together=together.judged
    )
    why = below_floor(trades, config.max_loss) or together.forgotten
    if why:
        return dataclasses.replace(judged, promote=False, reason=why)
    gain = weighted_figure(common, decision.weights) - weighted_champion
    figures = f"{weighted_champion + gain:.3f} vs champion {weighted_champion:.3f}"
    if gain < config.margin - _EPSILON:
        reason = (
            f"window-weighted acceptance length: {figures} "
            f"(gain {gain:+.3f} < margin {config.margin:.3f})"
        )
        return dataclasses.replace(judged, promote=False, reason=reason)
    reason = (
        f"window-weighted acceptance length {figures} (gain {gain:+.3f} >= margin "
        f"{config.margin:.3f}); no protected segment "
        f"({', '.join(decision.protected) or 'none'}) below its floor"
        f"{_unjudged(thin, together.figures)}"
    )
    return dataclasses.replace(judged, reason=reason)


def _normalised(shares: dict[str, float]) -> dict[str, float]:
    """Shares that add up to 1 (equal where none has one)."""
    total = sum(shares.values())
    if total <= 0:
        return {segment: 1.0 / len(shares) for segment in shares} if shares else {}
    return {segment: share / total for segment, share in shares.items()}


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
