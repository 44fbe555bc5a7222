"""The cycle's figures for the gate, from per-request counts (no services needed)."""

from __future__ import annotations

from tide_lib.orchestration import cycle
from tide_lib.serving.acceptance import AcceptanceCount


def test_a_segment_is_measured_on_its_window_requests_once_they_are_enough() -> None:
    # law: two window requests (96 tokens at 4.0) before older requests at 1.0
    law = AcceptanceCount.of([(48, 12), (48, 12), (48, 48), (48, 48)])
    lengths = cycle._window_lengths({"law": law}, {"law": 2}, min_tokens=64)
    assert lengths == {"law": 4.0}


def test_one_window_request_is_too_few_and_the_segment_falls_back_to_all() -> None:
    # one 48-token window request is noise against gate.min_segment_tokens=64: left out,
    # so the gate (and GateDecision.gains) read the segment's figure on all its requests
    law = AcceptanceCount.of([(48, 12), (48, 48), (48, 48)])
    chat = AcceptanceCount.of([(48, 16)])
    lengths = cycle._window_lengths({"law": law, "chat": chat}, {"law": 1}, min_tokens=64)
    assert lengths == {}
    assert cycle._window_lengths({"law": law}, {"law": 1}, min_tokens=48) == {"law": 4.0}
