"""``skyformer compare --maps FILE``: the attention matrix of one head, exact and per method.

A panel per exact target the methods approximate (unless an exact method among them
draws it), then one per method: the ``[Nq, Nk]`` matrix its output applies to the
values of that head (``skyformer.attention_weights``: the method run on that head
alone, with the table's seed and options), titled with its relative spectral error
against the exact matrix of its target, ``||A - A_exact||_2 / ||A_exact||_2``: the
softmax weights, or the Gaussian kernel matrix C of Skyformer's eq. (3), whose
approximation Skyformer's Theorem 2 bounds. A target's panels share one colour scale,
the square root of the weight from 0 to the exact matrix's largest (a negative weight,
which some approximations give, shows as 0). A method without such a matrix
(``kdeformer``, the multipole methods), or one that cannot run these inputs, says so
in its panel.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ...logs import first_line
from ...registry import exact_method, get_method
from ...weights import attention_weights, call_with_weights
from ..approx.plots import require_matplotlib
from ..data.qkv import MaskedQKV
from ..methods import resolve, target_options

COLUMNS = 4  # panels per row of the figure
EXACT_REASON = "the exact matrix of the target"


@dataclass(frozen=True)
class MapPanel:
    """One method's panel: its matrix ``[Nq, Nk]`` (float64, on the CPU), its error
    against its target's and the target's largest weight (the top of the colour scale),
    or ``None`` and why not."""

    method: str
    target: str
    matrix: Tensor | None
    error: float | None
    top: float | None = None
    reason: str = ""


def attention_maps(given: MaskedQKV, methods: list[str], num_features: int | None,
                   seed: int, head: int) -> list[MapPanel]:
    """The panels of ``methods`` for head ``head`` of the first sequence of ``given``
    (module doc); ``num_features`` and ``seed`` as the comparison's."""
    one = _one_head(given, head)
    exact: dict[tuple, Tensor] = {}
    drawn: set[tuple] = set()  # the targets an exact method's panel shows already
    panels = []
    for name in methods:
        spec = get_method(name)
        target = spec.capabilities.target
        named = resolve(name)
        options = named.options(num_features)
        try:
            resolved = named.resolved_options(options, one.k.shape[2])
        except (ValueError, RuntimeError, TypeError) as err:
            resolved, failure = None, first_line(err)
        if resolved is not None:  # its target's panel, also beside a method without one
            # one key a target and its options away from the defaults (causal, a scale)
            same = {k: v for k, v in target_options(resolved).items()
                    if v not in (None, False)}
            key = (target, *sorted(same.items()))
            if key not in exact:
                try:  # a target these inputs exclude (causal with Nq != Nk): the reason
                    with torch.no_grad():
                        exact[key] = attention_weights(
                            one.q.double(), one.k.double(), exact_method(target).name,
                            key_padding_mask=one.key_padding_mask, **same)[0, 0].cpu()
                except (ValueError, RuntimeError, TypeError) as err:
                    panels.append(MapPanel(name, target, None, None, reason=first_line(err)))
                    continue
        if not spec.capabilities.weights:
            panels.append(MapPanel(name, target, None, None, reason=(
                "no attention matrix: its output is not linear in V")))
            continue
        if resolved is None:
            panels.append(MapPanel(name, target, None, None, reason=failure))
            continue
        try:
            bound = spec.bind(1, one.q.shape[-1], seq_len=one.k.shape[2], **options)
            generator = torch.Generator(device=one.q.device).manual_seed(seed)
            with torch.no_grad():
                _, matrix = call_with_weights(bound, one.q, one.k, one.v, generator=generator,
                                              key_padding_mask=one.key_padding_mask)
        except (ValueError, RuntimeError, TypeError) as err:
            panels.append(MapPanel(name, target, None, None, reason=first_line(err)))
            continue
        matrix = matrix[0, 0].double().cpu()
        norm = torch.linalg.matrix_norm(exact[key], ord=2)
        error = (torch.linalg.matrix_norm(matrix - exact[key], ord=2) / norm).item()
        panels.append(MapPanel(name, target, matrix, error,
                               top=max(float(exact[key].max()), 1e-30)))
        if spec.capabilities.exact:
            drawn.add(key)
    targets = [MapPanel(_exact_name(key), key[0], matrix, None,
                        top=max(float(matrix.max()), 1e-30), reason=EXACT_REASON)
               for key, matrix in exact.items() if key not in drawn]
    return targets + panels


def _exact_name(key: tuple) -> str:
    """``"exact softmax"``, ``"exact gaussian (causal=True)"``: a target's panel."""
    target, *options = key
    given = ", ".join(f"{name}={value!r}" for name, value in options)
    return f"exact {target}" + (f" ({given})" if given else "")


def _one_head(given: MaskedQKV, head: int) -> MaskedQKV:
    """Head ``head`` of the first sequence: ``[1, 1, N, D]`` each, its mask ``[1, Nk]``."""
    heads = given.q.shape[1]
    if not 0 <= head < heads:
        raise ValueError(f"--maps-head must be in 0..{heads - 1} (the Q/K/V have {heads} "
                         f"heads), got {head}.")
    q, k, v = (t[:1, head:head + 1] for t in (given.q, given.k, given.v))
    mask = given.key_padding_mask
    return MaskedQKV(q, k, v, None if mask is None else mask[:1])


def plot_maps(panels: list[MapPanel], path: str | Path, title: str) -> Path:
    """The panels as one figure at ``path`` (written atomically, PNG unless the suffix
    names another format)."""
    from ...io import save_figure

    mpl = require_matplotlib("leave out --maps")
    from matplotlib.colors import PowerNorm

    rows = -(-len(panels) // COLUMNS)
    fig = mpl.figure.Figure(figsize=(3.1 * min(COLUMNS, len(panels)), 3.2 * rows + 0.5),
                            layout="constrained")
    axes = fig.subplots(rows, min(COLUMNS, len(panels)), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        ax.set_xticks([])
        ax.set_yticks([])
        if panel.matrix is None:
            ax.set_title(panel.method, fontsize=8)
            ax.text(0.5, 0.5, _wrapped(panel.reason), ha="center", va="center", fontsize=6,
                    transform=ax.transAxes)
            continue
        ax.imshow(panel.matrix.clamp_min(0).numpy(), cmap="viridis", interpolation="nearest",
                  norm=PowerNorm(gamma=0.5, vmin=0.0, vmax=panel.top))
        caption = (f"{panel.method} ({panel.target})\nmatrix error {panel.error:.3g}"
                   if panel.error is not None else f"{panel.method}\n{panel.reason}")
        ax.set_title(caption, fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_axis_off()
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path, dpi=110, bbox_inches="tight")


def _wrapped(text: str, width: int = 38) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width)) or "not drawn"


def describe(panels: list[MapPanel]) -> list[str]:
    """One line per panel for the terminal: the matrix error, or why there is none."""
    lines: list[str] = []
    for p in panels:
        lines.append(f"  {p.method:24s} " + (f"matrix error {p.error:.3g} ({p.target})"
                                             if p.error is not None else p.reason))
    return lines
