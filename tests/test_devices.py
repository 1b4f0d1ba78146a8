"""Every command and run parses its device in one place: the CPU or a CUDA device this
machine has, anything else refused with one sentence before any work."""

from __future__ import annotations

import re

import pytest
import torch

from skyformer.devices import parse_device
from skyformer.eval.bench.run import BenchConfig
from skyformer.eval.hf.run import HFEvalConfig
from skyformer.lra.distributed import pick_device


def test_cpu_and_cuda_spellings():
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_device(torch.device("cpu")) == torch.device("cpu")
    assert pick_device("cpu", local_rank=0) == torch.device("cpu")


@pytest.mark.parametrize("request_", ["mps", "meta", "xpu", "tpu", "cuda:x", "", None, 3.5])
def test_other_devices_are_named_in_one_sentence(request_):
    for check in (parse_device, lambda r: BenchConfig(device=r),
                  lambda r: HFEvalConfig(device=r).validate()):
        with pytest.raises(ValueError, match="device must be cpu, cuda or cuda:K, got "
                                             + re.escape(repr(request_))):
            check(request_)
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:K"):
        pick_device(request_, local_rank=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
@pytest.mark.parametrize("request_", ["cuda", "cuda:0", "cuda:7"])
def test_cuda_without_cuda_says_so(request_):
    with pytest.raises(ValueError, match=f"device '{request_}' was asked for but CUDA is not "
                                         "available here; use cpu"):
        parse_device(request_)
    with pytest.raises(ValueError, match="CUDA is not available"):
        pick_device(request_, local_rank=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_index_beyond_the_machine_is_refused():
    count = torch.cuda.device_count()
    assert parse_device(f"cuda:{count - 1}").index == count - 1
    with pytest.raises(ValueError, match=f"has {count} CUDA device"):
        parse_device(f"cuda:{count}")


def test_lra_stability_checks_its_device_before_any_work(tmp_path):
    from skyformer.lra.stability import run_stability

    with pytest.raises(ValueError, match="device must be cpu, cuda or cuda:K, got 'meta'"):
        run_stability(["listops"], ["skyformer"], cache_root=tmp_path / "no-cache",
                      device="meta")
