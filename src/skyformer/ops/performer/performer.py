"""Performer: softmax attention through positive orthogonal random features (FAVOR+).

Choromanski et al., "Rethinking Attention with Performers" (ICLR 2021). With
q' = s^1/2 q, k' = s^1/2 k (s = 1/sqrt(D) unless ``scale`` is given), the softmax
kernel exp(q'.k') is estimated by phi(q').phi(k') with the positive random features
of Lemma 1, phi(x) = m^-1/2 exp(W x - |x|^2/2), W the m x D orthogonal random
features of Section 2.4 (``sketch.random_features``). Eq. (5)-(6): with
A^ = phi(Q') phi(K')^T,

    out = diag(A^ 1)^-1 A^ V = phi(Q') (phi(K')^T V) / phi(Q') (phi(K')^T 1),

in O(N m D) time and memory, never forming A^.

Stabilisation (the max-subtraction of the reference implementation, without its
coupling of batch elements): each query's log-features are shifted by their own
maximum (a per-row factor, cancels in the row normalisation); the keys' by the
maximum over the real keys and features of the same batch element and head (a
common factor, cancels too). The shifts are constants for autograd. Each row's sums
are scaled by the power of two that brings its normaliser near 1 (``rows_rescaled``,
exact); if a row's normaliser still underflows (below 2^-100) the row returns the mean
of the values (uniform attention) instead of 0/0. By default no additive epsilon biases
the features; ``eps > 0`` adds performer-pytorch's (phi~ + eps after its shifts:
max_f w_f.q' per query, max of w_f.k' over the keys and features of a batch element
and head), which pulls every row towards the mean of the values (README).

Causal attention (``causal=True``): out_i = sum_{j<=i} phi(q_i).phi(k_j) v_j / sum_{j<=i}
phi(q_i).phi(k_j) by chunked prefix sums (``causal.py``). The keys' shift above is a
maximum over *all* keys, so a future key would change past outputs (and which of them
underflow); a shift fixed in advance (a bound over every key) leaves ordinary keys'
features below float32's range at common head dims. Row i's sums are taken instead at
the running maximum of the keys' log-scales up to i: output i depends on no later
position, not even through rounding. Each row's sums are then scaled by a power of two
that brings its normaliser near 1 (``rows_rescaled``, exact). Rows whose normaliser
still underflows return the mean of the values of the keys j <= i.

Feature redraw: called as a function, the features come from ``projection`` or are
drawn from ``generator`` on every call. In ``MultiHeadAttention`` the layer keeps
them in a ``PerformerFeatures`` module (the registry's state hook) and redraws them
every ``feature_redraw_interval`` training calls, never in eval mode.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ...linalg import with_ones_column
from ...linalg.eager_calls import custom_op
from ...linalg.scores import logit_scale
from ...linalg.tracing import may_read_values
from ...registry import Capabilities, register
from ...sketch import gaussian_projection
from ...sketch.rng import fold_in, random_key
from ..shared.causal_prefix import (
    CAUSAL_CHUNK,
    by_blocks,
    chunk_length,
    prefix_mean_values,
    row_blocks,
)
from ..shared.inputs import (
    AttentionInputs,
    check_attention_inputs,
    compute_dtype,
    mean_values,
    recomputing,
    resolve_key,
    zero_padded_queries,
)
from ..shared.normalised import normalised_or, numerator_and_denominator
from ..shared.options import (
    check_bool,
    check_nonnegative_float,
    check_optional_positive_int,
    check_random_features,
    check_scale,
)
from ..shared.reduction import WHOLE, KeyReduction
from .causal import (
    KeyChunks,
    RunningSums,
    causal_rows,
    earlier_running_sums,
    joined_running_sums,
    key_chunks,
)
from .features import causal_key_logs, key_features, query_features, resolve_projection


@dataclass(frozen=True)
class PerformerConfig:
    """Options of Performer (FAVOR+); defaults are the published comparison settings.

    num_features: random features m (128 in the Skyformer and KDEformer comparisons).
    orthogonal: block-orthogonal features with chi-distributed norms (FAVOR+); False
        draws i.i.d. Gaussian rows.
    feature_redraw_interval: in ``MultiHeadAttention``, redraw the layer's features
        after this many training calls (1000, performer-pytorch's default; None =
        never). Called as a function, Performer draws fresh features each call
        unless a ``projection`` is passed.
    scale: softmax logit scale s, None = 1/sqrt(head dim).
    eps: additive stabiliser of performer-pytorch (1e-4 there): each feature is
        m^-1/2 (exp(w.x' - |x'|^2/2 - c) + eps) with c its shift. 0 (default) is
        unbiased FAVOR+; eps > 0 biases the output towards the mean of the values.
        As in performer-pytorch the shifts c are constants for autograd: at eps = 0 they
        cancel and the gradient is exact; with eps > 0 it is performer-pytorch's, not
        the exact gradient of the output (README.md of this folder).
    causal: query i attends to keys j <= i (requires Nq == Nk; module docstring).
    """

    num_features: int = 128
    orthogonal: bool = True
    feature_redraw_interval: int | None = 1000
    scale: float | None = None
    eps: float = 0.0
    causal: bool = False

    @property
    def inexact_gradient_because(self) -> str | None:
        """Why the backward is not the derivative of the output (``skyformer check``):
        with eps > 0 the shifts, constants for autograd, do not cancel (README.md)."""
        if self.eps == 0:
            return None
        return ("with eps > 0 its features' shifts, constants for autograd as in "
                "performer-pytorch, no longer cancel")

    def __post_init__(self) -> None:
        check_bool("performer", "causal", self.causal)
        check_random_features("performer", self.num_features)
        check_bool("performer", "orthogonal", self.orthogonal)
        check_optional_positive_int(
            "performer", "feature_redraw_interval", self.feature_redraw_interval
        )
        check_scale("performer", self.scale)
        check_nonnegative_float("performer", "eps", self.eps)


class PerformerFeatures(nn.Module):
    """Per-layer random features of Performer, redrawn during training.

    Built by the registry's state hook: ``MultiHeadAttention`` owns it and passes
    ``{"projection": ...}`` to ``performer_attention`` on every call. In training mode
    the features are redrawn once ``feature_redraw_interval`` calls have used them; in
    eval mode never. Each call is differentiated with the features it used, whatever is
    redrawn before its backward pass (a layer called twice before one); but a
    checkpointed call recomputed after such a redraw reads the new features, so its
    gradient is not that of its output (redraw then between steps, not within one).
    Redraw r draws from the random key ``fold_in(seed, r)``
    (``sketch/rng.py``), ``seed`` and ``redraws`` being buffers: every data-parallel
    process (and a resumed run) draws the same features, whatever else consumed the
    global random stream. ``seed`` itself is drawn at construction, as the first
    features are, from ``generator`` (a CPU generator) or else the global generator, so
    it follows the model's seed. Under ``torch.compile`` the redraw is
    made with tensor operations (the fresh features are computed every training call and
    kept only when due), so the compiled layer has no data-dependent branch. Under
    ``features_held`` calls use the features as they are, uncounted (the micro-batches of
    one optimizer step after its first); ``upcoming`` gives the features the next call
    will use, changing nothing (``MultiHeadAttention.attention_weights``).
    """

    holding = False  # set by ``features_held``: calls are neither counted nor redraw

    def __init__(self, config: PerformerConfig, num_heads: int, head_dim: int, *,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.config = config
        self.head_dim = head_dim
        # drawn on the CPU (the same numbers whatever the device), kept on the device
        # the layer is built on (``with torch.device(...)``) and in the default dtype,
        # as nn.Linear's weights are
        device = torch.get_default_device()
        projection, seed = self._first_draws(generator)
        self.register_buffer("projection",
                             projection.to(device=device, dtype=torch.get_default_dtype()))
        self.register_buffer("calls_since_redraw", torch.zeros((), dtype=torch.long))
        self.register_buffer("seed", seed.to(device))
        self.register_buffer("redraws", torch.zeros((), dtype=torch.long))

    def _first_draws(self, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
        """The first features ``[m, D]`` and the redraw seed ``[2]``, drawn on the CPU."""
        projection = gaussian_projection(self.config.num_features, self.head_dim,
                                         orthogonal=self.config.orthogonal, generator=generator)
        return projection, random_key(generator)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw the first features and the redraw seed again from torch's global
        generator and restart the counts, as a layer built now would: what a layer built
        on the meta device needs after ``to_empty`` (its buffers hold no values)."""
        projection, seed = self._first_draws(None)
        self.projection.copy_(projection)
        self.seed.copy_(seed)
        self.calls_since_redraw.zero_()
        self.redraws.zero_()

    def _features(self, generator: torch.Generator | Tensor) -> Tensor:
        fresh = gaussian_projection(
            self.config.num_features, self.head_dim, orthogonal=self.config.orthogonal,
            device=self.projection.device, generator=generator,
        )
        return fresh.to(self.projection.dtype)

    @torch.no_grad()
    def redraw(self, generator: torch.Generator | Tensor | None = None) -> None:
        """Draw new features now (from ``generator``, else the next redraw of the
        (seed, redraw count) stream) and restart the redraw counter."""
        if generator is None:
            self.redraws += 1
            generator = fold_in(self.seed, self.redraws)
        self.projection.copy_(self._features(generator))
        self.calls_since_redraw.zero_()

    def _count_call(self, interval: int) -> None:
        """Count a training call, redrawing first when ``interval`` calls have used the
        features (buffers written in place)."""
        if not may_read_values(self.calls_since_redraw):  # traced, meta or vmapped
            self._redraw_if_due(interval)
        elif recomputing():  # activation checkpointing runs the forward again:
            pass  # the features it used, uncounted (not redrawn under the gradient)
        else:
            if int(self.calls_since_redraw) >= interval:
                self.redraw()
            self.calls_since_redraw += 1

    @torch.no_grad()
    def _redraw_if_due(self, interval: int) -> None:
        """``redraw()`` when ``interval`` calls have used the features, then count this
        call, as the eager branch does, in tensor ops; an activation checkpointing
        recomputation neither redraws nor counts (read when the graph runs)."""
        counts = ~in_recomputation(self.calls_since_redraw)  # bool scalar
        due = (self.calls_since_redraw >= interval) & counts
        fresh = self._features(fold_in(self.seed, self.redraws + 1))
        self.projection.copy_(torch.where(due, fresh, self.projection))
        self.redraws.add_(due.long())
        self.calls_since_redraw.masked_fill_(due, 0)
        self.calls_since_redraw.add_(counts.long())

    @torch.no_grad()
    def upcoming(self, q: Tensor, k: Tensor) -> dict[str, Tensor]:
        """What the next call in this mode will use (``forward``'s result), drawn where a
        redraw is due but neither kept nor counted: a look at the weights of that call
        that leaves the training run as it was."""
        interval = self.config.feature_redraw_interval
        if self.training and interval is not None and not self.holding \
                and may_read_values(self.calls_since_redraw) \
                and int(self.calls_since_redraw) >= interval:  # (meta: nothing to draw)
            return {"projection": self._features(fold_in(self.seed, self.redraws + 1))}
        return {"projection": self.projection.clone()}

    def forward(self, q: Tensor, k: Tensor) -> dict[str, Tensor]:
        interval = self.config.feature_redraw_interval
        if self.training and interval is not None and not self.holding:
            try:
                self._count_call(interval)
            except RuntimeError as error:
                if "mutate a captured Tensor" not in str(error):
                    raise
                raise RuntimeError(_CAPTURED_BUFFERS) from error
        # a copy: a later redraw (a call's, or ``redraw()``) writes the buffer in place,
        # and this call's backward pass needs the features it used (a layer called twice
        # before one backward pass; [m, D], a few KiB)
        return {"projection": self.projection.clone()}

    def extra_repr(self) -> str:
        return (f"num_features={self.config.num_features}, head_dim={self.head_dim}, "
                f"feature_redraw_interval={self.config.feature_redraw_interval}")


@contextmanager
def features_held(model: nn.Module) -> Iterator[None]:
    """The Performer layers of ``model`` keep their features through the block and do
    not count its calls: for the micro-batches of one optimizer step after its first
    (gradient accumulation), so that ``feature_redraw_interval`` counts steps however a
    batch is split (one process with K micro-batches redraws where K processes do), and
    one step's gradient is that of one set of features."""
    layers = [m for m in model.modules() if isinstance(m, PerformerFeatures) and not m.holding]
    for layer in layers:
        layer.holding = True
    try:
        yield
    finally:
        for layer in layers:
            layer.holding = False


_CAPTURED_BUFFERS = (
    "performer: a layer in training mode (MultiHeadAttention, TorchMultiheadAttention, "
    "or one replace_attention swapped in) counts its calls and redraws its features in "
    "its buffers (method_state.calls_since_redraw, .projection), in place, which "
    "torch.func's grad, vjp, jvp, jacrev, jacfwd and hessian refuse for a buffer the "
    "transformed function captures. Either pass the buffers as an argument of the "
    "transformed function (torch.func.grad(lambda params, buffers: loss(functional_call("
    "model, (params, buffers), inputs)))(params, buffers), with loss reducing the model's "
    "output, a tuple for torch's layer, to a scalar: they count there as in eager "
    "calls), or build the layer with feature_redraw_interval=None and call "
    "layer.method_state.redraw() between steps, or call it in eval mode.")


@custom_op("skyformer::in_recomputation")
def in_recomputation(like: Tensor) -> Tensor:
    """``recomputing()`` as a bool scalar on ``like``'s device, read when a compiled
    graph runs (an operator opaque to the tracer), not once when it is traced: a
    compiled layer under activation checkpointing counted its recomputation as a call
    and could redraw inside it (another function's gradient)."""
    return torch.full((), recomputing(), dtype=torch.bool, device=like.device)  # meta too


@in_recomputation.register_fake
def _(like: Tensor) -> Tensor:
    return torch.empty((), dtype=torch.bool, device=like.device)


@register(
    "performer",
    PerformerConfig,
    Capabilities(target="softmax", randomized=True, causal=True, independent_queries=True,
                 weights=True),
    summary="positive orthogonal random features for the softmax kernel (Performer, FAVOR+)",
    state=PerformerFeatures,
)
def performer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: PerformerConfig,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | str | None = "auto",
    generator: torch.Generator | Tensor | None = None,
    projection: Tensor | None = None,
) -> Tensor:
    """Performer attention (FAVOR+, Choromanski et al. 2021, Lemma 1 and eqs. (5)-(6)).

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``.
        key_padding_mask: ``[B, Nk]`` bool, True = real token; padded keys get zero
            features, so they contribute nothing.
        generator: draws the random features when ``projection`` is None.
        config: the options (``PerformerConfig``); ``feature_redraw_interval`` is used
            by the layer's ``PerformerFeatures`` and ignored here.
        projection: fixed feature directions ``[num_features, D]`` (e.g. from
            ``skyformer.sketch.gaussian_projection``), shared by batch and heads.
    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``q`` (half types computed in float32);
        rows of padded queries (self-attention) are zero.
    """
    info = check_attention_inputs(q, k, v, key_padding_mask, method="performer",
                                  query_padding_mask=query_padding_mask)
    key = resolve_key("performer", generator, q.device, needed=projection is None)
    return performer_with_projection(q, k, v, projection, info, config, key)


def performer_with_projection(
    q: Tensor, k: Tensor, v: Tensor, projection: Tensor | None, info: AttentionInputs,
    config: PerformerConfig, key: Tensor | None, reduce: KeyReduction = WHOLE,
) -> Tensor:
    """Performer attention with the fixed feature directions ``projection`` or, where it
    is None, directions drawn from ``key``: computed in float32 for half types, returned
    in ``q``'s dtype (the body of ``performer_attention`` and of its sequence-parallel
    form, whose ``reduce`` completes the sums over the key shards). A fixed projection
    marks the rows its features leave non-finite (``marked_by_projection``)."""
    w = resolve_projection("performer", projection, config.num_features, info.head_dim,
                           config.orthogonal, q.device, key)
    work = compute_dtype(q.dtype)
    out = performer_from_projection(q.to(work), k.to(work), v.to(work), w.to(work), info,
                                    config, reduce)
    if projection is not None:
        out = marked_by_projection(out, w, info)
    return out.to(q.dtype)


def marked_by_projection(out: Tensor, projection: Tensor, info: AttentionInputs) -> Tensor:
    """``out`` with every real row NaN where a given ``projection`` holds a non-finite
    entry, which the normaliser's fallback to mean(V) would hide (padded query rows stay
    zero). The mark is detached."""
    return zero_padded_queries(out + projection.detach().sum() * 0, info.query_valid)


def rows_rescaled(o: Tensor) -> Tensor:
    """``o = [numerator, denominator]`` ``[..., Dv + 1]`` with each row multiplied by the
    power of two that brings its denominator into [0.5, 1), where that denominator is at
    least 2^-100 (other rows as they are): a query whose features are small where the
    top keys' are large has sums far below 1, under ``normalised_or``'s float32
    threshold (~1e-19), though they hold every digit. A power of two scales exactly, so the
    quotient is unchanged; the scale is detached (the quotient does not depend on it)."""
    denominator = o[..., -1:].detach()
    _, exponent = torch.frexp(denominator)
    exponent = torch.where(denominator >= 2.0 ** -100, exponent, 0).to(o.dtype)
    return torch.ldexp(o, -exponent)  # a float exponent: pow(2, -int) is 0 in integers


def causal_performer(qs: Tensor, ks: Tensor, v: Tensor, projection: Tensor,
                     key_valid: Tensor | None, eps: float, reduce: KeyReduction = WHOLE
                     ) -> Tensor:
    """Causal Performer (``causal.py``) of the scaled rows ``qs, ks: [B, H, N, D]``,
    ``v: [B, H, N, Dv]``: ``[B, H, N, Dv]``, padded query rows not zeroed. Where the
    keys are a shard, ``reduce`` gives the earlier shards' running sums (sequence
    parallel). A call that records no gradient runs by blocks of rows
    (``causal_prefix.by_blocks``), each from the running sums of the keys before it;
    a shard's blocks first take the sums it offers to later shards block by block
    (its keys' features computed twice: the memory of one block, not of the shard)."""
    n = qs.shape[2]
    if not by_blocks(n, qs, ks, v, projection):
        return _causal_rows(qs, ks, v, projection, key_valid, eps, reduce)[0]
    blocks = [(rows, None if key_valid is None else key_valid[:, rows])
              for rows in row_blocks(n)]
    start = None
    if reduce.sharded:
        totals = [_keys(ks[:, :, rows], v[:, :, rows], projection, valid, eps).totals()
                  for rows, valid in blocks]
        start = earlier_running_sums(joined_running_sums(totals), reduce)
    outs = []
    for rows, valid in blocks:
        out, start = _causal_rows(qs[:, :, rows], ks[:, :, rows], v[:, :, rows], projection,
                                  valid, eps, WHOLE, start)
        outs.append(out)
    return torch.cat(outs, dim=2)


def _keys(ks: Tensor, v: Tensor, projection: Tensor, key_valid: Tensor | None, eps: float
          ) -> KeyChunks:
    """These keys' features and values by chunks (``causal.key_chunks``)."""
    log_k, scale_basis = causal_key_logs(ks, projection, eps)
    return key_chunks(log_k, scale_basis, with_ones_column(v), key_valid,
                      chunk_length(ks.shape[2], CAUSAL_CHUNK))


def _causal_rows(qs: Tensor, ks: Tensor, v: Tensor, projection: Tensor,
                 key_valid: Tensor | None, eps: float, reduce: KeyReduction,
                 start: RunningSums | None = None) -> tuple[Tensor, RunningSums]:
    """``causal_performer`` of these rows after the keys of ``start`` (or of the earlier
    shards, ``reduce``), and the running sums after them."""
    phi_q, _ = query_features(qs, projection, eps)  # [B, H, N, m]
    keys = _keys(ks, v, projection, key_valid, eps)
    if reduce.sharded:  # from this shard's chunk sums: each key's features taken once
        start = earlier_running_sums(keys.totals(), reduce)
    o, after = causal_rows(phi_q, keys, eps, start)  # [B, H, N, Dv + 1]
    numerator, denominator = numerator_and_denominator(rows_rescaled(o))
    fallback = prefix_mean_values(v, key_valid, None if start is None else start.plain)
    return normalised_or(numerator, denominator, fallback), after


def performer_from_projection(
    q: Tensor, k: Tensor, v: Tensor, projection: Tensor, info: AttentionInputs,
    config: PerformerConfig, reduce: KeyReduction = WHOLE,
) -> Tensor:
    """phi(Q') (phi(K')^T V) / phi(Q') (phi(K')^T 1) (eqs. (5)-(6)) given the feature
    directions ``projection: [m, D]``, in the inputs' dtype.

    ``q: [B, H, Nq, D]``, ``k: [B, H, Nk, D]``, ``v: [B, H, Nk, Dv]``; ``reduce``
    completes the sums (m x (Dv + 1)) and the keys' shift when the keys are a shard
    (``shared/reduction.py``). Returns ``[B, H, Nq, Dv]``.
    """
    s = logit_scale(info.head_dim, config.scale)
    root = math.sqrt(s)
    if config.causal:
        if info.query_len != info.key_len:
            raise ValueError(f"performer: causal=True needs as many queries as keys, got "
                             f"Nq={info.query_len}, Nk={info.key_len}.")
        out = causal_performer(q * root, k * root, v, projection, info.key_valid,
                               config.eps, reduce)
        return zero_padded_queries(out, info.query_valid)
    phi_q, _ = query_features(q * root, projection, config.eps)  # [B, H, Nq, m]
    phi_k, _ = key_features(k * root, projection, info.key_valid, config.eps,
                            reduce)  # [B, H, Nk, m]
    v_and_one = with_ones_column(v)  # [B, H, Nk, Dv + 1]
    o = phi_q @ reduce.sum(phi_k.transpose(-1, -2) @ v_and_one)  # [B, H, Nq, Dv + 1]
    numerator, denominator = numerator_and_denominator(rows_rescaled(o))
    out = normalised_or(numerator, denominator, mean_values(v, info.key_valid, reduce))
    return zero_padded_queries(out, info.query_valid)
