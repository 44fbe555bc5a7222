"""The replay budget split by segment: traffic the window lost is replayed most."""

from __future__ import annotations

import pytest

from tide_lib.orchestration.replay import ReplayCandidate, choose_replay, replay_quotas


def test_a_segment_the_window_lost_takes_the_replay() -> None:
    # Older traffic: English docs 40%, English 60%; the window: Korean and some English.
    quotas = replay_quotas(1000, {"docs": 400, "english": 600}, {"korean": 700, "english": 300})
    # lacking: docs 0.4 - 0, english 0.6 - 0.3 = 0.3
    assert quotas == pytest.approx({"docs": 1000 * 0.4 / 0.7, "english": 1000 * 0.3 / 0.7})
    assert sum(quotas.values()) == pytest.approx(1000)


def test_without_shift_the_replay_follows_the_older_shares() -> None:
    quotas = replay_quotas(500, {"a": 300, "b": 100}, {"a": 300, "b": 100})
    assert quotas == pytest.approx({"a": 375, "b": 125})
    assert replay_quotas(500, {}, {"a": 10}) == {}
    assert replay_quotas(0, {"a": 10}, {}) == {"a": 0}


def _candidates(segment: str, count: int, tokens: int = 10) -> list[ReplayCandidate]:
    return [ReplayCandidate(f"{segment}-{i}", segment, tokens) for i in range(count)]


def test_choose_fills_each_quota_and_is_the_same_on_a_retry() -> None:
    pool = _candidates("docs", 20) + _candidates("english", 20)
    quotas = {"docs": 55.0, "english": 5.0}
    chosen = choose_replay(pool, quotas, seed="cycle-7")
    assert sum(c.startswith("docs") for c in chosen) == 6  # the one crossing 55 included
    assert sum(c.startswith("english") for c in chosen) == 1  # a quota gets one request
    assert choose_replay(reversed(pool), quotas, seed="cycle-7") == chosen
    assert choose_replay(pool, quotas, seed="cycle-8") != chosen  # each cycle its own draw


def test_a_segment_without_quota_or_candidates_replays_nothing() -> None:
    pool = _candidates("docs", 3)
    assert choose_replay(pool, {"english": 100.0}, seed="c") == set()
    assert choose_replay(pool, {"docs": 1000.0}, seed="c") == {"docs-0", "docs-1", "docs-2"}
