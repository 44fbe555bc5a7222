"""Defect 5 (issue 13): training skips non-finite steps and fails only when there are too many.

Real SpecForge forward/backward on the tiny target; one captured sample gets an inf.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tide_lib.config import TrainConfig
from tide_lib.training.trainer import list_samples, load_sample, train_draft

pytestmark = pytest.mark.slow

CONFIG = TrainConfig(
    steps=8,
    batch_size=1,
    ttt_length=2,
    draft_vocab_size=512,
    learning_rate=3e-3,
    log_every=2,
    validation_fraction=0,  # every sample is trained on: the bad one comes once per epoch
)


def _window_with_one_inf(captured: dict[str, Path], out: Path) -> Path:
    """Four captured samples; the third has one inf in its aux states (a bad record)."""
    out.mkdir()
    for index, path in enumerate(list_samples(captured["en_train"])[:4]):
        if index != 2:
            shutil.copy(path, out / path.name)
            continue
        sample = load_sample(path)
        sample["aux_hidden_state"] = sample["aux_hidden_state"].clone()
        sample["aux_hidden_state"][1, 0] = float("inf")
        torch.save(sample, out / path.name)
    return out


def test_defect5_non_finite_steps_are_skipped_and_the_draft_stays_finite(
    tiny_target: Path, captured: dict[str, Path], tmp_path: Path
) -> None:
    data = _window_with_one_inf(captured, tmp_path / "data")
    config = CONFIG.model_copy(update={"max_skipped_step_fraction": 0.5})
    result = train_draft(data, tiny_target, tmp_path / "run", config)
    # 8 steps of one sample over 4 samples: every epoch meets the bad one once.
    assert result.skipped_steps == 2
    assert math.isfinite(result.final_loss)
    weights = load_file(result.draft_dir / "model.safetensors")
    assert all(torch.isfinite(t.float()).all() for t in weights.values())


def test_defect5_too_many_non_finite_steps_fail_with_a_clear_error(
    tiny_target: Path, captured: dict[str, Path], tmp_path: Path
) -> None:
    data = _window_with_one_inf(captured, tmp_path / "data")
    with pytest.raises(RuntimeError, match="max_skipped_step_fraction"):
        train_draft(data, tiny_target, tmp_path / "run", CONFIG)  # default: at most 10%


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (Path.touch, (str(self.marker),))  # type: ignore[return-value]


def test_a_checkpoint_from_the_lake_cannot_run_code(tmp_path: Path) -> None:
    """Issue 13 review: checkpoints come back from the lake bucket, which engines can write;
    a pickle that runs code on load is refused, not executed."""
    import pickle

    from tide_lib.training.trainer import load_checkpoint

    marker = tmp_path / "ran"
    evil = tmp_path / "step-00000004.pt"
    torch.save({"step": 4, "payload": _Payload(marker)}, evil)
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(evil)
    assert not marker.exists()
