"""The replay budget split by segment: traffic the window lost is replayed most."""

from __future__ import annotations

import pytest

from tide_lib.orchestration.replay import (
    ReplayCandidate,
    choose_replay,
    floored_shares,
    replay_quotas,
)


def test_a_segment_the_window_lost_gets_more_than_its_volume() -> None:
    # Older traffic: English docs 40%, English 60%; the window: Korean and some English.
    quotas = replay_quotas(1000, {"docs": 400, "english": 600}, {"korean": 700, "english": 300})
    # weights: docs 0.4 + 0.4 (all of it lacking), english 0.6 + (0.6 - 0.3)
    assert quotas == pytest.approx({"docs": 1000 * 0.8 / 1.7, "english": 1000 * 0.9 / 1.7})
    assert sum(quotas.values()) == pytest.approx(1000)


def test_without_shift_the_replay_follows_the_older_shares_and_a_wobble_moves_it_little() -> None:
    assert replay_quotas(500, {"a": 300, "b": 100}, {"a": 300, "b": 100}) == pytest.approx(
        {"a": 375, "b": 125}
    )
    wobble = replay_quotas(1000, {"a": 500, "b": 500}, {"a": 510, "b": 490})
    assert wobble == pytest.approx({"a": 1000 * 0.5 / 1.01, "b": 1000 * 0.51 / 1.01})
    assert replay_quotas(500, {}, {"a": 10}) == {}
    assert replay_quotas(0, {"a": 10}, {}) == {"a": 0}


def test_a_protected_segment_of_short_requests_gets_the_floor() -> None:
    # English chat: 12% of the older tokens; docs and law the rest, the window all law.
    older = {"english": 120, "docs": 300, "law": 600}
    by_volume = replay_quotas(1000, older, {"law": 500})
    quotas = replay_quotas(1000, older, {"law": 500}, floor=0.25, floor_from=0.10)
    assert by_volume["english"] < 250
    assert quotas["english"] == pytest.approx(250)
    assert sum(quotas.values()) == pytest.approx(1000)
    # the others keep their proportions
    assert quotas["docs"] / quotas["law"] == pytest.approx(by_volume["docs"] / by_volume["law"])
    # a segment the window still carries gets no floor: it is learned, not only kept
    older_law = {"english": 500, "law": 150}  # law 23% of older traffic, all the window
    carried = replay_quotas(1000, older_law, {"law": 500}, floor=0.25, floor_from=0.10)
    assert carried == pytest.approx(replay_quotas(1000, older_law, {"law": 500}))
    assert carried["law"] < 250
    # a segment below floor_from (a stray cluster) gets no floor
    stray = replay_quotas(1000, {**older, "stray": 20}, {"law": 500}, floor=0.25, floor_from=0.10)
    assert stray["stray"] < 50
    assert stray["english"] == pytest.approx(250)


def test_floored_shares_raise_in_turn_and_never_past_an_even_split() -> None:
    shares = {"a": 0.70, "b": 0.20, "c": 0.10}
    # raising c to 0.3 scales b to 0.2 x 0.7 / 0.9 < 0.3: b is raised too
    assert floored_shares(shares, 0.3, {"a", "b", "c"}) == pytest.approx(
        {"a": 0.4, "b": 0.3, "c": 0.3}
    )
    assert floored_shares(shares, 0.9, {"a", "b", "c"}) == pytest.approx(
        {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}
    )
    assert floored_shares(shares, 0.0, {"a", "b", "c"}) == shares
    assert floored_shares(shares, 0.3, set()) == shares
    assert floored_shares(shares, 0.15, {"c", "zzz"}) == pytest.approx(
        {"a": 0.70 * 0.85 / 0.9, "b": 0.20 * 0.85 / 0.9, "c": 0.15}
    )


def _chosen(pool: list[ReplayCandidate], quotas: dict[str, float], seed: str) -> set[str]:
    """The keys :func:`choose_replay` picks."""
    return {candidate.key for candidate in choose_replay(pool, quotas, seed=seed)}


def _candidates(segment: str, count: int, tokens: int = 10) -> list[ReplayCandidate]:
    return [ReplayCandidate(f"{segment}-{i}", segment, tokens) for i in range(count)]


def test_choose_fills_each_quota_and_is_the_same_on_a_retry() -> None:
    pool = _candidates("docs", 20) + _candidates("english", 20)
    quotas = {"docs": 55.0, "english": 5.0}
    chosen = _chosen(pool, quotas, seed="cycle-7")
    assert sum(c.startswith("docs") for c in chosen) == 6  # the one crossing 55 included
    assert sum(c.startswith("english") for c in chosen) == 1  # a quota gets one request
    assert _chosen(list(reversed(pool)), quotas, seed="cycle-7") == chosen
    assert _chosen(pool, quotas, seed="cycle-8") != chosen  # each cycle its own draw
    # A retry that lost some candidates (a shard quarantined between) keeps the others.
    survivors = [c for c in pool if c.key not in {"docs-0", "docs-1"}]
    again = _chosen(survivors, quotas, seed="cycle-7")
    assert chosen - {"docs-0", "docs-1"} <= again


def test_what_a_segment_cannot_fill_goes_to_the_others() -> None:
    pool = _candidates("docs", 3) + _candidates("english", 20)
    chosen = _chosen(pool, {"docs": 100.0, "english": 10.0}, seed="c")
    assert {"docs-0", "docs-1", "docs-2"} <= chosen
    assert sum(c.startswith("english") for c in chosen) == 8  # 1 of its own, 7 left over
    assert _chosen(_candidates("docs", 3), {"english": 100.0}, seed="c") == set()
