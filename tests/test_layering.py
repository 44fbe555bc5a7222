"""The product never imports the harness, and no private name crosses a module boundary."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ROOT / "tide_lib"


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every ``import``/``from ... import`` in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, []) for alias in node.names)
    return found


def test_the_product_does_not_import_the_harness() -> None:
    harness = PRODUCT / "harness"
    for path in [*PRODUCT.rglob("*.py"), *(ROOT / "dags").glob("*.py")]:
        if harness in path.parents:
            continue
        for line, module, _ in _imports(path):
            assert not module.startswith("tide_lib.harness"), f"{path}:{line} imports {module}"


def test_no_private_name_is_imported_from_another_module() -> None:
    files = [*PRODUCT.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "dags").glob("*.py")]
    for path in files:
        for line, module, names in _imports(path):
            private = [n for n in names if n.startswith("_") and module.startswith("tide_lib")]
            assert not private, f"{path}:{line} imports {private} from {module}"
