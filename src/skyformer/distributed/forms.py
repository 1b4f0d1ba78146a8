"""The methods that run sequence parallel, each as its single-process evaluation with
the sums over keys completed across ranks, and why the others cannot.

A method runs sequence parallel with N-independent communication when the keys enter
only through sums of a size independent of N (plus constants):

- ``skyformer``, ``nystrom_softmax``: m landmark rows (m x D), C(X_S, K) V (m x Dv;
  m x (Dv + 1) with the softmax normaliser), the keys' shift (B x H) and mean(V) (Dv + 1),
  Skyformer eqs. (5)-(6); the m x m core W is computed on every rank.
- ``linear``: phi(K)^T [V, 1] (D x (Dv + 1)), Katharopoulos et al. eq. (6).
- ``performer``: phi(K)^T [V, 1] (m x (Dv + 1)), the keys' shift and mean(V), Performer
  eqs. (5)-(6); the features come from the generator (or the layer), alike on every rank.

With ``causal=True``, ``linear`` and ``performer`` take the same sums from the ranks
before this one only (each rank's shard sums gathered, P times their size): the state
of their prefix sums where the shard starts (Katharopoulos et al. eqs. (8)-(9);
Performer's at the largest of the earlier ranks' key scales,
``ops/performer/causal.py``). ``skyformer`` gathers its landmark rows, the tails of
the chunks that cross into a rank and the earlier chunks' sums (``causal_shard.py``);
``nystrom_softmax`` the same, its sums at the largest of the earlier ranks' shifts
(``causal_nystrom_softmax.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ..linalg import kernel_scale, logit_scale
from ..ops.linear.linear import causal_linear, linear_features, linear_from_features
from ..ops.nystrom_softmax.nystrom_softmax import (
    FLOAT32_REACH,
    float32_reach,
    nystrom_softmax_from_core,
)
from ..ops.performer.performer import performer_with_projection
from ..ops.shared.causal_nystrom import refuse_causal_form_options
from ..ops.shared.inputs import AttentionInputs, compute_dtype, zero_padded_queries
from ..ops.shared.modified_nystrom import NystromCore, NystromOptions, core_from_rows
from ..ops.skyformer.skyformer import skyformer_from_core
from ..registry import get_method
from .causal_nystrom_softmax import causal_nystrom_softmax_shard
from .causal_skyformer import causal_skyformer_shard
from .landmarks import draw_landmarks, landmark_rows
from .layout import ShardLayout
from .reduction import GroupReduction


def _nystrom_core(q: Tensor, k: Tensor, scale: float, config: NystromOptions,
                  info: AttentionInputs, layout: ShardLayout) -> NystromCore:
    """Landmarks of the whole sequence, their rows shared, W computed here."""
    landmarks, q_local, k_local = draw_landmarks(
        config.num_features, layout, info.key_valid, info.batch, info.key_len,
        draw=config.kernel)
    return core_from_rows(landmark_rows(q, k, q_local, k_local, scale, layout), config, landmarks)


def _skyformer(q: Tensor, k: Tensor, v: Tensor, config: Any, info: AttentionInputs,
               layout: ShardLayout, reduce: GroupReduction) -> Tensor:
    if config.causal:
        return causal_skyformer_shard(q, k, v, config, info, layout, reduce)
    work = compute_dtype(q.dtype)
    qw, kw, vw = q.to(work), k.to(work), v.to(work)
    scale = kernel_scale(info.head_dim, config.scale)
    core = _nystrom_core(qw, kw, scale, config, info, layout)
    return skyformer_from_core(qw, kw, vw, core, info, scale, reduce,
                               kernel=config.kernel).to(q.dtype)


def _nystrom_softmax(q: Tensor, k: Tensor, v: Tensor, config: Any, info: AttentionInputs,
                     layout: ShardLayout, reduce: GroupReduction) -> Tensor:
    # as one process: in float64 where float32 would lose the Gaussian entries, decided
    # on the largest norm of every rank's rows (each rank makes the same call)
    reach = float32_reach(q, k, config)
    if reach is not None and bool(reduce.max(reach.reshape(1)) > FLOAT32_REACH):
        return _nystrom_softmax(q.double(), k.double(), v.double(), config, info, layout,
                                reduce).to(q.dtype)
    if config.causal:
        return causal_nystrom_softmax_shard(q, k, v, config, info, layout, reduce)
    work = compute_dtype(q.dtype)
    qw, kw, vw = q.to(work), k.to(work), v.to(work)
    root = math.sqrt(logit_scale(info.head_dim, config.scale))
    core = _nystrom_core(qw, kw, root, config, info, layout)
    return nystrom_softmax_from_core(qw, kw, vw, core, info, root, config, reduce).to(q.dtype)


def _linear(q: Tensor, k: Tensor, v: Tensor, config: Any, info: AttentionInputs,
            layout: ShardLayout, reduce: GroupReduction) -> Tensor:
    phi_q, phi_k, vw = linear_features(q, k, v, info.key_valid)
    if config.causal:  # the earlier shards' sums added to every row
        out = causal_linear(phi_q, phi_k, vw, config.eps, reduce=reduce)
        return zero_padded_queries(out, info.query_valid).to(q.dtype)
    return linear_from_features(phi_q, phi_k, vw, info, config.eps, reduce).to(q.dtype)


def _performer(q: Tensor, k: Tensor, v: Tensor, config: Any, info: AttentionInputs,
               layout: ShardLayout, reduce: GroupReduction, projection: Tensor | None = None
               ) -> Tensor:
    # a layer's projection is alike on every rank, as are draws from the layout's key
    return performer_with_projection(q, k, v, projection, info, config, layout.key, reduce)


def _causal_options_when_causal(method: str) -> Callable[[Any], None]:
    def check(config: Any) -> None:
        if not config.causal:  # as a call on one process does
            refuse_causal_form_options(method, config)
    return check


@dataclass(frozen=True)
class Form:
    """``run(q, k, v, config, info, layout, reduce, **state_arguments)``; ``check(config)``
    raises a sentence for options the form cannot run (before any collective)."""

    run: Callable[..., Tensor]
    check: Callable[[Any], None] = lambda config: None


FORMS = {
    "skyformer": Form(_skyformer, _causal_options_when_causal("skyformer")),
    "nystrom_softmax": Form(_nystrom_softmax, _causal_options_when_causal("nystrom_softmax")),
    "linear": Form(_linear),
    "performer": Form(_performer),
}

_WHY_NOT = {
    "softmax": "exact attention needs every key for every query (ring attention moves "
               "K and V around all ranks, traffic that grows with N)",
    "kernelized": "exact attention needs every key for every query (ring attention moves "
                  "K and V around all ranks, traffic that grows with N)",
    "nystromformer": "its landmarks are segment means over the whole sequence",
    "skyformer_adaptive": "its landmarks are cluster centres of the whole [Q; K]",
    "linformer": "its projections span the fixed full length; E^T K is a sum over "
                 "positions, so it could, but that form is not written",
}


def form_of(method: str) -> Form:
    """The sequence-parallel form of ``method`` (a variant's: its method's), or a sentence
    saying why there is none (for a name that is no method, the registry's sentence
    listing the methods)."""
    base = get_method(method).base_name
    if base in FORMS:
        return FORMS[base]
    if not getattr(get_method(base).core, "__module__", "").startswith("skyformer."):
        reason = "it is registered from outside the library, which has no sequence-parallel " \
                 "form of it"
    else:
        reason = _WHY_NOT.get(base, "its keys enter through more than sums of a size "
                              "independent of N (sparse patterns, hashing or clustering "
                              "need the other shards' keys themselves)")
    raise ValueError(f"{method} cannot run sequence parallel: {reason}; methods that can: "
                     f"{', '.join(FORMS)}.")
