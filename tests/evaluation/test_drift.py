"""The no-drift rule: the champion is compared with its own baseline, segment by segment."""

from __future__ import annotations

import pytest

from tide_lib.evaluation.drift import judge_drift


def judge(measured: dict[str, float], shares: dict[str, float], baseline: dict[str, float]):
    return judge_drift(measured, shares, baseline, tolerance=0.2, min_share=0.1)


def test_a_champion_that_still_fits_its_traffic_has_no_drift() -> None:
    verdict = judge({"en": 2.9}, {"en": 1.0}, {"en": 3.0})
    assert not verdict.drift and verdict.reason.startswith("no drift")


def test_a_segment_that_fell_beyond_the_tolerance_drifts() -> None:
    verdict = judge({"en": 2.7, "ko": 1.5}, {"en": 0.5, "ko": 0.5}, {"en": 3.0, "ko": 1.6})
    assert verdict.drift and set(verdict.drifted) == {"en"}
    assert verdict.drifted["en"] == pytest.approx(0.3)


def test_a_fall_on_a_sliver_of_traffic_does_not_count() -> None:
    verdict = judge({"en": 3.0, "ko": 1.0}, {"en": 0.95, "ko": 0.05}, {"en": 3.0, "ko": 2.0})
    assert not verdict.drift


def test_a_new_segment_drifts_only_if_served_below_the_baseline_average() -> None:
    served_badly = judge({"ko": 1.4}, {"ko": 1.0}, {"en": 3.0, "docs": 2.6})
    assert served_badly.drift and "new segment" in served_badly.reason
    served_well = judge({"ko": 2.7}, {"ko": 1.0}, {"en": 3.0, "docs": 2.6})
    assert not served_well.drift


def test_without_a_baseline_or_a_meaningful_segment_the_cycle_trains() -> None:
    assert judge({"en": 3.0}, {"en": 1.0}, {}).drift
    assert judge({"en": 3.0}, {"en": 0.05}, {"en": 3.0}).drift
