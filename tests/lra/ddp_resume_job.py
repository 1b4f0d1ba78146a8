"""Started by ``test_lra_ddp`` under torchrun: one run uninterrupted and the same run
stopped at step 4 (between two train log entries) and resumed, in one job.

The job owns the process group, so both trainers use it and neither destroys it.
Usage: ``ddp_resume_job.py CACHE OUT``.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from skyformer.distributed import destroy_process_group
from skyformer.lra import make_config, train


def main(cache: str, out: str) -> None:
    dist.init_process_group("gloo")
    cfg = make_config("listops", attention="softmax", steps=6, batch_size=16, lr=3e-3,
                      warmup=2, eval_every=3, log_every=3, eval_batches=None)
    common = {"cache_root": cache, "device": "cpu", "quiet": True, "tensorboard": False}
    train(cfg, out_dir=f"{out}/whole", **common)
    train(cfg, out_dir=f"{out}/cut", stop_after=4, **common)
    dist.barrier()  # process 0 has written last.pt
    train(cfg, out_dir=f"{out}/cut", resume=True, **common)
    dist.barrier()  # gloo: no process closes its connections while another still reads
    destroy_process_group()  # the library's: collected first, as `skyformer lra train` does


if __name__ == "__main__":
    main(*sys.argv[1:])
    # A finished job leaves without interpreter shutdown, where gloo's threads can
    # still abort a process that succeeded ("terminate called without an active
    # exception", seen once on a loaded 2-core CI machine); a failure above still
    # raises and fails the job.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
