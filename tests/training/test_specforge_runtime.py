"""The CPU loss is SpecForge's reference loss and agrees with its Triton kernel."""

from __future__ import annotations

import os

import torch

from tide_lib.training.specforge_runtime import (
    TorchLogSoftmaxLoss,
    prepare_specforge,
    resolve_loss_backend,
)


def test_backend_follows_the_device() -> None:
    assert resolve_loss_backend("cpu") == "torch"
    assert resolve_loss_backend("cuda:0") == "triton"
    assert resolve_loss_backend("cpu", "triton") == "triton"


def test_torch_loss_equals_the_triton_kernel_in_value_and_gradient() -> None:
    prepare_specforge("cpu")
    assert os.environ["TRITON_INTERPRET"] == "1"
    from specforge.core.loss import LogSoftmaxLoss

    torch.manual_seed(0)
    logits = torch.randn(1, 6, 40, requires_grad=True)
    target = torch.softmax(torch.randn(1, 6, 40), dim=-1)
    mask = (torch.rand(1, 6, 1) > 0.3).float()
    results = []
    for loss_fn in (TorchLogSoftmaxLoss, LogSoftmaxLoss):
        loss = loss_fn.apply(logits, target, mask)
        loss.backward()
        results.append((loss.detach(), logits.grad.clone()))
        logits.grad = None
    (torch_loss, torch_grad), (kernel_loss, kernel_grad) = results
    assert torch.allclose(torch_loss, kernel_loss, atol=1e-6)
    assert torch.allclose(torch_grad, kernel_grad, atol=1e-6)
