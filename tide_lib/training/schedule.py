"""Learning-rate schedule shared by every trainer in TIDE, and the warm-start recipe.

A warm start fine-tunes a serving draft on one window of traffic (often a few
dozen requests). Running it with a fresh draft's budget (hundreds of steps at the
full learning rate) overfits the window and forgets older traffic, so a warm
start's steps follow the number of samples (a few passes over them), its batch
never exceeds them, and its learning rate is scaled down.
"""

from __future__ import annotations

__all__ = ["StepPlan", "step_plan", "warmup_cosine"]

import dataclasses
import math

from tide_lib.config import TrainConfig


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, floor: float = 0.1) -> float:
    """Multiplier of the base learning rate at ``step`` (for ``LambdaLR``)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one training run does: optimizer steps, samples per step and process, rates."""

    steps: int
    batch_size: int
    learning_rate: float
    warmup_steps: int


def step_plan(config: TrainConfig, num_samples: int, *, warm: bool, world: int = 1) -> StepPlan:
    """The run's plan: ``config`` as given for a fresh draft, the recipe for a warm start.

    Warm start (``warm_epochs`` > 0): batch at most the samples each process gets,
    steps = ``warm_epochs`` passes over ``num_samples`` clamped to
    ``warm_min_steps..warm_max_steps``, learning rate x ``warm_lr_scale``, warmup at
    most a tenth of the steps.
    """
    if not warm or config.warm_epochs == 0:
        return StepPlan(config.steps, config.batch_size, config.learning_rate, config.warmup_steps)
    batch = max(1, min(config.batch_size, num_samples // world))
    passes = math.ceil(config.warm_epochs * num_samples / (batch * world))
    steps = min(max(passes, config.warm_min_steps), config.warm_max_steps)
    return StepPlan(
        steps=steps,
        batch_size=batch,
        learning_rate=config.learning_rate * config.warm_lr_scale,
        warmup_steps=min(config.warmup_steps, steps // 10),
    )
