"""Singular value spectra and stable ranks of attention (Skyformer Appendix B,
KDEformer Figure 2 and section 3.4).

- the softmax matrix D^-1 A and its residuals D^-1 A_res = D^-1 A with the entries of
  a sparse mask removed (KDEformer eq. (10): A_spar keeps the entries an LSH puts in
  the same bucket). Any boolean mask can be analysed; built in are KDEformer's
  equal-sized angular LSH buckets in Hamming order (Definition A.3, through
  ``sketch.hamming_blocks``, as the ``kdeformer`` method uses them) and the oracle
  mask of each row's largest entries (the most any mask with that many entries per
  row can remove, in Frobenius norm);
- the exact attention outputs, per head and for the heads side by side (the layer's
  output before its output projection).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ...linalg import softmax_scores
from ...sketch import draw_hyperplanes, hamming_blocks
from ..measure.metrics import singular_values, stable_rank_from_singular_values

MaskFn = Callable[[Tensor, Tensor, Tensor], Tensor]  # (q, k, probs) -> bool mask like probs


def topk_mask(scores: Tensor, per_row: int) -> Tensor:
    """True at the ``per_row`` largest entries of each row of ``scores: [..., Nq, Nk]``."""
    per_row = min(per_row, scores.shape[-1])
    index = scores.topk(per_row, dim=-1).indices
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    return mask.scatter_(-1, index, True)


def oracle_mask(per_row: int) -> MaskFn:
    """Mask function keeping each row's ``per_row`` largest softmax entries."""

    def fn(q: Tensor, k: Tensor, probs: Tensor) -> Tensor:
        return topk_mask(probs, per_row)

    return fn


def lsh_mask(block: int, bits: int = 7, seed: int = 0) -> MaskFn:
    """Mask function of KDEformer's sparse part: query i and key j in the same
    equal-sized bucket of ``block`` keys after sorting both by the Gray-code rank of
    a ``bits``-hyperplane angular hash (Definition A.3). Hyperplanes are drawn from
    ``seed``, one set per head, for ``q, k: [H, N, D]``."""
    if block < 1:
        raise ValueError(f"the LSH block must hold at least 1 key, got {block}.")

    def fn(q: Tensor, k: Tensor, probs: Tensor) -> Tensor:
        g = torch.Generator(device=q.device).manual_seed(seed)
        planes = draw_hyperplanes((1, q.shape[0]), q.shape[-1], bits, device=q.device,
                                  dtype=q.dtype, generator=g)
        blocks = hamming_blocks(q[None], k[None], planes, block)
        return blocks.q_block[0][..., :, None] == blocks.k_block[0][..., None, :]

    return fn


@dataclass(frozen=True)
class Residual:
    """The softmax matrix without the entries of one mask, per head."""

    mask: str
    singular_values: Tensor  # [H, N]
    stable_rank: Tensor  # [H]
    density: Tensor  # [H] fraction of all entries in the sparse part (the mask)


@dataclass(frozen=True)
class Spectra:
    """Spectra of one sequence's attention, per head (``H`` heads).

    softmax: singular values of D^-1 A ``[H, N]``; output: of the exact output
    D^-1 A V per head ``[H, Dv]``; layer_output: of the heads' outputs side by side
    ``[N, H Dv]`` -> ``[min(N, H Dv)]``; ``*_srank``: stable ranks ``[H]``
    (``layer_output_srank`` a 0-dim tensor); residuals: one per mask.
    """

    softmax: Tensor
    output: Tensor
    layer_output: Tensor
    softmax_srank: Tensor
    output_srank: Tensor
    layer_output_srank: Tensor
    residuals: list[Residual]


def attention_spectra(q: Tensor, k: Tensor, v: Tensor, masks: dict[str, MaskFn]) -> Spectra:
    """Spectra of the softmax matrix, of its residual after each mask, and of the outputs.

    Args:
        q, k, v: ``[H, N, D]`` (one sequence, H heads), any float dtype (float64 used).
        masks: name -> ``mask_fn(q, k, probs) -> bool [H, N, N]``, the entries the
            sparse part keeps.
    """
    q, k, v = (t.detach().to(torch.float64) for t in (q, k, v))
    probs = softmax_scores(q[None], k[None])[0]  # [H, N, N]
    residuals = []
    for name, mask_fn in masks.items():
        mask = mask_fn(q, k, probs)
        if mask.shape != probs.shape or mask.dtype != torch.bool:
            raise ValueError(f"mask {name!r} must be a bool tensor of shape {tuple(probs.shape)}.")
        s = singular_values(probs.masked_fill(mask, 0.0))
        residuals.append(Residual(name, s, stable_rank_from_singular_values(s),
                                  mask.to(torch.float64).mean(dim=(-1, -2))))
    out = probs @ v  # [H, N, Dv]
    layer = out.transpose(0, 1).reshape(out.shape[1], -1)  # [N, H Dv]
    s_soft = singular_values(probs)
    s_out = singular_values(out)
    s_layer = singular_values(layer)
    return Spectra(
        softmax=s_soft,
        output=s_out,
        layer_output=s_layer,
        softmax_srank=stable_rank_from_singular_values(s_soft),
        output_srank=stable_rank_from_singular_values(s_out),
        layer_output_srank=stable_rank_from_singular_values(s_layer),
        residuals=residuals,
    )
