"""Decoding state of the causal Skyformer (``ops/skyformer/causal.py``).

The causal forward gives query i in chunk c (``CAUSAL_CHUNK`` = 64 real tokens: the
forward runs on the real tokens gathered to the front, ``causal_inputs``)

    out_i = phi_<=i(q_i) . L^-1 U_c  +  sum_{64 c <= j <= i} C(q_i, k_j) v_j,
    U_c = sum_{j < 64 c} C(X_S, k_j) v_j,   phi(y) = L^-1 C(X_S, y),

with landmark slot s revealed at the real token of rank r_s = s R + floor(u_s R). Token
by token, the state keeps

- the revealed landmark rows X_S and L^-1 (``[B, H, m, D]``, ``[B, H, m, m]``): a slot
  revealed later leaves the leading block of L^-1 unchanged (``core_of_rows``);
- U (``[B, H, m, Dv]``): at the end of each chunk its keys are added (each batch
  element at its own 64th real token);
- the keys and values of the current chunk (at most 63 real ones an element; the
  buffer's positions are shared by the batch, a key outside an element's chunk has an
  +inf offset there, and positions no element holds are dropped), for the exact local
  part;
- the keys and values of the completed chunks *only while a slot is unrevealed*: slot s
  revealed at position p needs C(x_s, k_j) v_j for every j before p's chunk. With stride
  R every slot is revealed by position m R; from then on the state is bounded: at
  most m (D + m + Dv) + 63 (D + Dv) numbers per head, plus a norm and a flag per slot
  and a norm per key of the current chunk (Dv + 1 value columns for
  ``nystrom_softmax``'s normaliser); it peaks at the last key of each chunk.

Outputs equal the full causal forward with the same key and ``landmark_stride`` R to
rounding. Without a ``landmark_stride`` the state takes the prompt's default,
R = ceil(n_b / m) for each prompt's n_b real tokens, so the prompt's outputs are the
full forward's and the landmarks lie in the prompt and the first tokens after it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..linalg import gaussian_kernel_block, half_sq_norm, kernel_scale, with_ones_column
from ..ops.nystrom_softmax.nystrom_softmax import needs_float64
from ..ops.shared.causal_nystrom import (
    causal_core,
    causal_landmarks,
    core_of_rows,
    landmark_stride,
    slot_ranks,
    slot_takes_query,
    uses_failed,
)
from ..ops.shared.causal_prefix import CAUSAL_CHUNK
from ..ops.shared.inputs import compute_dtype
from ..ops.shared.normalised import normalised_or
from ..registry import BoundMethod
from .state import DecodingState, append, padding_as_false


class SkyformerDecoding(DecodingState):
    """The causal Skyformer's decoding state (module docstring)."""

    batched = ("ranks", "real", "revealed", "x", "x_norm", "l_inv", "failed", "u",
               "chunk_k", "chunk_kn", "chunk_v", "past_k", "past_kn", "past_v")

    def __init__(self, bound: BoundMethod, generator: torch.Generator | Tensor | None = None
                 ) -> None:
        super().__init__(bound.name, generator)
        self.bound = bound.replace(causal=True)
        config = self.bound.config
        self.m, self.gamma, self.local = config.num_features, config.gamma, config.causal_local
        self.stride: int | None = config.landmark_stride
        self.scale = 1.0
        self.ranks: Tensor | None = None  # [B, m] real-token rank of each slot
        self.real: Tensor | None = None  # [B] real tokens seen
        self.revealed: Tensor | None = None  # [B, m]
        self.x = self.x_norm = self.l_inv = self.u = None  # type: ignore[assignment]
        self.failed: Tensor | None = None  # [B, H, m] slots from a failed pivot on
        self.chunk_k = self.chunk_kn = self.chunk_v = None  # type: ignore[assignment]
        self.past_k = self.past_kn = self.past_v = None  # type: ignore[assignment]

    def _first(self, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None) -> Tensor:
        b, _, n, d = q.shape
        # without a landmark_stride, each prompt's own default (the forward's, below)
        stride = landmark_stride(self.stride, n, self.m, key_valid)
        out = self.bound(q, k, v, key_padding_mask=key_valid, generator=self.key)
        work = self._work_dtype(q, k)
        qw, kw, vw = q.to(work), k.to(work), v.to(work)
        self.scale = kernel_scale(d, self.bound.config.scale)
        draw = self.bound.config.kernel
        marks = causal_landmarks(self.m, stride, batch=b, n=n, key_valid=key_valid,
                                 device=q.device, key=self.key, draw=draw)
        _, kw, core = causal_core(qw, kw, self.scale, self.gamma, marks)
        self.ranks = slot_ranks(self.m, stride, batch=b, device=q.device, key=self.key,
                                draw=draw)
        self.real = padding_as_false(key_valid, q).sum(1)
        self.revealed = marks.live
        self.x = torch.where(marks.live[:, None, :, None], core.x, 0.0)
        self.x_norm, self.l_inv, self.failed = core.x_norm, core.l_inv, core.failed
        ks, kn, vw = self._keys(kw, vw, key_valid)
        # chunks of CAUSAL_CHUNK real tokens, as the forward's: the keys of each element's
        # completed chunks go to U, the others stay (the +inf offset of a key that is not
        # an element's gives it no weight there)
        valid = padding_as_false(key_valid, q)
        rank = valid.long().cumsum(1) - 1  # [B, n]
        absorbed = valid & (rank < (self.real - self.real % CAUSAL_CHUNK)[:, None])
        kn_done = torch.where(absorbed[:, None, :], kn, float("inf"))
        self._start_sums(ks, kn_done)
        self.u = self._block(ks, kn_done) @ vw
        self.chunk_k, self.chunk_v = ks, vw
        self.chunk_kn = torch.where((valid & ~absorbed)[:, None, :], kn, float("inf"))
        self._trim_chunk()
        self.past_k, self.past_kn, self.past_v = ks, kn_done, vw  # the keys in U, while
        self._forget_revealed()  # a slot is unrevealed (the rest dropped)
        return out

    def _keys(self, k: Tensor, v: Tensor, key_valid: Tensor | None
              ) -> tuple[Tensor, Tensor, Tensor]:
        """Scaled keys, their offsets in the kernel's exponent (here |k|^2/2; +inf for
        padded keys: zero weight) and the values the sums carry."""
        ks = k * self.scale
        kn = half_sq_norm(ks)
        if key_valid is not None:
            kn = torch.where(key_valid[:, None, :], kn, float("inf"))
        return ks, kn, v

    def _work_dtype(self, q: Tensor, k: Tensor) -> torch.dtype:
        """The dtype the state computes and keeps its tensors in (the forward's)."""
        return compute_dtype(q.dtype)

    def _start_sums(self, keys: Tensor, offsets: Tensor) -> None:
        """Set what ``_block`` needs before the first sums (nothing here)."""

    def _block(self, keys: Tensor, offsets: Tensor) -> Tensor:
        """``[B, H, m, L]`` weights of the landmarks against ``keys`` in the sums U."""
        return gaussian_kernel_block(self.x, keys, self.x_norm, offsets)

    def _extend(self, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None) -> Tensor:
        valid = padding_as_false(key_valid, q)
        work = self._work_dtype(q, k)
        outs = [self._advance(q[:, :, i:i + 1].to(work), k[:, :, i:i + 1].to(work),
                              v[:, :, i:i + 1].to(work), valid[:, i])
                for i in range(q.shape[2])]
        if key_valid is not None:  # padded positions: no element's key, dropped
            self._trim_chunk()
        return torch.cat(outs, dim=2).to(q.dtype)

    def reorder(self, index: Tensor) -> None:
        super().reorder(index)
        if self.chunk_kn is not None:  # the positions only dropped sequences held
            self._trim_chunk()

    def _advance(self, q: Tensor, k: Tensor, v: Tensor, valid: Tensor) -> Tensor:
        """One position: reveal its slot, attend, absorb the chunks it completes (those
        of the elements whose real tokens it brings to a multiple of CAUSAL_CHUNK)."""
        qs = q * self.scale
        ks, kn, v = self._keys(k, v, valid[:, None])
        complete = self._reveal(qs, ks, valid)
        self.chunk_k = torch.cat([self.chunk_k, ks], 2)
        self.chunk_kn = torch.cat([self.chunk_kn, kn], 2)
        self.chunk_v = torch.cat([self.chunk_v, v], 2)
        out = self._attend(qs, kn)
        seen = uses_failed(self.revealed[:, None, None, :], self.failed)[..., None]
        out = torch.where(seen, float("nan"), out)  # a failed slot: NaN
        if complete is not None:
            self._absorb_chunk(complete)
        return torch.where(valid[:, None, None, None], out, 0.0)

    def _trim_chunk(self) -> None:
        """Drop the positions of the chunk buffers that hold no element's key, wherever
        they are: an element whose chunk stays open (a finished sequence, padded from
        then on) keeps its own keys there, not every position after them, so the
        buffers hold at most 63 positions an element."""
        self.chunk_k, self.chunk_kn, self.chunk_v = _held(self.chunk_k, self.chunk_kn,
                                                          self.chunk_v)

    def _query_features(self, qs: Tensor) -> Tensor:
        """phi(q) = L^-1 C(X_S, q) over the revealed slots: ``[B, H, 1, m]``."""
        phi_q = gaussian_kernel_block(qs, self.x, half_sq_norm(qs), self.x_norm) \
            @ self.l_inv.transpose(-1, -2)
        return torch.where(self.revealed[:, None, None, :], phi_q, 0.0)

    def _attend(self, qs: Tensor, kn: Tensor) -> Tensor:
        """Output of one query ``[B, H, 1, D]`` (scaled; ``kn`` its key's offset)."""
        phi_q = self._query_features(qs)
        out = phi_q @ (self.l_inv @ self.u)
        if self.local:
            near = gaussian_kernel_block(qs, self.chunk_k, half_sq_norm(qs), self.chunk_kn)
        else:
            phi_k = gaussian_kernel_block(self.chunk_k, self.x, self.chunk_kn, self.x_norm) \
                @ self.l_inv.transpose(-1, -2)
            near = phi_q @ phi_k.transpose(-1, -2)
        return out + near @ self.chunk_v

    def _reveal(self, qs: Tensor, ks: Tensor, valid: Tensor) -> Tensor | None:
        """Count this token; reveal the next slot where it is the real token of its rank.
        Returns ``[B]``, the elements whose chunk it completes (its real tokens a multiple
        of CAUSAL_CHUNK), or None where it completes none. Whether any slot is revealed,
        whether any chunk completes and whether every slot is then revealed are read in
        one transfer: on a GPU each read waits for the queue, and a token usually does
        none of these."""
        slot = self.revealed.sum(1)  # [B]: slots are revealed in order
        safe = slot.clamp_max(self.m - 1)
        hit = valid & (slot < self.m) & (self.ranks.gather(1, safe[:, None])[:, 0] == self.real)
        self.real = self.real + valid.long()
        complete = valid & (self.real % CAUSAL_CHUNK == 0)  # [B]
        every = (slot + hit.long() >= self.m).all()  # every slot revealed after this token
        flags = int(every * 4 + hit.any() * 2 + complete.any())  # one value read for all
        if flags & 2:
            self._reveal_slot(qs, ks, hit, safe, every_revealed=bool(flags & 4))
        return complete if flags & 1 else None

    def _reveal_slot(self, qs: Tensor, ks: Tensor, hit: Tensor, safe: Tensor,
                     every_revealed: bool) -> None:
        """Reveal slot ``safe: [B]`` of the elements where ``hit``, this token's query or
        key row as the slot takes it (``every_revealed``: every slot of every element
        is revealed then)."""
        # [B, m]; not one_hot, which reads the indices' range back to check it
        new = (torch.arange(self.m, device=safe.device) == safe[:, None]) & hit[:, None]
        row = torch.where(slot_takes_query(self.m, qs.device)[safe][:, None, None], qs[:, :, 0],
                          ks[:, :, 0])  # [B, H, D]
        self.x = torch.where(new[:, None, :, None], row[:, :, None, :], self.x)
        self.revealed = self.revealed | new
        core = core_of_rows(self.x, self.revealed, self.gamma)
        self.x_norm, self.l_inv, self.failed = core.x_norm, core.l_inv, core.failed
        if self.past_k is not None and self.past_k.shape[2]:
            fresh = self._block(self.past_k, self.past_kn) @ self.past_v  # [B, H, m, Dv]
            self.u = torch.where(new[:, None, :, None], fresh, self.u)
        self._forget_revealed(every_revealed)

    def _forget_revealed(self, every_revealed: bool | None = None) -> None:
        """The earlier keys serve the slots still to reveal: an element with every slot
        revealed needs none of them (its entries get +inf offsets), and positions that
        no element needs are dropped (all of them once every slot is revealed, then
        ``past_k`` is None). ``every_revealed``: whether that is so, where the caller
        knows (else read)."""
        if self.past_k is None:
            return
        if every_revealed is None:
            every_revealed = bool(self.revealed.all())
        if every_revealed:
            self.past_k = self.past_kn = self.past_v = None
            return
        self.past_kn = torch.where(self.revealed.all(1)[:, None, None], float("inf"),
                                   self.past_kn)
        self.past_k, self.past_kn, self.past_v = _held(self.past_k, self.past_kn, self.past_v)

    def _absorb_chunk(self, complete: Tensor) -> None:
        """Add the keys of the chunks that end here (``complete``: ``[B]``) to U; keep
        them while a slot is unrevealed; the other elements' chunks stay."""
        done_kn = torch.where(complete[:, None, None], self.chunk_kn, float("inf"))
        self.u = self.u + self._block(self.chunk_k, done_kn) @ self.chunk_v  # + 0 elsewhere
        if self.past_k is not None:  # None once every slot is revealed
            # whole: the positions no completing element holds (+inf) go in the
            # forgetting below, which drops what no element holds in one value read
            self.past_k = append(self.past_k, self.chunk_k, 2)
            self.past_kn = append(self.past_kn, done_kn, 2)
            self.past_v = append(self.past_v, self.chunk_v, 2)
            # not for the elements with every slot revealed. False without a read: the
            # last reveal found a slot unrevealed (past_k would be None otherwise); were
            # every slot revealed since (a reordering of the beams), False only keeps
            # empty buffers instead of None
            self._forget_revealed(every_revealed=False)
        self.chunk_kn = torch.where(complete[:, None, None], float("inf"), self.chunk_kn)
        self._trim_chunk()


def _held(k: Tensor, kn: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Position-aligned keys ``[B, H, L, D]``, their offsets ``[B, H, L]`` (+inf: not
    this element's) and values, without the positions that no element holds."""
    held = torch.isfinite(kn).flatten(0, 1).any(0)  # [L]
    keep = held.nonzero()[:, 0]  # one value read: its length says whether all are held
    if keep.numel() == held.numel():
        return k, kn, v
    return k.index_select(2, keep), kn.index_select(2, keep), v.index_select(2, keep)


class NystromSoftmaxDecoding(SkyformerDecoding):
    """The causal ``nystrom_softmax``'s decoding state (``ops/nystrom_softmax/causal.py``).

    The weights are exp(x_s . k_j - |x_s|^2/2) (C(X_S, k) E_K) for the far keys and
    exp(q . k_j - |q|^2/2) for the near ones, each row shifted by r_i, the running
    maximum of |k_j|^2/2 over the real keys j <= i (it cancels in the row's ratio). U is
    kept shifted by M, r at the end of the last completed chunk: far weights are then
    multiplied by exp(M - r_i) <= 1, and U is rescaled by exp(M - M') when a chunk with
    a larger key moves M to M'. The sums carry [v, 1] (numerator and normaliser); rows
    whose normaliser is lost to cancellation get the prefix mean of the values, as in
    the forward.
    """

    batched = (*SkyformerDecoding.batched, "shift", "running_max", "value_sum", "count")

    def __init__(self, bound: BoundMethod, generator: torch.Generator | Tensor | None = None
                 ) -> None:
        super().__init__(bound, generator)
        self.threshold = self.bound.config.normalizer_threshold
        self.shift: Tensor | None = None  # M: [B, H]
        self.running_max: Tensor | None = None  # r of the last position: [B, H]
        self.value_sum: Tensor | None = None  # [B, H, 1, Dv]
        self.count: Tensor | None = None  # [B, 1, 1, 1]
        self.wide = False  # computing in float64 from now on (_work_dtype)

    def _work_dtype(self, q: Tensor, k: Tensor) -> torch.dtype:
        """As the forward's: float64 on a CPU once a position's norm is beyond what
        float32 holds (``needs_float64``); from then on the state is kept in float64
        (its float32 tensors converted: what they summed was within float32's reach)."""
        if not getattr(self, "wide", False) and needs_float64(q, k, self.bound.config):
            self.wide = True
            for name, value in list(vars(self).items()):
                if isinstance(value, Tensor) and value.dtype == torch.float32:
                    setattr(self, name, value.double())
        return torch.float64 if getattr(self, "wide", False) else compute_dtype(q.dtype)

    def _first(self, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None) -> Tensor:
        out = super()._first(q, k, v, key_valid)
        ks = k.to(self.x.dtype) * self.scale
        log_e = torch.where(torch.isfinite(self._real_offsets(key_valid, ks)),
                            half_sq_norm(ks), float("-inf"))  # [B, H, n]
        self.running_max = log_e.amax(-1)
        vw = v.to(self.x.dtype)
        w = (torch.ones_like(vw[:, :1, :, :1]) if key_valid is None
             else key_valid[:, None, :, None].to(vw.dtype))
        self.value_sum = (vw * w).sum(2, keepdim=True)
        self.count = w.sum(2, keepdim=True)
        return out

    @staticmethod
    def _real_offsets(key_valid: Tensor | None, ks: Tensor) -> Tensor:
        """0 for real keys, +inf for padded ones: ``[B, 1|H, n]``."""
        if key_valid is None:
            return torch.zeros_like(ks[..., 0])
        return torch.where(key_valid[:, None, :], 0.0, float("inf")).to(ks.dtype)

    def _keys(self, k: Tensor, v: Tensor, key_valid: Tensor | None
              ) -> tuple[Tensor, Tensor, Tensor]:
        ks = k * self.scale
        offsets = self._real_offsets(key_valid, ks).expand_as(ks[..., 0])
        return ks, offsets, with_ones_column(v)

    def _start_sums(self, keys: Tensor, offsets: Tensor) -> None:
        log_e = torch.where(torch.isfinite(offsets), half_sq_norm(keys), float("-inf"))
        self.shift = log_e.amax(-1) if keys.shape[2] else \
            torch.full(keys.shape[:2], float("-inf"), dtype=keys.dtype, device=keys.device)

    def _block(self, keys: Tensor, offsets: Tensor) -> Tensor:
        """exp(x_s . k_j - |x_s|^2/2 - M) (0 for padded keys and unrevealed slots)."""
        shift = torch.where(torch.isfinite(self.shift), self.shift, 0.0)
        return gaussian_kernel_block(self.x, keys, self.x_norm, offsets + shift[..., None])

    def _absorb_chunk(self, complete: Tensor) -> None:
        ending = torch.isfinite(self.chunk_kn) & complete[:, None, None]
        log_e = torch.where(ending, half_sq_norm(self.chunk_k), float("-inf"))
        new = torch.maximum(self.shift, log_e.amax(-1))  # M' = r at the chunk's end
        rescale = torch.where(torch.isfinite(self.shift), (self.shift - new).exp(), 0.0)
        self.u = self.u * rescale[..., None, None]  # 1 where no chunk ends
        self.shift = new
        super()._absorb_chunk(complete)

    def _attend(self, qs: Tensor, kn: Tensor) -> Tensor:
        ks = self.chunk_k[:, :, -1:]  # this position's key
        real = torch.isfinite(kn[..., 0])  # [B, H]
        key_log = torch.where(real, half_sq_norm(ks)[..., 0], float("-inf"))
        self.running_max = torch.maximum(self.running_max, key_log)
        r = torch.where(torch.isfinite(self.running_max), self.running_max, 0.0)  # r_i
        far_factor = torch.where(torch.isfinite(self.shift), (self.shift - r).exp(), 0.0)
        phi_q = self._query_features(qs)  # [B, H, 1, m]
        state = self.l_inv @ self.u  # [B, H, m, Dv + 1]
        far = (phi_q @ state) * far_factor[..., None, None]
        bound = (phi_q.abs() @ state[..., -1:].abs()) * far_factor[..., None, None]
        offsets = self.chunk_kn + r[..., None]
        if self.local:  # exp(q.k_j - |q|^2/2 - r_i), real keys of the chunk
            near = gaussian_kernel_block(qs, self.chunk_k, half_sq_norm(qs), offsets)
        else:
            psi = gaussian_kernel_block(self.chunk_k, self.x, offsets, self.x_norm) \
                @ self.l_inv.transpose(-1, -2)
            near = phi_q @ psi.transpose(-1, -2)  # [B, H, 1, L]
        o = far + near @ self.chunk_v
        bound = bound + near.abs().sum(-1, keepdim=True)
        v = self.chunk_v[:, :, -1:, :-1]
        w = real[:, :1, None, None].to(v.dtype)
        self.value_sum = self.value_sum + v * w
        self.count = self.count + w
        mean = self.value_sum / self.count.clamp_min(1.0)
        numerator, denominator = o[..., :-1], o[..., -1:]
        return normalised_or(numerator, denominator, mean, denominator > self.threshold * bound)
