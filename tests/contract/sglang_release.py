"""Each supported released SGLang wheel, downloaded once and read without a GPU.

SGLang cannot run here, and most of it does not import on CPU, so the contract
tests read its source with ``ast`` through the plugin's own reader
(:class:`~tide_lib.serving.sglang_api.SourceTree`); the few modules that are
self-contained (``srt/utils/auth.py``, ``srt/utils/msgspec_utils.py``) are loaded
straight from their files, and request types are executed from their released
source. Wheels are cached under ``~/.cache/tide/sglang-<version>``
(``TIDE_SGLANG_WHEEL_DIR`` moves the root): one download and one unpack per machine,
one parse per test run. A machine without PyPI fails these tests with the command
to run instead.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import types
import zipfile
from functools import cache, cached_property
from pathlib import Path
from typing import Any

from tide_lib.serving.sglang_api import SUPPORTED_SGLANG_VERSIONS, SGLangApi, SourceTree, detect

VERSIONS = SUPPORTED_SGLANG_VERSIONS
_Function = ast.FunctionDef | ast.AsyncFunctionDef

_PREAMBLE = """
from __future__ import annotations
import uuid
from abc import ABC
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union
"""


def _download(version: str) -> Path:
    """The unpacked wheel of ``version`` (the parent of its ``sglang/`` package)."""
    base = Path(os.environ.get("TIDE_SGLANG_WHEEL_DIR", Path.home() / ".cache" / "tide"))
    root = base / f"sglang-{version}"
    unpacked = root / "src"
    if (unpacked / "sglang" / "_version.py").is_file():
        return unpacked
    root.mkdir(parents=True, exist_ok=True)
    wheels = sorted(root.glob(f"sglang-{version}-*.whl"))
    if not wheels:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
        command += [f"sglang=={version}", "-d", str(root)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        wheels = sorted(root.glob(f"sglang-{version}-*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"cannot download sglang=={version} ({result.stderr[-500:]}); run "
                f"`{' '.join(command)}` where PyPI is reachable"
            )
    partial = root / "src.partial"
    with zipfile.ZipFile(wheels[-1]) as wheel:
        names = [name for name in wheel.namelist() if name.startswith("sglang/")]
        wheel.extractall(partial, members=names)
    partial.rename(unpacked)  # whole or not at all: an interrupted unpack is redone
    return unpacked


class Release:
    """One released SGLang: its source tree, read as the plugin reads it."""

    def __init__(self, version: str, tree: SourceTree | None = None) -> None:
        self.version = version
        self.tree = tree or SourceTree(_download(version))

    def __repr__(self) -> str:
        return f"sglang-{self.version}"

    def edited(self, module: str, old: str, new: str) -> Release:
        """This release with one module's source edited in memory."""
        return Release(self.version, self.tree.edited(module, old, new))

    @cached_property
    def api(self) -> SGLangApi:
        return detect(self.tree)

    @property
    def msgspec(self) -> bool:
        return "msgspec.Struct" in self.tree.bases("sglang.srt.managers.io_struct", "BaseReq")

    def module_file(self, module: str) -> Path:
        return self.tree.file(module)

    def module_ast(self, module: str) -> ast.Module:
        found = self.tree.module(module)
        if found is None:
            raise AssertionError(f"sglang {self.version} has no module {module}")
        return found

    def class_def(self, module: str, name: str) -> ast.ClassDef:
        found = self.tree.class_def(module, name)
        if found is None:
            raise AssertionError(f"sglang {self.version}: {module} defines no class {name}")
        return found

    def method(self, module: str, class_name: str, name: str) -> _Function:
        found = self.tree.method(module, class_name, name)
        if found is None:
            raise AssertionError(
                f"sglang {self.version}: {module}.{class_name} has no method {name}"
            )
        return found

    def has_method(self, module: str, class_name: str, name: str) -> bool:
        return self.tree.method(module, class_name, name) is not None

    def function(self, module: str, name: str) -> _Function:
        for node in ast.walk(self.module_ast(module)):
            if isinstance(node, _Function) and node.name == name:
                return node
        raise AssertionError(f"sglang {self.version}: {module} defines no function {name}")

    @staticmethod
    def parameters(node: _Function) -> list[str]:
        return [arg.arg for arg in node.args.args]

    def dataclass_fields(self, module: str, name: str) -> set[str]:
        self.class_def(module, name)
        return self.tree.fields(module, name)

    def self_attributes(self, module: str, class_name: str) -> set[str]:
        self.class_def(module, class_name)
        return self.tree.self_attributes(module, class_name)

    def server_args_modules(self) -> list[str]:
        """Where ``ServerArgs`` fields are declared: ``server_args.py``, and since 0.5.20
        the field groups of ``arg_groups/fields/``."""
        fields = self.tree.root / "sglang" / "srt" / "arg_groups" / "fields"
        grouped = [
            f"sglang.srt.arg_groups.fields.{path.stem}" for path in sorted(fields.glob("*.py"))
        ]
        return ["sglang.srt.server_args", *grouped]

    def server_args_fields(self) -> set[str]:
        found: set[str] = set()
        for module in self.server_args_modules():
            for node in self.module_ast(module).body:
                if isinstance(node, ast.ClassDef):
                    found |= self.tree.fields(module, node.name)
        return found

    def server_args_text(self) -> str:
        return "\n".join(self.module_file(m).read_text() for m in self.server_args_modules())

    def routes(self, module: str) -> dict[tuple[str, str], tuple[str, str | None]]:
        """``(METHOD, path) -> (endpoint function, auth level)`` of a FastAPI module."""
        found: dict[tuple[str, str], tuple[str, str | None]] = {}
        for node in ast.walk(self.module_ast(module)):
            if isinstance(node, _Function):
                level, paths = _route_decorators(node)
                for key in paths:
                    found[key] = (node.name, level)
        return found

    def string_constants(self, module: str) -> set[str]:
        return {
            node.value
            for node in ast.walk(self.module_ast(module))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
        }

    def load_file_module(self, module: str) -> types.ModuleType:
        """Import one self-contained module of the wheel from its file (no package imports)."""
        name = f"sglang_{self.version.replace('.', '_')}_{module.replace('.', '_')}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, self.module_file(module))
        assert spec is not None and spec.loader is not None
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[name] = loaded  # its dataclasses resolve names through it
        spec.loader.exec_module(loaded)
        return loaded

    def exec_classes(self, module: str, names: list[str]) -> dict[str, Any]:
        """Execute the released source of some classes of ``module``, as its release
        defines them (dataclasses, or msgspec Structs with SGLang's pydantic schema)."""
        preamble = _PREAMBLE
        if self.msgspec:
            utils = self.load_file_module("sglang.srt.utils.msgspec_utils")
            preamble += f"import msgspec\nfrom {utils.__name__} import *\n"
        path = self.module_file(module)
        text = path.read_text(encoding="utf-8").splitlines()
        pieces = [preamble]
        for name in names:
            node = self.class_def(module, name)
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            pieces.append("\n".join(text[start - 1 : node.end_lineno]))
        loaded = types.ModuleType(
            f"sglang_{self.version.replace('.', '_')}_{module.replace('.', '_')}_cls"
        )
        sys.modules[loaded.__name__] = loaded  # dataclasses and pydantic resolve names through it
        exec(compile("\n\n".join(pieces), str(path), "exec"), loaded.__dict__)
        return {name: getattr(loaded, name) for name in names}

    @cached_property
    def request_models(self) -> dict[str, Any]:
        """The released request types of the swap and the labels."""
        return self.exec_classes(
            "sglang.srt.managers.io_struct",
            [
                "BaseReq",
                "UpdateWeightFromDiskReqInput",
                "UpdateWeightFromDiskReqOutput",
                "TokenizedGenerateReqInput",
            ],
        )


def _route_decorators(node: _Function) -> tuple[str | None, list[tuple[str, str]]]:
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
    return level, paths


@cache
def release(version: str) -> Release:
    """The release of ``version``, one per test run."""
    return Release(version)
