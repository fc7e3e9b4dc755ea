"""The built wheel carries the config tree (harness/experiments, pyproject.toml's package data),
so an installed ratiolab composes its presets outside a checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["pyproject.toml", "README.md", "harness", "analysis", "hydra_plugins", "experiments"]
COMPOSE = """
import harness
from hydra import compose, initialize_config_dir
from harness.runs import config
config.register()
assert harness.__file__.startswith({site!r}), harness.__file__
with initialize_config_dir(config_dir=str(harness.CONFIGS), version_base="1.3"):
    cfg = compose("train", overrides=["experiment=collapse_reject_vs_clamp", "objective=band"])
print(harness.CONFIGS, cfg.name, cfg.objective.name, cfg.noise.nu)
"""


@pytest.mark.slow
def test_the_wheel_ships_the_configs_and_composes_a_preset_outside_the_checkout(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are the reference")
    src, dist = tmp_path / "src", tmp_path / "dist"  # setuptools builds in its source folder
    src.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        kw = {"symlinks": True, "ignore": shutil.ignore_patterns("__pycache__")}
        copy(ROOT / name, src / name, **(kw if copy is shutil.copytree else {}))
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    r = subprocess.run([*build, "-w", str(dist), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    [wheel] = dist.glob("ratiolab-*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".yaml")}
    ls = ["git", "-C", str(ROOT), "ls-files", "experiments"]
    tracked = subprocess.run(ls, capture_output=True, text=True, check=True).stdout.split()
    assert shipped == {f"harness/{f}" for f in tracked if f.endswith(".yaml")}
    site = tmp_path / "site"  # the wheel's files as pip lays them out in site-packages
    zipfile.ZipFile(wheel).extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = COMPOSE.format(site=str(site))
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [
        str(site / "harness" / "experiments"),
        "collapse_reject_vs_clamp",
        "band",
        "3.0",
    ]
