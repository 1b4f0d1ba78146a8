"""Decoding by prefix sums: ``linear`` and ``performer``, whose causal weights factor as
a_ij = phi(q_i) . psi(k_j) (Katharopoulos et al. 2020, eqs. (8)-(10): attention as an RNN).

The state is S = sum_{j < t} psi(k_j) [v_j, 1]^T (``[B, H, m, Dv + 1]``) plus, for the
fallback rows of Performer, the sum and count of the real values: constant in the length.
New positions get phi(q_i) . S plus their own lower-triangular block
(``ops/shared/causal_prefix.py``), exactly the chunked causal forward's sums. Performer's
S is held at the running maximum of the keys' log-scales (with that maximum and the plain
sum of [v_j, 1] for ``eps``), as its causal forward takes it (``ops/performer/causal.py``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..linalg.scores import logit_scale
from ..ops.linear.linear import elu_feature_map, linear_normalised
from ..ops.performer.causal import RunningSums, causal_performer_sums, running_sums
from ..ops.performer.features import causal_key_logs, query_features, resolve_projection
from ..ops.performer.performer import rows_rescaled
from ..ops.shared.causal_prefix import causal_feature_sums
from ..ops.shared.inputs import compute_dtype, zero_padded_queries
from ..ops.shared.normalised import normalised_or, numerator_and_denominator
from ..registry import BoundMethod
from .state import DecodingState, padding_as_false


class PrefixSumDecoding(DecodingState):
    """What the feature-map methods share: the method bound causal, the sums S and the
    [v, 1] rows they sum."""

    batched: tuple[str, ...] = ("sums",)

    def __init__(self, bound: BoundMethod, generator: torch.Generator | Tensor | None = None
                 ) -> None:
        super().__init__(bound.name, generator)
        self.bound = bound.replace(causal=True)
        self.sums: Tensor | None = None  # [B, H, m, Dv + 1]

    @staticmethod
    def _values(v: Tensor, key_valid: Tensor | None) -> tuple[Tensor, Tensor]:
        """V in the compute dtype with padded rows zeroed, and the ``[B, 1, n, 1]`` weights."""
        vw = v.to(compute_dtype(v.dtype))
        w = padding_as_false(key_valid, v)[:, None, :, None]
        return torch.where(w, vw, 0.0), w.to(vw.dtype)

    @staticmethod
    def _with_weights(vw: Tensor, w: Tensor) -> Tensor:
        """[v, 1] rows ``[B, H, n, Dv + 1]`` (zero rows for padding) from ``_values``, or
        the state's sums of them from Performer's ``value_sum`` and ``count``."""
        return torch.cat([vw, w.expand_as(vw[..., :1])], -1)


class LinearDecoding(PrefixSumDecoding):
    """``linear``: phi = psi = elu + 1 (``ops/linear``); its rows are normalised by
    ``eps`` alone, so it keeps no sum of the values beside S."""

    def _first(self, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None) -> Tensor:
        out = self.bound(q, k, v, key_padding_mask=key_valid, generator=self.key)
        self.sums = self._key_features(k, key_valid).transpose(-1, -2) \
            @ self._with_weights(*self._values(v, key_valid))
        return out

    def _extend(self, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None) -> Tensor:
        assert self.sums is not None
        phi_q = elu_feature_map(q.to(compute_dtype(q.dtype)))
        psi_k = self._key_features(k, key_valid)
        v1 = self._with_weights(*self._values(v, key_valid))  # [B, H, n, Dv + 1]
        o = causal_feature_sums(phi_q, psi_k, v1) + phi_q @ self.sums
        self.sums = self.sums + psi_k.transpose(-1, -2) @ v1
        out = linear_normalised(o, self.bound.config.eps)
        return zero_padded_queries(out, key_valid).to(q.dtype)

    @staticmethod
    def _key_features(k: Tensor, key_valid: Tensor | None) -> Tensor:
        """psi(k) ``[B, H, n, m]`` in the compute dtype, zero rows for padded keys."""
        psi_k = elu_feature_map(k.to(compute_dtype(k.dtype)))
        if key_valid is not None:
            psi_k = torch.where(key_valid[:, None, :, None], psi_k, 0.0)
        return psi_k


class PerformerDecoding(PrefixSumDecoding):
    """``performer``: positive random features, the keys' sums held at their running
    maximum (``ops/performer/causal.py``); the feature directions are fixed at the first
    step (the layer's own, or drawn from the key as the full forward draws them)."""

    batched = ("sums", "shift", "value_sum", "count")

    def __init__(self, bound: BoundMethod, generator: torch.Generator | Tensor | None = None,
                 features: nn.Module | None = None) -> None:
        super().__init__(bound, generator)
        self.features_module = features  # the layer's PerformerFeatures, if any
        self.projection: Tensor | None = None  # [m, D]
        self.shift: Tensor | None = None  # [B, H], the sums' running maximum
        self.value_sum: Tensor | None = None  # [B, H, 1, Dv]: the fallback rows' mean
        self.count: Tensor | None = None  # [B, 1, 1, 1]

    def _first(self, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None) -> Tensor:
        config = self.bound.config
        if self.features_module is not None:
            self.projection = self.features_module(q, k)["projection"]
        self.projection = resolve_projection(
            "performer", self.projection, config.num_features, q.shape[-1], config.orthogonal,
            q.device, self.key)
        out = self.bound(q, k, v, key_padding_mask=key_valid, generator=self.key,
                         projection=self.projection)
        vw, w = self._values(v, key_valid)
        self.sums, self.shift, _ = running_sums(*self._key_logs(k), self._with_weights(vw, w),
                                                key_valid)
        self.value_sum, self.count = vw.sum(2, keepdim=True), w.sum(2, keepdim=True)[:, :1]
        return out

    def _extend(self, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None) -> Tensor:
        assert self.value_sum is not None and self.count is not None
        o, vw, w = self._absorb(q, k, v, key_valid)
        value_sums = self.value_sum + vw.cumsum(2)
        counts = self.count + w.cumsum(2)
        out = normalised_or(*numerator_and_denominator(rows_rescaled(o)),
                            value_sums / counts.clamp_min(1.0))
        self.value_sum, self.count = value_sums[:, :, -1:], counts[:, :1, -1:]
        return zero_padded_queries(out, key_valid).to(q.dtype)

    def _absorb(self, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None
                ) -> tuple[Tensor, Tensor, Tensor]:
        """The sums of these positions after the state's (``[B, H, n, Dv + 1]``), the
        state moved past them; and V, its weights as ``_values`` gives them."""
        assert self.sums is not None and self.shift is not None
        assert self.value_sum is not None and self.count is not None
        vw, w = self._values(v, key_valid)
        plain = self._with_weights(self.value_sum, self.count)  # sum_j [v_j, 1] so far
        o, (self.sums, self.shift, _) = causal_performer_sums(
            self._query_features(q), *self._key_logs(k), self._with_weights(vw, w), key_valid,
            self.bound.config.eps, start=RunningSums(self.sums, self.shift, plain))
        return o, vw, w

    def _scaled(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x s^1/2 and the feature directions, in the compute dtype."""
        assert self.projection is not None
        config = self.bound.config
        s = logit_scale(x.shape[-1], config.scale)
        work = compute_dtype(x.dtype)
        return x.to(work) * math.sqrt(s), self.projection.to(work)

    def _query_features(self, q: Tensor) -> Tensor:
        """phi(q) ``[B, H, n, m]``, each row at its own shift."""
        return query_features(*self._scaled(q), self.bound.config.eps)[0]

    def _key_logs(self, k: Tensor) -> tuple[Tensor, Tensor]:
        """The keys' log-features and their log-scales' basis (``causal.py``)."""
        return causal_key_logs(*self._scaled(k), self.bound.config.eps)
