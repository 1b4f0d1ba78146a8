"""Kernels compiled for a GPU without one: ``benchmarks/triton_resources.py`` run in a
process of its own (compiling needs Triton's JIT, which the tests' interpreter replaces),
its rows read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _compiler_present() -> bool:
    try:
        import triton
    except ImportError:
        return False
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return (tools / "ptxas").exists() and (tools / "cuobjdump").exists()


def _missing() -> str | None:
    """Why the kernels cannot be compiled for a GPU here (None: they can)."""
    if not _compiler_present():
        return "Triton's ptxas and cuobjdump are needed to compile for a GPU without one"
    from skyformer.linalg.kernel_backend import INTERPRETER_PROBLEM

    if INTERPRETER_PROBLEM is not None:  # GPU images pair Triton 3.6 with NumPy 2.5
        return f"the launches are recorded under Triton's interpreter: {INTERPRETER_PROBLEM}"
    return None


needs_compiler = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")


def compiled_rows(out: Path, *options: str) -> list[dict]:
    """The rows (one per distinct launch: registers, stack, spills, warps per SM) that
    ``triton_resources.py OPTIONS --out OUT`` writes, for Skyformer at N = 40."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "triton_resources.py"),
                           "--methods", "skyformer", "--n", "40", *options, "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:  # the child's own words, not only its exit status
        pytest.fail(f"triton_resources.py {' '.join(options)} exited {done.returncode}:\n"
                    f"{done.stderr[-4000:]}", pytrace=False)
    return json.loads(out.with_suffix(".json").read_text())["rows"]
