"""Which finished requests a server keeps for training: one rule for every server TIDE runs.

The reference engine and the SGLang plugin both call :func:`capture_wanted`, so a
sampling rate and a selective-capture threshold (skip requests the draft already
serves well, as Moreh's SGLang fork does) mean the same thing on either.
"""

from __future__ import annotations

__all__ = ["capture_wanted", "sampled", "serves_well"]

import random

from tide_lib.config import ServeConfig


def serves_well(serve: ServeConfig, accepted_draft_tokens: int, drafted_tokens: int) -> bool:
    """True when the draft's acceptance rate is at or above ``capture_skip_accept_rate``."""
    threshold = serve.capture_skip_accept_rate
    rate = accepted_draft_tokens / drafted_tokens if drafted_tokens else 0.0
    return threshold is not None and rate >= threshold


def sampled(serve: ServeConfig, rng: random.Random) -> bool:
    """True for a ``capture_sample_rate`` share of requests."""
    return rng.random() < serve.capture_sample_rate


def capture_wanted(
    serve: ServeConfig, accepted_draft_tokens: int, drafted_tokens: int, rng: random.Random
) -> bool:
    """True when a finished request should go to the lake: sampled, and not served well."""
    return not serves_well(serve, accepted_draft_tokens, drafted_tokens) and sampled(serve, rng)
