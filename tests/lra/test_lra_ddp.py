"""Data-parallel training: 2 CPU processes (gloo) under torchrun match one process that
accumulates the same two micro-batches, and resume as if never interrupted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import skyformer
from skyformer.lra import make_config, train
from skyformer.lra.checkpoint import load_checkpoint

ARGS = ["--attn", "softmax", "--dropout", "0", "--steps", "6", "--batch-size", "16",
        "--lr", "3e-3", "--warmup", "2", "--eval-every", "3", "--log-every", "3", "--full-dev",
        "--no-tensorboard"]


def _torchrun(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``args`` under torchrun with 2 CPU processes; fails the test if the job fails."""
    src = str(Path(skyformer.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           *args]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env) as job:
        try:
            out, err = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            job.terminate()  # torchrun stops its workers on SIGTERM; SIGKILL would orphan them
            out, err = job.communicate()
            raise AssertionError(f"the job hung for {timeout} s:\n{out[-3000:]}"
                                 f"{err[-3000:]}") from None
    proc = subprocess.CompletedProcess(cmd, job.returncode, out, err)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _entries(folder: Path) -> list[dict]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("seconds", "steps_per_second")}
            for r in rows]


def test_two_gloo_processes_match_one_process_with_accumulation(listops_cache, tmp_path):
    proc = _torchrun("-m", "skyformer", "lra", "train", "listops", *ARGS, "--cache",
                     str(listops_cache), "--out", str(tmp_path / "ddp"))
    assert proc.stdout.count("best dev step") == 1, "only the main process reports"

    cfg = make_config("listops", attention="softmax", dropout=0.0, steps=6, batch_size=16, lr=3e-3,
                      warmup=2, eval_every=3, log_every=3, eval_batches=None, grad_accum=2)
    single = train(cfg, cache_root=listops_cache, out_dir=tmp_path / "one", quiet=True,
                   tensorboard=False)
    ddp = json.loads((tmp_path / "ddp" / "result.json").read_text())
    assert ddp["world_size"] == 2 and single["world_size"] == 1
    a = load_checkpoint(tmp_path / "ddp" / "last.pt")
    b = load_checkpoint(tmp_path / "one" / "last.pt")
    for key in b["model"]:
        # Same examples per step; only the order of floating-point sums differs.
        torch.testing.assert_close(a["model"][key], b["model"][key], rtol=1e-4, atol=2e-5)
    assert len(a["rng"]["processes"]) == 2
    assert not torch.equal(a["rng"]["processes"][0]["torch"], a["rng"]["processes"][1]["torch"])
    # Evaluation is shared out and summed: the whole dev split is counted once.
    lines = (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()
    dev = [json.loads(line) for line in lines]
    assert {r["examples"] for r in dev if r["kind"] == "dev"} == {64}
    assert ddp["test_accuracy"] == single["test_accuracy"]


def test_two_processes_resume_with_their_own_partial_log_sums(listops_cache, tmp_path):
    """Stopped between two train log entries, each process keeps the sums it had."""
    _torchrun(str(Path(__file__).with_name("ddp_resume_job.py")), str(listops_cache),
              str(tmp_path))
    whole, cut = _entries(tmp_path / "whole"), _entries(tmp_path / "cut")
    assert [r for r in whole if r["kind"] == "train"][-1]["step"] == 6
    assert cut == whole
    sums = load_checkpoint(tmp_path / "cut" / "last.pt")["running"]
    assert sums.shape == (2, 3)


def test_seeds_under_torchrun_train_one_after_another(listops_cache, tmp_path):
    """``--seeds`` under torchrun trains every seed in one process group: destroying
    torch's default group after a seed and initialising it again for the next hung."""
    args = [a for a in ARGS if a != "--full-dev"]
    args[args.index("--steps") + 1] = "3"
    _torchrun("-m", "skyformer", "lra", "train", "listops", *args, "--eval-batches", "1",
              "--seeds", "0", "1", "--cache", str(listops_cache), "--out", str(tmp_path),
              timeout=120)
    for seed in (0, 1):
        result = json.loads((tmp_path / f"seed{seed}" / "result.json").read_text())
        assert (result["seed"], result["world_size"], result["steps"]) == (seed, 2, 3)


def test_processes_that_disagree_on_the_run_are_refused_on_every_process(listops_cache,
                                                                         tmp_path):
    """Settings, --stop-after or the step resumed from (a run folder that only process 0
    sees) that differ between the processes: every process says so instead of waiting
    for the others in a collective the others never reach."""
    _torchrun(str(Path(__file__).with_name("ddp_disagree_job.py")), str(listops_cache),
              str(tmp_path), timeout=120)
    for rank in (0, 1):
        lines = (tmp_path / f"said{rank}.txt").read_text().splitlines()
        said = dict(line.split(": ", 1) for line in lines)
        assert "settings differ between the processes (lr, steps" in said["settings"]
        assert "--stop-after differs" in said["stop_after"]
        assert "process 0 at step 3, process 1 at step 0" in said["resume"]
        assert "a filesystem every process sees" in said["resume"]
        assert ("is in use by another run (process 1 on another-host" if rank == 0
                else "process 0 refused the run") in said["in_use"]
        # an OSError on process 0 alone: process 1 got gloo's "Connection closed by peer"
        assert ("File exists" if rank == 0 else "process 0 refused the run") \
            in said["not_a_folder"]
