"""The chunked vocabulary-parallel LM head + cross-entropy against float64 single-device math.

Reference: ``F.cross_entropy(x W^T)`` in float64 over the full vocabulary, the sum of target
token losses divided by N, differentiated by autograd. Tolerance: fp32 logits of an h = 16
GEMM and a 40-way softmax carry ~1e-7 relative error; 1e-5 leaves room for the all-reduce and
chunk summation orders (a wrong chunk offset, target shard or reduction is off by O(1)).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_stpar.config import Layout
from tests.distributed import run_workers

B, S, H, V = 2, 12, 16, 40


def _reference(seed: int):
    torch.manual_seed(seed)
    x = torch.randn(B, S, H, dtype=torch.float64)
    w = torch.randn(V, H, dtype=torch.float64) / H**0.5
    labels = torch.randint(0, V, (B, S))
    labels[0, 1] = labels[1, S - 1] = -100
    n = 37.0  # the mini-batch's targets: more than this micro-batch holds
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    logits = xr @ wr.t()
    loss = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="sum") / n
    (loss * 3.0).backward()  # an upstream scale, as the runner's DP factor
    return x, w, labels, n, loss.detach(), xr.grad, wr.grad


def _check(rank: int, world: int, sequence_parallel: bool, chunk_bytes: int) -> None:
    from ds_stpar.layers.cross_entropy import vocab_parallel_linear_cross_entropy
    from ds_stpar.parallel import GroupCache

    group = GroupCache().get(Layout(tp=world)).tp_group if world > 1 else None
    x, w, labels, n, ref_loss, ref_dx, ref_dw = _reference(0)
    s_local = S // world if sequence_parallel else S
    lo = rank * s_local if sequence_parallel else 0
    hidden = x[:, lo : lo + s_local].float().clone().requires_grad_()
    rows = V // world
    weight = w[rank * rows : (rank + 1) * rows].float().clone().requires_grad_()
    loss = vocab_parallel_linear_cross_entropy(
        hidden,
        weight,
        labels,
        n,
        group=group,
        sequence_parallel=sequence_parallel,
        chunk_bytes=chunk_bytes,
    )
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-7)
    (loss * 3.0).backward()
    dx = ref_dx[:, lo : lo + s_local]
    torch.testing.assert_close(hidden.grad.double(), dx, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(
        weight.grad.double(), ref_dw[rank * rows : (rank + 1) * rows], rtol=1e-5, atol=1e-7
    )
    again = vocab_parallel_linear_cross_entropy(
        hidden, weight, labels, n, group=group, sequence_parallel=sequence_parallel
    )
    again.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        again.backward()
    if group is not None:
        dist.barrier(group)


@pytest.mark.parametrize("chunk_bytes", [1 << 30, 5 * 8 * V])  # one chunk; 5 tokens a chunk
def test_single_device(chunk_bytes):
    _check(0, 1, False, chunk_bytes)


def _tp(rank: int, world: int) -> None:
    for sequence_parallel in (False, True):
        for chunk_bytes in (1 << 30, 7 * 8 * V // world):  # a last chunk shorter than the rest
            _check(rank, world, sequence_parallel, chunk_bytes)


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_with_and_without_sequence_parallel(world):
    run_workers(_tp, world)


def test_chunk_tokens_and_bad_input():
    from ds_stpar.errors import ConfigError
    from ds_stpar.layers.cross_entropy import chunk_tokens, vocab_parallel_linear_cross_entropy

    assert chunk_tokens(128256, 2) == (2 << 30) // (8 * 128256) == 2092
    assert chunk_tokens(10**9, 2) == 1
    x, w = torch.randn(1, 4, H), torch.randn(V, H)
    with pytest.raises(ConfigError, match="num_targets"):
        vocab_parallel_linear_cross_entropy(x, w, torch.zeros(1, 4, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="vs weight"):
        vocab_parallel_linear_cross_entropy(x, torch.randn(V, H + 1), torch.zeros(1, 4).long(), 4)
    with pytest.raises(ValueError, match="do not match labels"):
        vocab_parallel_linear_cross_entropy(x, w, torch.zeros(1, 5, dtype=torch.long), 4)
