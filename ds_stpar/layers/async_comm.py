"""Transfers that start in one autograd node and finish in a later one.

The ring layers (``ring.py``, ``ring_mlp.py``) wait for every hop inside the linear that
issued it, so a hop can only hide behind that linear's own sub-GEMMs. Here a transfer is split
in two nodes joined by a :class:`Transfer`: ``*_start`` issues it and returns a *token* (an
empty tensor carrying the autograd edge), ``*_finish`` waits and returns the result. Whatever
the caller issues in between (another micro-batch's attention, say) runs while the data
travels: :mod:`ds_stpar.layers.interleave` is the user.

Four patterns: Megatron's sequence-parallel pair, (P-1)/P of the tensor per rank, their
composition, and the pair without this rank's own chunk:

- **gather**: chunk d ``[n, ...]`` -> ``[P n, ...]`` in rank order; backward: the
  reduce-scatter of the gradient (this rank's terms ``[P n, ...]`` -> chunk d of the sum
  over ranks ``[n, ...]``). The interleaved layer reduces its outputs as the others' rows
  (below), so the reduce-scatter runs only as this adjoint.
- **all-reduce**: the sum on every rank (a reduce-scatter then a gather, in one collective);
  backward: the all-reduce of the gradient.
- **the others' rows**, a gather and a reduce-scatter that leave this rank's own chunk out,
  so that the caller works on it while the others travel (one all-to-all each, the same
  volume as Megatron's): *gather of the others*, chunk d ``[n, ...]`` -> the other ranks'
  chunks ``[(P-1) n, ...]`` in rank order; *reduce of the others*, this rank's terms for
  the other ranks' chunks ``[(P-1) n, ...]`` -> the sum of the other ranks' terms for chunk
  d ``[n, ...]``, to which the caller adds its own. Each is the other's adjoint.

In the backward the roles swap: finish's backward *starts* the adjoint transfer and start's
backward waits for it. Autograd runs the ready node created last first, so the backward
issues and overlaps in the forward's order reversed.

Transport: where the group's GPUs sit on one host without peer access and more than one
hardware queue is allowed, the copy engines through shared page-locked host memory
(:mod:`ds_stpar.layers.host_staged`, ``DS_STPAR_TRANSFER_TRANSPORT``); otherwise the
group's own collectives (``all_gather_single`` / ``reduce_scatter_single``,
the ``*_into_tensor`` / ``*_tensor`` names before torch 2.13, ``all_reduce``, and
``all_to_all_single`` for the others' rows, NCCL's send/receive kernel at P = 2) with
``async_op=True``: NCCL runs them on its own stream after the work already queued on the
current stream, and ``finish`` makes the current stream wait for them. At P = 2 each gather
or reduce-scatter is one exchange with the neighbour, the ring's hop; NCCL's collective moved
it at the rate of the ring's send/receive pair over host memory (2 x H100, BENCHMARKS.md,
sixteenth session, calls 70-71) in one kernel per transfer with no hop bookkeeping.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ds_stpar.layers.comm import Group
from ds_stpar.layers.host_staged import StagedTransfer, staged_group

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _InFlight:
    """A collective issued; :meth:`finish` makes the current stream wait and returns ``out``
    (the work holds its tensors until then)."""

    def __init__(self, work, out: Tensor):
        self._work, self._out = work, out

    def finish(self) -> Tensor:
        self._work.wait()
        return self._out


def _issue(collective, out: Tensor, x: Tensor, group: Group) -> _InFlight:
    return _InFlight(collective(out, x, group=group, async_op=True), out)


def _or_staged(kind: str, in_place: bool = False) -> Callable:
    """A start function whose transfer is staged through host memory by the copy engines
    where the group's transport is that (:mod:`ds_stpar.layers.host_staged`, which sends
    rows at a pitch, a piece of a batch, as they lie), its own (NCCL's, gloo's, on a
    contiguous ``x``) elsewhere."""

    def wrap(start: Callable[[Tensor, Group], _InFlight]) -> Callable:
        @functools.wraps(start)
        def started(x: Tensor, group: Group) -> _InFlight | StagedTransfer:
            staged = staged_group(group, x.device)
            if staged is None:
                return start(x.contiguous(), group)
            return staged.start(kind, x, in_place)

        return started

    return wrap


@_or_staged("gather")
def start_gather(x: Tensor, group: Group) -> _InFlight:
    """Issue the gather of ``x`` (chunk d, dim 0) over ``group``; ``finish()`` -> [P n, ...]."""
    out = x.new_empty((group.size() * x.shape[0], *x.shape[1:]))
    return _issue(_ALL_GATHER, out, x, group)


def _all_reduce_into(out: Tensor, x: Tensor, group: Group, async_op: bool):
    out.copy_(x)  # the caller's tensor stays as it was (autograd may hand it on elsewhere)
    return dist.all_reduce(out, group=group, async_op=async_op)


@_or_staged("all_reduce")
def start_all_reduce(x: Tensor, group: Group) -> _InFlight:
    """Issue the sum of ``x`` over ``group``; ``finish()`` -> the sum, on every rank."""
    return _issue(_all_reduce_into, torch.empty_like(x), x, group)


@_or_staged("all_reduce", in_place=True)
def start_all_reduce_in_place(x: Tensor, group: Group) -> _InFlight:
    """:func:`start_all_reduce` summing into ``x`` itself: no copy, ``x`` is the sum after
    ``finish()``, which returns it as a new tensor of the same memory (``x``'s own autograd
    history is left as it was)."""
    return _InFlight(dist.all_reduce(x, group=group, async_op=True), x.detach())


class _SumOfParts(_InFlight):
    """An all-to-all of ``parts`` equal chunks whose :meth:`finish` sums them."""

    def __init__(self, work, out: Tensor, parts: int):
        super().__init__(work, out)
        self._parts = parts

    def finish(self) -> Tensor:
        out = super().finish()
        return out if self._parts == 1 else out.view(self._parts, -1, *out.shape[1:]).sum(0)


def _others(group: Group, rows: int) -> list[int]:
    """All-to-all split sizes: ``rows`` to or from every rank but this one."""
    return [0 if rank == group.rank() else rows for rank in range(group.size())]


@_or_staged("reduce_others")
def start_reduce_others(x: Tensor, group: Group) -> _InFlight:
    """Issue sending ``x`` ``[(P-1) n, ...]`` (this rank's terms for the other ranks' chunks,
    rank order) to those ranks; ``finish()`` -> ``[n, ...]``, the sum of the other ranks'
    terms for chunk d."""
    parts = group.size() - 1
    splits = _others(group, x.shape[0] // parts)
    out = torch.empty_like(x)
    return _SumOfParts(
        dist.all_to_all_single(out, x, splits, splits, group=group, async_op=True), out, parts
    )


@_or_staged("gather_others")
def start_gather_others(x: Tensor, group: Group) -> _InFlight:
    """Issue sending ``x`` ``[n, ...]`` (chunk d) to every other rank; ``finish()`` ->
    ``[(P-1) n, ...]``, the other ranks' chunks in rank order."""
    parts = group.size() - 1
    sent = x if parts == 1 else x.repeat(parts, *([1] * (x.dim() - 1)))
    out = torch.empty_like(sent)
    splits = _others(group, x.shape[0])
    return _InFlight(
        dist.all_to_all_single(out, sent, splits, splits, group=group, async_op=True), out
    )


@_or_staged("reduce_scatter")
def start_reduce_scatter(x: Tensor, group: Group) -> _InFlight:
    """Issue the reduce-scatter of ``x`` ([P n, ...] this rank's terms) over ``group``;
    ``finish()`` -> chunk d of the sum over ranks."""
    out = x.new_empty((x.shape[0] // group.size(), *x.shape[1:]))
    return _issue(_REDUCE_SCATTER, out, x, group)


class Transfer:
    """What a start node hands its finish node, and what the finish node's backward hands
    the start node's backward (the adjoint transfer in flight)."""

    def __init__(self, group: Group):
        self.group = group
        self.forward: _InFlight | StagedTransfer | None = None
        self.backward: _InFlight | StagedTransfer | None = None


class _Start(torch.autograd.Function):
    """forward: issue ``issue(x)``; backward: finish the adjoint transfer (see the module
    docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, transfer: Transfer, issue: Callable) -> Tensor:
        ctx.transfer = transfer
        transfer.forward = issue(x, transfer.group)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad: Tensor):
        transfer = ctx.transfer
        grad, transfer.backward = transfer.backward.finish(), None
        return grad, None, None


class _Finish(torch.autograd.Function):
    """forward: wait and return the transfer's result; backward: issue ``adjoint(grad)``."""

    @staticmethod
    def forward(ctx, token: Tensor, transfer: Transfer, adjoint: Callable) -> Tensor:
        ctx.transfer, ctx.adjoint = transfer, adjoint
        result, transfer.forward = transfer.forward.finish(), None
        return result

    @staticmethod
    def backward(ctx, grad: Tensor):
        transfer = ctx.transfer
        transfer.backward = ctx.adjoint(grad, transfer.group)
        return grad.new_empty(0), None, None


def gather_start(x: Tensor, group: Group) -> tuple[Tensor, Transfer]:
    """Start gathering ``x`` ``[n, ...]`` (this rank's chunk, dim 0) over ``group``; returns
    (token, transfer) for :func:`gather_finish`."""
    transfer = Transfer(group)
    return _Start.apply(x, transfer, start_gather), transfer


def gather_finish(token: Tensor, transfer: Transfer) -> Tensor:
    """``[P n, ...]``: every rank's chunk in rank order (waits for the gather)."""
    return _Finish.apply(token, transfer, start_reduce_scatter)


def gather_others_start(x: Tensor, group: Group) -> tuple[Tensor, Transfer]:
    """Start sending ``x`` ``[n, ...]`` (this rank's chunk, dim 0) to every other rank of
    ``group``; returns (token, transfer) for :func:`gather_others_finish`."""
    if group.size() < 2:
        raise ValueError("a group of one has no other ranks to gather from")
    transfer = Transfer(group)
    return _Start.apply(x, transfer, start_gather_others), transfer


def gather_others_finish(token: Tensor, transfer: Transfer) -> Tensor:
    """``[(P-1) n, ...]``: the other ranks' chunks in rank order (waits for them)."""
    return _Finish.apply(token, transfer, start_reduce_others)


def reduce_others_start(x: Tensor, group: Group) -> tuple[Tensor, Transfer]:
    """Start sending ``x`` ``[(P-1) n, ...]``, this rank's terms for the other ranks' chunks
    (rank order, its own left out), to those ranks; returns (token, transfer) for
    :func:`reduce_others_finish`."""
    if group.size() < 2:
        raise ValueError("a group of one has no other ranks to reduce for")
    if x.shape[0] % (group.size() - 1):
        raise ValueError(
            f"dim 0 of size {x.shape[0]} must divide by the other ranks' count {group.size() - 1}"
        )
    transfer = Transfer(group)
    return _Start.apply(x, transfer, start_reduce_others), transfer


def reduce_others_finish(token: Tensor, transfer: Transfer) -> Tensor:
    """``[n, ...]``: the sum of the other ranks' terms for chunk d (waits for them); the
    caller adds its own term to make chunk d of the reduce-scatter."""
    return _Finish.apply(token, transfer, start_gather_others)


def all_reduce_start(x: Tensor, group: Group, consume: bool = False) -> tuple[Tensor, Transfer]:
    """Start summing ``x`` over ``group``; returns (token, transfer) for
    :func:`all_reduce_finish`. ``consume``: ``x`` is a fresh result that nothing else reads
    or saved for its backward (a linear's output handed straight here), so the sum is made
    in its own memory instead of a copy's; it then holds the sum (over NCCL a strided ``x`` is
    copied to a contiguous one first, which holds it instead). The backward's all-reduce
    copies its gradient either way: autograd hands the same gradient to other inputs (a
    residual add's)."""
    transfer = Transfer(group)
    issue = start_all_reduce_in_place if consume else start_all_reduce
    return _Start.apply(x, transfer, issue), transfer


def all_reduce_finish(token: Tensor, transfer: Transfer) -> Tensor:
    """The sum of every rank's tensor (waits for the all-reduce; its adjoint is itself)."""
    return _Finish.apply(token, transfer, start_all_reduce)
