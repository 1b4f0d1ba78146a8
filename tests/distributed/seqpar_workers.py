"""Code the spawned processes of ``test_sequence_parallel.py`` run (a module, not a test
file, so that the children can import it). Each worker builds the whole inputs from a
seed, computes the single-process reference itself, runs its shard and asserts."""

from __future__ import annotations

import copy
import datetime
import functools
import io
import os
import pickle
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import skyformer
from skyformer.distributed import (
    count_communication,
    destroy_process_group,
    forms,
    run_sequence_parallel,
    sequence_parallel_attention,
    sum_gradients,
)
from skyformer.distributed import landmarks as shard_landmarks
from skyformer.distributed.landmarks import draw_landmarks
from skyformer.distributed.layout import agree_layout
from skyformer.ops.shared.inputs import check_attention_inputs
from skyformer.ops.shared.modified_nystrom import sample_landmarks

METHODS = {
    "skyformer": {"num_features": 8},
    "nystrom_softmax": {"num_features": 8},
    "linear": {},
    "performer": {"num_features": 6},
    # causal: each shard's rows add the earlier shards' prefix sums
    "linear[causal=True]": {},
    "performer[causal=True]": {"num_features": 6},
    "skyformer[causal=True]": {"num_features": 8},
    "nystrom_softmax[causal=True]": {"num_features": 8},
}
# the causal modified Nystrom methods over several chunks of 64 real tokens, chunks
# across shard boundaries
CAUSAL_NYSTROM = {
    "skyformer[causal=True]": {"num_features": 8},
    "nystrom_softmax[causal=True]": {"num_features": 8},
    "skyformer[causal=True,causal_local=False]": {"num_features": 8},
    "nystrom_softmax[causal=True,causal_local=False,landmark_stride=5]": {"num_features": 8},
}
# float64 rounding: the shards' partial sums are added in another order than one
# process adds them; a few ulps of values of order 1, through the backward pass.
TOL = {"rtol": 1e-9, "atol": 1e-11}


def spawn(world: int, fn: Callable[..., None], *args: object) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` gloo processes; re-raise a failure."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world, os.path.join(tmp, "store"), fn, args), nprocs=world,
                 join=True)


def check_each(rank: int, world: int, *calls: tuple[Callable[..., None], tuple]) -> None:
    """Each ``(fn, args)`` of ``calls`` in turn in one process group: one start of the
    processes (seconds each) for several checks of the same world."""
    for fn, args in calls:
        fn(rank, world, *args)


def _entry(rank: int, world: int, store: str, fn: Callable[..., None], args: tuple) -> None:
    torch.set_num_threads(1)
    # no worker passes every rank the same rows by mistake (check_errors passes them once)
    warnings.filterwarnings("error", message=".*every rank of the group passed the same")
    # a rank left waiting for another (a hang) fails within minutes instead of gloo's 30
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        fn(rank, world, *args)
        dist.barrier()  # gloo: no rank closes its connections while another still reads
    except Exception:
        traceback.print_exc()
        raise
    finally:
        destroy_process_group()
    # A passing worker leaves without interpreter shutdown: PyTorch keeps references to
    # a group passed through torch.func's forward mode (the jvp checks), so its gloo
    # threads can outlive destroy_process_group into shutdown and abort the process
    # there (docs/distributed.md). Failures above still raise and are reported.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def inputs(n: int, seed: int = 0, b: int = 2, h: int = 2, d: int = 4):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    return q, k, v, torch.randn(b, h, n, d, generator=g, dtype=torch.float64)


def _shards(lengths: list[int]) -> list[slice]:
    ends = torch.tensor(lengths).cumsum(0).tolist()
    return [slice(e - n, e) for n, e in zip(lengths, ends, strict=True)]


def _tangent(attention: Callable[..., torch.Tensor], method: str, options: dict,
             mask: torch.Tensor | None, primals: tuple, tangents: tuple) -> torch.Tensor:
    """The output tangent of ``attention`` by ``torch.func.jvp``."""
    return torch.func.jvp(lambda q, k, v: attention(
        q, k, v, method, key_padding_mask=mask, generator=torch.Generator().manual_seed(7),
        **options), primals, tangents)[1]


def check_equal(rank: int, world: int, lengths: list[int], mask: torch.Tensor | None,
                methods: dict[str, dict] = METHODS) -> None:
    """Outputs, gradients, forward-mode tangents and landmarks equal to one process's,
    for every method."""
    n = sum(lengths)
    q, k, v, g = inputs(n)
    mine = _shards(lengths)[rank]
    shard_mask = None if mask is None else mask[:, mine]
    # a shard without padding passes None (as a decoder's later ranks, after left padding)
    local_mask = None if shard_mask is None or shard_mask.all() else shard_mask
    for method, options in methods.items():
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = skyformer.attention(*full, method, key_padding_mask=mask,
                                  generator=torch.Generator().manual_seed(7), **options)
        (ref * g).sum().backward()
        part = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
        out = sequence_parallel_attention(*part, method, key_padding_mask=local_mask,
                                          generator=torch.Generator().manual_seed(7),
                                          **options)
        (out * g[:, :, mine]).sum().backward()
        torch.testing.assert_close(out, ref[:, :, mine], **TOL, msg=f"{method} output")
        if mask is not None and not mask.all():  # padding never matters (every rank calls)
            clean = [t[:, :, mine].clone() for t in (q, k, v)]
            dirty = [t.clone() for t in clean]
            for t, bad in zip(dirty, (float("nan"), float("inf"), float("nan")), strict=True):
                t.masked_fill_(~shard_mask[:, None, :, None], bad)
            with torch.no_grad():
                got, want = (sequence_parallel_attention(
                    *inputs_, method, key_padding_mask=local_mask,
                    generator=torch.Generator().manual_seed(7), **options)
                    for inputs_ in (dirty, clean))
            assert torch.equal(got, want), f"{method} with garbage in padded rows"
        # a non-finite value in a real row of one shard marks the rows it reaches on every
        # rank, as one process's guard does (here an inf value: (0, head 1), every row)
        bad = [t.clone() for t in (q, k, v)]
        bad[2][0, 1, 0 if mask is None else int(mask[0].nonzero()[0]), 0] = float("inf")
        with torch.no_grad():
            want = skyformer.attention(*bad, method, key_padding_mask=mask,
                                       generator=torch.Generator().manual_seed(7), **options)
            got = sequence_parallel_attention(*(t[:, :, mine] for t in bad), method,
                                              key_padding_mask=local_mask,
                                              generator=torch.Generator().manual_seed(7),
                                              **options)
        marked = want[:, :, mine].isnan()
        assert torch.equal(got.isnan(), marked), f"{method}: marked rows"
        rows = marked[0, 1].all(-1)  # every real row of (0, head 1), no padded one
        assert torch.equal(rows, torch.ones_like(rows) if mask is None else shard_mask[0])
        torch.testing.assert_close(got[~marked], want[:, :, mine][~marked], **TOL,
                                   msg=f"{method} beside the marked rows")
        for name, a, b in zip("qkv", part, full, strict=True):
            torch.testing.assert_close(a.grad, b.grad[:, :, mine], **TOL,
                                       msg=f"{method} gradient of {name}")
        # forward mode: each shard's tangent is its part of one process's
        tangents = inputs(n, seed=1)[:3]
        want = _tangent(skyformer.attention, method, options, mask, (q, k, v), tangents)
        got = _tangent(sequence_parallel_attention, method, options, local_mask,
                       tuple(t[:, :, mine] for t in (q, k, v)),
                       tuple(t[:, :, mine] for t in tangents))
        torch.testing.assert_close(got, want[:, :, mine], **TOL, msg=f"{method} jvp")
        _check_double_backward(method, options, q, k, v, g, mask, mine)
    # the landmarks themselves, for a count that leaves slots without a landmark
    info = check_attention_inputs(q, k, v, mask, method="skyformer")
    key = skyformer.random_key(3)
    for m in (6, 4 * n):
        expected = sample_landmarks(info, m, q.device, key)
        local_info = check_attention_inputs(q[:, :, mine], k[:, :, mine], v[:, :, mine],
                                            local_mask, method="skyformer")
        layout = agree_layout("test", q[:, :, mine], v[:, :, mine], local_info.key_valid, key,
                              None, dist.group.WORLD)
        got, _, _ = draw_landmarks(m, layout, local_info.key_valid, 2, mine.stop - mine.start)
        for field in ("query_index", "query_live", "key_index", "key_live"):
            assert torch.equal(getattr(got, field), getattr(expected, field)), (m, field)


def _hessian_vector(attention: Callable[..., torch.Tensor], method: str, options: dict,
                    mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, g: torch.Tensor, directions: tuple[torch.Tensor, ...]
                    ) -> tuple[torch.Tensor, ...]:
    """H t for the loss sum(out * g) in (q, k, v), by reverse over reverse
    (create_graph): k and v reach every rank's output through the all-reduced sums."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, method, key_padding_mask=mask,
                    generator=torch.Generator().manual_seed(7), **options)
    grads = torch.autograd.grad((out * g).sum(), leaves, create_graph=True)
    return torch.autograd.grad(sum((d * t).sum() for d, t in zip(grads, directions,
                                                                  strict=True)), leaves)


def _forward_over_reverse(attention: Callable[..., torch.Tensor], method: str, options: dict,
                          mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, g: torch.Tensor, directions: tuple[torch.Tensor, ...]
                          ) -> tuple[torch.Tensor, ...]:
    """H t for the loss sum(out * g) in (q, k, v), by ``torch.func.jvp`` of
    ``torch.func.grad`` (each rank's loss its part of the whole sequence's)."""
    def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return (attention(q, k, v, method, key_padding_mask=mask,
                          generator=torch.Generator().manual_seed(7), **options) * g).sum()
    return torch.func.jvp(torch.func.grad(loss, argnums=(0, 1, 2)), (q, k, v), directions)[1]


def _check_double_backward(method: str, options: dict, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, g: torch.Tensor, mask: torch.Tensor | None,
                           mine: slice) -> None:
    """Forward over reverse across the ranks equals one process's Hessian-vector
    product for every method; reverse over reverse equals it too, or is refused on
    every rank as it is in one process (the fused backward passes of the Nystrom
    methods)."""
    directions = inputs(q.shape[2], seed=2)[:3]
    local = (None if mask is None else mask[:, mine], *(t[:, :, mine] for t in (q, k, v, g)),
             tuple(t[:, :, mine] for t in directions))
    want = _forward_over_reverse(skyformer.attention, method, options, mask, q, k, v, g,
                                 directions)
    got = _forward_over_reverse(sequence_parallel_attention, method, options, *local)
    for name, a, b in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(a, b[:, :, mine], **TOL,
                                   msg=f"{method} forward over reverse, {name}")
    results = []
    for attention, args in ((skyformer.attention, (mask, q, k, v, g, directions)),
                            (sequence_parallel_attention, local)):
        try:
            results.append(_hessian_vector(attention, method, options, *args))
        except RuntimeError as error:
            # the way that works across processes too
            assert "not differentiable" in str(error), str(error)
            assert "across processes" in str(error), str(error)
            results.append(None)
    want, got = results
    if want is None or got is None:
        assert want is None and got is None, f"{method}: refused by one side only"
        return
    for name, a, b in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(a, b[:, :, mine], **TOL,
                                   msg=f"{method} double backward, {name}")


def check_errors(rank: int, world: int) -> None:
    """Bad use gets the same sentence on every rank, and nobody waits forever."""
    q, k, v, _ = inputs(4 * world)
    s = slice(4 * rank, 4 * rank + 4)
    q, k, v = q[:, :, s], k[:, :, s], v[:, :, s]

    def raises(fragment: str, *args: object, **kwargs: object) -> None:
        try:
            sequence_parallel_attention(*args, **kwargs)
        except (ValueError, TypeError) as error:
            assert fragment in str(error), str(error)
        else:
            raise AssertionError(f"no error, expected {fragment!r}")

    raises("cannot run sequence parallel: its landmarks are segment means", q, k, v,
           "nystromformer")
    # as on one process: causal options without causal=True
    raises("skyformer: landmark_stride=4 shapes causal attention only (causal=True); this "
           "call is not causal, where it changes nothing: leave it out, or pass causal=True.",
           q, k, v, "skyformer", landmark_stride=4)
    raises("nystrom_softmax: causal_local=False shapes causal attention only (causal=True); "
           "this call is not causal, where it changes nothing: leave it out, or pass "
           "causal=True.", q, k, v, "nystrom_softmax", causal_local=False)
    raises("unknown attention method 'skyfromer'", q, k, v, "skyfromer")
    for group in ([0, 1], 0):  # torch said "unhashable type: 'list'", "Group 0 ..."
        raises("group must be a torch.distributed process group (torch.distributed."
               "new_group(ranks), or None for all processes)", q, k, v, "linear", group=group)
    first = dist.new_group([0])  # every process makes it; the others get torch's marker
    if rank != 0:  # it said "group must be a ... process group, got int -100"
        raises("linear (sequence parallel): this process is not a member of the process "
               "group it was given", q, k, v, "linear", group=first)
    seen, drawn = [], []  # the products and the draw run as asked, as in one process
    original, draw = forms.skyformer_from_core, shard_landmarks.stream_selection_keys
    forms.skyformer_from_core = lambda *a, **kw: seen.append(kw.get("kernel")) or original(
        *a, **kw)
    shard_landmarks.stream_selection_keys = lambda *a, **kw: drawn.append(
        kw.get("draw")) or draw(*a, **kw)
    try:
        sequence_parallel_attention(q, k, v, "skyformer", num_features=4, kernel="torch")
    finally:
        forms.skyformer_from_core = original
        shard_landmarks.stream_selection_keys = draw
    assert seen == ["torch"] and drawn == ["torch", "torch"], (seen, drawn)
    for variant, method, options in (("linear[eps=0.0]", "linear", {"eps": 0.0}),
                                     ("skyformer[num_features=4]", "skyformer",
                                      {"num_features": 4})):  # as the method with options
        g = torch.Generator()
        torch.testing.assert_close(
            sequence_parallel_attention(q, k, v, variant, generator=g.manual_seed(1)),
            sequence_parallel_attention(q, k, v, method, generator=g.manual_seed(1), **options),
            rtol=0, atol=0, msg=variant)
    wide = torch.cat([q, q], dim=-1) if rank == 1 else q
    raises("same batch size B, heads H, head dims D and Dv", wide, k if rank == 0 else wide,
           v)
    flat = q[0] if rank == 1 else q
    raises("must have shape [B, H, N, D]" if rank == 1 else "rejected their inputs",
           flat, k, v)
    raises("q and k must be shards of one sequence", q, k[:, :, :2], v[:, :, :2])
    for transform in (torch.func.jacfwd, torch.func.jacrev, torch.func.hessian):
        try:  # each rank would map over its own keys' directions
            transform(lambda k: sequence_parallel_attention(q, k, v, "linear").sum())(k)
        except RuntimeError as error:
            assert "torch.func.jvp of torch.func.grad" in str(error), str(error)
        else:
            raise AssertionError(f"{transform.__name__} ran across processes")
    skyformer.distributed.sequence_parallel_attention(q, k, v)  # the group still works
    whole, _, _, _ = inputs(4 * world)  # the whole sequence on every rank, not its shard
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sequence_parallel_attention(whole, whole, whole, "linear")
    assert [str(w.message) for w in caught] == [
        f"linear (sequence parallel): every rank of the group passed the same {4 * world} "
        f"rows of q, k and v (their first and last rows are equal on all {world} ranks), as "
        f"when each passes the whole sequence: each rank passes its own contiguous shard "
        f"(skyformer.distributed.shard_bounds(N, world_size, rank) gives its rows), and the "
        f"output is that of the shards concatenated, here {world} copies of these rows. "
        f"(Shards of a sequence whose rows are all alike, torch.ones, look the same: then "
        f"nothing is wrong.)"]
    assert caught[0].filename == __file__  # the warning points at the call
    torch.manual_seed(0)  # the same weights on every rank
    layer = skyformer.MultiHeadAttention(8, 2, "linear", process_group=dist.group.WORLD)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(torch.randn(1, 4 * world, 8, generator=torch.Generator().manual_seed(0)))
    assert [w.filename for w in caught] == [__file__]  # through a layer too, not nn.py


def _outcome(call: Callable[[], object]) -> str:
    """``"ok"`` or the sentence ``call`` raised."""
    try:
        call()
    except (ValueError, TypeError, KeyError) as error:
        return str(error)
    return "ok"


def check_one_rank_fails(rank: int, world: int) -> None:
    """A check that fails on one rank only, wherever it is made (binding the method, the
    shard, the layer's input): that rank raises its sentence and every other rank the
    sentence naming it, at once, instead of waiting for it in the exchange."""
    q, k, v, _ = inputs(4 * world)
    s = slice(4 * rank, 4 * rank + 4)
    q, k, v = q[:, :, s], k[:, :, s], v[:, :, s]
    bad = rank == world - 1
    cases = [
        (lambda: sequence_parallel_attention(q, k, v, "skyformer",
                                             num_features=0 if bad else 4),
         "num_features"),
        (lambda: sequence_parallel_attention(q, k, v, "softmax" if bad else "linear"),
         "softmax cannot run sequence parallel"),
        (lambda: sequence_parallel_attention(q, k, v, "linear",
                                             **({"epsilon": 1e-3} if bad else {})),
         "epsilon"),
        (lambda: sequence_parallel_attention(*(t[:, :, :0] if bad else t for t in (q, k, v)),
                                             "linear"),
         "this rank's shard of the sequence is empty"),
        (lambda: sequence_parallel_attention(q.to(torch.float8_e4m3fn) if bad else q, k, v,
                                             "linear"),
         "float8_e4m3fn"),
    ]
    torch.manual_seed(0)
    layer = skyformer.MultiHeadAttention(8, 2, "linear", process_group=dist.group.WORLD)
    x = torch.randn(1, 4, 8)
    cases += [(lambda: layer(x[..., :6] if bad else x), "must have shape [B, N, 8]"),
              (lambda: layer(x, context=x if bad else None), "it takes no context"),
              # torch's call on one rank (the others waited for it until the timeout)
              (lambda: layer(x, **({"need_weights": False} if bad else {})),
               "need_weights")]
    for call, fragment in cases:
        said = _outcome(call)
        expected = fragment if bad else f"rank(s) [{world - 1}] of the group rejected"
        assert expected in said, (rank, fragment, said)
    assert _outcome(lambda: sequence_parallel_attention(q, k, v, "linear")) == "ok"
    # the bound method's form takes the same defaults (the default group, no mask)
    assert torch.equal(run_sequence_parallel(skyformer.get_method("linear").bind(), q, k, v),
                       sequence_parallel_attention(q, k, v, "linear"))


def check_ranks_disagree(rank: int, world: int) -> None:
    """A method, options or a layer's fixed draws that differ between ranks get a
    sentence on every rank (they would mix unrelated sums, or crash the backend)."""
    q, k, v, _ = inputs(4 * world)
    s = slice(4 * rank, 4 * rank + 4)
    q, k, v = q[:, :, s], k[:, :, s], v[:, :, s]
    last = rank == world - 1
    same = "every rank must call the same method with the same options; rank(s) "
    for method, options in (("skyformer", {"num_features": 8 if last else 4}),
                            ("nystrom_softmax" if last else "skyformer", {"num_features": 4}),
                            ("performer", {"scale": 0.5 if last else 0.25})):
        said = _outcome(functools.partial(sequence_parallel_attention, q, k, v, method,
                                          **options))
        assert f"{same}[{world - 1}] differ from rank 0 (this rank, {rank}: {method} " in said, \
            said
    # one computation written two ways agrees: a variant and its method with the options
    variant = ("skyformer[num_features=4]", {}) if last else ("skyformer", {"num_features": 4})
    assert _outcome(functools.partial(sequence_parallel_attention, q, k, v, variant[0],
                                      generator=skyformer.random_key(0), **variant[1])) == "ok"
    torch.manual_seed(rank)  # a different seed per rank, the parameters then broadcast
    layer = skyformer.MultiHeadAttention(8, 2, "performer", num_features=4,
                                         process_group=dist.group.WORLD).double()
    for parameter in layer.parameters():
        dist.broadcast(parameter.data, 0)
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    said = _outcome(lambda: layer(x))
    assert "the layer's fixed random draws (projection) differ between ranks" in said, said
    for buffer in layer.buffers():
        dist.broadcast(buffer, 0)
    assert _outcome(lambda: layer(x)) == "ok"


def check_gradients_recorded_on_some_ranks(rank: int, world: int) -> None:
    """A call under torch.no_grad on one rank only (or with other inputs requiring
    gradients) gets a sentence on every rank: the ranks that record the call would wait
    in its backward all-reduce for the others, which had gone on to the next call's
    exchange (a collective of another size: a hang until the group's timeout)."""
    q, k, v, _ = inputs(4 * world)
    s = slice(4 * rank, 4 * rank + 4)
    q, k, v = (t[:, :, s].clone().requires_grad_() for t in (q, k, v))
    last = rank == world - 1
    for method in ("skyformer", "linear"):
        with torch.set_grad_enabled(not last):
            said = _outcome(lambda method=method: sequence_parallel_attention(q, k, v, method))
        assert "differ in which of q, k, v require gradients" in said, said
        assert f"rank {world - 1}: none" in said, said
        said = _outcome(lambda method=method: sequence_parallel_attention(
            q, k.detach() if last else k, v, method))
        assert f"rank {world - 1}: q, v)" in said and "rank 0: q, k, v;" in said, said
    with torch.no_grad():  # alike on every rank: runs
        assert _outcome(lambda: sequence_parallel_attention(q, k, v, "linear")) == "ok"
    out = sequence_parallel_attention(q, k, v, "linear")
    out.sum().backward()  # the group still works
    assert q.grad is not None


def check_performer_layer(rank: int, world: int) -> None:
    """A sequence-parallel Performer layer uses its own features, as on one process:
    it draws nothing from the global generator, and a non-finite feature marks every
    real row; causal too. A call refused on one rank is counted on none."""
    for causal in (False, True):
        _check_performer_layer(rank, world, causal)
    _check_a_refused_call_counts_nowhere(rank, world)


def _check_a_refused_call_counts_nowhere(rank: int, world: int) -> None:
    """The other ranks counted a call that one rank refused (they raise at the
    exchange, after counting): with a redraw every 2 calls, the ranks' features then
    differed at every other call."""
    torch.manual_seed(0)
    layer = skyformer.MultiHeadAttention(8, 2, "performer", num_features=4,
                                         feature_redraw_interval=2,
                                         process_group=dist.group.WORLD).double().train()
    x = torch.randn(1, 4, 8, dtype=torch.float64) + rank  # each rank its own shard
    layer(x)
    bad = x.float() if rank == world - 1 else x
    assert _outcome(lambda: layer(bad)) != "ok"
    assert int(layer.method_state.calls_since_redraw) == 1
    for _ in range(4):  # through two redraws, alike on every rank
        layer(x)


def _check_performer_layer(rank: int, world: int, causal: bool) -> None:
    torch.manual_seed(0)
    layer = skyformer.MultiHeadAttention(8, 2, "performer", num_features=4, causal=causal,
                                         process_group=dist.group.WORLD).double().eval()
    reference = skyformer.MultiHeadAttention(8, 2, "performer", num_features=4,
                                             causal=causal).double().eval()
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(2, 4 * world, 8, dtype=torch.float64)
    mask = torch.ones(2, 4 * world, dtype=torch.bool)
    mask[1, 2:5] = False
    mine = slice(4 * rank, 4 * rank + 4)
    before = torch.get_rng_state()
    out = layer(x[:, mine], mask[:, mine])
    assert torch.equal(torch.get_rng_state(), before), "the layer drew from the global generator"
    torch.testing.assert_close(out, reference(x, mask)[:, mine], **TOL)
    with torch.no_grad():
        for module in (layer, reference):
            module.method_state.projection[0, 0] = float("inf")
        out, want = layer(x[:, mine], mask[:, mine]), reference(x, mask)[:, mine]
    assert torch.equal(out.isnan().all(-1), mask[:, mine]), "rows marked: every real one"
    assert torch.equal(out.isnan(), want.isnan())


def check_autocast(rank: int, world: int) -> None:
    """Under torch.autocast the call casts its inputs and returns the autocast dtype,
    with the method's own precision inside, as one process does."""
    n = 8 * world
    q, k, v, _ = inputs(n)
    q, k, v = (t.float() for t in (q, k, v))
    mine = slice(8 * rank, 8 * rank + 8)
    for method, options in METHODS.items():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = skyformer.attention(q, k, v, method, generator=torch.Generator().manual_seed(2),
                                       **options)
            got = sequence_parallel_attention(*(t[:, :, mine] for t in (q, k, v)), method,
                                              generator=torch.Generator().manual_seed(2),
                                              **options)
        assert got.dtype == want.dtype == torch.bfloat16, (method, got.dtype)
        torch.testing.assert_close(got.float(), want[:, :, mine].float(), rtol=2e-2, atol=2e-2,
                                   msg=method)


def check_float32_norms_past_its_reach(rank: int, world: int) -> None:
    """float32 nystrom_softmax with norms past float32's reach: one process computes in
    float64 (needs_float64), each rank decided on its own rows and computed in float32,
    an answer far from the one-process one (0.9 against 0.3 of softmax's). Every rank
    now decides on the largest norm of all, as one process does; a shard whose own rows
    are within reach goes to float64 with the others. Causal calls too."""
    lengths = [13, 6][:world]
    n = sum(lengths)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for _ in range(3))
    q[:, :, :13], k[:, :, :13] = q[:, :, :13] * 5, k[:, :, :13] * 5  # rank 0's rows alone
    mine = _shards(lengths)[rank]
    for causal in (False, True):
        want = skyformer.attention(q, k, v, "nystrom_softmax", num_features=8, causal=causal,
                                   generator=torch.Generator().manual_seed(1))
        got = sequence_parallel_attention(*(t[:, :, mine] for t in (q, k, v)),
                                          "nystrom_softmax", num_features=8, causal=causal,
                                          generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(got, want[:, :, mine], rtol=1e-5, atol=1e-5,
                                   msg=f"causal={causal}")


def check_causal_nystrom_softmax_shifts(rank: int, world: int) -> None:
    """Causal nystrom_softmax joins the earlier ranks' states at the largest of their
    shifts, which start the later ranks' running maxima: on rank 2, rank 0's whole
    state (keys of large norm) and rank 1's head (a key of larger norm still) at
    different shifts; in head 1 a key on rank 0 whose exp(|k^|^2/2) float64 cannot hold;
    queries past float64's reach take the mean of every earlier value, rank 0's too.
    Outputs and gradients as one process's (float64)."""
    lengths = [70, 70, 20]
    n = sum(lengths)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64, generator=g) for _ in range(3))
    k[:, :, :70] *= 4  # |k^|^2/2 ~ 20 on rank 0
    k[:, :, 100] *= 6  # ~ 50, on rank 1
    k[:, 1, 5] *= 30  # ~ 1300
    q[:, :, [80, 150]] *= 40  # |q^|^2/2 ~ 2000: the rows' normalisers are lost
    mine = _shards(lengths)[rank]
    means = v.cumsum(2) / torch.arange(1, n + 1, dtype=v.dtype)[:, None]
    options = {"num_features": 8, "causal": True, "generator": skyformer.random_key(1)}
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = skyformer.attention(*full, "nystrom_softmax", **options)
    torch.testing.assert_close(want[:, :, [80, 150]], means[:, :, [80, 150]])  # the fallback
    want.sum().backward()
    part = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    got = sequence_parallel_attention(*part, "nystrom_softmax", **options)
    got.sum().backward()
    torch.testing.assert_close(got, want[:, :, mine].detach(), **TOL)
    for name, a, b in zip("qkv", part, full, strict=True):
        torch.testing.assert_close(a.grad, b.grad[:, :, mine], **TOL, msg=f"gradient of {name}")


def check_causal_blocks(rank: int, world: int) -> None:
    """A causal call of any sharded method that records no gradient runs each rank's
    rows by blocks (here of 128 rows), the sums the rank offers taken block by block
    too: the rows of one process's call, padding across a block and a shard boundary,
    a chunk across the boundary, left padding, keys of large norm in the last chunk of
    a block."""
    from skyformer.ops.linear import linear
    from skyformer.ops.nystrom_softmax import causal as causal_nystrom_softmax
    from skyformer.ops.performer import performer
    from skyformer.ops.shared import causal_prefix
    from skyformer.ops.skyformer import causal as causal_skyformer

    causal_prefix.STREAM_ROWS = 128
    lengths = [350, 250][:world]
    n = sum(lengths)
    q, k, v, _ = inputs(n, seed=3)
    k[:, :, 100] *= 4
    k[:, :, [250, 520]] *= 6  # larger than the first: the blocks offer states at other shifts
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[0, 330:380] = False
    mask[1, :40] = False
    mine = _shards(lengths)[rank]
    seen: list[int] = []
    local_options = [{"causal_local": True}, {"causal_local": False}]
    for method, module, name, variants in (
            ("skyformer", causal_skyformer, "_whole", local_options),
            ("nystrom_softmax", causal_nystrom_softmax, "_whole", local_options),
            ("linear", linear, "causal_feature_sums", [{}]),
            ("performer", performer, "_causal_rows", [{}])):
        original = getattr(module, name)
        setattr(module, name, lambda *a, original=original, **kw: (
            seen.append(a[0].shape[2]) or original(*a, **kw)))
        try:
            for padding, extra in [(mask, o) for o in variants] + [(None, variants[0])]:
                options = {"causal": True, "generator": skyformer.random_key(2), **extra}
                if method != "linear":
                    options["num_features"] = 8
                full = [t.clone().requires_grad_() for t in (q, k, v)]  # records: one pass
                want = skyformer.attention(*full, method, key_padding_mask=padding, **options)
                seen.clear()
                with torch.no_grad():
                    got = sequence_parallel_attention(
                        *(t[:, :, mine] for t in (q, k, v)), method,
                        key_padding_mask=None if padding is None else padding[:, mine],
                        **options)
                blocks = -(-lengths[rank] // 128)  # each at most 128 rows, a halo and chunks
                assert len(seen) >= blocks and max(seen) <= 128 + 63, (method, seen)
                torch.testing.assert_close(got, want[:, :, mine].detach(), rtol=1e-12,
                                           atol=1e-13, msg=f"{method} {extra} {padding is None}")
        finally:
            setattr(module, name, original)


def check_causal_collectives(rank: int, world: int) -> None:
    """A causal call's forward pass makes as many collectives whatever the rank and P,
    each rank's offers to the later ranks in one exchange (docs/distributed.md): the
    layout's two gathers, the offers and the non-finite check, and for the Nystrom
    forms the landmark rows and the halo; one more for nystrom_softmax in float32 or
    bfloat16 (its reach). The backward pass all-reduces the differentiable ones again."""
    lengths = [70, 60, 50][:world]
    q, k, v, _ = inputs(sum(lengths), seed=1)
    mine = _shards(lengths)[rank]
    expected = {"linear": 4, "performer": 4, "skyformer": 6, "nystrom_softmax": 6}
    for method, count in expected.items():
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            options = {"causal": True, "generator": skyformer.random_key(1)}
            if method != "linear":
                options["num_features"] = 8
            part = [t[:, :, mine].to(dtype).requires_grad_() for t in (q, k, v)]
            with count_communication() as forward:
                out = sequence_parallel_attention(*part, method, **options)
            out.sum().backward()
            extra = method == "nystrom_softmax" and dtype != torch.float64
            assert len(forward.calls) == count + extra, (method, dtype, forward.calls)


def check_causal_backward_under_anomaly_detection(rank: int, world: int) -> None:
    """The shifts a rank receives are constants for autograd: packed beside the sums in
    one exchange, they came back recording gradients, and the backward pass of their
    factors exp(shift - top) gave NaN where both are -inf (discarded later, but
    ``detect_anomaly`` stopped there, and the other rank waited in its all-reduce).
    Causal Performer and nystrom_softmax backpropagate under it, equal to one process."""
    lengths = [40, 30]
    q, k, v, weights = inputs(sum(lengths), seed=3)
    mask = torch.ones(2, sum(lengths), dtype=torch.bool)
    mask[0, :45] = False  # rank 0 holds no real key of element 0 (shift -inf)
    mine = _shards(lengths)[rank]
    for method in ("performer", "nystrom_softmax"):
        options = {"causal": True, "num_features": 8, "generator": skyformer.random_key(2)}
        for padding in (None, mask):
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            want = skyformer.attention(*full, method, key_padding_mask=padding, **options)
            (want * weights).sum().backward()
            part = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
            with torch.autograd.detect_anomaly(check_nan=True):
                got = sequence_parallel_attention(
                    *part, method, key_padding_mask=None if padding is None else padding[:, mine],
                    **options)
                (got * weights[:, :, mine]).sum().backward()
            for name, a, b in zip("qkv", part, full, strict=True):
                torch.testing.assert_close(a.grad, b.grad[:, :, mine], **TOL,
                                           msg=f"{method}: gradient of {name}")


def check_masks_without_a_real_token(rank: int, world: int) -> None:
    """A key_padding_mask False on every rank (torch's convention given for a batch
    without padding) gets the one-process warning on every rank; a rank whose shard is
    padding only, beside real tokens on another, gets none."""
    q, k, v, _ = inputs(10, seed=0)
    mine = _shards([6, 4])[rank]
    part = [t[:, :, mine] for t in (q, k, v)]
    options = {"num_features": 4, "generator": skyformer.random_key(0)}
    nothing_real = torch.zeros(2, 10, dtype=torch.bool)
    with pytest.warns(UserWarning, match=r"skyformer \(sequence parallel\): key_padding_mask is "
                      r"False on every rank, so every key is padding .* pass ~mask"):
        out = sequence_parallel_attention(*part, "skyformer",
                                          key_padding_mask=nothing_real[:, mine], **options)
    assert not out.any()
    later_only = nothing_real.clone()
    later_only[:, 8] = True  # rank 0's shard is padding only
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sequence_parallel_attention(*part, "skyformer", key_padding_mask=later_only[:, mine],
                                    **options)


def check_layer_copies(rank: int, world: int) -> None:
    """A deep copy of a sequence-parallel layer (an EMA model) shares the group and
    computes what the layer does; pickling the layer says to save its state_dict."""
    torch.manual_seed(0)
    layer = skyformer.MultiHeadAttention(8, 2, "skyformer", num_features=4,
                                         process_group=dist.group.WORLD).double()
    twin = copy.deepcopy(layer)
    assert twin.process_group is layer.process_group
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    torch.testing.assert_close(twin(x, generator=g), layer(x, generator=g.manual_seed(3)),
                               rtol=0, atol=0)
    said = _outcome(lambda: torch.save(layer, io.BytesIO()))
    assert "cannot be pickled; save model.state_dict() instead" in said, said
    torch.save(layer.state_dict(), io.BytesIO())
    alone = skyformer.MultiHeadAttention(8, 2, "skyformer")
    assert pickle.dumps(alone)  # without a group the layer pickles
    assert alone._group.__reduce__()[1] == (None,)  # and its handle is rebuilt empty


def check_layer_2d(rank: int, world: int) -> None:
    """MultiHeadAttention over a 2 x 2 grid: data parallel over rank // 2 (each data
    group has its own sequence), sequence parallel over rank % 2 (uneven shards)."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    data, seq = divmod(rank, 2)
    n, dim = 11, 8
    torch.manual_seed(0)
    layer = skyformer.MultiHeadAttention(dim, 2, "skyformer", num_features=6,
                                         process_group=groups[data]).double()
    reference = skyformer.MultiHeadAttention(dim, 2, "skyformer", num_features=6).double()
    reference.load_state_dict(layer.state_dict())
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(2, 1, n, dim, generator=g, dtype=torch.float64)  # one sequence per group
    weights = torch.randn(2, 1, n, dim, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 1, n, dtype=torch.bool)
    mask[1, 0, 4:7] = False  # padding across the shard boundary (shards 6 + 5)
    mine = slice(0, 6) if seq == 0 else slice(6, n)
    for d in range(2):
        out = reference(xs[d], mask[d], generator=torch.Generator().manual_seed(5))
        ((out * weights[d]).sum() / 2).backward()  # the mean over the data groups
    with count_communication() as traffic:
        with count_communication() as forward:  # nested: each block counts its own calls
            out = layer(xs[data][:, mine], mask[data][:, mine],
                        generator=torch.Generator().manual_seed(5))
        (out * weights[data][:, mine]).sum().backward()
    sum_gradients(layer, divide_by=2)
    expected = reference(xs[data], mask[data], generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(out, expected[:, mine], **TOL)
    for (name, a), b in zip(layer.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, **TOL, msg=name)
    assert 0 < traffic.bytes < 10_000, traffic.calls
    assert traffic.calls[:len(forward.calls)] == forward.calls, (forward.calls, traffic.calls)
    assert 0 < forward.bytes < traffic.bytes, (forward.calls, traffic.calls)


def check_gradients_present_on_some_ranks(rank: int, world: int) -> None:
    """A head used on rank 0 only, one used on rank 1 only (same shapes, so the flat
    sizes agreed and the two were added together), one used nowhere: the sum counts a
    missing gradient as zero, and a parameter without a gradient anywhere stays None.
    A rank whose attention rows are not in the loss backpropagates them with weight zero,
    and the gradients are one process's."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({name: torch.nn.Linear(2, 1, bias=False)
                                 for name in ("first", "second", "unused")})
    x = torch.ones(1, 2)
    (model["first"] if rank == 0 else model["second"])(x * (rank + 1)).sum().backward()
    sum_gradients(model)
    torch.testing.assert_close(model["first"].weight.grad, torch.tensor([[1.0, 1.0]]))
    torch.testing.assert_close(model["second"].weight.grad, torch.tensor([[2.0, 2.0]]))
    assert model["unused"].weight.grad is None
    # a rank whose rows are not in the loss joins the backward pass with 0 * out.sum()
    q, k, v, _ = inputs(4 * world)
    mine = slice(4 * rank, 4 * rank + 4)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    skyformer.attention(*full, "linear")[:, :, :4].sum().backward()  # rank 0's rows only
    part = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    out = sequence_parallel_attention(*part, "linear")
    (out.sum() if rank == 0 else 0 * out.sum()).backward()
    for name, a, b in zip("qkv", part, full, strict=True):
        torch.testing.assert_close(a.grad, b.grad[:, :, mine], **TOL, msg=name)


def check_sum_gradients_of_sparse_gradients(rank: int, world: int) -> None:
    """A sparse gradient (an nn.Embedding(sparse=True)) gets a sentence on every rank,
    also where only some ranks have one (the others would have waited in the sum)."""
    torch.manual_seed(0)  # alike on every rank
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(5, 2, sparse=True),
                                 "head": torch.nn.Linear(2, 1)})
    tokens = torch.tensor([rank])
    out = model["head"](model["embed"](tokens) if rank == 0 else torch.ones(1, 2))
    out.sum().backward()
    said = _outcome(lambda: sum_gradients(model))
    assert "sum_gradients: rank(s) [0] hold sparse gradients" in said, said
    assert ("embed.weight" in said) == (rank == 0), said
    model["embed"].weight.grad = None
    sum_gradients(model)  # the group still works
    torch.testing.assert_close(model["head"].bias.grad, torch.tensor([float(world)]))


def check_sum_gradients_of_models_that_differ(rank: int, world: int) -> None:
    """Trainable parameters whose shapes, dtypes or number differ between ranks (a head
    sized by each rank's own data) get a sentence on every rank: the all-reduces of other
    sizes aborted the process (gloo) or waited forever."""
    x = torch.ones(1, 2)
    models = {
        "shapes": torch.nn.Linear(2, 2 + (rank == world - 1)),
        "dtypes": torch.nn.Linear(2, 2).to(torch.float64 if rank == world - 1 else torch.float32),
        "number": torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(1 + (rank > 0)))),
        "frozen": torch.nn.Linear(2, 2).requires_grad_(rank == 0),
    }
    for name, model in models.items():
        out = model(x.to(next(model.parameters()).dtype)).sum()
        if out.requires_grad:  # not where every parameter is frozen
            out.backward()
        said = _outcome(lambda model=model: sum_gradients(model))
        assert "sum_gradients: the trainable parameters differ between ranks" in said, \
            (name, said)
        differ = list(range(1, world)) if name == "number" else [world - 1]
        assert f"rank(s) {differ} hold another number" in said, (name, said)
    model = torch.nn.Linear(2, 2)  # unseeded: other values on every rank
    model(x).sum().backward()
    said = _outcome(lambda: sum_gradients(model))
    assert ("sum_gradients: the trainable parameters' values differ between ranks: rank(s) "
            f"{list(range(1, world))} hold other values than rank 0") in said, said
    with torch.no_grad():  # made alike (as a broadcast of rank 0's would): summed
        for p in model.parameters():
            p.fill_(0.5)
    sum_gradients(model)
    torch.testing.assert_close(model.bias.grad, torch.full((2,), float(world)))
    with torch.no_grad():  # compared at a module's first sum only: alike parameters stay so
        model.bias.add_(rank)
    sum_gradients(model)  # the group still works
