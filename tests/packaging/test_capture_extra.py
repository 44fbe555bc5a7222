"""`pip install "tide[capture]"` in a fresh venv: the SGLang plugin imports, Airflow stays out.

An SGLang host gets TIDE's plugin this way (the README's recipe); the test installs
the extra exactly so, with the project's constraints, into a new virtual environment.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

_CHECK = """
import importlib.metadata, importlib.util, os
import tide_lib.serving.sglang_plugin as plugin
import tide_lib.serving.sglang_swap
os.environ.pop(plugin.ENABLE_ENV, None)
plugin.register()  # no SGLang here: registers nothing, raises nothing
points = importlib.metadata.entry_points(group="sglang.srt.plugins")
assert [p.value for p in points if p.name == "tide_capture"] == [
    "tide_lib.serving.sglang_plugin:register"
]
for absent in ("airflow", "specforge", "matplotlib"):
    assert importlib.util.find_spec(absent) is None, f"{absent} came with tide[capture]"
print("plugin ok")
"""


@pytest.mark.timeout(1200)  # torch and transformers install from the local wheel cache
def test_capture_extra_installs_the_plugin_and_nothing_of_airflow(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # Built from a copy: a build in the checkout would leave build/ and tide.egg-info
    # there, and an egg-info beside the tests shadows the editable install's metadata.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "tide_lib", source / "tide_lib", ignore=shutil.ignore_patterns("__pycache__")
    )
    install = [str(python), "-m", "pip", "install", "--quiet", "-c", str(ROOT / "constraints.txt")]
    result = subprocess.run(
        [*install, f"{source}[capture]"], capture_output=True, text=True, timeout=1100, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    check = subprocess.run(
        [str(python), "-c", _CHECK],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )
    assert check.returncode == 0, check.stderr[-3000:]
    assert "plugin ok" in check.stdout
    assert sys.prefix != str(env_dir)
