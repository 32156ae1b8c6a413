"""local.py's GEMMs, what an interleaved layer's linears run, against float64 autograd.

fp32 results against a float64 reference of the same function: output, input gradient and
weight gradient (returned, or accumulated into an fp32 ``main_grad`` as Megatron's gradient
accumulation fusion does), for one use and for two uses of a weight summed in one tensor (an
interleaved layer's two pieces). Tolerance: max |fp32 - fp64| <= 1e-5 * max |fp64|: the longest
reduction is 5 x 4 = 20 tokens (the weight gradient) or 16 features, an fp32 rounding of about
sqrt(K) * 6e-8 <= 3e-7 relative, so 1e-5 is far above rounding and far below a wrong
operand or transpose (O(1)).
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ds_stpar.layers import local
from ds_stpar.layers.activation import ClosedFormActivation, activation_backward
from ds_stpar.layers.local import LocalCompute, activation_linear, local_linear
from ds_stpar.layers.wgrad import WeightGrad

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import memtrace  # noqa: E402

RTOL = 1e-5


def _rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, what
    err = (actual.double() - expected).abs().max().item()
    assert err <= RTOL * expected.abs().max().item(), f"{what}: max error {err:.3g}"


def _swiglu(a: torch.Tensor) -> torch.Tensor:
    gate, up = a.chunk(2, dim=-1)
    return F.silu(gate) * up


CLOSED_FORM_SWIGLU = ClosedFormActivation(F.silu, gated=True)


def _through_pieces(x, weight, act, main_grad, uses: int, dw_first: bool = False) -> torch.Tensor:
    """``x`` cut into ``uses`` pieces along dim 1, each through ``weight`` (``local_linear``, or
    ``activation_linear`` with ``act``) with one :class:`LocalCompute`, concatenated again: an
    interleaved layer's linear (``dw_first``: every piece but the first makes dW first)."""
    call = LocalCompute()
    pieces = []
    for index, piece in enumerate(x.chunk(uses, dim=1)):
        grads = call.weight_grad(weight, main_grad)
        if act is None:
            pieces.append(local_linear(piece, weight, grads, dw_first and index > 0))
        else:  # + 0: a fresh A, as fc1's output is, handed over for dA to be written over it
            pieces.append(activation_linear(piece + 0, weight, act, grads, consume_a=True))
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("uses", [1, 2])
@pytest.mark.parametrize("fusion", ["off", "main_grad", "main_grad, DDP flag"])
@pytest.mark.parametrize(
    "kind", ["linear", "linear, dW first", "activation", "closed-form activation"]
)
def test_local_gemms_match_float64(kind: str, fusion: str, uses: int) -> None:
    # ``uses`` pieces of the batch through one weight, concatenated as an interleaved layer
    # does; with Megatron's DDP flag (grad_added_to_main_grad) the gradient goes into main_grad
    # and the flag is set. "dW first": the second piece's backward makes dW before dX
    dw_first = kind == "linear, dW first"
    kind = "linear" if dw_first else kind
    features = 16 if kind == "linear" else 12
    x64 = _rand(1, 5, 2 * uses, features).requires_grad_()
    w64 = _rand(2, 8, features if kind == "linear" else features // 2).requires_grad_()
    x = x64.detach().float().requires_grad_()
    weight = torch.nn.Parameter(w64.detach().float())
    main_grad = torch.full(weight.shape, 0.5) if fusion != "off" else None
    if fusion == "main_grad, DDP flag":
        weight.grad_added_to_main_grad = False
    act = CLOSED_FORM_SWIGLU if kind == "closed-form activation" else _swiglu
    y = _through_pieces(x, weight, None if kind == "linear" else act, main_grad, uses, dw_first)
    y_ref = F.linear(x64 if kind == "linear" else _swiglu(x64), w64)
    _close(y, y_ref.detach(), f"{kind}: output")
    grad = _rand(3, *y_ref.shape)
    y.backward(grad.float())
    y_ref.backward(grad)
    _close(x.grad, x64.grad, f"{kind}: input grad")
    if fusion == "main_grad":
        _close(main_grad - 0.5, w64.grad, f"{kind}: main_grad")
        assert weight.grad is None, kind
    elif fusion == "main_grad, DDP flag":
        _close(main_grad - 0.5, w64.grad, f"{kind}: main_grad")
        assert weight.grad_added_to_main_grad, kind
    else:
        _close(weight.grad, w64.grad, f"{kind}: weight grad")


@pytest.mark.parametrize("ddp", [False, True])
@pytest.mark.parametrize("kind", ["linear", "closed-form activation"])
def test_two_uses_hold_one_weight_gradient(kind: str, ddp: bool) -> None:
    # The backward of two pieces through a weight of 128 x 128 fp32 (64 KiB) with 2 tokens
    # each (1-2 KiB of activations): a dW per piece would be summed by autograd only after the
    # second exists (2 weight blocks alive); the shared accumulator holds one. Under Megatron's
    # DDP (main_grad, grad_added_to_main_grad) the same holds for the dummy gradients handed
    # to autograd. The CPU profiler's count is exact to the byte, so the bound 1.5 blocks
    # leaves room for the activations' gradients only.
    features = 256 if kind != "linear" else 128
    x = torch.randn(2, 2, features, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(128, 128))
    main_grad = torch.zeros(128, 128) if ddp else None
    if ddp:
        weight.grad_added_to_main_grad = False
    act = None if kind == "linear" else CLOSED_FORM_SWIGLU
    y = _through_pieces(x, weight, act, main_grad, 2)
    grad = torch.randn_like(y)
    cpu = torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[cpu], profile_memory=True) as prof:
        y.backward(grad)
    block = weight.numel() * weight.element_size()
    peak = memtrace.cpu_peak_above_start(prof)
    assert block <= peak < 1.5 * block, (kind, ddp, peak / block)


class _MatmulShapes(TorchDispatchMode):
    """The output shapes of the matrix products run inside, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.shapes.append(tuple(out.shape))
        return out


@pytest.mark.parametrize("dw_first", [False, True])
def test_weight_grad_first_orders_the_backward(dw_first: bool) -> None:
    # dX [tokens, K] first by default (what it feeds starts early); dW [N, K] first when asked
    # (the two, with the remade input, never alive together)
    x = torch.randn(3, 2, 6, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(4, 6))
    y = local_linear(x, weight, LocalCompute().weight_grad(weight, None), dw_first)
    with _MatmulShapes() as seen:
        y.backward(torch.randn_like(y))
    dx, dw = (6, 6), (4, 6)
    assert seen.shapes == ([dw, dx] if dw_first else [dx, dw])


@pytest.mark.parametrize("rows_per_chunk", [1, 3, None])
def test_activation_backward_in_row_chunks_matches_float64(rows_per_chunk) -> None:
    # dA and dW2 of 10 rows through fc2 in chunks of 1, 3 (the last chunk short) or all rows,
    # fp32 against autograd in float64 (tolerance as above: reductions of 10 rows or 4
    # features); dA written over A in place
    a64 = _rand(1, 10, 8).requires_grad_()
    w64 = _rand(2, 5, 4).requires_grad_()
    dy64 = _rand(3, 10, 5)
    F.linear(_swiglu(a64), w64).backward(dy64)
    a, wgrad = a64.detach().float(), WeightGrad(torch.zeros(5, 4), None)
    da = activation_backward(
        CLOSED_FORM_SWIGLU,
        a,
        dy64.float(),
        w64.detach().float(),
        wgrad,
        overwrite=True,
        rows_per_chunk=rows_per_chunk,
    )
    assert da is a
    _close(da, a64.grad, f"dA, {rows_per_chunk} rows a chunk")
    _close(wgrad.grad, w64.grad, f"dW2, {rows_per_chunk} rows a chunk")


@pytest.mark.parametrize("rows_per_chunk", [3, None])
def test_activation_backward_of_no_rows_gives_a_zero_weight_gradient(rows_per_chunk) -> None:
    # an empty piece still hands its (zero) dW2 in, as the whole-rows backward did
    wgrad = WeightGrad(torch.zeros(5, 4), None)
    a, dy, w2 = torch.zeros(0, 8), torch.zeros(0, 5), torch.randn(5, 4)
    da = activation_backward(CLOSED_FORM_SWIGLU, a, dy, w2, wgrad, rows_per_chunk=rows_per_chunk)
    assert da.shape == (0, 8) and torch.equal(wgrad.grad, torch.zeros(5, 4))


def test_activation_linear_backward_holds_one_chunk_of_act(monkeypatch) -> None:
    # act(a) and dy W2 of 64 rows x 256 fp32 features (64 KiB each) made whole, or in 8
    # chunks of 8 rows (8 KiB): the CPU profiler's count is exact to the byte; the backward's
    # peak above its start falls by at least the 56 KiB the whole rows held more
    def backward_peak(chunks: int) -> int:
        monkeypatch.setattr(local, "ACTIVATION_CHUNKS", chunks)
        weight = torch.nn.Parameter(torch.randn(32, 256))
        a = torch.randn(64, 1, 512, requires_grad=True)
        grads = LocalCompute().weight_grad(weight, None)
        y = activation_linear(a + 0, weight, CLOSED_FORM_SWIGLU, grads, consume_a=True)
        grad = torch.randn_like(y)
        cpu = torch.profiler.ProfilerActivity.CPU
        with torch.profiler.profile(activities=[cpu], profile_memory=True) as prof:
            y.backward(grad)
        return memtrace.cpu_peak_above_start(prof)

    whole, chunked = backward_peak(1), backward_peak(8)
    assert chunked <= whole - 56 * 1024, (whole, chunked)


def test_shared_weight_grad_sums_afresh_on_a_second_backward() -> None:
    # retain_graph: the second backward hands in the same sum again (not twice it)
    x = _rand(1, 4, 2, 6).float()
    weight = torch.nn.Parameter(_rand(2, 3, 6).float())
    call = LocalCompute()
    y = torch.cat(
        [local_linear(p, weight, call.weight_grad(weight, None)) for p in x.chunk(2, 1)], 1
    )
    y.sum().backward(retain_graph=True)
    first = weight.grad.clone()
    y.sum().backward()
    _close(weight.grad, 2 * first.double(), "two backwards")


def test_closed_form_writes_over_a_only_when_handed_over() -> None:
    # consume_a: dA is written over the saved A, and autograd's version check refuses a second
    # backward; without it A is left as it was (a leaf's A here: its .grad would share it)
    weight = torch.nn.Parameter(_rand(2, 3, 6).float())
    a = _rand(1, 4, 2, 12).float().requires_grad_()
    kept = a.detach().clone()
    y = activation_linear(a, weight, CLOSED_FORM_SWIGLU, LocalCompute().weight_grad(weight, None))
    y.sum().backward(retain_graph=True)
    assert torch.equal(a.detach(), kept)
    first = a.grad.clone()
    y.sum().backward()
    _close(a.grad, 2 * first.double(), "a second backward without consume_a")
    grads = LocalCompute().weight_grad(weight, None)
    y = activation_linear(a + 0, weight, CLOSED_FORM_SWIGLU, grads, consume_a=True)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_one_weight_with_two_main_grads_is_refused() -> None:
    weight = torch.nn.Parameter(torch.zeros(3, 6))
    call = LocalCompute()
    call.weight_grad(weight, torch.zeros(3, 6))
    with pytest.raises(ValueError, match="two different main_grad"):
        call.weight_grad(weight, torch.zeros(3, 6))


def test_a_use_whose_backward_never_ran_is_reported() -> None:
    # two uses, only the first reaches the loss: the sum is never handed over, and the
    # accumulator says so when it is freed
    weight = torch.nn.Parameter(_rand(2, 3, 6).float())
    call = LocalCompute()
    first, _ = (
        local_linear(p, weight, call.weight_grad(weight, None))
        for p in _rand(1, 4, 2, 6).float().chunk(2, 1)
    )
    first.sum().backward()
    assert weight.grad is None
    with pytest.warns(RuntimeWarning, match="1 of 2 uses"):
        del call, first, _
        gc.collect()
