"""Ring hops by the GPU's copy engines, through PyTorch's symmetric memory.

NCCL's send and receive run as kernels on the SMs, beside the sub-GEMM they should hide
behind. Here each rank instead *pushes* what it sends into its left neighbour's symmetric
buffer with ``copy_`` on a side stream, which CUDA carries out by copy engine over NVLink (or
whatever peer link CUDA IPC has): no SMs but those of two one-block barrier kernels per batch.
One batch of a ring step (``comm.ring_pass``), on the side stream:

    wait for the compute stream       (what is sent is written; earlier arrivals were read)
    barrier                           (every rank there: its own arrivals' readers are done)
    copy_ each tensor into the left neighbour's buffer
    -- the compute stream runs the step's sub-GEMM meanwhile --
    barrier                           (every push landed), in ``finish``; the compute stream waits

The arrivals are views of this rank's own buffer, valid until its next batch but one: the
buffer holds two batches in turn for P > 2, where a step sends on the chunk that arrived in
the previous one while the next arrives; at P = 2 a pass has one batch, so one. The buffer
grows (re-made and rendezvoused, collective over the group, at the same pass on every rank
since every rank runs the same shapes) to the largest batch seen and is not returned to the
caching allocator: it is not in ``torch.cuda.max_memory_allocated``, and
:func:`workspace_bytes` says how much it holds.

Which transport: ``DS_STPAR_RING_TRANSPORT`` = ``auto`` (default), ``nccl`` or
``symmetric-memory``, the same on every rank (as NCCL's own variables: ranks that disagree
wait for each other at the first ring pass). ``auto`` takes the copy engines for a GPU group
on one host whose GPUs all reach each other (``torch.cuda.can_device_access_peer`` between
every pair; ranks that see their peers under the same device index, one GPU per process,
are not taken to), unless ``NCCL_P2P_DISABLE=1`` says peer links are not to be used; the
ranks agree on it once per group (collective: a gather of host names and device indices,
a MIN all-reduce of the verdicts), so they all take the same transport. A barrier that waits
longer than :data:`BARRIER_TIMEOUT_MS` (a rank gone) stops the kernel with an error instead
of hanging.
CPU groups (gloo) always use ``start_p2p``. Measured over NVLink: on 2 x H100 the two-pass
ring's layer blocks and MLP blocks ran faster with the copy engines than with NCCL in 29 of
32 paired runs, and a whole gpt3-2.7b's step went from 0.84x to 0.94x Megatron's
(twenty-second session); on 4 x H100 its blocks of 4 layers ran 1.06-1.14x Megatron TP4+SP
with them where the GPU set the pace and 0.56-1.02x where the host did (h 4096, 8K and 16K
tokens), against 0.47-0.97x with NCCL (twenty-third session; BENCHMARKS.md). Groups of more
than four ranks have not been measured.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import Tensor

from ds_stpar.config import RING_TRANSPORTS as TRANSPORTS
from ds_stpar.errors import ConfigError

_ALIGN = 256  # bytes between tensors in the buffer
BARRIER_TIMEOUT_MS = 600_000  # NCCL's default watchdog timeout


def _transport() -> str:
    value = os.environ.get("DS_STPAR_RING_TRANSPORT", "auto")
    if value not in TRANSPORTS:
        raise ConfigError(f"DS_STPAR_RING_TRANSPORT must be one of {TRANSPORTS}, got {value!r}")
    return value


TRANSPORT = _transport()
"""The ring's hop transport, from ``DS_STPAR_RING_TRANSPORT`` when this module is imported."""


class SymmetricRing:
    """One group's ring hops through symmetric memory on one device (module docstring):
    every batch sends to the left neighbour and receives the same shapes from the right."""

    def __init__(self, group, device: torch.device) -> None:
        self.group, self.device = group, device
        # the stream switches take the index, not the device: torch.cuda's lookup of a
        # device's index costs the host microseconds a call (twenty-third session, call 132)
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.rank = group.rank()
        self.left = (self.rank - 1) % group.size()
        self.parities = 2 if group.size() > 2 else 1
        self.stream = torch.cuda.Stream(device)
        self.capacity = 0  # bytes per parity
        self._handle = None
        self._buffer: Tensor | None = None
        self._views: dict[tuple, Tensor] = {}
        self.batches = 0  # started so far: which parity the next one takes

    def _reserve(self, nbytes: int) -> None:
        if nbytes <= self.capacity:
            return
        import torch.distributed._symmetric_memory as symm_mem

        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # older PyTorch needs the group enabled; newer deprecate it
            enable(self.group.group_name)
        torch.cuda.synchronize(self.device)  # nothing in flight reads or writes the old one
        self._views.clear()
        self._buffer = symm_mem.empty(nbytes * self.parities, dtype=torch.uint8, device=self.device)
        self._handle = symm_mem.rendezvous(self._buffer, self.group)
        self.capacity = nbytes

    def _view(self, rank: int, offset: int, like: Tensor) -> Tensor:
        key = (rank, offset, like.shape, like.dtype)
        if key not in self._views:
            self._views[key] = self._handle.get_buffer(
                rank, like.shape, like.dtype, storage_offset=offset // like.element_size()
            )
        return self._views[key]

    def start(self, tensors: Sequence[Tensor]) -> SymmetricBatch:
        """Push ``tensors`` (contiguous) to the left neighbour; the batch's arrivals from the
        right have the same shapes and dtypes."""
        sizes = [-(-t.numel() * t.element_size() // _ALIGN) * _ALIGN for t in tensors]
        self._reserve(sum(sizes))
        offset = (self.batches % self.parities) * self.capacity
        self.batches += 1
        compute = torch.cuda.current_stream(self.index)
        self.stream.wait_stream(compute)
        arrivals = []
        caller = self._to_side_stream()
        try:
            self._handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
            for tensor, size in zip(tensors, sizes, strict=True):
                self._view(self.left, offset, tensor).copy_(tensor)
                arrivals.append(self._view(self.rank, offset, tensor))
                offset += size
        finally:
            self._back(compute, caller)
        for tensor in tensors:
            tensor.record_stream(self.stream)
        return SymmetricBatch(self, arrivals)

    def finish(self) -> None:
        compute = torch.cuda.current_stream(self.index)
        caller = self._to_side_stream()
        try:
            self._handle.barrier(channel=1, timeout_ms=BARRIER_TIMEOUT_MS)
        finally:
            self._back(compute, caller)
        compute.wait_stream(self.stream)

    def _to_side_stream(self) -> int:
        """Make the side stream current, and its device (``set_stream`` switches both; it
        costs the host less than ``torch.cuda.stream``'s context, whose device lookups took
        microseconds a call: call 132); returns the caller's device."""
        caller = torch.cuda.current_device()
        torch.cuda.set_stream(self.stream)
        return caller

    def _back(self, compute: torch.cuda.Stream, caller: int) -> None:
        """Undo :meth:`_to_side_stream`: ``compute`` current again, on the caller's device."""
        torch.cuda.set_stream(compute)
        if caller != self.index:
            torch.cuda.set_device(caller)


class SymmetricBatch:
    """A batch in flight; :meth:`wait` makes the compute stream wait for every push of the
    group and returns this rank's arrivals (views of its buffer, see the module docstring)."""

    def __init__(self, ring: SymmetricRing, arrivals: list[Tensor]) -> None:
        self._ring, self._arrivals = ring, arrivals

    def wait(self) -> list[Tensor]:
        self._ring.finish()
        return list(self._arrivals)


_RINGS: dict[tuple, SymmetricRing] = {}
_CHOSEN: dict[tuple, bool] = {}  # (group, device) -> copy engines, decided once


def peer_links(group, device: torch.device) -> bool:
    """Whether every rank of ``group`` can reach every other's GPU memory, as symmetric memory
    needs (each rank maps all the group's buffers and its barriers signal every peer, not
    just the neighbour a ring step pushes to): one host, distinct device indices (the same
    index on two ranks means each process sees one GPU, whose peers it cannot check), peer
    access between every pair, ``NCCL_P2P_DISABLE`` not 1, symmetric memory in this PyTorch.
    Collective over ``group`` (all ranks get the same answer)."""
    import socket

    import torch.distributed as dist

    places: list = [None] * group.size()
    dist.all_gather_object(places, (socket.gethostname(), device.index), group=group)
    others = [index for rank, (_, index) in enumerate(places) if rank != group.rank()]
    try:
        import torch.distributed._symmetric_memory  # noqa: F401

        usable = True
    except ImportError:
        usable = False
    usable = (
        usable
        and os.environ.get("NCCL_P2P_DISABLE") != "1"
        and all(host == socket.gethostname() for host, _ in places)
        and len({index for _, index in places}) == len(places)
        and all(torch.cuda.can_device_access_peer(device, index) for index in others)
    )
    verdict = torch.tensor([int(usable)], device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=group)
    return bool(verdict.item())


def symmetric_ring(group, device: torch.device) -> SymmetricRing | None:
    """The group's :class:`SymmetricRing` on ``device`` when the copy engines carry its hops
    (module docstring: ``DS_STPAR_RING_TRANSPORT``); None when ``start_p2p`` does (CPU groups,
    ``nccl``, or ``auto`` without peer links)."""
    if TRANSPORT == "nccl" or device.type != "cuda" or group.size() < 2:
        return None
    key = (group, device)
    if key not in _CHOSEN:
        forced = TRANSPORT == "symmetric-memory"
        _CHOSEN[key] = forced or peer_links(group, device)
    if not _CHOSEN[key]:
        return None
    if key not in _RINGS:
        _RINGS[key] = SymmetricRing(group, device)
    return _RINGS[key]


def workspace_bytes(device: torch.device) -> int:
    """Bytes the symmetric rings hold on ``device`` (outside the caching allocator)."""
    return sum(r.capacity * r.parities for (_, d), r in _RINGS.items() if d == device)


def release(device: torch.device) -> None:
    """Drop the rings of ``device`` and their buffers (collective: every rank of their groups
    calls it at the same point); the next ring pass makes its buffer anew. For measurements
    that should hold only what the shapes at hand need."""
    torch.cuda.synchronize(device)
    for key in [key for key in _RINGS if key[1] == device]:
        del _RINGS[key]
