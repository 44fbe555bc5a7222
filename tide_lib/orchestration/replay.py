"""Which older requests a cycle replays: a budget split by segment, toward those at risk.

A warm start forgets what it does not see. Commits drawn at random hand the trainer
older traffic in proportion to its volume, so a segment that stopped arriving
(English docs once Korean took over) may be two requests of the replay, or none:
too few to distil on, too few for the trainer's forgetting check to judge it, and
the gate then rejects the draft for forgetting it. So the replay budget
(``cycle.replay_share`` x the window's tokens) is split between the older segments
by their share of older traffic plus what the window lacks of it (older share minus
window share, when positive): traffic the window lost is replayed up to twice as
much as its volume, traffic it still carries by its volume. Without shift the split
follows the older shares, and a small wobble of the shares moves it only as much.
A budget a segment cannot fill (too few requests) goes to the other candidates.

Volume undersells traffic of short requests: in a four-segment benchmark with Korean
last, English chat (short answers beside long documents and law texts) held a small
share of the older tokens, so of the replay, and ended at 0.75-0.80 of its acceptance
length on fresh requests. With ``cycle.replay_min_segment_share`` set, a segment the
gate protects for its older traffic alone (``gate.min_segment_share`` of it, less of
the window's) gets at least that share of the budget, the others' quotas shrinking in
proportion (:func:`floored_shares`). It is off by default: at 0.25, three benchmark
runs differed more between themselves than with and without it.

Pure functions: the cycle reads the candidates (older requests that are not held
out) and writes the chosen ones (:func:`tide_lib.orchestration.export.export_training_data`).
"""

from __future__ import annotations

__all__ = [
    "ReplayCandidate",
    "choose_replay",
    "floored_shares",
    "replay_quotas",
    "token_shares",
]

import dataclasses
import hashlib
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayCandidate:
    """An older request that may be replayed: its identity, segment, size and commit.

    ``key`` identifies the record itself (request id and content), so a request id
    that repeats across commits or clients never picks another record; ``commit`` is
    the marker it was read from, so only commits holding chosen requests are read again.
    """

    key: str
    segment: str
    tokens: int
    commit: str = ""


def token_shares(tokens: dict[str, int]) -> dict[str, float]:
    """Each segment's share of ``tokens`` (empty when there are none)."""
    total = sum(tokens.values())
    return {segment: count / total for segment, count in tokens.items()} if total else {}


def replay_quotas(
    budget_tokens: float,
    older_tokens: dict[str, int],
    window_tokens: dict[str, int],
    *,
    floor: float = 0.0,
    floor_from: float = 0.0,
) -> dict[str, float]:
    """Replay tokens per older segment: ``budget_tokens`` split by weight, a segment's
    share of older traffic plus the part of it the window lacks (never below 0); a
    segment with at least ``floor_from`` of the older traffic and less of the window's
    (the gate protects it for its older traffic alone) gets at least ``floor`` of the
    budget (:func:`floored_shares`)."""
    older, window = token_shares(older_tokens), token_shares(window_tokens)
    weights = {
        segment: share + max(share - window.get(segment, 0.0), 0.0)
        for segment, share in older.items()
    }
    total = sum(weights.values())
    if not total:
        return {}
    floored = {
        segment
        for segment, share in older.items()
        if share >= floor_from and window.get(segment, 0.0) < floor_from
    }
    shares = floored_shares({s: w / total for s, w in weights.items()}, floor, floored)
    return {segment: budget_tokens * share for segment, share in shares.items()}


def floored_shares(shares: dict[str, float], floor: float, floored: set[str]) -> dict[str, float]:
    """``shares`` (summing to 1) with each of ``floored`` raised to at least ``floor``,
    the others scaled down to keep the sum; raising one can push another below the
    floor, so it is raised too. A floor above an even split is an even split."""
    floored &= shares.keys()
    if not floored or floor <= 0:
        return dict(shares)
    floor = min(floor, 1.0 / len(floored))
    raised: set[str] = set()
    while True:
        free = 1.0 - floor * len(raised)
        rest = sum(share for segment, share in shares.items() if segment not in raised)
        scale = free / rest if rest else 0.0
        low = {s for s in floored - raised if shares[s] * scale < floor}
        if not low:
            return {s: floor if s in raised else share * scale for s, share in shares.items()}
        raised |= low


def _rank(candidate: ReplayCandidate, seed: str) -> bytes:
    """A seeded order that does not depend on the other candidates: a retry that lost a
    shard in between still chooses the same requests of the shards that remain."""
    return hashlib.sha256(f"{seed}\0{candidate.key}".encode()).digest()


def choose_replay(
    candidates: Iterable[ReplayCandidate], quotas: dict[str, float], seed: str
) -> list[ReplayCandidate]:
    """The requests to replay, in the seeded order. Per segment, candidates in a seeded order until
    its quota is reached (the request that crosses it included, so a segment with a
    quota gets at least one); then what segments could not fill goes to the remaining
    candidates in the same order, whatever their segment."""
    ranked = sorted(candidates, key=lambda candidate: _rank(candidate, seed))
    chosen: set[str] = set()
    taken: dict[str, int] = {}
    for candidate in ranked:
        if taken.get(candidate.segment, 0) < quotas.get(candidate.segment, 0.0):
            chosen.add(candidate.key)
            taken[candidate.segment] = taken.get(candidate.segment, 0) + candidate.tokens
    left = sum(quotas.values()) - sum(taken.values())
    for candidate in ranked:
        if left <= 0:
            break
        if candidate.key not in chosen and candidate.segment in quotas:
            chosen.add(candidate.key)
            left -= candidate.tokens
    return [candidate for candidate in ranked if candidate.key in chosen]
