"""Learning-rate schedule shared by every trainer in TIDE: linear warmup, cosine to 10%."""

from __future__ import annotations

import math

__all__ = ["warmup_cosine"]


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, floor: float = 0.1) -> float:
    """Multiplier of the base learning rate at ``step`` (for ``LambdaLR``)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
