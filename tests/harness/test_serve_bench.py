"""``tide bench serve`` writes its JSON contract (figures are measured, not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tide_lib.config import TideConfig
from tide_lib.harness.params import ServeBenchParams
from tide_lib.harness.serve_bench import run_serve_bench

pytestmark = pytest.mark.slow


def test_serve_bench_writes_the_json_keys(
    stack: TideConfig, tiny_target: Path, tiny_drafts: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "serve.json"
    run_serve_bench(
        stack,
        tiny_target,
        out,
        ServeBenchParams(
            draft=tiny_drafts["en"], prompts=3, max_new_tokens=8, speculative_num_steps=3, settle=4
        ),
        preset="tiny",
    )
    result = json.loads(out.read_text())
    for key in (
        "capture_on_tokens_per_s",
        "capture_off_tokens_per_s",
        "spec_tokens_per_s",
        "adaptive_tokens_per_s",
        "plain_tokens_per_s",
        "accept_length",
        "swap_seconds",
    ):
        assert result[key] > 0, key
    assert result["failed_requests"] == 0 and result["swap_load_requests"] > 0
    assert result["adaptive_k"] in range(4)
    timed = result["adaptive"]["timed_requests_by_k"]
    assert sum(timed.values()) == 3 * 2 and set(timed) == {"0", "1", "2", "3"}  # two passes
    # adaptive k learned beside plain decoding first, the prompts in turn; reported apart
    settling = result["adaptive"]["settling"]
    assert settling["requests"] == 4 and sum(settling["requests_by_k"].values()) == 4
    assert settling["adaptive_vs_plain"] > 0
    paired = result["adaptive_vs_plain_paired"]  # request by request, 3 prompts x 2 passes
    assert paired["requests"] == 6 and paired["low"] <= paired["ratio"] <= paired["high"]
    by_pass = result["adaptive_vs_plain_by_pass"]
    assert len(by_pass) == 2 and all(ratio > 0 for ratio in by_pass)
    assert result["adaptive_vs_plain"] == pytest.approx(
        result["adaptive_tokens_per_s"] / result["plain_tokens_per_s"]
    )
