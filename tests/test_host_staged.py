"""The interleaved layer's transfers and the ring layers' hops staged through shared host
memory by the copy engines (``layers/host_staged.py``), against NCCL's of the same tensors.

On two GPUs each rank runs every pattern of ``async_comm`` (gather, reduce-scatter,
all-reduce and its in-place form, the others' rows both ways) through its start / finish
pairs with ``DS_STPAR_TRANSFER_TRANSPORT=host-staged``: finished in the order started and in
the reverse order (as the backward may), with GEMMs on the compute stream in between, more
transfers than the buffer has slots (a slot is written again only after its reader is done),
and shapes that grow the buffer. Each result must equal NCCL's of the same inputs bit for
bit: copies for the gathers, and at P = 2 one bf16 or fp32 addition for the sums, which is
commutative (the others' sums are NCCL's reduce-scatter with a zero own term, x + 0 = x).
The four settings on two GPUs: ``host-staged`` and ``auto`` under ``NCCL_P2P_DISABLE=1``
stage, ``auto`` with peer access and ``nccl`` keep NCCL's (the same results either way). More
transfers than slots in flight at once, with no synchronisation between them, finished in
reverse. The ring layers' hops (``comm.start_ring_hop``): the fused ring MLP and a
``ring_pass`` staged and through NCCL, bit for bit. On one GPU shared by P = 2, 3 and 4
ranks (each its own process and CUDA context, a gloo group for the ranks' agreement): every
pattern against a reference made from every rank's input in the transport's order of
additions (bit for bit), more transfers in flight than slots, and a ring's hops against the
same ring on the CPU over gloo. On the CPU: which groups stage (every
rank's host, device and hardware queues, peer access), ranks set differently refused (not
left waiting for each other), gloo groups keep their collectives whatever the setting,
unknown settings and a single hardware queue refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_workers

SHAPES = [(64, 2, 96), (256, 1, 512), (32, 4, 8), (1024, 2, 256), (64, 2, 96)]


def _inputs(rank: int, shape, dtype, device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def _nccl(kind: str, x: torch.Tensor, group) -> torch.Tensor:
    size, rank = group.size(), group.rank()
    if kind == "gather":
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    if kind == "gather_others":
        everyone = list(_nccl("gather", x, group).chunk(size))
        return torch.cat(everyone[:rank] + everyone[rank + 1 :])
    if kind == "reduce_others":  # a reduce-scatter whose own term is zero
        terms = list(x.chunk(size - 1))
        terms.insert(rank, torch.zeros_like(terms[0]))
        return _nccl("reduce_scatter", torch.cat(terms), group)
    if kind == "reduce_scatter":
        out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x, group=group)
        return out
    out = x.clone()
    dist.all_reduce(out, group=group)
    return out


def _laid_out(x: torch.Tensor, pitched: bool) -> torch.Tensor:
    """A fresh copy of ``x`` ``[n, b, h]``: contiguous, or (``pitched``) the first half along
    dim 1 of a ``[n, 2 b, h]`` tensor, rows of ``b h`` elements at a pitch of ``2 b h`` (a
    piece of a batch, as the interleaved layer hands its transfers)."""
    if not pitched:
        return x.clone(memory_format=torch.contiguous_format)
    return torch.cat([x, torch.full_like(x, float("nan"))], dim=1)[:, : x.shape[1]]


def _starts() -> dict:
    """Every ``async_comm`` pattern's start, by name; the reduce-scatter's payload is the
    smallest, so the gather after it grows the buffer."""
    from ds_stpar.layers import async_comm

    return {
        "reduce_scatter": async_comm.start_reduce_scatter,
        "gather": async_comm.start_gather,
        "all_reduce": async_comm.start_all_reduce,
        "all_reduce_in_place": async_comm.start_all_reduce_in_place,
        "gather_others": async_comm.start_gather_others,
        "reduce_others": async_comm.start_reduce_others,
    }


def _worker(rank: int, world_size: int, expect_staged: bool) -> None:
    from ds_stpar.layers import host_staged

    device = torch.device("cuda", rank)
    group = dist.new_group(list(range(world_size)))
    starts = _starts()
    seed = 0
    for dtype, pitched in ((torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)):
        for reverse in (False, True):
            for shape in SHAPES * 2:  # 10 shapes x 6 patterns: more transfers than SLOTS
                seed += 1
                xs = {
                    k: _inputs(rank, shape, dtype, device, seed + i) for i, k in enumerate(starts)
                }
                wants = {k: _nccl(k.removesuffix("_in_place"), xs[k], group) for k in starts}
                # in place: the input is the sum; pitched: rows sent from where they lie
                sent = {k: _laid_out(x, pitched) for k, x in xs.items()}
                flights = [(k, starts[k](sent[k], group)) for k in starts]
                filler = torch.randn(512, 512, device=device) @ torch.randn(512, 512, device=device)
                order = reversed(flights) if reverse else flights
                results = {k: flight.finish() for k, flight in order}
                for k in starts:
                    what = f"{k} {shape} {dtype} reverse={reverse} pitched={pitched}"
                    assert torch.equal(results[k], wants[k]), f"{what}: differs from NCCL's"
                if expect_staged or not pitched:  # NCCL sums rows at a pitch in a contiguous
                    summed = sent["all_reduce_in_place"]  # copy, which the result is (async_comm)
                    assert torch.equal(summed, wants["all_reduce_in_place"])
                assert torch.equal(sent["all_reduce"], xs["all_reduce"]), "input changed"
                del filler
    torch.cuda.synchronize(device)
    assert (host_staged._GROUPS.get((group, device)) is not None) == expect_staged


def _gpus(count: int) -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= count


@pytest.mark.gpu
@pytest.mark.skipif(not _gpus(2), reason="needs 2 CUDA GPUs (CI has none)")
@pytest.mark.parametrize("setting", ["host-staged", "auto-p2p-disabled", "auto", "nccl"])
def test_two_gpu_transfers_match_nccl(monkeypatch, setting) -> None:
    transport = setting.removesuffix("-p2p-disabled")
    monkeypatch.setenv("DS_STPAR_TRANSFER_TRANSPORT", transport)  # the workers' env
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    if setting == "auto-p2p-disabled":
        monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    else:
        monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    peers = torch.cuda.can_device_access_peer(0, 1)
    staged = setting in ("host-staged", "auto-p2p-disabled") or (setting == "auto" and not peers)
    run_workers(_worker, 2, staged, backend="nccl")


def _many_in_flight_worker(rank: int, world_size: int) -> None:
    """More transfers in flight than the buffer has slots, started with no synchronisation
    between them and finished in reverse: a slot is written again only once its readers
    are done with it, and every read lands in its own transfer."""
    from ds_stpar.layers import async_comm, host_staged

    device = torch.device("cuda", rank)
    group = dist.new_group(list(range(world_size)))
    starts = [
        ("gather", async_comm.start_gather),
        ("all_reduce", async_comm.start_all_reduce),
        ("reduce_scatter", async_comm.start_reduce_scatter),
        ("gather_others", async_comm.start_gather_others),
        ("reduce_others", async_comm.start_reduce_others),
    ]
    count = 3 * host_staged.SLOTS + 1
    plan = [(starts[i % len(starts)], (256 + 64 * (i % 3), 2, 128)) for i in range(count)]
    xs = [
        _inputs(rank, shape, torch.bfloat16, device, 1000 + i) for i, (_, shape) in enumerate(plan)
    ]
    wants = [_nccl(kind, x, group) for ((kind, _), _), x in zip(plan, xs, strict=True)]
    torch.cuda.synchronize(device)
    flights = [start(x, group) for ((_, start), _), x in zip(plan, xs, strict=True)]
    results = [flight.finish() for flight in reversed(flights)][::-1]
    for i, (got, want) in enumerate(zip(results, wants, strict=True)):
        assert torch.equal(got, want), f"transfer {i} ({plan[i][0][0]}) differs from NCCL's"
    assert host_staged._GROUPS.get((group, device)) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not _gpus(2), reason="needs 2 CUDA GPUs (CI has none)")
def test_two_gpu_more_transfers_in_flight_than_slots(monkeypatch) -> None:
    monkeypatch.setenv("DS_STPAR_TRANSFER_TRANSPORT", "host-staged")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    run_workers(_many_in_flight_worker, 2, backend="nccl")


def _ring_worker(rank: int, world_size: int) -> None:
    """The ring layers' hops (``comm.start_ring_hop``) staged and through NCCL: the fused
    ring MLP's forward and every gradient, and a two-pass ring layer's passes (rotating
    chunks and a rotating accumulator in one batch), bit for bit the same (copies either
    way, the same sums in the same order)."""
    import os

    from ds_stpar.layers import comm, host_staged
    from ds_stpar.layers.ring_mlp import ring_mlp

    device = torch.device("cuda", rank)
    os.environ["DS_STPAR_RING_TRANSPORT"] = "nccl"  # peer links must not take ring_pass's hops
    groups = {}
    for transport in ("nccl", "host-staged"):  # each group's transport: set at its first use
        os.environ["DS_STPAR_TRANSFER_TRANSPORT"] = transport
        groups[transport] = dist.new_group(list(range(world_size)))
        host_staged.staged_group(groups[transport], device)
    assert host_staged._GROUPS[(groups["nccl"], device)] is None
    assert host_staged._GROUPS[(groups["host-staged"], device)] is not None
    g = torch.Generator().manual_seed(7)  # the same weights on both ranks, own rows each
    k, f = 256, 384
    w1 = torch.randn(f, k, generator=g).bfloat16().to(device) / 16
    w2 = torch.randn(k, f, generator=g).bfloat16().to(device) / 16
    b1 = torch.randn(f, generator=g).bfloat16().to(device)
    x = _inputs(rank, (512, 2, k), torch.bfloat16, device, 5)
    dy = _inputs(rank, (512, 2, k), torch.bfloat16, device, 6)
    act = torch.nn.functional.gelu
    chunk = _inputs(rank, (64, 2, 96), torch.float32, device, 8)
    got = {}
    for transport, group in groups.items():
        leaves = [t.clone().requires_grad_() for t in (x, w1, b1, w2)]
        y = ring_mlp(*leaves, act, group, pieces=3, min_piece_flop=0)
        y.backward(dy)
        visited: list = []
        total = comm.ring_pass(
            group,
            rotate=chunk,
            visit=lambda c, t, seen=visited: seen.append(t.clone()),
            partial=lambda m: chunk * (m + 1) + rank,
        )
        got[transport] = [y, *(t.grad for t in leaves), total, *visited]
    for i, (a, b) in enumerate(zip(got["nccl"], got["host-staged"], strict=True)):
        assert torch.equal(a, b), f"result {i} differs between the transports"


@pytest.mark.gpu
@pytest.mark.skipif(not _gpus(2), reason="needs 2 CUDA GPUs (CI has none)")
def test_two_gpu_ring_hops_staged_match_nccl(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    run_workers(_ring_worker, 2, backend="nccl")


def _summed(terms: list[torch.Tensor]) -> torch.Tensor:
    """Terms added in rank order, as the staged transport adds them."""
    total = terms[0] + terms[1] if len(terms) > 1 else terms[0]
    for term in terms[2:]:
        total += term
    return total


def _reference(kind: str, everyone: list[torch.Tensor], rank: int) -> torch.Tensor:
    """What ``kind`` gives rank ``rank`` from every rank's input (CPU, the transport's dtype
    and order of additions: IEEE sums of the same terms in the same order, so exact)."""
    size = len(everyone)
    if kind == "gather":
        return torch.cat(everyone)
    if kind == "gather_others":
        return torch.cat(everyone[:rank] + everyone[rank + 1 :])
    if kind == "reduce_scatter":
        return _summed([x.chunk(size)[rank] for x in everyone])
    if kind == "reduce_others":  # rank r's terms: the other ranks' chunks in rank order
        return _summed(
            [x.chunk(size - 1)[rank - (rank > r)] for r, x in enumerate(everyone) if r != rank]
        )
    return _summed(everyone)


def _shared_gpu_worker(rank: int, world_size: int) -> None:
    """Every rank on GPU 0, a gloo group (its ranks agree there; the data goes through host
    memory): every pattern against :func:`_reference` bit for bit, finished in order and in
    reverse, more transfers in flight than slots; a ring's hops (the fused ring MLP, and
    ``ring_pass``'s rotating chunk and accumulator) against the same ring on the CPU over
    gloo."""
    from ds_stpar.layers import comm, host_staged
    from ds_stpar.layers.ring_mlp import ring_mlp

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    group = dist.new_group(list(range(world_size)))
    assert host_staged.staged_group(group, device) is not None
    starts = _starts()
    seed = 0
    for dtype, pitched in ((torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)):
        for reverse in (False, True):
            for shape in SHAPES:
                rows = shape[0] * (world_size - 1) * world_size  # divides by P and P - 1
                shape = (rows, *shape[1:])
                seed += 1
                everyone = {
                    k: [_inputs(r, shape, dtype, "cpu", seed * 10 + i) for r in range(world_size)]
                    for i, k in enumerate(starts)
                }
                sent = {k: _laid_out(xs[rank].to(device), pitched) for k, xs in everyone.items()}
                flights = [(k, starts[k](sent[k], group)) for k in starts]
                order = reversed(flights) if reverse else flights
                results = {k: flight.finish().cpu() for k, flight in order}
                for k in starts:
                    want = _reference(k.removesuffix("_in_place"), everyone[k], rank)
                    what = f"{k} {shape} {dtype} reverse={reverse} P={world_size} {pitched=}"
                    assert torch.equal(results[k], want), what
                assert torch.equal(
                    sent["all_reduce_in_place"].cpu(), results["all_reduce_in_place"]
                )
                assert torch.equal(sent["all_reduce"].cpu(), everyone["all_reduce"][rank])
    count = 2 * host_staged.SLOTS + 3  # in flight at once, finished in reverse
    kinds = [k for k in starts if not k.endswith("_in_place")]
    plan = [
        (kinds[i % len(kinds)], (world_size * (world_size - 1) * 32, 2, 64)) for i in range(count)
    ]
    everyone = [
        [_inputs(r, shape, torch.bfloat16, "cpu", 5000 + i) for r in range(world_size)]
        for i, (_, shape) in enumerate(plan)
    ]
    flights = [
        starts[k](xs[rank].to(device), group) for (k, _), xs in zip(plan, everyone, strict=True)
    ]
    results = [flight.finish().cpu() for flight in reversed(flights)][::-1]
    for i, ((k, _), xs) in enumerate(zip(plan, everyone, strict=True)):
        assert torch.equal(results[i], _reference(k, xs, rank)), f"transfer {i} ({k})"

    cpu_group = dist.new_group(list(range(world_size)))  # the same ring over gloo, on the CPU
    g = torch.Generator().manual_seed(7)  # the same weights on every rank, own rows each
    k, f = 96, 160
    w1, b1, w2 = (
        torch.randn(f, k, generator=g) / 8,
        torch.randn(f, generator=g),
        torch.randn(k, f, generator=g) / 8,
    )
    x = _inputs(rank, (64, 2, k), torch.float32, "cpu", 5)
    dy = _inputs(rank, (64, 2, k), torch.float32, "cpu", 6)
    chunk = _inputs(rank, (16, 2, 24), torch.float32, "cpu", 8)
    got = {}
    for where, on in ((cpu_group, "cpu"), (group, device)):
        leaves = [t.to(on, copy=True).requires_grad_() for t in (x, w1, b1, w2)]
        y = ring_mlp(*leaves, torch.nn.functional.gelu, where, pieces=3, min_piece_flop=0)
        y.backward(dy.to(on))
        visited: list = []
        ring = chunk.to(on)
        total = comm.ring_pass(
            where,
            rotate=ring,
            visit=lambda c, t, seen=visited: seen.append(t.to("cpu", copy=True)),  # not kept
            partial=lambda m, ring=ring: ring * (m + 1) + rank,
        )
        got[on if on == "cpu" else "gpu"] = [y, *(t.grad for t in leaves), total, *visited]
    for i, (a, b) in enumerate(zip(got["cpu"], got["gpu"], strict=True)):
        b = b.cpu()
        if i < 5:  # fp32 GEMMs on two devices, sums in other orders: ~1e-6 of the largest
            error = (a - b).abs().max() / b.abs().max()  # entry; a wrong chunk or hop, O(1)
            assert error <= 1e-5, f"ring MLP result {i} P={world_size}: {error:.2e}"
        else:  # copies and elementwise fp32 sums in the same order: the same bits
            assert torch.equal(a, b), f"ring_pass result {i} P={world_size}"
    torch.cuda.synchronize(device)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpus(1), reason="needs a CUDA GPU (CI has none)")
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_sharing_one_gpu_stage_every_pattern_and_ring_hop(monkeypatch, world_size) -> None:
    """P ranks on one GPU: the staged transport's flags, slots and pieces between processes
    (each its own CUDA context) at P = 2, 3 and 4, where a machine of P GPUs is not at hand."""
    monkeypatch.setenv("DS_STPAR_TRANSFER_TRANSPORT", "host-staged")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    run_workers(_shared_gpu_worker, world_size)


def _settings_worker(rank: int, world_size: int) -> None:
    import os

    from ds_stpar.errors import ConfigError
    from ds_stpar.layers import host_staged

    os.environ["DS_STPAR_TRANSFER_TRANSPORT"] = ("auto", "nccl")[rank % 2]
    group = dist.new_group(list(range(world_size)))
    with pytest.raises(ConfigError, match="differs between the group's ranks"):
        host_staged._stages(group, torch.device("cuda", rank))  # refused before any CUDA call


def test_ranks_set_differently_are_refused_not_left_waiting() -> None:
    run_workers(_settings_worker, 2)


def _cpu_worker(rank: int, world_size: int) -> None:
    from ds_stpar.layers import async_comm, host_staged

    group = dist.new_group(list(range(world_size)))
    x = torch.full((4, 3), float(rank + 1))
    total = async_comm.start_all_reduce(x, group).finish()
    assert torch.equal(total, torch.full((4, 3), 3.0))
    assert not host_staged._GROUPS  # gloo groups keep their collectives


def test_gloo_groups_keep_their_collectives_when_staging_is_asked(monkeypatch) -> None:
    monkeypatch.setenv("DS_STPAR_TRANSFER_TRANSPORT", "host-staged")
    run_workers(_cpu_worker, 2)


def test_transfer_transport_setting_refuses_unknown_names(monkeypatch) -> None:
    from ds_stpar.errors import ConfigError
    from ds_stpar.layers import host_staged

    monkeypatch.setenv("DS_STPAR_TRANSFER_TRANSPORT", "shm")
    with pytest.raises(ConfigError, match="host-staged"):
        host_staged._transport()


def test_which_groups_stage() -> None:
    from ds_stpar.errors import ConfigError
    from ds_stpar.layers.host_staged import stages

    one_host = [("a", 0, None), ("a", 1, "8")]
    assert stages("auto", one_host, peers=False)
    assert not stages("auto", one_host, peers=True)  # NVLink or PCIe peer access: NCCL
    assert not stages("auto", [("a", 0, None), ("a", 1, "1")], peers=False)
    assert not stages("auto", [("a", 0, None), ("a", 0, None)], peers=False)  # one GPU each
    assert not stages("auto", [("a", 0, None), ("b", 1, None)], peers=False)
    assert not stages("nccl", one_host, peers=False)
    assert stages("host-staged", one_host, peers=True)
    with pytest.raises(ConfigError, match="one host"):
        stages("host-staged", [("a", 0, None), ("b", 0, None)], peers=False)
    with pytest.raises(ConfigError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        stages("host-staged", [("a", 0, "1"), ("a", 1, "1")], peers=False)


def test_staging_refuses_a_single_hardware_queue(monkeypatch) -> None:
    from ds_stpar.errors import ConfigError
    from ds_stpar.layers import host_staged

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(ConfigError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        host_staged.HostStagedGroup(group=None, device=torch.device("cuda", 0))


def test_a_ring_hop_to_several_ranks_or_into_a_strided_buffer_is_refused() -> None:
    # checked before any transport is chosen, so the same on every path (no group needed)
    from ds_stpar.layers.comm import Message, start_ring_hop

    x, into = torch.zeros(4, 3), torch.zeros(4, 3)
    with pytest.raises(ValueError, match="sends to one rank and receives from one"):
        start_ring_hop([Message(x, 1), Message(x, 2)], [Message(into, 1)], None)
    with pytest.raises(ValueError, match="sends to one rank and receives from one"):
        start_ring_hop([Message(x, 1)], [], None)
    with pytest.raises(ValueError, match="contiguous"):
        start_ring_hop([Message(x, 1)], [Message(torch.zeros(3, 4).t(), 1)], None)


def _pieces_worker(rank: int, world_size: int) -> None:
    from ds_stpar.layers.host_staged import HostStagedGroup

    group = dist.new_group(list(range(world_size)))
    with pytest.raises(ValueError, match="different piece counts"):  # on every rank, before
        HostStagedGroup(group, torch.device("cuda", rank), pieces=2 + rank)  # any CUDA call


def test_ranks_staging_in_different_piece_counts_are_refused(monkeypatch) -> None:
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    run_workers(_pieces_worker, 2)


def test_pieces_cut_a_transfer_s_bytes_evenly_and_whole() -> None:
    from ds_stpar.layers.host_staged import _piece_bounds

    for nbytes in (0, 1, 7, 4096, 16 << 20, 3 * (1 << 20) + 5):
        for pieces in (1, 2, 3, 4, 8):
            bounds = _piece_bounds(nbytes, pieces)
            sizes = [b - a for a, b in zip(bounds, bounds[1:])]
            assert bounds[0] == 0 and bounds[-1] == nbytes and len(sizes) == pieces
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_rows_at_a_pitch_are_sent_as_their_packed_bytes(monkeypatch) -> None:
    # _copy_piece's arithmetic on real CPU addresses: the driver's two copies done here by
    # memmove with their documented meaning (cuMemcpyAsync: n bytes; cuMemcpy2DAsync: height
    # rows of width bytes, each pitch apart); every piece count, so that bounds fall inside
    # rows, must give the tensor's packed bytes. The driver's own copies: the GPU tests above
    import ctypes

    from ds_stpar.layers import host_staged

    def copy_bytes(_stream, into, source, nbytes):
        ctypes.memmove(into, source, nbytes)

    def copy_rows(_stream, into, into_pitch, source, source_pitch, width, height):
        for r in range(height):
            ctypes.memmove(into + r * into_pitch, source + r * source_pitch, width)

    monkeypatch.setattr(host_staged, "copy_bytes", copy_bytes)
    monkeypatch.setattr(host_staged, "copy_rows", copy_rows)
    base = torch.arange(7 * 6 * 5, dtype=torch.int16).view(7, 6, 5)
    cases = {
        "contiguous": (base, (7 * 6 * 5 * 2, 7 * 6 * 5 * 2)),
        "a piece of the batch": (base[:, 2:3], (5 * 2, 6 * 5 * 2)),
        "two of the batch": (base[:, 2:4], (2 * 5 * 2, 6 * 5 * 2)),
        "rows of a piece": (base[1:6, 4:5], (5 * 2, 6 * 5 * 2)),
        "transposed": (base.transpose(0, 1), None),
        "every other column": (base[..., ::2], None),
        "expanded rows (stride 0)": (base[:, :1].expand(7, 6, 5), None),
        "an expanded row": (base[0, 0].expand(4, 5), None),
    }
    for what, (t, rows) in cases.items():
        assert host_staged._rows_of(t) == rows, what
        if rows is None:
            continue
        packed = t.contiguous().view(torch.uint8)
        for pieces in (1, 2, 3, 4, 7):
            into = torch.zeros_like(packed)
            bounds = host_staged._bounds(t, pieces)
            for p in range(pieces):
                host_staged._copy_piece(None, [(into.data_ptr(), t.data_ptr(), bounds, rows)], p)
            assert torch.equal(into, packed), f"{what}, {pieces} pieces"
    with pytest.raises(ValueError, match="not rows at a pitch"):  # what a write refuses
        host_staged._rows(base.transpose(0, 1))


def test_a_piece_count_the_flags_page_cannot_hold_is_refused(monkeypatch) -> None:
    from ds_stpar.layers.host_staged import HostStagedGroup

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    for pieces in (0, 128):  # checked before the group or a GPU is touched
        with pytest.raises(ValueError, match="pieces must be 1 to 127"):
            HostStagedGroup(None, torch.device("cuda", 0), pieces=pieces)
