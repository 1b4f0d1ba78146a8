"""What every call promises about padding and non-finite values (docs/reliability.md).

- Padded positions never matter, whatever they hold: before a method runs, padded keys
  and values (``key_padding_mask``) and padded queries are replaced by zeros with
  ``torch.where`` (a NaN times a zero mask would still be NaN), so no NaN, inf or huge
  value in padding can reach a real output or a gradient.
- A mask that marks no real token at all gets a warning from the entry points
  (``warn_if_no_real_key``): torch's convention, True = padding, given by mistake.
- A non-finite value in a real token is never hidden: the output rows it can reach are
  NaN, as with SDPA (a NaN query spoils its own row; a NaN key or value spoils every
  row of its batch element and head, in a causal call the rows at and after it; a
  method's own products may spoil earlier rows too, 0 times a NaN value being NaN),
  whatever the method's own arithmetic would have made of it (a fallback to mean(V), a
  clamp, a zero). The rows are marked by adding a
  detached flag that is 0 or NaN, so a marked row's gradient passes to the method as
  it is (``show_nonfinite``).

Both run at ``call_core``, the one path every call takes (and after the method in the
sequence-parallel calls, ``distributed/attention.py``); they are elementwise and
data-independent, so they compile, export and batch like the methods. A method may
make the marks itself where it reads q, k and v anyway (``marks_nonfinite_when``:
Skyformer in its Triton kernels' tiles), for the calls it names; ``call_core`` then
leaves out ``show_nonfinite``. The marks are idempotent (0 + 0, NaN + NaN), so a core
called directly, outside ``call_core``, may make them as well. Eager calls on
the CPU first ask whether q, k, v are finite at all (one min/max pass each, through
which NaN and inf propagate) and skip the row-wise check when they are: in a decoding
step over a long key/value cache that check cost ten times the attention itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..linalg.kernels import overwrite_in_eager
from ..linalg.tracing import may_read_values
from ..user_frame import warn_from_user_frame

# Where a mask marks no real token: the convention of the other libraries, and the fix
MASK_CONVENTION = ("Here True marks a real token (as transformers' attention_mask == 1); "
                   "torch.nn.MultiheadAttention's key_padding_mask marks padding with True: "
                   "pass ~mask, or None where nothing is padded.")


def warn_if_no_real_key(method: str, key_padding_mask: object, k: Any) -> None:
    """A warning where a bool ``key_padding_mask`` of the keys' ``[B, Nk]`` (``k: [B, H,
    Nk, D]``; a mask of another form gets the method's sentence instead) marks no real
    token at all: every output row is then zero, and such a mask is most often torch's
    convention (True = padding) given for a batch without padding. Read in eager calls
    on a CPU only, as the finite check: on a GPU the read would make the host wait for
    the queued work."""
    mask = _padding(key_padding_mask, k.shape[0], k.shape[-2], k.device) \
        if isinstance(k, Tensor) and k.dim() == 4 else None
    if mask is not None and mask.numel() and mask.device.type == "cpu" \
            and may_read_values(mask) and not mask.any():
        warn_from_user_frame(f"{method}: key_padding_mask is False everywhere, so every key "
                             f"is padding and every output row is 0. {MASK_CONVENTION}",
                             UserWarning)


def warn_if_every_key_is_torch_padding(layer: str, key_padding_mask: object) -> None:
    """``warn_if_no_real_key`` for a layer in torch's convention (True = padding): a bool
    ``key_padding_mask`` True everywhere (or a float one -inf everywhere, as torch's
    ``TransformerEncoderLayer`` passes a bool one on) pads every key, and every attention
    row is 0 (torch's own layer gives NaN rows on some of its paths); such a mask is most
    often one whose True marks the real tokens. CPU eager calls only, as there."""
    mask = key_padding_mask
    if not (isinstance(mask, Tensor) and mask.numel() and mask.device.type == "cpu"
            and (mask.dtype == torch.bool or mask.is_floating_point())
            and may_read_values(mask)):
        return
    if mask.all() if mask.dtype == torch.bool else torch.isneginf(mask).all():
        warn_from_user_frame(
            f"{layer}: key_padding_mask pads every key (True, or -inf, everywhere; True = "
            f"padding, as in torch.nn.MultiheadAttention), so every attention row is 0 and "
            f"the output is out_proj's bias; pass None where nothing is padded, or ~mask "
            f"for a mask whose True marks the real tokens (transformers' attention_mask == "
            f"1, skyformer's own layers).", UserWarning)


def _padding(mask: Any, batch: int, length: int, device: torch.device) -> Tensor | None:
    """A ``[B, N]`` bool mask (True = real) on ``device`` as given, or None (also for
    masks of another form or device, which the method's own checks answer with a
    sentence; ``torch.where`` would fail first, in torch's words)."""
    if isinstance(mask, Tensor) and mask.dtype == torch.bool and tuple(mask.shape) == (
            batch, length) and mask.device == device:
        return mask
    return None


def valid_rows(q: Tensor, k: Tensor, key_padding_mask: Any, query_padding_mask: Any
               ) -> tuple[Tensor | None, Tensor | None]:
    """(query_valid ``[B, Nq]``, key_valid ``[B, Nk]``) as the methods read them:
    ``"auto"`` takes the key mask for the queries when Nq == Nk."""
    b, nq, nk = q.shape[0], q.shape[-2], k.shape[-2]
    key_valid = _padding(key_padding_mask, b, nk, k.device)
    if isinstance(query_padding_mask, str):
        query_valid = key_valid if nq == nk else None
    else:
        query_valid = _padding(query_padding_mask, b, nq, q.device)
    return query_valid, key_valid


def zero_padding(q: Any, k: Any, v: Any, key_padding_mask: Any, query_padding_mask: Any
                 ) -> tuple[Any, Any, Any]:
    """q, k, v with padded rows replaced by zeros (module docstring)."""
    if not all(isinstance(t, Tensor) and t.dim() == 4 for t in (q, k, v)) \
            or k.shape[-2] != v.shape[-2]:
        return q, k, v
    query_valid, key_valid = valid_rows(q, k, key_padding_mask, query_padding_mask)
    if key_valid is not None:
        keep = key_valid[:, None, :, None]
        k, v = torch.where(keep, k, 0.0), torch.where(keep, v, 0.0)
    if query_valid is not None:
        q = torch.where(query_valid[:, None, :, None], q, 0.0)
    return q, k, v


def show_nonfinite(out: Any, q: Any, k: Any, v: Any, key_padding_mask: Any,
                   query_padding_mask: Any, owned: bool = False, causal: bool = False,
                   key_sums: Callable[[Tensor], Tensor] | None = None,
                   keys_before: Callable[[Tensor], Tensor] | None = None) -> Any:
    """``out`` with NaN in every real row a non-finite real input can reach (module
    docstring); q, k, v are the inputs after ``zero_padding``. ``owned``: ``out`` is a
    new tensor of one of the library's methods (the flag may then go into it in place,
    ``_writable``). ``causal``: row i reaches the keys and values j <= i only (a prefix
    sum of their row sums), as SDPA with ``is_causal``. ``key_sums``: completes the
    keys' and values' sums ``[B, Hk, 1]`` over the shards other processes hold (the
    sequence-parallel calls: every process then takes the same steps, without the CPU
    shortcut, which would skip the exchange on a process whose shard is finite);
    ``keys_before``, in causal calls, gives the same sums ``[B, Hk, 1]`` over the shards
    before this one."""
    if not isinstance(out, Tensor) or not out.is_floating_point() or out.dim() != 4 \
            or not all(isinstance(t, Tensor) and t.dim() == 4 for t in (q, k, v)):
        return out
    quick = key_sums is None and keys_before is None and q.device.type == "cpu" \
        and may_read_values(q, k, v, out)
    keys_finite = quick and _finite(k) and _finite(v)
    if keys_finite and _finite(q):
        return out
    query_valid, _ = valid_rows(q, k, key_padding_mask, query_padding_mask)
    sums = _sum(q, -1)  # [B, H, Nq]
    if not keys_finite:
        if causal and k.shape[-2] == q.shape[-2]:
            spoiled = (_sum(k, -1) + _sum(v, -1)).cumsum(-1)  # [B, Hk, N]: keys j <= i
            if keys_before is not None:
                spoiled = spoiled + keys_before(spoiled[..., -1:])
        else:
            spoiled = (_sum(k, (-2, -1)) + _sum(v, (-2, -1)))[..., None]  # [B, Hk, 1]
            if key_sums is not None:
                spoiled = key_sums(spoiled)
        if spoiled.shape[1] != sums.shape[1]:  # fewer key heads (grouped queries): any head
            spoiled = spoiled.sum(dim=1, keepdim=True)
        sums = sums + spoiled
    flag = sums * 0  # 0 where every sum is finite, NaN elsewhere
    if query_valid is not None:
        flag = torch.where(query_valid[:, None, :], flag, 0.0)
    if flag.shape != out.shape[:3]:
        return out
    flag = flag[..., None].to(out.dtype)
    return out.add_(flag) if owned and _writable(out, q, k, v) else out + flag


def marks_nonfinite_when(predicate: Callable[[Any, Any, Any, Any], bool]
                         ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for a method's core that marks non-finite rows itself, as
    ``show_nonfinite`` would, in the calls where ``predicate(q, k, v, config)`` holds
    (a function of the call's form: shapes, dtypes, devices, options), with q, k, v
    as the core receives them (after ``zero_padding``). The core evaluates the same
    predicate; tests compare its rows with ``show_nonfinite``'s."""
    def decorate(core: Callable[..., Any]) -> Callable[..., Any]:
        core.marks_nonfinite = predicate  # type: ignore[attr-defined]
        return core

    return decorate


def marked_by_core(core: Callable[..., Any], q: Any, k: Any, v: Any, config: Any) -> bool:
    """Whether ``core`` marks non-finite rows itself in this call
    (``marks_nonfinite_when``)."""
    predicate = getattr(core, "marks_nonfinite", None)
    return predicate is not None and bool(predicate(q, k, v, config))


def _writable(out: Tensor, *inputs: Tensor) -> bool:
    """Whether the flag may be added into a method's own output ``out`` in place: a
    plain contiguous tensor of eager code that no autograd graph holds (inference),
    sharing no memory with the inputs (the methods return a new tensor, often reshaped:
    a view of one), outside dispatch modes (selective checkpointing keeps operators'
    outputs to hand back in its recomputation: ``kernels.overwrite_in_eager``). Out of
    place, the method's output and the flagged copy are both alive for a moment: twice
    the output's memory, the peak of a long inference call."""
    if not overwrite_in_eager() or out.requires_grad or type(out) is not Tensor \
            or not out.is_contiguous():
        return False
    memory = out.untyped_storage().data_ptr()
    return all(t.untyped_storage().data_ptr() != memory for t in inputs)


def _sum(t: Tensor, dim: int | tuple[int, ...]) -> Tensor:
    """The sum of ``t`` along ``dim``, NaN or inf exactly where an entry is (or where
    finite entries add up past the range of the sum's dtype, float32 for half types:
    entries beyond 1e30 even for 10^8 of them, far beyond where every method's own
    squares and products overflow); ``show_nonfinite`` adds the sums a row can reach
    and multiplies them by 0 once, which gives 0 or NaN. Half types are summed in
    float32 (float16's range ends at 65504, which a head's keys add up past), read as
    they are, without a copy on CUDA. One operation and one read of ``t``
    (``torch.isfinite`` is four on CUDA: eq, abs, ne, and, then all and a not;
    ``(t * 0).sum`` wrote and read a copy of ``t``), and the flag added to the output
    marks its rows with no ``torch.where``, so the backward pass gets no operation
    from this check (``t`` is detached)."""
    return t.detach().sum(dim=dim, dtype=torch.promote_types(t.dtype, torch.float32))


def _finite(t: Tensor) -> bool:
    """Whether every entry of ``t`` is finite: one pass (NaN and inf reach min or max)."""
    return t.numel() == 0 or bool(torch.isfinite(torch.stack(t.aminmax())).all())
