"""Skyformer: kernelized attention approximated by the modified Nystrom method.

Skyformer (Chen et al., NeurIPS 2021) eqs. (4)-(6) with the Lemma 3 inverse:

    out = C(Q, X_S) [ W ( C(X_S, K) V ) ],   C(x, y) = exp(-|x - y|^2 / (2 sqrt(p))),

where X_S are m landmarks drawn uniformly from the valid rows of [Q; K] and W the
regularised, normalised iterative inverse of C(X_S, X_S). Differences from the
reference implementation (deliberate): the kernel scale uses the input's head dim
(the reference hard-codes 32), the inverse starts from the identity (the reference
from A^T / |A|_1 with a maximum over the whole batch: README.md), landmarks are drawn among the
valid rows wherever the padding is (the reference assumes right padding), without
replacement, and nothing defaults to CUDA.

Evaluation: the [N, m] blocks C(Q, X_S) and C(K, X_S) are never held whole; both
products go through ``gaussian_kernel_matmul`` (row chunks, a backward pass that
rebuilds each chunk), so time is O(N m D) and memory O(N D) beyond the inputs.
``materialised.py`` is the same computation with the blocks formed whole and
differentiated by autograd: the path the fused one is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...linalg import gaussian_kernel_matmul, kernel_scale
from ...linalg.kernel_backend import use_triton
from ...registry import Capabilities, register
from ...registry.guard import marks_nonfinite_when
from ...sketch import Landmarks
from ..shared.causal_nystrom import (
    CausalNystromOptions,
    causal_inputs,
    causal_outputs,
    refuse_causal_form_options,
)
from ..shared.inputs import (
    AttentionInputs,
    check_attention_inputs,
    compute_dtype,
    resolve_key,
    zero_padded_queries,
)
from ..shared.modified_nystrom import (
    NystromCore,
    NystromOptions,
    nystrom_core,
    sample_landmarks,
)
from ..shared.options import check_scale
from ..shared.reduction import WHOLE, KeyReduction
from . import two_nodes
from .causal import causal_skyformer


@dataclass(frozen=True)
class SkyformerConfig(NystromOptions, CausalNystromOptions):
    """Options of Skyformer; defaults are the authors' code's (128 features, gamma 0.1, 6
    iterations; the paper gives no gamma, README "Landmarks").

    causal, causal_local, landmark_stride: the causal construction (``causal.py``,
        README "Causal"); with ``causal`` the core is the exact ridge inverse (one
        Cholesky), so the ``pinv*`` options do not apply.

    scale: s of the Gaussian kernel exp(-s |q - k|^2 / 2), ``None`` = 1/sqrt(head dim)
        (Skyformer eq. (3)); a model that pre-scales its queries passes its own.
    """

    scale: float | None = None

    def __post_init__(self) -> None:
        self.validate_causal("skyformer")
        self.validate("skyformer")
        check_scale("skyformer", self.scale)


def marks_in_products(q: Tensor, k: Tensor, v: Tensor, config: SkyformerConfig) -> bool:
    """Whether a call marks non-finite rows in its Triton products' tiles
    (``gaussian_kernel_matmul(show_nonfinite=True)``) instead of leaving them to the
    guard's passes over q, k, v and the output (``registry/guard.py``; on an H100 those
    were 11 % of the call's GPU time at B = 4, H = 16, D = 64, N = 16384): the
    non-causal form, a key head per query head, where the products take the Triton
    kernels (on CPU the guard's finiteness check skips the marks anyway)."""
    if config.causal or not all(isinstance(t, Tensor) and t.dim() == 4 for t in (q, k, v)) \
            or not q.shape[1] == k.shape[1] == v.shape[1]:
        return False
    return use_triton(config.kernel, q, half=True)


@register(
    "skyformer",
    SkyformerConfig,
    Capabilities(target="gaussian", randomized=True, causal=True, weights=True),
    summary="modified Nystrom approximation of kernelized attention (Skyformer)",
)
@marks_nonfinite_when(marks_in_products)
def skyformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: SkyformerConfig,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | Tensor | None = None,
) -> Tensor:
    """Skyformer attention, an O(N m) approximation of ``kernelized_attention``.

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        config: the options (``SkyformerConfig``).
        key_padding_mask: ``[B, Nk]`` bool, True = real token. Padded rows are never
            landmarks and padded keys get zero weight.
        generator: draws the landmarks (the only randomness).
    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``q`` (half types computed in float32);
        rows of padded queries (self-attention) are zero.
    """
    if config.causal:
        return _causal(q, k, v, config, key_padding_mask, query_padding_mask, generator)
    refuse_causal_form_options("skyformer", config)
    info, landmarks, scale, _ = prepare(
        q, k, v, config, key_padding_mask=key_padding_mask,
        query_padding_mask=query_padding_mask, generator=generator)
    # half inputs stay half: the landmark rows are converted to float32 (m rows), the
    # products read q, k, v as they are (Triton) or convert them (PyTorch path)
    marks = marks_in_products(q, k, v, config)
    if two_nodes.applies(q, k, v, config, landmarks):
        out = two_nodes.attention(q, k, v, config, info, landmarks, scale, marks)
        if out is not None:
            return out
    q, k, core = nystrom_core(q, k, scale, config, landmarks)
    return skyformer_from_core(q, k, v, core, info, scale, kernel=config.kernel,
                               show_nonfinite=marks).to(q.dtype)


def skyformer_from_core(
    q: Tensor, k: Tensor, v: Tensor, core: NystromCore, info: AttentionInputs, scale: float,
    reduce: KeyReduction = WHOLE, kernel: str = "auto", show_nonfinite: bool = False,
) -> Tensor:
    """C(Q, X_S) W (C(X_S, K) V) given the core (Skyformer eq. (5)), in the compute dtype
    or, for half inputs on the Triton path, in q's dtype (``gaussian_kernel_matmul``).
    ``show_nonfinite``: the products mark non-finite rows as the guard would (a NaN
    or inf in a valid key or value row spoils C(X_S, K) V, hence every row; one in a
    query row its own row).

    ``q: [B, H, Nq, D]``, ``k: [B, H, Nk, D]``, ``v: [B, H, Nk, Dv]``; ``reduce``
    completes the sum over the keys when they are a shard (``shared/reduction.py``).
    Returns ``[B, H, Nq, Dv]`` with padded query rows zero.
    """
    z = core_values(k, v, core, info, scale, reduce, kernel, show_nonfinite)
    return query_product(q, core, z, info, scale, kernel, show_nonfinite)


def core_values(k: Tensor, v: Tensor, core: NystromCore, info: AttentionInputs,
                scale: float, reduce: KeyReduction = WHOLE, kernel: str = "auto",
                show_nonfinite: bool = False) -> Tensor:
    """Z = W (C(X_S, K) V) ``[B, H, m, Dv]``, the first half of ``skyformer_from_core``
    (its arguments)."""
    key_valid = None if info.key_valid is None else info.key_valid[:, None, :]  # [B, 1, Nk]
    context = reduce.sum(gaussian_kernel_matmul(
        k, core.x, v, core.x_norm, scale=scale, row_valid=key_valid, transpose=True,
        kernel=kernel, show_nonfinite=show_nonfinite, **core.bf16_rows,
    ))  # C(X_S, K) V: [B, H, m, Dv]
    w = core.inverse()  # after C(X_S, K) V (NystromCore.inverse): [B, H, m, m]
    return w @ context


def query_product(q: Tensor, core: NystromCore, z: Tensor, info: AttentionInputs,
                  scale: float, kernel: str = "auto", show_nonfinite: bool = False) -> Tensor:
    """C(Q, X_S) Z with padded query rows zero, ``[B, H, Nq, Dv]``: the second half of
    ``skyformer_from_core`` (its arguments)."""
    out = gaussian_kernel_matmul(q, core.x, z, core.x_norm, scale=scale, kernel=kernel,
                                 show_nonfinite=show_nonfinite, **core.bf16_rows)
    return zero_padded_queries(out, info.query_valid)  # [B, H, Nq, Dv]


def _causal(q: Tensor, k: Tensor, v: Tensor, config: SkyformerConfig,
            key_padding_mask: Tensor | None, query_padding_mask: Tensor | str | None,
            generator: torch.Generator | Tensor | None) -> Tensor:
    q, k, v, info, landmarks, order = causal_inputs(
        "skyformer", q, k, v, config.num_features, config.landmark_stride, key_padding_mask,
        query_padding_mask, generator, config.kernel)
    work = compute_dtype(q.dtype)
    out, _ = causal_skyformer(q.to(work), k.to(work), v.to(work), info,
                              kernel_scale(info.head_dim, config.scale), config.gamma,
                              config.causal_local, landmarks, kernel=config.kernel)
    return causal_outputs(out, info, order).to(q.dtype)


def prepare(
    q: Tensor, k: Tensor, v: Tensor, config: SkyformerConfig, *,
    key_padding_mask: Tensor | None, query_padding_mask: Tensor | str | None,
    generator: torch.Generator | Tensor | None,
) -> tuple[AttentionInputs, Landmarks, float, torch.dtype]:
    """Checks, landmarks, kernel scale p^-1/4 and compute dtype (both evaluations)."""
    info = check_attention_inputs(q, k, v, key_padding_mask, method="skyformer",
                                  query_padding_mask=query_padding_mask)
    key = resolve_key("skyformer", generator, q.device)
    landmarks = sample_landmarks(info, config.num_features, q.device, key,
                                 draw=config.kernel)
    return info, landmarks, kernel_scale(info.head_dim, config.scale), compute_dtype(q.dtype)
