"""Which older requests a cycle replays: a budget split by segment, toward those at risk.

A warm start forgets what it does not see. Commits drawn at random hand the trainer
older traffic in proportion to its volume, so a segment that stopped arriving
(English docs once Korean took over) may be two requests of the replay, or none:
too few to distil on, too few for the trainer's forgetting check to judge it, and
the gate then rejects the draft for forgetting it. So the replay budget
(``cycle.replay_share`` x the window's tokens) is split between the older segments
by how much of each the window lacks: its share of older traffic minus its share
of the window. Traffic the window still carries is learned there; traffic it lost
is replayed most. When the window lacks nothing (no shift), the split follows the
older shares.

Pure functions: the cycle reads the candidates (older requests that are not held
out) and writes the chosen ones (:func:`tide_lib.orchestration.cycle.export_training_data`).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable

__all__ = ["ReplayCandidate", "choose_replay", "replay_quotas"]


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayCandidate:
    """An older request that may be replayed: its lake identity, segment and size."""

    request_id: str
    segment: str
    tokens: int


def _shares(tokens: dict[str, int]) -> dict[str, float]:
    total = sum(tokens.values())
    return {segment: count / total for segment, count in tokens.items()} if total else {}


def replay_quotas(
    budget_tokens: float, older_tokens: dict[str, int], window_tokens: dict[str, int]
) -> dict[str, float]:
    """Replay tokens per older segment: ``budget_tokens`` split by what the window lacks.

    A segment's weight is its share of older traffic minus its share of the window
    (never below 0); when no segment has weight, the older shares themselves.
    """
    older, window = _shares(older_tokens), _shares(window_tokens)
    lacking = {
        segment: max(share - window.get(segment, 0.0), 0.0) for segment, share in older.items()
    }
    weights = lacking if sum(lacking.values()) > 0 else older
    total = sum(weights.values())
    if not total:
        return {}
    return {segment: budget_tokens * weight / total for segment, weight in weights.items()}


def choose_replay(
    candidates: Iterable[ReplayCandidate], quotas: dict[str, float], seed: str
) -> set[str]:
    """Request ids to replay: per segment, candidates in a seeded random order until its
    quota is reached (the request that crosses it included, so a segment with a quota
    gets at least one request)."""
    by_segment: dict[str, list[ReplayCandidate]] = {}
    for candidate in candidates:
        by_segment.setdefault(candidate.segment, []).append(candidate)
    rng = random.Random(seed)
    chosen: set[str] = set()
    for segment in sorted(by_segment):
        pool = sorted(by_segment[segment], key=lambda c: c.request_id)
        rng.shuffle(pool)
        quota, taken = quotas.get(segment, 0.0), 0
        for candidate in pool:
            if taken >= quota:
                break
            chosen.add(candidate.request_id)
            taken += candidate.tokens
    return chosen
