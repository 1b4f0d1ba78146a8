"""Train a small model on one long sequence sharded over processes.

    torchrun --standalone --nproc-per-node 4 examples/sequence_parallel_train.py \\
        --seq-len 262144 --steps 20                      # 4 CPU processes (gloo)
    torchrun --standalone --nproc-per-node 8 examples/sequence_parallel_train.py \\
        --seq-len 1048576 --data-parallel 2              # 2 sequences x 4 shards (nccl on GPUs)
    torchrun --standalone --nproc-per-node 4 examples/sequence_parallel_train.py \\
        --seq-len 262144 --causal                        # a decoder: next-character prediction

The task is masked-character prediction on the bundled public-domain text, tiled to
``--seq-len`` characters: 15% of the characters are hidden and predicted from both sides.
Which ones depends on the step and the position alone, not on the sharding, so P processes
take the steps of one process (the same losses, to rounding). With ``--causal`` the model
is a decoder (causal attention) predicting each character from the ones before it, the
last rank's last position excepted.
Ranks form a grid of ``--data-parallel`` groups (each trains on its own sequence) times
``P / data-parallel`` sequence shards; each rank holds only its shard of the sequence and
of every activation, so one process alone would need P / data-parallel times the memory.
Attention is Skyformer through ``MultiHeadAttention(process_group=...)``; everything else
in the model acts row by row. After backward the parameters' gradients are summed over
every rank and divided by the number of data-parallel groups (each sequence's loss is
already split over its shards), so all ranks take the same step.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import time
from importlib import resources

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from skyformer import MultiHeadAttention
from skyformer.checks import heads_divide_width, positive_float_argument, positive_int_argument
from skyformer.distributed import destroy_process_group, shard_bounds, sum_gradients
from skyformer.lra.distributed import DistInfo, init_distributed, shutdown

MASK_RATE = 0.15
MASK_BLOCK = 1024  # the hidden characters are drawn per block of this many global positions


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, group: object, features: int,
                 causal: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = MultiHeadAttention(dim, heads, "skyformer", num_features=features,
                                       causal=causal, process_group=group)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor, generator: torch.Generator) -> Tensor:
        x = x + self.attn(self.norm1(x), generator=generator)
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    """Embedding + sinusoidal positions of the *global* index + pre-norm blocks + final
    norm + classifier."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, group: object,
                 features: int, causal: bool = False) -> None:
        super().__init__()
        self.dim = dim
        self.embed = nn.Embedding(vocab + 1, dim)  # the last id is the mask token
        self.blocks = nn.ModuleList(Block(dim, heads, group, features, causal)
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(dim)  # Skyformer's kernelized attention is unnormalised
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: Tensor, start: int, generator: torch.Generator) -> Tensor:
        pos = torch.arange(start, start + tokens.shape[1], device=tokens.device)[:, None]
        freq = torch.exp(torch.arange(0, self.dim, 2, device=tokens.device)
                         * (-math.log(10000.0) / self.dim))
        angles = torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], -1)
        x = self.embed(tokens) + angles[:, :self.dim]  # an odd dim has one angle too many
        for block in self.blocks:
            x = block(x, generator)
        return self.head(self.norm(x))


def hidden_characters(start: int, stop: int, step: int, device: torch.device) -> Tensor:
    """Which characters at the global positions ``start .. stop - 1`` are hidden at
    ``step``: ``[1, stop - start]`` bool. Drawn per block of ``MASK_BLOCK`` positions from
    a seed of the step and the block, so a position is hidden or not whatever the
    sharding: P processes hide the characters one process hides, and train as it does."""
    first = start // MASK_BLOCK
    draws = [torch.rand(MASK_BLOCK, device=device, generator=torch.Generator(device=device)
                        .manual_seed(_block_seed(step, block)))
             for block in range(first, (stop - 1) // MASK_BLOCK + 1)]
    offset = first * MASK_BLOCK
    return (torch.cat(draws)[start - offset:stop - offset] < MASK_RATE)[None]


def _block_seed(step: int, block: int) -> int:
    """A 32-bit seed of the pair: the CPU generator reads a seed's low 32 bits alone, so
    ``step * 2**32 + block`` hid the same characters at every step."""
    return int(np.random.SeedSequence([step, block]).generate_state(1)[0])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=positive_int_argument, default=2**16)
    parser.add_argument("--data-parallel", type=positive_int_argument, default=1)
    parser.add_argument("--steps", type=positive_int_argument, default=20)
    parser.add_argument("--dim", type=positive_int_argument, default=64)
    parser.add_argument("--heads", type=positive_int_argument, default=2)
    parser.add_argument("--layers", type=positive_int_argument, default=2)
    parser.add_argument("--features", type=positive_int_argument, default=128)
    parser.add_argument("--lr", type=positive_float_argument, default=3e-3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--causal", action="store_true",
                        help="a decoder: causal attention, next-character prediction")
    args = parser.parse_args(argv)
    heads_divide_width(parser, args.dim, args.heads)
    if args.seq_len < 2:  # one position has no other to predict it from, or to predict
        parser.error(f"argument --seq-len: must be at least 2, got {args.seq_len}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        info, device = init_distributed(args.device)
    except ValueError as err:  # a device this machine lacks (or torchrun's settings)
        raise SystemExit(f"sequence_parallel_train: error: {err}") from None
    store = None
    if not info.enabled:  # one process: a group of one, so the same code runs
        store = tempfile.mkdtemp()
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"file://{os.path.join(store, 'store')}", rank=0,
                                world_size=1)
    try:
        train(args, info, device)
    finally:
        if store is not None:
            shutil.rmtree(store, ignore_errors=True)


def train(args: argparse.Namespace, info: DistInfo, device: torch.device) -> None:
    """The steps, on the process group ``main`` set up, which this closes."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % args.data_parallel:
        raise SystemExit(f"--data-parallel {args.data_parallel} must divide the {world} "
                         f"processes.")
    shards = world // args.data_parallel
    data, seq = divmod(rank, shards)
    groups = [dist.new_group(list(range(d * shards, (d + 1) * shards)))
              for d in range(args.data_parallel)]  # every rank creates every group

    text = resources.files("skyformer.data").joinpath("public_domain_en.txt").read_text()
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text])
    start, stop = shard_bounds(args.seq_len, shards, seq)
    offset = data * 7919  # each data-parallel group reads the text from another place
    positions = torch.arange(start, stop) + offset
    tokens = ids[positions % len(ids)][None].to(device)  # [1, N_r]
    following = ids[(positions + 1) % len(ids)][None].to(device)  # the next characters

    torch.manual_seed(0)  # the same initial parameters on every rank
    model = Model(len(chars), args.dim, args.heads, args.layers, groups[data],
                  args.features, args.causal).to(device)
    optimiser = torch.optim.Adam(model.parameters(), lr=args.lr)
    if rank == 0:
        print(f"{world} processes: {args.data_parallel} sequences x {shards} shards of "
              f"{args.seq_len} tokens ({stop - start} per rank) on {device}")
    for step in range(args.steps):
        t0 = time.perf_counter()
        if args.causal:  # every position predicts the next character (the last has none)
            scored = torch.arange(start, stop, device=device)[None] < args.seq_len - 1
            inputs, targets = tokens, following
        else:  # the hidden characters, from both sides
            scored = hidden_characters(start, stop, step, device)
            inputs, targets = torch.where(scored, len(chars), tokens), tokens
        landmarks = torch.Generator(device=device).manual_seed(step)  # alike on every rank
        logits = model(inputs, start, landmarks)
        # the sequence's mean loss over its scored characters, split over the shards
        counts = scored.sum().float().reshape(1)
        dist.all_reduce(counts, group=groups[data])
        has_scored = (counts > 0).float() / shards  # 1 / shards on each rank of the group
        counts.clamp_(min=1)  # a short sequence may hide nothing at a step: no gradient
        loss = nn.functional.cross_entropy(logits[scored], targets[scored], reduction="sum")
        (loss / counts).backward()
        sum_gradients(model, divide_by=args.data_parallel)
        optimiser.step()
        optimiser.zero_grad(set_to_none=True)
        # the mean over the sequences with something scored: [sum of their losses, count]
        total = torch.cat([(loss.detach() / counts).reshape(1), has_scored])
        dist.all_reduce(total)
        if rank == 0:
            said = (f"loss {total[0].item() / total[1].item():.3f}" if total[1] > 0.5
                    else "nothing scored (no loss)")
            print(f"step {step:3d}  {said}  {time.perf_counter() - t0:.2f} s", flush=True)
    dist.barrier()  # gloo: no rank closes its connections while another still reads
    destroy_process_group() if not info.enabled else shutdown(info)


if __name__ == "__main__":
    main()
