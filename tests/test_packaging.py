"""The source distribution as pip and packagers build it from this repository."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _copy_tree(tmp_path: Path) -> Path:
    """A copy of the packaging inputs (the source tree is left as it is)."""
    pytest.importorskip("setuptools", minversion="77")  # pyproject's license expression
    tree = tmp_path / "tree"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    for folder in ("src", "tests"):
        shutil.copytree(ROOT / folder, tree / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "MANIFEST.in", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, tree / name)
    return tree


def _build(tree: Path, kind: str) -> Path:
    """The ``kind`` ("sdist" or "wheel") built from ``tree``."""
    code = f"from setuptools import build_meta; print(build_meta.build_{kind}('dist'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return tree / "dist" / out.stdout.strip().splitlines()[-1]


def _build_sdist(tmp_path: Path) -> tuple[list[str], str]:
    """Names in the sdist built from a copy of the packaging inputs, relative to the
    sdist's top folder, and its PKG-INFO."""
    with tarfile.open(_build(_copy_tree(tmp_path), "sdist")) as sdist:
        names = sdist.getnames()
        info = sdist.extractfile(next(n for n in names if n.endswith("/PKG-INFO")))
        return ([name.split("/", 1)[1] for name in names if "/" in name],
                info.read().decode())


def test_the_sdist_holds_the_package_and_its_data_and_no_part_of_the_test_suite(tmp_path):
    """The tests run from the repository (they read README.md, docs/, benchmarks/): an
    sdist holding some of them (test_*.py without conftest.py and the subfolders) fails
    at collection, so it holds none."""
    names = set(_build_sdist(tmp_path)[0])
    assert "src/skyformer/data/public_domain_en.txt" in names
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "src").rglob("*.py")}
    assert modules <= names
    assert sorted(n for n in names if n.startswith("tests/")) == []


def test_the_distribution_carries_the_licence_and_the_packages_own_version(tmp_path):
    """The MIT licence pyproject declares travels with the code, and the version pip
    records is ``skyformer.__version__`` (written once, read by the build)."""
    import skyformer

    names, info = _build_sdist(tmp_path)
    assert "LICENSE" in names
    assert "License-File: LICENSE" in info
    assert f"\nVersion: {skyformer.__version__}\n" in info
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and '\nversion = "' not in pyproject


def test_the_wheel_holds_every_file_of_the_package(tmp_path):
    """What ``pip install skyformer`` puts in site-packages: every module, and every file
    beside them that the package ships (the text the commands embed, each method's
    README the docstrings cite, py.typed), not only what the tests read from src/."""
    import zipfile

    package = ROOT / "src" / "skyformer"
    shipped = {str(p.relative_to(package.parent)) for p in package.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    assert {"skyformer/py.typed", "skyformer/ops/skyformer/README.md"} <= shipped
    with zipfile.ZipFile(_build(_copy_tree(tmp_path), "wheel")) as wheel:
        names = set(wheel.namelist())
    assert sorted(shipped - names) == []
