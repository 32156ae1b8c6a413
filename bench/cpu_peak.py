"""Peak memory of the ring MLPs' forward + backward on the CPU, counted in activation blocks.

    torchrun --nproc_per_node 2 bench/cpu_peak.py [--hidden 1024 --tokens 1024]

The layer benchmark's peaks need a GPU; which buffers are alive at once does not. This runs
one forward and backward of each ring MLP on gloo ranks (fp32, P = world size) under
torch.profiler's memory recording and prints, on rank 0, the most bytes alive above what was
allocated before the step, in units of one ``[tokens/P, hidden]`` block (the input chunk X;
``--tokens`` = ``--hidden`` gives a weight shard of 4 blocks at P = 2, the proportions of
h 8192 / 8K tokens, where the GPU's 17 blocks were 1.0625 GiB). Rows: the two-pass MLP and the
fused pass, each with the activation as a plain callable (a nested autograd graph; dA then
copied over A) and as the ``ClosedFormActivation`` StparMLP passes (dA written over A). The
fused pass sends its partial sums in one row piece here; ``peak_blocks(..., pieces=4)``
counts four, as the GPU cuts them at h 8192 / 8K. BENCHMARKS.md, eighteenth, nineteenth and
twenty-fifth sessions.
"""

from __future__ import annotations

import argparse

import memtrace
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_stpar.layers.activation import ClosedFormActivation
from ds_stpar.layers.norm_recipe import MarkedLayerNorm
from ds_stpar.layers.ring_mlp import ring_mlp, ring_two_pass_mlp

VARIANTS = ("two-pass", "two-pass-closed-form", "fused", "fused-closed-form")


def peak_blocks(
    group, hidden: int, tokens: int, variant: str, pieces: int = 1, norm: bool = False
) -> float:
    """Peak bytes above the step's start over one ``[tokens/P, hidden]`` fp32 block, for
    ``variant`` in :data:`VARIANTS` (no biases; the output stays referenced through the
    backward, as a training step's loss keeps it); the fused pass's partial sums travel in
    ``pieces`` row pieces. ``norm``: the MLP's input is made in the step by the spec's
    LayerNorm (``norm_recipe.MarkedLayerNorm``, no affine weights) from the step's input, as
    in a layer, so the MLP keeps the norm's input and makes its own chunk again."""
    size = group.size()
    ffn = 4 * hidden // size
    gen = torch.Generator().manual_seed(group.rank())
    x = torch.randn(tokens // size, 1, hidden, generator=gen).requires_grad_()
    w1 = torch.randn(ffn, hidden, generator=gen).requires_grad_()
    w2 = torch.randn(hidden, ffn, generator=gen).requires_grad_()
    dy = torch.randn(tokens // size, 1, hidden, generator=gen)
    act = ClosedFormActivation(F.gelu) if variant.endswith("closed-form") else F.gelu

    layer_norm = MarkedLayerNorm(hidden, elementwise_affine=False) if norm else None

    def step() -> None:
        x_in = layer_norm(x) if norm else x
        if variant.startswith("fused"):
            y = ring_mlp(x_in, w1, None, w2, act, group, pieces=pieces, min_piece_flop=0)
        else:
            y = ring_two_pass_mlp(x_in, w1, None, w2, act, group)
        del x_in
        y.backward(dy)
        for leaf in (x, w1, w2):
            leaf.grad = None

    step()  # first-use allocations (gloo buffers, autograd) out of the measured step
    cpu = torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[cpu], profile_memory=True) as prof:
        step()
    return memtrace.cpu_peak_above_start(prof) / (tokens // size * hidden * 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    group = dist.new_group(list(range(dist.get_world_size())))
    rows = {v: peak_blocks(group, args.hidden, args.tokens, v) for v in VARIANTS}
    if group.rank() == 0:
        print(
            f"| variant | peak above the step's start, [T/P, h] blocks (h {args.hidden}, "
            f"T {args.tokens}, P {group.size()}) |"
        )
        print("|---|---|")
        for variant, blocks in rows.items():
            print(f"| {variant} | {blocks:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
