"""Distillation toward the parent draft on replayed traffic: training without forgetting.

Trained on a new window, a draft forgets the traffic it used to serve, and
replaying older samples alone did not stop it in TIDE's benchmarks. So on replay
samples a warm start adds ``distill_weight`` x KL(parent || student): the frozen
parent (the serving champion) runs the same EAGLE3 training-time-test unroll on
the same batch, and at every unrolled position the student's draft distribution
is pulled toward the parent's. The gradient on the student's logits is
``q - p`` (student minus parent probabilities), so it vanishes when the student
equals the parent.

When the warm start rebuilt the draft vocabulary, the two drafts predict over
different token sets. Both are compared on the student's draft tokens: the
parent's distribution is restricted to the tokens both can draft and
renormalised there; a token only the student can draft has parent probability 0.
"""

from __future__ import annotations

__all__ = ["LogitTap", "LossMaskTap", "distill_kl", "teacher_columns"]

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from tide_lib.training.draft import draft_tokens


def teacher_columns(student_d2t: torch.Tensor, teacher_d2t: torch.Tensor) -> torch.Tensor:
    """For each student draft token, the teacher's draft row of the same target token, or -1."""
    teacher_row = {int(t): row for row, t in enumerate(draft_tokens(teacher_d2t.cpu()).tolist())}
    columns = [teacher_row.get(int(t), -1) for t in draft_tokens(student_d2t.cpu()).tolist()]
    return torch.tensor(columns, dtype=torch.int64, device=student_d2t.device)


def _shifted(mask: torch.Tensor, step: int) -> torch.Tensor:
    """The loss mask SpecForge uses at TTT step ``step``: shifted left, zeros at the end."""
    if step == 0:
        return mask
    return torch.cat((mask[:, step:], torch.zeros_like(mask[:, :step])), dim=1)


def distill_kl(
    student_logits: Sequence[torch.Tensor],
    teacher_logits: Sequence[torch.Tensor],
    loss_mask: torch.Tensor,
    columns: torch.Tensor,
    decay: float,
) -> torch.Tensor:
    """Sum over TTT steps i of ``decay**i`` x mean KL(teacher || student) on masked positions.

    ``student_logits``/``teacher_logits``: one ``[B, S, V]`` tensor per TTT step (the
    drafts' own vocabularies); ``loss_mask``: ``[B, S]`` or ``[B, S, 1]`` as SpecForge
    preprocesses it; ``columns``: :func:`teacher_columns`. The teacher side carries no
    gradient.
    """
    shared = columns >= 0
    if not bool(shared.any()):
        raise ValueError("the parent and the student share no draft token: nothing to distill")
    gather = columns.clamp(min=0)
    total = student_logits[0].new_zeros((), dtype=torch.float32)
    for step, (student, teacher) in enumerate(zip(student_logits, teacher_logits, strict=True)):
        mask = _shifted(loss_mask.reshape(student.shape[:2]).float(), step)
        teacher_on_student = teacher.detach().float()[..., gather]
        teacher_on_student = teacher_on_student.masked_fill(~shared, float("-inf"))
        parent_log_p = torch.log_softmax(teacher_on_student, dim=-1)
        parent_p = parent_log_p.exp()
        student_log_q = torch.log_softmax(student.float(), dim=-1)
        safe_log_p = torch.where(parent_p > 0, parent_log_p, torch.zeros_like(parent_log_p))
        kl = (parent_p * (safe_log_p - student_log_q)).sum(dim=-1)
        total = total + decay**step * (kl * mask).sum() / mask.sum().clamp_min(1.0)
    return total


class LogitTap:
    """Collects a draft's logits (its ``lm_head`` outputs, one per TTT step) inside
    :meth:`recording` only: replaying the draft for evaluation must not add to them."""

    def __init__(self, lm_head: torch.nn.Module) -> None:
        self.outputs: list[torch.Tensor] | None = None
        self.handle = lm_head.register_forward_hook(self._hook)

    def _hook(self, _module: torch.nn.Module, _args: Any, output: torch.Tensor) -> None:
        if self.outputs is not None:
            self.outputs.append(output)

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        outputs: list[torch.Tensor] = []
        self.outputs = outputs
        try:
            yield outputs
        finally:
            self.outputs = None


class LossMaskTap:
    """The loss mask SpecForge's EAGLE3 model is called with (after preprocessing)."""

    def __init__(self, eagle3_model: torch.nn.Module) -> None:
        self.loss_mask: torch.Tensor | None = None
        self.handle = eagle3_model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(
        self, _module: torch.nn.Module, _args: Any, kwargs: dict[str, Any]
    ) -> tuple[Any, dict[str, Any]] | None:
        self.loss_mask = kwargs.get("loss_mask")
        return None

    def take(self) -> torch.Tensor:
        if self.loss_mask is None:
            raise RuntimeError("SpecForge's EAGLE3 model was not called with a loss_mask")
        mask, self.loss_mask = self.loss_mask, None
        return mask
