"""The procedure of CONTRIBUTING.md, checked for every registered method: one folder with
its fast module, ``naive.py``, README and exports; options defined once in the config;
a test module that compares with the naive reference."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from skyformer import get_method, list_methods
from skyformer.registry.signature import takes_config

ROOT = Path(__file__).resolve().parents[1]
OPS = ROOT / "src" / "skyformer" / "ops"


def package_of(method: str) -> str:
    """``skyformer.ops.<package>.<module>`` -> ``<package>``."""
    module = get_method(method).core.__module__
    prefix = "skyformer.ops."
    assert module.startswith(prefix), f"{method} is implemented outside skyformer.ops"
    return module[len(prefix):].split(".")[0]


@pytest.mark.parametrize("method", list_methods())
def test_every_method_is_one_folder_with_its_naive_reference_and_readme(method):
    folder = OPS / package_of(method)
    for name in ("__init__.py", "naive.py", "README.md"):
        assert (folder / name).is_file(), f"{method}: {folder / name} is missing"
    assert "def reference_" in (folder / "naive.py").read_text(), (
        f"{method}: {folder / 'naive.py'} defines no reference_<name>_attention")
    readme = (folder / "README.md").read_text()
    assert readme.startswith("# "), f"{method}: README.md has no title"


def test_every_method_folder_is_imported_by_the_ops_package():
    """A folder left out of ``ops/__init__.py`` passed every test that names it (its test
    module's import registered it) while ``skyformer list`` and ``attention`` lacked it."""
    tree = ast.parse((OPS / "__init__.py").read_text())
    imported = {node.module.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module}
    folders = {p.parent.name for p in OPS.glob("*/naive.py")}
    missing = sorted(folders - imported)
    assert not missing, (f"ops/{missing[0]} is not imported by src/skyformer/ops/__init__.py, "
                         f"so it registers no method (CONTRIBUTING.md, step 2)")


@pytest.mark.parametrize("method", list_methods())
def test_its_test_module_compares_with_the_naive_reference(method):
    """The test module imports the naive reference and uses it, a name read in its code
    (an import alone passed)."""
    package = package_of(method)
    test_file = ROOT / "tests" / "ops" / f"test_{package}.py"
    assert test_file.is_file(), f"{method}: {test_file} is missing"
    tree = ast.parse(test_file.read_text())
    naive = f"skyformer.ops.{package}.naive"
    imported = {alias.asname or alias.name for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module == naive
                for alias in node.names if alias.name.startswith("reference_")}
    assert imported, f"{method}: {test_file.name} imports no reference_* from {naive}"
    read = {node.id for node in ast.walk(tree)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    assert imported & read, (f"{method}: {test_file.name} imports but never uses "
                             f"{' or '.join(sorted(imported))}")


@pytest.mark.parametrize("method", list_methods())
def test_options_are_defined_once_by_the_config(method):
    spec = get_method(method)
    assert takes_config(spec.core), f"{method}: the core does not take its config"
    core_parameters = inspect.signature(spec.core).parameters
    for field in dataclasses.fields(spec.config_class):
        assert field.name not in core_parameters, (
            f"{method}: option {field.name!r} is restated as an argument of the core")
        public = inspect.signature(spec.function).parameters[field.name]
        assert public.default == field.default  # the public signature comes from the config


@pytest.mark.parametrize("method", list_methods())
def test_the_public_docstring_names_only_arguments_it_takes(method):
    """help() of the public function lists the arguments of its signature (the core's
    ``config`` is not one: its options are keyword arguments)."""
    function = get_method(method).function
    parameters = inspect.signature(function).parameters
    doc = inspect.getdoc(function)
    args = doc.split("Args:\n", 1)[1].split("\nReturns:", 1)[0] if "Args:\n" in doc else ""
    named = [name.strip() for line in args.splitlines()
             if line.startswith("    ") and not line.startswith("     ") and ":" in line
             for name in line.split(":", 1)[0].split(",")]
    assert named, f"{method}: no Args in its docstring"
    unknown = [name for name in named if name not in parameters]
    assert not unknown, f"{method}: its docstring names {unknown}, not arguments it takes"


@pytest.mark.parametrize("method", list_methods())
def test_the_public_signature_takes_a_random_key_as_generator(method):
    """Every method takes a torch.Generator or a random key (``skyformer.random_key``);
    the signature help() shows says so."""
    generator = inspect.signature(get_method(method).function).parameters["generator"]
    assert "Tensor" in generator.annotation and "torch.Generator" in generator.annotation
