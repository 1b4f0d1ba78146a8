"""Independent random streams derived from one user seed."""

from __future__ import annotations

import numpy as np


def derive_seed(*words: int) -> int:
    """A 63-bit seed from integers, e.g. ``(seed, rank, purpose)``: different words give
    statistically independent streams (numpy's ``SeedSequence`` hashing)."""
    state = np.random.SeedSequence([int(w) for w in words]).generate_state(2, np.uint64)
    return int(state[0] >> np.uint64(1))
