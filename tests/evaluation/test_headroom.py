"""The headroom rule: train where a draft reaches well above what the champion serves.

Also what it reads from offline replay: a figure's margin of error, and the ceiling a
segment's output lengths allow a draft that is never wrong."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from tide_lib.evaluation.headroom import HeadroomState, SegmentFigure, judge_headroom
from tide_lib.evaluation.offline import (
    acceptance_ceiling,
    length_margin,
    no_room_to_gain,
    replay_request,
)
from tide_lib.serving.acceptance import AcceptanceCount


def test_the_margin_of_one_figure_shrinks_with_requests_and_is_infinite_for_one() -> None:
    assert math.isinf(length_margin([(6, 3)]))
    spread = [(6, 3), (3, 3), (9, 3), (4, 3)]
    assert length_margin(spread * 8) < length_margin(spread) / 3
    assert length_margin([(6, 3)] * 5) == 0.0


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


def _judge(window: dict[str, SegmentFigure], known: HeadroomState | None = None):
    return judge_headroom(window, known or HeadroomState(), tolerance=0.15, min_share=0.1)


def _figure(value: float, share: float = 0.5, margin: float = 0.1, **kw: Any) -> SegmentFigure:
    return SegmentFigure(value, margin, share, **kw)


def test_a_champions_failure_is_never_its_baseline() -> None:
    """Traffic no cycle trained on is estimated at its ceiling: a champion at 1.0 there
    has headroom from the first window on, with no baseline at all, and the segment it
    already serves well is probed once too (nothing tells the check it cannot gain)."""
    window = {"en": _figure(3.0, ceiling=4.0), "ko": _figure(1.0, ceiling=4.5)}
    verdict = _judge(window)
    assert verdict.train and verdict.learn == ["en", "ko"] and verdict.keep == []
    assert verdict.estimates == {"en": 4.0, "ko": 4.5}
    # English was trained on and gained nothing; Korean gained 1.2: Korean trains again
    known = HeadroomState(reached={"en": 2.9, "ko": 0.9})
    known = known.with_reached({"ko": 2.2}).after_trial({"en": 0.0, "ko": 1.2}, {}, 0.15)
    later = {"en": _figure(3.0, share=0.2, ceiling=4.0), "ko": _figure(2.2, ceiling=4.5)}
    verdict = _judge(later, known)
    assert verdict.learn == ["ko"] and verdict.keep == ["en"]
    assert verdict.estimates == {"en": pytest.approx(2.9), "ko": pytest.approx(2.8)}


def test_the_learning_curve_flattens_and_a_fall_is_headroom_again() -> None:
    known = HeadroomState(reached={"ko": 2.6}, last_gain={"ko": 0.2})  # expect +0.1
    window = {"ko": _figure(2.6, share=1.0, ceiling=4.5)}
    assert not _judge(window, known).train and "no headroom" in _judge(window, known).reason
    # the same champion served below what was reached there: headroom
    fell = {"ko": _figure(2.2, share=1.0, ceiling=4.5)}
    assert _judge(fell, known).learn == ["ko"]
    # a cycle that lost there expects nothing more; what the champion serves is what was
    # reached (a luckier figure before would keep it training in vain)
    lucky = known.with_reached({"ko": 3.2})
    settled = lucky.after_trial({"ko": -0.3}, {"ko": 2.5}, 0.15)
    assert settled.estimate("ko", 4.5) == pytest.approx(2.5)
    assert not _judge({"ko": _figure(2.6, share=1.0, ceiling=4.5)}, settled).train
    assert _judge({"ko": _figure(2.6, share=1.0, ceiling=4.5)}, lucky).train  # in vain
    # a gain above the tolerance settles nothing
    assert lucky.after_trial({"ko": 0.5}, {"ko": 2.5}, 0.15).reached["ko"] == 3.2
    assert known.with_reached({"ko": 3.0}).estimate("ko", 2.9) == 2.9  # at most the ceiling


def test_a_fitted_champion_on_unshifted_traffic_trains_once_at_most() -> None:
    window = {"en": _figure(3.0, share=1.0, ceiling=4.0)}
    assert _judge(window).train  # probed once
    known = HeadroomState().with_reached({"en": 2.9}).after_trial({"en": 0.02}, {}, 0.15)
    assert not _judge(window, known).train
    # within its margin of error of the estimate: noise, not headroom
    noisy = {"en": _figure(2.95, share=0.6, margin=0.3, ceiling=4.0)}
    assert not _judge(noisy, known.with_reached({"en": 3.2})).train


def test_shares_and_margins_weigh_in() -> None:
    known = HeadroomState(reached={"en": 3.0, "x": 1.0, "ko": 1.0})
    known = known.after_trial({"en": 0.0, "x": 2.0, "ko": 2.0}, {}, 0.15)  # x, ko: +1.0
    # a sliver of the window never trains alone, but is learned when the cycle trains
    sliver = {"en": _figure(3.0, share=0.95), "x": _figure(1.0, share=0.05)}
    assert not _judge(sliver, known).train
    both = {**sliver, "ko": _figure(1.0, share=0.5)}
    assert _judge(both, known).learn == ["ko", "x"]
    # one request (no margin of error) is no evidence either
    assert not _judge({"ko": _figure(1.0, margin=math.inf)}, known).train
    # no ceiling known: no bound on a segment never trained on
    assert HeadroomState().estimate("new", None) == math.inf
    # a figure that is not finite (one request's lower bound) reaches nothing
    assert HeadroomState().with_reached({"a": -math.inf}).reached == {}


def test_a_thin_trial_does_not_settle_traffic_that_then_fills_the_window() -> None:
    """The first window holds a little of a segment the champion serves near 1.0; the
    cycle's draft gains nothing there (a few steps' worth of it). When the next windows
    are mostly that segment, it is probed again at its ceiling, not held to that trial."""
    first = {"en": _figure(3.4, share=0.87, ceiling=4.5), "ko": _figure(1.5, share=0.13)}
    known = HeadroomState().with_reached({"en": 3.3, "ko": 1.4})
    shares = {s: f.share for s, f in first.items()}
    known = known.after_trial({"en": 0.0, "ko": -0.1}, {"en": 3.3, "ko": 1.39}, 0.15, shares)
    same_mix = {"en": _figure(3.4, share=0.85, ceiling=4.5), "ko": _figure(1.4, share=0.15)}
    assert not _judge(same_mix, known).train  # the trial speaks for traffic like its own
    filled = {"ko": _figure(1.4, share=1.0, ceiling=4.2)}
    verdict = _judge(filled, known)
    assert verdict.train and verdict.learn == ["ko"] and verdict.estimates["ko"] == 4.2
    # once trained on as most of the window, what that trial finds holds
    after = known.after_trial({"ko": 0.05}, {"ko": 1.38}, 0.15, {"ko": 1.0})
    assert not _judge(filled, after).train
    # a trial without shares (an older record) spoke for all of the segment's traffic
    assert HeadroomState().after_trial({"ko": 0.0}, {"ko": 1.4}, 0.15).trial_share == {"ko": 1.0}
