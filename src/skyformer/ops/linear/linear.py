"""Linear attention (Katharopoulos et al., ICML 2020, "Transformers are RNNs").

Softmax's similarity exp(q.k) is replaced by phi(q).phi(k) with the feature map
phi(x) = elu(x) + 1 (their eq. (7)), and associativity gives O(N D Dv) time and
O(N D) memory (their eqs. (4)-(6)):

    out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j) + eps).

It does not approximate softmax attention (no parameter makes it converge to it): it is
the simplest linear-cost replacement, the baseline the Nystromformer and Skyformer
papers include; its error is reported against softmax attention, the attention it
replaces. ``eps`` = 1e-6 is the reference implementation's guard of the denominator.

``num_features`` is accepted but has no effect: phi is applied elementwise, so the
feature dimension is the head dim D, and no setting of the paper changes it. The option
exists so that a sweep over the common knob includes linear attention as a constant
baseline (``None`` or any positive integer; invalid values are rejected).

Causal attention (``causal=True``, the paper's eqs. (8)-(10): an RNN over the prefix
sums S_i = sum_{j<=i} phi(k_j) v_j^T, z_i = sum_{j<=i} phi(k_j)) is computed by chunks of
``CAUSAL_CHUNK`` positions, so that it stays matmul-bound and O(N D) in memory: within a
chunk the lower-triangular block (phi(Q_c) phi(K_c)^T) V_c; across chunks phi(Q_c)
S_{<c} with S_{<c} an exclusive prefix sum of the chunks' phi(K_c)^T V_c (a sum over
earlier chunks only, so output i depends on no position after i, not even by rounding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ...linalg import with_ones_column
from ...registry import Capabilities, register
from ..shared.causal_prefix import CAUSAL_CHUNK, by_blocks, causal_feature_sums, row_blocks
from ..shared.inputs import (
    AttentionInputs,
    check_attention_inputs,
    check_generator,
    compute_dtype,
    zero_padded_queries,
)
from ..shared.normalised import numerator_and_denominator
from ..shared.options import check_bool, check_nonnegative_float, check_optional_positive_int
from ..shared.reduction import WHOLE, KeyReduction


@dataclass(frozen=True)
class LinearConfig:
    """Options of linear attention.

    num_features: accepted for uniform sweeps, no effect (the feature dimension of
        elu + 1 is the head dim; module docstring).
    eps: added to the denominator (1e-6, as the reference implementation).
    causal: query i attends to keys j <= i (requires Nq == Nk; module docstring).
    """

    # options taken with no effect: sweeps over num_features run linear once
    INERT_OPTIONS: ClassVar[tuple[str, ...]] = ("num_features",)

    num_features: int | None = None
    eps: float = 1e-6
    causal: bool = False

    def __post_init__(self) -> None:
        check_optional_positive_int("linear", "num_features", self.num_features)
        check_nonnegative_float("linear", "eps", self.eps)
        check_bool("linear", "causal", self.causal)


def elu_feature_map(x: Tensor) -> Tensor:
    """phi(x) = elu(x) + 1 > 0 (Katharopoulos et al. eq. (7))."""
    return F.elu(x) + 1.0


@register(
    "linear",
    LinearConfig,
    Capabilities(target="softmax", causal=True, independent_queries=True, weights=True),
    summary="linear attention with the elu(x)+1 feature map (Katharopoulos et al.)",
)
def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: LinearConfig,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | Tensor | None = None,
) -> Tensor:
    """Linear attention phi(Q) (phi(K)^T V) / (phi(Q) phi(K)^T 1 + eps), O(N).

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        key_padding_mask: ``[B, Nk]`` bool, True = real token (padded keys are dropped
            from both sums).
        generator: unused (deterministic method).
        config: the options (``LinearConfig``).
    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``q`` (half types computed in float32); rows of
        padded queries (self-attention) are zero.
    """
    info = check_attention_inputs(q, k, v, key_padding_mask, method="linear",
                                  query_padding_mask=query_padding_mask)
    check_generator("linear", generator, q.device)
    dtype = q.dtype
    phi_q, phi_k, vw = linear_features(q, k, v, info.key_valid)
    if config.causal:
        if info.query_len != info.key_len:
            raise ValueError(f"linear: causal=True needs as many queries as keys, got "
                             f"Nq={info.query_len}, Nk={info.key_len}.")
        out = causal_linear(phi_q, phi_k, vw, config.eps)
        return zero_padded_queries(out, info.query_valid).to(dtype)
    return linear_from_features(phi_q, phi_k, vw, info, config.eps).to(dtype)


def linear_features(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """phi(Q), phi(K) and V in the compute dtype, padded keys' features and values zeroed
    (by ``where``: whatever a padded key holds stays out). Shapes as the inputs'."""
    work = compute_dtype(q.dtype)
    phi_q = elu_feature_map(q.to(work))  # [B, H, Nq, D]
    phi_k = elu_feature_map(k.to(work))  # [B, H, Nk, D]
    vw = v.to(work)
    if key_valid is not None:
        real = key_valid[:, None, :, None]
        phi_k = torch.where(real, phi_k, 0.0)
        vw = torch.where(real, vw, 0.0)
    return phi_q, phi_k, vw


def linear_from_features(phi_q: Tensor, phi_k: Tensor, v: Tensor, info: AttentionInputs,
                         eps: float, reduce: KeyReduction = WHOLE) -> Tensor:
    """phi(Q) (phi(K)^T V) / (phi(Q) phi(K)^T 1 + eps) (Katharopoulos et al. eq. (6)).

    ``phi_q: [B, H, Nq, D]``, ``phi_k: [B, H, Nk, D]`` and ``v: [B, H, Nk, Dv]`` with
    padded keys zeroed; ``reduce`` completes the two sums over the keys (D x Dv and D)
    when they are a shard (``shared/reduction.py``). Returns ``[B, H, Nq, Dv]``.
    """
    v_and_one = with_ones_column(v)  # [B, H, Nk, Dv + 1]
    kv = reduce.sum(phi_k.transpose(-1, -2) @ v_and_one)  # [B, H, D, Dv + 1]
    o = phi_q @ kv  # [B, H, Nq, Dv + 1]
    out = linear_normalised(o, eps)
    return zero_padded_queries(out, info.query_valid)


def causal_linear(phi_q: Tensor, phi_k: Tensor, v: Tensor, eps: float,
                  chunk: int = CAUSAL_CHUNK, reduce: KeyReduction = WHOLE) -> Tensor:
    """sum_{j<=i} (phi_i . phi_j) v_j / (sum_{j<=i} phi_i . phi_j + eps) by chunks
    (``shared/causal_prefix.py``): ``[B, H, N, D]`` features, ``[B, H, N, Dv]`` values.
    Where the keys are a shard (sequence parallel), ``reduce`` gives the sums of the
    shards before it, phi(K)^T [V, 1] (D x (Dv + 1) each), which every row adds: the
    RNN's state S at the shard's start (Katharopoulos et al. eqs. (8)-(9)). A call that
    records no gradient runs by blocks of rows (``causal_prefix.by_blocks``), each from
    that state after the keys before it (a shard's sums offered to later shards are
    the sum of its blocks')."""
    n = phi_q.shape[2]
    if by_blocks(n, phi_q, phi_k, v):  # inference: block by block
        blocks = row_blocks(n)
        block_sums = [phi_k[:, :, rows].transpose(-1, -2) @ with_ones_column(v[:, :, rows])
                      for rows in blocks]  # [B, H, D, Dv + 1] each
        start = reduce.earlier(sum(block_sums)).sum(0) if reduce.sharded else None
        outs = []
        for rows, sums in zip(blocks, block_sums, strict=True):
            o = causal_feature_sums(phi_q[:, :, rows], phi_k[:, :, rows],
                                    with_ones_column(v[:, :, rows]), chunk=chunk, start=start)
            outs.append(linear_normalised(o, eps))
            start = sums if start is None else start + sums
        return torch.cat(outs, dim=2)
    v_and_one = with_ones_column(v)  # [B, H, N, Dv + 1]
    o = causal_feature_sums(phi_q, phi_k, v_and_one, chunk=chunk)
    if reduce.sharded:
        start = reduce.earlier(phi_k.transpose(-1, -2) @ v_and_one).sum(0)  # [B, H, D, Dv + 1]
        o = o + phi_q @ start
    return linear_normalised(o, eps)


def linear_normalised(o: Tensor, eps: float) -> Tensor:
    """``o[..., :-1] / (o[..., -1:] + eps)`` for ``o: [..., Dv + 1]``; 0 where that
    denominator is 0 (``eps`` = 0 and a row that sees no key, or whose features all
    underflow), as the other methods give a row without keys, instead of 0 / 0."""
    numerator, denominator = numerator_and_denominator(o)
    total = denominator + eps
    return numerator / torch.where(total == 0, 1.0, total)
