"""Naive Reformer: softmax over the union of the rounds' LSH attention sets.

For given rotations, per batch element, head and round: hash every real query and key
(argmax over [x R, -x R] with the sequence's b/2 columns), sort each side by (bucket,
position) with Python's ``sorted``, and mark j in P_i^(r) iff query i and key j share
the bucket and key j's chunk is query i's chunk or the one before (Section 2, eqs.
(3)-(5)); with ``attend_across_buckets`` (default) every key of those chunks. P_i is
the union over rounds; without attention to self (if excluded) unless P_i holds
nothing else, and self alone when P_i is empty. The output is softmax(s q_i . k_j)
over P_i (Appendix A's combination of rounds equals this), materialised as an N x N
masked matrix. For tests only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...linalg.scores import logit_scale
from ..shared.inputs import check_attention_inputs, zero_padded_queries
from .reformer import ReformerConfig, buckets_per_sequence


def _bucket(x: Tensor, rotation: Tensor, n_buckets: int) -> int:
    if n_buckets == 1:
        return 0
    proj = x @ rotation[:, : n_buckets // 2]
    return int(torch.argmax(torch.cat([proj, -proj])))


def reformer_attention_sets(
    q: Tensor, k: Tensor, rotations: Tensor, *, key_padding_mask: Tensor | None = None,
    **options,
) -> Tensor:
    """The union attention pattern P ``[B, H, N, N]`` bool (row i: the keys query i sees)."""
    cfg = ReformerConfig(**options)
    b, h, n, _ = q.shape
    valid = key_padding_mask if key_padding_mask is not None else torch.ones(b, n, dtype=torch.bool)
    lengths = valid.sum(-1)
    if cfg.shared_qk:
        k = q / q.norm(dim=-1, keepdim=True)
    sets = torch.zeros(b, h, n, n, dtype=torch.bool)
    for bi in range(b):
        nb = int(buckets_per_sequence(cfg, lengths)[bi])
        real = [i for i in range(n) if valid[bi, i]]
        for hi in range(h):
            for r in range(cfg.num_hashes):
                rot = rotations[hi, r]
                hq = {i: _bucket(q[bi, hi, i], rot, nb) for i in real}
                hk = {j: _bucket(k[bi, hi, j], rot, nb) for j in real}
                chunk_q = {
                    i: t // cfg.chunk for t, i in enumerate(sorted(real, key=lambda i: (hq[i], i)))
                }
                chunk_k = {
                    j: t // cfg.chunk for t, j in enumerate(sorted(real, key=lambda j: (hk[j], j)))
                }
                for i in real:
                    for j in real:
                        same = cfg.attend_across_buckets or hq[i] == hk[j]
                        if same and chunk_q[i] - chunk_k[j] in (0, 1):
                            sets[bi, hi, i, j] = True
            for i in real:
                if cfg.self_excluded:
                    sets[bi, hi, i, i] = False
                if not sets[bi, hi, i].any():  # nothing in any round: self alone
                    sets[bi, hi, i, i] = True
    return sets


def reference_reformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rotations: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    **options,
) -> Tensor:
    """softmax(s q_i . k_j) over the union of the LSH sets.

    ``rotations: [H, num_hashes, D, C]`` as drawn by ``sketch.draw_rotations``.
    Returns ``[B, H, N, Dv]``.
    """
    info = check_attention_inputs(q, k, v, key_padding_mask, method="reformer reference")
    cfg = ReformerConfig(**options)
    sets = reformer_attention_sets(
        q.detach(), k.detach(), rotations, key_padding_mask=key_padding_mask, **options
    )
    keys = q / q.norm(dim=-1, keepdim=True) if cfg.shared_qk else k
    s = logit_scale(q.shape[-1], cfg.scale)
    nonempty = sets.any(-1, keepdim=True)
    logits = (q @ keys.transpose(-1, -2) * s).masked_fill(~sets & nonempty, float("-inf"))
    probs = torch.softmax(logits, dim=-1) * nonempty
    return zero_padded_queries(probs @ v, info.query_valid)
