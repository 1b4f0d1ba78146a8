"""Naive KDEformer (Algorithm 3) with the matrices of the paper materialised.

For given draws, per batch element and head: the N x N attention matrix A, the 0/1
block pattern of the equal-sized angular LSH (labels from explicit sign bits, Gray
ranks from the closed form g ^ (g >> 1), Python ``sorted``), A_spar and A_res, the
exact softmax matrix D^-1 A whose stratified rows give the column norms (``"rows"``) or
the one-hot sampling matrices of the uniform KDE estimates (``"uniform"``), p, the
columns walked along the CDF (systematic or i.i.d.) and the explicit sampling matrix
Pi_res with rows e_l / sqrt(m p_l); then D~^-1 (A_spar V + A_res Pi^T Pi V).
Memory O(N^2), Python loops: for tests only.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...linalg.scores import logit_scale
from ..shared.inputs import check_attention_inputs, zero_padded_queries
from .kdeformer import KDEformerConfig, KDEformerDraws


def _gray_rank(label: int) -> int:
    """Position of ``label`` in the reflected Gray code, whose t-th word is t ^ (t >> 1)."""
    rank = 0
    while label:
        rank ^= label
        label >>= 1
    return rank


def _sorted_rows(x: Tensor, planes: Tensor, real: list[int], n: int) -> list[int]:
    labels = {}
    for i in real:
        bits = (x[i] @ planes > 0).tolist()
        labels[i] = sum(1 << r for r, bit in enumerate(bits) if bit)
    order = sorted(real, key=lambda i: (_gray_rank(labels[i]), i))
    return order + [i for i in range(n) if i not in labels]


def reference_key_order(k: Tensor, hyperplanes: Tensor | None, real: list[int]) -> list[int]:
    """The real keys of one (element, head) in the order that systematic sampling walks:
    Gray rank of the label then position (no hyperplanes: sequence order)."""
    if hyperplanes is None:
        return list(real)
    return _sorted_rows(k, hyperplanes.to(k.dtype), real, k.shape[0])[: len(real)]


def reference_block_pattern(
    q: Tensor, k: Tensor, hyperplanes: Tensor, block_size: int, *,
    key_padding_mask: Tensor | None = None, cross: bool | None = None,
) -> Tensor:
    """``[B, H, Nq, Nk]`` bool: query i and key j fall in the same equal-sized LSH bucket
    (Definition A.3 applied to queries and keys with the same hyperplanes)."""
    b, h, nq, _ = q.shape
    nk = k.shape[2]
    kv = key_padding_mask if key_padding_mask is not None else torch.ones(b, nk, dtype=torch.bool)
    cross = nq != nk if cross is None else cross  # cross: every query is real
    qv = torch.ones(b, nq, dtype=torch.bool) if cross else kv
    pattern = torch.zeros(b, h, nq, nk, dtype=torch.bool)
    for bi in range(b):
        q_real = [i for i in range(nq) if qv[bi, i]]
        k_real = [j for j in range(nk) if kv[bi, j]]
        # cross-attention: the element's real keys fill ceil(n_k / block) blocks and its
        # real queries are cut into as many chunks (padding = truncation)
        blocks = max(1, math.ceil(len(k_real) / block_size))
        q_size = max(1, math.ceil(len(q_real) / blocks)) if cross else block_size
        for hi in range(h):
            planes = hyperplanes[bi, hi].to(q.dtype)
            q_order = _sorted_rows(q[bi, hi], planes, q_real, nq)
            k_order = _sorted_rows(k[bi, hi], planes, k_real, nk)
            q_blk = torch.empty(nq, dtype=torch.long)
            k_blk = torch.empty(nk, dtype=torch.long)
            for t, i in enumerate(q_order):
                q_blk[i] = t // q_size
            for t, j in enumerate(k_order):
                k_blk[j] = t // block_size
            pattern[bi, hi] = q_blk[:, None] == k_blk[None, :]
    return pattern


def _uniform_pick(u: float, real: list[int]) -> int:
    t = min(math.floor(float(u) * len(real)), len(real) - 1)
    return real[t]


def _pick_columns(p: Tensor, order: list[int], points: list[float]) -> list[int]:
    """For each point x in [0, 1): the first key along ``order`` whose cumulative p
    exceeds x * (total p)."""
    cum, acc = [], 0.0
    for j in order:
        acc += float(p[j])
        cum.append(acc)
    picks = []
    for x in points:
        target = x * cum[-1]
        t = next((i for i, c in enumerate(cum) if c > target), len(order) - 1)
        picks.append(order[t])
    return picks


def reference_kdeformer_attention(
    q: Tensor, k: Tensor, v: Tensor, draws: KDEformerDraws, *,
    key_padding_mask: Tensor | None = None, **options,
) -> Tensor:
    """D~^-1 (A_spar V + A_res Pi_res^T Pi_res V) with everything materialised (eq. (11)).

    ``draws`` as made by ``draw_kdeformer`` for the same options. ``[B, H, Nq, Dv]``.
    """
    info = check_attention_inputs(q, k, v, key_padding_mask, method="kdeformer reference")
    cfg = KDEformerConfig(**options)
    b, h, nq, d = q.shape
    nk = k.shape[2]
    s_scale = logit_scale(d, cfg.scale)
    kv = key_padding_mask if key_padding_mask is not None else torch.ones(b, nk, dtype=torch.bool)
    qv = kv if nq == nk else torch.ones(b, nq, dtype=torch.bool)
    if cfg.blocks > 0:
        pattern = reference_block_pattern(
            q.detach(), k.detach(), draws.hyperplanes, cfg.blocks, key_padding_mask=key_padding_mask
        ).to(q.dtype)
    else:
        pattern = torch.zeros(b, h, nq, nk, dtype=q.dtype)
    m, s = cfg.num_features, cfg.samples
    rows = []
    for bi in range(b):
        k_real = [j for j in range(nk) if kv[bi, j]]
        q_real = [i for i in range(nq) if qv[bi, i]]
        if not k_real:  # an element of padding only: zero rows, nothing to sample
            rows.append(torch.zeros(h, nq, v.shape[-1], dtype=v.dtype))
            continue
        real_cols = kv[bi].to(q.dtype)
        heads = []
        for hi in range(h):
            a = torch.exp(s_scale * q[bi, hi] @ k[bi, hi].T) * real_cols  # A  [Nq, Nk]
            a_spar = a * pattern[bi, hi]
            a_res = a - a_spar
            if cfg.estimator == "uniform":
                # alpha: exact sparse row sums + (n/s) * residual entries at s uniform keys.
                u_keys = torch.zeros(s, nk, dtype=q.dtype)
                for r in range(s):
                    u_keys[r, _uniform_pick(draws.key_uniform[bi, hi, r], k_real)] += 1.0
                alpha = a_spar.sum(1) + len(k_real) / s * (a_res @ u_keys.T).sum(1)
            with torch.no_grad():
                v_real = v[bi, hi].detach() * real_cols[:, None]
                if cfg.estimator == "uniform":
                    # residual column norms of D~^-1 A at s uniform queries.
                    u_queries = torch.zeros(s, nq, dtype=q.dtype)
                    for r in range(s):
                        u_queries[r, _uniform_pick(draws.query_uniform[bi, hi, r], q_real)] += 1.0
                    x = a_res.detach() / alpha.detach()[:, None]  # D~^-1 A_res
                    norms = len(q_real) / s * (u_queries @ (x * x)).sum(0)
                    gamma = torch.linalg.matrix_norm(v_real, ord=2) ** -2
                    p = (norms + gamma * (v_real * v_real).sum(1)) * real_cols
                else:
                    # exact softmax rows of r stratified queries, own block dropped.
                    r_rows = cfg.rows
                    x = a.detach() / a.detach().sum(1, keepdim=True)  # D^-1 A
                    x = x * (1 - pattern[bi, hi])
                    beta = torch.zeros(nk, dtype=q.dtype)
                    for t in range(r_rows):
                        i = _uniform_pick((t + float(draws.row_uniform[bi, hi, t])) / r_rows,
                                          q_real)
                        beta += x[i] ** 2
                    root = (beta * len(q_real) / r_rows).sqrt()
                    y = torch.cat([v_real, real_cols[:, None]], dim=1)  # [V 1] on real keys
                    p_v = (y.norm(dim=1) / torch.linalg.matrix_norm(y, ord=2) ** 2
                           + 1.0 / len(k_real)) * real_cols
                    p_v = p_v / p_v.sum()
                    p_norms = root / root.sum() if float(root.sum()) > 0 else p_v
                    p = cfg.mix_weight * p_norms + (1 - cfg.mix_weight) * p_v
                p = p / p.sum()
                u_cols = [float(u) for u in draws.column_uniform[bi, hi]]
                if cfg.sampler == "iid":
                    cols = _pick_columns(p, list(range(nk)), u_cols)
                else:
                    planes = draws.hyperplanes[bi, hi] if cfg.blocks > 0 else None
                    order = reference_key_order(k[bi, hi].detach(), planes, k_real)
                    cols = _pick_columns(p, order, [(t + u_cols[0]) / m for t in range(m)])
                pi = torch.zeros(m, nk, dtype=q.dtype)
                for r, col in enumerate(cols):
                    if float(p[col]) > 0 and bool(kv[bi, col]):
                        pi[r, col] = 1.0 / math.sqrt(m * float(p[col]))
            residual = a_res @ pi.T @ pi  # A_res Pi^T Pi  [Nq, Nk]
            approx = a_spar + residual
            d_tilde = approx.sum(1) if cfg.normalizer == "sampled" else alpha
            heads.append((approx @ v[bi, hi]) / d_tilde[:, None])
        rows.append(torch.stack(heads))
    return zero_padded_queries(torch.stack(rows), info.query_valid)
