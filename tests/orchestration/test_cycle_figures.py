"""The cycle's figures for the gate, from per-request counts (no services needed)."""

from __future__ import annotations

import dataclasses

import torch

from tests.conftest import make_record
from tide_lib.config import GateConfig
from tide_lib.orchestration import cycle, export
from tide_lib.serving.acceptance import AcceptanceCount


def test_a_segment_is_measured_on_its_window_requests_once_they_are_enough() -> None:
    # law: two window requests (80 output tokens, a round from each, at 4.0) before
    # older requests at 1.0; (emitted, verify steps) per request
    law = AcceptanceCount.of([(160, 40), (160, 40), (48, 48), (48, 48)])
    lengths = cycle._window_lengths({"law": law}, {"law": 2}, min_tokens=64)
    assert lengths == {"law": 4.0}


def test_one_window_request_is_too_few_and_the_segment_falls_back_to_all() -> None:
    # one 40-token window request is noise against gate.min_segment_tokens=64: left out,
    # so the gate (and GateDecision.gains) read the segment's figure on all its requests;
    # it is the same for every draft (tokens, not what a draft accepted there)
    law = AcceptanceCount.of([(160, 40), (48, 48), (48, 48)])
    chat = AcceptanceCount.of([(160, 40)])
    lengths = cycle._window_lengths({"law": law, "chat": chat}, {"law": 1}, min_tokens=64)
    assert lengths == {}
    assert cycle._window_lengths({"law": law}, {"law": 1}, min_tokens=40) == {"law": 4.0}
    worse = AcceptanceCount.of([(40, 40), (48, 48), (48, 48)])  # another draft, same tokens
    assert cycle._window_lengths({"law": worse}, {"law": 1}, min_tokens=40) == {"law": 1.0}


def test_a_request_answered_with_no_token_is_never_held_out() -> None:
    """It has nothing to verify: held out, it would only narrow the margins of error."""
    records = [  # as the lake reader yields them: torch tensors
        dataclasses.replace(
            record,
            input_ids=torch.from_numpy(record.input_ids),
            loss_mask=torch.from_numpy(record.loss_mask).long(),
        )
        for record in (make_record(index) for index in range(200))
    ]
    held = [record for record in records if export._held_out(record, 50)]
    assert held  # about half of the answered ones
    silent = [dataclasses.replace(r, loss_mask=torch.zeros_like(r.loss_mask)) for r in held]
    assert not any(export._held_out(record, 50) for record in silent)


def test_a_window_that_leaves_the_champion_no_room_is_judged_with_its_older_requests() -> None:
    """Short answers the champion already serves at their ceiling cannot show a gain: the
    gate measures that segment's gain on all its held-out requests, older ones too."""
    gate = GateConfig(margin=0.05)
    # 8 output tokens replayed from every position at k=3: at most 29 emitted in 8 rounds
    full = AcceptanceCount.of([(29, 8), (29, 8), (16, 8)])  # two window requests, one older
    room = AcceptanceCount.of([(20, 8), (29, 8), (16, 8)])
    window = {"ko": 2, "en": 2}
    assert cycle._window_with_room({"ko": full, "en": room}, window, 3, gate) == {"ko": 0, "en": 2}
    # 0.0625 below the ceiling: room for a gain of 0.05 (or of exactly 0.0625), not of 0.1
    near = AcceptanceCount.of([(28, 8), (29, 8), (16, 8)])
    assert cycle._window_with_room({"ko": near}, window, 3, gate) == window
    exact = GateConfig(margin=0.0625)
    assert cycle._window_with_room({"ko": near}, window, 3, exact) == window
    wide = GateConfig(margin=0.1)
    assert cycle._window_with_room({"ko": near}, window, 3, wide) == {"ko": 0, "en": 2}
    # no champion (a first cycle): nothing to judge the room by
    assert cycle._window_with_room({}, window, 3, gate) == window
