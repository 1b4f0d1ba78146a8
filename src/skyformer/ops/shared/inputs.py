"""Input checks and mask conventions shared by every attention function.

Layout: ``q: [B, H, Nq, D]``, ``k: [B, H, Nk, D]``, ``v: [B, H, Nk, Dv]``.
Mask: ``key_padding_mask: [B, Nk]`` bool, True = real token.

Query mask: ``query_padding_mask`` is ``"auto"`` (the default), ``None`` or
``[B, Nq]`` bool. ``"auto"`` is the self-attention convention: when ``Nq == Nk`` the key
padding mask also marks which *queries* are padding, and with ``Nq != Nk`` every query
is real. Cross-attention with ``Nq == Nk`` passes ``None`` (every query real) or its own
mask. Padded queries take no part in anything computed from the set of queries (e.g.
Skyformer's landmarks), and their output rows are zero.

Errors are raised here, early, as sentences that name the problem and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...sketch.rng import check_key, random_key
from .reduction import WHOLE, KeyReduction

HALF_DTYPES = (torch.float16, torch.bfloat16)
FLOAT_DTYPES = (torch.float32, torch.float64, *HALF_DTYPES)  # the dtypes methods take


@dataclass(frozen=True)
class AttentionInputs:
    """Resolved shapes and masks of one attention call."""

    batch: int
    heads: int
    query_len: int
    key_len: int
    head_dim: int
    value_dim: int
    key_valid: Tensor | None  # [B, Nk] bool, None = all real
    query_valid: Tensor | None  # [B, Nq] bool, None = all real


AUTO = "auto"  # query_padding_mask: the key padding mask when Nq == Nk, else none


def _grouped_hint(method: str, q: Tensor, k: Tensor, v: Tensor) -> str:
    """The end of the sentence for inputs of different batch or head counts: for keys and
    values of a batch of one, the views that give them the queries' batch; where the
    key/value heads (``[B, Hkv, N, D]``, as many for k as for v) divide the query heads,
    the call that runs them as grouped-query attention; else a full stop."""
    h, hkv = q.shape[1], k.shape[1]
    b = q.shape[0]
    sequence_first = (q.shape[0] == k.shape[0] == v.shape[0]
                      and q.shape[2] == k.shape[2] == v.shape[2]
                      and k.shape[1] == v.shape[1] > k.shape[2])  # more keys than heads
    if b > 1 and k.shape[0] == v.shape[0] == 1 and k.shape[1] == v.shape[1] == h:
        return (f"; keys and values shared by the {b} batch elements (SDPA broadcasts a "
                f"batch of one): pass k.expand({b}, -1, -1, -1) and v.expand({b}, -1, -1, "
                f"-1), views that copy nothing.")
    if k.shape[0] == v.shape[0] == b and v.shape[1] == hkv and 0 < hkv < h \
            and h % hkv == 0:
        return (f"; for grouped-query attention ({hkv} key/value heads, each shared by "
                f"{h // hkv} query heads) call skyformer.scaled_dot_product_attention(q, k, "
                f"v, enable_gqa=True, method={method!r}), which repeats them"
                + (_SEQUENCE_FIRST if sequence_first else "."))
    return _SEQUENCE_FIRST if sequence_first else "."


# The end of a shape error whose tensors read as [B, N, H, D]: the layout of
# FlashAttention's API and of a projection's output before its heads are moved
_SEQUENCE_FIRST = ("; if q, k and v are [B, N, H, D] (sequence before heads, as "
                   "FlashAttention takes them), pass q.transpose(1, 2), k.transpose(1, 2) "
                   "and v.transpose(1, 2), and transpose the output back.")


def check_attention_inputs(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, *, method: str,
    query_padding_mask: Tensor | str | None = AUTO, allow_empty: bool = False,
) -> AttentionInputs:
    """Validate ``q, k, v`` and the masks and resolve the query/key masks (module doc);
    ``allow_empty``: sizes of 0 pass, but a head dim of 0 with keys and queries (the
    methods' results would not be SDPA's mean of the values)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{method}: {name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dim() != 4:
            raise ValueError(
                f"{method}: {name} must have shape [B, H, N, D] (4 dimensions), got shape "
                f"{tuple(t.shape)}; split heads first, e.g. x.view(B, N, H, D).transpose(1, 2)."
            )
        if t.dtype not in FLOAT_DTYPES:  # not float8, which no method computes in
            raise TypeError(
                f"{method}: {name} has dtype {t.dtype}; attention needs floating point "
                f"tensors of float32, float64, float16 or bfloat16, e.g. {name}.float()."
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"{method}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}."
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"{method}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}."
        )
    b, h, nq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[1] != h or v.shape[1] != h:
        raise ValueError(
            f"{method}: batch and head sizes differ: q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}; all must be [B, H, N, D] with the same B and H"
            + _grouped_hint(method, q, k, v)
        )
    if k.shape[-1] != d:
        raise ValueError(
            f"{method}: q and k must have the same head dim, got {d} and {k.shape[-1]}."
        )
    nk = k.shape[2]
    if v.shape[2] != nk:
        raise ValueError(
            f"{method}: k and v must have the same sequence length, got {nk} and {v.shape[2]}."
        )
    if 0 in (b, h, nq, nk, d, v.shape[-1]) and not (allow_empty and (d or not nq * nk)):
        zero = [name for name, size in zip(("B", "H", "Nq", "Nk", "D", "Dv"),
                                           (b, h, nq, nk, d, v.shape[-1]), strict=True)
                if size == 0]
        rule = ("the head dim D of q and k must be at least 1 where there are queries and "
                "keys to score" if allow_empty else f"{', '.join(zero)} "
                f"{'is' if len(zero) == 1 else 'are'} 0, and every dimension (B, H, N, D, "
                f"Dv) must be at least 1 (skip the call for an empty batch)")
        raise ValueError(
            f"{method}: empty input, q {tuple(q.shape)}, k {tuple(k.shape)}, v "
            f"{tuple(v.shape)}; {rule}.")

    try:
        key_valid = check_padding_mask(method, "key_padding_mask", key_padding_mask, b, nk,
                                       "Nk", k)
    except ValueError as error:  # a mask of as many tokens as dim 1 holds: the layout?
        if not (tuple(key_padding_mask.shape) == (b, h) and h > nk):
            raise
        raise ValueError(str(error).removesuffix(".") + _SEQUENCE_FIRST) from None
    if isinstance(query_padding_mask, str):
        check_query_mask_word(method, query_padding_mask)
        query_valid = key_valid if nq == nk else None
    else:
        query_valid = check_padding_mask(method, "query_padding_mask", query_padding_mask, b,
                                         nq, "Nq", q)
    return AttentionInputs(b, h, nq, nk, d, v.shape[-1], key_valid, query_valid)


def check_query_mask_word(method: str, query_padding_mask: str) -> None:
    """Fail in a sentence unless the one word ``query_padding_mask`` takes is given."""
    if query_padding_mask != AUTO:
        raise ValueError(
            f"{method}: query_padding_mask must be a bool tensor [B, Nq], None or "
            f"{AUTO!r}, got {query_padding_mask!r}."
        )


def check_padding_mask(method: str, name: str, m: object, b: int, n: int, n_name: str,
                       like: Tensor) -> Tensor | None:
    """A padding mask ``[B, n]`` bool (True = real token) on ``like``'s device, or None."""
    if m is None:
        return None
    if not isinstance(m, Tensor):
        raise TypeError(f"{method}: {name} must be a torch.Tensor or None.")
    if m.dtype != torch.bool:
        additive = (" An additive float mask (0 = real token, -inf = padding, as "
                    "torch.nn.MultiheadAttention takes) converts with mask == 0."
                    if m.is_floating_point() else "")
        raise TypeError(
            f"{method}: {name} must be a bool tensor (True = real token), got {m.dtype}; "
            f"a 0/1 attention mask (1 = real token, as transformers') converts with "
            f"mask == 1.{additive}"
        )
    if tuple(m.shape) != (b, n):
        raise ValueError(
            f"{method}: {name} must have shape [B, {n_name}] = [{b}, {n}], got "
            f"{tuple(m.shape)}."
        )
    check_device(method, name, m, like.device)
    return m


def check_device(method: str, name: str, t: Tensor, device: torch.device) -> None:
    """A sentence where tensor ``t`` (argument ``name``: a mask, a method's state) is not
    on the inputs' ``device``, with the ``.to`` call that moves it."""
    if t.device != device:
        raise ValueError(f"{method}: {name} is on {t.device} but the inputs are on "
                         f"{device}; pass {name}.to('{device}').")


def zero_padded_queries(out: Tensor, query_valid: Tensor | None) -> Tensor:
    """Set the output rows of padded queries to zero. ``out: [B, H, Nq, Dv]``."""
    if query_valid is None:
        return out
    return torch.where(query_valid[:, None, :, None], out, 0.0)  # where: NaN * 0 is NaN


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype the kernel arithmetic runs in: half types are upcast to float32.

    The Gaussian kernel's exponent ``q.k - |q|^2/2 - |k|^2/2`` is a difference of
    large terms; in 8 mantissa bits (bfloat16) it loses everything.
    """
    return torch.float32 if dtype in HALF_DTYPES else dtype


def check_generator(method: str, generator: object, device: torch.device) -> None:
    """``generator`` is ``None``, a ``torch.Generator`` on the inputs' device type, or a
    random key (``skyformer.random_key``, ``sketch/rng.py``)."""
    if generator is None:
        return
    if isinstance(generator, Tensor):
        check_key(generator, method)
        if generator.dim() != 1:  # [B, 2]: the sketches fold in the batch index themselves
            raise TypeError(
                f"{method}: generator takes one random key, an int64 tensor [2] "
                f"(skyformer.random_key(...)), got shape {tuple(generator.shape)}; each batch "
                f"element already draws its own numbers from it (for one key per element, "
                f"call the method per element, or torch.func.vmap it over the keys)."
            )
        return
    if not isinstance(generator, torch.Generator):
        seed = isinstance(generator, int) and not isinstance(generator, bool)
        raise TypeError(
            f"{method}: generator must be a torch.Generator, a random key "
            f"(skyformer.random_key(...)) or None, got {type(generator).__name__}"
            + (f" {generator!r}; for a seed pass generator=skyformer.random_key({generator!r})."
               if seed else ".")
        )
    if torch.compiler.is_compiling():
        raise TypeError(
            f"{method}: torch.compile cannot trace a torch.Generator; pass a random key "
            f"instead, generator=skyformer.random_key(g) (an int64 tensor, drawn outside "
            f"the compiled code), or None to draw from torch's global generator."
        )
    if generator.device.type != device.type:
        raise ValueError(
            f"{method}: generator is on {generator.device} but the inputs are on {device}; "
            + ("pass a random key on that device instead, "
               f"generator=skyformer.random_key(generator).to({str(device)!r})."
               if device.type == "meta" else
               "create it with torch.Generator(device=q.device).")
        )


def resolve_key(method: str, generator: object, device: torch.device, *,
                needed: bool = True) -> Tensor | None:
    """The call's random key ``[2]``: checks ``generator`` (``check_generator``), then one
    draw of it (of torch's global generator for ``None``), or the key it is. ``needed``
    False (the caller holds its draws, e.g. a layer's fixed projection): checked only,
    None returned, and no generator is drawn from."""
    check_generator(method, generator, device)
    if not needed:
        return None
    if isinstance(generator, torch.Generator) and recomputing():
        raise ValueError(
            f"{method}: activation checkpointing recomputes the forward in the backward "
            f"pass, where a torch.Generator gives its next draw, not the forward's (other "
            f"random draws: the gradients of another function; the checkpoint restores "
            f"torch's global generator only). Pass a random key drawn outside the "
            f"checkpointed function, generator=skyformer.random_key(g), or None to draw "
            f"from torch's global generator."
        )
    try:
        return random_key(generator, device)  # type: ignore[arg-type]
    except RuntimeError as error:
        if "randomness error mode" not in str(error):
            raise
        source = "torch's global generator" if generator is None else "a torch.Generator"
        raise RuntimeError(
            f"{method}: the call draws its random key from {source} inside "
            f"torch.func.vmap (which jacfwd and hessian run too), whose default "
            f"randomness='error' refuses random draws. Draw the key outside the mapped "
            f"function, generator=skyformer.random_key(seed or generator): the same draws "
            f"for every mapped element, as a Jacobian needs (vmap over a stack of keys "
            f"[R, 2] for R draws); or pass randomness='same' (vmap, jacfwd) for one draw "
            f"shared by the elements, or randomness='different' (vmap) for a draw per "
            f"element."
        ) from error


def recomputing() -> bool:
    """Whether this forward runs inside a backward pass: activation checkpointing's
    recomputation of the forward (``torch.utils.checkpoint``, reentrant or not)."""
    return torch._C._current_graph_task_id() != -1


def mean_values(v: Tensor, key_valid: Tensor | None, reduce: KeyReduction = WHOLE) -> Tensor:
    """Mean of the values over real keys, ``[B, H, 1, Dv]`` (zero if there are none);
    ``reduce`` completes the sums when ``v`` is a shard of the keys (``reduction.py``)."""
    if key_valid is None and reduce is WHOLE:
        return v.mean(dim=2, keepdim=True)
    w = torch.ones_like(v[:1, :1, :, :1]) if key_valid is None \
        else key_valid[:, None, :, None].to(v.dtype)  # [B|1, 1, Nk, 1]
    total = reduce.sum(torch.cat([(v * w).sum(dim=2, keepdim=True),
                                  w.sum(dim=2, keepdim=True).expand(*v.shape[:2], 1, 1)], -1))
    return total[..., :-1] / total[..., -1:].clamp_min(1.0)
