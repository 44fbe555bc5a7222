"""The ``tide`` command line: help, stack status, lake stats and the lake benchmark."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.conftest import make_record
from tide_lib.cli import build_parser, main
from tide_lib.config import LakeConfig, TideConfig
from tide_lib.lake import LakeWriter, ObjectStore

ONE_HOUR = datetime(2026, 11, 1, 12, 30, tzinfo=UTC)  # records in one partition, whenever run


def _env(monkeypatch: pytest.MonkeyPatch, config: TideConfig) -> None:
    monkeypatch.setenv("TIDE_STORE__ENDPOINT", config.store.endpoint)
    monkeypatch.setenv("TIDE_STACK__STATE_DIR", str(config.stack.state_dir))
    monkeypatch.setenv("TIDE_STACK__S3_PORT", str(config.stack.s3_port))
    monkeypatch.setenv("TIDE_STACK__MLFLOW_PORT", str(config.stack.mlflow_port))
    monkeypatch.setenv("TIDE_STACK__AIRFLOW", "false")  # the session stack runs without Airflow


def test_help_explains_every_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tide_lib.cli", "--help"], capture_output=True, text=True, check=True
    )
    for command in ("stack", "lake", "bench", "demo", "TIDE_STORE__ENDPOINT"):
        assert command in result.stdout


def test_unreachable_store_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TIDE_STORE__ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("TIDE_STORE__TIMEOUT_S", "0.5")
    assert main(["lake", "stats"]) == 2
    assert "unreachable" in caplog.text and "tide stack status" in caplog.text


def test_invalid_configuration_exits_2(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TIDE_LAKE__QUEUE_MAX_RECORDS", "-1")
    assert main(["lake", "stats"]) == 2
    assert "queue_max_records" in caplog.text


@pytest.mark.slow
def test_stack_status_and_lake_stats(
    stack: TideConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _env(monkeypatch, stack)
    assert main(["stack", "status"]) == 0
    assert capsys.readouterr().out.count("healthy") == 2

    prefix = "cli-stats"
    monkeypatch.setenv("TIDE_LAKE__PREFIX", prefix)
    store = ObjectStore(stack.store, stack.store.lake_bucket)
    with LakeWriter(store, LakeConfig(prefix=prefix, spool_dir=tmp_path / "spool")) as writer:
        for index in range(3):
            writer.submit(
                make_record(index, tokens=10, target_id="org/Model-7B", finished_at=ONE_HOUR)
            )
    assert main(["lake", "stats", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["target_slug"], r["records"], r["tokens"]) for r in rows] == [
        ("org--model-7b", 3, 30)
    ]
    assert main(["lake", "stats"]) == 0
    table = capsys.readouterr().out
    assert "org--model-7b" in table and "dt=" in table


@pytest.mark.slow
def test_bench_lake_writes_json(
    stack: TideConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _env(monkeypatch, stack)
    monkeypatch.setenv("TIDE_LAKE__SPOOL_DIR", str(tmp_path / "spool"))
    out = tmp_path / "lake.json"
    assert (
        main(
            [
                "bench",
                "lake",
                "--json",
                str(out),
                "--records",
                "16",
                "--tokens-per-record",
                "32",
                "--hidden-size",
                "64",
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    for key in (
        "write_tokens_per_s",
        "write_mb_per_s",
        "bytes_per_token",
        "raw_fp16_bytes_per_token",
        "read_tokens_per_s",
        "writer_us_per_record",
    ):
        assert result[key] > 0
    assert result["raw_fp16_bytes_per_token"] == 64 * 4 * 2
    assert result["params"] == {
        "records": 16,
        "tokens_per_record": 32,
        "hidden_size": 64,
        "distinct_payloads": 8,
    }


@pytest.mark.slow
def test_train_from_the_lake(
    stack: TideConfig,
    tiny_target: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tide_lib.target_model import load_corpus
    from tide_lib.target_model.hidden import capture_records
    from tide_lib.training.draft import validate_draft_dir

    _env(monkeypatch, stack)
    monkeypatch.setenv("TIDE_LAKE__PREFIX", "cli-train")
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    documents = load_corpus().domain("ko_chat")[:8]
    store = ObjectStore(stack.store, stack.store.lake_bucket)
    with LakeWriter(store, LakeConfig(prefix="cli-train", spool_dir=tmp_path / "spool")) as writer:
        for record in capture_records(model, tokenizer, documents, target_id="demo/tiny"):
            writer.submit(record)
    args = ["train", "--target", str(tiny_target), "--lake-target", "demo--tiny"]
    args += ["--out", str(tmp_path / "run"), "--steps", "3", "--ttt-length", "2"]
    args += ["--draft-vocab-size", "256", "--batch-size", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "exported 8 samples" in out
    assert json.loads(out[out.index("{") :])["steps"] == 3
    validate_draft_dir(tmp_path / "run" / "draft")
    assert main([*args[:-6], "--steps", "3", "--ttt-length", "0"]) == 2  # invalid config, exit 2


def test_workload_segments_arrive_in_turn_and_a_bad_plan_is_one_line(tmp_path: Path) -> None:
    out = tmp_path / "w.jsonl"
    plan = "english:3,english-docs:2,korean-law:2"
    assert main(["workload", "segments", "--out", str(out), "--plan", plan]) == 0
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [item["segment"] for item in lines] == ["english"] * 3 + ["english-docs"] * 2 + [
        "korean-law"
    ] * 2
    assert lines[0]["prompt"].endswith("<|assistant|>")  # a chat turn
    assert not lines[-1]["prompt"].endswith("<|assistant|>")  # a document's first words
    assert main(["workload", "segments", "--out", str(out), "--plan", "english:x"]) == 2
    assert main(["workload", "segments", "--out", str(out), "--plan", "german:3"]) == 2


def _commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """Every command and subcommand: (path, its parser, the help its parent lists)."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                found.append(((*path, name), sub, helps.get(name) or ""))
                found.extend(_commands(sub, (*path, name)))
    return found


def test_help_walks_every_command_and_explains_each_option() -> None:
    commands = _commands(build_parser())
    paths = {" ".join(path) for path, _, _ in commands}
    assert {"stack up", "lake stats", "bench adaptation", "fleet promote", "demo"} <= paths
    assert len(paths) >= 20
    for path, parser, listed in commands:
        name = " ".join(path)
        assert listed.strip(), f"`tide {name}` has no help line in `tide {name} --help`'s parent"
        text = parser.format_help()
        assert text.startswith(f"usage: tide {name}"), text[:80]
        for action in parser._actions:
            if action.option_strings and action.help != argparse.SUPPRESS:
                assert action.help, f"`tide {name}`: {action.option_strings} has no help"
