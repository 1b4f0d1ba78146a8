"""The keys' mean, taken out of queries and keys before a Gaussian kernel is formed.

The Gaussian kernel ``exp(-|q_i - k_j|^2 / (2 sqrt(p)))`` depends on ``q_i - k_j`` alone,
so moving every query and key by one vector changes no product (nor k-means centres,
which move with the points). Its exponent is formed as ``q.k - |q|^2 / 2 - |k|^2 / 2``,
which in float32 loses about ``eps |q| |k|``: with norms far above the distances (a
common offset of the rows, e.g. a projection's bias) the kernel comes out wrong or
above 1. Taking the keys' mean out first leaves norms of the order of the distances.

Exact kernelized attention's SDPA augmentation copies q and k anyway: the mean is
taken out in those copies and costs no memory. Its form at head dim D (``sdpa_fold.py``,
the CPU's default) keeps the two moved copies for its backward pass, and still holds less
than the augmentation (4.05 against 5.5 buffers of q's size at N = 8192,
``ops/kernelized/README.md``). Its flash kernels (CUDA) take moved float32 copies,
which they keep for the backward pass in place of q and k (unmoved, a common offset of
1e4 gave outputs of 1e19; moved, they give float64's on the rounded inputs:
``tests/ops/test_gaussian_offset.py``, under Triton's interpreter; half types are not
moved, below).
Skyformer's products read q and k as
they are (their backward keeps them), so a moved copy would be held from the forward to
the backward pass; the multipole methods' angular LSH buckets depend on where the
origin is. Those are not moved (docs/reliability.md, "Large norms in float32").

Half-precision inputs are left as they are: their own rounding (``2^-9 |q|`` in
bfloat16) is far above what the float32 sums lose (bfloat16 inputs that a float
``attn_mask`` sends to float32 are moved, as float32 ones).
"""

from __future__ import annotations

from torch import Tensor

from .inputs import HALF_DTYPES


def keys_mean(k: Tensor, key_valid: Tensor | None) -> Tensor | None:
    """The mean of the real keys of each batch element and head, ``[B, H, 1, D]``, to
    subtract from q and k; ``None`` for half-precision keys.

    Detached: the kernel does not depend on it, so its gradient is zero and the
    gradients with respect to q and k are those of the call without it. A component
    whose mean is not finite (a non-finite key, whose rows the guard marks anyway) is
    0: any shift, whole or in part, leaves the kernel as it is.
    ``k: [B, H, Nk, D]``, ``key_valid: [B, Nk]`` bool or None.
    """
    if k.dtype in HALF_DTYPES:
        return None
    keys = k.detach()
    if key_valid is None:
        mu = keys.mean(dim=2, keepdim=True)
    else:  # weights 1 / count: a convex combination, which cannot overflow
        weights = key_valid.to(keys.dtype)
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1)  # [B, Nk]
        mu = weights[:, None, None, :] @ keys
    return mu.nan_to_num(0.0, 0.0, 0.0)
