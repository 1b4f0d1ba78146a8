"""Exact kernelized attention through the fused softmax kernels of SDPA.

With the kernel scale s (1/sqrt(p) by default) and a_i = |q_i|^2/2, b_j = -|k_j|^2/2,

    C_ij = exp(s (q_i.k_j + b_j - a_i)).

Augment (``[hi, lo]`` is a value split into two numbers of the fused dtype whose sum
carries it to about 16 mantissa bits)

    q'_i = [q_i, 1, 1, a_i^hi, a_i^lo, 0...],   k'_j = [k_j, b_j^hi, b_j^lo, 0, 0, 0...],
    k'_0 = [0, 0, 0, 1, 1, 0...]  (one extra key),

give the extra key a one-hot value in an extra channel, and run softmax attention with
SDPA's own scale s over the N+1 keys. Then s (q'_i.k'_j - q'_i.k'_0) = log C_ij <= 0,
the extra key is every row's maximum, and

    O_i[:Dv] = sum_j C_ij v_j / (1 + sum_j C_ij),    O_i[Dv] = 1 / (1 + sum_j C_ij),

so ``O_i[:Dv] / O_i[Dv] = (C V)_i`` with the fused kernels' O(N) memory and no overflow
(the softmax's max-shift is exactly the Gaussian's normaliser).

Why this shape:

- q and k enter unscaled and s is SDPA's ``scale``: the fused kernels multiply their
  float32 accumulator by s, so bfloat16 inputs are never rounded again (q s would be),
  and q.k is the exact products of the inputs summed in float32, as in flash attention.
- The norms are what the cancellation q.k - |q|^2/2 - |k|^2/2 is sensitive to; split
  into hi + lo they reach the logits with a relative error of about 2^-17 instead of
  bfloat16's 2^-9 (for float32 and float64 inputs lo is zero).
- The width is a multiple of 8: CUDA's memory-efficient kernel needs a head dim
  divisible by 4 (float32) or 8 (half types), or SDPA falls back to its math backend,
  which forms the [N, N] matrix (66 GiB at B = 4, H = 16, N = 8192).
- bfloat16 inputs stay bfloat16 (flash attention on CUDA: the weights are rounded to
  bfloat16 before the product with V, as in SDPA itself); float16 is computed in float32,
  since |k|^2/2 and the padding logit can exceed float16's largest number (65504); so is
  bfloat16 with a float ``attn_mask`` (``kernelized.py``), which would be rounded to 8
  bits (a bias of ~20 by ~0.04). A mask makes CUDA's SDPA take its memory-efficient
  kernel (flash takes none), and head dims above 252 (width > 256) do too.
- At D = 64 the width is 72: FlashAttention-2 rounds head dims up to a multiple of 32,
  so it likely runs its 96 kernel, about 1.5x the products of D = 64 (read from its
  dispatch rules, not measured).

Padded keys carry ``MASKED_LOGIT / s`` in the bias slot (weight exp(-1e6) = 0; the
value is clamped for tiny s, and padded value rows are zero, which keeps them out of
C V exactly since the normaliser cancels in O[:Dv] / O[Dv]).
Causal masking prepends the extra key and one dummy query, so that SDPA's causal mask
lets query i see the extra key and keys 0..i.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ...linalg import half_sq_norm
from ..shared.sdpa import fused_width, sdpa

MASKED_LOGIT = -1e6


def fused_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype q', k', v' are handed to SDPA in (see the module docstring)."""
    return torch.float32 if dtype == torch.float16 else dtype


def augmented_width(head_dim: int, value_dim: int) -> int:
    """Head dim of q', k', v': room for [q, 1, 1, a^hi, a^lo] and [v, 1], rounded up to
    a multiple of ``shared.sdpa.WIDTH_MULTIPLE``."""
    need = max(head_dim + 4, value_dim + 1)
    return fused_width(need)


def split_hi_lo(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(hi, lo) in ``dtype`` with hi + lo ~ x (about twice dtype's mantissa bits).

    Differentiable: d hi / dx = 1 and lo = x - hi contributes nothing net, so a gradient
    that reaches hi and lo equally (they meet the same factor 1) reaches x once."""
    hi = x.to(dtype)
    return hi, (x - hi.to(x.dtype)).to(dtype)


def augmented_inputs(
    q: Tensor, k: Tensor, v: Tensor, scale: float, key_valid: Tensor | None, *,
    causal: bool = False, shift: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(q', k', v') of the module docstring as SDPA takes them: the extra key and its
    one-hot value appended (``causal``: prepended, with a zero dummy query first).

    q ``[B, H, Nq, D]``, k ``[B, H, Nk, D]``, v ``[B, H, Nk, Dv]`` in any float dtype;
    ``key_valid`` ``[B, Nk]`` bool or ``None``. Norms are formed in float32 (float64 for
    float64 inputs); the results are ``[..., W]`` in ``fused_dtype(q.dtype)``, with
    Nk + 1 keys (and Nq + 1 queries for ``causal``). Each is built by its own function,
    so that its intermediate copies are freed before the next is built. ``shift``
    ``[B, H, 1, D]`` (or None), detached (``ops/shared/centring.keys_mean``), is
    subtracted from q and k in those copies: C is unchanged, its exponent better
    conditioned.
    """
    width = augmented_width(q.shape[-1], v.shape[-1])
    valid = None if key_valid is None else key_valid[:, None, :, None]  # [B, 1, Nk, 1]
    return (_queries(q, width, causal, shift), _keys(k, valid, scale, width, causal, shift),
            _values(v, valid, width, causal))


def _norm_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _filler(norm: Tensor, value: float, columns: int) -> Tensor:
    """``value`` broadcast to ``[..., N, columns]`` for ``norm: [..., N]`` (no memory)."""
    return norm[..., None].new_full((1,) * norm.dim() + (columns,), value).expand(
        *norm.shape, columns)


def _with_extra_row(rows: Tensor, extra: Tensor, causal: bool) -> Tensor:
    """``rows: [B, H, N, W]`` with the row ``extra: [B, H, 1, W]`` after them (``causal``:
    before them)."""
    return torch.cat([extra, rows] if causal else [rows, extra], dim=2)


def _queries(q: Tensor, width: int, causal: bool, shift: Tensor | None) -> Tensor:
    """q'_i = [q_i, 1, 1, a_i^hi, a_i^lo, 0...]; ``causal``: a zero dummy query first,
    so that SDPA's causal mask lets query i see the extra key."""
    dtype, (b, h, _, d) = fused_dtype(q.dtype), q.shape
    if shift is not None:
        q = q - shift
    a_hi, a_lo = split_hi_lo(half_sq_norm(q.to(_norm_dtype(q))), dtype)
    q_aug = torch.cat([q.to(dtype), _filler(a_hi, 1.0, 2), a_hi[..., None],
                       a_lo[..., None], _filler(a_hi, 0.0, width - d - 4)], dim=-1)
    return _with_extra_row(q_aug, q_aug.new_zeros(b, h, 1, width), True) if causal \
        else q_aug


def _keys(k: Tensor, valid: Tensor | None, scale: float, width: int, causal: bool,
          shift: Tensor | None) -> Tensor:
    """k'_j = [k_j, b_j^hi, b_j^lo, 0...] (padded keys: [0, masked logit / s, 0...])
    and the extra key [0, 0, 0, 1, 1, 0...]."""
    dtype, (b, h, _, d) = fused_dtype(k.dtype), k.shape
    if shift is not None:
        k = k - shift
    norm_dtype = _norm_dtype(k)
    bias = -half_sq_norm(k.to(norm_dtype))
    k = k.to(dtype)
    if valid is not None:
        # the logit s * masked <= MASKED_LOGIT for every scale down to ~1e-32; below
        # that the zero value rows still keep padded keys out of C V exactly
        masked = max(MASKED_LOGIT / scale, -torch.finfo(norm_dtype).max / 4)
        bias = torch.where(valid[..., 0], bias, masked)
        k = torch.where(valid, k, 0.0)
    b_hi, b_lo = split_hi_lo(bias, dtype)
    extra = torch.zeros(b, h, 1, width, dtype=dtype, device=k.device)
    extra[..., d + 2 : d + 4] = 1.0
    rows = torch.cat([k, b_hi[..., None], b_lo[..., None],
                      _filler(b_hi, 0.0, width - d - 2)], dim=-1)
    return _with_extra_row(rows, extra, causal)


def _values(v: Tensor, valid: Tensor | None, width: int, causal: bool) -> Tensor:
    """v'_j = [v_j, 0...] (padded keys: zero rows) and the extra value [0..., 1, 0...]
    (the 1 in channel Dv)."""
    dtype, (b, h, _, dv) = fused_dtype(v.dtype), v.shape
    v = v.to(dtype)
    if valid is not None:
        v = torch.where(valid, v, 0.0)
    extra = torch.zeros(b, h, 1, width, dtype=dtype, device=v.device)
    extra[..., dv] = 1.0
    return _with_extra_row(F.pad(v, (0, width - dv)), extra, causal)


def kernelized_by_sdpa(
    q: Tensor, k: Tensor, v: Tensor, scale: float, *,
    key_valid: Tensor | None = None, bias: Tensor | None = None, causal: bool = False,
    shift: Tensor | None = None,
) -> Tensor:
    """C V through ``scaled_dot_product_attention`` (module docstring).

    ``bias``: an additive ``[B|1, H|1, Nq, Nk]`` mask (``-inf`` = blocked) already holding
    padding and causality, or ``None``; ``causal`` is used only without it. Returns
    ``[B, H, Nq, Dv]`` in float32 (float64 for float64 inputs), rows of padded queries
    not zeroed.
    """
    causal = causal and bias is None
    q_aug, k_aug, v_aug = augmented_inputs(q, k, v, scale, key_valid, causal=causal,
                                           shift=shift)
    if bias is not None:  # the extra key (last column) always visible
        # a bias [.., 1, Nk] over the keys alone stays one row: SDPA broadcasts it (the
        # fused kernels keep O(N) memory), where one row per query would be [Nq, Nk + 1]
        bias = F.pad(bias.to(q_aug.dtype), (0, 1))
        out = sdpa(q_aug, k_aug, v_aug, attn_mask=bias, scale=scale)
    elif causal:
        out = sdpa(q_aug, k_aug, v_aug, scale=scale, is_causal=True)[..., 1:, :]
    else:
        out = sdpa(q_aug, k_aug, v_aug, scale=scale)
    work = torch.float64 if out.dtype == torch.float64 else torch.float32
    dv = v.shape[-1]
    # split, not sliced: the backward writes one tensor of out's size, not a zero
    # tensor of that size for each slice and their sum
    numerator, denominator, _ = out.split([dv, 1, out.shape[-1] - dv - 1], dim=-1)
    return numerator.to(work) / denominator.to(work)
