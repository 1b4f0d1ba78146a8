"""Singular value spectra and stable ranks of attention (Skyformer Appendix B,
KDEformer Figure 2 and section 3.4).

- the softmax matrix D^-1 A and its residual D^-1 A_res = D^-1 A with the entries of
  a sparse mask removed (KDEformer eq. (10): A_spar keeps the entries an LSH puts
  in the same bucket). Any boolean mask can be analysed; built in are the oracle
  mask of each row's largest entries (the best any mask with that many entries per
  row can remove, in Frobenius norm) and equal-sized sorted buckets
  (KDEformer Appendix A, Definition A.3), which turn any hash or sort key into a
  mask;
- the exact attention outputs, per head and for the heads side by side (the layer's
  output before its output projection).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..ops.softmax import softmax_scores
from .metrics import singular_values, stable_rank_from_singular_values

MaskFn = Callable[[Tensor, Tensor, Tensor], Tensor]  # (q, k, probs) -> bool mask like probs


def topk_mask(scores: Tensor, per_row: int) -> Tensor:
    """True at the ``per_row`` largest entries of each row of ``scores: [..., Nq, Nk]``."""
    per_row = min(per_row, scores.shape[-1])
    index = scores.topk(per_row, dim=-1).indices
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    return mask.scatter_(-1, index, True)


def sorted_block_mask(query_keys: Tensor, key_keys: Tensor, block: int) -> Tensor:
    """Equal-sized buckets from sort keys (KDEformer Definition A.3, Figure 6).

    Queries and keys are sorted by their keys (e.g. an LSH bucket id in Hamming
    order), the sorted sequences are cut into chunks of ``block``, and query i sees
    key j when both fall in the same chunk.

    Args:
        query_keys: ``[..., Nq]``; key_keys: ``[..., Nk]`` (any sortable values).
    Returns:
        bool ``[..., Nq, Nk]``.
    """
    if block < 1:
        raise ValueError(f"block must be at least 1, got {block}.")
    q_chunk = torch.empty_like(query_keys, dtype=torch.long)
    k_chunk = torch.empty_like(key_keys, dtype=torch.long)
    positions_q = torch.arange(query_keys.shape[-1], device=query_keys.device) // block
    positions_k = torch.arange(key_keys.shape[-1], device=key_keys.device) // block
    q_chunk.scatter_(-1, query_keys.argsort(dim=-1, stable=True),
                     positions_q.expand_as(query_keys).contiguous())
    k_chunk.scatter_(-1, key_keys.argsort(dim=-1, stable=True),
                     positions_k.expand_as(key_keys).contiguous())
    return q_chunk[..., :, None] == k_chunk[..., None, :]


def oracle_mask(per_row: int) -> MaskFn:
    """Mask function keeping each row's ``per_row`` largest softmax entries."""

    def fn(q: Tensor, k: Tensor, probs: Tensor) -> Tensor:
        return topk_mask(probs, per_row)

    fn.__doc__ = f"each row's {per_row} largest entries (oracle)"
    return fn


@dataclass(frozen=True)
class Spectra:
    """Spectra of one source's attention, per head (``H`` heads).

    softmax: singular values of D^-1 A ``[H, N]``; residual: of D^-1 A_res ``[H, N]``;
    output: of the exact output D^-1 A V per head ``[H, Dv]``; layer_output: of the
    heads' outputs side by side ``[N, H Dv]`` -> ``[min(N, H Dv)]``. ``*_srank``:
    stable ranks ``[H]`` (``layer_output_srank`` a scalar tensor).
    """

    softmax: Tensor
    residual: Tensor
    output: Tensor
    layer_output: Tensor
    softmax_srank: Tensor
    residual_srank: Tensor
    output_srank: Tensor
    layer_output_srank: Tensor
    mask_density: Tensor  # [H] fraction of the entries in the sparse part (the mask)
    mask: str


def attention_spectra(
    q: Tensor, k: Tensor, v: Tensor, mask_fn: MaskFn, *, mask_name: str = "mask"
) -> Spectra:
    """Spectra of the softmax matrix, its residual after ``mask_fn`` and the outputs.

    Args:
        q, k, v: ``[H, N, D]`` (one sequence, H heads), any float dtype (float64 used).
        mask_fn: ``(q, k, probs) -> bool [H, N, N]``: the entries the sparse part keeps.
    """
    q, k, v = (t.detach().to(torch.float64) for t in (q, k, v))
    probs = softmax_scores(q[None], k[None])[0]  # [H, N, N]
    mask = mask_fn(q, k, probs)
    if mask.shape != probs.shape or mask.dtype != torch.bool:
        raise ValueError(f"mask_fn must return a bool tensor of shape {tuple(probs.shape)}.")
    residual = probs.masked_fill(mask, 0.0)
    out = probs @ v  # [H, N, Dv]
    layer = out.transpose(0, 1).reshape(out.shape[1], -1)  # [N, H Dv]
    s_soft = singular_values(probs)
    s_res = singular_values(residual)
    s_out = singular_values(out)
    s_layer = singular_values(layer)
    return Spectra(
        softmax=s_soft,
        residual=s_res,
        output=s_out,
        layer_output=s_layer,
        softmax_srank=stable_rank_from_singular_values(s_soft),
        residual_srank=stable_rank_from_singular_values(s_res),
        output_srank=stable_rank_from_singular_values(s_out),
        layer_output_srank=stable_rank_from_singular_values(s_layer),
        mask_density=mask.to(torch.float64).mean(dim=(-1, -2)),
        mask=mask_name,
    )
