"""Sequence-parallel attention on gloo: P = 2 and 3 CPU processes give the outputs,
gradients and landmarks of one process (float64, uneven shards, padding across a shard
boundary, shards that are entirely padding), bad use gets a sentence, and
MultiHeadAttention trains data x sequence parallel on a 2 x 2 grid."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from seqpar_workers import (
    CAUSAL_NYSTROM,
    check_autocast,
    check_causal_backward_under_anomaly_detection,
    check_causal_blocks,
    check_causal_collectives,
    check_causal_nystrom_softmax_shifts,
    check_each,
    check_equal,
    check_errors,
    check_float32_norms_past_its_reach,
    check_gradients_present_on_some_ranks,
    check_gradients_recorded_on_some_ranks,
    check_layer_2d,
    check_layer_copies,
    check_masks_without_a_real_token,
    check_one_rank_fails,
    check_performer_layer,
    check_ranks_disagree,
    check_sum_gradients_of_models_that_differ,
    check_sum_gradients_of_sparse_gradients,
    spawn,
)

import skyformer
from skyformer.distributed import sequence_parallel_attention, shard_bounds, sum_gradients


def test_two_processes_uneven_shards_padding_on_the_boundary_and_a_padded_shard():
    mask = torch.ones(2, 23, dtype=torch.bool)
    mask[0, 10:16] = False  # across the boundary between the shards (13 + 10 rows)
    mask[1, :13] = False  # rank 0's shard of the second sequence is all padding
    spawn(2, check_equal, [13, 10], mask)


def test_three_processes_without_mask_and_with_a_wholly_padded_shard():
    mask = torch.ones(2, 23, dtype=torch.bool)
    mask[:, 16:] = False  # rank 2 holds only padding
    mask[1, 2:4] = False
    spawn(3, check_each, (check_equal, ([5, 11, 7], mask)), (check_equal, ([9, 1, 6], None)))


def test_causal_nystrom_methods_over_chunks_that_cross_the_shard_boundaries():
    """Causal skyformer and nystrom_softmax, chunks of 64 real tokens: a rank's first
    chunk begins on the ranks before it (on two of them with the one-row shards), and
    its earlier chunks are theirs too; ranks without padding after one with padding
    (they pass no mask)."""
    mask = torch.ones(2, 152, dtype=torch.bool)
    mask[0, 58:75] = False  # across the shard boundaries of both layouts
    mask[1, :90] = False
    mask[1, 130:135] = False
    spawn(3, check_equal, [70, 2, 80], mask, CAUSAL_NYSTROM)
    left = torch.ones(2, 152, dtype=torch.bool)  # left padding on rank 0 only: the other
    left[0, :5] = False  # ranks pass None, their real tokens counted after it
    left[1, :20] = False
    spawn(4, check_equal, [62, 1, 1, 88], left, dict(list(CAUSAL_NYSTROM.items())[:2]))


def test_float32_norms_past_its_reach_are_computed_as_one_process_computes_them():
    spawn(2, check_float32_norms_past_its_reach)


def test_causal_inference_runs_by_blocks_on_each_rank():
    spawn(2, check_causal_blocks)


@pytest.mark.parametrize("world", [2, 3])
def test_causal_offers_cross_in_one_exchange(world):
    spawn(world, check_causal_collectives)


def test_causal_exchanged_shifts_are_constants_for_autograd():
    spawn(2, check_causal_backward_under_anomaly_detection)


def test_a_mask_without_a_real_token_on_any_rank_gets_a_warning():
    spawn(2, check_masks_without_a_real_token)


def test_causal_nystrom_softmax_joins_the_earlier_ranks_at_their_largest_shift():
    spawn(3, check_causal_nystrom_softmax_shifts)


def test_bad_use_gets_a_sentence_on_every_rank():
    spawn(2, check_errors)


def test_a_check_failing_on_one_rank_stops_every_rank():
    spawn(2, check_one_rank_fails)


def test_methods_options_and_fixed_draws_that_differ_between_ranks_get_a_sentence():
    spawn(2, check_ranks_disagree)


def test_a_call_recorded_for_backward_on_some_ranks_only_gets_a_sentence():
    spawn(2, check_gradients_recorded_on_some_ranks)


def test_a_performer_layer_uses_its_own_features_as_on_one_process():
    spawn(2, check_performer_layer)


def test_autocast_casts_the_shards_as_one_process_does():
    spawn(2, check_autocast)


def test_a_layer_copies_with_its_group_and_refuses_pickling():
    spawn(1, check_layer_copies)


def test_layer_runs_data_by_sequence_parallel():
    spawn(4, check_layer_2d)


def test_gradients_missing_on_some_ranks_count_as_zero_and_zero_weighted_rows_join():
    spawn(2, check_gradients_present_on_some_ranks)


def test_sum_gradients_of_models_that_differ_between_ranks_gets_a_sentence():
    spawn(2, check_sum_gradients_of_models_that_differ)


def test_sum_gradients_of_sparse_gradients_gets_a_sentence():
    spawn(2, check_sum_gradients_of_sparse_gradients)


def test_without_an_initialised_group_the_call_says_so():
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialised .* or run "
                                           r"without sequence parallelism where one"):
        sequence_parallel_attention(q, q, q)
    with pytest.raises(RuntimeError, match=r"sum_gradients: torch\.distributed is not "
                                           r"initialised .* leave sum_gradients out where"):
        sum_gradients(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="cannot run sequence parallel"):
        skyformer.MultiHeadAttention(8, 2, "reformer", process_group=object())
    # a bad method or option says so itself (nobody waits without a group)
    with pytest.raises(ValueError, match="softmax cannot run sequence parallel"):
        sequence_parallel_attention(q, q, q, "softmax")
    # a variant runs, or is refused, as its method is
    with pytest.raises(ValueError, match=r"softmax\[scale=0\.5\] cannot run sequence "
                                         r"parallel: exact attention needs every key"):
        sequence_parallel_attention(q, q, q, "softmax[scale=0.5]")
    layer = skyformer.MultiHeadAttention(8, 2, "skyformer[num_features=4]",
                                         process_group=object())
    assert layer.bound.config.num_features == 4
    with pytest.raises(ValueError, match="num_features"):
        sequence_parallel_attention(q, q, q, "skyformer", num_features=0)


def test_a_layer_pickled_before_the_group_handle_loads():
    """Whole-module pickles from before the group was held by a handle kept
    ``process_group`` in the module's dict; they load and run."""
    import copy

    layer = skyformer.MultiHeadAttention(8, 2, "linear")
    state = layer.__getstate__().copy()
    state["process_group"] = state.pop("_group").group  # the old layout
    old = skyformer.MultiHeadAttention.__new__(skyformer.MultiHeadAttention)
    old.__setstate__(state)
    loaded = copy.deepcopy(old)  # through __reduce_ex__ and __setstate__ again
    x = torch.randn(1, 3, 8)
    assert loaded.process_group is None
    torch.testing.assert_close(loaded(x), layer(x))


@pytest.mark.parametrize("divide_by", [0, -2, float("nan"), "2", True, torch.tensor([2.0])],
                         ids=repr)
def test_sum_gradients_refuses_a_divisor_that_is_no_positive_number(divide_by):
    """Zero or a negative count made every gradient inf or flipped its sign silently; a
    string failed inside the sum. Checked before any collective (none is needed here)."""
    with pytest.raises(ValueError, match="divide_by must be a positive number"):
        sum_gradients(torch.nn.Linear(2, 2), divide_by=divide_by)


@pytest.mark.parametrize("divide_by", [np.int64(2), np.float32(2.0), torch.tensor(2)],
                         ids=repr)
def test_sum_gradients_takes_a_numpy_divisor(divide_by, tmp_path):
    """A count from numpy (np.prod of a mesh's sizes) or a 0-d tensor (a world size
    summed by a collective) is a positive number too; it was refused as none. In a group
    of one process, the gradient is divided by it."""
    import torch.distributed as dist

    layer = torch.nn.Linear(2, 2)
    layer(torch.ones(1, 2)).sum().backward()
    want = [p.grad / 2 for p in layer.parameters()]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        sum_gradients(layer, divide_by=divide_by)
    finally:
        dist.destroy_process_group()
    for p, g in zip(layer.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, g)


def test_shard_bounds_cover_the_sequence_contiguously():
    bounds = [shard_bounds(10, 4, r) for r in range(4)]
    assert bounds == [(0, 3), (3, 6), (6, 8), (8, 10)]
    with pytest.raises(ValueError, match="rank < world <= n"):
        shard_bounds(3, 4, 0)
    # a float (10.0, or a rank of 1.5) gave float bounds that no slice takes, or nonsense
    for args in ((10.0, 3, 0), (10, 3, 1.5), (10, True, 0)):
        with pytest.raises(ValueError, match="must be integers"):
            shard_bounds(*args)


def _example_losses(procs: int, *sizes: str) -> list[float]:
    """The losses examples/sequence_parallel_train.py prints, run on ``procs`` processes."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "sequence_parallel_train.py"
    launch = [sys.executable] if procs == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(procs)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launch, str(script), *sizes], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return [float(x) for x in re.findall(r"loss (\S+)", done.stdout)]


@pytest.mark.parametrize("causal", [False, True], ids=["masked", "causal"])
def test_the_training_example_sharded_over_two_processes_takes_one_process_steps(causal):
    """The hidden characters of a position do not depend on the sharding, nor does the
    next character (a decoder, causal attention): two shards train as one process does
    (the same loss at every step)."""
    sizes = ["--seq-len", "2500", "--steps", "3", "--dim", "16", "--features", "8",
             *(["--causal"] if causal else [])]
    one = _example_losses(1, *sizes)
    assert len(one) == 3
    assert _example_losses(2, *sizes) == pytest.approx(one, abs=2e-3)


def test_the_fingerprint_of_a_large_tensor_is_taken_by_slices_to_the_same_sum(monkeypatch):
    """sum_gradients' first call fingerprints every parameter: whole, an 80 MB one took
    620 MB of int64 temporaries. By slices the sum is the same, and moves with a swap."""
    from skyformer.distributed import layout

    t = torch.randn(5000, dtype=torch.float64)
    bits = t.view(torch.int64)
    whole = (bits * (torch.arange(1, 5001) * 2654435761 + 1)).sum()
    monkeypatch.setattr(layout, "_FINGERPRINT_SLICE", 1024)
    assert int(layout.fingerprint([t])) == int(whole)
    assert int(layout.fingerprint([t.flip(0)])) != int(whole)
