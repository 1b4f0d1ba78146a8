"""Options of the multipole methods and how a budget splits between their parts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...linalg import KERNELS
from ..shared.options import (
    check_choice,
    check_nonnegative_int,
    check_optional_positive_int,
    check_positive_float,
    check_positive_int,
)


@dataclass(frozen=True)
class MultipoleOptions:
    """Options of the multipole (near field + far-field expansion) methods.

    num_features: kernel evaluations per query: clusters + near keys + window keys.
    window: local window half-width w (keys |i - j| <= w, ranks among the real tokens;
        0 = none, the default: with the first-order far field it bought little on
        MiniLM, see ``docs/accuracy-first.md``). Self-attention only: a call with
        Nq != Nk or a query_padding_mask of its own is refused (``check_window``). Its
        2w + 1 keys must fit in a quarter of ``num_features`` (w <= 15 at 128; a wider
        window is refused, not shrunk; with ``tolerance`` the smaller rungs of the
        ladder shrink it to their budget).
    lsh_block: keys per angular-LSH bucket (KDEformer Appendix A, Hamming-ordered
        equal-sized buckets) computed exactly for each query (0 = none); at most a
        quarter of ``num_features`` (refused above). Exclusive with ``window``.
    lsh_hyperplanes: hyperplanes r of the LSH (2^r buckets before equal-size cutting).
    clusters: number of query clusters c; ``None`` = half of what the window leaves.
        The remaining budget goes to the near keys of each cluster.
    tilt_rank: value directions kept in the far-field covariance term (0 = zeroth-order
        far field, ``None`` = every direction).
    tilt_sample: keys (a uniform sample, shared by the clusters) from which the
        covariance term is estimated (``None`` = every key); caps its cost at
        c * tilt_sample * D * tilt_rank whatever N.
    kmeans_iterations: Lloyd iterations on the k-means sub-sample.
    kmeans_sample: rows sub-sampled for the Lloyd iterations (``None`` = all); at least
        the number of clusters (a smaller one is raised to it, and the sampled rows are
        then the centres, which Lloyd's steps leave as they are).
    tolerance: target relative error; when set, each head takes the smallest budget of
        the ladder 0, m/8 .. m (m = ``num_features``; 0 = the trivial answer, every
        row the mean of V for softmax, the mean exact probe row for the Gaussian
        target) whose error, measured on ``probe`` exact query rows, is at most
        ``tolerance``, else the one with the smallest error (``targeted.py``).
    probe: query rows computed exactly to estimate the error (with ``tolerance``).
    kernel: the far-field kernel products by ``"auto"``, ``"torch"`` or ``"triton"``
        (``linalg.kernel_backend``).
    """

    num_features: int = 128
    window: int = 0
    lsh_block: int = 0
    lsh_hyperplanes: int = 7
    clusters: int | None = None
    tilt_rank: int | None = 8
    tilt_sample: int | None = 2048
    kmeans_iterations: int = 10
    kmeans_sample: int | None = 2048
    tolerance: float | None = None
    probe: int = 32
    kernel: str = "auto"

    @property
    def exact_query_rows(self) -> int:
        """Query rows returned exact whatever is drawn (``skyformer check`` adds as many
        rows to those on which the draws must show): the probes of ``tolerance``."""
        return self.probe if self.tolerance is not None else 0

    def _check_exact_keys_fit(self, method: str) -> None:
        """A window or LSH bucket wider than a quarter of the budget is refused (it was
        shrunk without a word: num_features=8 with window=3 ran as window=0)."""
        quarter = self.num_features // 4
        widest = max(0, (quarter - 1) // 2)
        if self.window > widest:
            raise ValueError(
                f"{method}: window={self.window} takes 2w + 1 = {2 * self.window + 1} keys "
                f"per query, more than a quarter of num_features={self.num_features} "
                f"({quarter}); lower window to at most {widest} or raise num_features to "
                f"{4 * (2 * self.window + 1)}."
            )
        if self.lsh_block > quarter:
            raise ValueError(
                f"{method}: lsh_block={self.lsh_block} keys per query are more than a "
                f"quarter of num_features={self.num_features} ({quarter}); lower lsh_block "
                f"to at most {quarter} or raise num_features to {4 * self.lsh_block}."
            )

    def validate(self, method: str) -> None:
        check_positive_int(method, "num_features", self.num_features)
        for name in ("window", "lsh_block", "kmeans_iterations"):
            check_nonnegative_int(method, name, getattr(self, name))
        check_positive_int(method, "probe", self.probe)
        check_choice(method, "kernel", self.kernel, KERNELS)
        check_positive_int(method, "lsh_hyperplanes", self.lsh_hyperplanes)
        if self.lsh_hyperplanes > 30:
            raise ValueError(
                f"{method}: lsh_hyperplanes must be at most 30 (2^r buckets), "
                f"got {self.lsh_hyperplanes}."
            )
        if self.window and self.lsh_block:
            raise ValueError(
                f"{method}: choose one of window={self.window} and lsh_block={self.lsh_block} "
                f"for the per-query exact keys (set the other to 0)."
            )
        if self.tolerance is not None:
            check_positive_float(method, "tolerance", self.tolerance)
            if self.clusters is not None:
                raise ValueError(
                    f"{method}: clusters cannot be combined with tolerance (each budget of the "
                    f"ladder uses its own split); leave clusters=None."
                )
        for name in ("clusters", "kmeans_sample", "tilt_sample"):
            check_optional_positive_int(method, name, getattr(self, name))
        if self.tilt_rank is not None:
            check_nonnegative_int(method, "tilt_rank", self.tilt_rank)
        self._check_exact_keys_fit(method)
        window, lsh, _, _ = feature_split(self.num_features, self.window, None,
                                          self_attention=True, lsh_block=self.lsh_block)
        extra = (2 * window + 1 if window else 0) + lsh
        left = self.num_features - extra
        if self.clusters is not None and self.clusters > left:
            raise ValueError(
                f"{method}: clusters={self.clusters} leaves no budget: num_features="
                f"{self.num_features} with {extra} window/LSH keys allows at most {left} "
                f"clusters; raise num_features or lower clusters."
            )


def check_window(method: str, options: MultipoleOptions, *, nq: int, nk: int,
                 self_attention: bool) -> None:
    """Refuse a ``window`` where the call is cross-attention (it would be dropped)."""
    if options.window and not self_attention:
        why = (f"Nq={nq} != Nk={nk}" if nq != nk else "query_padding_mask given: the "
               "queries padded apart from the keys, where self-attention reads both from "
               "key_padding_mask")
        raise ValueError(
            f"{method}: window={options.window} takes the keys around each query's own "
            f"position, which only self-attention has (here {why}); use lsh_block for "
            f"per-query exact keys in cross-attention, or leave window=0."
        )


def feature_split(
    num_features: int, window: int, clusters: int | None, *, self_attention: bool,
    lsh_block: int = 0,
) -> tuple[int, int, int, int]:
    """(window half-width, LSH block, clusters, near keys) for ``num_features`` per query.

    The window (2w + 1 keys, self-attention only) or the LSH bucket takes at most a
    quarter of the budget; of the rest, ``clusters`` (default: half, at least 1) are
    cluster centres and the remainder near keys.
    """
    quarter = num_features // 4
    w = 0
    if self_attention and window > 0:
        w = min(window, max(0, (quarter - 1) // 2))
    lsh = min(lsh_block, quarter) if lsh_block > 0 else 0
    left = num_features - (2 * w + 1 if w else 0) - lsh
    c = max(1, left // 2) if clusters is None else min(clusters, left)
    return w, lsh, c, left - c


def rung_options(options: MultipoleOptions, num_features: int) -> MultipoleOptions:
    """``options`` at a smaller budget of the ``tolerance`` ladder, the window and LSH
    bucket shrunk to fit it (``feature_split``'s rule)."""
    w, lsh, _, _ = feature_split(num_features, options.window, None, self_attention=True,
                                 lsh_block=options.lsh_block)
    return dataclasses.replace(options, num_features=num_features, window=w, lsh_block=lsh)
