"""local.py's GEMMs, what an interleaved layer's linears run, against float64 autograd.

fp32 results against a float64 reference of the same function: output, input gradient and
weight gradient (returned, or accumulated into an fp32 ``main_grad`` as Megatron's gradient
accumulation fusion does). Tolerance: max |fp32 - fp64| <= 1e-5 * max |fp64|: the longest
reduction is 5 x 3 = 15 tokens (the weight gradient) or 16 features, an fp32 rounding of about
sqrt(K) * 6e-8 <= 3e-7 relative, so 1e-5 is far above rounding and far below a wrong
operand or transpose (O(1)).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ds_stpar.layers.local import activation_linear, local_linear

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


@pytest.mark.parametrize("fusion", [False, True])
@pytest.mark.parametrize("kind", ["linear", "activation"])
def test_local_gemms_match_float64(kind: str, fusion: bool) -> None:
    features = 16 if kind == "linear" else 12
    x64 = _rand(1, 5, 3, features).requires_grad_()
    w64 = _rand(2, 8, features if kind == "linear" else features // 2).requires_grad_()
    x = x64.detach().float().requires_grad_()
    weight = torch.nn.Parameter(w64.detach().float())
    main_grad = torch.full(weight.shape, 0.5) if fusion else None
    if kind == "linear":
        y, y_ref = local_linear(x, weight, main_grad), F.linear(x64, w64)
    else:
        y = activation_linear(x, weight, _swiglu, main_grad)
        y_ref = F.linear(_swiglu(x64), w64)
    _close(y, y_ref.detach(), f"{kind}: output")
    grad = _rand(3, *y_ref.shape)
    y.backward(grad.float())
    y_ref.backward(grad)
    _close(x.grad, x64.grad, f"{kind}: input grad")
    if fusion:
        _close(main_grad - 0.5, w64.grad, f"{kind}: main_grad")
        assert weight.grad is None, kind
    else:
        _close(weight.grad, w64.grad, f"{kind}: weight grad")
