"""What ``pip install`` gives a user: the package built as a wheel and installed into a folder of its
own (not this checkout), where the trainer recipes import and ``__version__`` is the project's."""

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ("skyrl", "verl", "slime", "nemo_rl")


def test_recipes_import_from_an_installed_wheel(tmp_path):
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    # Built from a copy of what the build reads: setuptools' build/ folder in the checkout would
    # keep files of an earlier build in the wheel.
    source = tmp_path / "source"
    shutil.copytree(
        ROOT / "megatron_fused_lm", source / "megatron_fused_lm", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    # Built as pip builds the README's install: in an isolated environment with the setuptools
    # pyproject.toml asks for (the interpreter's own may be too old to build wheels).
    wheels = tmp_path / "wheels"
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(wheels), str(source)], check=True)
    (wheel,) = wheels.glob("megatron_fused_lm-*.whl")
    target = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True)
    probe = (
        "import megatron_fused_lm, importlib;"
        f"[importlib.import_module('megatron_fused_lm.recipes.' + name) for name in {RECIPES!r}];"
        "print(megatron_fused_lm.__file__); print(megatron_fused_lm.__version__)"
    )
    # Run from an empty folder, the installed copy first: the checkout is not importable from there.
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(target), *os.environ.get("PYTHONPATH", "").split(os.pathsep)])
    )
    env["PYTHONPATH"] = os.pathsep.join(
        path for path in env["PYTHONPATH"].split(os.pathsep) if path and Path(path).resolve() != ROOT
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    location, version = done.stdout.split()
    assert Path(location).resolve().is_relative_to(target.resolve()), location
    assert version == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
