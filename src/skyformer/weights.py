"""The attention matrix a method applies to the values: ``attention_weights(q, k, method)``
gives ``A: [B, H, Nq, Nk]`` with ``attention(q, k, v, method) == A @ v`` (up to rounding)
for the same draws, for the methods that declare ``Capabilities.weights``.

Those methods' outputs are ``A V`` with ``A`` a function of the queries, keys, masks and
draws alone, so one call on the values with the ``Nk x Nk`` identity appended gives the
output in its first ``Dv`` columns and ``A`` in the others (``call_with_weights``): the
weights are those of that output's draws (landmarks, features, hashes, samples), the
matrix the method's own code applied, not a formula written again beside it. For the
exact methods ``A`` is the target itself: the softmax weights for ``softmax``, the
Gaussian kernel matrix ``C`` of Skyformer's eq. (3) for ``kernelized`` (kernelized
attention is ``C V``, not normalised by its row sums); for Skyformer, the modified
Nystrom approximation of ``C`` that its output applies. Padded keys get weight 0;
padded queries (``query_padding_mask``) zero rows.

Cost: the method with ``Dv + Nk`` value columns (Skyformer's time becomes O(Nq Nk m))
and ``A``'s memory, as torch's weights. The exact methods' are formed from their
scores and masks instead, O(Nq Nk D) as torch's (``ops/softmax/weights.py``,
``ops/kernelized/weights.py``), but for a call with dropout, whose mask only the call
itself knows. On the PyTorch path: ``kernel`` runs as ``"torch"``, since the Triton
kernels compile the value width in. A method whose draws follow the values (KDEformer
samples keys by their norms) or whose output is not linear in them (the multipole
methods clamp their far field to the values' range) has no such matrix and is refused
in a sentence naming those that have one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .registry import BoundMethod, CapabilityError, check_capabilities
from .registry.guard import warn_if_no_real_key
from .registry.methods import refuse_misnamed_arguments


def attention_weights(
    q: Tensor,
    k: Tensor,
    method: str = "skyformer",
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | Tensor | None = None,
    **options: Any,
) -> Tensor:
    """The attention matrix of ``method`` (module doc): ``skyformer.attention`` with the
    same arguments and draws gives ``attention_weights(...) @ v``. Pass one key
    (``skyformer.random_key(seed)``) as ``generator`` to both calls for the weights of
    that output: a ``torch.Generator`` moves on at each call.

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``.
        method: a name from ``list_methods()`` whose capabilities include ``weights``.
        key_padding_mask, query_padding_mask, generator, **options: as
            ``skyformer.attention``'s.
    Returns:
        ``[B, H, Nq, Nk]`` in the dtype of the method's output.
    """
    where = "skyformer.attention_weights"
    if isinstance(method, Tensor):  # attention's call, v included
        raise TypeError(f"{where} takes (q, k, method): no v, the weights do not depend on "
                        f"it (out = attention_weights(q, k, method) @ v).")
    spec = check_capabilities(method, weights=True, causal=bool(options.get("causal")))
    refuse_misnamed_arguments(spec, options, where, attention_weights)
    _check_keys(q, k, where)
    bound = BoundMethod(spec, spec.make_config(**options))
    warn_if_no_real_key(method, key_padding_mask, k)
    _, weights = call_with_weights(bound, q, k, k[..., :0], key_padding_mask=key_padding_mask,
                                   query_padding_mask=query_padding_mask, generator=generator)
    return weights


def _check_keys(q: Any, k: Any, where: str) -> None:
    """A sentence for keys the weights cannot be of: not a tensor, none at all, or
    fewer heads than the queries (grouped-query attention's keys)."""
    if not isinstance(k, Tensor) or k.dim() != 4:
        shape = list(k.shape) if isinstance(k, Tensor) else ""
        raise TypeError(f"{where}: k must be a tensor [B, H, Nk, D], got "
                        f"{type(k).__name__}{shape}.")
    if k.shape[2] == 0:
        raise ValueError(f"{where}: k holds no key (Nk = 0): there is no attention matrix "
                         f"to give.")
    if isinstance(q, Tensor) and q.dim() == 4 and 0 < k.shape[1] < q.shape[1] \
            and q.shape[1] % k.shape[1] == 0:
        groups = q.shape[1] // k.shape[1]
        raise ValueError(f"{where}: q has {q.shape[1]} heads and k {k.shape[1]}; for "
                         f"grouped-query attention pass each query head its key head, "
                         f"k.repeat_interleave({groups}, dim=1).")


def check_weights(method: str, prefix: str = "") -> None:
    """A ``CapabilityError`` where ``method`` has no attention matrix, its sentence after
    ``prefix`` (the caller's name)."""
    try:
        check_capabilities(method, weights=True)
    except CapabilityError as err:
        raise CapabilityError(f"{prefix}{err}") from None


def call_maybe_with_weights(bound: BoundMethod, q: Tensor, k: Tensor, v: Tensor,
                            weights: bool, **call: Any) -> tuple[Tensor, Tensor | None]:
    """``(bound(q, k, v, **call), None)``, or with ``weights`` ``call_with_weights``:
    the output and the weights of that one call."""
    if weights:
        return call_with_weights(bound, q, k, v, **call)
    return bound(q, k, v, **call), None


def call_with_weights(bound: BoundMethod, q: Tensor, k: Tensor, v: Tensor, **call: Any
                      ) -> tuple[Tensor, Tensor]:
    """``(bound(q, k, v, **call), A)`` from one call (module doc): the output
    ``[..., Nq, Dv]`` and the weights ``[..., Nq, Nk]`` of its draws. A method without
    ``Capabilities.weights`` is refused (``CapabilityError``)."""
    check_weights(bound.method.name)
    if "kernel" in bound.options():  # "auto" or "triton": the value width is compiled in
        bound = bound.replace(kernel="torch")
    formed = _formed_weights(bound.method.base_name)
    if formed is not None and not call.get("dropout_p"):
        # the exact matrix at O(Nq Nk D), the output from the method's own call
        # (attention_weights passes no value column: one of zeros, for the output's dtype)
        values = v if v.shape[-1] else v.new_zeros(*v.shape[:-1], 1)
        out = bound(q, k, values, **call)[..., :v.shape[-1]]
        masks = {name: call[name] for name in ("key_padding_mask", "query_padding_mask",
                                                "attn_mask") if name in call}
        return out, formed(q, k, bound.config, **masks).to(out.dtype)
    n, dv = v.shape[-2], v.shape[-1]
    identity = torch.eye(n, dtype=v.dtype, device=v.device).expand(*v.shape[:-1], n)
    both = bound(q, k, torch.cat([v, identity], -1), **call)
    return both[..., :dv], both[..., dv:]


def _formed_weights(name: str) -> Any:
    """The function forming an exact method's weights from its scores and masks,
    ``(q, k, config, *, key_padding_mask, query_padding_mask, attn_mask) -> [B, H, Nq,
    Nk]``, for ``softmax`` and ``kernelized``; ``None`` for the others (their weights
    come from the identity appended to the values)."""
    if name == "softmax":
        from .ops.softmax.weights import softmax_weights

        return softmax_weights
    if name == "kernelized":
        from .ops.kernelized.weights import kernelized_weights

        return kernelized_weights
    return None
