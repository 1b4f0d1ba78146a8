"""A second thread drawing from torch's global generator while a test's own thread is
paused at a barrier: for the tests that seeded construction is apart from other
threads' draws."""

from __future__ import annotations

import threading

import torch

SEED = 123  # of the global generator, before the draws alone and before the thread's


def draws_alone(times: int) -> list[torch.Tensor]:
    """What ``GlobalDraws(barrier, times)`` draws when nothing else draws."""
    torch.manual_seed(SEED)
    return [torch.rand(3) for _ in range(times)]


class GlobalDraws:
    """``times`` draws of ``torch.rand(3)`` from the global generator (seeded with
    ``SEED`` at ``start``) by a thread of its own, each between two waits on
    ``barrier``; ``drawn`` holds them after ``join``."""

    def __init__(self, barrier: threading.Barrier, times: int) -> None:
        self.barrier, self.times, self.drawn = barrier, times, []
        self.thread = threading.Thread(target=self._draw)

    def _draw(self) -> None:
        for _ in range(self.times):
            self.barrier.wait()
            self.drawn.append(torch.rand(3))
            self.barrier.wait()

    def start(self) -> None:
        torch.manual_seed(SEED)
        self.thread.start()

    def join(self) -> None:
        self.thread.join()
