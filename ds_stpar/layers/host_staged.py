"""Tensor-parallel transfers of one host's GPUs through shared page-locked host memory, moved
by the copy engines: no SMs.

Why. Where a host's GPUs cannot reach each other's memory (a PCIe box without peer access,
or ``NCCL_P2P_DISABLE=1``), NCCL moves data through host memory with kernels on the SMs, and
those kernels slow the GEMMs the interleaved layer hides its transfers behind: a 64 MiB
gather beside four 8192^3 GEMMs added 0.96 ms to them through NCCL and 0.10 ms staged by the
copy engines (2 x H200, twenty-fourth session, call 138). That session's transport issued a
reader's copies when the caller finished the transfer, so each transfer ran store and
forward on the layer's critical path (blocks of 4 of its layers at h 8192 / 16K ran
1.00-1.08x Megatron TP2 + SP, with NCCL's transfers 1.27-1.31x). Here a rank issues its reads as soon as the peers have issued their writes,
behind GPU-side waits for them on a stream of their own, so the data lands while the caller
computes. A wait for another process's event holds every later command of its hardware queue,
so this needs ``CUDA_DEVICE_MAX_CONNECTIONS`` above 1, where CUDA spreads the streams over
several queues (a stream that still shares the receive stream's queue is only held in
order, as every rank issues the same transfers in the same order; Megatron's own
tensor-parallel overlap asks for 1, which the interleaved layer with this transport does not
need). Over the slow link on 2 x H200 (thirty-first session,
calls 204-206) the interleaved layer ran 1.30-1.37x Megatron TP2 + SP at h 8192 and
1.65-1.75x at h 4096 from 16K tokens, where NCCL's transfers gave 1.25-1.31x and 1.50-1.54x
(BENCHMARKS.md); at h 4096 / 8K, where the host sets the pace, 1.16-1.73x against NCCL's
1.43-1.46x: a staged transfer costs 0.2-0.4 ms of host time to issue, and a rank's reads
wait for the peer's host (below), so the two hosts move in step.

One transfer, exchange k of the group (every rank starts the same transfers in the same
order, as for NCCL's collectives), in slot ``k % SLOTS`` of every rank's buffer, each copy
in ``PIECES`` pieces so that a reader's host-to-device copy of one piece runs beside the
writer's device-to-host copy of the next::

    start           send stream: wait for the compute stream (the payload is written) and
                    for the readers of exchange k - SLOTS (the slot is free); per piece: D2H
                    into this rank's slot, record ``written``
    as soon as the peers have issued their writes (at this or a later start, at the latest
    at finish)      receive stream: per piece and peer: wait for its ``written``, H2D what
                    this rank needs from its slot; record ``read``
    finish          the compute stream waits for both; adds or places what arrived

A stream can only wait for an event record the host has already issued, so each rank keeps
a shared counter of the last exchange whose writes and reads it issued, and reads its peers'
before it issues a wait (spinning only where it must: at finish, before writing a slot whose
readers have not issued their reads, and before the buffers grow). The hosts run ahead of the GPUs, so what a rank waits
for there is the skew between the hosts, not GPU time. The host views of the slots are
made once per buffer and kept.

Patterns, ``x`` as the caller passes it, P ranks, this rank d (``async_comm``'s):

- ``gather``: chunk d ``[n, ...]`` -> ``[P n, ...]``; every reader takes ``x``.
- ``reduce_scatter``: terms ``[P n, ...]`` -> chunk d of the sum; reader r takes chunk r.
- ``all_reduce``: ``x`` -> the sum; every reader takes ``x`` and adds in rank order, so
  every rank holds the same bits (at P = 2 one addition, NCCL's sum exactly).
- ``gather_others``: chunk d -> the other ranks' chunks ``[(P-1) n, ...]`` in rank order.
- ``reduce_others``: terms for the other ranks' chunks ``[(P-1) n, ...]`` (rank order) ->
  the sum of the other ranks' terms for chunk d ``[n, ...]``.

Which transport: ``DS_STPAR_TRANSFER_TRANSPORT`` = ``auto`` (default), ``nccl`` or
``host-staged``, the same on every rank (a group whose ranks differ is refused;
:func:`stages`). ``auto`` stages a group of GPUs on one host, one per process, that cannot
reach each other's memory (``NCCL_P2P_DISABLE=1``, or no peer access between some pair),
where no rank runs with ``CUDA_DEVICE_MAX_CONNECTIONS=1``; NCCL carries everything else, and
gloo groups keep their collectives. The buffers are ``SLOTS`` slots per rank in
``/dev/shm``, each as large as the largest transfer seen, rounded up to a page (grown
collectively, at the same transfer on every rank): at h 8192 and 32K tokens, 8 x 256 MiB
of page-locked host memory per rank.
"""

from __future__ import annotations

import mmap
import os
import socket
import time
import uuid
from collections import deque

import torch
import torch.distributed as dist
from torch import Tensor

from ds_stpar.config import TRANSFER_TRANSPORTS as TRANSPORTS
from ds_stpar.errors import ConfigError

SLOTS = 8  # transfers in flight before a slot is written again
PIECES = 2  # each transfer's copies in pieces, the reader's H2D of one beside the next D2H
SPIN_TIMEOUT_S = 600.0  # NCCL's default watchdog timeout
_ALIGN = 4096  # bytes: slot sizes, so that any dtype's view of a slot is aligned
_WRITTEN, _READ = 0, 1  # a rank's counters: the last exchange whose writes / reads it issued
KINDS = ("gather", "reduce_scatter", "all_reduce", "gather_others", "reduce_others")
_PER_READER = ("reduce_scatter", "reduce_others")  # a payload part per reader, not one for all
_ONE_QUEUE = (
    "host-staged transfers need CUDA_DEVICE_MAX_CONNECTIONS above 1 (unset: CUDA's 8): with "
    "one hardware queue a wait for the peer's copy holds the compute stream's work too"
)


def _transport() -> str:
    value = os.environ.get("DS_STPAR_TRANSFER_TRANSPORT", "auto")
    if value not in TRANSPORTS:
        raise ConfigError(f"DS_STPAR_TRANSFER_TRANSPORT must be one of {TRANSPORTS}, got {value!r}")
    return value


def _shared(name: str, nbytes: int, create: bool) -> mmap.mmap:
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


class HostStagedGroup:
    """One group's transfers through host memory on one device (module docstring)."""

    def __init__(self, group, device: torch.device) -> None:
        if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
            raise ConfigError(_ONE_QUEUE)
        self.group, self.device = group, device
        self.size, self.rank = group.size(), group.rank()
        self.send_stream = torch.cuda.Stream(device)
        self.recv_stream = torch.cuda.Stream(device)
        self.written = [torch.cuda.Event(interprocess=True) for _ in range(SLOTS * PIECES)]
        self.read = [torch.cuda.Event(interprocess=True) for _ in range(SLOTS)]
        for event in self.written + self.read:  # made on this device, then shared
            event.record(torch.cuda.current_stream(device))
        me = f"ds_stpar_{self._agree(uuid.uuid4().hex[:16])}_{self.rank}_ctr"
        self._mine = memoryview(_shared(me, 64, create=True)).cast("q")
        self._mine[_WRITTEN] = self._mine[_READ] = -1
        handles = ([e.ipc_handle() for e in self.written], [e.ipc_handle() for e in self.read])
        everyone: list = [None] * self.size
        dist.all_gather_object(everyone, (me, handles), group=group)
        self.peers = [r for r in range(self.size) if r != self.rank]
        self._theirs = {
            r: memoryview(_shared(everyone[r][0], 64, create=False)).cast("q") for r in self.peers
        }
        index = device.index if device.index is not None else torch.cuda.current_device()
        opened = {
            r: [[torch.cuda.Event.from_ipc_handle(index, h) for h in hs] for hs in everyone[r][1]]
            for r in self.peers
        }
        self._peer_written = {r: opened[r][0] for r in self.peers}
        self._peer_read = {r: opened[r][1] for r in self.peers}
        dist.barrier(group=group)
        os.unlink(f"/dev/shm/{me}")  # every rank has it mapped: the name can go
        self._buffers: _Buffers | None = None
        self._count = 0  # transfers started
        self._unread: deque[StagedTransfer] = deque()  # started, their reads not yet issued

    def _agree(self, tag: str) -> str:
        """Rank 0's ``tag`` on every rank of the group."""
        box = [tag]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def _reserve(self, nbytes: int) -> _Buffers:
        """Buffers whose slots hold ``nbytes``; grown collectively (every rank grows at the
        same transfer, since every rank runs the same shapes) once every copy is done."""
        if self._buffers is not None and nbytes <= self._buffers.slot_bytes:
            return self._buffers
        nbytes = -(-max(nbytes, 1) // _ALIGN) * _ALIGN  # every slot starts page-aligned
        self._issue_reads(upto=self._count)  # every copy of the old buffers issued,
        torch.cuda.synchronize(self.device)  # and done
        dist.barrier(group=self.group)  # nor a peer's
        if self._buffers is not None:
            self._buffers.close()
        self._buffers = _Buffers(self, self._agree(uuid.uuid4().hex[:16]), nbytes)
        return self._buffers

    def _spin(self, index: int, exchange: int) -> None:
        """Wait on the host until every peer has issued ``index`` for ``exchange``."""
        deadline = None
        for r in self.peers:
            while self._theirs[r][index] < exchange:
                deadline = deadline or time.monotonic() + SPIN_TIMEOUT_S
                if time.monotonic() > deadline:
                    what = "writes" if index == _WRITTEN else "reads"
                    raise RuntimeError(
                        f"host-staged transfer {exchange}: rank {r} of the group did not "
                        f"issue its {what} within {SPIN_TIMEOUT_S:.0f} s (a rank gone, or "
                        "ranks starting different transfers)"
                    )

    def start(self, kind: str, x: Tensor, in_place: bool = False) -> StagedTransfer:
        """Issue a ``kind`` transfer of ``x`` (module docstring); ``finish()`` on the result
        makes the current stream wait and returns what arrived. ``in_place``
        (``all_reduce``): the sum is made in ``x``."""
        if kind not in KINDS:
            raise ValueError(f"unknown transfer {kind!r}; one of {KINDS}")
        x = x.contiguous()
        parts = (
            list(x.chunk(self.size if kind == "reduce_scatter" else self.size - 1))
            if kind in _PER_READER
            else None
        )
        payload = [parts[r] for r in self.peers] if kind == "reduce_scatter" else parts or [x]
        part_bytes = payload[0].numel() * payload[0].element_size()
        buffers = self._reserve(part_bytes * len(payload))
        k, slot = self._count, self._count % SLOTS
        self._count += 1
        compute = torch.cuda.current_stream(self.device)
        result, arriving = self._receiving(kind, x, payload[0])
        ready = compute.record_event()  # the payload is written, what arrives is allocated
        if k >= SLOTS:  # the slot's last readers: this rank's own first, then the peers'
            self._issue_reads(upto=k - SLOTS)
            self._spin(_READ, k - SLOTS)
        with torch.cuda.stream(self.send_stream):
            self.send_stream.wait_event(ready)
            if k >= SLOTS:
                for r in self.peers:
                    self.send_stream.wait_event(self._peer_read[r][slot])
            sources = [_pieces(part) for part in payload]
            places = [
                buffers.pieces(self.rank, slot, i * part_bytes, part.dtype, part.numel())
                for i, part in enumerate(payload)
            ]
            for p in range(PIECES):
                for source, place in zip(sources, places, strict=True):
                    place[p].copy_(source[p], True)
                self.written[slot * PIECES + p].record(self.send_stream)
            sent = self.send_stream.record_event()
        self._mine[_WRITTEN] = k
        own = parts[self.rank] if kind == "reduce_scatter" else x
        tensors = (own, payload, arriving, result)
        transfer = StagedTransfer(self, kind, k, buffers, tensors, ready, sent, in_place)
        self._unread.append(transfer)
        self._issue_reads(upto=-1)
        return transfer

    def _issue_reads(self, upto: int) -> None:
        """Issue the reads of the transfers started so far, in order, as far as the peers
        have issued their writes; waiting on the host for those of exchanges up to ``upto``."""
        while self._unread:
            transfer = self._unread[0]
            k, slot = transfer.exchange, transfer.exchange % SLOTS
            if any(self._theirs[r][_WRITTEN] < k for r in self.peers):
                if k > upto:
                    return
                self._spin(_WRITTEN, k)
            _own, payload, arriving, _result = transfer.tensors
            part = payload[0]
            part_bytes = part.numel() * part.element_size()
            with torch.cuda.stream(self.recv_stream):
                self.recv_stream.wait_event(transfer.ready)
                targets = [_pieces(into) for into in arriving]
                for p in range(PIECES):
                    for r, target in zip(self.peers, targets, strict=True):
                        self.recv_stream.wait_event(self._peer_written[r][slot * PIECES + p])
                        at = self.rank - (self.rank > r) if transfer.kind in _PER_READER else 0
                        staged = transfer.buffers.pieces(
                            r, slot, at * part_bytes, part.dtype, part.numel()
                        )
                        target[p].copy_(staged[p], True)
                self.read[slot].record(self.recv_stream)
                transfer.received = self.recv_stream.record_event()
            self._mine[_READ] = k
            self._unread.popleft()

    def _receiving(self, kind: str, x: Tensor, part: Tensor) -> tuple[Tensor | None, list]:
        """(the result when it is what arrives, placed; the tensors each peer's part lands in)."""
        if kind == "gather":
            result = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
            chunks = list(result.chunk(self.size))
            chunks[self.rank].copy_(x)
            return result, [chunks[r] for r in self.peers]
        if kind == "gather_others":
            result = x.new_empty(((self.size - 1) * x.shape[0], *x.shape[1:]))
            return result, list(result.chunk(self.size - 1))
        return None, list(part.new_empty((len(self.peers), *part.shape)))

    def finish(self, transfer: StagedTransfer) -> Tensor:
        """Make the current stream wait for ``transfer``'s copies; its result."""
        self._issue_reads(upto=transfer.exchange)
        own, _payload, arriving, result = transfer.tensors
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(transfer.sent)  # the payload may be freed or written after this
        compute.wait_event(transfer.received)
        if result is not None:
            return result
        terms = list(arriving)  # the peers' terms, rank order
        if transfer.kind != "reduce_others":  # with this rank's own term
            terms.insert(self.rank, own)  # summed in rank order: the same bits on every rank
        if transfer.in_place and self.size == 2:
            return own.add_(terms[1 - self.rank]).detach()
        total = terms[0] + terms[1] if len(terms) > 1 else terms[0]
        for term in terms[2:]:
            total += term
        return own.copy_(total).detach() if transfer.in_place else total


def _pieces(t: Tensor) -> tuple[Tensor, ...]:
    """Contiguous ``t``'s elements in ``PIECES`` pieces."""
    return t.view(-1).tensor_split(PIECES)


class _Buffers:
    """Every rank's shared buffer of ``SLOTS`` slots of ``slot_bytes``, mapped and page-locked
    in this process (made collectively over the group)."""

    def __init__(self, owner: HostStagedGroup, tag: str, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        name = lambda r: f"ds_stpar_{tag}_{r}_buf"  # noqa: E731
        self._maps = {owner.rank: _shared(name(owner.rank), slot_bytes * SLOTS, create=True)}
        dist.barrier(group=owner.group)
        for r in owner.peers:
            self._maps[r] = _shared(name(r), slot_bytes * SLOTS, create=False)
        dist.barrier(group=owner.group)
        os.unlink(f"/dev/shm/{name(owner.rank)}")
        self._bytes = {r: torch.frombuffer(m, dtype=torch.uint8) for r, m in self._maps.items()}
        self._views: dict[tuple, tuple[Tensor, ...]] = {}
        for raw in self._bytes.values():
            err = torch.cuda.cudart().cudaHostRegister(raw.data_ptr(), raw.numel(), 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {raw.numel()} bytes failed: {err}")

    def pieces(self, rank: int, slot: int, offset: int, dtype, numel: int) -> tuple[Tensor, ...]:
        """``numel`` elements of ``dtype`` at byte ``offset`` of ``rank``'s ``slot``, in
        ``PIECES`` pieces (kept: a transfer's host side is the same from step to step)."""
        key = (rank, slot, offset, dtype, numel)
        if key not in self._views:
            start = slot * self.slot_bytes + offset
            raw = self._bytes[rank][start : start + numel * dtype.itemsize]
            self._views[key] = raw.view(dtype).tensor_split(PIECES)
        return self._views[key]

    def close(self) -> None:
        for raw in self._bytes.values():
            torch.cuda.cudart().cudaHostUnregister(raw.data_ptr())
        self._bytes.clear()
        self._views.clear()
        for mapped in self._maps.values():
            mapped.close()


class StagedTransfer:
    """A transfer whose writes are issued (its reads as soon as the peers' writes are);
    :meth:`finish` returns its result on the current stream (it holds its tensors until
    then)."""

    def __init__(self, owner, kind, exchange, buffers, tensors, ready, sent, in_place) -> None:
        self._owner, self.kind, self.exchange = owner, kind, exchange
        self.buffers, self.tensors = buffers, tensors
        self.ready, self.sent, self.in_place = ready, sent, in_place
        self.received = None  # recorded once its reads are issued

    def finish(self) -> Tensor:
        return self._owner.finish(self)


_GROUPS: dict[tuple, HostStagedGroup | None] = {}


def staged_group(group, device: torch.device) -> HostStagedGroup | None:
    """The group's :class:`HostStagedGroup` on ``device`` when its transfers stage through
    host memory (module docstring: ``DS_STPAR_TRANSFER_TRANSPORT``); None when NCCL's (or
    gloo's) collectives carry them. Collective over a GPU group the first time it is asked,
    whatever the setting, so that ranks set differently fail instead of waiting."""
    if device.type != "cuda" or group.size() < 2:
        return None
    key = (group, device)
    if key not in _GROUPS:
        _GROUPS[key] = HostStagedGroup(group, device) if _stages(group, device) else None
    return _GROUPS[key]


def _stages(group, device: torch.device) -> bool:
    """Whether the group's transfers stage through host memory (collective; every rank gets
    the same answer): every rank's setting, place and hardware queues, then whether it
    reaches every other rank's GPU (:func:`stages`)."""
    mine = (
        _transport(),
        socket.gethostname(),
        device.index,
        os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
    )
    everyone: list = [None] * group.size()
    dist.all_gather_object(everyone, mine, group=group)
    settings = {transport for transport, *_ in everyone}
    if len(settings) > 1:
        raise ConfigError(
            f"DS_STPAR_TRANSFER_TRANSPORT differs between the group's ranks: {sorted(settings)}"
        )
    places = [place for _, *place in everyone]
    reach = os.environ.get("NCCL_P2P_DISABLE") != "1" and all(
        index is not None and torch.cuda.can_device_access_peer(device, index)
        for rank, (host, index, _) in enumerate(places)
        if rank != group.rank() and host == socket.gethostname() and index != device.index
    )
    verdicts: list = [None] * group.size()
    dist.all_gather_object(verdicts, reach, group=group)
    return stages(settings.pop(), places, all(verdicts))


def stages(transport: str, places: list[tuple[str, int | None, str | None]], peers: bool) -> bool:
    """Whether a group stages its transfers through host memory, from the setting
    (``transport``), every rank's (host name, device index, CUDA_DEVICE_MAX_CONNECTIONS)
    and whether its GPUs reach each other's memory (``peers``). ``host-staged``: yes, or a
    ConfigError where it cannot run (ranks on several hosts, a single hardware queue).
    ``auto``: where it can run and the GPUs cannot reach each other (``NCCL_P2P_DISABLE=1``,
    a PCIe box without peer access), with one process per GPU; ``nccl``: no."""
    if transport == "nccl":
        return False
    hosts = {host for host, _, _ in places}
    one_queue = any(connections == "1" for _, _, connections in places)
    if transport == "host-staged":
        if len(hosts) > 1:
            raise ConfigError(
                f"DS_STPAR_TRANSFER_TRANSPORT=host-staged needs the group on one host; it spans "
                f"{sorted(hosts)}"
            )
        if one_queue:
            raise ConfigError(_ONE_QUEUE)
        return True
    distinct = len({index for _, index, _ in places}) == len(places)
    return len(hosts) == 1 and distinct and not peers and not one_queue
