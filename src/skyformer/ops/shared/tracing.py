"""Whether a method may look at tensor values to choose a branch or a shape.

Eager code can read a value (``bool(mask.all())``, a block count) to skip work or
allocate less. ``torch.compile`` and ``torch.func`` transforms cannot: a compiled graph
must not depend on the data, and a functorch-wrapped tensor (vmap, grad) has no single
value. Methods ask ``may_read_values`` and take the data-independent path (a bound, an
unconditional mask) when the answer is no; both paths give the same result.
"""

from __future__ import annotations

import torch
from torch import Tensor


def may_read_values(*tensors: Tensor) -> bool:
    """False under ``torch.compile`` or when any tensor is wrapped by a ``torch.func``
    transform."""
    if torch.compiler.is_compiling():
        return False
    return not any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)
