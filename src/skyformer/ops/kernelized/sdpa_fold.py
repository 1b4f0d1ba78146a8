"""Exact kernelized attention through SDPA's fused kernels at the inputs' own head dim:
the key norms as a bias of the scores or folded into the values, the normaliser taken
from the logsumexp (``fold_key_norms``: by default on the CPU, with ``True`` on CUDA).

With the kernel scale s and a_i = s |q_i|^2 / 2, b_j = s |k_j|^2 / 2,

    C_ij = exp(s q_i.k_j - a_i - b_j),
    (C V)_i = exp(lse_i - a_i) O_i,   O = softmax(s Q K^T - 1 b^T) V,

where lse_i = log sum_j exp(s q_i.k_j - b_j) is the logsumexp that SDPA's fused kernels
compute anyway (exp(lse_i - a_i) = sum_j C_ij <= Nk: no overflow). So one fused call at
head dim D gives C V, where the augmentation (``sdpa_augmentation.py``) runs at width
D + 8 (72 at D = 64, which FlashAttention-2 rounds up to its 96 kernel and cuDNN to 128).
The key bias -b is an additive ``attn_mask`` row, in float32 (float64 for float64
inputs), which the CPU flash kernel (any dtype) and CUDA's memory-efficient kernel
(float32) take. For CUDA half types FlashAttention-2 takes no bias, and the
memory-efficient kernel (above head dim 256) only one of q's dtype, which would round
b; there the values carry it instead: v'_j = exp(c - b_j) v_j and a_i + c in place of
a_i, for a constant c.

The backward pass needs no term for the normaliser. With g = dL/d(C V) and
r_i = exp(lse_i - a_i): dS_ij = P_ij (dO_i . v_j) with dO = r g, i.e. softmax's
backward pass P (dP - D) with D_i = 0. The fused backward kernels compute
D_i = dO_i . O_i from the output they are given, so they are given zeros for it (the
CPU flash kernel, FlashAttention-2 and the memory-efficient kernel read the output for
D alone). Then dL/da_i = -g_i . (C V)_i, and the bias's gradient is the column sums of
dS: sum_i P_ij dO_i . v_j = dV_j . v_j.

Range, where the values carry the bias (CUDA half types only; ``takes_key_bias``): the
softmax weights P_ij = exp(s q_i.k_j - max_l s q_i.k_l) no longer carry -b_j, so beside
a key of larger norm and score a key whose C_ij is the larger can get a P_ij below
e^-87, which the fused kernels flush to zero: its share of C is at most e^(-87 + span),
span the range of the keys' b. In the backward pass dP = (r g).v' reaches
Nk e^span |g| |v|. Both stay harmless while span + ln(Nk) is well under 87: past
``FOLD_SPAN_LIMIT`` (60) a head's output is made NaN rather than silently inexact, and
the backward scales dO by its largest entry per head (it is linear in dO once D = 0),
so that |g| cannot push dP past float32's range. c (per batch element and head,
detached: C does not depend on it) is the middle of the valid keys' b, at most
``FOLD_HEADROOM`` above the smallest, so that v' <= e^40 |v|. At D = 64 a span of 60 in
b is one of 960 in |k|^2, e.g. a key of norm 31 beside one at 0. The bias route and
the augmentation have no such limit.

Head dims are padded with zero columns to a common multiple of 8 where they differ or
CUDA needs it. Padded keys have k = 0 and v = 0 and a bias of -1e6 (or v' = 0); causal
is SDPA's top-left mask (Nq == Nk). The private ``aten`` operators called here have the
same signatures in torch 2.11 and 2.13.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ...linalg import half_sq_norm
from ...linalg.eager_calls import apply
from ...linalg.functional_ops import first_order_backward
from ...linalg.vmap import fold_into_batch, is_placeholder, split_batch
from ..shared.masked import attention_bias
from ..shared.sdpa import WIDTH_MULTIPLE, fused_width
from .sdpa_augmentation import MASKED_LOGIT, fused_dtype

FOLD_HEADROOM = 40.0  # the largest exponent of exp(c - b_j): v' <= e^40 |v|
FOLD_SPAN_LIMIT = 60.0  # heads whose keys' b spans more come out NaN (values route)
_BIAS_ALIGNMENT = 16  # CUDA's memory-efficient kernel reads the bias in aligned rows

_aten = torch.ops.aten


def takes_key_bias(q: Tensor) -> bool:
    """Whether the call takes the key bias: the CPU flash kernel (a float32 or float64
    bias for any dtype) and CUDA's memory-efficient kernel in float32; not CUDA half
    types (FlashAttention-2 takes no bias, the memory-efficient kernel only one of q's
    dtype, which would round b)."""
    return q.device.type == "cpu" or q.dtype not in (torch.bfloat16, torch.float16)


def uses_flash(q: Tensor) -> bool:
    """Whether a CUDA call without a bias takes FlashAttention-2 (half types, padded head
    dim <= 256), else the memory-efficient kernel."""
    return q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256


def _cuda_bias(bias: Tensor, nq: int) -> Tensor:
    """``[B, H, 1, Nk]`` as the memory-efficient kernel reads it: ``[B, H, Nq, Nk]``, each
    row the same one, in storage whose rows are padded to ``_BIAS_ALIGNMENT`` (as SDPA
    itself pads a mask)."""
    nk = bias.shape[-1]
    pad = -nk % _BIAS_ALIGNMENT
    if pad:
        bias = F.pad(bias, (0, pad))[..., :nk]
    return bias.expand(*bias.shape[:2], nq, nk)


def _fused_forward(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float,
                   causal: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(O, lse ``[B, H, >= Nq]`` float32, and the dropout seed and offset that the
    backward operator takes: empty placeholders for the CPU kernel)."""
    if q.device.type == "cpu":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        return out, lse, q.new_empty(0), q.new_empty(0)
    if bias is None and uses_flash(q):
        out, lse, _, _, _, _, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, seed, offset
    out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(
        q, k, v, None if bias is None else _cuda_bias(bias, q.shape[2]), True, 0.0, causal,
        scale=scale)
    return out, lse, seed, offset


def _fused_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None,
                    out: Tensor, lse: Tensor, seed: Tensor, offset: Tensor, scale: float,
                    causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax attention's backward pass with D = rowsum(grad * out) zero: ``out`` is
    given as zeros (module docstring)."""
    zeros = torch.zeros_like(out)
    if q.device.type == "cpu":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, zeros, lse, 0.0, causal, attn_mask=bias, scale=scale)
    if bias is None and uses_flash(q):
        return _aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, zeros, lse, None, None, q.shape[2], k.shape[2], 0.0, causal,
            seed, offset, scale=scale)
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, None if bias is None else _cuda_bias(bias, q.shape[2]), zeros, lse,
        seed, offset, 0.0,
        [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def _bias_or_none(bias: Tensor) -> Tensor | None:
    return None if is_placeholder(bias) else bias


def _scores_bias(bias: Tensor | None, mask: Tensor | None) -> Tensor | None:
    """What the operator adds to the scaled scores: the key bias ``[B, H, 1, Nk]`` and an
    ``attn_mask``'s additive form ``[B, H|1, 1|Nq, Nk]`` (CPU calls only)."""
    if mask is None:
        return bias
    return mask if bias is None else bias + mask


class FoldedSDPA(torch.autograd.Function):
    """exp(lse_i - a_i) O_i with (O, lse) of one fused softmax-attention call at scale s
    with the key bias added to its scores: q ``[B, H, Nq, W]``, k ``[B, H, Nk, W]``,
    v ``[B, H, Nk, W]`` in one dtype, bias ``[B, H, 1, Nk]`` and an ``attn_mask``'s
    additive form ``[B, H|1, 1|Nq, Nk]`` (CPU calls only; ``_mask_gradient``), each an
    empty placeholder where there is none, and a ``[B, H, Nq]``, these three in float32
    (float64 for float64 inputs). Returns that
    ``[B, H, Nq, W]`` in a's dtype, then O, lse and the dropout seed and offset (not
    differentiable; kept for the backward operator, as SDPA's own autograd keeps them)."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, bias: Tensor,  # type: ignore[override]
                mask: Tensor, a: Tensor, scale: float, causal: bool) -> tuple[Tensor, ...]:
        # the biases detached: the operators have no gradient for them (the backward
        # below does), and export traces this forward with autograd on
        scores_bias = _scores_bias(_bias_or_none(bias.detach()),
                                   _bias_or_none(mask.detach()))
        out, lse, seed, offset = _fused_forward(q, k, v, scores_bias, scale, causal)
        y = out.to(a.dtype) * torch.exp(lse[..., : q.shape[2]] - a)[..., None]
        return y, out, lse, seed, offset

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        q, k, v, bias, mask, a, scale, causal = inputs
        _, out, lse, seed, offset = output
        ctx.mark_non_differentiable(out, lse, seed, offset)
        ctx.save_for_backward(q, k, v, bias, mask, a, out, lse)
        ctx.rng = (seed, offset)  # not batched: outside the saved tensors' batch dims
        ctx.options = (scale, causal)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, q, k, v, bias, mask, a,  # type: ignore[override]
             scale, causal):
        """The mapped dim joins the batch dim (the seed and offset are not mapped)."""
        size = info.batch_size
        tensors = [t if is_placeholder(t) else fold_into_batch(t, dim, size)
                   for t, dim in zip((q, k, v, bias, mask, a), in_dims, strict=False)]
        y, out, lse, seed, offset = FoldedSDPA.apply(*tensors, scale, causal)
        return ((split_batch(y, size), split_batch(out, size), split_batch(lse, size),
                 seed, offset), (0, 0, 0, None, None))

    @staticmethod
    @first_order_backward
    def backward(ctx: Any, grad: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, bias, mask, a, out, lse = ctx.saved_tensors
        scale, causal = ctx.options
        r = torch.exp(lse[..., : q.shape[2]] - a)[..., None]  # [B, H, Nq, 1]
        grad = grad.to(a.dtype)
        grad_a = -(r * (grad * out.to(a.dtype))).sum(-1)  # -g . (C V)
        bias = _bias_or_none(bias)
        if bias is None:  # the values route: dO.v' may pass float32's range (docstring)
            # the backward is linear in dO (D = 0): dO scaled to at most 1 per head, g
            # first (r g itself may overflow), and the gradients scaled back
            size = _largest_per_head(grad)
            grad_out = grad / size * r
            second = _largest_per_head(grad_out)
            grad_out, size = grad_out / second, size * second
        else:
            grad_out = grad * r  # dO
        dq, dk, dv = _fused_backward(grad_out.to(q.dtype).contiguous(), q, k, v,
                                     _scores_bias(bias, _bias_or_none(mask)), out, lse,
                                     *ctx.rng, scale, causal)
        if bias is None:
            dq, dk, dv = ((d * size).to(d.dtype) for d in (dq, dk, dv))
        grad_bias = None if bias is None or not ctx.needs_input_grad[3] \
            else (dv.to(bias.dtype) * v.to(bias.dtype)).sum(-1)[:, :, None, :]  # dV_j . v_j
        grad_mask = None if not ctx.needs_input_grad[4] else _mask_gradient(
            q, k, v, bias, mask, lse, grad_out, dv, scale)
        return dq, dk, dv, grad_bias, grad_mask, grad_a, None, None


def _mask_gradient(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, mask: Tensor,
                   lse: Tensor, grad_out: Tensor, dv: Tensor, scale: float) -> Tensor:
    """The gradient of a learned ``attn_mask`` (its additive form ``[B, H|1, 1|Nq, Nk]``):
    the scores' gradient dS_ij = P_ij (dO_i . v_j), softmax's with D = 0 (module
    docstring), summed over what the mask broadcasts over. A row over the keys (a padding
    mask) takes the column sums, dV_j . v_j, as the key bias does, with no pass over the
    block; a mask with a row per query has its own ``[Nq, Nk]`` entries, and so does
    its gradient: P is formed again from q, k and lse in the mask's dtype."""
    work = mask.dtype
    if mask.shape[-2] == 1:
        grad = (dv.to(work) * v.to(work)).sum(-1)[:, :, None, :]  # [B, H, 1, Nk]
    else:
        logits = scale * (q.to(work) @ k.to(work).transpose(-1, -2)) + mask
        if bias is not None:
            logits = logits + bias
        p = torch.exp(logits - lse[..., : q.shape[2], None].to(work))
        # rows whose keys are all masked: lse = -inf, no weight and no gradient
        p = torch.where(p.isnan(), 0.0, p)
        grad = p * (grad_out.to(work) @ v.to(work).transpose(-1, -2))
    return grad.sum(1, keepdim=True) if mask.shape[1] == 1 else grad


def _largest_per_head(x: Tensor) -> Tensor:
    """max |x| over each head's ``[N, W]`` block, ``[B, H, 1, 1]``; 1 where that is 0 or
    not finite (nothing to scale, or a NaN to pass on as it is)."""
    size = x.abs().amax(dim=(-2, -1), keepdim=True)
    return torch.where(size.isfinite() & (size > 0), size, 1.0)


def fold_exponent_shift(norms: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor]:
    """(c, too wide), each ``[B, H, 1]``, for the values route (module docstring), from
    the keys' b = s |k|^2 / 2 ``[B, H, Nk]`` (``valid`` ``[B, 1, Nk]`` bool or None): c
    the middle of the valid, finite keys' range (a non-finite key spoils the rows that
    see it, not the others' c), at most ``FOLD_HEADROOM`` above its bottom (0 where a
    head has no such key); too wide where that range exceeds ``FOLD_SPAN_LIMIT``."""
    norms = norms.detach()
    counted = norms.isfinite() if valid is None else valid & norms.isfinite()
    low = torch.where(counted, norms, torch.inf)
    high = torch.where(counted, norms, -torch.inf)
    low, high = low.amin(-1, keepdim=True), high.amax(-1, keepdim=True)
    shift = low + ((high - low) / 2).clamp(max=FOLD_HEADROOM)
    return shift.nan_to_num(0.0, 0.0, 0.0), (high - low) > FOLD_SPAN_LIMIT


def kernelized_by_folding(
    q: Tensor, k: Tensor, v: Tensor, scale: float, *, key_valid: Tensor | None = None,
    causal: bool = False, shift: Tensor | None = None, attn_mask: Tensor | None = None,
) -> Tensor:
    """C V through one fused softmax-attention call at head dim D (module docstring).

    q ``[B, H, Nq, D]``, k ``[B, H, Nk, D]``, v ``[B, H, Nk, Dv]``; ``key_valid``
    ``[B, Nk]`` bool or None; ``shift`` ``[B, H, 1, D]`` (or None), detached, taken out of
    q and k (``shared/centring.keys_mean``); ``attn_mask`` SDPA's (bool, or float
    weights exp(m_ij)), CPU calls only; a float one that requires grad gets its
    gradient (``_mask_gradient``). Returns ``[B, H, Nq, Dv]`` in float32 (float64
    for float64 inputs), rows of padded queries not zeroed.
    """
    dtype = fused_dtype(q.dtype)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if shift is not None:
        q, k = q - shift, k - shift
    valid = None if key_valid is None else key_valid[:, None, :]  # [B, 1, Nk]
    if valid is not None:
        k, v = (torch.where(valid[..., None], t, 0.0) for t in (k, v))
    key_norms = scale * half_sq_norm(k.to(work))  # b: [B, H, Nk]
    a = scale * half_sq_norm(q.to(work))  # [B, H, Nq]
    if takes_key_bias(q):
        # a padded key: a logit of -1e6 (added to the scaled scores: weight exactly 0)
        bias = -key_norms if valid is None else torch.where(valid, -key_norms, MASKED_LOGIT)
        # a key's NaN reaches the rows that see it through q.k already; the fused kernel
        # adds the bias after its causal mask (-inf), so a NaN there would reach the rows
        # before that key too
        bias = torch.where(bias.isnan(), 0.0, bias)[:, :, None, :]  # [B, H, 1, Nk]
    else:  # the values carry it (FlashAttention-2 takes no bias)
        c, too_wide = fold_exponent_shift(key_norms, valid)  # [B, H, 1]
        # a NaN key, a padded one: v' = 0 (the rows that see a NaN key get it through
        # q.k; a NaN or an overflow in v' would reach, through 0 x NaN, every row)
        kept = ~key_norms.isnan() if valid is None else valid & ~key_norms.isnan()
        factor = torch.exp(torch.where(kept, c - key_norms, -torch.inf))
        v = (factor[..., None] * v.to(work)).to(dtype)
        a = a + torch.where(too_wide, torch.nan, c)
        bias = q.new_empty(0)
    d, dv = q.shape[-1], v.shape[-1]
    width = d if d == dv and (q.device.type == "cpu" or not d % WIDTH_MULTIPLE) \
        else fused_width(max(d, dv))
    if width != d or width != dv:
        q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
    # the fused operators read rows of unit stride (SDPA's wrapper sees to it for them)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    mask = q.new_empty(0)
    if attn_mask is not None:  # additive, with the causal pattern: [B, H|1, 1|Nq, Nk]
        if q.device.type != "cpu":
            raise ValueError("kernelized_by_folding takes an attn_mask on the CPU only")
        shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        mask = attention_bias(attn_mask, None, causal, shape, work, q.device, "kernelized")
        mask = mask.expand(q.shape[0], *mask.shape[1:])  # a batch dim to fold under vmap
        causal = False
    out = apply(FoldedSDPA, q, k, v, bias, mask, a, scale, causal)[0]
    # split, not sliced: the backward writes one tensor of out's size, not a zero
    # tensor of that size and a copy (as the augmentation's)
    return out if width == dv else out.split([dv, width - dv], dim=-1)[0]
