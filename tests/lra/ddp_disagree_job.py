"""Started by ``test_lra_ddp`` under torchrun: runs whose two processes disagree, each
refused on both processes with a sentence (written to OUT/saidRANK.txt, a line per case)
instead of a hang.

The job owns the process group, so every trainer uses it and none destroys it.
Usage: ``ddp_disagree_job.py CACHE OUT``.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch.distributed as dist

from skyformer.distributed import destroy_process_group
from skyformer.io import LOCK_FILE
from skyformer.lra import make_config, train


def main(cache: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = make_config("listops", attention="softmax", steps=6, batch_size=16, lr=3e-3,
                      warmup=2, eval_every=3, log_every=3, eval_batches=1)
    common = {"cache_root": cache, "device": "cpu", "quiet": True, "tensorboard": False}
    cases = {  # process 1's run, where process 0 runs cfg in out/NAME
        "settings": lambda: train(dataclasses.replace(cfg, steps=9, lr=1e-3),
                                  out_dir=f"{out}/settings", **common),
        "stop_after": lambda: train(cfg, out_dir=f"{out}/stop_after", stop_after=4, **common),
        # the run folder not shared: process 1 finds no last.pt in its own copy of the path
        "resume": lambda: train(cfg, out_dir=f"{out}/resume1", resume=True, **common),
        # the folder in use by another run, which only process 0 checks
        "in_use": lambda: train(cfg, out_dir=f"{out}/in_use", **common),
        # a file where the run folder goes, which only process 0 (making it) finds
        "not_a_folder": lambda: train(cfg, out_dir=f"{out}/not_a_folder", **common),
    }
    if rank == 0:
        with open(f"{out}/not_a_folder", "w", encoding="utf-8") as handle:
            handle.write("a file\n")
        os.makedirs(f"{out}/in_use")
        with open(f"{out}/in_use/{LOCK_FILE}", "w", encoding="utf-8") as handle:
            handle.write("another-host-1\n")
    train(cfg, out_dir=f"{out}/resume", stop_after=3, **common)
    dist.barrier()  # process 0 has written last.pt
    said = []
    for name, other in cases.items():
        try:
            if rank == 1:
                other()
            else:
                train(cfg, out_dir=f"{out}/{name}", resume=name == "resume", **common)
        except (ValueError, OSError) as error:
            said.append(f"{name}: {error}\n")
        dist.barrier()
    with open(f"{out}/said{rank}.txt", "w", encoding="utf-8") as handle:
        handle.writelines(said)
    dist.barrier()  # gloo: no process closes its connections while another still reads
    destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    sys.stdout.flush()  # left without interpreter shutdown, as ddp_resume_job.py does
    sys.stderr.flush()
    os._exit(0)
