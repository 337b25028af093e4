"""The package as users install it: a wheel and an sdist, built from a copy of the checkout and
installed into folders of their own, import and run their commands from a folder outside the
checkout (``pip install .`` once gave a package without ``fsdp_strategy.plan``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import excerpt

ROOT = Path(__file__).resolve().parents[1]
LEFT_OUT = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache")
IMPORTS = (
    "import fsdp_strategy, fsdp_strategy.callbacks, fsdp_strategy.checkpoint, fsdp_strategy.engine, "
    "fsdp_strategy.plan.cli, fsdp_strategy.consolidate; "
    "from fsdp_strategy.callbacks import MemoryMonitor, ThroughputMonitor, CommunicationMonitor; "
    "print(fsdp_strategy.__file__)"
)


def _run(command: list[str], cwd: Path, env: dict | None = None) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command} failed:\n{excerpt(done.stdout, 2000)}\n{excerpt(done.stderr, 2000)}"
    return done.stdout


def test_wheel_and_sdist_install_a_package_whose_imports_and_commands_work(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=LEFT_OUT)  # building writes build/ and *.egg-info: not into the checkout
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(source)], tmp_path)
    wheel, sdist = next(dist.glob("*.whl")), next(dist.glob("*.tar.gz"))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for name, artifact in (("wheel", wheel), ("sdist", sdist)):
        target = tmp_path / name
        pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--target", str(target)]
        _run([*pip, str(artifact)], tmp_path)
        env = {**os.environ, "PYTHONPATH": str(target)}  # ahead of any other installation of the package
        where = _run([sys.executable, "-c", IMPORTS], outside, env).strip()
        assert Path(where).is_relative_to(target), f"{name}: imported {where}, not the installed copy"
        for command in ("fsdp-consolidate", "fsdp-plan"):
            assert "usage:" in _run([str(target / "bin" / command), "--help"], outside, env), (name, command)


@pytest.mark.skipif(not (ROOT / ".ci" / "run").exists(), reason="the CI script is in the checkout only")
def test_ci_runs_the_readme_commands_on_an_installed_package():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    commands = [line.strip() for line in ci.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    commands = [line for line in commands if not line.startswith(("set ", "cd "))]
    for command in commands:
        assert command in readme, f".ci/run runs {command!r}, which README does not tell a user to run"
    assert "pip install -e" not in ci and "--clear" in ci and "ruff check" in ci and " -rs" in ci
