"""The promotion gate's decisions."""

from __future__ import annotations

import pytest

from tide_lib.config import GateConfig
from tide_lib.evaluation.gate import decide, decision_from_tags, decision_report, decision_tags

CONFIG = GateConfig(margin=0.1, tolerance=0.2)
CHAMPION = {"recent": 2.0, "older": 3.0}


def test_missing_champion_lets_the_first_challenger_win() -> None:
    decision = decide({"recent": 1.3, "older": 1.1}, None, CONFIG)
    assert decision.promote and "no champion" in decision.reason


def test_win_on_recent_traffic_without_regression() -> None:
    decision = decide({"recent": 2.5, "older": 2.9}, CHAMPION, CONFIG)
    assert decision.promote
    assert "+0.500" in decision.reason


def test_loss_on_recent_traffic_is_rejected() -> None:
    decision = decide({"recent": 1.8, "older": 3.1}, CHAMPION, CONFIG)
    assert not decision.promote and "gain -0.200 < margin" in decision.reason


def test_tie_is_rejected() -> None:
    decision = decide(dict(CHAMPION), CHAMPION, CONFIG)
    assert not decision.promote and "gain +0.000 < margin 0.100" in decision.reason


def test_regression_on_older_traffic_is_rejected() -> None:
    decision = decide({"recent": 3.0, "older": 2.5}, CHAMPION, CONFIG)
    assert not decision.promote
    assert (
        "older traffic 'older'" in decision.reason
        and "drop 0.500 > tolerance 0.200" in decision.reason
    )


def test_weighted_fall_is_rejected_even_within_tolerance() -> None:
    decision = decide(
        {"recent": 2.2, "older": 2.85}, CHAMPION, CONFIG, weights={"recent": 0.05, "older": 0.95}
    )
    assert not decision.promote and "traffic-weighted" in decision.reason


def test_missing_recent_segment_is_an_error() -> None:
    with pytest.raises(ValueError, match="no figure for the recent segment"):
        decide({"older": 2.0}, CHAMPION, CONFIG)


def test_tags_and_report_carry_the_figures() -> None:
    decision = decide({"recent": 2.5, "older": 2.9}, CHAMPION, CONFIG)
    tags = decision_tags(decision, k=4)
    assert tags["tide.gate.decision"] == "promote"
    assert tags["tide.al.recent.k4"] == "2.5000"
    assert tags["tide.gate.champion_al.older.k4"] == "3.0000"
    report = decision_report(decision, k=4, names={"challenger": "v7"})
    assert report.startswith("# Gate: PROMOTE v7") and "| older | 1.00 | 2.900 | 3.000 |" in report


@pytest.mark.parametrize(
    ("challenger", "champion", "weights"),
    [
        ({"recent": 2.5, "older": 2.75}, CHAMPION, {"recent": 0.25, "older": 0.75}),
        ({"recent": 2.5, "older": 1.5}, CHAMPION, None),
        ({"recent": 1.5}, None, None),
    ],
)
def test_recorded_decision_reads_back_equal(
    challenger: dict[str, float], champion: dict[str, float] | None, weights: dict | None
) -> None:
    decision = decide(challenger, champion, CONFIG, weights)
    tags = {"mlflow.user": "someone", **decision_tags(decision, k=4)}
    assert decision_from_tags(tags, k=4) == decision
    assert decision_from_tags({"mlflow.user": "someone"}, k=4) is None
    assert list(decision_tags(decision, k=4))[-1] == "tide.gate.decision"  # written last


def test_a_decision_recorded_halfway_is_not_read_back() -> None:
    tags = decision_tags(decide({"recent": 2.5}, CHAMPION, CONFIG), k=4)
    written_before_a_crash = dict(list(tags.items())[:2])
    assert decision_from_tags(written_before_a_crash, k=4) is None


def test_figures_exactly_at_the_thresholds_pass() -> None:
    decision = decide(
        {"recent": 2.1, "older": 2.9}, CHAMPION, CONFIG
    )  # gain == margin, weighted equal
    assert decision.promote, decision.reason
