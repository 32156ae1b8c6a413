"""The ring passes through each P2P path ``comm.start_p2p`` has, and through the copy-engine
transport (``layers/symmetric.py``), against float64.

``start_p2p`` issues a batch one of two ways: ``dist.batch_isend_irecv`` (gloo, and CUDA
backends that do not coalesce) or, on NCCL, the process group's own coalesced send / recv
calls from the compute stream, with NCCL's stream ordering itself after the compute stream and
the process group holding the buffers. The same checks run on both: gloo on the CPU (always)
and NCCL on two GPUs (``gpu``: skipped where there are fewer, ``DS_STPAR_RING_TRANSPORT=nccl``);
on the GPUs once more with ``symmetric-memory`` (``ring_pass``'s hops pushed into the
neighbour's symmetric memory, the arrivals views of it), and with ``auto``, which must take the
copy engines on two peer-linked GPUs and not under ``NCCL_P2P_DISABLE=1`` (where the hops go
by NCCL, or, with ``CUDA_DEVICE_MAX_CONNECTIONS`` above 1, staged through host memory:
``comm.start_ring_hop``). Each rank runs the ring column
and row linears and the two-pass and fused MLPs (each with its activation a plain callable,
and the closed form that writes dA over A) forward and backward 12 times (more batches than the
in-flight bound of 8, so the bound's host waits run too) and compares output, input gradient
and weight gradients of the last round with a float64 reference of the whole problem; at
P = 2 a row linear's weight gradient deferred to the column linear before it as well
(``deferred_wgrad``), which on the copy engines must refuse once their buffer is written over.
Tolerance: max |fp32 - fp64| <= 1e-5 * max |fp64|; the longest reduction is K = 64 terms
(relative rounding about sqrt(64) * 6e-8 = 5e-7 in fp32, TF32 off), the ring only reorders
the sums, so 1e-5 is > 10x the expected error and far below an indexing or ordering mistake.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_stpar.layers import symmetric
from ds_stpar.layers.activation import ClosedFormActivation
from ds_stpar.layers.comm import ring_pass
from ds_stpar.layers.deferred_wgrad import DeferredWeightGrad
from ds_stpar.layers.ring import ring_column_linear, ring_row_linear
from ds_stpar.layers.ring_mlp import ring_mlp, ring_two_pass_mlp
from tests.distributed import run_workers

ROUNDS = 12
M, K, N = 16, 24, 64  # tokens, input features, output features (N is fc1's width too)
RTOL = 1e-5


def _full(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    err = (actual.detach().cpu().double() - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= RTOL * scale, f"{what}: max error {err:.3g} > {RTOL} * {scale:.3g}"


def _local(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.float().to(device).contiguous().requires_grad_()


def _check_column(group, device) -> None:
    """[M/P, 1, K] chunk d x W rows d -> [M, 1, N/P]."""
    size, me = group.size(), group.rank()
    x, w, dy = _full(1, M, K), _full(2, N, K), _full(3, M, N)
    rows, cols = M // size, N // size
    y_ref = x @ w.t()
    for _ in range(ROUNDS):
        x_d = _local(x[me * rows : (me + 1) * rows, None], device)
        w_d = _local(w[me * cols : (me + 1) * cols], device)
        y = ring_column_linear(x_d, w_d, group)
        y.backward(dy[:, None, me * cols : (me + 1) * cols].float().to(device))
    _close(y[:, 0], y_ref[:, me * cols : (me + 1) * cols], "column output")
    _close(x_d.grad[:, 0], (dy @ w)[me * rows : (me + 1) * rows], "column input grad")
    _close(w_d.grad, (dy.t() @ x)[me * cols : (me + 1) * cols], "column weight grad")


def _check_row(group, device) -> None:
    """[M, 1, K/P] x W columns d -> [M/P, 1, N] chunk d."""
    size, me = group.size(), group.rank()
    x, w, dy = _full(4, M, N), _full(5, K, N), _full(6, M, K)
    rows, cols = M // size, N // size
    for _ in range(ROUNDS):
        x_d = _local(x[:, None, me * cols : (me + 1) * cols], device)
        w_d = _local(w[:, me * cols : (me + 1) * cols], device)
        y = ring_row_linear(x_d, w_d, group)
        y.backward(dy[me * rows : (me + 1) * rows, None].float().to(device))
    _close(y[:, 0], (x @ w.t())[me * rows : (me + 1) * rows], "row output")
    _close(x_d.grad[:, 0], (dy @ w)[:, me * cols : (me + 1) * cols], "row input grad")
    _close(w_d.grad, (dy.t() @ x)[:, me * cols : (me + 1) * cols], "row weight grad")


def _check_ring_mlp(group, device, act, fused: bool = False) -> None:
    """fc2(act(fc1(x) + b1)) over [M/P, 1, K] chunks, fc1 [N/P, K] rows, fc2 [K, N/P] columns;
    ``act`` gelu as a plain callable or as the ``ClosedFormActivation`` that writes dA over A;
    ``fused``: the fused ring pass (``ring_mlp``, each chunk's partial sums in 2 row pieces)
    instead of the two passes."""
    size, me = group.size(), group.rank()
    x, w1, b1, w2, dy = (
        _full(7, M, K),
        _full(8, N, K),
        _full(9, N),
        _full(10, K, N),
        _full(11, M, K),
    )
    rows, cols = M // size, N // size
    leaves = [t.clone().requires_grad_() for t in (x, w1, b1, w2)]
    y_ref = F.linear(F.gelu(F.linear(leaves[0], leaves[1], leaves[2])), leaves[3])
    y_ref.backward(dy)
    for _ in range(ROUNDS):
        x_d = _local(x[me * rows : (me + 1) * rows, None], device)
        w1_d = _local(w1[me * cols : (me + 1) * cols], device)
        b1_d = _local(b1[me * cols : (me + 1) * cols], device)
        w2_d = _local(w2[:, me * cols : (me + 1) * cols], device)
        if fused:
            y = ring_mlp(x_d, w1_d, b1_d, w2_d, act, group, pieces=2, min_piece_flop=0)
        else:
            y = ring_two_pass_mlp(x_d, w1_d, b1_d, w2_d, act, group)
        y.backward(dy[me * rows : (me + 1) * rows, None].float().to(device))
    what = f"{'fused' if fused else 'two-pass'} MLP ({type(act).__name__})"
    _close(y[:, 0], y_ref.detach()[me * rows : (me + 1) * rows], f"{what} output")
    _close(x_d.grad[:, 0], leaves[0].grad[me * rows : (me + 1) * rows], f"{what} input grad")
    _close(w1_d.grad, leaves[1].grad[me * cols : (me + 1) * cols], f"{what} fc1 weight grad")
    _close(b1_d.grad, leaves[2].grad[me * cols : (me + 1) * cols], f"{what} fc1 bias grad")
    _close(w2_d.grad, leaves[3].grad[:, me * cols : (me + 1) * cols], f"{what} fc2 weight grad")


def _check_deferred_projection(group, device, copy_engines: bool) -> None:
    """column (W1) -> tanh (the attention's stand-in) -> row (W2), the row's weight gradient
    made in the column's backward (``deferred_wgrad``), from the dY chunk that arrived: over
    the copy engines a view of their buffer, which must still hold it. A ring pass run in
    between (from a hook on the column's output gradient) writes that buffer over: the
    column's backward must refuse, not return a wrong gradient."""
    size, me = group.size(), group.rank()
    x, w1, w2, dy = _full(13, M, K), _full(14, N, K), _full(15, K, N), _full(16, M, K)
    rows, cols = M // size, N // size
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
    y_ref = F.linear(torch.tanh(F.linear(leaves[0], leaves[1])), leaves[2])
    y_ref.backward(dy)
    ring = symmetric.symmetric_ring(group, device)
    assert (ring is not None) == copy_engines
    for intrude in (False, True) if copy_engines else (False,):
        x_d = _local(x[me * rows : (me + 1) * rows, None], device)
        w1_d = _local(w1[me * cols : (me + 1) * cols], device)
        w2_d = _local(w2[:, me * cols : (me + 1) * cols], device)
        deferred = DeferredWeightGrad(w2_d, ring)
        h = ring_column_linear(x_d, w1_d, group, deferred=deferred)
        if intrude:
            h.register_hook(lambda g: ring_pass(group, rotate=g[:rows].contiguous()))
        y = ring_row_linear(torch.tanh(h), w2_d, group, deferred=deferred)
        if intrude:
            with pytest.raises(RuntimeError, match="written over"):
                y.backward(dy[me * rows : (me + 1) * rows, None].float().to(device))
            continue
        y.backward(dy[me * rows : (me + 1) * rows, None].float().to(device))
        what = "deferred projection weight grad"
        _close(w2_d.grad, leaves[2].grad[:, me * cols : (me + 1) * cols], what)
        _close(w1_d.grad, leaves[1].grad[me * cols : (me + 1) * cols], f"{what}: fc1's")
        _close(x_d.grad[:, 0], leaves[0].grad[me * rows : (me + 1) * rows], f"{what}: dX")


def _check_closed_form_in_place(device) -> None:
    """The gated closed form writing dA over A on this device, bit-exact against autograd
    (on CUDA: its elementwise kernels with the output aliasing an input, and strided halves)."""
    gen = torch.Generator().manual_seed(12)
    a = torch.randn(M, 2 * N, generator=gen).to(device)
    grad_h = torch.randn(M, N, generator=gen).to(device)
    act = ClosedFormActivation(F.silu, gated=True, offset=1.0)
    leaf = a.clone().requires_grad_()
    act(leaf).backward(grad_h)
    over_a = a.clone()
    act.grad(over_a, grad_h, out=over_a)
    assert torch.equal(over_a, leaf.grad), "closed form over A"


def _worker(rank: int, world_size: int, device_type: str, copy_engines: bool = False) -> None:
    device = torch.device(device_type, rank if device_type == "cuda" else 0)
    torch.backends.cuda.matmul.allow_tf32 = False
    group = dist.new_group(list(range(world_size)))
    _check_column(group, device)
    _check_row(group, device)
    for act in (F.gelu, ClosedFormActivation(F.gelu)):
        for fused in (False, True):
            _check_ring_mlp(group, device, act, fused)
    _check_closed_form_in_place(device)
    if world_size == 2:
        _check_deferred_projection(group, device, copy_engines)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # the transport expected was the one used: the copy engines' buffer exists exactly when
    # they carried the hops
    assert symmetric.TRANSPORT == os.environ.get("DS_STPAR_RING_TRANSPORT", "auto")
    assert (symmetric.workspace_bytes(device) > 0) == copy_engines


@pytest.mark.parametrize("transport", ["auto", "nccl", "symmetric-memory"])
def test_ring_passes_through_batch_isend_irecv_on_gloo(monkeypatch, transport) -> None:
    """On the CPU the ring keeps ``start_p2p`` whichever transport is set (the copy engines
    serve GPU groups only)."""
    monkeypatch.setenv("DS_STPAR_RING_TRANSPORT", transport)  # the workers' import
    run_workers(_worker, 2, "cpu")


def test_ring_transport_setting_refuses_unknown_names(monkeypatch) -> None:
    from ds_stpar.errors import ConfigError
    from ds_stpar.layers import symmetric

    monkeypatch.setenv("DS_STPAR_RING_TRANSPORT", "copy")
    with pytest.raises(ConfigError, match="symmetric-memory"):
        symmetric._transport()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs for NCCL (CI has none)",
)
def test_ring_passes_through_nccl_coalesced_calls(monkeypatch) -> None:
    monkeypatch.setenv("DS_STPAR_RING_TRANSPORT", "nccl")
    run_workers(_worker, 2, "cuda", backend="nccl")


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs with peer access for symmetric memory (CI has none)",
)
def test_ring_passes_through_symmetric_memory(monkeypatch) -> None:
    monkeypatch.setenv("DS_STPAR_RING_TRANSPORT", "symmetric-memory")  # the workers' import
    run_workers(_worker, 2, "cuda", True, backend="nccl")


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available()
    or torch.cuda.device_count() < 2
    or not torch.cuda.can_device_access_peer(0, 1),
    reason="needs 2 CUDA GPUs with peer access (CI has none)",
)
@pytest.mark.parametrize("p2p_disabled", [False, True])
def test_ring_transport_auto_takes_copy_engines_over_peer_links(monkeypatch, p2p_disabled) -> None:
    monkeypatch.setenv("DS_STPAR_RING_TRANSPORT", "auto")
    if p2p_disabled:
        monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    else:
        monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    run_workers(_worker, 2, "cuda", not p2p_disabled, backend="nccl")


def _four_gpus_reach_each_other() -> bool:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 4:
        return False
    return all(
        torch.cuda.can_device_access_peer(a, b) for a in range(4) for b in range(4) if a != b
    )


@pytest.mark.gpu
@pytest.mark.skipif(
    not _four_gpus_reach_each_other(),
    reason="needs 4 CUDA GPUs with peer access between every pair (CI has none)",
)
@pytest.mark.parametrize("transport", ["symmetric-memory", "auto", "nccl"])
def test_four_rank_ring_by_copy_engines_and_auto(monkeypatch, transport) -> None:
    """P = 4: the copy engines' buffer holds two batches in turn (a step sends on the chunk
    that arrived in the previous one while the next arrives), over 12 rounds; ``auto`` takes
    them over peer links at any group size."""
    monkeypatch.setenv("DS_STPAR_RING_TRANSPORT", transport)
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    run_workers(_worker, 4, "cuda", transport != "nccl", backend="nccl")
