"""Versions of installed packages, read without importing them (for checks at import)."""

from __future__ import annotations

import importlib.metadata
import re


def major_minor(version: str) -> tuple[int, int]:
    """(major, minor) of a version string, from the leading digits of its first two parts:
    ``"2.11.0+cu130"`` -> (2, 11), ``"5.0.0rc1"`` -> (5, 0); a missing part counts 0."""
    parts = [re.match(r"\d*", piece)[0] for piece in version.split(".")[:2]]
    major, minor = (int(p or 0) for p in [*parts, "0"][:2])
    return major, minor


def installed_version(*distributions: str) -> tuple[int, int] | None:
    """(major, minor) of the first of ``distributions`` installed, from its metadata;
    None when none is installed or its metadata has no version."""
    for name in distributions:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return major_minor(version) if isinstance(version, str) else None
    return None
