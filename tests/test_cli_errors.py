"""One error boundary: every TIDE exception derives from TideError, and the CLI prints
each as one line without a traceback (exit 2)."""

from __future__ import annotations

import ast
import importlib
import logging
from pathlib import Path

import pytest

import tide_lib.cli
from tide_lib.cli import main
from tide_lib.errors import TideError

PACKAGE = Path(tide_lib.cli.__file__).parent


def _error_classes() -> list[tuple[str, str, list[str]]]:
    """(module, class, base names) of every class named ``*Error`` in tide_lib."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
                bases = [ast.unparse(base) for base in node.bases]
                found.append((module, node.name, bases))
    return found


PUBLIC_ERRORS = [(m, name) for m, name, _ in _error_classes() if not name.startswith("_")]


def test_every_tide_exception_derives_from_tide_error() -> None:
    assert len(PUBLIC_ERRORS) >= 15
    for module, name, bases in _error_classes():
        if module == "tide_lib.errors":
            continue
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, TideError), f"{module}.{name} ({bases}) is not a TideError"


@pytest.mark.parametrize(("module", "name"), PUBLIC_ERRORS, ids=[n for _, n in PUBLIC_ERRORS])
def test_the_cli_prints_each_error_as_one_line_without_a_traceback(
    module: str, name: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cls = getattr(importlib.import_module(module), name)
    message = f"{name} happened:\n  the thing: is wrong\n  the fix: do this"

    def fail(*_args: object) -> int:
        raise cls(message)

    monkeypatch.setattr(tide_lib.cli, "_lake_stats", fail)
    with caplog.at_level(logging.ERROR):
        assert main(["lake", "stats"]) == 2
    records = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(records) == 1, [r.getMessage() for r in records]
    text = records[0].getMessage()
    assert text == f"{name} happened: the thing: is wrong; the fix: do this"
    assert records[0].exc_info is None and "Traceback" not in caplog.text


def test_invalid_arguments_are_one_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        arguments = ["--target", "t", "--out", "o", "--data", "d", "--steps", "-3"]
        assert main(["train", *arguments]) == 2
    records = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(records) == 1 and "\n" not in records[0].getMessage()
    assert "steps" in records[0].getMessage()
