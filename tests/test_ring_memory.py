"""What the ring MLPs hold at their peaks, counted against a hand count of their buffers.

``bench/cpu_peak.py`` measures the most bytes alive above a forward + backward's start on
gloo ranks (torch.profiler's memory events, exact to the byte on the CPU) in units of one
``[T/P, h]`` block; with T = h the weight shards and fc1's output A are 4 blocks each at any
P. At the backward's peak (fc1's dW pass, its first weight-gradient GEMM) the two-pass MLP
with the closed-form activation holds exactly: the output Y (1, kept by the caller), dA over
A (4), dW2 (4), dX (1), the rotation's spare chunks (min(2, P - 1)) and the new dW1 (4). One
block more means a buffer outlived its use, e.g. the dX accumulator's beside dW1 (the single
combined pass before the eighteenth session held 17 at P = 2).

The fused pass keeps the X chunks of the other ranks (P - 1; its own is the input) and A (4).
At its peak (dW1, made once the ring's last partial sums are on their way) it holds Y (1),
those chunks (P - 1), dA over A (4), dW2 (4), dW1 (4), its own chunk's dX (1), the partial-sum
inbox (1) and the partial sums in flight (1), whether they travel in one row piece or four.
With more tokens than hidden (T = 4h: a weight shard is 1 block) the peak comes at the last
ring step's last piece of four, before dW1 exists: Y (1), the other chunks (P - 1), A (4),
its own dX (1), the spare dY chunks (min(2, P - 1)), dW2 (1), the three pieces' partial sums
in flight (3/4), their inbox (3/4 at P = 2, where it is made as the pieces leave; the whole
1 at P > 2, made in the first step) and that piece's dY W2 (1/2). A partial-sum buffer made
before its piece's temporaries adds a quarter block there (2f01dcb did).
With its input made by the spec's norm (``norm_recipe``), the fused pass keeps the norm's
input instead and makes its own chunk again for dW1, after the other chunks' buffer is
released: the same counts, plus the norm's fp32 statistics (at most 1/16 block: two [T/P]
fp32 vectors and the profiler's allocation granularity; 1/16 measured at P = 2, 1/32 at P = 4). Made again
beside the other chunks it held one block more (18 at P = 2, T = h; twenty-sixth session).
Before dW1 moved out of the ring (twenty-fifth session) the peak was at a chunk's recomputed
act(A) with dW1 alive beside the rotation's spare chunks: 20 blocks at P = 2 with one piece,
and before the closed form wrote dA over A (nineteenth session), when act(A), dA and fc2's
input gradient of the chunk were alive at once: 24 blocks at P = 2 instead of 20."""

import sys
from pathlib import Path

import torch.distributed as dist

from tests.distributed import run_workers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import cpu_peak  # noqa: E402


def _worker(rank: int, world_size: int) -> None:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for group in (pairs[rank // 2], dist.group.WORLD):
        size = group.size()
        expected = 1 + 4 + 4 + 1 + min(2, size - 1) + 4
        blocks = cpu_peak.peak_blocks(group, 64, 64, "two-pass-closed-form")
        assert blocks == expected, (size, blocks, expected)
        # a plain callable (nested autograd graph, dA copied over A) never holds less
        assert cpu_peak.peak_blocks(group, 64, 64, "two-pass") >= expected
        fused = 1 + (size - 1) + 4 + 4 + 4 + 1 + 1 + 1
        for pieces in (1, 4):
            blocks = cpu_peak.peak_blocks(group, 64, 64, "fused-closed-form", pieces)
            assert blocks == fused, (size, pieces, blocks, fused)
        inbox = 3 / 4 if size == 2 else 1
        long_rows = 1 + (size - 1) + 4 + 1 + min(2, size - 1) + 1 + 3 / 4 + inbox + 1 / 2
        blocks = cpu_peak.peak_blocks(group, 64, 256, "fused-closed-form", 4)
        assert blocks == long_rows, (size, blocks, long_rows)
        assert cpu_peak.peak_blocks(group, 64, 64, "fused") >= fused
        stats = 1 / 16  # the norm's mean and rstd, [T/P] fp32 each, with the allocator's slack
        for tokens, unmarked in ((64, fused), (256, long_rows)):
            blocks = cpu_peak.peak_blocks(group, 64, tokens, "fused-closed-form", 4, norm=True)
            assert unmarked < blocks <= unmarked + stats, (size, tokens, blocks, unmarked)


def test_ring_mlp_peaks_are_their_hand_counts() -> None:
    run_workers(_worker, 4)
