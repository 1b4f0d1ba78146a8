"""Every seed a user passes is checked in one place: an integer in [0, 2^64), the range
torch.Generator.manual_seed takes, refused with a sentence before any work."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from skyformer.cli import main
from skyformer.eval.approx.run import ApproxConfig
from skyformer.eval.bench.run import BenchConfig
from skyformer.eval.compare.run import CompareConfig
from skyformer.eval.hf.finetune import FinetuneConfig
from skyformer.eval.hf.run import HFEvalConfig
from skyformer.lra import make_config
from skyformer.lra.listops_gen import write_listops
from skyformer.lra.pathfinder_gen import write_pathfinder
from skyformer.lra.readers.pathfinder import read_pathfinder
from skyformer.lra.readers.text import read_text
from skyformer.seeds import SEED_LIMIT, check_seed

BAD = [-1, SEED_LIMIT, 1.5, True, "0"]


def test_the_limit_is_torchs():
    torch.Generator().manual_seed(SEED_LIMIT - 1)
    with pytest.raises((RuntimeError, ValueError), match="Overflow"):
        torch.Generator().manual_seed(SEED_LIMIT)
    check_seed("seed", 0)
    check_seed("seed", SEED_LIMIT - 1)


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("build", [
    lambda s: CompareConfig(seed=s),
    lambda s: BenchConfig(seed=s),
    lambda s: ApproxConfig(seeds=(0, s)),
    lambda s: HFEvalConfig(seed=s).validate(),
    lambda s: FinetuneConfig(seed=s).validate(),
    lambda s: make_config("listops", seed=s),
], ids=["compare", "bench", "approx", "hf-eval", "finetune", "lra-train"])
def test_configs_refuse_seeds_out_of_range(build, value):
    # hf-eval names the flag beside the setting: "seed (--seed) must be ..."
    with pytest.raises(ValueError,
                       match=r"seeds?(?: \(--seeds?\))? must be an integer from 0 to 2\^64 - 1"):
        build(value)


def test_approx_refuses_a_bad_data_seed():
    with pytest.raises(ValueError, match=r"data_seed \(--data-seed\) must be an integer from 0 "
                                         r"to 2\^64 - 1"):
        ApproxConfig(data_seed=-3)


def test_generators_and_splits_refuse_before_writing(tmp_path):
    with pytest.raises(ValueError, match=r"seed must be an integer from 0"):
        write_listops(tmp_path / "listops", train=2, dev=1, test=1, seed=-1)
    with pytest.raises(ValueError, match=r"seed must be an integer from 0"):
        write_pathfinder(tmp_path / "pathfinder", 2, seed=SEED_LIMIT)
    assert not (tmp_path / "listops").exists() and not (tmp_path / "pathfinder").exists()
    for read in (read_text, read_pathfinder):
        with pytest.raises(ValueError, match=r"split_seed must be an integer from 0"):
            read(tmp_path / "missing", split_seed=-1)


@pytest.mark.parametrize("argv", [
    ["bench", "--seed", str(SEED_LIMIT), "--seq-lens", "16", "--methods", "softmax"],
    ["compare", "--seed", str(SEED_LIMIT), "--seq-len", "16"],
    ["approx", "--seeds", "-5", "--seq-lens", "16"],
], ids=["bench", "compare", "approx"])
def test_the_command_says_which_seed(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"skyformer {argv[0]}: error: seed" in err and "2^64 - 1" in err, err
    assert not any(tmp_path.iterdir()), "nothing is written"


@pytest.mark.parametrize("method", ["linformer", "performer", "skyformer"])
def test_every_layer_of_a_model_takes_the_largest_seed(method):
    """Layer i draws under (seed + i) mod 2^64: a seed near 2^64 overflowed from layer 1 on."""
    pytest.importorskip("transformers")
    import skyformer.hf as shf
    from tests.hf.conftest import tiny_bert

    model = tiny_bert()
    shf.set_attention(model, method, seed=SEED_LIMIT - 1)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    a, b = (model(ids).last_hidden_state for _ in range(2))
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # seeded: the same draws every call


@pytest.mark.parametrize("value", [np.int64(3), torch.tensor(3)])
def test_a_numpy_or_torch_integer_is_refused_naming_the_python_int_wanted(value):
    """"must be an integer ..., got np.int64(3)" did not say what was wrong with it."""
    with pytest.raises(ValueError, match=r"seed must be an integer from 0 to 2\^64 - 1 \(a "
                                         r"Python int: pass int\(value\)\), got"):
        check_seed("seed", value)
    check_seed("seed", int(value))
