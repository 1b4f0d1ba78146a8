"""Causal modified Nystrom: landmarks revealed in order, nested cores from one Cholesky.

Shared by ``skyformer`` and ``nystrom_softmax`` with ``causal=True``; the derivation is
in ``ops/skyformer/README.md`` ("Causal"). In short:

- Landmark slot s sits at the real token of rank r_s = s R + floor(u_s R) (R = the
  landmark stride, by default ceil(n_b / m) for the n_b real tokens of the batch
  element, u_s a counter-based uniform draw of the batch element and slot): its
  position depends on the generator, on which earlier tokens are real and on R, never
  on the content. R's default counts every real token of the sequence, later ones
  too: for outputs that no later token can move (decoding, a prefix run alone), give
  ``landmark_stride``. Even slots take that token's query row, odd
  slots its key row (half from each, as Skyformer's [Q; K] sampling). Slots are in
  the order they become available; a slot past the sequence holds no landmark.
- Query i uses the slots at positions <= i. The core of that nested set is the
  ridge inverse (M_k + gamma I)^-1 of the leading k x k block of M = C(X_S, X_S). With
  M + gamma I = L L^T (one Cholesky, slots in order), the leading block of L is the
  Cholesky factor of the leading block of M + gamma I, so with phi(y) = L^-1 C(X_S, y)
  (lower-triangular L^-1: entry s depends on slots <= s only)

      C(q_i, X_k) (M_k + gamma I)^-1 C(X_k, k_j) = sum_{s <= k} phi_s(q_i) phi_s(k_j),

  and the m nested cores cost one O(m^3) factorisation instead of one per set.
- Then the far past is a feature-map attention with features phi (the query's masked to
  its available slots), evaluated by the chunked prefix sums of ``causal_prefix.py``
  ([m, Dv] states), and the keys of the query's own chunk are exact (``local``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ...linalg import gaussian_kernel_block, gaussian_kernel_matmul, half_sq_norm
from ...linalg.flush import flush_on_cpu
from ...linalg.nystrom import check_ridge_in_range, warn_of_a_ridge_below_rounding
from ...linalg.rows import gather_rows_through
from ...sketch.landmarks import launch_or_fall_back, use_triton_draw
from ...sketch.rng import fold_in, stream, uniform_at
from .inputs import AttentionInputs, check_attention_inputs, resolve_key, zero_padded_queries
from .options import (
    MAX_BUDGET,
    check_bool,
    check_nonnegative_float,
    check_optional_positive_int,
)
from .real_first import RealFirst, from_real_first, real_first, real_first_mask, to_real_first


@dataclass(frozen=True)
class CausalNystromOptions:
    """Causal options of the modified Nystrom methods (``causal_nystrom.py``).

    causal: query i attends to keys j <= i, with no dependence on any later token
        (requires Nq == Nk; ``ops/skyformer/README.md``).
    causal_local: with ``causal``, the keys of the query's own chunk of 64 real tokens
        are attended exactly and only earlier chunks through the landmarks (False: all
        through the landmarks).
    landmark_stride: with ``causal``, one landmark slot per this many real tokens;
        None = ceil(n / num_features) for each sequence's n real tokens, spreading the
        landmarks over it. Fix it for outputs that do not depend on the sequence length
        (decoding).
    """

    causal: bool = False
    causal_local: bool = True
    landmark_stride: int | None = None

    def validate_causal(self, method: str) -> None:
        """Checked before the inverse's options: a causal call with gamma = 0 is told what
        the causal form needs, not the non-causal form's ways to gamma = 0."""
        check_bool(method, "causal", self.causal)
        check_bool(method, "causal_local", self.causal_local)
        check_optional_positive_int(method, "landmark_stride", self.landmark_stride)
        if self.landmark_stride is not None and self.landmark_stride > MAX_STRIDE:
            raise ValueError(
                f"{method}: landmark_stride must be at most 2^32 (a slot's position, slot "
                f"* landmark_stride, must stay in int64; a stride longer than the sequence "
                f"leaves at most its first slot a landmark), got {self.landmark_stride!r}.")
        gamma = getattr(self, "gamma", 1.0)
        if self.causal:
            check_nonnegative_float(method, "gamma", gamma)
        if self.causal and gamma <= 0:
            raise ValueError(f"{method}: causal=True needs gamma > 0 (its core factorises "
                             f"C(X_S, X_S) + gamma I by Cholesky), got {gamma!r}.")
        m = getattr(self, "num_features", None)
        if self.causal and isinstance(m, int) and m > MAX_BUDGET:
            raise ValueError(
                f"{method}: with causal=True num_features must be at most {MAX_BUDGET} (a "
                f"landmark slot is drawn for each, whatever the sequence's length; without "
                f"causal the rows of the sequence cap it), got {m!r}.")


# The largest landmark_stride: slot s's rank s R + floor(u R) stays exact in int64 and
# float64 for every slot (at most MAX_BUDGET of them)
MAX_STRIDE = 2**32

# The options that shape the causal form only, with their defaults
CAUSAL_FORM_DEFAULTS = {f.name: f.default for f in dataclasses.fields(CausalNystromOptions)
                        if f.name != "causal"}


def refuse_causal_form_options(method: str, config: CausalNystromOptions,
                               way_out: str | None = "pass causal=True",
                               not_causal: str = "this call is not causal") -> None:
    """A non-causal call given options of the causal form only (which it would ignore:
    the output would equal the default's without a word) is refused in a sentence.
    Checked when the call runs, not in the config: a Hugging Face decoder's layers keep
    causal=False in their options and take causal from the model's mask at each call.
    ``way_out``: the sentence's other fix, after "leave it out" (``None``: none);
    ``not_causal``: what is not causal (``skyformer.hf``: the layers set)."""
    given = [f"{name}={getattr(config, name)!r}" for name, default in
             CAUSAL_FORM_DEFAULTS.items() if getattr(config, name) != default]
    if given:
        raise ValueError(
            f"{method}: {' and '.join(given)} shape{'' if len(given) > 1 else 's'} causal "
            f"attention only (causal=True); {not_causal}, where "
            f"{'they change' if len(given) > 1 else 'it changes'} nothing: leave "
            f"{'them' if len(given) > 1 else 'it'} out"
            + (f", or {way_out}." if way_out else "."))


def refuse_causal_in_materialised(method: str, config: CausalNystromOptions) -> None:
    """``materialised_<method>_attention`` forms the non-causal form's blocks whole (the
    path the fused one is tested against): ``causal=True``, which it would ignore (every
    row seeing later keys), and the causal form's options are refused in a sentence."""
    if config.causal:
        raise ValueError(
            f"materialised_{method}_attention has no causal form (it forms the two-way "
            f"blocks whole): use {method}_attention(..., causal=True).")
    refuse_causal_form_options(method, config,
                               way_out=f"use {method}_attention(..., causal=True)")


@dataclass(frozen=True)
class CausalLandmarks:
    """Landmark slots in order of availability."""

    position: Tensor  # [B, m] long; slots holding no landmark point at position 0
    live: Tensor  # [B, m] bool
    from_query: Tensor  # [m] bool: the slot takes the token's query row (else key row)

    def available(self, n: int) -> Tensor:
        """``[B, 1, N, m]`` bool: slot s may serve query i (live and at a position <= i)."""
        i = torch.arange(n, device=self.position.device)
        return (self.live[:, None, :] & (self.position[:, None, :] <= i[:, None]))[:, None]


def landmark_stride(stride: int | None, n: int, m: int, key_valid: Tensor | None = None
                    ) -> int | Tensor:
    """R: ``stride`` if given, else ceil(n_b / m) for each batch element's number of real
    tokens n_b (a ``[B]`` long tensor; ``n`` for all without ``key_valid``), at least 1:
    the landmarks spread over each sequence's own tokens, so that its outputs do not
    depend on how far the batch is padded."""
    if stride is not None:
        return stride
    if key_valid is None:
        return max(1, math.ceil(n / m))
    return ((key_valid.sum(1) + (m - 1)) // m).clamp_min(1)


CAUSAL_STREAM = "landmarks/causal"


def slot_ranks(num_features: int, stride: int | Tensor, *, batch: int, device: torch.device,
               key: Tensor, draw: str = "auto") -> Tensor:
    """``[B, m]`` long: slot s takes the real token of rank s R + floor(u_s R), increasing
    in s (at most one slot per token); a function of the key and R alone, never of the
    content. ``stride`` R: an int, or a ``[B]`` long tensor of one per batch element
    (``landmark_stride``). ``draw``: PyTorch operations or one Triton kernel, the same
    ranks (``sketch.landmarks.use_triton_draw``)."""
    if use_triton_draw(draw, key):
        from ...sketch import triton_draws

        return launch_or_fall_back(
            draw, lambda: triton_draws.slot_ranks(key.to(device), CAUSAL_STREAM, batch,
                                                  num_features, stride),
            lambda: slot_ranks(num_features, stride, batch=batch, device=device, key=key,
                               draw="torch"), on=key)
    keys = fold_in(stream(key, CAUSAL_STREAM), torch.arange(batch, device=device))
    slot = torch.arange(num_features, device=device)
    u = uniform_at(keys[:, None, :], slot.expand(batch, num_features), torch.float64)
    if isinstance(stride, Tensor):
        stride = stride.to(device)[:, None]  # [B, 1]
    return slot * stride + (u * stride).floor().long()


def slot_takes_query(num_features: int, device: torch.device) -> Tensor:
    """``[m]`` bool: even slots take the token's query row, odd slots its key row."""
    return torch.arange(num_features, device=device) % 2 == 0


def causal_landmarks(num_features: int, stride: int | Tensor, *, batch: int, n: int,
                     key_valid: Tensor | None, device: torch.device, key: Tensor,
                     draw: str = "auto") -> CausalLandmarks:
    """Slot s at the real token of rank s R + floor(u_s R) (module docstring)."""
    rank = slot_ranks(num_features, stride, batch=batch, device=device, key=key, draw=draw)
    if key_valid is None:
        position = rank
    else:  # the first position holding rank + 1 real tokens
        position = torch.searchsorted(key_valid.long().cumsum(1), rank + 1)
    live = position < n
    return CausalLandmarks(torch.where(live, position, 0), live,
                           slot_takes_query(num_features, device))


def draw_causal_landmarks(info: AttentionInputs, num_features: int, stride: int | None,
                          device: torch.device, key: Tensor, draw: str = "auto"
                          ) -> CausalLandmarks:
    """The landmark slots of one call (``causal_nystrom.causal_landmarks``). With a query
    mask of its own, a query-row slot at a padded query holds no landmark: padded
    queries take no part in what is computed from the set of queries
    (``shared/inputs.py``; their rows, zeroed, put a landmark at the origin)."""
    marks = causal_landmarks(
        num_features, landmark_stride(stride, info.key_len, num_features, info.key_valid),
        batch=info.batch, n=info.key_len, key_valid=info.key_valid, device=device, key=key,
        draw=draw)
    if info.query_valid is None or info.query_valid is info.key_valid:
        return marks
    real = info.query_valid.gather(1, marks.position) | ~marks.from_query  # [B, m]
    live = marks.live & real
    return CausalLandmarks(torch.where(live, marks.position, 0), live, marks.from_query)


def causal_inputs(method: str, q: Tensor, k: Tensor, v: Tensor, num_features: int,
                  stride: int | None, key_padding_mask: Tensor | None,
                  query_padding_mask: Tensor | str | None,
                  generator: torch.Generator | Tensor | None, draw: str = "auto",
                  ) -> tuple[Tensor, Tensor, Tensor, AttentionInputs, CausalLandmarks,
                             RealFirst | None]:
    """Checks of a causal call (``Nq == Nk``) for ``method`` and what it runs on:
    ``(q, k, v, info, landmarks, order)`` (``draw``: the method's ``kernel`` option,
    ``slot_ranks``). With padding that the queries share, the call runs on the real
    tokens gathered to the front (``order``, ``real_first``; None: on the positions as
    they are), so that its chunks hold ranks among the real tokens (the exact local
    part, and with ``causal_local`` off the order of the sums and nystrom_softmax's
    bound of unreliable rows, which the decoding states take by rank): left padding
    and holes then give the packed sequence's outputs. The returned tensors, inputs
    and landmarks are the gathered ones; ``causal_outputs`` puts the outputs back."""
    info = check_attention_inputs(q, k, v, key_padding_mask, method=method,
                                  query_padding_mask=query_padding_mask)
    if info.query_len != info.key_len:
        raise ValueError(f"{method}: causal=True needs as many queries as keys, got "
                         f"Nq={info.query_len}, Nk={info.key_len}.")
    key = resolve_key(method, generator, q.device)
    order = None
    if info.key_valid is not None and info.query_valid is info.key_valid:
        order = real_first(info.key_valid)
        packed = real_first_mask(info.key_valid, order)
        info = dataclasses.replace(info, key_valid=packed, query_valid=packed)
        q, k, v = (to_real_first(t, order) for t in (q, k, v))
    landmarks = draw_causal_landmarks(info, num_features, stride, q.device, key, draw)
    return q, k, v, info, landmarks, order


def causal_outputs(out: Tensor, info: AttentionInputs, order: RealFirst | None) -> Tensor:
    """The outputs of a causal call back at their positions (``order`` from
    ``causal_inputs``), padded query rows zero: ``[B, H, N, Dv]``."""
    return from_real_first(zero_padded_queries(out, info.query_valid), order)


@dataclass(frozen=True)
class CausalCore:
    """Landmark rows, their half norms (+inf for dead slots) and L^-1 (module docstring)."""

    x: Tensor  # [B, H, m, D] scaled landmark rows
    x_norm: Tensor  # [B, H, m]
    l_inv: Tensor  # [B, H, m, m] lower triangular, L L^T = C(X, X) + gamma I
    failed: Tensor  # [B, H, m] bool: slots from a failed pivot on (decoupled; see below)


def uses_failed(available: Tensor, failed: Tensor) -> Tensor:
    """``[B, H, N]`` bool: the queries that may use a failed slot (``available``:
    ``[B, 1|H, N, m]``, ``failed``: ``CausalCore.failed``); their outputs are NaN, the
    others' exact (the forward's and the decoding states')."""
    return (available & failed[:, :, None, :]).any(-1)


def causal_core(q: Tensor, k: Tensor, scale: float, gamma: float,
                landmarks: CausalLandmarks) -> tuple[Tensor, Tensor, CausalCore]:
    """(q, k, core): X_S from the rows of ``q``/``k`` ``[B, H, N, D]`` at the slots'
    positions, scaled by ``scale``; L^-1 of C(X_S, X_S) + gamma I (dead slots: unit
    diagonal, decoupled). The caller reads the q and k returned here: the gradient of
    the landmark rows joins theirs in one ``index_add`` a side
    (``linalg.rows.gather_rows_through``), not through a zero tensor of their size and
    an addition each; in place, so the callers must read q and k only through
    operations whose backward gives a new tensor (they scale them) or several of them."""
    b, h, m = q.shape[0], q.shape[1], landmarks.position.shape[-1]
    index = landmarks.position[:, None, :].expand(b, h, -1)
    (q, k), rows = gather_rows_through((q, k), (index, index), in_place=True)  # [B, H, 2m, D]
    x = torch.where(landmarks.from_query[:, None], rows[..., :m, :],
                    rows[..., m:, :]) * scale  # [B, H, m, D]
    return q, k, core_of_rows(x, landmarks.live, gamma)


def core_of_rows(x: Tensor, live: Tensor, gamma: float) -> CausalCore:
    """The core of scaled landmark rows ``x: [B, H, m, D]`` of which ``live: [B, m]``
    hold a landmark: L^-1 of C(X, X) + gamma I with the other slots decoupled (unit
    diagonal, +inf half norms). The leading block of L^-1 depends on the leading slots
    only, so revealing a later slot leaves it unchanged. A ``gamma`` below what x's
    dtype resolves is warned of, as the non-causal cores do (the queries of a failed
    pivot are NaN, below)."""
    check_ridge_in_range(gamma, x.dtype)
    warn_of_a_ridge_below_rounding(gamma, x.shape[-2], x.dtype)
    x_norm = torch.where(live[:, None, :], half_sq_norm(x), float("inf"))  # [B, H, m]
    # gamma in x's dtype: where() of two Python numbers gives the default dtype, whose
    # rounding of gamma (0.1 -> 0.100000001 in float32) a float64 call would carry
    ridge = torch.where(live, torch.full((), gamma, dtype=x.dtype, device=x.device),
                        1.0)  # [B, m]
    gram = gaussian_kernel_block(x, x, x_norm, x_norm) + torch.diag_embed(ridge)[:, None]
    # PD for gamma > 0 unless rounding says otherwise (float32, tiny gamma, near-equal
    # landmarks). Unchecked (no host wait): the slots from the first failed pivot on are
    # flagged and decoupled, and the rest factorised again, so the leading block stays
    # exact and the queries that use a flagged slot are the callers' to mark (NaN); the
    # second factorisation is the first where none fails
    m = gram.shape[-1]
    pivot = torch.linalg.cholesky_ex(gram).info[..., None]  # [B, H, 1]: 0 = none failed
    failed = (pivot > 0) & (torch.arange(m, device=x.device) >= pivot - 1)  # [B, H, m]
    kept = ~failed
    gram = torch.where(kept[..., :, None] & kept[..., None, :], gram, 0.0) \
        + torch.diag_embed(failed.to(x.dtype))
    chol = torch.linalg.cholesky_ex(gram).L
    eye = torch.eye(m, dtype=x.dtype, device=x.device).expand_as(gram)
    l_inv = flush_on_cpu(torch.linalg.solve_triangular(chol, eye, upper=False))
    return CausalCore(x, x_norm, l_inv, failed)


def nystrom_features(kernel: Tensor, core: CausalCore) -> Tensor:
    """phi = L^-1 C(X_S, y) for each row: ``[B, H, N, m]`` kernel columns -> ``[B, H, N, m]``
    (``kernel`` and ``core.l_inv`` are flushed on the CPU, ``linalg.flush``, so the
    product has no subnormal operand). The columns of failed slots are zeros: a
    landmark row holding NaN or inf (a non-finite token at a later slot's position)
    gave every feature 0 x NaN, earlier slots' included, and the outputs before that
    token NaN; the rows that may use a failed slot are NaN anyway (``uses_failed``)."""
    kernel = torch.where(core.failed[:, :, None, :], 0.0, kernel)
    return kernel @ core.l_inv.transpose(-1, -2)


def gaussian_features(y: Tensor, core: CausalCore, *, row_valid: Tensor | None = None,
                      row_offset: Tensor | None = None, row_norm: bool = True,
                      kernel: str = "auto") -> Tensor:
    """phi = L^-1 C(X_S, y) of scaled rows ``y: [B, H, N, D]``, ``[B, H, N, m]``:
    ``nystrom_features`` of the Gaussian block C(y, X_S) = exp(y x_s - |y|^2/2 - |x_s|^2/2),
    as one product C (L^-1)^T (``linalg.gaussian_kernel_matmul``), so that the ``[N, m]``
    block is not held for the backward pass, which rebuilds it (on CUDA the fused Triton
    kernels, ``kernel``, never hold it; the PyTorch path keeps it only where it fits in
    one of its chunks of rows, ``kernel_matmul.chunk_rows``). Rows where ``row_valid``
    (``[B, N]``) is False are zeros; ``row_offset`` (``[B, H, N]``, constants) r_i
    replaces |y_i|^2/2 where ``row_norm`` is False, or is subtracted beside it; failed
    slots' columns are zeros, their rows of X_S read as zeros so that a non-finite
    landmark row reaches no other feature (``nystrom_features``)."""
    x = torch.where(core.failed[..., None], 0.0, core.x)
    offsets = torch.where(core.failed, float("inf"), core.x_norm)  # [B, H, m]
    return gaussian_kernel_matmul(
        y, x, core.l_inv.transpose(-1, -2), offsets, row_norm=row_norm,
        row_valid=None if row_valid is None else row_valid[:, None, :],
        row_offset=row_offset, kernel=kernel)
