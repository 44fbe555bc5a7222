"""The no-drift rule: the champion is compared with its own baseline, segment by segment."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from tide_lib.evaluation.drift import (
    carried_gain,
    judge_drift,
    judge_window,
    pooled_gain,
    still_learning,
)
from tide_lib.evaluation.gate import GateDecision
from tide_lib.evaluation.offline import (
    acceptance_ceiling,
    fall_below,
    length_margin,
    no_room_to_gain,
    replay_request,
)
from tide_lib.serving.acceptance import AcceptanceCount


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


def test_a_fall_within_its_margin_of_error_is_not_drift() -> None:
    """The no-shift case: a cluster of three sampled requests served at 2.0 against
    a baseline average of 2.2 is noise; the same fall measured tightly is drift."""
    few = [(8, 4), (4, 4), (12, 4)]  # 2.0 pooled, per-request 1..3
    margin = length_margin(few)
    assert margin > 0.5
    kwargs = {"tolerance": 0.15, "min_share": 0.1}
    noisy = judge_drift({"c2": 2.0}, {"c2": 1.0}, {"c0": 2.2}, margins={"c2": margin}, **kwargs)
    assert not noisy.drift and "+/-" in noisy.reason
    many = [(8, 4)] * 40 + [(9, 4), (7, 4)]  # 2.0 pooled, tight
    tight = length_margin(many)
    assert tight < 0.05
    drift = judge_drift({"c2": 2.0}, {"c2": 1.0}, {"c0": 2.2}, margins={"c2": tight}, **kwargs)
    assert drift.drift and "margin of error" in drift.reason


def test_the_margin_of_one_figure_shrinks_with_requests_and_is_infinite_for_one() -> None:
    assert math.isinf(length_margin([(6, 3)]))
    spread = [(6, 3), (3, 3), (9, 3), (4, 3)]
    assert length_margin(spread * 8) < length_margin(spread) / 3
    assert length_margin([(6, 3)] * 5) == 0.0
    verdict = judge({"ko": 1.0}, {"ko": 1.0}, {"en": 3.0})
    assert verdict.drift  # no margins given: figures are taken as exact


def test_a_baseline_measured_on_a_sample_widens_the_margin() -> None:
    """Both figures are samples: the fall's margin is the root of their squares."""
    kwargs = {"tolerance": 0.15, "min_share": 0.1}
    exact = judge_drift({"en": 2.0}, {"en": 1.0}, {"en": 2.4}, margins={"en": 0.2}, **kwargs)
    assert exact.drift  # 0.4 - 0.2 > 0.15
    noisy = judge_drift(
        {"en": 2.0},
        {"en": 1.0},
        {"en": 2.4},
        margins={"en": 0.2},
        baseline_margins={"en": 0.2},
        **kwargs,
    )
    assert not noisy.drift  # 0.4 - 0.283 < 0.15


@dataclasses.dataclass
class _Answered:
    """A replayable request: ``prompt`` tokens, then ``output`` masked ones."""

    prompt: int
    output: int

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.arange(self.prompt + self.output)

    @property
    def loss_mask(self) -> torch.Tensor:
        return torch.tensor([0] * self.prompt + [1] * self.output)


def test_the_ceiling_is_what_output_lengths_allow_a_draft_that_is_never_wrong() -> None:
    # output tokens verified: the masked ones and the one the last state predicts;
    # the first comes from the prefill, so 2 tokens are one verify step at any k
    assert acceptance_ceiling([_Answered(5, 1)], 3) == 2.0
    assert acceptance_ceiling([_Answered(5, 8)], 3) == 4.0  # 4 + 4 tokens in 2 steps
    # 6 + 3: a last step drafting the 2 tokens left counts its bonus token, as replay does
    assert acceptance_ceiling([_Answered(5, 8)], 5) == pytest.approx(9 / 2)
    assert acceptance_ceiling([_Answered(5, 1), _Answered(5, 8)], 3) == pytest.approx(10 / 3)
    assert acceptance_ceiling([_Answered(5, 0)], 3) == 0.0  # nothing to verify
    assert acceptance_ceiling([], 3) == 0.0


class _Oracle:
    """A draft runner (as :func:`replay_request` drives one) that always drafts the
    true next token, or, ``wrong``, never does."""

    def __init__(
        self,
        tokens: list[int],
        vocab: int,
        wrong: bool = False,
        misses: frozenset[int] = frozenset(),
    ) -> None:
        self.tokens, self.vocab, self.wrong, self.position = tokens, vocab, wrong, 0
        self.misses = misses  # indices of ``tokens`` it drafts wrong (all of them if wrong)

    def reset(self) -> None:
        self.position = 0

    def crop(self, length: int) -> None:
        self.position = length

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        return aux

    def to_target_ids(self, token: torch.Tensor) -> int:
        return int(token)

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.position += len(tokens)
        following = self.position + 1
        token = self.tokens[following] if following < len(self.tokens) else 0
        logits = torch.zeros(self.vocab)  # the last position's, as DraftRunner.step
        logits[(token + 1) % self.vocab if self.wrong or following in self.misses else token] = 1.0
        return torch.zeros(len(tokens), 2), logits


def _record(prompt: int, output: int, vocab: int) -> tuple[list[int], Any]:
    """Tokens (with the one the last state predicts) and a record an identity head reads."""
    truth = [(7 * i + 3) % vocab for i in range(prompt + output + 1)]
    record = type(
        "Record",
        (),
        {
            "input_ids": torch.tensor(truth[:-1]),
            "loss_mask": _Answered(prompt, output).loss_mask,
            "hidden_states": torch.nn.functional.one_hot(torch.tensor(truth[1:]), vocab).float(),
            "aux_hidden_states": torch.zeros(len(truth) - 1, 2),
        },
    )()
    return truth, record


@pytest.mark.parametrize("every_position", [False, True])
@pytest.mark.parametrize("output", [1, 2, 5, 9, 14])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_the_ceiling_is_what_replay_measures_for_a_draft_that_is_never_wrong(
    output: int, k: int, every_position: bool
) -> None:
    vocab, prompt = 32, 4
    answered = _Answered(prompt, output)
    truth, record = _record(prompt, output, vocab)
    head = torch.nn.Identity()

    def replay(runner: _Oracle) -> tuple[int, int]:
        return replay_request(runner, head, record, k, every_position=every_position)  # type: ignore[arg-type]

    perfect, wrong = replay(_Oracle(truth, vocab)), replay(_Oracle(truth, vocab, True))
    count = AcceptanceCount()
    count.add(*perfect)
    ceiling = acceptance_ceiling([answered], k, every_position=every_position)
    assert count.accept_length == ceiling
    assert wrong[0] == wrong[1]  # never right: the bonus token of each verify, no more


@pytest.mark.parametrize("output", [1, 5, 14])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_draft_that_is_never_wrong_leaves_no_room_to_gain(output: int, k: int) -> None:
    """Replayed from every output position, a request's counts tell its ceiling: a draft
    at it leaves no room; one always wrong (1.0) leaves the ceiling less 1.0, and a gain
    of exactly that can still be shown."""
    vocab = 32
    truth, record = _record(4, output, vocab)

    def replay(runner: _Oracle) -> tuple[int, int]:
        return replay_request(runner, torch.nn.Identity(), record, k, every_position=True)  # type: ignore[arg-type]

    perfect, wrong = replay(_Oracle(truth, vocab)), replay(_Oracle(truth, vocab, True))
    room = acceptance_ceiling([_Answered(4, output)], k, every_position=True) - 1.0
    assert no_room_to_gain([perfect], k, 0.0) and no_room_to_gain([perfect], k, 0.05)
    assert not no_room_to_gain([wrong], k, room)
    assert no_room_to_gain([wrong], k, room + 0.01)
    # pooled, the two leave half the room of the one always wrong
    assert not no_room_to_gain([perfect, wrong], k, room / 2)
    assert no_room_to_gain([perfect, wrong], k, room / 2 + 0.01)
    assert no_room_to_gain([], k, 0.0)  # nothing to verify: nothing to gain


@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_round_from_every_position_counts_each_position_once(k: int) -> None:
    """Replayed from every output position, each round drafts from that position: its
    accepted tokens are the true ones drafted before the first miss, within the budget
    the output leaves, whatever earlier rounds accepted."""
    vocab, prompt, output = 32, 4, 12
    misses = frozenset({prompt + 3, prompt + 4, prompt + 9})  # token indices drafted wrong
    truth, record = _record(prompt, output, vocab)
    runner = _Oracle(truth, vocab, misses=misses)
    emitted, verify = replay_request(
        runner,  # type: ignore[arg-type]
        torch.nn.Identity(),
        record,
        k,
        every_position=True,
    )
    verified = output + 1  # the masked tokens and the one the last state predicts
    expected = 0
    for produced in range(1, verified):  # output[0] came from the prefill
        position = prompt + produced - 1  # the last verified token's index
        budget = min(k, verified - produced)
        accepted = 0
        while accepted < budget and position + 1 + accepted not in misses:
            accepted += 1
        expected += accepted + 1
    assert (emitted, verify) == (expected, verified - 1)
    # from round starts only (the engine's rule), fewer rounds, on the positions they reach
    rounds = replay_request(runner, torch.nn.Identity(), record, k)  # type: ignore[arg-type]
    assert rounds[1] < verified - 1


def test_a_segment_served_at_its_ceiling_is_no_drift() -> None:
    """Traffic the target answers in a token or two: no draft does better than the
    champion, so a low figure there is no reason to train (the drift trap)."""
    kwargs = {"tolerance": 0.15, "min_share": 0.1}
    measured, shares = {"en": 2.9, "law": 1.4}, {"en": 0.5, "law": 0.5}
    trapped = judge_drift(measured, shares, {"en": 3.0}, **kwargs)
    assert trapped.drift and set(trapped.drifted) == {"law"}
    capped = judge_drift(measured, shares, {"en": 3.0}, ceilings={"law": 1.5}, **kwargs)
    assert not capped.drift and "law 1.400 vs its ceiling" in capped.reason
    below = judge_drift({"law": 1.2}, {"law": 1.0}, {"en": 3.0}, ceilings={"law": 1.5}, **kwargs)
    assert below.drifted == {"law": pytest.approx(0.3)}  # held to the ceiling, and short of it
    loose = judge_drift(measured, shares, {"en": 3.0}, ceilings={"law": 4.0}, **kwargs)
    assert loose.drifted.keys() == {"law"}  # a ceiling above the reference, or unknown: no cap
    # answered in one token each: nothing verified, nothing a draft could do
    silent = judge_drift({"law": 0.0}, {"law": 1.0}, {"en": 3.0}, ceilings={"law": 0.0}, **kwargs)
    assert not silent.drift


def _promotion(promoted: dict[str, float], replaced: dict[str, float] | None) -> GateDecision:
    weights = {"en": 0.45, "ko": 0.5, "law": 0.05}
    protected = ("en", "ko", "law")
    return GateDecision(True, "", promoted, replaced, weights, 0.0, 0.0, protected=protected)


def test_a_promotion_for_a_large_gain_on_real_traffic_keeps_learning() -> None:
    promoted = {"en": 2.9, "ko": 1.9, "law": 1.9}
    replaced = {"en": 3.0, "ko": 1.2, "law": 1.2}
    gains = still_learning(_promotion(promoted, replaced), min_gain=0.25, min_share=0.1)
    # ko gained 0.7 on half the window; law as much on a sliver; en lost.
    assert gains == {"ko": pytest.approx(0.7)}
    smaller = _promotion(promoted, {**replaced, "ko": 1.7})
    assert still_learning(smaller, min_gain=0.25, min_share=0.1) == {}  # the chain ends
    assert still_learning(_promotion(promoted, replaced), min_gain=0.0, min_share=0.1) == {}
    assert still_learning(_promotion(promoted, None), min_gain=0.25, min_share=0.1) == {}
    rejected = dataclasses.replace(_promotion(promoted, replaced), promote=False)
    assert still_learning(rejected, min_gain=0.25, min_share=0.1) == {}
    thin = dataclasses.replace(_promotion(promoted, replaced), protected=("en",))
    assert still_learning(thin, min_gain=0.25, min_share=0.1) == {}  # ko: too few held out


def test_a_window_weighted_gain_names_the_segments_that_carried_it() -> None:
    """Korean too thin to protect alone carried the promotion's window-weighted gain: the
    next cycle learns Korean (its earlier requests too), not the English tail, which
    gained nothing, nor a sliver of law, however much it gained."""
    promoted = {"en": 2.9, "ko": 2.4, "ko2": 2.0, "law": 2.5}
    replaced = {"en": 3.0, "ko": 1.2, "ko2": 1.1, "law": 1.0}
    weights = {"en": 0.2, "ko": 0.5, "ko2": 0.25, "law": 0.05}
    thin = GateDecision(True, "", promoted, replaced, weights, 2.4, 1.5, protected=())
    assert still_learning(thin, min_gain=0.25, min_share=0.1) == {}  # none protected alone
    carried = carried_gain(thin, min_gain=0.25, min_share=0.1)
    assert carried == {"ko": pytest.approx(1.2), "ko2": pytest.approx(0.9)}
    assert carried_gain(thin, min_gain=0.0, min_share=0.1) == {}  # the rule is off
    assert (
        carried_gain(dataclasses.replace(thin, promote=False), min_gain=0.25, min_share=0.1) == {}
    )
    assert (
        carried_gain(dataclasses.replace(thin, champion=None), min_gain=0.25, min_share=0.1) == {}
    )


def test_the_pooled_gain_counts_every_held_out_request_together() -> None:
    promotion = GateDecision(True, "", {"ko": 2.4}, {"ko": 1.3}, {"ko": 1.0}, 2.35, 1.33)
    assert pooled_gain(promotion) == pytest.approx(1.02)
    assert still_learning(promotion, min_gain=0.25, min_share=0.1) == {}  # ko: not protected
    assert pooled_gain(dataclasses.replace(promotion, promote=False)) == 0.0
    assert pooled_gain(dataclasses.replace(promotion, weighted_champion=None)) == 0.0


def _window_kwargs(margins: dict[str, float]) -> dict[str, Any]:
    return {"tolerance": 0.15, "min_share": 0.1, "margins": margins}


def test_a_fall_spread_over_segments_too_thin_alone_is_drift_of_the_window() -> None:
    """A new language's first window, grouped by the old traffic's clusters: each cluster
    fell within its wide margin (few requests), the window as a whole beyond it."""
    requests = {
        "c0": [(20, 5), (10, 5), (15, 6), (8, 5)],  # 2.52 (+/- 1.18) against 3.2
        "c2": [(6, 6), (16, 8)],  # 1.57 (+/- 3.09) against 3.1
    }
    baseline = {"c0": 3.2, "c2": 3.1}
    counts = {s: AcceptanceCount.of(pairs) for s, pairs in requests.items()}
    measured = {s: count.accept_length for s, count in counts.items()}
    margins = {s: length_margin(pairs) for s, pairs in requests.items()}
    alone = judge_drift(measured, {"c0": 0.6, "c2": 0.4}, baseline, **_window_kwargs(margins))
    assert not alone.drift  # each fall is within its own margin of error
    whole = judge_window(requests, baseline, tolerance=0.15)
    assert whole.drift and "the window as a whole fell" in whole.reason
    assert set(whole.drifted) == {"c0", "c2"}
    assert whole.drifted["c2"] > whole.drifted["c0"] > 0.15


def test_the_window_as_a_whole_is_noise_on_few_requests_and_with_a_loose_baseline() -> None:
    requests = {"c0": [(13, 5), (16, 6)], "c2": [(9, 7)]}
    few = judge_window(requests, {"c0": 3.2, "c2": 3.1}, tolerance=0.15)
    assert not few.drift and "+/-" in few.reason
    tight = {"c0": [(16, 5)] * 20 + [(15, 5), (17, 5)]}  # 3.2 pooled, every request near it
    assert judge_window(tight, {"c0": 3.6}, tolerance=0.15).drift
    loose = judge_window(tight, {"c0": 3.6}, tolerance=0.15, reference_margins={"c0": 0.4})
    assert not loose.drift  # the baseline was itself a sample: 0.4 - 0.4 < 0.15


def test_the_window_names_only_segments_measured_well_enough_to_relearn() -> None:
    """A cycle relearns the older requests of every segment a drift names: one request's
    fall is no reason to (an English cluster of 28 tokens relearned fell 2.83 -> 1.98)."""
    requests = {"en": [(16, 5)] * 10 + [(15, 5), (17, 5)], "thin": [(27, 10)]}
    references = {"en": 3.6, "thin": 3.5}
    everything = judge_window(requests, references, tolerance=0.15)
    assert everything.drift and set(everything.drifted) == {"en", "thin"}
    named = judge_window(requests, references, tolerance=0.15, nameable={"en"})
    assert named.drift and set(named.drifted) == {"en"}
    unnamed = judge_window(requests, references, tolerance=0.15, nameable=set())
    assert unnamed.drift and unnamed.drifted == {} and "none measured well" in unnamed.reason
    nan = judge_window(requests, {"en": math.nan, "thin": 3.5}, tolerance=0.15)
    assert not nan.drift  # a figure that is no number judges nothing


def test_segments_served_at_their_own_references_are_no_fall_and_no_noise() -> None:
    """Requests of segments with different figures add evidence, not spread: each is held
    to its own segment's reference, so a window served at its references is exact."""
    requests = {"en": [(15, 5), (12, 4)], "law": [(6, 5), (12, 10)]}  # 3.0 and 1.2 exactly
    fall, margin = fall_below([(3.0, requests["en"]), (1.2, requests["law"])])
    assert fall == pytest.approx(0.0, abs=1e-12) and margin == pytest.approx(0.0, abs=1e-12)
    verdict = judge_window(requests, {"en": 3.0, "law": 1.2, "docs": 2.0}, tolerance=0.15)
    assert not verdict.drift and "fell 0.000" in verdict.reason
    assert math.isinf(fall_below([(3.0, [(6, 3)])])[1])  # one request: no margin
    unknown = judge_window({"new": [(5, 5), (6, 5)]}, {"en": 3.0}, tolerance=0.15)
    assert not unknown.drift and unknown.reason == "no request to judge the window on"
