"""What the wheel ships: every package of the source tree, listed in pyproject.toml (the wheel
itself is built, installed outside the tree and imported whole in the slow tier:
tests/cli/test_demo.py)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from tests.support.paths import ROOT

MAPPED = {"toolledger.migrations": "migrations", "toolledger.examples": "examples"}


def shipped_packages() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return set(config["tool"]["setuptools"]["packages"])


def find_packages(folder: Path) -> set[str]:
    """The dotted names of the packages under ``folder`` (folders with an ``__init__.py``)."""
    return {
        ".".join(init.parent.relative_to(folder).parts)
        for init in folder.rglob("__init__.py")
        if init.parent != folder
    }


def source_packages() -> set[str]:
    """Every package of src/, and of the folders mapped into it (their own subpackages too)."""
    found = find_packages(ROOT / "src")
    for package, folder in MAPPED.items():
        found.add(package)
        found.update(f"{package}.{sub}" for sub in find_packages(ROOT / folder))
    return found


def test_pyproject__ships_every_package_of_the_source_tree() -> None:
    assert source_packages() - shipped_packages() == set(), "packages the wheel would leave out"
    assert shipped_packages() - source_packages() == set(), "listed packages that do not exist"


def test_pyproject__maps_the_top_level_folders_it_ships() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    package_dir = config["tool"]["setuptools"]["package-dir"]
    assert {name: package_dir[name] for name in MAPPED} == MAPPED
