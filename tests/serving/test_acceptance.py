"""One acceptance-length accumulator: every source of the figure pools the same way."""

from __future__ import annotations

from tide_lib.serving.acceptance import AcceptanceCount


def test_every_source_of_one_request_counts_the_same() -> None:
    # 4 verify steps that accepted 6 draft tokens: 10 emitted (the bonus tokens count)
    direct, accepted, meta, pooled = (AcceptanceCount() for _ in range(4))
    direct.add(10, 4)
    accepted.add_accepted(6, 4)
    meta.add_meta({"spec_verify_ct": 4, "spec_accept_length": 2.5, "completion_tokens": 10})
    pooled.add_pooled(2.5, 4)
    for count in (direct, accepted, meta, pooled):
        assert (count.emitted, count.verify_steps, count.requests) == (10, 4, 1)
        assert count.accept_length == 2.5 and count.per_request == [(10, 4)]


def test_requests_pool_by_verify_steps_not_by_request() -> None:
    count = AcceptanceCount(keep_requests=False)
    count.add_accepted(0, 10)  # a draft always rejected: 1.0
    count.add_accepted(30, 10)  # a draft always accepted at k=3: 4.0
    count.add_meta({})  # a response before any verify step adds nothing but the request
    assert count.accept_length == 2.5 and count.requests == 3
    assert count.per_request == []  # not kept: an engine's counters run for its lifetime
    assert AcceptanceCount().accept_length == 0.0
