"""Triton's interpreter patches ``triton.language`` once a launch, not once a device call.

The interpreter runs a launch with ``triton.language`` patched (``_patch_lang``, restored
when the launch ends), and every call of a ``@triton.jit`` helper inside the kernel
(``tile``, ``product_rows``, ...) patches the same modules again: a scan of every member
of ``tl``, ``tl.core``, ``tl.tensor`` and ``tl.math`` that finds them patched already
and changes nothing. Measured on a Lemma 3 test (``py-spy``): 27 % of the interpreter's
time went to those repeats. Here a helper's call inside a launch whose patch covers the
modules it sees skips them; the launch's own patch and its restoring are Triton's.

Triton's private names: where they are missing (another Triton version), nothing is
changed and the tests run at the interpreter's own speed.
"""

from __future__ import annotations

import inspect
import threading


def patch_the_language_once_per_launch() -> None:
    """Routes ``triton.runtime.interpreter._patch_lang`` through a once-per-launch
    wrapper (idempotent)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # Triton is optional
        return
    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or getattr(patch, "once_per_launch", False):
        return
    launch = threading.local()  # the modules the running launch has patched
    found: dict[object, frozenset[int]] = {}

    def languages(fn) -> frozenset[int]:  # as _patch_lang finds them, once a function
        if fn not in found:
            found[fn] = frozenset(id(value) for value in fn.__globals__.values()
                                  if inspect.ismodule(value) and value in (tl, tl.core))
        return found[fn]

    class LaunchScope:
        """The launch's patch (Triton's scope, restored by the launch): restoring it ends
        the launch. A helper's call gets one with no scope, which nothing restores."""

        def __init__(self, scope=None) -> None:
            self.scope = scope

        def restore(self) -> None:
            if self.scope is not None:
                launch.patched = None
                self.scope.restore()

    def patch_once(fn):
        seen, patched = languages(fn), getattr(launch, "patched", None)
        if patched is not None and seen <= patched:
            return LaunchScope()  # a helper's call: already patched
        scope = patch(fn)
        if patched is not None:  # a helper seeing more modules than the kernel did
            launch.patched = patched | seen
            return scope
        launch.patched = seen
        return LaunchScope(scope)

    patch_once.once_per_launch = True
    interpreter._patch_lang = patch_once
