"""Counter-based random numbers: every draw is a pure function of a key and an index.

A *key* is an int64 tensor ``[..., 2]`` of two 32-bit words. ``uniform_at(key, index)``
hashes the key with each integer ``index`` (a 32-bit integer hash, Wellons' "lowbias32",
applied in rounds), so the number drawn for an item depends only on the key and on that
item's index, never on how many other numbers are drawn. That gives, by construction:

- padding and batch independence: a sampler that indexes its draws by the batch
  element and by the *rank of a real row* draws the same numbers whatever the padded
  width, wherever the padding is and whatever the other sequences are;
- ``torch.compile``: a draw is a few integer tensor ops, with no ``torch.Generator``
  object in the graph (Dynamo cannot trace one);
- the same numbers on every device for one key: the hash is integer arithmetic.

Callers keep passing a ``torch.Generator`` (or ``None``): ``random_key`` turns it into a
key with one draw, ``torch.randint`` on the generator's own device, and a CPU and a CUDA
generator seeded alike draw different numbers: for draws that match across devices pass
a key (``skyformer.random_key(seed)`` with an int seed, or one key made once and moved).
A key tensor (``skyformer.random_key(generator)``) can be passed wherever a generator
is, which is how randomised methods run inside ``torch.compile`` reproducibly (with
``None`` the key is drawn from torch's global generator, which compiled code supports).
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ..seeds import check_seed

_MASK = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: spreads consecutive indices
UNIFORM_SALT = 0x68E31DA4  # the salt of the (high) bits behind a uniform number
UNIFORM_LOW_SALT = 0x1B56C4E9  # the salt of float64's 21 low bits


def _mix(x: Tensor) -> Tensor:
    """lowbias32 on int64 tensors holding 32-bit values (products wrap; the mask keeps
    the low 32 bits, which is all the hash uses)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK
    return x ^ (x >> 16)


def random_key(source: torch.Generator | Tensor | int | None = None,
               device: torch.device | str | None = None) -> Tensor:
    """A key ``[2]`` (int64 on ``device``) from a generator (one draw, on the generator's
    own device: there the key stays where ``device`` is ``None``), an int seed in
    [0, 2^64) (as ``torch.Generator.manual_seed`` takes), an existing key or ``None``
    (one draw of torch's global generator); ``device`` ``None``: the CPU but for a
    generator's key."""
    if isinstance(source, Tensor):
        check_key(source)
        return source.to("cpu" if device is None else device)
    if isinstance(source, numbers.Integral) and not isinstance(source, bool):
        source = int(source)  # a NumPy integer is a seed too
        check_seed("a random key's seed", source)
        # hashed on the host whatever torch's default device (meta, a GPU), then moved
        lo, hi = (torch.tensor(word & _MASK, device="cpu") for word in (source, source >> 32))
        # one-to-one: the first word a bijection of the low half, the second of the high
        # half given the first (a fold_in of both words by the low half mapped about
        # 2^32 (1 - 1/e) seeds below 2^32 onto one key apiece: seeds 52406 and 69315 drew
        # alike)
        first = _mix(lo ^ 0x5BD1E995)
        key = torch.stack([first, _mix(hi ^ 0x27D4EB2F ^ first)])
        return key.to("cpu" if device is None else device)
    if source is not None and not isinstance(source, torch.Generator):
        raise TypeError(f"random_key takes a torch.Generator, an int seed, a key tensor or "
                        f"None, got {type(source).__name__} {source!r}.")
    # a generator draws on its own device (a CUDA generator refuses a CPU draw)
    drawn_on = source.device if source is not None else "cpu" if device is None else device
    key = torch.randint(0, 2**31, (2,), generator=source, device=drawn_on, dtype=torch.long)
    return key if device is None else key.to(device)


def check_key(key: object, method: str = "skyformer") -> None:
    """A key is an int64 tensor whose last dim has size 2."""
    if not isinstance(key, Tensor) or key.dtype != torch.long or key.dim() < 1 \
            or key.shape[-1] != 2:
        raise TypeError(
            f"{method}: a random key must be an int64 tensor [..., 2] "
            f"(skyformer.random_key(generator)), got "
            f"{tuple(key.shape) if isinstance(key, Tensor) else type(key).__name__}"
            f"{' ' + str(key.dtype) if isinstance(key, Tensor) else ''}."
        )


def fold_in(key: Tensor, data: int | Tensor) -> Tensor:
    """A new key derived from ``key [..., 2]`` and ``data`` (an int in [0, 2^32) or an
    integer tensor broadcasting against ``key[..., 0]``, of which the low 32 bits are
    folded in): independent streams for parts of a method, batch elements, heads. An
    int is hashed on the host: on a GPU, making it a tensor would be a blocking copy,
    which makes the host wait for the queued work. Under ``torch.compile`` an int may
    be symbolic (a size; an int argument once recompiled): dynamo shows it as an int,
    and hashed as one its bit operations became symbolic expressions that Inductor's
    C++ code cannot compile, so there (where a constant becomes part of the graph, no
    copy) and for anything else the data becomes a tensor first. A float, a bool or an
    int out of range is refused: its stream would be another's (1.5 and True are 1's,
    2^32 is 0's)."""
    if isinstance(data, np.integer):  # checked for range as the int it is
        data = int(data)
    _check_fold_in(key, data)
    if not isinstance(data, int) or torch.compiler.is_compiling():
        data = torch.as_tensor(data, device=key.device, dtype=torch.long)
    data = _mix(((data & _MASK) * _GOLDEN) & _MASK)
    k0, k1 = key[..., 0], key[..., 1]
    a = _mix(k0 ^ data)
    b = _mix(k1 ^ _mix(a + 0x632BE5AB))
    return torch.stack([a, b], dim=-1)


def _check_fold_in(key: object, data: object) -> None:
    """The key (an int64 key) and the data that ``fold_in`` would otherwise take for
    another's: a float, bool or complex number or tensor (truncated), or a Python int
    outside [0, 2^32) (folded by its low 32 bits; checked in eager code, where its value
    is known). Integer tensors and arrays, and symbolic ints, go as they are."""
    check_key(key, "fold_in")
    if isinstance(data, Tensor):
        integral = not (data.is_floating_point() or data.is_complex()
                        or data.dtype == torch.bool)
    elif isinstance(data, (np.ndarray, np.generic)):
        integral = data.dtype.kind in ("i", "u")
    else:  # a Python number, or a symbolic int under a tracer
        integral = not isinstance(data, (bool, float, complex))
    if not integral:
        shown = (f"a {data.dtype} tensor" if isinstance(data, Tensor) else
                 f"a NumPy {data.dtype} value" if isinstance(data, (np.ndarray, np.generic))
                 else f"{type(data).__name__} {data!r}")
        raise TypeError(f"fold_in: data must be an int in [0, 2^32) or an integer tensor, "
                        f"got {shown} (its values would be truncated).")
    if isinstance(data, int) and not torch.compiler.is_compiling() \
            and not 0 <= data <= _MASK:
        raise ValueError(f"fold_in: data must be in [0, 2^32) (its low 32 bits are folded "
                         f"in: {data} would give the stream of {data & _MASK}), got {data}.")


def stream_data(name: str) -> int:
    """The 32-bit FNV-1a hash of a stream's name (plain Python, so that torch.compile
    folds it to a constant)."""
    h = 0x811C9DC5
    for ch in name:
        h = ((h ^ ord(ch)) * 0x01000193) & _MASK
    return h


def stream(key: Tensor, name: str) -> Tensor:
    """The key of the named stream under ``key``: ``fold_in`` of a hash of ``name``
    (e.g. ``stream(key, "landmarks/queries")``), so that independent draws of one call
    never share numbers by accident."""
    return fold_in(key, stream_data(name))


def _bits(key: Tensor, index: Tensor, salt: int) -> Tensor:
    """32 random bits ``[...]`` for each ``index`` under ``key [..., 2]`` (broadcast)."""
    i = index & _MASK
    h = _mix(((i * _GOLDEN) & _MASK) ^ key[..., 0])
    h = _mix(h ^ key[..., 1] ^ salt)
    return _mix((h + i) & _MASK)


def uniform_at(key: Tensor, index: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Uniform numbers in [0, 1), one per entry of the integer tensor ``index``; ``key``
    ``[..., 2]`` broadcasts against ``index`` (its trailing dim aside). As many random bits
    as the dtype holds exactly below 1: 24 for float32, 11 for float16, 8 for bfloat16 (24
    rounded to a half type gave 1.0), 53 for float64."""
    index = index.to(device=key.device, dtype=torch.long)
    hi = _bits(key, index, UNIFORM_SALT)
    if dtype == torch.float64:
        lo = _bits(key, index, UNIFORM_LOW_SALT) >> 11  # 21 bits
        return ((hi << 21) + lo).to(torch.float64) * 2.0**-53
    # the bits of precision: -log2(eps) + 1 (24, 11, 8 for float32, float16, bfloat16)
    bits = min(24, 1 - int(math.log2(torch.finfo(dtype).eps)))
    return ((hi >> (32 - bits)).to(torch.float32) * 2.0**-bits).to(dtype)  # exact in dtype


def uniform(key: Tensor, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Tensor:
    """Uniform numbers ``[*key.shape[:-1], *shape]`` in [0, 1), indexed by their flat
    position in ``shape``."""
    index = torch.arange(math.prod(shape), device=key.device).view(shape)
    lead = key.shape[:-1]
    return uniform_at(key.view(*lead, *([1] * len(shape)), 2), index, dtype)


def normal(key: Tensor, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Tensor:
    """Standard normal numbers ``[*key.shape[:-1], *shape]`` (Box-Muller on two uniforms),
    each a function of its flat position in ``shape``."""
    u1 = uniform(fold_in(key, 0x51ED27), shape, torch.float64)
    u2 = uniform(fold_in(key, 0x2D8D4F), shape, torch.float64)
    radius = torch.sqrt(-2.0 * torch.log1p(-u1))  # 1 - u1 in (0, 1]: log finite
    return (radius * torch.cos(2.0 * math.pi * u2)).to(dtype)


def bulk_normal(key: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Standard normal numbers ``[*key.shape[:-1], *shape]`` (float32), each a function of
    its flat position in ``shape``, for draws with one number per sequence position.

    Flat positions 2i and 2i + 1 are the two outputs r cos t, r sin t of one Box-Muller
    pair on two 24-bit uniforms, so a number costs one hash where ``normal`` spends four
    (two 53-bit uniforms, one output): Linformer's direct call 2.6-7x faster on the CPU
    (``benchmarks/linformer_draw.py``). The price is the
    tails: |z| <= sqrt(2 ln 2^24) = 5.77, where ``normal`` reaches 8.6 (probability
    8e-9 of a draw beyond 5.77)."""
    count = math.prod(shape)
    index = torch.arange((count + 1) // 2, device=key.device)  # one per pair
    lead = key.shape[:-1]
    pair_key = key.view(*lead, 1, 2)
    u = uniform_at(fold_in(pair_key, 0x3C6EF372), index)  # [..., pairs] in [0, 1)
    angle = (2.0 * math.pi) * uniform_at(fold_in(pair_key, 0xA54FF53A), index)
    radius = torch.sqrt(-2.0 * torch.log1p(-u))  # 1 - u in (0, 1]: log finite
    z = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=-1)
    return z.flatten(-2)[..., :count].reshape(*lead, *shape)


def valid_rank(valid: Tensor | None, batch: int, n: int, device: torch.device,
               before: Tensor | None = None) -> Tensor:
    """Rank ``[B, n]`` (int64) of each row among the valid rows of its batch element,
    counted from ``before: [B]`` (the valid rows preceding these ``n``, when they are one
    shard of a longer sequence; 0 by default). Padded rows get ranks apart from every
    valid one (callers mask them)."""
    if valid is None:
        rank = torch.arange(n, device=device).expand(batch, n)
    else:
        rank = valid.long().cumsum(dim=1) - 1
        rank = torch.where(valid, rank, n + torch.arange(n, device=device))  # padded: apart
    return rank if before is None else rank + before.to(device)[:, None]


def row_uniform(key: Tensor, valid: Tensor | None, batch: int, n: int,
                dtype: torch.dtype = torch.float32, *, before: Tensor | None = None) -> Tensor:
    """One uniform number per row ``[B, n]``, indexed by (batch element, rank of the row
    among the valid rows): a sequence draws the same numbers for its real rows whatever
    its padding (left, right, holes), its padded width and the other sequences.
    Padded rows get numbers too; callers mask them. ``before``: see ``valid_rank`` (a
    shard of a sequence draws the numbers the whole sequence draws for those rows)."""
    device = key.device
    rank = valid_rank(valid, batch, n, device, before)
    keys = fold_in(key, torch.arange(batch, device=device))  # [B, 2]
    return uniform_at(keys[:, None, :], rank, dtype)


@contextlib.contextmanager
def cpu_draws_seeded(seed: int) -> Iterator[None]:
    """Inside: torch's CPU generator seeded with ``seed``; after: as it was. No GPU's
    generator is touched (``torch.manual_seed`` would seed them all, and ``fork_rng``
    over every device starts CUDA): for what is built on the CPU under a seed."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield


# torch's random functions and Tensor methods, and the nn.init functions (which take a
# generator since torch 2.2): every one takes ``generator=``
_RANDOM_FUNCTIONS = frozenset({
    "rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson",
    "rand_like", "randn_like", "randint_like",
    "normal_", "uniform_", "random_", "bernoulli_", "exponential_", "geometric_", "cauchy_",
    "log_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
    "xavier_normal_", "trunc_normal_", "orthogonal_", "sparse_",
})


class _DrawsFrom(TorchFunctionMode):
    """Gives ``generator`` to the random functions called without one."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.generator = generator

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if getattr(func, "__name__", None) in _RANDOM_FUNCTIONS \
                and kwargs.get("generator") is None:
            kwargs["generator"] = self.generator
        return func(*args, **kwargs)


@contextlib.contextmanager
def draws_from(generator: torch.Generator) -> Iterator[None]:
    """Inside, in this thread: torch's random functions (``torch.randn``,
    ``Tensor.normal_``, ``nn.init.*``, ...) called without a generator draw from
    ``generator``, in the order they are called, so a CPU one seeded with s gives what the
    global CPU generator seeded with s would; torch's global generators are neither read
    nor changed (other threads may draw meanwhile). For code that takes no generator, such
    as a Hugging Face model's initialisation. A torch function mode: thread-local; a
    draw inside another torch function that passes no generator on (``F.dropout``,
    ``F.gumbel_softmax``) is not seen and still takes torch's global generator."""
    with _DrawsFrom(generator):
        yield
