"""``tide bench train`` runs through the real lake and writes its JSON contract."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tide_lib.config import TideConfig
from tide_lib.harness.train_bench import TrainBenchParams, run_train_bench

pytestmark = pytest.mark.slow


def test_train_bench_writes_the_json_keys(
    stack: TideConfig, tiny_target: Path, tmp_path: Path
) -> None:
    config = stack.model_copy(
        update={"lake": stack.lake.model_copy(update={"prefix": "bench-test"})}
    )
    out = tmp_path / "train.json"
    run_train_bench(
        config,
        TrainBenchParams(samples=6, steps=2, batch_size=2, ttt_length=2, draft_vocab_size=256),
        tiny_target,
        out,
        preset="tiny",
    )
    result = json.loads(out.read_text())
    for key in (
        "reuse_tokens_per_s",
        "recompute_tokens_per_s",
        "recompute_over_reuse_time",
        "peak_rss_mb",
    ):
        assert result[key] > 0, key
    assert set(result["shapes"]) == {"demo", "llama-3.1-8b-scaled"}
    assert result["shapes"]["llama-3.1-8b-scaled"]["target"]["layers"] == 32
