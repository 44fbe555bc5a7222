"""The GPU smoke script: on a machine without a GPU or SGLang it says so and runs nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_smoke.py"


def test_without_a_gpu_it_says_why_and_exits_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--target", "t", "--draft", "a", "--draft2", "b"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr
    assert "GPU smoke test not run: no CUDA GPU" in result.stdout
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


def test_help_explains_what_it_checks() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True
    )
    assert "--draft2" in result.stdout and "SGLang" in result.stdout
