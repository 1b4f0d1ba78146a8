"""``vmap`` rules for the library's custom ``autograd.Function``s.

Every such Function already works on a leading batch dim (heads, blocks), so mapping it
over one more dim is the same call with the mapped dim merged into that batch dim: move
each mapped dim to the front, flatten it with the batch dim (expanding arguments that
are not mapped), run once, and split the outputs back. This is exact, costs one call,
and needs no per-example Python loop (``torch.func`` docs, "Extending torch.func with
autograd.Function").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor


def vmap_into_batch(
    apply: Callable[..., Any], info: Any, in_dims: Sequence[int | None], args: Sequence[Any],
    *, tensors: Sequence[int], outputs: int,
) -> tuple[tuple[Tensor, ...], tuple[int | None, ...]]:
    """Run ``apply(*args)`` once for the whole vmapped batch.

    Args:
        apply: the Function's ``apply``.
        info: ``VmapInfo`` (``batch_size``).
        in_dims: the mapped dim of each argument (``None``: not mapped).
        args: the arguments.
        tensors: positions of the tensor arguments with a leading batch dim (each may be
            ``None``); the mapped dim is merged into that dim.
        outputs: number of outputs; an empty output (a placeholder) is returned unmapped.
    Returns:
        ``(outputs, out_dims)`` as a ``vmap`` staticmethod returns them.
    """
    size = info.batch_size
    new = list(args)
    for i in tensors:
        t = args[i]
        if t is None:
            continue
        t = t.expand(size, *t.shape) if in_dims[i] is None else t.movedim(in_dims[i], 0)
        new[i] = t.reshape(size * t.shape[1], *t.shape[2:])
    result = apply(*new)
    results = result if isinstance(result, tuple) else (result,)
    assert len(results) == outputs
    out, dims = [], []
    for r in results:
        if r.numel() == 0 and r.dim() == 1:  # a placeholder output
            out.append(r)
            dims.append(None)
        else:
            out.append(r.reshape(size, r.shape[0] // size, *r.shape[1:]))
            dims.append(0)
    return tuple(out), tuple(dims)
