"""The modified Nystrom method applied to the softmax kernel (Skyformer Figure 1).

The curve labelled "Skyformer" in Figure 1 of the paper approximates the
un-normalised softmax matrix A = exp(s Q K^T) with eq. (5) and then its row
normaliser by D~ = A~ 1, as Performer does: out = D~^-1 A~ V.

Stable evaluation. With q^ = sqrt(s) q and k^ = sqrt(s) k,

    exp(q^.k^) = exp(|q^|^2/2) exp(-|q^ - k^|^2/2) exp(|k^|^2/2),

so the lifted softmax matrix is A_bar = E C_bar E with E = diag(exp(|x^|^2/2)) and
C_bar the Gaussian kernel matrix of [Q^; K^]. Nystrom approximation commutes with
this diagonal congruence (A_bar S (S^T A_bar S)^+ S^T A_bar = E C_bar S (S^T C_bar S)^+
S^T C_bar E: the Nystrom projector is unchanged by a diagonal rescaling), hence

    A~ = E_Q  C(Q, X_S) W C(X_S, K)  E_K.

E_Q is a per-row factor and cancels in D~^-1 A~, so each row of C(Q, X_S) is
instead scaled by its own maximum; E_K is applied as exp(|k^|^2/2 - max_j |k^_j|^2/2)
(a common factor, which also cancels). The regularised Lemma 3 inverse W is taken
of the bounded Gaussian core C(X_S, X_S), not of exp(s X_S X_S^T), whose entries
overflow float32 for |q| ~ 30. With ``gamma = 0`` and ``pinv="exact"`` this is
exactly the modified Nystrom method of eq. (5) applied to A.

Unreliable rows. The Nystrom approximation is not entrywise positive, so D~_i can
be tiny or negative, and D~_i^-1 then multiplies the row's error without bound (on
pretrained MiniLM Q/K/V, layers 2 and 4, a few percent of rows: relative errors of
1e5). With u = C(X_S, K) E_K 1, the sum M_i = sum_s C(q_i, x_s) |(W u)_s| bounds
|D~_i| and equals it when nothing cancels; a row with D~_i <= rho M_i
(``normalizer_threshold``) has lost most of its normaliser to cancellation and
returns the mean of the values instead (the answer of uniform attention). On the
MiniLM data above rho = 0.3 cut the mean spectral error from 6.6 (rho = 0.01) to
0.33-0.57 on the deeper layers and changed the first layer's by +0.006.

Float32 range. The Gaussian entries carry the softmax matrix scaled by
exp(-|q^|^2/2 - |k^|^2/2), and the Nystrom sums need them down to exp(-|x^_a - x^_b|^2/2)
for landmark pairs: with max |x^|^2 = s max |x|^2 above 21.8 those fall below what the
float32 products keep (sqrt(tiny), ``linalg/flush.py``; tiny itself is exp(-87)), and
rows came out 60-97 % wrong while float64 stayed exact. On a CPU, where reading that
maximum costs nothing, such calls are computed in float64 (``needs_float64``); on a GPU
and in traced code they are not (docs/reliability.md, "Large norms in float32").

Evaluation: as in ``skyformer``, the [N, m] blocks are never held whole
(``gaussian_kernel_matmul``). E_K is folded into the exponent of C(X_S, K):
exp(k^.x - |x|^2/2 - max_j |k^_j|^2/2) <= 1, so no [N] factor multiplies the values;
the bound's column rides along in the product with C(Q, X_S).
``materialised.py`` forms the blocks whole (the path the fused one is tested against).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...linalg import gaussian_kernel_matmul
from ...linalg.flush import negligible_exponent
from ...linalg.kernel_backend import HALF_TYPES
from ...linalg.kernel_offsets import squared_norms
from ...linalg.scores import logit_scale
from ...linalg.tracing import may_read_values
from ...registry import Capabilities, register
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
    mean_values,
    resolve_key,
    zero_padded_queries,
)
from ..shared.modified_nystrom import (
    NystromCore,
    NystromOptions,
    nystrom_core,
    sample_landmarks,
)
from ..shared.normalised import normalised_or
from ..shared.options import check_nonnegative_float, check_scale
from ..shared.reduction import WHOLE, KeyReduction
from .causal import causal_nystrom_softmax

# The largest s |x|^2 of a row for which every Gaussian entry the float32 sums need,
# down to exp(-2 s max |x|^2), stays above the products' flush (sqrt(tiny) = exp(-43.7)).
FLOAT32_REACH = -negligible_exponent(torch.float32) / 2


@dataclass(frozen=True)
class NystromSoftmaxConfig(NystromOptions, CausalNystromOptions):
    """Options of the modified Nystrom softmax approximation.

    scale: softmax logit scale s, ``None`` = 1/sqrt(head dim).
    normalizer_threshold: rows whose approximate normaliser is at most this fraction
        of its magnitude bound return the mean of the values (module docstring).
    Other options as ``SkyformerConfig`` (the causal ones: ``causal.py``).
    """

    scale: float | None = None
    normalizer_threshold: float = 0.3

    def __post_init__(self) -> None:
        self.validate_causal("nystrom_softmax")
        self.validate("nystrom_softmax")
        check_scale("nystrom_softmax", self.scale)
        check_nonnegative_float(
            "nystrom_softmax", "normalizer_threshold", self.normalizer_threshold
        )
        if self.normalizer_threshold >= 1:
            raise ValueError(
                "nystrom_softmax: normalizer_threshold must be below 1, got "
                f"{self.normalizer_threshold!r}."
            )


@register(
    "nystrom_softmax",
    NystromSoftmaxConfig,
    Capabilities(target="softmax", randomized=True, causal=True, weights=True),
    summary="modified Nystrom approximation of softmax attention (Skyformer Figure 1)",
)
def nystrom_softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: NystromSoftmaxConfig,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | Tensor | None = None,
) -> Tensor:
    """Softmax attention approximated by the modified Nystrom method (O(N m)).

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        config: the options (``NystromSoftmaxConfig``).
        key_padding_mask: ``[B, Nk]`` bool, True = real token.
        generator: draws the landmarks.
    Returns:
        ``[B, H, Nq, Dv]``; rows of padded queries (self-attention) are zero.
    """
    return in_float64_where_needed(_attention, q, k, v, config, generator=generator,
                                   key_padding_mask=key_padding_mask,
                                   query_padding_mask=query_padding_mask)


def _attention(q: Tensor, k: Tensor, v: Tensor, config: NystromSoftmaxConfig, *,
               key_padding_mask: Tensor | None, query_padding_mask: Tensor | str | None,
               generator: torch.Generator | Tensor | None) -> Tensor:
    """``nystrom_softmax_attention`` in the compute dtype of q's."""
    if config.causal:
        return _causal(q, k, v, config, key_padding_mask, query_padding_mask, generator)
    refuse_causal_form_options("nystrom_softmax", config)
    info, landmarks, root, _ = prepare(
        q, k, v, config, key_padding_mask=key_padding_mask,
        query_padding_mask=query_padding_mask, generator=generator)
    # half inputs stay half, as in skyformer: the landmark rows become float32, the
    # products read q, k, v as they are (Triton) or convert them (PyTorch path); but
    # queries whose gradient is asked for are read in float32 (queries_for_gradient)
    out_dtype, bf16_values = q.dtype, q.dtype == k.dtype == torch.bfloat16
    q, k, core = nystrom_core(queries_for_gradient(q), k, root, config, landmarks,
                              bf16_values=bf16_values)
    return nystrom_softmax_from_core(q, k, v, core, info, root, config).to(out_dtype)


def in_float64_where_needed(call: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor,
                            config: NystromSoftmaxConfig, **kwargs: Any) -> Tensor:
    """``call(q, k, v, config, **kwargs)``, in float64 and back to q's dtype where
    ``needs_float64`` says so (the fused and the materialised path alike). Values of
    another dtype are left to the input checks, which refuse them."""
    if needs_float64(q, k, config) and isinstance(v, Tensor) and v.dtype == q.dtype:
        return call(q.double(), k.double(), v.double(), config, **kwargs).to(q.dtype)
    return call(q, k, v, config, **kwargs)


def needs_float64(q: Tensor, k: Tensor, config: NystromSoftmaxConfig) -> bool:
    """Whether a call computed in float32 would lose the Gaussian entries its sums need
    (module docstring, "Float32 range"): on a CPU (the read costs nothing there), in
    eager code, when s max(|q|^2, |k|^2) exceeds ``FLOAT32_REACH``. Every row counts,
    padded ones too (at worst a padded row's value costs a float64 call). Keys of
    another dtype than the queries' are left to the input checks (False)."""
    reach = float32_reach(q, k, config)
    return reach is not None and bool(reach > FLOAT32_REACH)


def float32_reach(q: Tensor, k: Tensor, config: NystromSoftmaxConfig) -> Tensor | None:
    """s max(|q|^2, |k|^2) over the rows (a 0-dim float32 tensor; -inf for no rows), which
    ``needs_float64`` compares with ``FLOAT32_REACH``; ``None`` where no float64 call is
    made whatever the values (not on a CPU, not computed in float32, traced, keys of
    another dtype). Sequence-parallel calls take its maximum over the ranks, so that
    every rank decides as one process would."""
    if not (isinstance(q, Tensor) and isinstance(k, Tensor)) or k.dtype != q.dtype \
            or q.device.type != "cpu" \
            or compute_dtype(q.dtype) != torch.float32 or not may_read_values(q, k) \
            or q.dim() < 2:
        return None
    if 0 in q.shape or 0 in k.shape:
        return torch.tensor(-math.inf, dtype=torch.float32, device=q.device)
    s = logit_scale(q.shape[-1], config.scale)
    with torch.no_grad():
        return s * torch.maximum(squared_norms(q, torch.float32).amax(),
                                 squared_norms(k, torch.float32).amax())


def queries_for_gradient(q: Tensor) -> Tensor:
    """q ``[B, H, N, D]``, or its float32 copy where q is a half type and gradients are
    on. A query's gradient comes by two routes, the rows of C(Q, X_S) and the landmark
    rows drawn from q, and on clustered queries they cancel: each rounded to the half
    type before autograd added them (the Triton product stores dy in q's dtype), dq
    had 1e-1 relative error against float64 for bfloat16 queries around a few centres;
    meeting in float32 they keep the half type's own rounding (docs/gpu-record.md,
    "Half-precision inputs read as they are"). Grad mode, not ``q.requires_grad``:
    inside ``torch.vmap`` or ``torch.func.grad`` q does not say it needs one."""
    if q.dtype in HALF_TYPES and torch.is_grad_enabled():
        return q.float()
    return q


def nystrom_softmax_from_core(
    q: Tensor, k: Tensor, v: Tensor, core: NystromCore, info: AttentionInputs, root: float,
    config: NystromSoftmaxConfig, reduce: KeyReduction = WHOLE,
) -> Tensor:
    """D~^-1 A~ V given the core (module docstring), in the compute dtype or, for half
    inputs on the Triton path, in their dtype.

    ``q: [B, H, Nq, D]``, ``k: [B, H, Nk, D]``, ``v: [B, H, Nk, Dv]``, ``root`` = sqrt
    of the logit scale; ``reduce`` completes the sums and the maximum over the keys when
    they are a shard (``shared/reduction.py``). Returns ``[B, H, Nq, Dv]``.
    """
    key_valid = None if info.key_valid is None else info.key_valid[:, None, :]  # [B, 1, Nk]

    # C(X_S, K) E_K up to a common factor: entries exp(k^.x - |x|^2/2 - max_j |k^_j|^2/2),
    # at most 1 since k^.x - |x|^2/2 <= |k^|^2/2. No gradient through the common factor.
    with torch.no_grad():
        log_e_k = squared_norms(k, core.x.dtype).mul_(0.5 * root * root)  # [B, H, Nk]
        if key_valid is not None:
            log_e_k = log_e_k.masked_fill(~key_valid, float("-inf"))
        shift = reduce.max(log_e_k.amax(dim=-1, keepdim=True))
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))  # [B, H, 1]
    # C(X_S, K) [V, 1]: the ones appended inside, so that v itself is saved, not a copy
    context = reduce.sum(gaussian_kernel_matmul(
        k, core.x, v, core.x_norm + shift, scale=root, row_norm=False,
        row_valid=key_valid, transpose=True, kernel=config.kernel, ones_column=True,
        **core.bf16_rows,
    ))  # [B, H, m, Dv + 1]
    z = core.inverse() @ context  # W after C(X_S, K) V (NystromCore.inverse)
    # E_Q cancels in the ratio: rows of C(Q, X_S) are scaled by their own maximum instead.
    # The last column gives sum_s C(q_i, x_s) |(W u)_s|, the bound on |D~_i|.
    o = gaussian_kernel_matmul(
        q, core.x, torch.cat([z, z[..., -1:].detach().abs()], dim=-1), core.x_norm,
        scale=root, row_norm=False, shift_rows=True, kernel=config.kernel, **core.bf16_rows,
    )  # [B, H, Nq, Dv + 2]
    # split, not three slices: its backward writes one tensor of o's size, where each
    # slice's backward wrote a zero tensor of that size and autograd added them
    numerator, denominator, bound = o.split([v.shape[-1], 1, 1], dim=-1)
    return normalise(numerator, denominator, bound, v, info, config, v.dtype, reduce)


def _causal(q: Tensor, k: Tensor, v: Tensor, config: NystromSoftmaxConfig,
            key_padding_mask: Tensor | None, query_padding_mask: Tensor | str | None,
            generator: torch.Generator | Tensor | None) -> Tensor:
    q, k, v, info, landmarks, order = causal_inputs(
        "nystrom_softmax", q, k, v, config.num_features, config.landmark_stride, key_padding_mask,
        query_padding_mask, generator, config.kernel)
    s = logit_scale(info.head_dim, config.scale)
    work = compute_dtype(q.dtype)
    out = causal_nystrom_softmax(q.to(work), k.to(work), v.to(work), info, math.sqrt(s),
                                 config.gamma, config.causal_local,
                                 config.normalizer_threshold, landmarks,
                                 kernel=config.kernel)
    return causal_outputs(out, info, order).to(q.dtype)


def prepare(
    q: Tensor, k: Tensor, v: Tensor, options: NystromSoftmaxConfig, *,
    key_padding_mask: Tensor | None, query_padding_mask: Tensor | str | None,
    generator: torch.Generator | Tensor | None,
) -> tuple[AttentionInputs, Landmarks, float, torch.dtype]:
    """Checks, landmarks, sqrt of the logit scale and compute dtype (both evaluations)."""
    info = check_attention_inputs(q, k, v, key_padding_mask, method="nystrom_softmax",
                                  query_padding_mask=query_padding_mask)
    key = resolve_key("nystrom_softmax", generator, q.device)
    s = logit_scale(info.head_dim, options.scale)
    landmarks = sample_landmarks(info, options.num_features, q.device, key,
                                 draw=options.kernel)
    return info, landmarks, math.sqrt(s), compute_dtype(q.dtype)


def normalise(numerator: Tensor, denominator: Tensor, bound: Tensor, vw: Tensor,
              info: AttentionInputs, options: NystromSoftmaxConfig, dtype: torch.dtype,
              reduce: KeyReduction = WHOLE) -> Tensor:
    """D~^-1 A~ V on reliable rows, mean(V) on the others; zero padded queries. A NaN
    normaliser (a non-finite landmark) is no reason for mean(V): the row stays NaN."""
    reliable = ~(denominator <= options.normalizer_threshold * bound)
    out = normalised_or(numerator, denominator, mean_values(vw, info.key_valid, reduce),
                        reliable)
    return zero_padded_queries(out, info.query_valid).to(dtype)
