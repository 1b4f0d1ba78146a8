"""Triton's interpreted launches in one worker thread, whose Python stack starts shallow.

CPython 3.11 keeps frames on a stack of 16 KiB chunks and unmaps a chunk as soon as the
frame at its base returns. The interpreter runs a kernel as deep chains of small Python
calls, and at some depths of the caller's stack one of its hottest calls lands at a
chunk's base: every such call then maps and unmaps a chunk. Measured here: the same
Skyformer forward + backward under the interpreter (B = 1, H = 2, N = 64, D = 16,
m = 16, ``kernel="triton"``, called under 0 to 152 extra Python frames of eight
arguments each) took 0.7 s at most depths and up to 2.7 s at others, so a test's time
depended on how deep pytest happened to call it (a refactor of the Lemma 3 kernels that
added one call level made some tests 3x slower).

In a worker thread every launch starts from the same shallow stack. The caller's
thread-local autograd state goes with it (grad and inference mode); other thread-local
state does not (autocast, torch function and dispatch modes, saved-tensor hooks), so a
dispatch-mode recorder sees the launch's custom operator but not the interpreter's own
tensor copies inside it. A launch made from the worker itself runs there directly.
"""

from __future__ import annotations

import concurrent.futures
import threading

import torch


def run_interpreted_launches_in_a_worker_thread() -> None:
    """Routes ``InterpretedFunction.run`` (every launch under ``TRITON_INTERPRET=1``)
    through one worker thread; the caller waits for it, so launches stay in order."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # Triton is optional
        return
    if getattr(InterpretedFunction.run, "in_worker_thread", False):
        return
    worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="triton-interpreter")
    launch = InterpretedFunction.run

    def run(self, *args, **kwargs):
        if threading.current_thread().name.startswith("triton-interpreter"):
            return launch(self, *args, **kwargs)  # nested: waiting on itself would hang
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

        def in_worker():
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                return launch(self, *args, **kwargs)
        return worker.submit(in_worker).result()

    run.in_worker_thread = True
    InterpretedFunction.run = run
