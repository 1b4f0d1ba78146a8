"""Launch options timed on the GPU by ``lemma3_tiles.py``, ``product_tiles.py`` and
``flash_tiles.py``, put in place of the library's defaults for a measurement
(``gpu_kernels.py --tiles``, ``gpu_profile.py --tiles``): the call as it will run once
they are the defaults."""

from __future__ import annotations

import contextlib
import json

import flash_tiles  # benchmarks/, beside this module
import lemma3_tiles
import product_tiles

SWEEPS = {"lemma3": lemma3_tiles, "products": product_tiles, "flash": flash_tiles}


@contextlib.contextmanager
def applied(paths: list[str] | None):
    """The ``best`` of each JSON in ``paths`` (written by one of ``SWEEPS``), applied."""
    with contextlib.ExitStack() as stack:
        for path in paths or ():
            with open(path) as f:
                result = json.load(f)
            kind = result.get("kind")
            if kind not in SWEEPS:
                raise SystemExit(f"{path}: not the output of lemma3_tiles.py, "
                                 f"product_tiles.py or flash_tiles.py (kind {kind!r}); run "
                                 "one of them first.")
            print(f"launch options from {path}:", flush=True)
            stack.enter_context(SWEEPS[kind].applied(result["best"]))
        yield


def graphed_options():
    """The graphed launch options of ``applied`` for the calls inside, the warm-up before
    a CUDA graph capture too (``lemma3_tiles.graphed_options``)."""
    return lemma3_tiles.graphed_options()
