"""The wheel: every package of ppo_trainer/ and the Hydra tree of configs/ (as ppo_trainer/config/yaml_tree)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

from ppo_trainer.config.schema import CONFIG_DIR

REPO = Path(__file__).resolve().parents[2]


def test_pyproject_lists_every_package():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "ppo_trainer").rglob("__init__.py")}
    assert listed == found | {"ppo_trainer.config.yaml_tree"}


def test_source_checkout_reads_the_tree_at_the_root():
    assert CONFIG_DIR == REPO / "configs"


def test_wheel_ships_the_config_tree(tmp_path):
    src = tmp_path / "src"  # a copy: building in place would leave build/ and *.egg-info in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("ppo_trainer", "configs"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("ppo_trainer/config/yaml_tree/")}
    expected = {f"ppo_trainer/config/yaml_tree/{p.relative_to(CONFIG_DIR).as_posix()}" for p in CONFIG_DIR.rglob("*.yaml")}
    assert shipped == expected
