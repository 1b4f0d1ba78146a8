"""The released Skyformer code's attention modules as ``skyformer bench`` functions.

``skyformer bench`` takes any importable ``module:function@target``; these functions
call the modules of a checkout of github.com/pkuzengqi/Skyformer (``SKYFORMER_OFFICIAL``,
imported as ``published.py`` does, never shipped) on ``[B, H, N, D]`` tensors, so that
their time, peak memory and error are measured in the same run and by the same rules
as the library's methods::

    SKYFORMER_OFFICIAL=~/src/Skyformer PYTHONPATH=benchmarks skyformer bench \\
        --methods skyformer released:released_skyformer@gaussian \\
                  nystromformer released:released_nystromformer@softmax \\
        --shapes 1,2,32 --seq-lens 1024 2048 4096 8192 16384 --no-error

Each call builds its module for the call's shape (cheap: the modules hold no weights)
and passes the all-real mask the released model passes. The released Skyformer scales by
32 ** -0.25 whatever the head dim p; it is given Q and K times (32 / p)^(1/4), which
makes its scale the paper's p^-1/4 at any head dim (``published.at_released_skyformer_scale``).
"""

from __future__ import annotations

import functools

import torch
from published import _import_skyformer_official, at_released_skyformer_scale
from torch import Tensor


@functools.cache
def _released_skyformer(n: int, m: int, d: int, device: str) -> torch.nn.Module:
    released = _import_skyformer_official()
    return released.skyformer({  # the LRA "skyformer" entry of the release's config.py
        "device": device, "max_seq_len": n, "nb_features": m, "head_dim": d,
        "sketched_kernel": "kernel_RS_RBF", "accumulation": 1, "sampling_factor": 4,
        "no_projection": False}).eval()


@functools.cache
def _released_nystromformer(n: int, m: int, d: int, heads: int) -> torch.nn.Module:
    released = _import_skyformer_official()
    return released.nystrom({"head_dim": d, "num_head": heads, "num_landmarks": m,
                             "max_seq_len": n}).eval()


def _mask(q: Tensor) -> Tensor:
    """The released models' mask: ``[B, N]``, 1 for a real token."""
    return q.new_ones(q.shape[0], q.shape[2])


def released_skyformer(q: Tensor, k: Tensor, v: Tensor, *, num_features: int = 128) -> Tensor:
    """The released ``Skyformer`` module (m landmarks, half from Q and half from K)."""
    _, _, n, d = q.shape
    module = _released_skyformer(n, num_features, d, q.device.type)
    return module(*at_released_skyformer_scale(q, k), v, _mask(q))


def released_nystromformer(q: Tensor, k: Tensor, v: Tensor, *, num_features: int = 128) -> Tensor:
    """The released ``NystromAttention`` module (m segment-means landmarks)."""
    _, h, n, d = q.shape
    return _released_nystromformer(n, num_features, d, h)(q, k, v, _mask(q))
