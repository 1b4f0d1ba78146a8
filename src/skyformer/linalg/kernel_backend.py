"""Which implementation computes the Gaussian block products: PyTorch or Triton.

``kernel="auto"`` takes the fused Triton kernels (``triton_kernels``) for float32 CUDA
tensors when Triton imports, and the chunked PyTorch path otherwise (CPU, float64,
``torch.export`` graphs, forward-mode AD, and after a kernel failed:
``KernelFallback``). Under ``torch.compile`` the kernels are custom operators
(``triton_ops``) that the compiled graph calls. ``"triton"`` insists: on a CPU tensor it
runs under Triton's interpreter, which must be switched on with ``TRITON_INTERPRET=1``
before Triton is first imported. ``"torch"`` always takes the PyTorch path.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from ..user_frame import warn_from_user_frame
from ..versions import TRITON_DISTRIBUTIONS, installed_version
from .functional_ops import exporting, functional_ops_only

KERNELS = ("auto", "torch", "triton")
HALF_TYPES = (torch.bfloat16, torch.float16)  # read by the kernels, computed in float32


def interpreter_problem(triton_version: tuple[int, int] | None,
                        numpy_version: tuple[int, int] | None) -> str | None:
    """Why Triton's interpreter cannot run here, or None. Before Triton 3.7 it reads
    loop bounds with ``int(array)`` on a one-element array, which NumPy 2.4 refuses:
    the kernels would fail deep inside the interpreter ("only 0-dimensional arrays can
    be converted to Python scalars")."""
    if triton_version is None or numpy_version is None:
        return None  # unknown versions: let the interpreter try
    if triton_version < (3, 7) and numpy_version >= (2, 4):
        return (f"Triton {'.'.join(map(str, triton_version))}'s interpreter "
                f"(TRITON_INTERPRET=1) cannot run with NumPy "
                f"{'.'.join(map(str, numpy_version))}: it converts one-element arrays to "
                "Python integers, which NumPy 2.4 refuses. Install triton>=3.7 or "
                "numpy<2.4 to run the Triton kernels on the CPU.")
    return None


# Read once at import: torch.compile traces the functions below, and some PyTorch
# versions refuse to trace importlib (torch 2.11: "find_spec should not be traced").
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
TRITON_VERSION = installed_version(*TRITON_DISTRIBUTIONS) if TRITON_INSTALLED else None
INTERPRETER_PROBLEM = (interpreter_problem(TRITON_VERSION, installed_version("numpy"))
                       if TRITON_INSTALLED else None)
FLOAT64_DOTS = (3, 5)  # the first Triton whose tl.dot takes float64 tiles


def float64_dots() -> bool:
    """Whether this Triton's ``tl.dot`` takes float64 tiles (the fused Lemma 3 kernels
    use it; the product kernels multiply float64 by broadcast sums instead)."""
    return TRITON_VERSION is None or TRITON_VERSION >= FLOAT64_DOTS


def triton_available() -> bool:
    """Whether Triton can be imported (it is not needed by the library otherwise)."""
    return TRITON_INSTALLED


def auto_device(y: Tensor) -> bool:
    """Whether ``kernel="auto"`` may take the Triton kernels for ``y``'s device: CUDA (on
    the CPU the PyTorch path is faster than the interpreter by far)."""
    return y.is_cuda


# The values Triton reads as true (``triton.knobs``: case aside, nothing else; "off",
# "false" and "2" leave the interpreter off)
_TRUE = ("1", "true", "on", "yes", "y")


def interpreter_on() -> bool:
    """Whether Triton runs kernels on the CPU through its interpreter: the variable read
    as Triton reads it (without importing Triton)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in _TRUE


def check_interpreter() -> None:
    """Raises ``INTERPRETER_PROBLEM`` (a sentence with the fix) where there is one."""
    if INTERPRETER_PROBLEM is not None:
        raise RuntimeError(INTERPRETER_PROBLEM)


def check_kernel(kernel: str) -> None:
    """A ``kernel`` option is one of ``KERNELS``; anything else gets a sentence."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(map(repr, KERNELS))}, got {kernel!r}.")


def use_triton(kernel: str, y: Tensor, *, half: bool = False) -> bool:
    """True when the products of ``y`` (and its partners) go through the Triton kernels.

    Never under ``torch.export`` or forward-mode AD (``functional_ops``): ``"auto"``
    takes the PyTorch path there, ``"triton"`` says so. Raises a sentence saying how to
    get the Triton path where ``kernel="triton"`` cannot be honoured. Float64 CUDA
    tensors take the PyTorch path under either (below); the interpreter runs float64.
    ``half``: the kernels also compute in ``y``'s half type (exact kernelized attention's
    flash kernels), which ``"triton"`` then accepts and ``"auto"`` takes too (on an
    H100 the flash kernels beat the SDPA augmentation in bfloat16 and float32 at every
    N measured, with under a tenth of its memory: docs/gpu-record.md).
    """
    check_kernel(kernel)
    if kernel == "torch":
        return False
    functional = functional_ops_only()
    if kernel == "auto":
        return (auto_device(y) and not functional and triton_available()
                and (y.dtype == torch.float32 or (half and y.dtype in HALF_TYPES)))
    if not triton_available():
        raise RuntimeError('kernel="triton" needs Triton: pip install triton (or use '
                           'kernel="auto", which falls back to PyTorch).')
    if exporting():
        raise RuntimeError('kernel="triton" cannot be exported by torch.export; use '
                           'kernel="auto" there (it takes the PyTorch path).')
    if functional:
        raise RuntimeError('kernel="triton" has no forward-mode derivative (torch.func.jvp, '
                           'jacfwd, forward_ad); use kernel="auto" there (it takes the '
                           'PyTorch path).')
    if not y.is_cuda and not interpreter_on():
        raise RuntimeError(
            f'kernel="triton" runs on CUDA tensors; this one is on {y.device}. To run the '
            "Triton kernels on the CPU, set TRITON_INTERPRET=1 before Python starts "
            '(slow, for testing), or use kernel="auto".')
    if interpreter_on():  # it runs the kernels whatever the tensors' device
        check_interpreter()
    elif y.dtype == torch.float64:
        # On a GPU Triton passes the kernels' float arguments (the output scale, the row
        # norm's coefficient) as float32: dy came out 1e-6 off in float64 on an H200.
        # Float64 runs the kernels under the interpreter (the tests' exact checks) only.
        return False
    if y.dtype not in (torch.float32, torch.float64) and not (half and y.dtype in HALF_TYPES):
        raise RuntimeError(f'kernel="triton" computes in float32 or float64, got {y.dtype}; '
                           "the attention methods convert half types to float32 first.")
    return True


class KernelTooLarge(RuntimeError):
    """A kernel configuration (its tiles) that needs more of a GPU's resources (shared
    memory) than the GPU has (``triton_limits``); ``first``: refused at this launch, not
    remembered from an earlier one. Under ``"auto"`` ``KernelFallback`` takes the
    PyTorch path for that configuration alone."""

    def __init__(self, need: str, *, first: bool) -> None:
        super().__init__(f'{need}; kernel="auto" takes the PyTorch path for these shapes, '
                         f'kernel="torch" for every shape')
        self.need, self.first = need, first


class KernelFallback:
    """The ``"auto"`` safety net of one Triton kernel family: ``run`` launches it and,
    under ``"auto"``, a failure (Triton installed but unable to compile or launch here:
    no C compiler, an old GPU, too few registers) warns once and takes the PyTorch path.
    The failure is remembered for the device and dtype of the tensor the kernel runs on
    (``on``: its device type and index, its dtype; ``failures``), so that later calls on
    that device in that dtype skip the kernel (``failed_on``, ``run`` too) while other
    dtypes and devices keep it: bfloat16 kernels that cannot compile on a GPU without
    bfloat16 tensor cores leave float32 on the kernels. ``"triton"`` insists: its
    failures propagate. Running out of GPU memory is not the kernel's failure (the
    PyTorch path would need more): it propagates under ``"auto"`` too, and the kernel
    stays in use. Nor is a configuration of tiles the GPU cannot hold
    (``KernelTooLarge``): ``"auto"`` takes the PyTorch path for those shapes only, with
    one warning each.

    The warning is attributed to the innermost caller outside Skyformer and PyTorch
    (``user_frame.user_frame``): the user's call of the method, or of ``backward()`` where a
    backward kernel failed, also from inside a custom operator or a compiled graph.

    Under ``torch.compile`` a custom operator is opaque: the compiled graph calls its
    implementation, and a ``run`` around the call is traced away. A kernel that
    ``"auto"`` takes there has its ``run`` inside the operator's implementation, which
    takes ``auto`` and returns the PyTorch path's result on failure: the Gaussian block
    products (``triton_ops``, ``product_fallback``; ``PRODUCT_FALLBACK``) and exact
    kernelized attention's flash kernels (``flash.py``). ``"auto"`` takes the Lemma 3
    kernel and the landmark draws in eager code only (``CORE_FALLBACK``,
    ``DRAW_FALLBACK``, around their calls), but compiled autograd traces the backward
    pass of an eager forward: the Lemma 3 backward operator holds its ``run`` inside
    too. A traced ``failed_on`` guards on
    ``failures``: a compiled function recompiles once after a failure."""

    def __init__(self, name: str, instead: str) -> None:
        self.name, self.instead = name, instead
        # (device, dtype) of the tensors the kernel failed on; a set, not a dict: dynamo
        # (torch 2.13) guarded ``bool(d) and key in d`` on a dict wrongly (a compiled
        # function kept its graph after a second key was added), on a set rightly
        self.failures: set[tuple[torch.device, torch.dtype]] = set()

    @property
    def failed(self) -> bool:
        """Whether the kernel failed on any device and dtype (``failures``)."""
        return bool(self.failures)

    def failed_on(self, on: Tensor) -> bool:
        """Whether the kernel failed for ``on``'s device and dtype: ``"auto"`` then takes
        the PyTorch path for it up front. No allocation until a kernel failed."""
        return bool(self.failures) and (on.device, on.dtype) in self.failures

    def run(self, auto: bool, launch: Callable[[], Any], fallback: Callable[[], Any], *,
            on: Tensor) -> Any:
        """``launch()`` on ``on``'s device (``launch_device``); under ``auto``,
        ``fallback()`` where the kernel failed for ``on``'s device and dtype, now (with a
        warning) or before."""
        with launch_device(on):
            return self._run(auto, launch, fallback, on)

    def _run(self, auto: bool, launch: Callable[[], Any], fallback: Callable[[], Any],
             on: Tensor) -> Any:
        if not auto:
            return launch()
        if self.failed_on(on):
            return fallback()
        try:
            return launch()
        except torch.OutOfMemoryError:
            raise
        except KernelTooLarge as error:  # these shapes alone: the others keep the kernel
            # (inside a CUDA graph capture too: Triton refuses before any CUDA call, so
            # the capture is intact, and a refusal remembered makes no call at all)
            if error.first:
                warn_from_user_frame(f"{error.need}; {self.instead} for these shapes "
                                      f"from now on (other shapes keep the Triton path).")
            return fallback()
        except Exception as error:  # any compiler or driver error
            if _capturing(on):  # the capture's failure, not the kernel's (below)
                raise
            self.failures.add((on.device, on.dtype))
            warn_from_user_frame(
                f"the Triton {self.name} failed for {_dtype_name(on.dtype)} tensors on "
                f"{on.device} ({type(error).__name__}: {error}); {self.instead} for them "
                "from now on (other dtypes and devices keep the Triton path).")
            return fallback()


def launch_device(on: Tensor) -> contextlib.AbstractContextManager:
    """A context making ``on``'s CUDA device the current one where it is not: Triton
    launches on the current device and its stream, so a kernel for tensors on another
    GPU of the process would read them from the wrong device (or race its stream).
    Nothing elsewhere, nor while traced (a compiled graph calls the custom operators,
    whose ``run`` enters it at run time)."""
    if not on.is_cuda or torch.compiler.is_compiling() or on.device.index is None \
            or on.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(on.device)


def _capturing(on: Tensor) -> bool:
    """Whether ``on``'s CUDA stream is capturing a CUDA graph. A kernel first compiled or
    loaded inside a capture fails because of the capture (CUDA refuses a module load
    there: warm up first, ``graph_launches``), and the capture is broken whatever runs
    next: the error propagates, and the kernel stays in use."""
    return on.is_cuda and torch.cuda.is_current_stream_capturing()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_AUTOGRAD_KEYS = ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor")


@contextlib.contextmanager
def autograd_in_operator() -> Iterator[None]:
    """Autograd on, also inside a custom operator's implementation, which the dispatcher
    runs below autograd (its keys excluded, grad mode often off): for a fallback that
    differentiates the PyTorch path there, from leaves detached first."""
    with contextlib.ExitStack() as stack:
        for key in _AUTOGRAD_KEYS:
            stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(
                getattr(torch._C.DispatchKey, key), False))
        stack.enter_context(torch.enable_grad())
        yield
