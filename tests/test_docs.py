"""The user docs agree with the code: every ``skyformer ...`` command line they show parses
with the current command line, and every relative link and repository path they name
exists (README.md, CONTRIBUTING.md, docs/, benchmarks/README.md, the methods' READMEs)."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import re
import shlex
from pathlib import Path

import pytest

from skyformer.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "src" / "skyformer").rglob("README.md"))]
# Placeholders the docs write for a value of the user's.
PLACEHOLDERS = {"TASK": "listops", "METHOD": "skyformer"}
SUBCOMMANDS = ("list", "compare", "bench", "approx", "hf-eval", "lra")
REPOSITORY_PATH = re.compile(
    r"(?<![\w./-])((?:docs|benchmarks|tests|examples|scripts|src/skyformer)/[\w./-]*\w)")


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _code_block_commands(text: str) -> list[str]:
    """The ``skyformer ...`` lines of the fenced code blocks, continuations joined."""
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = re.sub(r"^\s*(\$\s*)?(\S*/)?", "", line)
            if line.startswith("skyformer "):
                found.append(line.removeprefix("skyformer "))
    return found


def _inline_commands(text: str) -> list[str]:
    """The ``skyformer <command> ...`` spans in backticks outside the code blocks."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    spans = (s.removeprefix("skyformer ") for s in re.findall(r"`(skyformer [^`\n]+)`", prose))
    return [s.replace("\\|", "|") for s in spans if s.split()[0] in SUBCOMMANDS]


def _argvs(command: str) -> list[list[str]]:
    """The argument lists a documented command stands for: comments, pipes and
    redirections cut, placeholders filled, an optional ``[--flag value]`` taken, each
    alternative of ``a|b`` parsed. Lines eliding arguments (``...``) are skipped."""
    command = re.split(r"\s(?:#|\||>|&&|;)", " " + command)[0].strip()
    if "..." in command:
        return []
    unbracketed = command.replace("[", " ").replace("]", " ")
    tokens = [PLACEHOLDERS.get(t, t) for t in shlex.split(unbracketed)]
    choices = [t.split("|") if re.fullmatch(r"[\w-]+(\|[\w-]+)+", t) else [t] for t in tokens]
    width = max(len(c) for c in choices)
    return [[c[min(i, len(c) - 1)] for c in choices] for i in range(width)]


def _documented_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in DOCS:
        text = path.read_text()
        for command in _code_block_commands(text) + _inline_commands(text):
            found += [(_name(path), argv) for argv in _argvs(command)]
    return found


def test_every_command_line_in_the_docs_parses():
    commands = _documented_commands()
    assert len(commands) > 50, "the docs' command lines were not found"
    parser = build_parser()
    failed = []
    for where, argv in commands:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                parser.parse_args(argv)
        except SystemExit as exit_:
            if exit_.code:
                failed.append(f"{where}: skyformer {shlex.join(argv)}: "
                              f"{err.getvalue().strip().splitlines()[-1]}")
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("path", DOCS, ids=_name)
def test_relative_links_and_repository_paths_exist(path):
    text = path.read_text()
    missing = []
    prose = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        external = target.startswith(("http:", "https:", "mailto:", "#"))
        if not external and not (path.parent / target.split("#")[0]).exists():
            missing.append(f"link {target}")
    for named in REPOSITORY_PATH.findall(text):
        # a results prefix (bench_cpu for bench_cpu.json) names its files
        if not any(ROOT.glob(named + "*")) and not (path.parent / named).exists():
            missing.append(named)
    assert not missing, f"{_name(path)} names what does not exist: {missing}"


def _cells(row: str) -> list[str]:
    """The cells of a markdown table row (``\\|`` inside a cell is no separator)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def _readme_method_rows() -> dict[str, list[str]]:
    """Method name -> cells of its row in README.md's methods table, in order."""
    from skyformer import list_methods

    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = _cells(line) if line.startswith("| `") else []
        name = re.fullmatch(r"`(\w+)`", cells[0]) if len(cells) == 3 else None
        if name and name.group(1) in list_methods():
            rows[name.group(1)] = cells
    return rows


def _named_options(name: str, rows: dict[str, list[str]]) -> set[str]:
    """The options README.md's row of ``name`` names (backticked, bare or ``=value``),
    with those of the row it refers to by "options as `other`"."""
    from skyformer import get_method

    text = rows[name][1]
    named = set(re.findall(r"`(\w+)(?:=[^`]*)?`", text)) & set(get_method(name).option_names())
    base = re.search(r"options as `(\w+)`", text)
    return named | (_named_options(base.group(1), rows) if base else set())


def test_the_readme_methods_table_is_the_registry():
    """README.md's methods table has every method in the registry's order with its
    target, and the logit/kernel ``scale`` and ``causal`` it names are the methods' own
    (the Gaussian methods' ``scale`` was once missing, so that "options as `skyformer`
    plus `scale`" said skyformer had none)."""
    from skyformer import get_method, list_methods

    rows = _readme_method_rows()
    assert list(rows) == list_methods()
    wrong = []
    for name, (_, text, target) in rows.items():
        spec = get_method(name)
        if target.lower() != spec.capabilities.target:
            wrong.append(f"{name}: target {target}, registered {spec.capabilities.target}")
        named = _named_options(name, rows)
        for option, has in (("scale", "scale" in spec.option_names()),
                            ("causal", spec.capabilities.causal)):
            if (option in named) != has:
                wrong.append(f"{name}: {option} {'not ' if has else ''}named, but "
                             f"{'an' if has else 'no'} option of it")
        for base, plus in re.findall(r"options as `(\w+)` plus ((?:`[^`]+`(?:, )?)+)", text):
            inherited = set(re.findall(r"`(\w+)", plus)) & set(get_method(base).option_names())
            if inherited:
                wrong.append(f"{name}: 'options as {base} plus {sorted(inherited)}', but "
                             f"{base} has them")
    assert not wrong, "\n".join(wrong)


def test_the_defaults_in_the_readme_methods_table_are_the_methods_own():
    """Each ``option=value`` in the options list of a row of README.md's methods table
    (after "options") is that method's default (``pinv="iterative"|"exact"``: the first
    is the default), so that a default changed in the code (Nystromformer's
    pinv_iterations, the baseline every comparison runs) shows up here, and the table
    never states a stale one. Values before the list describe forms (``causal=True``)."""
    from skyformer import get_method

    checked, wrong = 0, []
    for name, (_, text, _) in _readme_method_rows().items():
        spec = get_method(name)
        defaults = dataclasses.asdict(spec.make_config())
        listed = text[text.find("options"):] if "options" in text else ""
        for option, written in re.findall(r"`(\w+)=([^`]+)`", listed):
            if option not in spec.option_names():
                continue
            value = ast.literal_eval(written.split("\\|")[0])
            checked += 1
            if defaults[option] != value:
                wrong.append(f"{name}: README says {option}={written}, default "
                             f"{defaults[option]!r}")
    assert not wrong, "\n".join(wrong)
    assert checked >= 20  # the table keeps naming its defaults


def test_the_methods_index_is_the_registry():
    """docs/methods.md's index names every method in order with its target, "(exact)"
    where the method computes it exactly."""
    from skyformer import get_method, list_methods

    found = []
    for line in (ROOT / "docs" / "methods.md").read_text().splitlines():
        cells = _cells(line) if line.startswith("| `") else []
        if len(cells) != 3 or "ops/" not in cells[1]:
            continue
        names = re.findall(r"`(\w+)`", cells[0])
        targets = [t.strip() for t in cells[2].split(",")]
        found += [(n, t) for n, t in zip(names, targets * len(names) if len(targets) == 1
                                         else targets, strict=True)]
    expected = []
    for name in list_methods():
        caps = get_method(name).capabilities
        target = {"softmax": "softmax", "gaussian": "Gaussian"}[caps.target]
        expected.append((name, f"{target} (exact)" if caps.exact else target))
    assert found == expected
