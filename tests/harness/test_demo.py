"""`tide demo` end to end on the tiny target: the real scheduler runs a cycle while the
fleet serves live traffic, the table is measured from the lake, the plot is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import DEMO_ENGINE_PORTS, DEMO_STACK_PORTS, stack_config
from tide_lib.harness.demo import DemoSettings, run_demo
from tide_lib.stack import StackManager

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.mark.timeout(1800)  # the demo's own deadline (timeout_s) starts after its setup
def test_demo_runs_a_scheduled_cycle_and_promotes_on_live_traffic(
    tiny_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its warm start trains train_steps, not the recipe's passes over the window (83 steps,
    # a minute of CI): this test is about the loop, tests/training about the recipe.
    monkeypatch.setenv("TIDE_TRAINING__WARM_EPOCHS", "0")
    base = stack_config(tmp_path / "stack", port_base=DEMO_STACK_PORTS)
    config = base.model_copy(update={"stack": base.stack.model_copy(update={"airflow": True})})
    settings = DemoSettings(
        preset="tiny",
        cycles=1,
        max_new_tokens=16,
        tokens_per_cycle=300,
        static_prompts=30,
        train_steps=10,
        ttt_length=2,
        draft_vocab_size=512,
        refresh_s=5,
        request_pause_s=0.1,
        force_promote=True,
        engine_port=DEMO_ENGINE_PORTS,
        timeout_s=600,
    )
    lines: list[str] = []
    try:
        summary = run_demo(
            config,
            settings,
            target_dir=tiny_target,
            work_dir=tmp_path / "demo",
            out_json=tmp_path / "demo.json",
            out_png=tmp_path / "demo.png",
            say=lines.append,
        )
    finally:
        StackManager(config).down()

    assert json.loads((tmp_path / "demo.json").read_text()) == summary
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"
    [cycle] = summary["cycles"]
    assert cycle["state"] == "success" and cycle.get("promoted"), (cycle, lines)
    # the engines picked up the cycle's version, under live traffic, with no failed request
    [promotion] = summary["promotions"]
    assert promotion["version"] == f"tide-draft-{summary['target_id']}-v{cycle['version']}"
    assert promotion["version"] != summary["static_version"]
    assert summary["requests_failed"] == 0 and summary["requests_served"] > 0
    assert summary["rows"] and all(
        row["serving"] >= 1 and row["static"] >= 1 for row in summary["rows"]
    )
    assert summary["final"]["serving_version"] == promotion["version"]
    assert any("AL serving" in line for line in lines)
