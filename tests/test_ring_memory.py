"""What the ring MLPs hold at their peaks, counted against a hand count of their buffers.

``bench/cpu_peak.py`` measures the most bytes alive above a forward + backward's start on
gloo ranks (torch.profiler's memory events, exact to the byte on the CPU) in units of one
``[T/P, h]`` block; with T = h the weight shards and fc1's output A are 4 blocks each at any
P. At the backward's peak (fc1's dW pass, its first weight-gradient GEMM) the two-pass MLP
with the closed-form activation holds exactly: the output Y (1, kept by the caller), dA over
A (4), dW2 (4), dX (1), the rotation's spare chunks (min(2, P - 1)) and the new dW1 (4). One
block more means a buffer outlived its use, e.g. the dX accumulator's beside dW1 (the single
combined pass before the eighteenth session held 17 at P = 2).

The fused pass (one row piece) keeps every X chunk (P) and A (4). At its peak (a chunk's
act(A), recomputed for dW2, at step 1) it holds Y (1), X (P), A with the rows done so far
overwritten by dA (4), the rotation's spare dY chunks (min(2, P - 1)), dW2 (4), dW1 (4), its
own chunk's dX term (1), the partial-sum inbox (1) and that act(A) (2). Before the closed
form wrote dA over A (nineteenth session), act(A), dA and fc2's input gradient of the chunk
were alive at once: 24 blocks at P = 2 instead of 20."""

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
        fused = 1 + size + 4 + min(2, size - 1) + 4 + 4 + 1 + 1 + 2
        blocks = cpu_peak.peak_blocks(group, 64, 64, "fused-closed-form")
        assert blocks == fused, (size, blocks, fused)
        assert cpu_peak.peak_blocks(group, 64, 64, "fused") >= fused


def test_ring_mlp_peaks_are_their_hand_counts() -> None:
    run_workers(_worker, 4)
