"""What the two-pass ring MLP holds at its peak, counted against a hand count of its buffers.

``bench/cpu_peak.py`` measures the most bytes alive above a forward + backward's start on
gloo ranks (torch.profiler's memory events, exact to the byte on the CPU) in units of one
``[T/P, h]`` block; with T = h the weight shards and fc1's output A are 4 blocks each at any
P. At the backward's peak (fc1's dW pass, its first weight-gradient GEMM) the two-pass MLP
with the closed-form activation holds exactly: the output Y (1, kept by the caller), dA over
A (4), dW2 (4), dX (1), the rotation's spare chunks (min(2, P - 1)) and the new dW1 (4). One
block more means a buffer outlived its use, e.g. the dX accumulator's beside dW1 (the single
combined pass before the eighteenth session held 17 at P = 2)."""

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


def test_two_pass_mlp_peak_is_its_hand_count() -> None:
    run_workers(_worker, 4)
