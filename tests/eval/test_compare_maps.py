"""``skyformer compare --maps``: the attention matrix of one head, per method, with its
relative spectral error against its target's matrix."""

from __future__ import annotations

import json

import pytest
import torch

from skyformer import attention_weights
from skyformer.cli import main

pytest.importorskip("matplotlib")


@pytest.fixture
def saved(tmp_path):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 24, 8, generator=g) for _ in range(3))
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[0, 20:] = False
    path = tmp_path / "mine.pt"
    torch.save({"q": q, "k": k, "v": v, "mask": mask}, path)
    return path, q, k, mask


def test_the_maps_of_one_head_with_each_methods_matrix_error(tmp_path, capsys, saved):
    """The figure is written; each method's error is that of its matrix on the head
    (skyformer.attention_weights with the table's seed) against its target's, the exact
    methods' about 0; a method without a matrix says so."""
    path, q, k, mask = saved
    figure, out_json = tmp_path / "maps.png", tmp_path / "compare.json"
    assert main(["compare", "--qkv", str(path), "--methods", "softmax", "skyformer",
                 "kdeformer", "--features", "8", "--repeats", "1", "--no-memory", "--maps",
                 str(figure), "--maps-head", "1", "--json", str(out_json)]) == 0
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert f"wrote {figure}: the attention matrix of head 1 of the first sequence" in printed
    maps = json.loads(out_json.read_text())["maps"]
    assert maps["head"] == 1 and maps["path"] == str(figure)
    errors = {m["method"]: m for m in maps["matrix_errors"]}
    # softmax draws its target; skyformer's is drawn first, in a panel of its own
    assert list(errors) == ["exact gaussian", "softmax", "skyformer", "kdeformer"]
    assert errors["exact gaussian"]["reason"] == "the exact matrix of the target"
    assert errors["softmax"]["error"] < 1e-5
    assert errors["kdeformer"]["error"] is None
    assert errors["kdeformer"]["reason"] == "no attention matrix: its output is not linear in V"
    one = {"key_padding_mask": mask[:1]}
    head = (q[:1, 1:2].double(), k[:1, 1:2].double())
    exact = attention_weights(*head, "kernelized", **one)[0, 0]
    sky = attention_weights(*head, "skyformer", num_features=8,
                            generator=torch.Generator().manual_seed(0), **one)[0, 0]
    want = (torch.linalg.matrix_norm(sky - exact, ord=2)
            / torch.linalg.matrix_norm(exact, ord=2)).item()
    assert errors["skyformer"]["error"] == pytest.approx(want, rel=1e-4)
    assert 0.01 < want < 1  # 8 landmarks of 20 keys: an approximation, not the matrix
    assert f"  skyformer                matrix error {want:.3g} (gaussian)" in printed


def test_a_method_without_a_matrix_alone_is_shown_beside_its_exact_target(tmp_path, saved):
    """--methods kdeformer alone drew one empty panel: the exact matrix of its target
    was computed for the methods with a matrix only."""
    path, *_ = saved
    figure, out_json = tmp_path / "maps.png", tmp_path / "compare.json"
    assert main(["compare", "--qkv", str(path), "--methods", "kdeformer", "--repeats", "1",
                 "--no-memory", "--maps", str(figure), "--json", str(out_json)]) == 0
    maps = json.loads(out_json.read_text())["maps"]["matrix_errors"]
    assert [(m["method"], m["reason"]) for m in maps] == [
        ("exact softmax", "the exact matrix of the target"),
        ("kdeformer", "no attention matrix: its output is not linear in V")]


@pytest.mark.parametrize(("arguments", "says"), [
    (["--maps-head", "2"], "--maps-head must be below the 2 heads of the Q/K/V, got 2."),
    (["--maps-head", "-1"], "maps_head (--maps-head) must be a head's index, 0 or more"),
    (["--maps", "maps.txt"], "--maps maps.txt: matplotlib writes")])
def test_a_head_or_figure_it_cannot_draw_is_refused_before_the_table(
        tmp_path, capsys, saved, arguments, says):
    path = saved[0]
    figure = ["--maps", str(tmp_path / "m.png")] if "--maps" not in arguments else []
    assert main(["compare", "--qkv", str(path), "--methods", "softmax", "--repeats", "1",
                 "--no-memory", *figure, *arguments]) == 2
    out = capsys.readouterr()
    assert says in out.err and "spectral err" not in out.out


def test_the_figure_keeps_its_title_above_the_panels_captions(tmp_path, monkeypatch):
    """The last panel's caption ("method (target) / matrix error") became the figure's
    title: the loop's variable took the argument's name."""
    pytest.importorskip("matplotlib")
    import skyformer.eval.compare.maps as maps
    import skyformer.io

    shown = {}

    def keep(fig, path, **options):
        shown["title"] = fig._suptitle.get_text()
        shown["captions"] = [ax.get_title() for ax in fig.axes]
        return path

    monkeypatch.setattr(skyformer.io, "save_figure", keep)  # imported at the call
    panels = [maps.MapPanel("softmax", "softmax", torch.eye(3, dtype=torch.float64), 0.0,
                            top=1.0),
              maps.MapPanel("skyformer", "gaussian", torch.eye(3, dtype=torch.float64), 0.25,
                            top=1.0)]
    maps.plot_maps(panels, tmp_path / "maps.png", "head 0: the matrices")
    assert shown["title"] == "head 0: the matrices"
    assert "skyformer (gaussian)\nmatrix error 0.25" in shown["captions"]


def test_a_head_without_maps_is_noted_as_changing_nothing(capsys, saved):
    """--maps-head 99 without --maps ran without a word; with --maps it is refused."""
    assert main(["compare", "--qkv", str(saved[0]), "--methods", "softmax", "--repeats", "1",
                 "--no-memory", "--maps-head", "99"]) == 0
    assert "note: --maps-head changes nothing in this run: only --maps reads it." in \
        capsys.readouterr().err


def test_a_target_the_inputs_exclude_is_its_methods_reason_not_an_error(tmp_path):
    """A causal method on cross-attention inputs (Nq != Nk), where the causal target
    cannot run: the exact target's matrix was computed outside the method's guard and
    the command stopped with exit code 2; the method's panel gives the reason."""
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "rect.pt"
    torch.save({"q": torch.randn(1, 1, 16, 8, generator=g),
                "k": torch.randn(1, 1, 24, 8, generator=g),
                "v": torch.randn(1, 1, 24, 8, generator=g)}, path)
    out_json = tmp_path / "compare.json"
    assert main(["compare", "--qkv", str(path), "--methods", "softmax[causal=True]",
                 "softmax", "--repeats", "1", "--no-memory", "--maps",
                 str(tmp_path / "maps.png"), "--json", str(out_json)]) == 0
    maps = {m["method"]: m for m in json.loads(out_json.read_text())["maps"]["matrix_errors"]}
    assert maps["softmax[causal=True]"]["reason"].startswith("softmax: causal=True needs")
    assert maps["softmax"]["error"] < 1e-5
