"""Fixtures of the LRA tests: one CPU thread, a tiny prepared ListOps cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from skyformer.lra import prepare, write_listops
from tests.lra.release_files import TINY_RULES


@pytest.fixture(autouse=True)
def one_thread():
    """The models here are tiny: more threads only add contention on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def listops_cache(tmp_path_factory) -> Path:
    """A prepared cache of tiny generated ListOps (8 tokens)."""
    root = tmp_path_factory.mktemp("listops")
    write_listops(root / "src", train=256, dev=64, test=64, rules=TINY_RULES, seed=0)
    prepare("listops", root / "src", root / "cache", max_len=8)
    return root / "cache"
