"""Versions of installed packages, read without importing them (for checks at import)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys

# Triton's distribution is "triton" on PyPI, "pytorch-triton(-rocm|-xpu)" in PyTorch's
# own indexes.
TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu")


def major_minor(version: str) -> tuple[int, int]:
    """(major, minor) of a version string, from the leading digits of its first two parts:
    ``"2.11.0+cu130"`` -> (2, 11), ``"5.0.0rc1"`` -> (5, 0); a missing part counts 0."""
    parts = [re.match(r"\d*", piece)[0] for piece in version.split(".")[:2]]
    major, minor = (int(p or 0) for p in [*parts, "0"][:2])
    return major, minor


def distribution_version(*distributions: str) -> str | None:
    """The version string of the first of ``distributions`` installed, from its metadata;
    None when none is installed or its metadata has no version."""
    for name in distributions:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return version if isinstance(version, str) else None
    return None


def installed_version(*distributions: str) -> tuple[int, int] | None:
    """(major, minor) of the first of ``distributions`` installed (``distribution_version``)."""
    version = distribution_version(*distributions)
    return None if version is None else major_minor(version)


def triton_version() -> str | None:
    """Triton's full version where it can be imported, else None: the imported module's,
    or read from the metadata without importing it (an import takes 0.15 s)."""
    module = sys.modules.get("triton")
    if module is not None:
        return getattr(module, "__version__", None)
    if importlib.util.find_spec("triton") is None:
        return None
    return distribution_version(*TRITON_DISTRIBUTIONS)
