"""Nystromformer (Xiong et al., AAAI 2021): softmax attention from three small softmax kernels.

With landmarks Q~, K~ (``[m, D]``) the segment means of Q and K, and logits scaled by
s = 1/sqrt(D), Nystromformer approximates the softmax attention matrix by

    S^ = softmax(s Q K~^T)  [softmax(s Q~ K~^T)]^+  softmax(s Q~ K^T),        [N, m][m, m][m, N]

(the paper's Nystrom-based self-attention; the blog post in the papers folder,
``003_*.txt``, derives it) and computes ``S^ V`` right to left in O(N m) time. The
``[N, m]`` and ``[m, N]`` kernels are only applied to matrices, through fused masked
SDPA, so they are never stored: memory O(N D + m^2), that of exact SDPA. The
pseudo-inverse is the iterative one of Razavi et al. (2014) with 6 iterations started
from A^T / (|A|_1 |A|_inf) (``linalg.iterative_pinv(init="scaled_transpose")``).
An optional depthwise convolution of the values along the sequence is added to the
output (the paper's skip connection; ``conv_kernel``), over the real tokens in order.

Landmarks and padding. Segments are taken over the *real* tokens only: the token with
rank r among the n real ones belongs to segment floor(r m / n). The m segments
partition the real tokens into runs of floor(n/m) or ceil(n/m) consecutive tokens
(adaptive pooling, so n need not be a multiple of m), padded tokens never enter a
mean, and a padded sequence has the landmarks of its truncation. The convolution too
runs over ranks among the real tokens: a hole is skipped, not read as a zero value.

When every real key is its own segment (n_k <= m, so K~ = K), the approximation is
exact in exact arithmetic: with A = softmax(s Q~ K^T) (m_q x n_k, m_q = min(n_q, m)), S^ =
softmax(s Q K^T) A^+ A; with fewer queries than keys Q~ = Q, so S^ = A A^+ A = A = S,
and otherwise A^+ A = I for generic inputs (A of full column rank, which query landmarks
that coincide would break). 6 iterations of the pseudo-inverse are not exact. Such
sequences get exact softmax attention (whatever A's rank), computed as
softmax(s Q K~^T) V~ with V~ the (one-token) segment means of V. The reference
implementation does the same when m equals the padded length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...linalg import iterative_pinv
from ...linalg.scores import logit_scale
from ...registry import Capabilities, register
from ..shared.inputs import (
    check_attention_inputs,
    check_device,
    check_generator,
    compute_dtype,
    zero_padded_queries,
)
from ..shared.masked import masked_attention, masked_softmax
from ..shared.options import (
    check_optional_positive_int,
    check_pinv_iterations,
    check_positive_int,
    check_scale,
)
from ..shared.real_first import from_real_first, real_first_pair, to_real_first


@dataclass(frozen=True)
class NystromformerConfig:
    """Options of Nystromformer; defaults are the settings of the Skyformer comparisons.

    num_features: number of landmarks m (segment means), 128 as in the Skyformer
        paper's LRA comparison (the Nystromformer paper itself uses 64).
    pinv_iterations: Razavi iterations of the pseudo-inverse (the paper's 6).
    conv_kernel: odd kernel size of the depthwise convolution of V added to the output,
        ``None`` = no convolution (the Nystromformer LRA configuration uses 35). Its
        weights are learned: ``MultiHeadAttention`` owns them; a direct call must pass
        ``conv_weight``.
    scale: softmax logit scale s, ``None`` = 1/sqrt(head dim).
    """

    num_features: int = 128
    pinv_iterations: int = 6
    conv_kernel: int | None = None
    scale: float | None = None

    def __post_init__(self) -> None:
        check_positive_int("nystromformer", "num_features", self.num_features)
        check_pinv_iterations("nystromformer", self.pinv_iterations)
        check_optional_positive_int("nystromformer", "conv_kernel", self.conv_kernel)
        if self.conv_kernel is not None and self.conv_kernel % 2 == 0:
            raise ValueError(
                f"nystromformer: conv_kernel must be odd (a centred window keeps the "
                f"sequence length), got {self.conv_kernel}; use e.g. {self.conv_kernel + 1}."
            )
        check_scale("nystromformer", self.scale)

    @property
    def state_needed_because(self) -> str | None:
        """Why a call needs the per-layer state (``NystromformerConv``), None if not."""
        if self.conv_kernel is None:
            return None
        return f"conv_kernel={self.conv_kernel} convolves V with learned weights"

    @property
    def not_cross_attention_because(self) -> str | None:
        """Why these options need as many queries as keys, None if they do not."""
        if self.conv_kernel is None:
            return None
        return (f"conv_kernel={self.conv_kernel} adds the convolved value of each position "
                f"to the query of that position")

    def budget_caps(self, nq: int, nk: int) -> dict[str, int]:
        """Options to change for Nq, Nk tokens: at most one landmark per token (segment
        means of more segments than tokens are empty)."""
        n = max(nq, nk, 1)
        return {"num_features": n} if self.num_features > n else {}


@dataclass(frozen=True)
class Segments:
    """Assignment of tokens to m landmark segments, per batch element."""

    index: Tensor  # [B, N] long, segment of each token (padded tokens: any, weight 0)
    weight: Tensor  # [B, N] 1 for real tokens, 0 for padded ones (compute dtype)
    count: Tensor  # [B, m] number of real tokens per segment
    n_valid: Tensor  # [B] number of real tokens

    @property
    def live(self) -> Tensor:
        """``[B, m]`` bool: segments holding at least one real token."""
        return self.count > 0


def segments(valid: Tensor | None, batch: int, n: int, m: int, device: torch.device,
             dtype: torch.dtype) -> Segments:
    """Segment r -> floor(r m / n_valid) over the ranks r of the real tokens."""
    if valid is None:
        rank = torch.arange(n, device=device).expand(batch, n)
        n_valid = torch.full((batch,), n, device=device)
        weight = torch.ones(batch, n, device=device, dtype=dtype)
    else:
        rank = valid.long().cumsum(dim=1) - 1
        n_valid = valid.sum(dim=1)
        weight = valid.to(dtype)
    index = (rank.clamp_min(0) * m).div(n_valid.clamp_min(1)[:, None], rounding_mode="floor")
    count = weight.new_zeros(batch, m).scatter_add(1, index, weight)  # not in place: vmap
    return Segments(index, weight, count, n_valid)


def segment_means(x: Tensor, seg: Segments) -> Tensor:
    """Means of ``x: [B, H, N, D]`` over each segment's real tokens: ``[B, H, m, D]``
    (zero for empty segments)."""
    b, h, _, d = x.shape
    m = seg.count.shape[1]
    index = seg.index[:, None, :, None].expand(b, h, -1, d)
    sums = x.new_zeros(b, h, m, d).scatter_add(2, index, x * seg.weight[:, None, :, None])
    return sums / seg.count.clamp_min(1.0)[:, None, :, None]


def depthwise_conv(v: Tensor, weight: Tensor, key_valid: Tensor | None,
                   query_valid: Tensor | None) -> Tensor:
    """Per-head convolution of the real values along their ranks, one row per query.

    ``v: [B, H, N, Dv]``, ``weight: [H, K]`` (K odd) -> ``[B, H, N, Dv]``: the query of
    rank r among the real queries gets sum_t weight[t] v_(r + t - K // 2), v_j the real
    value of rank j, zero beyond either end. The convolution runs on the real values
    gathered to the front (``shared/real_first.py``), so holes and left padding give
    the truncated sequence's rows.
    """
    if key_valid is not None:
        v = v * key_valid[:, None, :, None].to(v.dtype)
    q_order, k_order = real_first_pair(query_valid, key_valid)
    v = to_real_first(v, k_order)
    h, kernel = weight.shape
    out = F.conv2d(v, weight.to(v.dtype).view(h, 1, kernel, 1), padding=(kernel // 2, 0),
                   groups=h)
    return from_real_first(out, q_order)


def _check_conv_weight(weight: Tensor | None, kernel: int | None, heads: int,
                       device: torch.device) -> None:
    """``weight`` is ``[H, conv_kernel]`` on the inputs' ``device`` where ``conv_kernel``
    is set, and None otherwise; or a sentence."""
    if kernel is None:
        if weight is not None:
            raise ValueError(
                "nystromformer: conv_weight was given but conv_kernel is None; set conv_kernel "
                "to the weight's kernel size."
            )
        return
    if weight is None:
        raise ValueError(
            f"nystromformer: conv_kernel={kernel} needs learned conv_weight of shape "
            f"[H, {kernel}]; use skyformer.MultiHeadAttention(..., method='nystromformer', "
            f"conv_kernel={kernel}), which owns it, or pass conv_weight to "
            f"skyformer.ops.nystromformer.nystromformer_attention (skyformer.attention "
            f"and scaled_dot_product_attention take options, not weights)."
        )
    if not isinstance(weight, Tensor) or tuple(weight.shape) != (heads, kernel):
        shape = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(
            f"nystromformer: conv_weight must have shape [H, conv_kernel] = [{heads}, {kernel}], "
            f"got {shape}."
        )
    check_device("nystromformer", "conv_weight", weight, device)


class NystromformerConv(nn.Module):
    """Per-layer state of Nystromformer: the depthwise convolution weights (if any).

    Initialised as ``nn.Conv2d(H, H, (K, 1), groups=H, bias=False)`` is (the reference
    implementation's layer): its ``reset_parameters`` draws the weight ``[H, 1, K, 1]``
    by ``kaiming_uniform_(a=sqrt(5))``, here from ``generator`` (a CPU generator: drawn
    on the CPU, then moved to the default device) or else torch's global generator of
    the default device.
    """

    def __init__(self, config: NystromformerConfig, num_heads: int, head_dim: int, *,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.weight = None
        if config.conv_kernel is not None:
            device = None if generator is None else generator.device
            weight = torch.empty(num_heads, 1, config.conv_kernel, 1, device=device)
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)
            self.weight = nn.Parameter(
                weight.view(num_heads, config.conv_kernel).to(torch.get_default_device()))

    def reset_parameters(self) -> None:
        """Draw the weight again from torch's global generator of its device, as a layer
        built now would: what a layer built on the meta device needs after ``to_empty``
        (its parameters hold no values)."""
        if self.weight is not None:
            heads, kernel = self.weight.shape
            nn.init.kaiming_uniform_(self.weight.view(heads, 1, kernel, 1), a=math.sqrt(5))

    def forward(self, q: Tensor, k: Tensor) -> dict[str, Tensor]:
        return {} if self.weight is None else {"conv_weight": self.weight}


@register(
    "nystromformer",
    NystromformerConfig,
    Capabilities(target="softmax", weights=True, not_causal_because=(
        "its landmarks are means of segments spanning the whole sequence and its first "
        "and last factors normalise over all landmarks and all keys, so every output "
        "depends on later tokens; skyformer and nystrom_softmax have a causal Nystrom "
        "construction with landmarks revealed in order")),
    summary="Nystromformer: segment-means landmarks, three softmax kernels, iterative pinv",
    state=NystromformerConv,
)
def nystromformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: NystromformerConfig,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | Tensor | None = None,
    conv_weight: Tensor | None = None,
) -> Tensor:
    """Nystromformer attention, O(N m) time, O(N D + m^2) memory.

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        config: the options (``NystromformerConfig``).
        key_padding_mask: ``[B, Nk]`` bool, True = real token. Padded tokens enter no
            landmark and padded keys get zero weight.
        generator: unused (the method is deterministic); accepted for a uniform signature.
        conv_weight: ``[H, conv_kernel]`` depthwise convolution weights (with ``conv_kernel``).
    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``q`` (half types computed in float32); rows of
        padded queries (self-attention) are zero.
    """
    info = check_attention_inputs(q, k, v, key_padding_mask, method="nystromformer",
                                  query_padding_mask=query_padding_mask)
    check_generator("nystromformer", generator, q.device)
    _check_conv_weight(conv_weight, config.conv_kernel, info.heads, q.device)
    if conv_weight is not None and info.query_len != info.key_len:
        raise ValueError(
            f"nystromformer: conv_kernel adds the convolved value of rank r to the query of "
            f"rank r, so it needs as many queries as keys; got Nq={info.query_len}, "
            f"Nk={info.key_len} (use conv_kernel=None for cross-attention)."
        )
    dtype = q.dtype
    work = compute_dtype(dtype)
    s = logit_scale(info.head_dim, config.scale)
    root = math.sqrt(s)  # split between q and k, as the reference does, so landmarks are scaled too
    qs, ks, vw = q.to(work) * root, k.to(work) * root, v.to(work)
    m = config.num_features
    q_seg = segments(info.query_valid, info.batch, info.query_len, m, q.device, work)
    k_seg = segments(info.key_valid, info.batch, info.key_len, m, q.device, work)
    q_land = segment_means(qs, q_seg)  # [B, H, m, D]
    k_land = segment_means(ks, k_seg)  # [B, H, m, D]
    q_live = q_seg.live[:, None, :, None].to(work)  # [B, 1, m, 1]
    k_live = k_seg.live[:, None, None, :]  # [B, 1, 1, m]
    key_visible = None if info.key_valid is None else info.key_valid[:, None, None, :]

    # kernel_1 [N, m] and kernel_3 [m, N] are only ever applied to a matrix: fused
    # masked SDPA computes kernel @ X without forming them (O(N) instead of O(N m) memory).
    kernel_2 = masked_softmax(q_land @ k_land.transpose(-1, -2), k_live) * q_live  # [B, H, m, m]
    kernel_3_v = masked_attention(q_land, ks, vw, key_visible) * q_live  # [B, H, m, Dv]
    # Dead landmark rows/columns of kernel_2 are zero and stay zero through the
    # iteration, so the live block is inverted as if it were alone.
    inverse = iterative_pinv(kernel_2, config.pinv_iterations, init="scaled_transpose")
    values = inverse @ kernel_3_v  # [B, H, m, Dv]

    own_landmarks = k_seg.n_valid <= m  # [B] (module docstring: exact whatever n_q)
    # K~ = K and V~ = V: kernel_1 V~ is exact softmax attention (computed for every
    # sequence, an O(N Dv) mean, so that no branch depends on the data).
    exact_values = segment_means(vw, k_seg)
    values = torch.where(own_landmarks[:, None, None, None], exact_values, values)
    out = masked_attention(qs, k_land, values, k_live)  # kernel_1 @ values  [B, H, Nq, Dv]
    if conv_weight is not None:
        out = out + depthwise_conv(vw, conv_weight, info.key_valid, info.query_valid)
    return zero_padded_queries(out, info.query_valid).to(dtype)
