"""Exact kernelized (Gaussian) attention, Skyformer section 4.1.

    out = C V,   C_ij = exp(-|q_i - k_j|^2 / (2 sqrt(p))),   p = head dim.

Fast path without an n x n matrix: softmax attention over augmented inputs through the
fused kernels of ``scaled_dot_product_attention`` (O(N) memory); the derivation is in
``sdpa_augmentation.py``. CPU calls without an ``attn_mask`` (and CUDA ones with
``fold_key_norms=True``) run those kernels at the head dim itself instead, the key norms
a bias of the scores or folded into V, the normaliser read off the logsumexp
(``sdpa_fold.py``).
``kernel="triton"`` takes flash-style Triton kernels of the Gaussian kernel itself
instead (``triton_flash.py``: no augmentation, no running maximum).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ...linalg import KERNELS, kernel_scale
from ...linalg.functional_ops import forward_mode_active
from ...linalg.kernel_backend import use_triton
from ...registry import Capabilities, register
from ..shared.centring import keys_mean
from ..shared.inputs import (
    AttentionInputs,
    check_attention_inputs,
    check_device,
    check_generator,
    zero_padded_queries,
)
from ..shared.masked import attention_bias, shared_key_row
from ..shared.options import check_bool, check_choice, check_scale
from .flash import FLASH_FALLBACK, flash_kernelized
from .sdpa_augmentation import fused_dtype, kernelized_by_sdpa
from .sdpa_fold import kernelized_by_folding


@dataclass(frozen=True)
class KernelizedConfig:
    """Options of exact kernelized attention.

    scale: s of the Gaussian kernel exp(-s |q - k|^2 / 2), ``None`` = 1/sqrt(head dim)
        (Skyformer eq. (3)); a model that pre-scales its queries passes its own.
    causal: query i attends to keys j <= i (requires Nq == Nk).
    kernel: ``"torch"`` (the SDPA augmentation, ``sdpa_augmentation.py``), ``"triton"``
        (flash-style kernels of the Gaussian kernel itself, ``triton_flash.py``: O(N)
        memory, padding and causal masks, an ``attn_mask`` only as a boolean row over
        the keys for every query and head, i.e. padding; in the inputs' dtype, half
        types included; float64 on CUDA takes ``"torch"``) or ``"auto"`` (``"triton"``
        for CUDA tensors in float32, bfloat16 or float16 without an ``attn_mask`` or
        with such a row, where it was faster on an H100 at every N measured without
        one, with under a tenth of the memory; ``"torch"`` otherwise).
    fold_key_norms: SDPA's fused kernels at the head dim D rather than at the
        augmentation's D + 8 (``sdpa_fold.py``), the normaliser taken from their
        logsumexp. ``True``: wherever a fused kernel runs, CUDA included: float32 (and
        float16, computed in float32) with exp(-s |k_j|^2 / 2) as a bias of the scores,
        exact; bfloat16 on CUDA with it folded into V, exact to bfloat16's rounding
        while the keys' s |k|^2 / 2 span less than 60 within a head (a head past that
        comes out NaN); an ``attn_mask`` only on the CPU (a learned one gets its
        gradient); not with ``kernel="triton"``. ``None`` (default): CPU calls (the bias
        form, exact, and faster than the augmentation there), with an ``attn_mask`` only
        one row over the keys (a padding mask; a row per query is slower there), not
        CUDA ones (not yet timed on a GPU).
        ``False``: never (the augmentation, or the flash kernels).
    """

    # no float32 step whose derivative a compiled backward would cast (amp.py)
    FLOAT32_STEPS: ClassVar[bool] = False

    scale: float | None = None
    causal: bool = False
    kernel: str = "auto"
    fold_key_norms: bool | None = None

    def __post_init__(self) -> None:
        check_scale("kernelized", self.scale)
        check_bool("kernelized", "causal", self.causal)
        check_choice("kernelized", "kernel", self.kernel, KERNELS)
        if not isinstance(self.fold_key_norms, bool | None):
            raise ValueError(
                f"kernelized: fold_key_norms must be True, False or None (the default: "
                f"the library's choice), got {self.fold_key_norms!r}.")
        if self.fold_key_norms and self.kernel == "triton":
            raise ValueError(
                'kernelized: fold_key_norms=True runs SDPA\'s fused kernels and '
                'kernel="triton" the Gaussian flash kernels; pass one of them '
                '(kernel="auto" or "torch" with fold_key_norms=True).')


@register(
    "kernelized",
    KernelizedConfig,
    Capabilities(target="gaussian", exact=True, causal=True, cross_attention=True,
                 attn_mask=True, independent_queries=True, weights=True),
    summary="exact Gaussian kernelized attention C V (Skyformer eq. (3)), O(N) memory",
)
def kernelized_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: KernelizedConfig,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | Tensor | None = None,
    attn_mask: Tensor | None = None,
) -> Tensor:
    """Exact Gaussian kernelized attention ``C V`` (Skyformer section 4.1).

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        key_padding_mask: ``[B, Nk]`` bool, True = real token.
        generator: unused (exact method); checked as every method's.
        attn_mask: SDPA's mask, broadcastable to ``[B, H, Nq, Nk]``: bool (False: weight
            0) or float m_ij (weights C_ij exp(m_ij)); combined with padding and causal.
    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``q``; rows of padded queries
        (self-attention) are zero. On the CPU (unless ``fold_key_norms=False``, or an
        ``attn_mask`` with a row per query): SDPA's flash kernel at
        head dim D with the key norms as a bias of the scores in float32 (float64 for
        float64 inputs; ``sdpa_fold.py``), an ``attn_mask``'s row added to it. The
        augmentation otherwise (``kernel="torch"``, or ``"auto"`` where the flash kernels
        are not taken):
        bfloat16 goes through SDPA's fused kernels as it is (float32 sums, the norms split
        hi + lo); float16, and bfloat16 with a float ``attn_mask``, are computed in
        float32.
    """
    info = check_attention_inputs(q, k, v, key_padding_mask, method="kernelized",
                                  query_padding_mask=query_padding_mask)
    check_generator("kernelized", generator, q.device)
    causal = config.causal
    if causal and info.query_len != info.key_len:
        raise ValueError(
            f"kernelized: causal=True needs as many queries as keys, got Nq={info.query_len}, "
            f"Nk={info.key_len}; for SDPA's top-left alignment (query i sees keys j <= i) "
            f"pass attn_mask=torch.ones(Nq, Nk, dtype=torch.bool).tril(), or is_causal to "
            f"skyformer.scaled_dot_product_attention, which builds it."
        )
    dtype = q.dtype
    scale = kernel_scale(info.head_dim, config.scale)
    if config.fold_key_norms:
        return _folded(q, k, v, info, scale, causal, attn_mask)
    auto = config.kernel == "auto"
    mask_row = _padding_row(attn_mask, info, q)
    flash_takes_mask = attn_mask is None or mask_row is not None
    flash = config.kernel == "triton" or (auto and flash_takes_mask
                                          and not FLASH_FALLBACK.failed_on(q))
    if flash and use_triton(config.kernel, q, half=True):
        if not flash_takes_mask:
            raise ValueError('kernelized: kernel="triton" takes an attn_mask only as a '
                             'boolean row over the keys, the same for every query and '
                             'head (a padding mask, [B, 1, 1, Nk]), nor is_causal with '
                             'Nq != Nk (scaled_dot_product_attention passes it as a '
                             'mask): padding and causal with Nq == Nk only; use '
                             'kernel="torch" for other masks.')
        # the keys' mean out of float32 q and k, as the SDPA routes take it (their
        # exponent cancels c |q|^2 / 2 against c q.k; not for causal rows, as there)
        keys = k.to(dtype)
        shift = None if causal else keys_mean(keys, info.key_valid)
        moved_q, moved_k = (q, keys) if shift is None else (q - shift, keys - shift)
        return FLASH_FALLBACK.run(
            auto, lambda: zero_padded_queries(flash_kernelized(
                moved_q, moved_k, v.to(dtype), _joined(info.key_valid, mask_row),
                scale * scale, causal, auto), info.query_valid),
            lambda: _augmented(*_inputs_for_gradients(q, k, v), info, scale, causal,
                               attn_mask).to(dtype), on=q)
    q, k, v = _inputs_for_gradients(q, k, v)
    if config.fold_key_norms is None and q.device.type == "cpu" \
            and (attn_mask is None or _one_row_per_key(attn_mask)):
        # the key bias, head dim D
        return _folded(q, k, v, info, scale, causal, attn_mask).to(dtype)
    return _augmented(q, k, v, info, scale, causal, attn_mask).to(dtype)


def _padding_row(attn_mask: Tensor | None, info: AttentionInputs, q: Tensor
                 ) -> Tensor | None:
    """``[B, Nk]`` bool: the keys ``attn_mask`` lets every query and head see, where it
    is a boolean row over the keys for all of them (a padding mask, as ``skyformer.hf``
    builds it; ``shared_key_row``), which the flash kernels take as key padding; None
    for no mask or any other (the SDPA routes take it). A mask on another device than
    q: a sentence."""
    if not isinstance(attn_mask, Tensor):
        return None
    check_device("kernelized", "attn_mask", attn_mask, q.device)
    return shared_key_row(attn_mask, (*q.shape[:3], info.key_len))


def _joined(key_valid: Tensor | None, row: Tensor | None) -> Tensor | None:
    """The keys that both masks keep (``[B, Nk]`` bool, or None: every key)."""
    if row is None or key_valid is None:
        return key_valid if row is None else row
    return key_valid & row


def _inputs_for_gradients(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v for the SDPA routes: float32 copies where ``sums_in_float32_for_gradients``."""
    if sums_in_float32_for_gradients(q):
        return q.float(), k.float(), v.float()
    return q, k, v


def sums_in_float32_for_gradients(q: Tensor) -> bool:
    """Whether the SDPA routes compute a bfloat16 call in float32: where gradients are
    on. A query's gradient is s sum_j dS_ij (k_j - q_i), which cancels where q_i ~ k_j;
    through SDPA its two terms (SDPA's dq and that of the row offset s |q_i|^2 / 2) are
    rounded to bfloat16 each before autograd adds them, and dq, dk came out 3e-2 from
    float64 for queries and keys around a few centres (spread 0.1 at D = 64), 0.95 for
    repeated tokens; in float32 1.7e-3, bfloat16's rounding (docs/gpu-record.md,
    "Exact kernelized attention's bfloat16 gradients on the SDPA routes"). The flash
    kernels keep it (dS rounded once) and stay in bfloat16; so does an explicit
    ``fold_key_norms=True``, the fused bfloat16 route, and so does a call without
    gradients, whose output is bfloat16's rounding either way. Grad mode, not
    ``requires_grad``, as ``nystrom_softmax``'s queries (inside ``torch.func`` the
    inputs do not say they need one)."""
    return q.dtype == torch.bfloat16 and torch.is_grad_enabled()


def _one_row_per_key(attn_mask: Tensor) -> bool:
    """An ``attn_mask`` that the head-dim-D form takes by default: one row over the keys,
    broadcast or expanded over the queries (a padding mask, as ``skyformer.hf`` builds
    it), which it adds to its key bias as one row (a learned one gets its gradient as
    the key bias does, with no pass over the block). A mask with a row per query would
    be added into a ``[B, H, Nq, Nk]`` bias per head, slower on the CPU than the
    augmentation's shared one (``benchmarks/kernelized_masks.py``)."""
    return attn_mask.dim() < 2 or attn_mask.shape[-2] == 1 or attn_mask.stride(-2) == 0


def _folded(q: Tensor, k: Tensor, v: Tensor, info: AttentionInputs, scale: float,
            causal: bool, attn_mask: Tensor | None) -> Tensor:
    """SDPA's fused kernels at head dim D (``sdpa_fold.py``): ``fold_key_norms=True``, and
    by default CPU calls (with an ``attn_mask``, ``_one_row_per_key``); the augmentation
    where no fused kernel takes the call (float64 on CUDA, devices other than the CPU and
    CUDA, forward-mode AD, which the fused kernels lack)."""
    if attn_mask is not None and q.device.type != "cpu":
        raise ValueError(
            "kernelized: fold_key_norms=True takes an attn_mask on the CPU only (on CUDA "
            "FlashAttention takes none): pass fold_key_norms=False for that attn_mask.")
    if forward_mode_active() or q.device.type not in ("cpu", "cuda") \
            or (q.device.type == "cuda" and q.dtype == torch.float64):
        return _augmented(q, k, v, info, scale, causal, attn_mask)
    shift = None if causal else keys_mean(k, info.key_valid)  # as _augmented's
    out = kernelized_by_folding(q, k, v, scale * scale, key_valid=info.key_valid,
                                causal=causal, shift=shift, attn_mask=attn_mask)
    return zero_padded_queries(out, info.query_valid).to(q.dtype)


def _augmented(q: Tensor, k: Tensor, v: Tensor, info: AttentionInputs, scale: float,
               causal: bool, attn_mask: Tensor | None) -> Tensor:
    """``kernel="torch"``: softmax attention over augmented inputs by SDPA."""
    dtype = q.dtype
    bias = None
    if attn_mask is not None:
        if attn_mask.is_floating_point() and dtype == torch.bfloat16:
            # a float mask rounded to bfloat16 would shift logits by ~2^-9 |mask|
            q, k, v = q.float(), k.float(), v.float()
        bias = attention_bias(attn_mask, None, causal, (*q.shape[:3], info.key_len),
                              fused_dtype(q.dtype), q.device, "kernelized")
    # the keys' mean out of q and k (in the augmentation's copies, ops/shared/centring.py);
    # not for causal rows, whose rounding must not depend on later keys
    shift = None if causal else keys_mean(k, info.key_valid)
    out = kernelized_by_sdpa(q, k, v, scale * scale, key_valid=info.key_valid, bias=bias,
                             causal=causal, shift=shift)
    return zero_padded_queries(out, info.query_valid).to(dtype)
