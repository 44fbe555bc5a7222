"""``tide bench suite``: workloads drawn by seed, and the figures and goals read from a run."""

from __future__ import annotations

from typing import Any

import pytest

from tide_lib.harness.params import SuiteParams
from tide_lib.harness.suite import (
    KINDS,
    SuiteWorkload,
    draw_workload,
    suite_summary,
    workload_figures,
)

POOLS = {s: [f"{s} prompt {i}" for i in range(30)] for s in ("en", "docs", "ko", "law")}
TOKENS = {"en": 40.0, "docs": 30.0, "ko": 50.0, "law": 20.0}


def _draw(index: int, seed: int, **params: Any) -> SuiteWorkload:
    return draw_workload(index, seed, POOLS, TOKENS, SuiteParams(**params))


def test_each_kind_comes_in_turn_drawn_by_its_seed() -> None:
    params = SuiteParams(cycles=6, cycle_tokens=700)
    drawn = [draw_workload(i, 100 + i, POOLS, TOKENS, params) for i in range(8)]
    assert [w.kind for w in drawn] == [*KINDS, *KINDS[:2]]
    assert [w.labels for w in drawn] == [False, True] * 4  # with and without client labels
    assert drawn[0].requests == _draw(0, 100).requests  # the same seed draws the same workload
    assert _draw(0, 100).requests != _draw(0, 101).requests
    for workload in drawn:
        tokens = sum(TOKENS[item["segment"]] for item in workload.requests)
        assert tokens >= 5.5 * 700, workload.name  # at least five cycles of traffic
        assert {item["prompt"] for item in workload.requests} <= {
            p for prompts in POOLS.values() for p in prompts
        }
        assert workload.static_segments[0] == workload.segments[0]
    new, turns, gradual, back, served, none = drawn[:6]
    assert len(new.segments) == 2 and new.new_segment == new.segments[1]
    assert len(turns.segments) in {3, 4}
    assert len(back.segments) == 2 and back.requests[-1]["segment"] == back.segments[0]
    assert served.static_segments == tuple(served.segments)  # fitted to both
    assert none.new_segment is None and len(none.segments) == 1
    # a gradual mix: the new segment's share grows from the first half to the second
    half = len(gradual.requests) // 2
    later = gradual.segments[1]
    shares = [
        sum(item["segment"] == later for item in part) / len(part)
        for part in (gradual.requests[:half], gradual.requests[half:])
    ]
    assert shares[0] < shares[1]


def _cycle(served: int, outcome: str, version: int | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"requests_served": served, "outcome": outcome}
    if outcome != "no-drift":
        entry["training_s"] = 10.0
    if version is not None:
        entry["version"] = version
    return entry


def _workload(kind: str = "new") -> SuiteWorkload:
    requests = [{"prompt": f"a{i}", "segment": "en"} for i in range(10)]
    requests += [{"prompt": f"b{i}", "segment": "ko"} for i in range(30)]
    return SuiteWorkload("new-s1", kind, 1, False, ("en",), requests)


ORACLE = {"en": 3.0, "ko": 3.0}


def test_lag_counts_cycles_from_the_first_window_holding_the_segment_to_a_draft_serving_it() -> (
    None
):
    cycles = [
        _cycle(10, "parent-best"),  # all English: the window does not hold Korean yet
        _cycle(20, "rejected", 2),  # first window holding Korean
        _cycle(30, "promoted", 3),  # v3 at 2.0: not yet 0.8 of the oracle (2.4)
        _cycle(40, "promoted", 4),  # v4 at 2.7: serves it
    ]
    lengths = {
        "static": {"en": 3.0, "ko": 1.0},
        "adapted-v3": {"en": 2.9, "ko": 2.0},
        "adapted-v4": {"en": 2.7, "ko": 2.7},
    }
    figures = workload_figures(_workload(), cycles, lengths, ORACLE)
    assert figures["lag"] == {"ko": 3}
    assert figures["final"] == "adapted-v4"
    assert figures["static_oracle"] == pytest.approx(1 / 3)
    assert figures["adapted_static"] == pytest.approx(2.7)
    assert figures["adapted_oracle"] == pytest.approx(0.9)
    # English against the best any serving draft reached there (the static draft's 3.0)
    assert figures["retention"] == {"en": pytest.approx(0.9)}
    assert figures["cycles_trained"] == 4 and figures["training_s"] == 40.0
    never = workload_figures(_workload(), cycles[:3], lengths, ORACLE)
    assert never["lag"] == {"ko": "never"}  # no champion ever served it well
    unheld = workload_figures(_workload(), cycles[:1], lengths, ORACLE)
    assert unheld["lag"] == {"ko": "unheld"}  # no window held it: no lag to count
    served_well = {**lengths, "static": {"en": 3.0, "ko": 2.5}}
    assert workload_figures(_workload(), cycles, served_well, ORACLE)["lag"] == {"ko": 0}


def _figures(kind: str, **figures: Any) -> dict[str, Any]:
    base = {
        "kind": kind,
        "new_segment": "ko",
        "static_oracle": 0.4,
        "adapted_static": 2.0,
        "adapted_oracle": 0.95,
        "retention": {"en": 0.99},
        "lag": {"ko": 1},
        "cycles_trained": 2,
        "cycle_outcomes": {"promoted": 2, "no-drift": 1},
        "cycle_log": [{"training_s": 5.0}, {"training_s": 7.0}, {}],
    }
    return base | figures


def test_the_summary_takes_medians_and_worst_cases_and_checks_each_goal() -> None:
    runs = [
        _figures("new"),
        _figures("turns", adapted_oracle=0.85, lag={"ko": 2, "docs": 3}),
        _figures("return", adapted_static=1.6, retention={"en": 0.93, "docs": 0.98}),
        _figures(
            "none",
            new_segment=None,
            lag={},
            cycles_trained=1,
            cycle_outcomes={"parent-best": 1, "no-drift": 2},
        ),
    ]
    summary = suite_summary(runs)
    assert summary["adapted_static_unfitted"]["worst"] == 1.6
    assert summary["adapted_oracle"] == {"median": 0.95, "worst": 0.85, "n": 3}
    assert summary["retention"]["worst"] == 0.93
    assert summary["lag"]["worst"] == 3
    assert summary["promoted_of_trained"] == pytest.approx(6 / 7)
    assert summary["training_s"] == 4 * 12.0
    assert summary["training_s_saved_estimate"] == pytest.approx(5 * 6.0)  # 5 skipped cycles
    goals = summary["goals"]
    assert goals["adapted_static_unfitted_worst_ge_1.5"]
    assert summary["retention"]["median"] == 0.99 and goals["retention_median_ge_0.97"]
    assert goals["retention_worst_ge_0.9"]  # 0.93
    assert goals["no_shift_trains_at_most_once"] and goals["lag_worst_le_3"]
    # a segment never served well is an infinite lag: the worst case fails, not skipped
    stalled = suite_summary([*runs, _figures("new", lag={"ko": "never"})])
    assert stalled["lag"]["worst"] == "never"
    assert not stalled["goals"]["lag_worst_le_3"]
    assert not stalled["goals"]["unfitted_new_segment_served_within_2"]
    # one that arrived after the last cycle is no lag at all
    late = suite_summary([*runs, _figures("new", lag={"ko": "unheld"})])
    assert late["lag"]["n"] == summary["lag"]["n"] and late["goals"]["lag_worst_le_3"]
    # a figure over nothing measured is None, never a division by zero
    zero = workload_figures(
        _workload(), [], {"static": {"en": 0.0, "ko": 0.0}}, {"en": 0.0, "ko": 0.0}
    )
    assert zero["adapted_static"] is None and zero["retention"] == {"en": None}
    assert suite_summary([zero])["retention"] == {"median": None, "worst": None, "n": 0}
