"""What a method can do, as data, and the sentence a caller gets when it cannot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Target = Literal["softmax", "gaussian"]
TARGETS: tuple[str, ...] = get_args(Target)  # the exact attentions a method approximates

CAPABILITY_TEXT = {
    "mask": "honour a key_padding_mask",
    "causal": "do causal masking",
    "cross_attention": "attend with a different number of queries and keys",
    "fixed_length": "run without a fixed max_seq_len",
    "half_precision": "take float16/bfloat16 inputs",
    "attn_mask": "take an arbitrary attn_mask",
    "gqa": "attend with fewer key/value heads than query heads",
    "varlen": "run packed variable-length sequences (cu_seqlens)",
    "independent_queries": "serve a causal decoder's cross-attention (its outputs mix the "
                           "queries, and a decoder's later queries are later tokens)",
    "weights": "give attention weights (its output is not one matrix of the queries and "
               "keys applied to the values)",
}


@dataclass(frozen=True)
class Capabilities:
    """What a method can do, as data.

    target: the exact attention the method equals or approximates: ``"softmax"``
        (softmax(QK^T/sqrt(D))V) or ``"gaussian"`` (kernelized attention C V).
    exact: computes its target exactly.
    mask: honours ``key_padding_mask``.
    causal: has a ``causal`` option.
    cross_attention: accepts Nq != Nk.
    randomized: output depends on the ``generator`` (one that is not gives the same
        output for every seed: ``approx`` evaluates it once for all of them).
    fixed_length: needs a fixed ``max_seq_len`` (e.g. Linformer's projections); more keys
        than it are refused in a sentence before the method runs.
    learned_parameters: owns trainable parameters (a ``state`` module, see ``Method``).
    half_precision: accepts float16/bfloat16 inputs.
    attn_mask: takes any SDPA-style ``attn_mask`` (bool or additive, broadcastable to
        ``[B, H, Nq, Nk]``); the others take key padding and (if ``causal``) causal masks.
    weight_dropout: ``dropout_p`` drops attention weights, as SDPA does; methods without
        a weight matrix drop entries of their output instead.
    gqa: runs grouped-query attention (key/value heads repeated to the query heads).
    varlen: runs packed variable-length batches (``cu_seqlens``), which run as a padded
        batch with its key padding mask: it follows ``mask`` unless given, and
        ``varlen=True`` with ``mask=False`` is refused.
    independent_queries: each query's output depends on that query, the keys and the
        values alone, not on the other queries (no landmarks, clusters or samples drawn
        from them). Needed in the cross-attention of a causal decoder, whose later
        queries are later target tokens: a method mixing them would let a position see
        the tokens after it in teacher-forced training. False unless declared.
    weights: the output is ``A V``, ``A`` a matrix of the queries, keys, masks and draws
        alone (not of the values): ``skyformer.attention_weights`` then gives ``A``.
        False unless declared (a method that draws by the values, or clamps its output
        to their range, has no such matrix).
    not_causal_because: for a method without ``causal``, why it cannot have it (a clause
        appended to the refusal).
    fixed_shapes_because: why ``torch.export`` cannot take a symbolic sequence length
        (``torch.export.Dim`` for N) for the method (its control flow follows N; a
        clause of the refusal); ``None``: it can.
    """

    target: Target
    exact: bool = False
    mask: bool = True
    causal: bool = False
    cross_attention: bool = True
    randomized: bool = False
    fixed_length: bool = False
    learned_parameters: bool = False
    half_precision: bool = True
    attn_mask: bool = False
    weight_dropout: bool = False
    gqa: bool = True
    varlen: bool | None = None  # None: as mask (__post_init__)
    independent_queries: bool = False
    weights: bool = False
    not_causal_because: str | None = None
    fixed_shapes_because: str | None = None

    def __post_init__(self) -> None:
        if self.varlen is None:
            object.__setattr__(self, "varlen", self.mask)
        elif self.varlen and not self.mask:
            raise ValueError(
                "Capabilities: varlen=True needs mask=True: packed variable-length "
                "sequences run as a padded batch with its key padding mask; leave varlen "
                "out (it follows mask) or give mask=True.")

    def has(self, capability: str) -> bool:
        """Whether the method can do ``capability`` (a key of ``CAPABILITY_TEXT``)."""
        if capability == "fixed_length":
            return not self.fixed_length
        return bool(getattr(self, capability))


def mask_forms(mask: bool, causal: bool) -> list[str]:
    """The masks a method without ``attn_mask`` takes: ``"key padding"`` (with ``mask``)
    and ``"causal"`` (with ``causal``), in that order."""
    return [form for form, able in (("key padding", mask), ("causal", causal)) if able]


def masks_taken(caps: Capabilities) -> str:
    """``"key padding and causal masks"``, ``"key padding masks"``, ... or ``"no
    masks"``: what a method without ``attn_mask`` takes, for its sentences."""
    return f"{' and '.join(mask_forms(caps.mask, caps.causal)) or 'no'} masks"


class CapabilityError(ValueError):
    """A method was asked for something its capabilities exclude."""


def capability_sentence(name: str, capability: str, able: list[str]) -> str:
    """``"<name> cannot <do it>; methods that can: <able>."``"""
    return (
        f"{name} cannot {CAPABILITY_TEXT[capability]}"
        + (f"; methods that can: {', '.join(able)}." if able else ".")
    )
