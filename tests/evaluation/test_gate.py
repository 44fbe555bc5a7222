"""The promotion gate's decisions (issue 14): segments the traffic really has, weighted by
their share of the window, each protected by the tolerance above a minimum share."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from tide_lib.config import GateConfig, TideConfig
from tide_lib.evaluation.gate import decide, decision_from_tags, decision_report, decision_tags

CONFIG = GateConfig(margin=0.1, tolerance=0.2, min_segment_share=0.1)
CHAMPION = {"korean": 2.0, "english": 3.0}


def test_missing_champion_lets_the_first_challenger_win() -> None:
    decision = decide({"korean": 1.3, "english": 1.1}, None, CONFIG)
    assert decision.promote and "no champion" in decision.reason


def test_weights_are_the_window_token_shares() -> None:
    # Korean is 90 % of the window: its gain pays for English's small loss (within tolerance).
    shares = {"korean": 0.9, "english": 0.1}
    decision = decide({"korean": 2.3, "english": 2.9}, CHAMPION, CONFIG, weights=shares)
    assert decision.promote, decision.reason
    assert decision.weighted_challenger == pytest.approx(0.9 * 2.3 + 0.1 * 2.9)
    assert decision.weighted_champion == pytest.approx(0.9 * 2.0 + 0.1 * 3.0)
    # The same figures on a window that is 90 % English: the weighted gain is gone.
    flipped = decide(
        {"korean": 2.3, "english": 2.9}, CHAMPION, CONFIG, weights={"korean": 0.1, "english": 0.9}
    )
    assert not flipped.promote and "gain -0.060 < margin 0.100" in flipped.reason


def test_a_segment_above_the_minimum_share_may_not_drop_beyond_tolerance() -> None:
    shares = {"korean": 0.8, "english": 0.2}
    decision = decide({"korean": 3.5, "english": 2.7}, CHAMPION, CONFIG, weights=shares)
    assert not decision.promote
    assert "segment 'english'" in decision.reason and "drop 0.300 > tolerance" in decision.reason


def test_a_segment_under_the_minimum_share_is_not_protected() -> None:
    shares = {"korean": 0.95, "english": 0.05}
    older = {"korean": 0.95, "english": 0.05}
    decision = decide(
        {"korean": 3.5, "english": 2.0}, CHAMPION, CONFIG, weights=shares, older_shares=older
    )
    assert decision.promote, decision.reason
    assert decision.protected == ("korean",)


def test_a_segment_that_stopped_arriving_is_still_protected_while_in_the_lookback() -> None:
    # English is gone from the window but was most of the older traffic.
    shares = {"korean": 1.0, "english": 0.0}
    older = {"english": 0.7, "korean": 0.3}
    challenger = {"korean": 3.0, "english": 2.5}
    decision = decide(challenger, CHAMPION, CONFIG, weights=shares, older_shares=older)
    assert not decision.promote and "segment 'english'" in decision.reason
    assert "0% of the window, 70% of older traffic" in decision.reason
    assert "english" in decision.protected
    # Its weight stays zero: the margin is judged on what is served now.
    assert decision.weighted_challenger == pytest.approx(3.0)


def test_first_cycle_checks_every_segment_it_has_data_for() -> None:
    # No older traffic: even a segment under the minimum share is checked against the champion.
    shares = {"korean": 0.95, "english": 0.05}
    decision = decide({"korean": 3.5, "english": 2.0}, CHAMPION, CONFIG, weights=shares)
    assert not decision.promote and "segment 'english'" in decision.reason
    assert decision.protected == ("english", "korean")


def test_tie_is_rejected() -> None:
    decision = decide(dict(CHAMPION), CHAMPION, CONFIG)
    assert not decision.promote and "gain +0.000 < margin 0.100" in decision.reason


def test_figures_exactly_at_the_thresholds_pass() -> None:
    # english drops by exactly the tolerance; the weighted gain is exactly the margin.
    decision = decide(
        {"korean": 2.4, "english": 2.8}, CHAMPION, CONFIG, weights={"korean": 0.5, "english": 0.5}
    )
    assert decision.promote, decision.reason


def test_no_figures_is_an_error() -> None:
    with pytest.raises(ValueError, match="no held-out traffic"):
        decide({}, CHAMPION, CONFIG)


def test_a_segment_measured_on_too_few_tokens_cannot_block_a_promotion() -> None:
    """Two short held-out requests make a noisy figure: it counts in the weighted gain,
    but the tolerance protects only segments measured on gate.min_segment_tokens."""
    challenger = {"korean": 3.5, "english": 2.9, "cluster-2": 1.8}
    champion = {**CHAMPION, "cluster-2": 2.5}
    shares = {"korean": 0.5, "english": 0.37, "cluster-2": 0.13}
    tokens = {"korean": 400, "english": 300, "cluster-2": CONFIG.min_segment_tokens - 1}
    decision = decide(challenger, champion, CONFIG, weights=shares, held_out_tokens=tokens)
    assert decision.promote and decision.protected == ("english", "korean")
    assert decision.reason.endswith("too little held-out traffic to protect: cluster-2")
    enough = {**tokens, "cluster-2": CONFIG.min_segment_tokens}
    blocked = decide(challenger, champion, CONFIG, weights=shares, held_out_tokens=enough)
    assert not blocked.promote and "'cluster-2'" in blocked.reason
    tokens["english"] = 10  # an old segment with too little evidence is not protected either
    older = decide(
        {**challenger, "english": 1.0},
        champion,
        CONFIG,
        weights=shares,
        older_shares={"english": 1.0},
        held_out_tokens=tokens,
    )
    assert "english" not in older.protected


def test_older_traffic_split_into_thin_clusters_is_protected_together() -> None:
    """Seen in the adaptation benchmark: English, the traffic before Korean, fell into four
    clusters of a few held-out requests each, none protected alone, and a promotion for
    Korean lost a third of English's acceptance length unchecked."""
    thin = CONFIG.min_segment_tokens // 2 + 1  # two together reach the minimum
    tokens = {"korean": 400, "en-a": thin, "en-b": thin}
    champion = {"korean": 1.2, "en-a": 3.0, "en-b": 3.4}
    challenger = {"korean": 2.5, "en-a": 2.0, "en-b": 2.4}
    shares, older = {"korean": 1.0}, {"en-a": 0.5, "en-b": 0.5}
    asked: list[tuple[str, ...]] = []

    def pooled(margin: float):
        def figures(segments: tuple[str, ...]) -> tuple[float, float, float]:
            asked.append(segments)
            return 3.2, 2.2, margin  # the requests of both, pooled and paired

        return figures

    kwargs = {"weights": shares, "older_shares": older, "held_out_tokens": tokens}
    alone = decide(challenger, champion, CONFIG, **kwargs)
    assert alone.promote and "too little held-out traffic to protect: en-a, en-b" in alone.reason
    together = decide(challenger, champion, CONFIG, **kwargs, pooled=pooled(0.3))
    assert not together.promote and asked == [("en-a", "en-b")]
    assert "traffic to keep, judged together: en-a, en-b together 2.200 vs champion" in (
        together.reason
    )
    # A thin segment the window holds (new traffic, trained for) is not pooled: its gain
    # would hide what the older ones lost.
    asked.clear()
    new_thin = {**tokens, "korean": thin}
    hidden = decide(
        challenger, champion, CONFIG, **{**kwargs, "held_out_tokens": new_thin}, pooled=pooled(0.3)
    )
    assert not hidden.promote and asked == [("en-a", "en-b")]
    assert together.protected == ("korean",)  # no segment alone counts as evidenced
    assert together.protected_together == ("en-a", "en-b")
    assert decision_from_tags(decision_tags(together, k=4), k=4) == together  # as recorded
    assert "| en-a | 0.00 | 0.50 | together | 2.000 | 3.000 |" in decision_report(together, 4)
    noisy = decide(challenger, champion, CONFIG, **kwargs, pooled=pooled(0.9))
    assert noisy.promote and "no drop beyond the tolerance + margin of error 0.900" in (
        noisy.reason
    )
    fewer = {**tokens, "en-b": 1}  # too little even together: not judged
    kwargs["held_out_tokens"] = fewer
    assert decide(challenger, champion, CONFIG, **kwargs, pooled=pooled(0.0)).promote
    assert len(asked) == 2


def test_a_loss_spread_over_older_clusters_is_judged_on_all_their_requests() -> None:
    """Seen in the demo benchmark with the floor: English, older traffic, fell into a
    cluster protected alone (-0.34 within its margin of error) and a thin one (-0.49,
    too few tokens to judge), and the promotion lost English 3.40 -> 2.70 at k=5.
    Pooled, the drop is measured on the requests of both, within a smaller margin."""
    tokens = {"korean": 400, "en-a": 200, "en-b": CONFIG.min_segment_tokens // 2}
    champion = {"korean": 3.0, "en-a": 3.1, "en-b": 2.6}
    challenger = {"korean": 3.2, "en-a": 2.75, "en-b": 2.1}
    shares, older = {"korean": 0.95, "en-b": 0.05}, {"en-a": 0.5, "en-b": 0.3, "korean": 0.2}
    asked: list[tuple[str, ...]] = []

    def pooled(segments: tuple[str, ...]) -> tuple[float, float, float]:
        asked.append(segments)
        return 3.0, 2.5, 0.2  # drop 0.5 > tolerance 0.2 + margin 0.2

    kwargs = {"weights": shares, "older_shares": older, "held_out_tokens": tokens}
    alone = decide(challenger, champion, CONFIG, **kwargs, drop_margins={"en-a": 0.3})
    assert alone.promote, alone.reason
    together = decide(
        challenger, champion, CONFIG, **kwargs, drop_margins={"en-a": 0.3}, pooled=pooled
    )
    assert asked == [("en-a", "en-b")]  # korean is the window's: what is learned
    assert not together.promote and "en-a, en-b together 2.500 vs champion 3.000" in (
        together.reason
    )
    # one older segment protected alone is not judged together by rule 2 (it is alone),
    # but its drop still weighs against the gain in rule 5
    asked.clear()
    single = {"korean": 400, "en-a": 200}
    alone_kept = decide(
        {"korean": 3.2, "en-a": 2.75},
        {"korean": 3.0, "en-a": 3.1},
        CONFIG,
        weights={"korean": 1.0},
        older_shares={"en-a": 0.7, "korean": 0.3},
        held_out_tokens=single,
        drop_margins={"en-a": 0.3},
        pooled=pooled,
    )
    assert asked == [("en-a",)] and alone_kept.protected_together == ()
    assert not alone_kept.promote and "judged together" not in alone_kept.reason
    assert "loses more than the window gains: en-a 2.500 vs champion 3.000" in alone_kept.reason


def test_thin_window_traffic_the_champion_already_serves_well_is_protected_together() -> None:
    """Seen in the demo benchmark with a fitted static draft: the first Korean window still
    held the English tail, so English was window traffic, thin in every cluster, and the
    promotion for Korean lost English 3.68 -> 2.83 unchecked. English, served well above
    the window as a whole, is traffic to keep; the Korean the champion serves poorly is
    what the challenger learns and stays out of the pool."""
    thin = CONFIG.min_segment_tokens // 2 + 1
    tokens = {"korean": 400, "ko-thin": thin, "en-a": thin, "en-b": thin}
    champion = {"korean": 1.2, "ko-thin": 1.3, "en-a": 3.6, "en-b": 3.4}
    challenger = {"korean": 2.6, "ko-thin": 2.5, "en-a": 2.7, "en-b": 2.6}
    shares = {"korean": 0.6, "ko-thin": 0.15, "en-a": 0.125, "en-b": 0.125}
    older = {"en-a": 0.5, "en-b": 0.5}
    asked: list[tuple[str, ...]] = []

    def pooled(segments: tuple[str, ...]) -> tuple[float, float, float]:
        asked.append(segments)
        return 3.5, 2.65, 0.2

    decision = decide(
        challenger,
        champion,
        CONFIG,
        weights=shares,
        older_shares=older,
        held_out_tokens=tokens,
        pooled=pooled,
    )
    assert asked == [("en-a", "en-b")]  # both in the window, neither the learned Korean
    assert not decision.promote and "en-a, en-b together 2.650 vs champion 3.500" in (
        decision.reason
    )
    # Served no better than the window as a whole, window traffic is what is learned.
    asked.clear()
    level = {**champion, "en-a": 1.3, "en-b": 1.3}
    learned = decide(
        challenger, level, CONFIG, weights=shares, held_out_tokens=tokens, pooled=pooled
    )
    assert learned.promote
    assert asked == []


def test_tags_and_report_carry_the_figures() -> None:
    decision = decide(
        {"korean": 2.5, "english": 2.9},
        CHAMPION,
        CONFIG,
        weights={"korean": 0.75, "english": 0.25},
        older_shares={"english": 1.0},
    )
    tags = decision_tags(decision, k=4)
    assert tags["tide.gate.decision"] == "promote"
    assert tags["tide.al.korean.k4"] == "2.5000"
    assert tags["tide.gate.champion_al.english.k4"] == "3.0000"
    assert tags["tide.gate.weight.korean"] == "0.7500"
    assert tags["tide.gate.older_share.english"] == "1.0000"
    report = decision_report(decision, k=4, names={"challenger": "v7"})
    assert report.startswith("# Gate: PROMOTE v7")
    assert "| english | 0.25 | 1.00 | yes | 2.900 | 3.000 |" in report


@pytest.mark.parametrize(
    ("challenger", "champion", "weights", "older"),
    [
        ({"korean": 2.5, "english": 2.75}, CHAMPION, {"korean": 0.25, "english": 0.75}, None),
        ({"korean": 2.5, "english": 1.5}, CHAMPION, None, {"english": 0.5, "korean": 0.5}),
        ({"korean": 1.5}, None, None, None),
        ({"law.ko": 2.25, "cluster-3": 1.5}, {"law.ko": 2.0, "cluster-3": 1.5}, None, None),
    ],
)
@pytest.mark.parametrize("floor", [None, {"korean": 1.75, "english": 3.25}])
def test_recorded_decision_reads_back_equal(
    challenger: dict[str, float],
    champion: dict[str, float] | None,
    weights: dict[str, float] | None,
    older: dict[str, float] | None,
    floor: dict[str, float] | None,
) -> None:
    decision = dataclasses.replace(
        decide(challenger, champion, CONFIG, weights, older, floor=floor),
        challenger_by_k={3: {s: v - 0.25 for s, v in challenger.items()}},
        champion_by_k={3: dict(champion)} if champion else {},
        floor_version="1" if floor else None,
    )
    tags = {"mlflow.user": "someone", "tide.segmenter": "x", **decision_tags(decision, k=4)}
    assert decision_from_tags(tags, k=4) == decision
    assert decision_from_tags({"mlflow.user": "someone"}, k=4) is None
    assert list(decision_tags(decision, k=4))[-1] == "tide.gate.decision"  # written last


def test_a_decision_recorded_halfway_is_not_read_back() -> None:
    tags = decision_tags(decide({"korean": 2.5}, CHAMPION, CONFIG), k=4)
    written_before_a_crash = dict(list(tags.items())[:2])
    assert decision_from_tags(written_before_a_crash, k=4) is None


def test_recent_segment_still_loads_but_says_it_is_deprecated() -> None:
    with pytest.warns(DeprecationWarning, match="recent_segment is deprecated"):
        config = TideConfig(gate={"recent_segment": "recent"})  # type: ignore[arg-type]
    assert config.gate.recent_segment == "recent"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GateConfig()  # the default says nothing


def test_the_paired_drop_and_its_error() -> None:
    """Both drafts replayed on the same requests: the error comes from how the requests'
    changes disagree, not from how the requests differ from each other."""
    from tide_lib.evaluation.offline import paired_drop, significant_drop

    before = [(30, 10), (12, 10), (50, 20)]  # 3.0, 1.2, 2.5 tokens per verify
    steady = [(e - v // 2, v) for e, v in before]  # every request loses 0.5
    drop, error = paired_drop(before, steady)
    assert drop == pytest.approx(92 / 40 - 72 / 40) and error == pytest.approx(0.0, abs=1e-12)
    assert significant_drop(before, steady, tolerance=0.2) == pytest.approx(0.5)
    mixed = [(10, 10), (30, 10), (30, 20)]  # one request collapses, one gains
    drop, error = paired_drop(before, mixed)
    assert drop == pytest.approx(92 / 40 - 70 / 40) and error > 0.3
    assert significant_drop(before, mixed, tolerance=0.2) is None  # 0.55 is within the noise
    two = [(20, 10), (20, 10)], [(17, 10), (16, 10)]  # both fell, but two requests say little
    assert paired_drop(*two)[0] > 0.2 and significant_drop(*two, tolerance=0.2) is None
    assert paired_drop(before[:1], mixed[:1])[1] == float("inf")  # one request: no estimate
    with pytest.raises(ValueError, match="same requests"):
        paired_drop(before, mixed[:2])


def test_a_drop_within_its_noise_does_not_reject() -> None:
    challenger = {"korean": 3.5, "english": 2.7}  # english drops 0.3 > tolerance 0.2
    shares = {"korean": 0.5, "english": 0.5}
    noisy = decide(challenger, CHAMPION, CONFIG, weights=shares, drop_margins={"english": 0.15})
    assert noisy.promote
    sure = decide(challenger, CHAMPION, CONFIG, weights=shares, drop_margins={"english": 0.05})
    assert not sure.promote and "margin of error 0.050" in sure.reason
    from tide_lib.evaluation.gate import t95

    assert t95(1) > t95(2) > t95(9) > t95(25) > t95(1000) == pytest.approx(1.658)
    assert t95(11) == t95(10)  # between tabulated points: the stricter quantile
    assert t95(0) == float("inf")


def test_losses_within_the_tolerance_cannot_add_up_below_the_floor() -> None:
    """Each promotion may lose up to the tolerance on a protected segment; the floor
    (the baseline draft on the same requests) does not move with the champion."""
    shares = {"korean": 0.8, "english": 0.2}
    eroded = {"korean": 2.5, "english": 3.0}  # the champion: english already 0.4 under
    floor = {"korean": 1.0, "english": 3.4}
    challenger = {"korean": 3.0, "english": 2.9}  # -0.1 on english: within the tolerance
    assert decide(challenger, eroded, CONFIG, weights=shares).promote
    below = decide(challenger, eroded, CONFIG, weights=shares, floor=floor)
    assert not below.promote
    assert "segment 'english': 2.900 vs floor 3.400" in below.reason, below.reason
    assert "small losses would add up" in below.reason
    # within the noise of the drop below the floor: no rejection
    noisy = decide(
        challenger, eroded, CONFIG, weights=shares, floor=floor, floor_margins={"english": 0.4}
    )
    assert noisy.promote, noisy.reason
    # a segment already below the floor only needs not to fall further (beyond the noise)
    kept = decide({"korean": 3.0, "english": 3.0}, eroded, CONFIG, weights=shares, floor=floor)
    assert kept.promote, kept.reason
    dipped = {"korean": 3.0, "english": 2.95}
    noise = {"english": 0.1}
    assert decide(dipped, eroded, CONFIG, weights=shares, floor=floor, drop_margins=noise).promote
    assert not decide(dipped, eroded, CONFIG, weights=shares, floor=floor).promote
    assert kept.floor == floor
    report = decision_report(below, k=4)
    assert "| english | 0.20 | - | yes | 2.900 | 3.000 | 3.400 |" in report


def test_the_gain_is_measured_on_the_window_requests_of_a_segment() -> None:
    """Korean law joined the cluster of Korean chat: its held-out requests mix the older
    chat (served well by both) with the window's law (what the challenger learned)."""
    champion, challenger = {"korean": 3.0, "english": 3.0}, {"korean": 3.05, "english": 3.0}
    shares = {"korean": 1.0}
    diluted = decide(challenger, champion, CONFIG, weights=shares)
    assert not diluted.promote and "gain +0.050 < margin" in diluted.reason
    law = decide(
        challenger,
        champion,
        CONFIG,
        weights=shares,
        window_figures=({"korean": 2.0}, {"korean": 1.0}),
    )
    assert law.promote and "2.000 vs champion 1.000 (gain +1.000" in law.reason
    assert law.challenger == challenger  # the segment's figures, as recorded, are all of it
    # what the promotion learned, for the headroom check's last gain, is the law's gain
    assert law.gains() == pytest.approx({"korean": 1.0, "english": 0.0})
    assert diluted.gains() == pytest.approx({"korean": 0.05, "english": 0.0})
    assert decision_from_tags(decision_tags(law, k=4), k=4) == law


def test_traffic_to_keep_may_not_lose_more_than_the_window_gains() -> None:
    """Seen in the demo benchmark: a cycle sent to go on learning Korean gained +0.131
    window-weighted while English, judged together, fell 3.060 -> 2.667, within its
    margin of error, and was promoted."""
    tokens = {"korean": 400, "en-a": 200, "en-b": 200}
    champion = {"korean": 3.00, "en-a": 3.1, "en-b": 3.0}
    learning = {"korean": 3.13, "en-a": 2.7, "en-b": 2.6}  # +0.13 on the window
    shares, older = {"korean": 1.0}, {"en-a": 0.5, "en-b": 0.5}

    def pooled(segments: tuple[str, ...]) -> tuple[float, float, float]:
        return 3.06, 2.667, 0.5  # a drop of 0.393, within tolerance + margin

    kwargs = {"weights": shares, "older_shares": older, "held_out_tokens": tokens}
    margins = {"en-a": 0.6, "en-b": 0.6}
    config = GateConfig(margin=0.05, tolerance=0.1, min_segment_share=0.1)
    decision = decide(learning, champion, config, **kwargs, drop_margins=margins, pooled=pooled)
    assert not decision.promote
    assert "traffic to keep loses more than the window gains" in decision.reason
    assert "drop 0.393 > window-weighted gain +0.130" in decision.reason
    assert "no drop beyond the tolerance" not in decision.reason  # rule 2's verdict, not 5's
    # a gain larger than the loss is a trade the gate takes; so does net_gain off
    learned = {**learning, "korean": 3.6}
    assert decide(learned, champion, config, **kwargs, drop_margins=margins, pooled=pooled).promote
    off = config.model_copy(update={"net_gain": False})
    assert decide(learning, champion, off, **kwargs, drop_margins=margins, pooled=pooled).promote
