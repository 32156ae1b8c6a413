"""The P2P communication patterns of ds_stpar.layers.comm and the Cannon schedule, on gloo.

One launch of 9 workers checks every pattern on three group shapes at once: the whole world
(P=9, a 3 x 3 torus: unlike P<=4, left and right, up and down, and the two diagonals are
different ranks, so a direction mistake shows), three *strided* groups {0, 3, 6}, {1, 4, 7},
{2, 5, 8} (P=3: a group rank differs from the global rank, so a group-rank/global-rank mix-up
delivers to the wrong process) and singleton groups (P=1: the wrappers return their input
untouched). Each rank generates every rank's tensors from seeds, so expected values are
computed locally. The patterns only move and add data: values are small integers stored as
float64, every sum is exact in any order, and those checks are bit-exact (torch.equal).

The same launch checks async_comm's transfers (started in one call, finished in another, two
in flight at once) on the three group shapes, also bit-exact, and runs the bare Cannon
functions (cannon.py) on the 3 x 3 torus against a float64 F.linear: fp32 there, tolerance
max |fp32 - fp64| <= 1e-5 * max |fp64| (K <= 9 terms per dot product: rounding ~sqrt(K) *
6e-8, reordered by the grid; see test_temporal_linear.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_stpar.layers.async_comm import (
    all_reduce_finish,
    all_reduce_start,
    gather_finish,
    gather_others_start,
    gather_start,
    reduce_others_finish,
    reduce_others_start,
)
from ds_stpar.layers.cannon import _plan, cannon_column_linear, cannon_row_linear
from ds_stpar.layers.comm import (
    InFlightLimit,
    exchange,
    ring_all_gather,
    ring_pass,
    ring_reduce_scatter,
    ring_shift,
    torus_shift,
)
from tests.distributed import run_workers


def _data(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=gen).double()


def _check_ring_shift(group, members: list[int], tag: int) -> None:
    size, me = group.size(), group.rank()
    for hops in (1, -1, 2):
        x = _data(tag + me, (3, 2)).requires_grad_()
        y = ring_shift(x, group, hops)
        assert torch.equal(y, _data(tag + (me + hops) % size, (3, 2))), f"shift {hops} value"
        y.backward(_data(tag + 100 + me, (3, 2)))
        # x went to rank me - hops, whose upstream gradient comes back here
        expect = _data(tag + 100 + (me - hops) % size, (3, 2))
        assert torch.equal(x.grad, expect), f"shift {hops} grad (P={size}, members {members})"


def _check_gather_scatter(group, tag: int) -> None:
    size, me = group.size(), group.rank()
    x = _data(tag + me, (2, 3)).requires_grad_()
    y = ring_all_gather(x, group)
    assert torch.equal(y, torch.cat([_data(tag + e, (2, 3)) for e in range(size)]))
    y.backward(_data(tag + 50 + me, (2 * size, 3)))
    # adjoint: the sum over ranks of their upstream gradient's chunk `me`
    expect = sum(_data(tag + 50 + e, (2 * size, 3))[2 * me : 2 * me + 2] for e in range(size))
    assert torch.equal(x.grad, expect), "all-gather grad"

    x = _data(tag + 200 + me, (2 * size, 3)).requires_grad_()
    y = ring_reduce_scatter(x, group)
    expect = sum(_data(tag + 200 + e, (2 * size, 3))[2 * me : 2 * me + 2] for e in range(size))
    assert torch.equal(y, expect), "reduce-scatter value"
    y.backward(_data(tag + 300 + me, (2, 3)))
    assert torch.equal(x.grad, torch.cat([_data(tag + 300 + e, (2, 3)) for e in range(size)]))


def _check_async_transfers(group, tag: int) -> None:
    """async_comm's gather split into start and finish, two in flight at once and finished in
    the other order, forward and backward (its adjoint, the reduce-scatter, started by the
    finish's backward); the all-reduce pair, whose adjoint is itself, leaves its input as it
    was."""
    size, me = group.size(), group.rank()
    x = _data(tag + me, (2, 3)).requires_grad_()
    z = _data(tag + 200 + me, (2, 3)).requires_grad_()
    first, second = gather_start(x, group), gather_start(z, group)
    second_rows = gather_finish(*second)
    gathered = gather_finish(*first)
    assert torch.equal(gathered, torch.cat([_data(tag + e, (2, 3)) for e in range(size)]))
    assert torch.equal(second_rows, torch.cat([_data(tag + 200 + e, (2, 3)) for e in range(size)]))
    grads = _data(tag + 50 + me, (2 * size, 3)), _data(tag + 300 + me, (2 * size, 3))
    torch.autograd.backward([gathered, second_rows], list(grads))
    expect = sum(_data(tag + 50 + e, (2 * size, 3))[2 * me : 2 * me + 2] for e in range(size))
    assert torch.equal(x.grad, expect), "async gather grad"
    expect = sum(_data(tag + 300 + e, (2 * size, 3))[2 * me : 2 * me + 2] for e in range(size))
    assert torch.equal(z.grad, expect), "async gather grad, finished first"

    v = _data(tag + 400 + me, (2, 3)).requires_grad_()
    total = all_reduce_finish(*all_reduce_start(v, group))
    assert torch.equal(total, sum(_data(tag + 400 + e, (2, 3)) for e in range(size)))
    assert torch.equal(v, _data(tag + 400 + me, (2, 3))), "all-reduce changed its input"
    total.backward(_data(tag + 500 + me, (2, 3)))
    assert torch.equal(v.grad, sum(_data(tag + 500 + e, (2, 3)) for e in range(size)))
    # consumed: the sum is made in the input's own memory; the gradient as before
    fresh = _data(tag + 400 + me, (2, 3)).requires_grad_() * 1
    total = all_reduce_finish(*all_reduce_start(fresh, group, consume=True))
    assert total.data_ptr() == fresh.data_ptr(), "a consumed all-reduce copied its input"
    assert torch.equal(total, sum(_data(tag + 400 + e, (2, 3)) for e in range(size)))
    grad = _data(tag + 500 + me, (2, 3))
    assert torch.equal(torch.autograd.grad(total, fresh, grad)[0], v.grad), "consumed: grad"
    _check_reduce_others(group, tag + 600)


def _check_reduce_others(group, tag: int) -> None:
    """The reduction of the other ranks' rows: rank e's terms for chunk c are the rows of c
    in e's [P n] tensor, of which e sends all but its own; rank d receives the sum of the
    others' terms for its chunk; the backward hands each rank every other rank's gradient
    chunk, in rank order. A group of one has no other rank, and terms that do not cut into P - 1
    equal chunks have no owners: refused."""
    size, me = group.size(), group.rank()
    if size == 1:
        with pytest.raises(ValueError, match="other ranks"):
            reduce_others_start(_data(tag, (2, 3)), group)
        with pytest.raises(ValueError, match="other ranks"):
            gather_others_start(_data(tag, (2, 3)), group)
        return
    if size > 2:  # P rows do not cut into P - 1 equal chunks
        with pytest.raises(ValueError, match="must divide by the other ranks' count"):
            reduce_others_start(_data(tag, (size, 3)), group)

    def others(tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor[2 * e : 2 * e + 2] for e in range(size) if e != me])

    w = others(_data(tag + me, (2 * size, 3))).requires_grad_()
    summed = reduce_others_finish(*reduce_others_start(w, group))
    terms = [_data(tag + e, (2 * size, 3))[2 * me : 2 * me + 2] for e in range(size) if e != me]
    assert torch.equal(summed, sum(terms)), "reduce of the others' rows"
    summed.backward(_data(tag + 100 + me, (2, 3)))
    sent = [_data(tag + 100 + e, (2, 3)) for e in range(size) if e != me]
    assert torch.equal(w.grad, torch.cat(sent)), "reduce of the others' rows: grad"


def _check_ring_pass_both_streams(group, tag: int) -> None:
    """Rotating chunk and rotating accumulator in the same batches (the column backward)."""
    size, me = group.size(), group.rank()
    seen = []
    total = ring_pass(
        group,
        rotate=_data(tag + me, (2, 2)),
        visit=lambda c, chunk: seen.append((c, chunk.clone())),
        partial=lambda m: _data(tag + 70 + me, (2 * size, 2))[2 * m : 2 * m + 2],
    )
    assert [c for c, _ in seen] == [(me + t) % size for t in range(size)]
    for c, chunk in seen:
        assert torch.equal(chunk, _data(tag + c, (2, 2))), f"rotated chunk {c}"
    expect = sum(_data(tag + 70 + e, (2 * size, 2))[2 * me : 2 * me + 2] for e in range(size))
    assert torch.equal(total, expect), "rotating accumulator"


def _check_torus_shift(group, tag: int) -> None:
    q, me = math.isqrt(group.size()), group.rank()
    row, col = divmod(me, q)
    for rows, cols in ((0, 1), (1, 0), (1, 1)):
        x = _data(tag + me, (2, 2)).requires_grad_()
        y = torus_shift(x, group, rows, cols)
        src = ((row + rows) % q) * q + (col + cols) % q
        assert torch.equal(y, _data(tag + src, (2, 2))), f"torus shift {(rows, cols)}"
        y.backward(_data(tag + 10 + me, (2, 2)))
        dst = ((row - rows) % q) * q + (col - cols) % q
        assert torch.equal(x.grad, _data(tag + 10 + dst, (2, 2))), "torus shift grad"


def _check_exchange(group, tag: int) -> None:
    """Sequence-sharded -> feature-sharded re-layout (and its adjoint) of a [2P, 2, 3P] tensor."""
    size, me = group.size(), group.rank()
    seq, feat = 2 * size, 3 * size
    full = _data(tag, (seq, 2, feat))
    rows, cols = seq // size, feat // size
    x = full[me * rows : (me + 1) * rows].clone().requires_grad_()
    y = exchange(x, _plan("seq", "feat", me, size, seq, 2, feat), group)
    assert torch.equal(y, full[:, :, me * cols : (me + 1) * cols]), "exchange value"
    upstream = _data(tag + 1, (seq, 2, feat))
    y.backward(upstream[:, :, me * cols : (me + 1) * cols])
    assert torch.equal(x.grad, upstream[me * rows : (me + 1) * rows]), "exchange grad"


def _check_singleton(group) -> None:
    x = torch.ones(2, 2)
    assert ring_shift(x, group) is x
    assert ring_all_gather(x, group) is x
    assert ring_reduce_scatter(x, group) is x
    assert torus_shift(x, group) is x


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    err = (actual.double() - expected).abs().max().item()
    assert err <= 1e-5 * expected.abs().max().item(), f"{what}: max error {err:.3g}"


def _rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _check_cannon_q3(group) -> None:
    """Column [s/P, b, k] -> [s, b, n/P] and row [s, b, n/P] -> [s/P, b, k] with W blocks
    (c, (r+c) % q) of the global weight, against float64 F.linear: outputs and gradients."""
    size, me = group.size(), group.rank()
    q, (row, col) = 3, divmod(me, 3)
    k, n, s, b = 6, 9, 9, 2
    own = torch.arange(me, me + 1)  # n / P = 1 feature per rank

    def block(w: torch.Tensor) -> torch.Tensor:
        return w.chunk(q, 0)[col].chunk(q, 1)[(row + col) % q]

    x_full, w_full = _rand(1, s, b, k).requires_grad_(), _rand(2, n, k).requires_grad_()
    x = x_full.detach().chunk(size)[me].float().requires_grad_()
    w = block(w_full.detach()).float().requires_grad_()
    y, y_ref = cannon_column_linear(x, w, group), F.linear(x_full, w_full)
    _close(y, y_ref[..., own].detach(), "cannon column output")
    grad = _rand(3, s, b, n)
    y.backward(grad[..., own].float())
    y_ref.backward(grad)
    _close(x.grad, x_full.grad.chunk(size)[me], "cannon column input grad")
    _close(w.grad, block(w_full.grad), "cannon column weight grad")

    x_full, w_full = _rand(4, s, b, n).requires_grad_(), _rand(5, k, n).requires_grad_()
    x = x_full.detach()[..., own].float().requires_grad_()
    w = block(w_full.detach()).float().requires_grad_()
    y, y_ref = cannon_row_linear(x, w, group), F.linear(x_full, w_full)
    _close(y, y_ref.chunk(size)[me].detach(), "cannon row output")
    grad = _rand(6, s, b, k)
    y.backward(grad.chunk(size)[me].float())
    y_ref.backward(grad)
    _close(x.grad, x_full.grad[..., own], "cannon row input grad")
    _close(w.grad, block(w_full.grad), "cannon row weight grad")


def _comm_worker(rank: int, world_size: int) -> None:
    world = dist.group.WORLD
    strided = [dist.new_group(list(range(i, 9, 3))) for i in range(3)][rank % 3]
    singles = [dist.new_group([r]) for r in range(world_size)][rank]
    members = list(range(rank % 3, 9, 3))
    tag = 500 * (rank % 3)  # each strided group on its own data
    _check_ring_shift(world, list(range(9)), 1000)
    _check_ring_shift(strided, members, 2000 + tag)
    _check_gather_scatter(world, 4000)
    _check_gather_scatter(strided, 5000 + tag)
    _check_async_transfers(world, 6000)
    _check_async_transfers(strided, 6500 + tag)
    _check_async_transfers(singles, 9000 + rank)
    _check_ring_pass_both_streams(world, 7000)
    _check_ring_pass_both_streams(strided, 8000 + tag)
    _check_torus_shift(world, 10_000)
    _check_exchange(world, 11_000)
    _check_exchange(strided, 12_000 + tag)
    _check_singleton(singles)
    _check_cannon_q3(world)


@pytest.mark.dist
def test_comm_patterns_p9_p3_p1_and_cannon_3x3() -> None:
    run_workers(_comm_worker, 9)


class _Event:
    """Stands in for a torch.cuda.Event (none on CPU): notes when the host waited on it."""

    def __init__(self, index: int, waited: list[int]):
        self.index, self.waited = index, waited

    def synchronize(self) -> None:
        self.waited.append(self.index)


def test_in_flight_limit_waits_for_the_oldest_batches_beyond_the_bound() -> None:
    waited: list[int] = []
    limit = InFlightLimit(3)
    for index in range(3):
        limit.add(_Event(index, waited))
    assert waited == []  # three batches queued ahead: no wait yet
    for index in range(3, 6):
        limit.add(_Event(index, waited))
    assert waited == [0, 1, 2]  # each new batch past the third waits for the oldest, in order
    unbounded: list[int] = []
    free = InFlightLimit(0)
    for index in range(100):
        free.add(_Event(index, unbounded))
    assert unbounded == []


def test_in_flight_bound_from_the_environment_is_checked(monkeypatch) -> None:
    from ds_stpar.errors import ConfigError
    from ds_stpar.layers import comm

    monkeypatch.setenv("DS_STPAR_P2P_IN_FLIGHT", "12")
    assert comm._max_in_flight() == 12
    monkeypatch.setenv("DS_STPAR_P2P_IN_FLIGHT", "-1")
    with pytest.raises(ConfigError, match="whole number"):
        comm._max_in_flight()
