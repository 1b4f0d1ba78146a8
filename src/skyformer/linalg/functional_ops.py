"""When a computation must be written in plain differentiable operators.

The library's fast paths are custom ``autograd.Function``s (chunked products whose
backward rebuilds the block, the Razavi iteration, the multipole near field), Triton
kernels and SDPA's fused kernels. Two callers cannot use them:

- ``torch.export`` traces through a Function's forward, whose ``out=`` writes into
  preallocated buffers cannot be replayed in the exported graph with grad enabled;
- forward-mode AD (``torch.func.jvp``, ``jacfwd``, ``hessian``,
  ``torch.autograd.forward_ad``): the Functions have a hand-written backward only, and
  SDPA's fused kernels (flash, memory-efficient, the CPU flash kernel) have no
  forward-mode derivative.

There the same computation runs as functional operators that autograd differentiates in
both modes (the block formed whole, as a naive reference would), giving the same values
up to rounding. Reverse-mode training, ``torch.compile`` and ``vmap`` keep the fast paths.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.autograd.forward_ad as forward_ad
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..amp import outside_autocast
from .vmap import fold_into_batch, is_placeholder, split_batch

F = TypeVar("F", bound=Callable[..., Any])


def exporting() -> bool:
    """Whether ``torch.export`` is tracing. Reads the flag export sets rather than
    calling ``torch.compiler.is_exporting()``, which torch.compile before PyTorch 2.12
    evaluates as True in every compiled function (every fast path would then give way
    under ``torch.compile``, and ``kernel="triton"`` would refuse)."""
    return bool(getattr(torch.compiler, "_is_exporting_flag", False))


def known_while_exporting(condition: Any) -> bool:
    """Whether ``torch.export`` can prove ``condition`` (a comparison of possibly
    symbolic sizes) true without adding a guard: ``statically_known_true``, imported
    here since its module imports sympy, which ``import skyformer`` would otherwise
    pay for (half a second) though only an export asks."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(condition)


def forward_mode_active() -> bool:
    """Whether forward-mode AD is running: a dual level is open (``torch.func.jvp``,
    ``jacfwd`` and ``hessian`` open one, as ``forward_ad.dual_level`` does). Asked of
    the level rather than of the tensors: inside ``hessian`` (``jacfwd`` over
    ``jacrev``) the tensors a method sees are wrapped by the inner transform and show
    no tangent, yet the outer one differentiates the call forward. (A level opened with
    no tangent in sight also takes the plain path: same values, more memory.) Read
    under ``torch.compile`` too: dynamo guards on it, so ``jvp`` inside a compiled
    function, or a compiled function called under ``jvp``, gets the plain graph. False
    while exporting."""
    if exporting():
        return False
    return forward_ad._current_level >= 0


def functional_ops_only() -> bool:
    """Whether the fast paths must give way to plain operators (module docstring):
    under ``torch.export`` or forward-mode AD."""
    return exporting() or forward_mode_active()


def jit_tracing() -> bool:
    """Whether ``torch.jit.trace`` records this call: its tracer fails inside the
    PyTorch Functions that write into buffers they allocate (the Gaussian products),
    which then take plain operators; the Triton operators it records as they are."""
    return torch._C._get_tracing_state() is not None


def no_derivatives(fn: F) -> F:
    """``torch.no_grad()`` for both modes: ``fn`` runs without autograd on detached
    tensor arguments. ``no_grad`` alone stops reverse mode only: a tangent carried by
    an argument still reaches the result (e.g. sampling probabilities that reverse mode
    treats as constants would get a forward-mode derivative)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        args = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
        kwargs = {k: v.detach() if isinstance(v, Tensor) else v for k, v in kwargs.items()}
        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def first_order_backward(backward: F) -> F:
    """``once_differentiable`` for the ``backward`` of a custom ``autograd.Function``
    whose gradient is not itself differentiable, refusing in a sentence what it lets
    through: a differentiable backward of plain autograd (``create_graph=True``:
    ``torch.autograd.functional.hessian`` / ``hvp``, gradient penalties). There
    ``once_differentiable`` returns a gradient that silently drops its dependence on
    the saved inputs.

    Under ``torch.func`` transforms (tensors wrapped by functorch) the backward runs as
    a Function of its own, ``_TransformedBackward``: ``jacrev`` and ``vmap`` of ``grad``
    (per-sample gradients) call it with batched tensors, on which its ``out=`` and
    in-place products have no batching rule; the Function's ``vmap`` rule folds the
    mapped dim into the batch dim instead, as the forward's rule does. The saved
    tensors' batch dims are 0 unless ``setup_context`` sets ``ctx.saved_batch_dims``.
    Differentiating that backward again (``jacrev`` of ``jacrev``) is refused.
    Gradients batched by the legacy vmap (``autograd.grad(..., is_grads_batched=True)``)
    are folded the same way (``_legacy_batched_backward``). The
    backward reads the saved tensors once, through the wrapper (activation
    checkpointing allows one unpack), and runs with autocast off
    (``amp.outside_autocast``: as eager code runs it, where ``torch.compile`` would
    trace it under the forward's autocast)."""

    once = once_differentiable(backward)

    @functools.wraps(backward)
    @outside_autocast
    def wrapper(ctx: Any, *grads: Any) -> Any:
        saved = ctx.saved_tensors
        tensors = [t for t in (*grads, *saved) if isinstance(t, Tensor)]
        if not torch.compiler.is_compiling() and any(  # dynamo cannot trace the query
                torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors):
            return _TransformedBackward.run(backward, ctx, saved, grads)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            raise RuntimeError(_NOT_DIFFERENTIABLE)
        mapped = [False] if torch.compiler.is_compiling() else _legacy_batched(grads)
        if any(mapped):
            results = _legacy_batched_backward(once, ctx, saved, grads, mapped)
            if results is not None:
                return results
        # the saved tensors as read above: a second read of ctx.saved_tensors unpacks
        # them again, which non-reentrant activation checkpointing refuses
        # (torch.utils.checkpoint recomputes a tensor once per unpack)
        return once(ctx if torch.compiler.is_compiling() else _SavedContext(ctx, saved),
                    *grads)

    return wrapper  # type: ignore[return-value]


_NOT_DIFFERENTIABLE = (
    "skyformer: this attention's fused backward pass is not differentiable "
    "(create_graph=True, as torch.autograd.functional.hessian / hvp use, or "
    "torch.func.jacrev of a reverse-mode derivative). For second derivatives use "
    "forward-over-reverse, which takes plain differentiable operators: torch.func.jvp of "
    "torch.func.grad (Hessian-vector products, in one process or across processes with "
    "sequence_parallel_attention), or torch.func.hessian (in one process).")


_NESTED_LEGACY_BATCH = (
    "skyformer: this attention's fused backward pass takes gradients batched once "
    "(torch.autograd.grad(..., is_grads_batched=True), or "
    "torch.autograd.functional.jacobian(..., vectorize=True)), not batched again inside "
    "another legacy vmap. Use torch.func.vmap with torch.func.vjp or torch.func.jacrev, "
    "which any nesting takes.")


def _legacy_batched(grads: tuple) -> list[bool]:
    """Which gradients the legacy vmap batches (``autograd.grad(...,
    is_grads_batched=True)``)."""
    return [isinstance(g, Tensor) and torch._C._functorch.is_legacy_batchedtensor(g)
            for g in grads]


# the legacy vmap's levels (kVmapNumLevels in ATen's LegacyBatchedTensorImpl.h)
_LEGACY_LEVELS = range(1, 64)


def _unwrap_legacy(g: Tensor) -> tuple[Tensor, int] | None:
    """A legacy-batched gradient as a plain tensor, the batch first, and its level; None
    where it cannot be unwrapped. The level is found on the tensor: removing a level it
    lacks leaves it batched. The vmap open on this thread is tried first; on CUDA,
    autograd runs backward passes on threads of its own, which that level does not
    reach, so the others are tried after it. Refuses in a sentence a gradient batched
    at two levels (the open one and another)."""
    open_level = torch._C._vmapmode_increment_nesting() - 1
    torch._C._vmapmode_decrement_nesting()
    remove_batch_dim = torch._remove_batch_dim  # type: ignore[attr-defined]
    for level in (open_level, *_LEGACY_LEVELS):
        if level not in _LEGACY_LEVELS:
            continue
        physical = remove_batch_dim(g, level, 1, 0)
        if not torch._C._functorch.is_legacy_batchedtensor(physical):
            return physical, level
        if level == open_level and physical.shape[0] != 1:  # batched there and elsewhere
            raise RuntimeError(_NESTED_LEGACY_BATCH)
    return None


def _legacy_batched_backward(once: Callable[..., Any], ctx: Any, saved: tuple,
                             grads: tuple, mapped: list[bool]) -> tuple | None:
    """The backward for a batch of gradients of the legacy vmap (``is_grads_batched``),
    whose batching has no rule for the backward's ``out=`` and in-place products: the
    batch unwrapped and folded into the batch dim (the saved tensors repeated along it,
    at ``ctx.saved_batch_dims``), one backward call, the results wrapped again at the
    gradients' level, as ``_TransformedBackward.vmap`` does for ``torch.func``.
    ``mapped``: which gradients are batched. None where a gradient does not unwrap
    cleanly (batched at two levels, on a thread that shows neither): the backward then
    meets the batch as it is, which operators' batching fallbacks take (the Triton
    kernels' custom operators) and the PyTorch path's products do not."""
    unwrapped = [_unwrap_legacy(g) if batched else (g, None)
                 for g, batched in zip(grads, mapped, strict=True)]
    if any(u is None for u in unwrapped):
        return None
    levels = {level for _, level in unwrapped if level is not None}
    if len(levels) != 1:
        return None
    (level,) = levels
    grads = tuple(g for g, _ in unwrapped)
    size = next(g.shape[0] for g, batched in zip(grads, mapped, strict=True) if batched)
    at = getattr(ctx, "saved_batch_dims", None) or (0,) * len(saved)
    saved = tuple(t if t is None or is_placeholder(t)
                  else fold_into_batch(t, None, size, at[i]) for i, t in enumerate(saved))
    grads = tuple(fold_into_batch(g, 0 if batched else None, size) if isinstance(g, Tensor)
                  else g for g, batched in zip(grads, mapped, strict=True))
    results = once(_SavedContext(ctx, saved), *grads)
    add_batch_dim = torch._add_batch_dim  # type: ignore[attr-defined]
    return tuple(None if r is None else add_batch_dim(split_batch(r, size), 0, level)
                 for r in results)


class _SavedContext:
    """A Function's backward context with other saved tensors (the folded ones)."""

    def __init__(self, ctx: Any, saved: tuple) -> None:
        self._ctx = ctx
        self.saved_tensors = saved

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


class _Positions:
    """Positions an inner call reports to its caller (an object, not a list: transforms
    rebuild the containers among a Function's arguments)."""

    def __init__(self) -> None:
        self.positions: list[int] = []


class _TransformedBackward(torch.autograd.Function):
    """A hand-written backward pass run as a Function under ``torch.func`` transforms
    (``first_order_backward``). Arguments: the backward, its context, a ``_Positions`` that
    receives the positions of the gradients it leaves out (``None``), the number of
    saved tensors, then the saved tensors and the incoming gradients; outputs: the
    gradients it computes."""

    @staticmethod
    def run(backward: Callable[..., Any], ctx: Any, saved: tuple, grads: tuple) -> tuple:
        absent = _Positions()
        out = iter(_TransformedBackward.apply(backward, ctx, absent, len(saved), *saved,
                                              *grads))
        return tuple(None if i in absent.positions else next(out)
                     for i in range(len(ctx.needs_input_grad)))

    @staticmethod
    def forward(backward: Callable[..., Any], ctx: Any, absent: _Positions,  # type: ignore[override]
                n_saved: int, *tensors: Tensor | None) -> tuple[Tensor, ...]:
        results = backward(_SavedContext(ctx, tensors[:n_saved]), *tensors[n_saved:])
        absent.positions = [i for i, r in enumerate(results) if r is None]
        return tuple(r for r in results if r is not None)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        pass

    @staticmethod
    def vmap(info: Any, in_dims: tuple, backward: Callable[..., Any], ctx: Any,
             absent: _Positions, n_saved: int, *tensors: Tensor | None) -> tuple[tuple, tuple]:
        size = info.batch_size
        at = getattr(ctx, "saved_batch_dims", None) or (0,) * n_saved
        folded = [t if t is None or (dim is None and is_placeholder(t))
                  else fold_into_batch(t, dim, size, at[i] if i < n_saved else 0)
                  for i, (t, dim) in enumerate(zip(tensors, in_dims[-len(tensors):],
                                                   strict=True))]
        results = _TransformedBackward.apply(backward, ctx, absent, n_saved, *folded)
        return tuple(split_batch(r, size) for r in results), (0,) * len(results)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(_NOT_DIFFERENTIABLE)
