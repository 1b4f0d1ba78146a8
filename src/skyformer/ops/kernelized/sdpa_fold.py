"""Exact kernelized attention through SDPA's fused kernels at the inputs' own head dim:
the key norms folded into the values, the normaliser taken from the logsumexp
(``fold_key_norms=True``).

With the kernel scale s, a_i = s |q_i|^2 / 2 + c and b_j = s |k_j|^2 / 2 - c for any
constant c,

    C_ij = exp(s q_i.k_j - a_i - b_j),
    (C V)_i = exp(lse_i - a_i) O_i,   O = softmax(s Q K^T) V',   v'_j = exp(-b_j) v_j,

where lse_i = log sum_j exp(s q_i.k_j) is the logsumexp that SDPA's fused kernels
compute anyway. So one fused call on q, k and v' of head dim D gives C V, where the
augmentation (``sdpa_augmentation.py``) runs at width D + 8 (72 at D = 64, which
FlashAttention-2 rounds up to its 96 kernel and cuDNN to 128).

The backward pass needs no term for the normaliser. With g = dL/d(C V) and
r_i = exp(lse_i - a_i), the gradient of the scores is
dS_ij = C_ij e^{a_i} (g_i . v'_j) e^{-lse_i} ... = P_ij (dO_i . v'_j) with dO = r g:
softmax's backward pass, P (dP - D), with D_i = 0. The fused backward kernels compute
D_i = dO_i . O_i from the output they are given, so they are given zeros for it
(the CPU flash kernel, FlashAttention-2 and the memory-efficient kernel read the output
for D alone). And dL/da_i = -g_i . (C V)_i.

Range: v' and O are stored in the inputs' dtype, so exp(-b_j) must stay inside it.
c is set per batch element and head from the valid keys' s |k|^2 / 2 (detached: C does
not depend on it): the middle of their range, but at most ``FOLD_HEADROOM`` above the
smallest, so that v' <= e^40 |v| and the kernels' float32 sums cannot overflow. The
result is exact (to the dtype's rounding) while the keys' s |k|^2 / 2 span less than
about 120 within a head (for float32 inputs after the keys' mean is taken out,
``shared/centring.py``); past that the values of the largest-norm keys underflow to
zero (and the call is no longer exact). At D = 64 that is a spread of |k|^2 of about
1900, e.g. a key of norm 44 beside one at 0; the augmentation has no such limit.

Where it runs: CPU (the CPU flash kernel, any float dtype), CUDA bfloat16 (flash),
CUDA float32 (memory-efficient); float16 is computed in float32 as in the augmentation.
Head dims are padded with zero columns to a common multiple of 8 where they differ or
CUDA needs it. Padded keys have k = 0 and v' = 0 (they add to lse, which cancels);
``causal`` is SDPA's top-left mask (Nq == Nk). The private ``aten`` operators called
here have the same signatures in torch 2.11 and 2.13.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ...linalg import half_sq_norm
from ...linalg.eager_calls import apply
from ...linalg.functional_ops import first_order_backward
from ...linalg.vmap import fold_into_batch, split_batch
from ..shared.sdpa import WIDTH_MULTIPLE
from .sdpa_augmentation import fused_dtype

FOLD_HEADROOM = 40.0  # the largest exponent of exp(-b_j): v' <= e^40 |v|

_aten = torch.ops.aten


def _fused_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(O, lse ``[B, H, >= Nq]`` float32, and the dropout seed and offset that the
    backward operator takes: empty placeholders for the CPU kernel)."""
    if q.device.type == "cpu":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
        return out, lse, q.new_empty(0), q.new_empty(0)
    if uses_flash(q):
        out, lse, _, _, _, _, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, seed, offset
    out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse, seed, offset


def uses_flash(q: Tensor) -> bool:
    """Whether a CUDA call takes FlashAttention-2 (half types, head dim <= 256), else the
    memory-efficient kernel."""
    return q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256


def _fused_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    seed: Tensor, offset: Tensor, scale: float, causal: bool
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax attention's backward pass with D = rowsum(grad * out) zero: ``out`` is
    given as zeros (module docstring)."""
    zeros = torch.zeros_like(out)
    if q.device.type == "cpu":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, zeros, lse, 0.0, causal, scale=scale)
    if uses_flash(q):
        return _aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, zeros, lse, None, None, q.shape[2], k.shape[2], 0.0, causal,
            seed, offset, scale=scale)
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, None, zeros, lse, seed, offset, 0.0, [True, True, True, False],
        causal, scale=scale)
    return dq, dk, dv


class FoldedSDPA(torch.autograd.Function):
    """exp(lse_i - a_i) O_i with (O, lse) of one fused softmax-attention call at scale s:
    q ``[B, H, Nq, W]``, k ``[B, H, Nk, W]``, v ``[B, H, Nk, W]`` in one dtype, a
    ``[B, H, Nq]`` float32 (float64 for float64 inputs). Returns that ``[B, H, Nq, W]``
    in a's dtype, then O, lse and the dropout seed and offset (not differentiable; kept
    for the backward operator, as SDPA's own autograd keeps them)."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, a: Tensor,  # type: ignore[override]
                scale: float, causal: bool) -> tuple[Tensor, ...]:
        out, lse, seed, offset = _fused_forward(q, k, v, scale, causal)
        y = out.to(a.dtype) * torch.exp(lse[..., : q.shape[2]] - a)[..., None]
        return y, out, lse, seed, offset

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        q, k, v, a, scale, causal = inputs
        _, out, lse, seed, offset = output
        ctx.mark_non_differentiable(out, lse, seed, offset)
        ctx.save_for_backward(q, k, v, a, out, lse)
        ctx.rng = (seed, offset)  # not batched: outside the saved tensors' batch dims
        ctx.options = (scale, causal)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, q, k, v, a, scale, causal):  # type: ignore[override]
        """The mapped dim joins the batch dim (the seed and offset are not mapped)."""
        size = info.batch_size
        tensors = [fold_into_batch(t, dim, size)
                   for t, dim in zip((q, k, v, a), in_dims, strict=False)]
        y, out, lse, seed, offset = FoldedSDPA.apply(*tensors, scale, causal)
        return ((split_batch(y, size), split_batch(out, size), split_batch(lse, size),
                 seed, offset), (0, 0, 0, None, None))

    @staticmethod
    @first_order_backward
    def backward(ctx: Any, grad: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, a, out, lse = ctx.saved_tensors
        scale, causal = ctx.options
        r = torch.exp(lse[..., : q.shape[2]] - a)[..., None]  # [B, H, Nq, 1]
        grad = grad.to(a.dtype)
        grad_a = -(r * (grad * out.to(a.dtype))).sum(-1)  # -g . (C V)
        dq, dk, dv = _fused_backward((grad * r).to(q.dtype).contiguous(), q, k, v, out,
                                     lse, *ctx.rng, scale, causal)
        return dq, dk, dv, grad_a, None, None


def fold_exponent_shift(norms: Tensor, valid: Tensor | None) -> Tensor:
    """c ``[B, H, 1]`` of the module docstring from the keys' s |k|^2 / 2 ``[B, H, Nk]``
    (``valid`` ``[B, 1, Nk]`` bool or None): the middle of the valid keys' range, at most
    ``FOLD_HEADROOM`` above its bottom; 0 where a head has no valid or finite key."""
    norms = norms.detach()
    low = norms if valid is None else torch.where(valid, norms, torch.inf)
    high = norms if valid is None else torch.where(valid, norms, -torch.inf)
    low, high = low.amin(-1, keepdim=True), high.amax(-1, keepdim=True)
    shift = low + ((high - low) / 2).clamp(max=FOLD_HEADROOM)
    return shift.nan_to_num(0.0, 0.0, 0.0)


def kernelized_by_folding(
    q: Tensor, k: Tensor, v: Tensor, scale: float, *, key_valid: Tensor | None = None,
    causal: bool = False, shift: Tensor | None = None,
) -> Tensor:
    """C V through one fused softmax-attention call at head dim D (module docstring).

    q ``[B, H, Nq, D]``, k ``[B, H, Nk, D]``, v ``[B, H, Nk, Dv]``; ``key_valid``
    ``[B, Nk]`` bool or None; ``shift`` ``[B, H, 1, D]`` (or None), detached, taken out of
    q and k (``shared/centring.keys_mean``). Returns ``[B, H, Nq, Dv]`` in float32
    (float64 for float64 inputs), rows of padded queries not zeroed.
    """
    dtype = fused_dtype(q.dtype)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if shift is not None:
        q, k = q - shift, k - shift
    valid = None if key_valid is None else key_valid[:, None, :]  # [B, 1, Nk]
    if valid is not None:
        k = torch.where(valid[..., None], k, 0.0)
    key_norms = scale * half_sq_norm(k.to(work))  # [B, H, Nk]
    c = fold_exponent_shift(key_norms, valid)  # [B, H, 1]
    factor = torch.exp(c - key_norms)
    if valid is not None:
        factor = torch.where(valid, factor, 0.0)
    v_folded = (factor[..., None] * v.to(work)).to(dtype)
    a = scale * half_sq_norm(q.to(work)) + c  # [B, H, Nq]
    d, dv = q.shape[-1], v.shape[-1]
    width = d if d == dv and (q.device.type == "cpu" or not d % WIDTH_MULTIPLE) \
        else -(-max(d, dv) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
    if width != d or width != dv:
        q, k, v_folded = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v_folded))
    out = apply(FoldedSDPA, q, k, v_folded, a, scale, causal)[0]
    return out[..., :dv]
