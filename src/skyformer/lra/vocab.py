"""Token ids of the LRA tasks. Id 0 is padding wherever padding can occur.

- ListOps: LRA's tokenizer (since it renamed the closing brackets) keeps operators,
  digits and the closing bracket and drops the parentheses of the release's nested
  format (they only mark the binary nesting of the generator's tree and carry no
  information); ids 1-15. The earlier pipeline, which the Skyformer code used, split on
  non-word characters and lost the closing brackets too (docs/lra.md); ``tokens=
  "reference"`` reproduces it (14 of the ids: operators and digits, no ``]``).
- Text and Retrieval: bytes of the UTF-8 text, id = byte + 1 (1-256).
- Image and Pathfinder: the 8-bit grey value itself (0-255). Every sequence has the
  full length, so no id is reserved for padding; the model's mask comes from the
  stored lengths, never from token values.
"""

from __future__ import annotations

import numpy as np

PAD = 0

LISTOPS_OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
LISTOPS_CLOSE = "]"
LISTOPS_TOKENS = (*LISTOPS_OPERATORS, LISTOPS_CLOSE, *tuple(str(d) for d in range(10)))
LISTOPS_IDS = {token: i + 1 for i, token in enumerate(LISTOPS_TOKENS)}
LISTOPS_IGNORED = ("(", ")")
# "lra": LRA's tokenizer since it renamed the closing brackets; "reference": the earlier
# one, which split on non-word characters, so the closing brackets were lost too.
LISTOPS_TOKENIZERS = ("lra", "reference")


def check_listops_tokenizer(tokens: str) -> None:
    """Refuse a ListOps tokenizer name other than those of ``LISTOPS_TOKENIZERS``."""
    if tokens not in LISTOPS_TOKENIZERS:
        raise ValueError(f"ListOps tokens must be one of {', '.join(LISTOPS_TOKENIZERS)}, "
                         f"got {tokens!r}.")


def encode_listops(source: str, tokens: str = "lra") -> np.ndarray:
    """Ids of a ListOps source string (whitespace-separated tokens), parentheses dropped,
    and with ``tokens="reference"`` the closing brackets too.

    Raises ``ValueError`` naming the first token that is not ListOps.
    """
    check_listops_tokenizer(tokens)
    ignored = LISTOPS_IGNORED if tokens == "lra" else (*LISTOPS_IGNORED, LISTOPS_CLOSE)
    ids = []
    for token in source.split():
        if token in ignored:
            continue
        try:
            ids.append(LISTOPS_IDS[token])
        except KeyError:
            raise ValueError(
                f"unknown token {token!r}; ListOps sources hold {' '.join(LISTOPS_TOKENS[:5])}, "
                f"digits 0-9 and parentheses"
            ) from None
    return np.asarray(ids, dtype=np.uint8)


def encode_bytes(data: bytes) -> np.ndarray:
    """Byte-level ids (byte + 1) of ``data``: ``[len(data)]`` uint16."""
    return np.frombuffer(data, dtype=np.uint8).astype(np.uint16) + 1
