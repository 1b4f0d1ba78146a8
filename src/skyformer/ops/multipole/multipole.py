"""Multipole attention: exact near field + first-order far-field expansion.

Two registered methods share ``multipole_sums`` (``sums.py``):

- ``softmax_multipole`` approximates softmax attention softmax(s Q K^T) V: logits
  s q_i.k_j, output S_i[:Dv] / S_i[Dv];
- ``skyformer_multipole`` approximates Skyformer's Gaussian kernelized attention C V
  (Skyformer eq. (3)): with q^ = q p^-1/4, k^ = k p^-1/4, C_ij = exp(q^_i.k^_j -
  |k^_j|^2/2) exp(-|q^_i|^2/2), so the logits are q^_i.k^_j - |k^_j|^2/2 and the
  output is exp(-|q^_i|^2/2) S_i[:Dv].

Both follow the directions named in Skyformer's conclusion (section 6): a local +
global (sparse + low-rank) approximation, with landmarks (cluster centres) adapted to
the data. Derivation, budget accounting and measurements: ``docs/accuracy-first.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, overload

import torch
from torch import Tensor

from ...linalg import half_sq_norm, kernel_scale
from ...linalg.scores import logit_scale
from ...registry import Capabilities, get_method, register
from ...registry.methods import refuse_misnamed_arguments
from ..shared.inputs import (
    check_attention_inputs,
    compute_dtype,
    mean_values,
    resolve_key,
    zero_padded_queries,
)
from ..shared.options import check_scale
from .options import MultipoleOptions, check_window
from .sums import PartialSums, multipole_sums
from .targeted import FeatureChoice, targeted_multipole


@dataclass(frozen=True)
class SkyformerMultipoleConfig(MultipoleOptions):
    """Options of ``skyformer_multipole`` (see ``MultipoleOptions``).

    scale: s of the Gaussian kernel exp(-s |q - k|^2 / 2), ``None`` = 1/sqrt(head dim)
        (Skyformer eq. (3)); a model that pre-scales its queries passes its own.
    """

    scale: float | None = None

    def __post_init__(self) -> None:
        self.validate("skyformer_multipole")
        check_scale("skyformer_multipole", self.scale)


@dataclass(frozen=True)
class SoftmaxMultipoleConfig(MultipoleOptions):
    """Options of ``softmax_multipole``; ``scale``: logit scale s, ``None`` = 1/sqrt(D)."""

    scale: float | None = None

    def __post_init__(self) -> None:
        self.validate("softmax_multipole")
        check_scale("softmax_multipole", self.scale)


CONFIGS = {"softmax_multipole": SoftmaxMultipoleConfig,
           "skyformer_multipole": SkyformerMultipoleConfig}


def masked_bias(bias: Tensor, key_valid: Tensor | None) -> Tensor:
    """Per-key logit bias ``[B, H, Nk]`` with -inf for padded keys."""
    if key_valid is None:
        return bias
    return bias.masked_fill(~key_valid[:, None, :], float("-inf"))


def _gaussian_finish(sums: PartialSums, q_rows: Tensor) -> Tensor:
    """C V rows: exp(-|q^|^2/2) sum_j exp(q^.k^_j - |k^_j|^2/2) v_j."""
    return (sums.log_scale - half_sq_norm(q_rows)[..., None]).exp() * sums.numerator


def _softmax_finish(sums: PartialSums, q_rows: Tensor) -> Tensor:
    """Softmax rows: numerator / normaliser (0 for rows without a real key). The
    numerator times 0, not 0: a NaN query among the k-means centres leaves NaN
    numerators and zero normalisers (its logits count as no key), and its rows must
    not read as rows without a key (docs/reliability.md)."""
    den, num = sums.denominator, sums.numerator
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(den.dtype).tiny), num * 0)


def _mean_row(exact: Tensor, live: Tensor) -> Tensor:
    """The mean output row over the live rows (the trivial answer of the Gaussian target)."""
    return (exact * live).sum(2, keepdim=True) / live.sum(2, keepdim=True).clamp_min(1)


def multipole_and_choice(
    q: Tensor, k: Tensor, v: Tensor, config: MultipoleOptions, *,
    key_padding_mask: Tensor | None = None, query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | Tensor | None = None,
) -> tuple[Tensor, FeatureChoice | None]:
    """The multipole method of ``config``'s type: its output ``[B, H, Nq, Dv]`` and, with
    ``tolerance``, the per-head budgets and error estimates (``None`` without)."""
    softmax = isinstance(config, SoftmaxMultipoleConfig)
    method = "softmax_multipole" if softmax else "skyformer_multipole"
    info = check_attention_inputs(q, k, v, key_padding_mask, method=method,
                                  query_padding_mask=query_padding_mask)
    check_window(method, config, nq=info.query_len, nk=info.key_len,
                 self_attention=info.query_len == info.key_len
                 and info.query_valid is info.key_valid)
    generator = resolve_key(method, generator, q.device)
    work = compute_dtype(q.dtype)
    values = v.to(work)
    if softmax:
        s = logit_scale(info.head_dim, config.scale)
        q_, k_ = q.to(work) * s, k.to(work)
        bias = q_.new_zeros(q.shape[0], q.shape[1], k.shape[2])
        finish = _softmax_finish

        def trivial(exact: Tensor, live: Tensor) -> Tensor:  # uniform attention: mean(V)
            return mean_values(values, info.key_valid)
    else:
        scale = kernel_scale(info.head_dim, config.scale)
        q_, k_ = q.to(work) * scale, k.to(work) * scale
        bias = -half_sq_norm(k_)
        finish, trivial = _gaussian_finish, _mean_row
    bias = masked_bias(bias, info.key_valid)
    choice = None
    if config.tolerance is None:
        out = finish(multipole_sums(q_, k_, values, bias, info, config, generator,
                                    gaussian=not softmax), q_)
    else:
        out, choice = targeted_multipole(
            q_, k_, values, bias, info, config, generator, finish, trivial,
            tolerance=config.tolerance, probe=config.probe, gaussian=not softmax,
        )
    return zero_padded_queries(out, info.query_valid).to(q.dtype), choice


@overload
def multipole_with_choice(
    method: str, q: Tensor, k: Tensor, v: Tensor, *, tolerance: float,
    key_padding_mask: Tensor | None = ..., query_padding_mask: Tensor | str | None = ...,
    generator: torch.Generator | Tensor | None = ..., **options: Any,
) -> tuple[Tensor, FeatureChoice]: ...


@overload
def multipole_with_choice(
    method: str, q: Tensor, k: Tensor, v: Tensor, *, key_padding_mask: Tensor | None = ...,
    query_padding_mask: Tensor | str | None = ...,
    generator: torch.Generator | Tensor | None = ..., **options: Any,
) -> tuple[Tensor, FeatureChoice | None]: ...


def multipole_with_choice(
    method: str, q: Tensor, k: Tensor, v: Tensor, *, key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | Tensor | None = None, **options: Any,
) -> tuple[Tensor, FeatureChoice | None]:
    """``multipole_and_choice`` by method name, options as keyword arguments: the
    choice is None without a ``tolerance`` (typed so: with one it is a ``FeatureChoice``).

    Args:
        method: ``"softmax_multipole"`` or ``"skyformer_multipole"``.
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        key_padding_mask, query_padding_mask, generator: as ``skyformer.attention``.
        options: the method's options (``SoftmaxMultipoleConfig`` / ``SkyformerMultipoleConfig``);
            an unknown one is refused in a sentence listing them.
    """
    if method not in CONFIGS:
        raise ValueError(f"method must be one of {', '.join(CONFIGS)}, got {method!r}.")
    spec = get_method(method)
    refuse_misnamed_arguments(spec, options, "multipole_with_choice", multipole_with_choice)
    return multipole_and_choice(q, k, v, spec.make_config(**options),
                                key_padding_mask=key_padding_mask,
                                query_padding_mask=query_padding_mask, generator=generator)


# why torch.export cannot take a symbolic sequence length (Capabilities)
_FIXED_SHAPES = "its k-means sample and its budgets are capped by N"


@register(
    "skyformer_multipole",
    SkyformerMultipoleConfig,
    Capabilities(target="gaussian", randomized=True, fixed_shapes_because=_FIXED_SHAPES),
    summary="kernelized attention: exact near field (heavy keys of k-means query clusters) "
    "+ first-order far-field expansion around the cluster centres",
)
def skyformer_multipole_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: SkyformerMultipoleConfig,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | Tensor | None = None,
) -> Tensor:
    """Gaussian kernelized attention ``C V`` by near field + far-field expansion.

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        config: the options (``SkyformerMultipoleConfig``).
        key_padding_mask: ``[B, Nk]`` bool, True = real token.
        generator: draws the k-means sub-sample, initial centres and covariance keys.
    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``q``; rows of padded queries are zero.
    """
    return multipole_and_choice(q, k, v, config, key_padding_mask=key_padding_mask,
                                query_padding_mask=query_padding_mask, generator=generator)[0]


@register(
    "softmax_multipole",
    SoftmaxMultipoleConfig,
    Capabilities(target="softmax", randomized=True, fixed_shapes_because=_FIXED_SHAPES),
    summary="softmax attention: exact near field (heavy keys of k-means query clusters) "
    "+ first-order far-field expansion around the cluster centres",
)
def softmax_multipole_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: SoftmaxMultipoleConfig,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | Tensor | None = None,
) -> Tensor:
    """Softmax attention by near field + far-field expansion (normaliser from the same
    expansion, hence always positive).

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        config: the options (``SoftmaxMultipoleConfig``).
        key_padding_mask: ``[B, Nk]`` bool, True = real token.
        generator: draws the k-means sub-sample, initial centres and covariance keys.
    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``q``; rows of padded queries and of queries
        without any real key are zero.
    """
    return multipole_and_choice(q, k, v, config, key_padding_mask=key_padding_mask,
                                query_padding_mask=query_padding_mask, generator=generator)[0]
