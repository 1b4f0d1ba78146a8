"""Experiments call registered methods through the registry's binding: as a function call
or, with ``as_layer``, with the per-layer state a layer owns."""

from __future__ import annotations

import pytest
import torch

from skyformer import attention
from skyformer.eval.bench.run import BenchConfig, run_bench
from skyformer.eval.measure.memory import MemoryJob, peak_memory_bytes
from skyformer.eval.methods import resolve
from skyformer.ops.linformer import linformer_attention
from tests.conftest import gen, make_qkv


def as_layer(method, q, k, v, generator=None, **options):
    call = resolve(method).prepare(tuple(q.shape), options, dtype=q.dtype, as_layer=True)
    return call(q, k, v, generator)


def test_stateful_method_gets_its_kept_state_module():
    q, k, v = make_qkv(1, 2, 20, 8)
    a = as_layer("linformer", q, k, v, num_features=6, max_seq_len=20)
    b = as_layer("linformer", q, k, v, num_features=6, max_seq_len=20)
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same learned projections
    # not the bare call's Gaussian projections drawn from the generator
    assert not torch.allclose(a, linformer_attention(q, k, v, num_features=6, generator=gen(0)))


def test_stateless_method_equals_attention():
    q, k, v = make_qkv(1, 2, 20, 8)
    torch.testing.assert_close(
        as_layer("informer", q, k, v, generator=gen(1)),
        attention(q, k, v, "informer", generator=gen(1)),
        rtol=0, atol=0,
    )


def test_usable_as_a_memory_job():
    job = MemoryJob("linformer", (1, 2, 1024, 16), options={"num_features": 32},
                    backward=True, as_layer=True)
    # the [2, 1024, 32] float32 attention matrix alone is 256 KiB
    assert peak_memory_bytes(job) > 2**18


def test_recorded_options_are_those_a_call_on_the_sequence_runs_with():
    """A budget above the sequence is capped in the call (``registry.autocast.capped``);
    result files record the capped value."""
    nystromformer = resolve("nystromformer")
    assert nystromformer.resolved_options({"num_features": 128}, 20)["num_features"] == 20
    assert nystromformer.resolved_options({"num_features": 8}, 20)["num_features"] == 8
    q, k, v = make_qkv(1, 2, 20, 8)
    torch.testing.assert_close(attention(q, k, v, "nystromformer", num_features=128),
                               attention(q, k, v, "nystromformer", num_features=20),
                               rtol=0, atol=0)


def test_bench_rows_record_the_capped_budget():
    config = BenchConfig(methods=("nystromformer",), seq_lens=(16,), shapes=((1, 1, 8),),
                         num_features=64, repeats=1, warmup=0, memory=False)
    rows = {r["method"]: r for r in run_bench(config).rows}
    assert rows["nystromformer"]["num_features"] == 16


def test_one_method_named_twice_in_other_spellings_is_refused_by_every_command():
    """A variant's options in another order or spelling run the same method: each would
    be measured again, under a name of its own."""
    import pytest

    from skyformer.eval.approx.run import ApproxConfig
    from skyformer.eval.compare.run import CompareConfig
    from skyformer.eval.hf.run import HFEvalConfig

    same = ("linear[eps=0.001,causal=false]", "linear[causal=False, eps=1e-3]")
    said = (r"methods \(--methods\) lists 'linear\[eps=0.001,causal=false\]' and "
            r"'linear\[causal=False, eps=1e-3\]', one method with the same options; give it once")
    for make in (lambda m: CompareConfig(methods=m), lambda m: BenchConfig(methods=m),
                 lambda m: ApproxConfig(methods=m), lambda m: HFEvalConfig(methods=m).validate()):
        with pytest.raises(ValueError, match=said):
            make(same)
        make(("linear", "linear[eps=0.001]", "softmax"))  # other options: two methods


def test_a_prepared_call_takes_the_key_padding_mask():
    """``compare`` passes a padded batch's mask to each method through ``prepare``."""
    q, k, v = make_qkv(2, 2, 20, 8)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, 13:] = False
    call = resolve("nystromformer").prepare(tuple(q.shape), {"num_features": 4},
                                            dtype=q.dtype)
    masked = call(q, k, v, gen(1), key_padding_mask=mask)
    torch.testing.assert_close(
        masked, attention(q, k, v, "nystromformer", num_features=4, key_padding_mask=mask,
                          generator=gen(1)), rtol=0, atol=0)
    assert not torch.allclose(masked, call(q, k, v, gen(1)))


def test_a_plain_function_gets_the_mask_only_where_one_is_given():
    """A ``module:function`` need not take a mask; one that does gets it when given."""
    q, k, v = make_qkv(1, 2, 12, 8)
    mask = torch.ones(1, 12, dtype=torch.bool)
    mask[0, 9:] = False
    sdpa = resolve("torch.nn.functional:scaled_dot_product_attention@softmax")
    plain = sdpa.prepare(tuple(q.shape), {})(q, k, v, None)
    torch.testing.assert_close(plain, attention(q, k, v, "softmax"))
    exact = resolve("skyformer.ops.softmax:softmax_attention@softmax")
    torch.testing.assert_close(
        exact.prepare(tuple(q.shape), {})(q, k, v, None, key_padding_mask=mask),
        attention(q, k, v, "softmax", key_padding_mask=mask), rtol=0, atol=0)


def test_a_function_of_a_module_in_the_current_folder_is_found(tmp_path, monkeypatch):
    """``bench --methods my_methods:f@softmax`` run beside my_methods.py said "cannot load
    ... No module named 'my_methods'" although the format was right (``--plugin`` finds
    such a module); the current folder is searched too, after the installed packages."""
    import sys

    (tmp_path / "beside_methods.py").write_text(
        "from skyformer.ops import softmax_attention as attention\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        named = resolve("beside_methods:attention@softmax")
        assert named.target == "softmax" and sys.path[-1] == str(tmp_path)
        with pytest.raises(ValueError, match=r"cannot load 'nowhere_methods:f' \(No module "
                                             r"named 'nowhere_methods'\); expected "
                                             r"'package.module:function', the module "
                                             r"importable from here"):
            resolve("nowhere_methods:f@softmax")
    finally:
        sys.modules.pop("beside_methods", None)
