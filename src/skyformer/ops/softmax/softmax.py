"""Exact softmax attention through ``scaled_dot_product_attention`` (O(N) memory)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ...linalg.scores import logit_scale
from ...registry import Capabilities, register
from ..shared.inputs import (
    HALF_DTYPES,
    check_attention_inputs,
    check_generator,
    zero_padded_queries,
)
from ..shared.masked import attention_bias, biased_attention
from ..shared.options import check_bool, check_finite_scale, check_probability
from ..shared.sdpa import sdpa

_MASKED_MARGIN = 1e4  # a padded key's logit is this far below every real one: exp() is 0


@dataclass(frozen=True)
class SoftmaxConfig:
    """Options of exact softmax attention.

    scale: logit scale, any finite number as torch's SDPA takes, ``None`` = 1/sqrt(head
        dim).
    causal: query i attends to keys j <= i (requires Nq == Nk).
    """

    # no float32 step whose derivative a compiled backward would cast (amp.py)
    FLOAT32_STEPS: ClassVar[bool] = False

    scale: float | None = None
    causal: bool = False

    def __post_init__(self) -> None:
        check_finite_scale("softmax", self.scale)
        check_bool("softmax", "causal", self.causal)


def _masked_sdpa(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None, *, scale: float,
                 causal: bool, dropout_p: float = 0.0) -> Tensor:
    """SDPA with a key padding mask that never yields NaN (fully padded rows give 0),
    ``dropout_p`` on the probabilities (a padded key's is 0, dropped or not)."""
    if key_valid is None:
        if causal and scale <= 0:  # torch's CPU flash kernel gives NaN rows for these
            q, scale = q * scale, 1.0
        return sdpa(q, k, v, scale=scale, is_causal=causal, dropout_p=dropout_p)
    has_key = key_valid.any(dim=-1, keepdim=True)  # [B, 1]
    if not causal:
        safe = key_valid | ~has_key  # a row without keys attends to all, then is zeroed
        out = sdpa(q, k, v, attn_mask=safe[:, None, None, :], scale=scale, dropout_p=dropout_p)
    else:
        # SDPA takes no attn_mask together with is_causal: carry the padding in one
        # extra logit column instead (q' = [s q, c], k' = [k, 0 or -c]).
        q_column, k_column = _padding_columns(q, k, key_valid, scale)
        q_aug = torch.cat([q * scale, q_column.expand(*q.shape[:-1], 1)], dim=-1)
        k_aug = torch.cat([k, k_column.expand(*k.shape[:-1], 1)], dim=-1)
        out = sdpa(q_aug, k_aug, v, scale=1.0, is_causal=True, dropout_p=dropout_p)
    return out * has_key[:, None, :, None].to(out.dtype)


def _padding_columns(q: Tensor, k: Tensor, key_valid: Tensor, scale: float
                     ) -> tuple[Tensor, Tensor]:
    """The extra columns of the padded causal form, ``[B, 1, 1, 1]`` for the queries and
    ``[B, 1, Nk, 1]`` for the keys, in q's dtype: c and 0 (a real key) or -c (a padded
    one), so that a padded key's logit is s q_i.k_j - c^2. Every |s q_i.k_j| of a batch
    element is at most M = |s| max_i |q_i| max_j |k_j| (row norms over its heads and
    rows; a NaN row, whose own output is NaN, is left out, so it spoils no other row),
    and c^2 = 2 M + margin puts each padded logit below every real one by the margin at
    least. A fixed -1e6 did not: real logits below it (s = 1e4, q.k = -150) gave the
    padded keys every weight. c is kept within a quarter of the dtype's largest number
    and of the square root of the fused kernels' accumulator's, where c^2 and the row's
    products add up finite: in float16 c^2 <= 2.7e8, which real logits pass only with
    row norms of about 3e4 at s = 1/8."""
    accumulator = torch.float64 if q.dtype == torch.float64 else torch.float32

    def largest_row(x: Tensor) -> Tensor:  # [B]; 0 without rows
        rows = torch.linalg.vector_norm(x.detach(), dim=-1, dtype=accumulator).flatten(1)
        rows = torch.cat([torch.nan_to_num(rows, nan=0.0), rows.new_zeros(len(rows), 1)], 1)
        return rows.amax(dim=1)

    bound = torch.nan_to_num(abs(scale) * largest_row(q) * largest_row(k), nan=0.0)  # 0 * inf
    largest = min(torch.finfo(q.dtype).max, torch.finfo(accumulator).max ** 0.5) / 4
    c = (2 * bound + _MASKED_MARGIN).sqrt().clamp(max=largest)[:, None, None, None]
    k_column = torch.where(key_valid[:, None, :, None], 0.0, -c)
    return c.to(q.dtype), k_column.to(q.dtype)


@register(
    "softmax",
    SoftmaxConfig,
    Capabilities(target="softmax", exact=True, causal=True, cross_attention=True,
                 attn_mask=True, weight_dropout=True, independent_queries=True,
                 weights=True),
    summary="exact softmax attention (torch scaled_dot_product_attention)",
)
def softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: SoftmaxConfig,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | Tensor | None = None,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Exact softmax attention softmax(scale Q K^T + mask) V.

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        key_padding_mask: ``[B, Nk]`` bool, True = real token.
        generator: unused (exact method; dropout draws from torch's global generator, as
            SDPA's); accepted for a uniform signature and checked as every method's.
        attn_mask: SDPA's mask, broadcastable to ``[B, H, Nq, Nk]``: bool (True = may
            attend) or float (added to the logits); combined with the padding and
            ``causal``. A row that may attend to nothing returns zeros.
        dropout_p: dropout on the attention probabilities (applied whenever > 0, as SDPA).
    Returns:
        ``[B, H, Nq, Dv]``; rows of padded queries (self-attention) are zero.
    """
    info = check_attention_inputs(q, k, v, key_padding_mask, method="softmax",
                                  query_padding_mask=query_padding_mask)
    check_generator("softmax", generator, q.device)
    check_probability("softmax", "dropout_p", dropout_p)
    if config.causal and info.query_len != info.key_len:
        raise ValueError(
            f"softmax: causal=True needs as many queries as keys, got Nq={info.query_len}, "
            f"Nk={info.key_len}; for SDPA's top-left alignment (query i sees keys j <= i) "
            f"pass attn_mask=torch.ones(Nq, Nk, dtype=torch.bool).tril(), or is_causal to "
            f"skyformer.scaled_dot_product_attention, which builds it."
        )
    s = logit_scale(info.head_dim, config.scale)
    if attn_mask is None:  # SDPA's causal flag: its fused kernels (dropout too on CUDA)
        out = _masked_sdpa(q, k, v, info.key_valid, scale=s, causal=config.causal,
                           dropout_p=dropout_p)
    else:
        bias = attention_bias(attn_mask, info.key_valid, config.causal,
                              (*q.shape[:3], info.key_len), _bias_dtype(q, attn_mask),
                              q.device, "softmax")
        out = biased_attention(q, k, v, bias, scale=s, dropout_p=dropout_p)
    return zero_padded_queries(out, info.query_valid)


def _bias_dtype(q: Tensor, attn_mask: Tensor) -> torch.dtype:
    """The dtype of the bias handed to SDPA: the inputs', but float32 for a float mask
    of another dtype with half-precision inputs on the CPU, whose SDPA kernels take a
    float32 mask as it is (torch's own call does with a float32 one: a bias such as
    ALiBi's, hundreds at long N, rounded to bfloat16 would move logits by whole units;
    a float64 mask, which torch refuses, is rounded to float32). CUDA's fused kernels
    take only the inputs' dtype."""
    if q.device.type == "cpu" and q.dtype in HALF_DTYPES \
            and attn_mask.is_floating_point() and attn_mask.dtype != q.dtype:
        return torch.float32
    return q.dtype
