"""Counter-based random numbers: keys, streams, and length-independent draws."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import scipy.stats
import torch

from skyformer.sketch.random_features import gaussian_columns
from skyformer.sketch.rng import (
    bulk_normal,
    check_key,
    draws_from,
    fold_in,
    normal,
    random_key,
    row_uniform,
    stream,
    uniform,
    uniform_at,
)
from tests.conftest import gen


def test_a_draw_depends_only_on_the_key_and_its_index():
    key = random_key(gen(0))
    assert torch.equal(uniform(key, (10,)), uniform(key, (1000,))[:10])
    assert torch.equal(uniform_at(key, torch.tensor([7, 3])), uniform(key, (8,))[[7, 3]])
    assert not torch.equal(uniform(key, (10,)), uniform(random_key(gen(1)), (10,)))
    assert torch.equal(random_key(gen(0)), key)  # one draw of the generator
    assert torch.equal(random_key(key), key) and torch.equal(random_key(5), random_key(5))


def test_a_generators_key_is_drawn_on_the_generators_device(monkeypatch):
    """random_key(g) drew on the CPU whatever g's device: torch refuses a CUDA generator
    in a CPU draw, and the sentences for torch.compile and activation checkpointing tell
    users to pass exactly skyformer.random_key(g)."""
    seen = []

    class CudaGenerator(torch.Generator):
        device = torch.device("cuda", 0)

    def randint(*args, generator, device, **kwargs):
        seen.append((device, generator.device))
        return torch.zeros(2, dtype=torch.long)

    monkeypatch.setattr(torch, "randint", randint)
    random_key(CudaGenerator())
    assert seen == [(torch.device("cuda", 0), torch.device("cuda", 0))]
    assert random_key(gen(0), "meta").device.type == "meta"  # drawn, then moved


@pytest.mark.parametrize("source", ["abc", 1.5, True])
def test_a_key_from_anything_else_is_refused_in_a_sentence(source):
    with pytest.raises(TypeError, match=r"random_key takes a torch\.Generator, an int seed"):
        random_key(source)


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_an_int_seed_outside_64_bits_is_refused_rather_than_wrapped(seed):
    # -1 and 2^64 would otherwise name the streams of 2^64 - 1 and 0
    with pytest.raises(ValueError, match=r"seed must be an integer from 0 to 2\^64 - 1"):
        random_key(seed)


def test_streams_and_folded_keys_are_independent():
    key = random_key(gen(0))
    a, b = uniform(stream(key, "a"), (20000,)), uniform(stream(key, "b"), (20000,))
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 0.03  # 4 sigma at n = 20000
    per_element = uniform(fold_in(key, torch.arange(3)), (5,))  # [3, 5]
    assert per_element.shape == (3, 5)
    assert not torch.equal(per_element[0], per_element[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_uniform_and_normal_have_their_distributions(dtype):
    key = random_key(gen(2))
    u = uniform(key, (50000,), dtype)
    assert u.dtype == dtype and u.min() >= 0 and u.max() < 1
    assert scipy.stats.kstest(u.double().numpy(), "uniform").pvalue > 1e-3
    z = normal(key, (50000,), dtype)
    assert scipy.stats.kstest(z.double().numpy(), "norm").pvalue > 1e-3


def test_bulk_normal_is_normal_pairwise_independent_and_indexed_by_position():
    key = random_key(gen(3))
    z = bulk_normal(key, (50001,))  # odd: the last pair keeps one output
    assert z.dtype == torch.float32 and z.shape == (50001,)
    assert scipy.stats.kstest(z.double().numpy(), "norm").pvalue > 1e-3
    # the two outputs of a pair are independent normals: uncorrelated, and so are squares
    pairs = z[:50000].view(-1, 2).double()
    assert abs(torch.corrcoef(pairs.T)[0, 1]) < 0.04  # 4 sigma at 25000 pairs
    assert abs(torch.corrcoef(pairs.square().T)[0, 1]) < 0.04
    assert z.abs().max() <= (2 * 24 * torch.log(torch.tensor(2.0))).sqrt()
    assert torch.equal(bulk_normal(key, (7, 3)).reshape(-1), z[:21])
    assert torch.equal(bulk_normal(fold_in(key, torch.arange(2)), (5,))[1],
                       bulk_normal(fold_in(key, 1), (5,)))


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="inductor on CPU needs a C++ compiler")
def test_fold_in_takes_a_symbolic_int_under_torch_compile():
    """An int that torch.compile makes symbolic (a size, or an int argument after a
    recompilation) folds in as a tensor would: hashed with symbolic bit operations it
    broke Inductor's C++ code ("<expression error>", a make_signed_t of float)."""
    key = random_key(gen(0))
    compiled = torch.compile(lambda key, x: fold_in(key, x.shape[0]), fullgraph=True,
                             dynamic=True)
    for n in (5, 6):
        assert torch.equal(compiled(key, torch.zeros(n)), fold_in(key, torch.tensor(n)))
    assert torch.equal(fold_in(key, 5), fold_in(key, torch.tensor(5)))
    assert torch.equal(fold_in(key, 2**32 - 3), fold_in(key, torch.tensor(2**32 - 3)))


def test_row_uniform_is_indexed_by_rank_among_valid_rows():
    key = random_key(gen(0))
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 0, 1, 1]], dtype=torch.bool)
    masked = row_uniform(key, mask, 2, 5)
    plain = row_uniform(key, None, 2, 3)
    torch.testing.assert_close(masked[0, :3], plain[0], rtol=0, atol=0)
    torch.testing.assert_close(masked[1, [1, 3, 4]], plain[1], rtol=0, atol=0)
    # an element's numbers do not depend on the other elements
    torch.testing.assert_close(row_uniform(key, None, 1, 3)[0], plain[0], rtol=0, atol=0)


def test_bad_keys_get_a_sentence():
    with pytest.raises(TypeError, match="random key must be an int64 tensor"):
        check_key(torch.zeros(2))
    with pytest.raises(TypeError, match="random key"):
        check_key(torch.zeros(3, dtype=torch.long))


def test_gaussian_columns_share_a_prefix_across_lengths():
    short = gaussian_columns((2, 3), 17, gen(0))
    long = gaussian_columns((2, 3), 600, gen(0))
    assert short.shape == (2, 3, 17) and long.shape == (2, 3, 600)
    assert torch.equal(long[..., :17], short)
    assert not torch.equal(gaussian_columns((2, 3), 17, gen(1)), short)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_uniforms_of_a_half_type_stay_below_one(dtype):
    """24 random bits rounded to a half type gave 1.0 (45 of 20000 in bfloat16)."""
    u = uniform(random_key(0), (20000,), dtype)
    assert u.dtype == dtype and u.min() >= 0 and u.max() < 1
    assert u.unique().numel() > 100  # every representable step is reached, not a few


def test_draws_from_gives_the_generator_to_calls_without_one():
    """Inside ``draws_from(g)`` torch's random functions, Tensor methods and nn.init draw
    from ``g`` what the global generator seeded alike would, a given generator is kept,
    and the global generator is left as it was."""
    def draws(generator=None):
        w = torch.empty(2, 3)
        torch.nn.init.kaiming_uniform_(w, a=5 ** 0.5)
        return [torch.randn(4), torch.randint(0, 9, (3,)), torch.empty(3).normal_(), w,
                torch.rand_like(w), torch.randn(2, generator=generator)]

    own = torch.Generator().manual_seed(8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        expected = draws(torch.Generator().manual_seed(8))
    before = torch.get_rng_state()
    with draws_from(torch.Generator().manual_seed(3)):
        got = draws(own)
    assert torch.equal(torch.get_rng_state(), before)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_distinct_int_seeds_give_distinct_keys():
    """Both words were folded by the seed's low half, a map of 2^32 seeds onto about
    0.63 * 2^32 keys: seeds 52406 and 69315 made one key and drew alike."""
    from skyformer.sketch.rng import random_key

    assert not torch.equal(random_key(52406), random_key(69315))
    seeds = [0, 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**63, 2**64 - 1]
    keys = {tuple(random_key(s).tolist()) for s in seeds}
    assert len(keys) == len(seeds)  # the high half counts too
    assert torch.equal(random_key(np.int64(3)), random_key(3))  # a NumPy seed is a seed
    first = {random_key(s)[0].item() for s in range(0, 70000, 7)}
    assert len(first) == len(range(0, 70000, 7))  # the first word alone is one-to-one


def test_one_key_draws_alike_in_every_call_and_fold_in_gives_each_layer_its_own():
    """The documented way to give layers their own draws from one key."""
    import skyformer

    q = torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(0))
    key = skyformer.random_key(0)
    run = [skyformer.attention(q, q, q, "skyformer", num_features=8, generator=k)
           for k in (key, key, skyformer.fold_in(key, 1))]
    assert torch.equal(run[0], run[1]) and not torch.equal(run[0], run[2])


@pytest.mark.parametrize(("data", "error", "words"), [
    (2**32, ValueError, r"must be in \[0, 2\^32\) .*4294967296 would give the stream of 0"),
    (-1, ValueError, r"-1 would give the stream of 4294967295"),
    (np.int64(2**32), ValueError, r"4294967296 would give the stream of 0"),  # aliased
    (np.int64(-1), ValueError, r"-1 would give the stream of 4294967295"),
    (1.5, TypeError, r"an int in \[0, 2\^32\) or an integer tensor, got float 1\.5"),
    (True, TypeError, r"got bool True"),
    (torch.tensor([0.5]), TypeError, r"got a torch\.float32 tensor"),
    (np.float32(0.5), TypeError, r"got a NumPy float32 value"),
])
def test_fold_in_refuses_data_whose_stream_would_be_anothers(data, error, words):
    with pytest.raises(error, match=rf"^fold_in: .*{words}"):
        fold_in(random_key(0), data)
    with pytest.raises(TypeError, match=r"^fold_in: a random key must be an int64 tensor "
                                        r"\[\.\.\., 2\] .*, got int\.$"):
        fold_in(3, 1)
    assert torch.equal(fold_in(random_key(0), np.int64(5)), fold_in(random_key(0), 5))
    assert torch.equal(fold_in(random_key(0), np.arange(3)),
                       fold_in(random_key(0), torch.arange(3)))
