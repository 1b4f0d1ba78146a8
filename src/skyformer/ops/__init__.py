"""Attention functions on ``[B, H, N, D]``, one folder per method; importing this package
registers them.

Each folder holds the method's fast module(s), ``naive.py`` (the materialising reference
the tests compare with) and a README (equations, paper, deliberate differences from the
published code). ``shared/`` holds what several methods use: input checks, option
checks, masked softmax, the modified Nystrom core, the LSH-block exact part.

Registration order (the order of ``list_methods()``) is the import order below, kept by
hand (``isort: skip_file``): exact methods, Skyformer, then the methods it is compared with.
"""
# isort: skip_file

from .softmax import softmax_attention
from .kernelized import kernelized_attention
from .skyformer import skyformer_attention
from .nystrom_softmax import nystrom_softmax_attention
from .nystromformer import nystromformer_attention
from .linformer import linformer_attention
from .linear import linear_attention
from .informer import informer_attention
from .bigbird import bigbird_attention
from .performer import performer_attention
from .reformer import reformer_attention
from .kdeformer import kdeformer_attention
from .scatterbrain import scatterbrain_attention
from .skyformer_adaptive import skyformer_adaptive_attention
from .multipole import skyformer_multipole_attention, softmax_multipole_attention

__all__ = [
    "bigbird_attention",
    "informer_attention",
    "kdeformer_attention",
    "kernelized_attention",
    "linear_attention",
    "linformer_attention",
    "nystrom_softmax_attention",
    "nystromformer_attention",
    "performer_attention",
    "reformer_attention",
    "scatterbrain_attention",
    "skyformer_adaptive_attention",
    "skyformer_attention",
    "skyformer_multipole_attention",
    "softmax_attention",
    "softmax_multipole_attention",
]
