"""ClosedFormActivation against autograd on the same function: bit-exact (it runs autograd's
own backward kernels in the same order, so any difference is a bug, not rounding), written
into a fresh tensor and over A itself, plain and gated (Megatron's GLU with an offset), in
float32 and bfloat16; and StparMLP picks it exactly where Megatron's config names one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ds_stpar.layers.activation import ClosedFormActivation, recompute_activation


def _autograd(func, gated: bool, offset: float, a: torch.Tensor, grad_h: torch.Tensor):
    def act(x):
        if not gated:
            return func(x)
        gate, up = torch.chunk(x, 2, dim=-1)
        return func(gate) * (up + offset)

    return recompute_activation(act, a, grad_h)


@pytest.mark.parametrize("func", [F.gelu, F.silu, F.relu])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_closed_form_matches_autograd_bit_for_bit(func, gated, dtype) -> None:
    offset = 1.0 if gated else 0.0
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(6, 5, 8, generator=gen).to(dtype)
    grad_h = torch.randn(6, 5, 4 if gated else 8, generator=gen).to(dtype)
    act = ClosedFormActivation(func, gated, offset)
    h_ref, da_ref = _autograd(func, gated, offset, a, grad_h)
    h, da = act(a), act.grad(a, grad_h)
    assert torch.equal(h, h_ref) and torch.equal(da, da_ref)
    over_a = a.clone()
    assert act.grad(over_a, grad_h, out=over_a) is over_a
    assert torch.equal(over_a, da_ref)


def test_unknown_activation_is_refused() -> None:
    assert not ClosedFormActivation.supports(torch.tanh)
    with pytest.raises(ValueError, match="no closed-form derivative"):
        ClosedFormActivation(torch.tanh)
