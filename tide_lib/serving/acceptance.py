"""Acceptance length, pooled as SGLang pools it: tokens emitted / target verify steps.

The bonus token of each verify step counts, so a draft that is always rejected
still scores 1.0. One accumulator for every source of the figure: an SGLang
response's ``meta_info`` (``spec_accept_length`` x ``spec_verify_ct``), a
captured record (``spec_accept_tokens`` + ``spec_verify_ct``), offline replay
(tokens emitted and verify steps counted directly), an engine's own counters.
Per-request pairs are kept, for margins of error, unless ``keep_requests`` is off.
"""

from __future__ import annotations

__all__ = ["AcceptanceCount"]

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any


@dataclasses.dataclass
class AcceptanceCount:
    """Pooled counts, and each request's ``(emitted, verify steps)`` when kept."""

    emitted: int = 0
    verify_steps: int = 0
    requests: int = 0
    per_request: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    keep_requests: bool = True  # off for long-lived counters (an engine's lifetime)

    @classmethod
    def of(cls, pairs: Iterable[tuple[int, int]]) -> AcceptanceCount:
        """Pooled counts of requests' ``(emitted, verify steps)`` pairs."""
        count = cls()
        for emitted, verify_steps in pairs:
            count.add(emitted, verify_steps)
        return count

    def add(self, emitted: int, verify_steps: int) -> None:
        """One request that emitted ``emitted`` tokens in ``verify_steps`` verify steps."""
        self.emitted += emitted
        self.verify_steps += verify_steps
        self.requests += 1
        if self.keep_requests:
            self.per_request.append((emitted, verify_steps))

    def add_accepted(self, accepted_draft_tokens: int, verify_steps: int) -> None:
        """One request by its accepted draft tokens (each verify step adds its bonus token)."""
        self.add(accepted_draft_tokens + verify_steps, verify_steps)

    def add_pooled(self, accept_length: float, verify_steps: int) -> None:
        """One request by its own pooled figure (what SGLang reports per response)."""
        self.add(round(accept_length * verify_steps), verify_steps)

    def add_meta(self, meta_info: Mapping[str, Any]) -> None:
        """One SGLang response's ``meta_info``; before a verify step it has no counts."""
        steps = int(meta_info.get("spec_verify_ct") or 0)
        self.add_pooled(float(meta_info.get("spec_accept_length") or 0.0), steps)

    @property
    def accept_length(self) -> float:
        return self.emitted / self.verify_steps if self.verify_steps else 0.0
