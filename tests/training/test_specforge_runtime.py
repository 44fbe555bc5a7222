"""The CPU loss is SpecForge's reference loss and agrees with its Triton kernel."""

from __future__ import annotations

import json
import subprocess
import sys

from tide_lib.training.specforge_runtime import resolve_loss_backend


def test_backend_follows_the_device() -> None:
    assert resolve_loss_backend("cpu") == "torch"
    assert resolve_loss_backend("cuda:0") == "triton"
    assert resolve_loss_backend("cpu", "triton") == "triton"


_COMPARE = """
import json, os, torch
from tide_lib.training.specforge_runtime import TorchLogSoftmaxLoss, prepare_specforge
prepare_specforge("cpu")
assert os.environ["TRITON_INTERPRET"] == "1"
from specforge.core.loss import LogSoftmaxLoss
torch.manual_seed(0)
logits = torch.randn(1, 6, 32, requires_grad=True)
target = torch.softmax(torch.randn(1, 6, 32), dim=-1)
mask = (torch.rand(1, 6, 1) > 0.3).float()
results = []
for loss_fn in (TorchLogSoftmaxLoss, LogSoftmaxLoss):
    loss = loss_fn.apply(logits, target, mask)
    loss.backward()
    results.append((loss.item(), logits.grad.flatten().tolist()))
    logits.grad = None
print(json.dumps(results))
"""


def test_torch_loss_equals_the_triton_kernel_in_value_and_gradient() -> None:
    # A fresh interpreter: Triton decides at import whether it interprets kernels,
    # and other tests may already have imported SpecForge's kernels.
    result = subprocess.run(
        [sys.executable, "-c", _COMPARE], capture_output=True, text=True, check=True, timeout=300
    )
    (torch_loss, torch_grad), (kernel_loss, kernel_grad) = json.loads(
        result.stdout.splitlines()[-1]
    )
    assert abs(torch_loss - kernel_loss) < 1e-6
    assert max(abs(a - b) for a, b in zip(torch_grad, kernel_grad, strict=True)) < 1e-6
