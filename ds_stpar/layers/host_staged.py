"""Tensor-parallel transfers of one host's GPUs through shared page-locked host memory, moved
by the copy engines: no SMs.

Why. Where a host's GPUs cannot reach each other's memory (a PCIe box without peer access,
or ``NCCL_P2P_DISABLE=1``), NCCL moves data through host memory with kernels on the SMs, and
those kernels slow the GEMMs the interleaved layer hides its transfers behind (and the ring
layers their hops, which stage here too: ``comm.start_ring_hop``): a 64 MiB
gather beside four 8192^3 GEMMs added 0.96 ms to them through NCCL and 0.10 ms staged by the
copy engines (2 x H200, twenty-fourth session, call 138). That session's transport issued a
reader's copies when the caller finished the transfer, so each transfer ran store and
forward on the layer's critical path (blocks of 4 of its layers at h 8192 / 16K ran
1.00-1.08x Megatron TP2 + SP, with NCCL's transfers 1.27-1.31x). Here a rank issues its
reads when it starts the transfer, behind GPU-side waits for flags in shared host memory that
the writers' streams set after their copies (:mod:`ds_stpar.layers.stream_flags`), on a
stream of their own, so the data lands while the caller computes and neither host waits for
the other. A GPU-side wait holds every later command of its hardware queue, so this needs
``CUDA_DEVICE_MAX_CONNECTIONS`` above 1, where CUDA spreads the streams over several queues
(a stream that still shares the receive stream's queue is only held in order, as every rank
issues the same transfers in the same order; Megatron's own tensor-parallel overlap asks for
1, which the interleaved layer with this transport does not need).

The thirty-first session's version waited for the writers' IPC events instead, which a
stream can wait for only once the writer's host has recorded them: each rank's host issued
its reads only after its peers' hosts had issued their writes, so the hosts moved in step.
Over the slow link on 2 x H200 (calls 204-206) it ran the interleaved layer 1.30-1.37x
Megatron TP2 + SP at h 8192 and 1.65-1.75x at h 4096 from 16K tokens, where NCCL's transfers
gave 1.25-1.31x and 1.50-1.54x (BENCHMARKS.md); at h 4096 / 8K, where the host sets the
pace, 1.16-1.73x against NCCL's 1.43-1.46x.

One transfer, exchange k of the group (every rank starts the same transfers in the same
order, as for NCCL's collectives), in slot ``k % SLOTS`` of every rank's buffer, each copy
in pieces (the group's ``pieces``, ``PIECES`` unless given) so that a reader's host-to-device
copy of one piece runs beside the writer's device-to-host copy of the next; every rank's
flags count exchanges + 1::

    send stream     wait for the compute stream (the payload is written) and for every
                    peer's ``read`` flag of the slot to reach k - SLOTS + 1 (the slot is
                    free); per piece: D2H into this rank's slot, set ``written`` to k + 1
    receive stream  wait for the compute stream (what arrives is allocated); per piece and
                    peer: wait for its ``written`` to reach k + 1, H2D what this rank needs
                    from its slot; set this rank's ``read`` of the slot to k + 1
    finish          the compute stream waits for both; adds or places what arrived

The copies are issued to the driver directly (``cuMemcpyAsync``, as ``Tensor.copy_`` issues
them without its dispatch) on the two streams, from the calling thread, whose current device
must be the group's (one process per GPU). A rank that never writes
(gone) leaves its peers' receive streams waiting with no timeout, as an NCCL collective
without its watchdog would; the launcher (torchrun) ends the job when a rank dies. Ranks
that start different transfers are not detected: they read each other's bytes, or wait at a
buffer's growth, as NCCL's collectives issued in different orders would mismatch.

Patterns, ``x`` as the caller passes it, P ranks, this rank d (``async_comm``'s):

- ``gather``: chunk d ``[n, ...]`` -> ``[P n, ...]``; every reader takes ``x``.
- ``reduce_scatter``: terms ``[P n, ...]`` -> chunk d of the sum; reader r takes chunk r.
- ``all_reduce``: ``x`` -> the sum; every reader takes ``x`` and adds in rank order, so
  every rank holds the same bits (at P = 2 one addition, NCCL's sum exactly).
- ``gather_others``: chunk d -> the other ranks' chunks ``[(P-1) n, ...]`` in rank order.
- ``reduce_others``: terms for the other ranks' chunks ``[(P-1) n, ...]`` (rank order) ->
  the sum of the other ranks' terms for chunk d ``[n, ...]``.
- a ring's hop (:meth:`HostStagedGroup.start_shift`, ``comm.start_ring_hop``): this rank's
  messages to one neighbour, one after the other in its slot -> the other neighbour's, into
  the caller's receive buffers.

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

import functools
import mmap
import os
import socket
import uuid

import torch
import torch.distributed as dist
from torch import Tensor

from ds_stpar.config import TRANSFER_TRANSPORTS as TRANSPORTS
from ds_stpar.errors import ConfigError
from ds_stpar.layers.stream_flags import HostFlags, copy_bytes, copy_rows

SLOTS = 8  # transfers in flight before a slot is written again
PIECES = 4  # each copy in pieces, a reader's H2D of one beside the writer's D2H of the next
# (4 against 2 on 2 x H200, call 210: the fused ring MLP 2.5% faster at h 8192 / 8K, 6-8% at
# h 4096; the interleaved layer within 1% at h 8192, 3% faster at h 4096 / 16K, 15% slower
# at h 4096 / 8K, where the host sets the pace and its runs spread)
_ALIGN = 4096  # bytes: every slot and every message in one starts on a page
_FLAG_PAGE = 4096  # bytes of a rank's flags (32-bit each): bounds the piece count
_MAX_PIECES = (_FLAG_PAGE // 4 - SLOTS) // SLOTS  # SLOTS x (pieces + 1) flags in the page
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

    def __init__(self, group, device: torch.device, pieces: int = PIECES) -> None:
        if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
            raise ConfigError(_ONE_QUEUE)
        if not 1 <= pieces <= _MAX_PIECES:
            raise ValueError(f"pieces must be 1 to {_MAX_PIECES}, got {pieces}")
        flags = SLOTS * pieces + SLOTS  # each piece of each slot written, each slot read
        self.group, self.device, self.pieces = group, device, pieces
        self.size, self.rank = group.size(), group.rank()
        self.peers = [r for r in range(self.size) if r != self.rank]
        everyone: list = [None] * self.size  # the flags' layout and the pieces' bounds
        dist.all_gather_object(everyone, pieces, group=group)  # depend on it: the same
        if len(set(everyone)) > 1:  # on every rank, or each would read the others' wrong flags
            raise ValueError(f"the group's ranks stage in different piece counts: {everyone}")
        self.send_stream = torch.cuda.Stream(device)
        self.recv_stream = torch.cuda.Stream(device)
        with torch.cuda.device(device):
            self._pages = _SharedPages(
                self, self._agree(uuid.uuid4().hex[:16]), "flags", _FLAG_PAGE
            )
            self._flags = {r: HostFlags(page, flags) for r, page in self._pages.bytes.items()}
        self._buffers: _Buffers | None = None
        self._count = 0  # transfers started

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
        nbytes = _aligned(max(nbytes, 1))  # every slot starts page-aligned
        torch.cuda.synchronize(self.device)  # every copy of the old buffers done,
        dist.barrier(group=self.group)  # and every peer's
        if self._buffers is not None:
            self._buffers.close()
        self._buffers = _Buffers(self, self._agree(uuid.uuid4().hex[:16]), nbytes)
        return self._buffers

    def start(self, kind: str, x: Tensor, in_place: bool = False) -> StagedTransfer:
        """Issue a ``kind`` transfer of ``x`` (module docstring); ``finish()`` on the result
        makes the current stream wait and returns what arrived. ``in_place``
        (``all_reduce``): the sum is made in ``x``."""
        if kind not in KINDS:
            raise ValueError(f"unknown transfer {kind!r}; one of {KINDS}")
        if _rows_of(x) is None:  # rows at a pitch (a piece of a batch) are sent as they are
            x = x.contiguous()
        parts = (
            list(x.chunk(self.size if kind == "reduce_scatter" else self.size - 1))
            if kind in _PER_READER
            else None
        )
        payload = [parts[r] for r in self.peers] if kind == "reduce_scatter" else parts or [x]
        part = payload[0]
        part_bytes = part.numel() * part.element_size()
        result, arriving = self._receiving(kind, x, part)
        if kind == "gather":  # sent from where the result holds it already: the transfer then
            payload = [result.chunk(self.size)[self.rank]]  # keeps nothing of the caller's
        at = [self.rank - (self.rank > r) if kind in _PER_READER else 0 for r in self.peers]
        writes = [(each, i * part_bytes) for i, each in enumerate(payload)]
        reads = [(r, i * part_bytes, into) for r, i, into in zip(self.peers, at, arriving)]
        sent, received = self._issue(part_bytes * len(payload), writes, reads)
        own = None  # this rank's term of a sum, which finish adds to what arrives
        if kind == "reduce_scatter":
            own = parts[self.rank]
        elif kind == "all_reduce":
            own = x
        tensors = (own, payload, arriving, result)
        return StagedTransfer(self, kind, tensors, sent, received, in_place)

    def start_shift(
        self, sends: list[Tensor], to: int, recvs: list[Tensor], source: int
    ) -> StagedTransfer:
        """Issue a batch of point-to-point messages, every one of them sent to group rank
        ``to`` or received from ``source`` (a ring's hop): ``sends`` in this rank's slot, one
        after the other; ``recvs`` (contiguous) filled from ``source``'s slot, whose sends
        match them in order and size (as NCCL matches a batch's messages), the same sizes on
        every rank (so that every rank grows its buffers at the same hop). ``finish()``
        makes the current stream wait and returns ``recvs``."""
        if self.rank in (to, source):
            raise ValueError("a staged batch's messages go to and come from other ranks")
        sent_at, sent_bytes = _packed(sends)
        read_at, read_bytes = _packed(recvs)
        writes = list(zip(sends, sent_at))
        reads = [(source, at, into) for into, at in zip(recvs, read_at)]
        sent, received = self._issue(max(sent_bytes, read_bytes), writes, reads)
        return StagedTransfer(self, "shift", (None, sends, recvs, recvs), sent, received, False)

    def _issue(
        self, nbytes: int, writes: list[tuple[Tensor, int]], reads: list[tuple[int, int, Tensor]]
    ) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Issue exchange k: ``writes`` ``(tensor, byte offset)`` into this rank's slot,
        ``reads`` ``(peer, byte offset, tensor)`` from the peers' (module docstring's
        streams; what is read into contiguous, what is written contiguous or rows at a pitch,
        :func:`_rows_of`); the events (sent, received) for the compute stream. The copies go
        to the driver directly (:func:`copy_bytes`, :func:`copy_rows`), each piece of a
        tensor the same bytes on the writer's side and the reader's (:func:`_bounds`)."""
        if torch.cuda.current_device() != self.device.index:  # the driver's calls go to the
            raise RuntimeError(  # current device's context, the buffers registered there
                f"a staged transfer of {self.device} issued with cuda:"
                f"{torch.cuda.current_device()} current: set the process's device first"
            )
        buffers = self._reserve(nbytes)
        k, slot = self._count, self._count % SLOTS
        self._count += 1
        pieces, send, recv = self.pieces, self.send_stream, self.recv_stream
        ready = torch.cuda.current_stream(self.device.index).record_event()  # the payload written,
        send.wait_event(ready)  # what arrives allocated
        if k >= SLOTS:  # the slot is free once every peer has read exchange k - SLOTS
            for r in self.peers:
                self._flags[r].wait(send, self._read(slot), k - SLOTS + 1)
        mine = self._flags[self.rank]
        out = [
            (buffers.address(self.rank, slot, at), t.data_ptr(), _bounds(t, pieces), _rows(t))
            for t, at in writes
        ]
        for p in range(pieces):
            _copy_piece(send, out, p)
            mine.write(send, self._written(slot, p), k + 1)
        sent = send.record_event()
        recv.wait_event(ready)
        by_peer: dict[int, list] = {}
        for r, at, t in reads:
            by_peer.setdefault(r, []).append(
                (t.data_ptr(), buffers.address(r, slot, at), _bounds(t, pieces), None)
            )
        for p in range(pieces):
            for r, copies in by_peer.items():
                self._flags[r].wait(recv, self._written(slot, p), k + 1)
                _copy_piece(recv, copies, p)
        mine.write(recv, self._read(slot), k + 1)
        return sent, recv.record_event()

    def _written(self, slot: int, piece: int) -> int:
        """The flag a writer sets to exchange + 1 once that piece of its slot is written."""
        return slot * self.pieces + piece

    def _read(self, slot: int) -> int:
        """The flag a reader sets to exchange + 1 once it has read that slot of every peer."""
        return SLOTS * self.pieces + slot

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

    def finish(self, transfer: StagedTransfer) -> Tensor | list[Tensor]:
        """Make the current stream wait for ``transfer``'s copies; its result."""
        own, _payload, arriving, result = transfer.tensors
        compute = torch.cuda.current_stream(self.device.index)
        compute.wait_event(transfer.sent)  # the payload may be freed or written after this
        compute.wait_event(transfer.received)
        if result is not None:  # placed as it arrived (gathers, a shift's receive buffers)
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


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a page."""
    return -(-nbytes // _ALIGN) * _ALIGN


def _packed(tensors: list[Tensor]) -> tuple[list[int], int]:
    """(byte offsets of ``tensors`` one after the other in a slot, each page-aligned; the
    bytes they take)."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += _aligned(t.numel() * t.element_size())
    return offsets, end


def _bounds(t: Tensor, pieces: int) -> tuple[int, ...]:
    """Byte offsets where ``t``'s ``pieces`` pieces start, and its end: its bytes, as if
    packed (:func:`_rows_of`), cut as evenly as they go (a piece may be empty, or end inside an element: the copies are
    of bytes), so a writer's and a reader's pieces match wherever their byte counts do,
    whatever their dtypes."""
    return _piece_bounds(t.numel() * t.element_size(), pieces)


def _rows_of(t: Tensor) -> tuple[int, int] | None:
    """``(row bytes, pitch bytes)`` where ``t``'s elements, in order, are rows of contiguous
    bytes each ``pitch`` bytes after the previous one (a contiguous ``t``: one row, its
    bytes); None where they are not. A piece of a batch cut along dim 1, ``[n, b/k, h]`` of
    ``[n, b, h]``, is n rows of ``b/k h`` elements at a pitch of ``b h``: a transfer sends it
    from where it lies (:func:`_copy_piece`), not from a contiguous copy made first
    (BENCHMARKS.md, thirty-fifth session: such a copy of an output gradient's piece, 32 MiB at
    h 8192 / 8K tokens, was alive through the last piece's MLP backward)."""
    size = t.element_size()
    if t.is_contiguous():
        return t.numel() * size, t.numel() * size
    dims = [(n, stride) for n, stride in zip(t.shape, t.stride(), strict=True) if n != 1]
    row = 1
    while dims and dims[-1][1] == row:  # the innermost dims that lie contiguous
        row *= dims.pop()[0]
    outer = list(zip(dims, dims[1:]))
    if not dims or any(stride != n * inner for (_, stride), (n, inner) in outer):
        return None  # not one run of rows (or contiguous after all, which is_contiguous says)
    pitch = dims[-1][1]
    return (row * size, pitch * size) if pitch >= row else None


def _rows(t: Tensor) -> tuple[int, int]:
    """:func:`_rows_of` for a tensor a transfer writes, which must be rows at a pitch."""
    rows = _rows_of(t)
    if rows is None:
        raise ValueError(f"a staged write of strides {t.stride()} is not rows at a pitch")
    return rows


def _copy_piece(stream: torch.cuda.Stream, copies: list[tuple], p: int) -> None:
    """``stream`` copies piece ``p`` of each ``(to address, from address, bounds, rows)``:
    bytes ``bounds[p]`` to ``bounds[p + 1]`` of the source as if packed (``rows``: its
    :func:`_rows_of`, None for contiguous), to the same offsets of the destination, which is
    contiguous."""
    for into, source, bounds, rows in copies:
        start, end = bounds[p], bounds[p + 1]
        row, pitch = rows or (0, 0)
        if row == pitch:  # contiguous
            if end > start:
                copy_bytes(stream, into + start, source + start, end - start)
            continue
        while start < end:  # a piece's bounds may fall inside a row: those parts row by row
            line, skip = divmod(start, row)
            whole = (end - start) // row if skip == 0 else 0
            if whole:
                copy_rows(stream, into + start, row, source + line * pitch, pitch, row, whole)
                start += whole * row
            else:
                part = min(row - skip, end - start)
                copy_bytes(stream, into + start, source + line * pitch + skip, part)
                start += part


@functools.lru_cache(maxsize=256)
def _piece_bounds(nbytes: int, pieces: int) -> tuple[int, ...]:
    base, longer = divmod(nbytes, pieces)
    return tuple(p * base + min(p, longer) for p in range(pieces + 1))


class _SharedPages:
    """Every rank's shared mapping of ``nbytes`` named by ``tag`` and ``what``, mapped in
    this process as uint8 tensors (``bytes[rank]``; made collectively over the group)."""

    def __init__(self, owner: HostStagedGroup, tag: str, what: str, nbytes: int) -> None:
        name = lambda r: f"ds_stpar_{tag}_{r}_{what}"  # noqa: E731
        self._maps = {owner.rank: _shared(name(owner.rank), nbytes, create=True)}
        dist.barrier(group=owner.group)
        for r in owner.peers:
            self._maps[r] = _shared(name(r), nbytes, create=False)
        dist.barrier(group=owner.group)
        os.unlink(f"/dev/shm/{name(owner.rank)}")  # every rank has it mapped: the name can go
        self.bytes = {r: torch.frombuffer(m, dtype=torch.uint8) for r, m in self._maps.items()}

    def close(self) -> None:
        self.bytes.clear()
        for mapped in self._maps.values():
            mapped.close()


class _Buffers:
    """Every rank's shared buffer of ``SLOTS`` slots of ``slot_bytes``, mapped and page-locked
    in this process (made collectively over the group)."""

    def __init__(self, owner: HostStagedGroup, tag: str, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self._pages = _SharedPages(owner, tag, "buf", slot_bytes * SLOTS)
        for raw in self._pages.bytes.values():
            err = torch.cuda.cudart().cudaHostRegister(raw.data_ptr(), raw.numel(), 0)
            if int(err) != 0:
                raise RuntimeError(
                    f"cudaHostRegister of {raw.numel()} bytes failed: cudaError {int(err)}"
                )

    def address(self, rank: int, slot: int, offset: int) -> int:
        """The host address of byte ``offset`` of ``rank``'s ``slot``."""
        return self._pages.bytes[rank].data_ptr() + slot * self.slot_bytes + offset

    def close(self) -> None:
        for raw in self._pages.bytes.values():
            torch.cuda.cudart().cudaHostUnregister(raw.data_ptr())
        self._pages.close()


class StagedTransfer:
    """A transfer whose copies are issued; :meth:`finish` returns its result on the current
    stream (it holds its tensors until then)."""

    def __init__(
        self,
        owner: HostStagedGroup,
        kind: str,
        tensors: tuple,
        sent: torch.cuda.Event,
        received: torch.cuda.Event,
        in_place: bool,
    ) -> None:
        self._owner, self.kind, self.tensors = owner, kind, tensors
        self.sent, self.received, self.in_place = sent, received, in_place

    def finish(self) -> Tensor | list[Tensor]:
        return self._owner.finish(self)

    def wait(self) -> None:
        """:meth:`finish` under the name :class:`~ds_stpar.layers.comm.PendingP2P` calls."""
        self._owner.finish(self)


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
