"""The released ``sglang==0.5.14`` wheel, downloaded once and read without a GPU.

SGLang cannot run here, and most of it does not import on CPU, so the contract
tests read its source with ``ast``; the few modules that are self-contained
(``srt/utils/auth.py``) are loaded straight from their files. The wheel is
cached under ``~/.cache/tide/`` (``TIDE_SGLANG_WHEEL_DIR`` moves it); a
machine without PyPI fails these tests with the command to run instead.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import types
import zipfile
from functools import cache
from pathlib import Path

VERSION = "0.5.14"


def _cache_dir() -> Path:
    default = Path.home() / ".cache" / "tide" / f"sglang-{VERSION}"
    return Path(os.environ.get("TIDE_SGLANG_WHEEL_DIR", default))


@cache
def source_root() -> Path:
    """The unpacked wheel (its ``sglang/`` package directory's parent)."""
    root = _cache_dir()
    unpacked = root / "src"
    if (unpacked / "sglang" / "_version.py").is_file():
        return unpacked
    root.mkdir(parents=True, exist_ok=True)
    wheels = sorted(root.glob(f"sglang-{VERSION}-*.whl"))
    if not wheels:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
        command += [f"sglang=={VERSION}", "-d", str(root)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        wheels = sorted(root.glob(f"sglang-{VERSION}-*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"cannot download sglang=={VERSION} ({result.stderr[-500:]}); run "
                f"`{' '.join(command)}` where PyPI is reachable"
            )
    with zipfile.ZipFile(wheels[-1]) as wheel:
        names = [name for name in wheel.namelist() if name.startswith("sglang/")]
        wheel.extractall(unpacked, members=names)
    return unpacked


def module_file(module: str) -> Path:
    return source_root() / (module.replace(".", "/") + ".py")


@cache
def module_ast(module: str) -> ast.Module:
    path = module_file(module)
    if not path.is_file():
        raise AssertionError(f"sglang {VERSION} has no module {module} ({path})")
    return ast.parse(path.read_text(encoding="utf-8"))


def class_def(module: str, name: str) -> ast.ClassDef:
    for node in module_ast(module).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"sglang {VERSION}: {module} defines no class {name}")


def method(module: str, class_name: str, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    for node in class_def(module, class_name).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return node
    raise AssertionError(f"sglang {VERSION}: {module}.{class_name} has no method {name}")


def function(module: str, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    for node in ast.walk(module_ast(module)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return node
    raise AssertionError(f"sglang {VERSION}: {module} defines no function {name}")


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    return [arg.arg for arg in node.args.args]


def dataclass_fields(module: str, name: str) -> set[str]:
    """Annotated fields of a (data)class, its bases in the same module included."""
    node = class_def(module, name)
    fields = {
        item.target.id
        for item in node.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    }
    for base in node.bases:
        if isinstance(base, ast.Name):
            try:
                fields |= dataclass_fields(module, base.id)
            except AssertionError:
                continue  # a base from another module
    return fields


def self_attributes(module: str, class_name: str, method_name: str = "__init__") -> set[str]:
    """Names assigned as ``self.X = ...`` in a method."""
    names = set()
    for node in ast.walk(method(module, class_name, method_name)):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                names.add(target.attr)
    return names


def routes(module: str) -> dict[tuple[str, str], tuple[str, str | None]]:
    """``(METHOD, path) -> (endpoint function, auth level)`` of a FastAPI module."""
    found: dict[tuple[str, str], tuple[str, str | None]] = {}
    for node in ast.walk(module_ast(module)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        level = None
        paths: list[tuple[str, str]] = []
        for decorator in node.decorator_list:
            if not isinstance(decorator, ast.Call):
                continue
            first = decorator.args[0] if decorator.args else None
            if isinstance(decorator.func, ast.Name) and decorator.func.id == "auth_level":
                level = first.attr if isinstance(first, ast.Attribute) else None
                continue
            if not isinstance(decorator.func, ast.Attribute):
                continue
            attribute = decorator.func.attr
            first = decorator.args[0] if decorator.args else None
            if attribute == "auth_level" and isinstance(first, ast.Attribute):
                level = first.attr
            elif isinstance(first, ast.Constant) and isinstance(first.value, str):
                if attribute in ("get", "post", "put", "delete"):
                    paths.append((attribute.upper(), first.value))
                elif attribute == "api_route":
                    for keyword in decorator.keywords:
                        if keyword.arg == "methods" and isinstance(keyword.value, ast.List):
                            paths += [
                                (str(item.value), first.value)
                                for item in keyword.value.elts
                                if isinstance(item, ast.Constant)
                            ]
        for key in paths:
            found[key] = (node.name, level)
    return found


def string_constants(module: str) -> set[str]:
    return {
        node.value
        for node in ast.walk(module_ast(module))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


@cache
def load_file_module(module: str) -> types.ModuleType:
    """Import one self-contained module of the wheel from its file (no package imports)."""
    name = f"sglang_release_{module.replace('.', '_')}"
    spec = importlib.util.spec_from_file_location(name, module_file(module))
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[name] = loaded  # its dataclasses resolve names through it
    spec.loader.exec_module(loaded)
    return loaded


def exec_classes(module: str, names: list[str], preamble: str) -> dict[str, object]:
    """Execute the released source of some classes of ``module`` (with ``preamble`` imports)."""
    path = module_file(module)
    text = path.read_text(encoding="utf-8")
    pieces = [preamble]
    for name in names:
        node = class_def(module, name)
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        pieces.append("\n".join(text.splitlines()[start - 1 : node.end_lineno]))
    loaded = types.ModuleType(f"sglang_release_{module.replace('.', '_')}")
    sys.modules[loaded.__name__] = loaded  # dataclasses and pydantic resolve names through it
    exec(compile("\n\n".join(pieces), str(path), "exec"), loaded.__dict__)
    return {name: getattr(loaded, name) for name in names}
