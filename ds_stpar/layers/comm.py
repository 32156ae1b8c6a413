"""Point-to-point communication patterns of the spatial-temporal layers.

Every pattern is built on one primitive, :func:`start_p2p`: a batch of ``isend``/``irecv``
that returns at once and is completed by :meth:`PendingP2P.wait` (:func:`ring_pass`'s batches
may go by the copy engines instead, below). It runs on gloo (CPU tests)
and NCCL alike. Peers are *group* ranks, so a TP group smaller than the world (or strided
across it) works. The process group is always an argument.

On NCCL the batch is the group's own coalesced send/recv calls (what
``torch.distributed.batch_isend_irecv`` issues, without its per-op Python), made from the
compute stream: NCCL's stream waits for the compute stream (a buffer is only sent once it is
written), ``wait`` makes the compute stream wait for the transfer, and the process group keeps
the buffers from the caching allocator until then. Another CUDA backend goes through
``batch_isend_irecv`` on a side stream that waits for the compute stream, with every buffer
``record_stream``-ed there. The host does not wait for the transfer it issues: the sub-GEMM of
step t is queued while the transfer for step t+1 is in flight. It does wait once it is more
than :data:`MAX_IN_FLIGHT` batches ahead of the GPU (:class:`InFlightLimit`, as FSDP's
``limit_all_gathers``). Unbounded, the host ran a micro-batch ahead and the caching allocator's
reserve grew with the lead (a block whose last use is still queued on another stream is not
reused) to the card's capacity, where it frees its cache and retries, a device-wide sync each:
7% of a 32K step on H200; on H100, whose capacity the reserve met sooner, the same layout had
run 16-20% slow (BENCHMARKS.md, twelfth and thirteenth sessions). On CPU the same code runs
minus the streams (gloo progresses the transfer on its own threads). Within one host with
peer links, :func:`ring_pass`'s hops go by the copy engines instead
(:mod:`ds_stpar.layers.symmetric`); without peer links the ring layers' hops
(:func:`start_ring_hop`: :func:`ring_pass`'s and the fused ring MLP's) go by the copy
engines through shared host memory where the group's transport says so
(:mod:`ds_stpar.layers.host_staged`); the other patterns keep :func:`start_p2p`.

Schedules (no autograd, used by the layer algorithms in ``ring.py``):

- :func:`ring_pass` — P steps around the ring: a *rotating chunk* (this rank's chunk d goes
  to d-1, the chunk of d+1 arrives) and/or a *rotating accumulator* (a partial sum for chunk
  m = d+t+1 is received from d+1, this rank's contribution is added, the sum goes on to d-1;
  after P-1 hops rank d holds the full sum for chunk d).

Differentiable patterns (one ``torch.autograd.Function`` each, with a functional wrapper that
short-circuits a one-rank group; "forward: ..., backward: ..."):

- :func:`ring_shift` — forward: rank d gets rank (d+hops)'s tensor; backward: shift back.
- :func:`ring_all_gather` — forward: rotating chunks gather dim 0; backward: rotating
  accumulator (reduce-scatter), its adjoint.
- :func:`ring_reduce_scatter` — forward: rotating accumulator over dim 0 (PrimePar's
  "summation by accumulating over the steps"); backward: rotating chunks (all-gather).
- :func:`torus_shift` — Cannon's row/column shifts on a q x q torus: forward: (r, c) gets the
  tensor of (r+rows, c+cols); backward: the opposite shift.
- :func:`exchange` — block re-layout (an all-to-all-v by P2P) described by an
  :class:`ExchangePlan`; backward: the transposed plan.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from ds_stpar.errors import ConfigError
from ds_stpar.layers.host_staged import staged_group
from ds_stpar.layers.symmetric import symmetric_ring

Group = dist.ProcessGroup
Region = tuple[slice, ...]

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _max_in_flight() -> int:
    value = os.environ.get("DS_STPAR_P2P_IN_FLIGHT", "8")
    if not value.isdigit():
        raise ConfigError(f"DS_STPAR_P2P_IN_FLIGHT must be a whole number >= 0, got {value!r}")
    return int(value)


MAX_IN_FLIGHT = _max_in_flight()
"""How many P2P batches the host may issue ahead of the GPU per device; 0: no bound.

Eight batches are two transformer layers of a P = 2 ring (four linears, one hop each): tens of
milliseconds of queued GPU work at 8K-32K tokens, where the host issues a layer in a few.
``DS_STPAR_P2P_IN_FLIGHT`` in the environment sets it."""


class Waitable(Protocol):
    """What :class:`InFlightLimit` holds: a ``torch.cuda.Event`` on GPU."""

    def synchronize(self) -> None: ...


class InFlightLimit:
    """Keeps the host at most ``limit`` batches ahead: ``add`` takes an event recorded on the
    compute stream where a batch was issued and, once more than ``limit`` are held, waits on the
    host until the GPU has reached the oldest ones.

    ``limit <= 0`` never waits.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._events: deque[Waitable] = deque()

    def add(self, event: Waitable) -> None:
        if self.limit <= 0:
            return
        self._events.append(event)
        while len(self._events) > self.limit:
            self._events.popleft().synchronize()


_LIMITS: dict[torch.device, InFlightLimit] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One communication stream per CUDA device, created on first use."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


@dataclass(frozen=True)
class Message:
    """One side of a point-to-point transfer: ``tensor`` to/from group rank ``peer``.

    ``tag`` tells apart several messages between the same pair of ranks in one batch (the
    receiver posts the same tag); NCCL matches them by order instead, which is the same order.
    """

    tensor: Tensor
    peer: int
    tag: int = 0


class PendingP2P:
    """Transfers in flight; :meth:`wait` completes them and returns the received tensors."""

    def __init__(self, works: list, received: list[Tensor], stream: torch.cuda.Stream | None):
        self._works = works
        self._received = received
        self._stream = stream

    def wait(self) -> list[Tensor]:
        for work in self._works:
            work.wait()
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        return self._received


def _p2p_ops(sends: Sequence[Message], recvs: Sequence[Message], group: Group) -> list:
    """The batch as ``dist.P2POp``s (global peer ranks) for ``dist.batch_isend_irecv``."""
    return [
        dist.P2POp(kind, msg.tensor, dist.get_global_rank(group, msg.peer), group, msg.tag)
        for kind, messages in ((dist.isend, sends), (dist.irecv, recvs))
        for msg in messages
    ]


_COALESCES: dict[tuple[Group, torch.device], bool] = {}


def _coalesces(group: Group, device: torch.device) -> bool:
    """Whether ``group``'s backend on ``device`` batches P2P itself (NCCL's group calls): the
    test ``dist.batch_isend_irecv`` makes on every call, made once per group."""
    key = (group, device)
    if key not in _COALESCES:
        _COALESCES[key] = (
            type(group) is dist.ProcessGroup and group._get_backend(device).supports_coalescing
        )
    return _COALESCES[key]


def _coalesced_batch(
    sends: Sequence[Message], recvs: Sequence[Message], group: Group, device: torch.device
):
    """What ``dist.batch_isend_irecv`` does for a coalescing backend (its start / send / recv /
    end calls on the group, with group ranks), minus its per-op Python (``P2POp``s, rank
    translation, checks, logging wrappers), issued from the compute stream. NCCL runs the
    batch on its own stream, which first waits for the compute stream (a buffer is sent only
    once written); the returned work's ``wait`` makes the compute stream wait for the batch,
    and the process group keeps the buffers from the caching allocator until then. So the
    side stream, its two stream waits and the ``record_stream`` calls of the generic path are
    not needed here: they cost the host more than the transfer's launch, and a P = 2 ring
    layer issues about eight batches per forward and backward (BENCHMARKS.md, eighteenth
    session). One work for the whole batch."""
    group._start_coalescing(device)
    for msg in sends:
        group.send([msg.tensor], msg.peer, msg.tag)
    for msg in recvs:
        group.recv([msg.tensor], msg.peer, msg.tag)
    return group._end_coalescing(device)


def start_p2p(sends: Sequence[Message], recvs: Sequence[Message], group: Group) -> PendingP2P:
    """Start all ``sends`` and ``recvs`` (group ranks) as one batch; returns at once.

    Receive buffers must be contiguous and are filled in place. A message to or from this rank
    itself is not allowed (callers copy locally instead).
    """
    messages = [*sends, *recvs]
    for msg in messages:
        if not msg.tensor.is_contiguous():
            raise ValueError("P2P buffers must be contiguous")
    received = [msg.tensor for msg in recvs]
    if not messages:
        return PendingP2P([], received, None)
    device = messages[0].tensor.device
    if device.type != "cuda":
        return PendingP2P(dist.batch_isend_irecv(_p2p_ops(sends, recvs, group)), received, None)
    compute = torch.cuda.current_stream(device)
    if _coalesces(group, device):
        pending = PendingP2P([_coalesced_batch(sends, recvs, group, device)], received, None)
    else:
        stream = _side_stream(device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            works = dist.batch_isend_irecv(_p2p_ops(sends, recvs, group))
        for msg in messages:
            msg.tensor.record_stream(stream)
        pending = PendingP2P(works, received, stream)
    _bound_in_flight(compute)
    return pending


def start_ring_hop(sends: Sequence[Message], recvs: Sequence[Message], group: Group) -> PendingP2P:
    """:func:`start_p2p` for a ring's hop, which every rank of ``group`` issues at the same
    point: each rank's ``sends`` go to one neighbour and its ``recvs`` come from the other,
    matching that neighbour's sends in order and size (the same sizes on every rank, as a
    ring's chunks are). Where the group's transfers stage through host memory
    (:mod:`ds_stpar.layers.host_staged`: GPUs of one host without peer access) the copy
    engines move the hop, sparing the SMs NCCL's kernels would take beside the GEMMs it hides
    behind; elsewhere :func:`start_p2p`. The hop is checked the same way on either path."""
    to, source = {m.peer for m in sends}, {m.peer for m in recvs}
    if len(to) != 1 or len(source) != 1:
        raise ValueError(
            f"a ring's hop sends to one rank and receives from one, got {to} and {source}"
        )
    if not all(m.tensor.is_contiguous() for m in (*sends, *recvs)):
        raise ValueError("P2P buffers must be contiguous")
    device = sends[0].tensor.device
    staged = staged_group(group, device) if device.type == "cuda" else None
    if staged is None:
        return start_p2p(sends, recvs, group)
    received = [msg.tensor for msg in recvs]
    transfer = staged.start_shift([m.tensor for m in sends], *to, received, *source)
    _bound_in_flight(torch.cuda.current_stream(device))
    return PendingP2P([transfer], received, None)


def _bound_in_flight(compute: torch.cuda.Stream) -> None:
    """Count a batch just issued from ``compute`` against :data:`MAX_IN_FLIGHT` (see
    :class:`InFlightLimit`)."""
    if MAX_IN_FLIGHT > 0:
        if compute.device not in _LIMITS:
            _LIMITS[compute.device] = InFlightLimit(MAX_IN_FLIGHT)
        _LIMITS[compute.device].add(compute.record_event())


def ring_pass(
    group: Group,
    *,
    rotate: Tensor | None = None,
    visit: Callable[[int, Tensor], None] | None = None,
    partial: Callable[[int], Tensor] | None = None,
) -> Tensor | None:
    """P steps around the ring of ``group``; at most one hop per step per stream of data.

    ``rotate`` is this rank's chunk d. At step t the chunk c = (d+t) % P is here and
    ``visit(c, chunk)`` runs while the chunk travels on to d-1 (the chunk of d+1 arrives).
    ``visit`` must use ``chunk`` on the current stream and not keep it: an arrival may be a
    view of the copy engines' buffer, which a later batch writes over (``deferred_wgrad``
    keeps a P = 2 pass's arrival until the next batch and checks that none ran).

    ``partial(m)`` gives this rank's contribution to the sum for chunk m, as a fresh tensor
    (the received partial sum is added into it in place, so the pass holds one sum buffer
    less). At step t it is called for m = (d+t+1) % P (while the previous hop is in flight),
    the partial sum received from d+1 is added, and the result goes to d-1; the last step
    yields the complete sum for chunk d, which is returned. One batch per step carries both
    streams: :func:`start_ring_hop`'s (NCCL's, or without peer links the copy engines'
    through host memory), or, on GPUs with peer links (``DS_STPAR_RING_TRANSPORT``), the copy
    engines' (:mod:`ds_stpar.layers.symmetric`, whose arrivals are views of its buffer: no
    receive buffers here).
    """
    size, me = group.size(), group.rank()
    left, right = (me - 1) % size, (me + 1) % size
    symmetric = symmetric_ring(group, rotate.device) if rotate is not None else None
    spares = (
        [torch.empty_like(rotate) for _ in range(min(2, size - 1))]
        if rotate is not None and symmetric is None
        else []
    )
    acc_buffer: Tensor | None = None
    chunk, total, pending = rotate, None, None
    for step in range(size):
        here = (me + step) % size
        if partial is not None:
            total = partial((here + 1) % size)
        if pending is not None:
            received = pending.wait()
            if rotate is not None:
                chunk = received.pop(0)
            if partial is not None:
                total.add_(received.pop(0))  # partial() gave a fresh tensor: sum in place
        if step == 0 and rotate is None:  # an accumulator only: its device known now
            symmetric = symmetric_ring(group, total.device)
        if step < size - 1 and symmetric is not None:
            sent = ([chunk] if rotate is not None else []) + (
                [total] if partial is not None else []
            )
            pending = symmetric.start([t.contiguous() for t in sent])
            _bound_in_flight(torch.cuda.current_stream(symmetric.index))
        elif step < size - 1:
            sends, recvs = [], []
            if rotate is not None:
                sends.append(Message(chunk, left, 0))
                recvs.append(Message(spares[step % 2], right, 0))
            if partial is not None:
                if acc_buffer is None:
                    acc_buffer = torch.empty_like(total)
                sends.append(Message(total.contiguous(), left, 1))
                recvs.append(Message(acc_buffer, right, 1))
            pending = start_ring_hop(sends, recvs, group)
        if visit is not None:
            visit(here, chunk)
    return total


def _chunk(x: Tensor, index: int, parts: int) -> Tensor:
    rows = x.shape[0] // parts
    return x[index * rows : (index + 1) * rows]


def _check_divisible(x: Tensor, size: int) -> None:
    if x.shape[0] % size:
        raise ConfigError(f"dim 0 of size {x.shape[0]} must be divisible by the group size {size}")


def _gather(x: Tensor, group: Group) -> Tensor:
    size = group.size()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    ring_pass(group, rotate=x, visit=lambda c, xc: _chunk(out, c, size).copy_(xc))
    return out


def _reduce_scatter(x: Tensor, group: Group) -> Tensor:
    size = group.size()
    return ring_pass(group, partial=lambda m: _chunk(x, m, size).clone())


class _RingShift(torch.autograd.Function):
    """forward: rank d receives rank (d+hops)'s tensor; backward: the gradient goes back."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Group, hops: int) -> Tensor:
        ctx.group, ctx.hops = group, hops
        return _shift(x, group, hops)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _shift(grad.contiguous(), ctx.group, -ctx.hops), None, None


def _shift(x: Tensor, group: Group, hops: int) -> Tensor:
    size, me = group.size(), group.rank()
    recv = torch.empty_like(x)
    sends = [Message(x, (me - hops) % size)]
    return start_p2p(sends, [Message(recv, (me + hops) % size)], group).wait()[0]


def ring_shift(x: Tensor, group: Group, hops: int = 1) -> Tensor:
    """Rank d gets the tensor of rank (d + hops) % P (hops=1: every chunk moves one step left)."""
    if group.size() == 1 or hops % group.size() == 0:
        return x
    return _RingShift.apply(x.contiguous(), group, hops)


class _RingAllGather(torch.autograd.Function):
    """forward: rotating chunks, [n, ...] -> [P*n, ...]; backward: rotating accumulator."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _reduce_scatter(grad.contiguous(), ctx.group), None


def ring_all_gather(x: Tensor, group: Group) -> Tensor:
    """Concatenate every rank's ``x`` along dim 0 in rank order, by P-1 neighbour hops."""
    if group.size() == 1:
        return x
    return _RingAllGather.apply(x.contiguous(), group)


class _RingReduceScatter(torch.autograd.Function):
    """forward: rotating accumulator, [P*n, ...] -> [n, ...]; backward: rotating chunks."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _gather(grad.contiguous(), ctx.group), None


def ring_reduce_scatter(x: Tensor, group: Group) -> Tensor:
    """Rank d gets chunk d (of P along dim 0) of the sum of every rank's ``x``."""
    if group.size() == 1:
        return x
    _check_divisible(x, group.size())
    return _RingReduceScatter.apply(x.contiguous(), group)


@dataclass(frozen=True)
class TorusGrid:
    """This rank's place on the q x q torus of a TP group of q*q ranks (row-major:
    group rank = row * q + col, as :class:`~ds_stpar.config.Layout` documents)."""

    q: int
    row: int
    col: int

    @classmethod
    def of(cls, group: Group) -> TorusGrid:
        size = group.size()
        q = math.isqrt(size)
        if q * q != size:
            raise ConfigError(
                f"tp_mode=cannon needs a square TP group (4, 9, 16, ...), got {size} ranks"
            )
        row, col = divmod(group.rank(), q)
        return cls(q, row, col)

    def rank(self, row: int, col: int) -> int:
        """Group rank of the torus position (row, col), wrapping around."""
        return (row % self.q) * self.q + col % self.q


class _TorusShift(torch.autograd.Function):
    """forward: (r, c) receives the tensor of (r+rows, c+cols); backward: the reverse shift."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Group, rows: int, cols: int) -> Tensor:
        ctx.group, ctx.rows, ctx.cols = group, rows, cols
        return _torus_shift(x, group, rows, cols)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _torus_shift(grad.contiguous(), ctx.group, -ctx.rows, -ctx.cols), None, None, None


def _torus_shift(x: Tensor, group: Group, rows: int, cols: int) -> Tensor:
    grid = TorusGrid.of(group)
    dst = grid.rank(grid.row - rows, grid.col - cols)
    src = grid.rank(grid.row + rows, grid.col + cols)
    if src == group.rank():
        return x.clone()
    recv = torch.empty_like(x)
    return start_p2p([Message(x, dst)], [Message(recv, src)], group).wait()[0]


def torus_shift(x: Tensor, group: Group, rows: int = 0, cols: int = 1) -> Tensor:
    """Cannon shift: (r, c) gets the tensor of (r+rows, c+cols). ``cols=1`` moves every block
    one step left along its torus row, ``rows=1`` one step up along its column."""
    if group.size() == 1:
        return x
    return _TorusShift.apply(x.contiguous(), group, rows, cols)


@dataclass(frozen=True)
class ExchangePlan:
    """One rank's part of a block re-layout: what it sends and where received blocks go.

    ``sends``: (peer, region of the input) and ``recvs``: (peer, region of the output), at most
    one of each per peer; a peer equal to this rank is a local copy. The output is zero where no
    block lands, and blocks landing on the same region add up, so :meth:`transpose` (swap the
    roles) is the exact adjoint and serves as the backward.
    """

    out_shape: tuple[int, ...]
    sends: tuple[tuple[int, Region], ...]
    recvs: tuple[tuple[int, Region], ...]

    def transpose(self, in_shape: tuple[int, ...]) -> ExchangePlan:
        return ExchangePlan(tuple(in_shape), self.recvs, self.sends)


def _region_shape(region: Region, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(len(range(*sl.indices(n))) for sl, n in zip(region, shape))


def _run_exchange(x: Tensor, plan: ExchangePlan, group: Group) -> Tensor:
    me = group.rank()
    out = x.new_zeros(plan.out_shape)
    sends = [Message(x[region].contiguous(), peer) for peer, region in plan.sends if peer != me]
    landing = [(peer, region) for peer, region in plan.recvs if peer != me]
    buffers = [x.new_empty(_region_shape(region, plan.out_shape)) for _, region in landing]
    pending = start_p2p(sends, [Message(b, p) for b, (p, _) in zip(buffers, landing)], group)
    local_src = [region for peer, region in plan.sends if peer == me]
    local_dst = [region for peer, region in plan.recvs if peer == me]
    for src, dst in zip(local_src, local_dst):
        out[dst] += x[src]
    for (_, region), block in zip(landing, pending.wait()):
        out[region] += block
    return out


class _Exchange(torch.autograd.Function):
    """forward: the block re-layout of ``plan``; backward: the transposed plan."""

    @staticmethod
    def forward(ctx, x: Tensor, plan: ExchangePlan, group: Group) -> Tensor:
        ctx.plan, ctx.group, ctx.in_shape = plan, group, tuple(x.shape)
        return _run_exchange(x, plan, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        plan = ctx.plan.transpose(ctx.in_shape)
        return _run_exchange(grad.contiguous(), plan, ctx.group), None, None


def exchange(x: Tensor, plan: ExchangePlan, group: Group) -> Tensor:
    """Re-lay ``x`` out across ``group`` as ``plan`` says (differentiable)."""
    return _Exchange.apply(x, plan, group)
