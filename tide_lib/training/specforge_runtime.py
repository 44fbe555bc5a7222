"""Running SpecForge's EAGLE3 code on the device at hand.

SpecForge's objective uses a Triton kernel for the soft-label cross entropy and
``torch.compile`` for the teacher projection. On a GPU host both run as shipped.
On CPU, Triton only runs in its (very slow) interpreter and Dynamo adds nothing,
so TIDE disables Dynamo and swaps in SpecForge's own torch reference loss,
which computes the same numbers. The choice is a registry keyed by backend name
and picked by device, never a flag buried in training code.
"""

from __future__ import annotations

__all__ = ["LOSS_BACKENDS", "LossBackend", "prepare_specforge", "resolve_loss_backend"]

import logging
import os
from collections.abc import Callable
from typing import Any, Final, Literal

import torch

logger = logging.getLogger(__name__)

LossBackend = Literal["triton", "torch"]


class TorchLogSoftmaxLoss:
    """SpecForge's reference loss (``core.loss._compute_loss``) behind the kernel's API."""

    @staticmethod
    def apply(
        logits: torch.Tensor, target: torch.Tensor, position_mask: torch.Tensor
    ) -> torch.Tensor:
        log_probs = torch.nn.functional.log_softmax(logits.float(), dim=-1)
        return -torch.sum(position_mask * target * log_probs, dim=-1).mean()


def _triton_loss() -> Any:
    from specforge.core.loss import LogSoftmaxLoss  # noqa: PLC0415

    return LogSoftmaxLoss


LOSS_BACKENDS: Final[dict[str, Callable[[], Any]]] = {
    "triton": _triton_loss,
    "torch": lambda: TorchLogSoftmaxLoss,
}


def resolve_loss_backend(device: str, requested: str = "auto") -> LossBackend:
    """``auto`` means Triton on CUDA and the torch reference elsewhere."""
    if requested == "auto":
        return "triton" if device.startswith("cuda") else "torch"
    if requested not in LOSS_BACKENDS:
        raise ValueError(
            f"unknown loss backend {requested!r}; choose auto, {', '.join(LOSS_BACKENDS)}"
        )
    return requested  # type: ignore[return-value]


def prepare_specforge(device: str, loss_backend: str = "auto") -> LossBackend:
    """Configure the process for SpecForge on ``device``; returns the loss backend in use."""
    backend = resolve_loss_backend(device, loss_backend)
    if not device.startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
        torch._dynamo.config.disable = True
    import specforge.algorithms.eagle3.model as eagle3_model  # noqa: PLC0415

    eagle3_model.LogSoftmaxLoss = LOSS_BACKENDS[backend]()
    logger.debug("SpecForge EAGLE3 loss backend: %s on %s", backend, device)
    return backend
