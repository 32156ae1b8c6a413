"""A tensor-parallel rank's own GEMMs with no communication in them.

:mod:`ds_stpar.layers.interleave` moves the transfers out of the linears (it gathers a
column's input before and reduces a row's output after, so another micro-batch's work runs in
between); inside, a temporal linear in *local* mode runs only this:

    column: x [s, b, K] (gathered) x W_d [N/P, K] -> [s, b, N/P]
    row:    x [s, b, K/P]          x W_d [N, K/P] -> [s, b, N]   (this rank's term of the sum)

Both save their input for dW (the column's is the gathered one: the backward needs no second
gather) and accumulate dW in fp32 into ``main_grad`` with Megatron's gradient accumulation
fusion (:class:`~ds_stpar.layers.wgrad.WeightGrad`).

:func:`activation_linear` is the row GEMM with the activation in front, y = act(a) W^T,
saving ``a`` and recomputing act(a) in the backward (one elementwise pass), as the fused ring
MLP does: a Megatron MLP would keep both fc1's output and act(fc1's output).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ds_stpar.layers.activation import Activation, recompute_activation
from ds_stpar.layers.wgrad import WeightGrad


def _tokens(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])


class _LocalLinear(torch.autograd.Function):
    """y = x W^T; backward dX = dY W, dW = dY^T X (into main_grad when given)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, main_grad: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.main_grad = main_grad
        return torch.matmul(x, weight.t())

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        x, weight = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        dx = torch.matmul(grad_output, weight) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            wgrad = WeightGrad(weight, ctx.main_grad)
            wgrad.add(_tokens(grad_output), _tokens(x))
            dw = wgrad.result(x.dtype)
        return dx, dw, None


class _ActivationLinear(torch.autograd.Function):
    """y = act(a) W^T saving ``a`` only; act(a) is recomputed in the backward."""

    @staticmethod
    def forward(ctx, a: Tensor, weight: Tensor, act: Activation, main_grad: Tensor | None):
        ctx.save_for_backward(a, weight)
        ctx.act, ctx.main_grad = act, main_grad
        return torch.matmul(act(a), weight.t())

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        a, weight = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        h, da = recompute_activation(ctx.act, a, torch.matmul(grad_output, weight))
        dw = None
        if ctx.needs_input_grad[1]:
            wgrad = WeightGrad(weight, ctx.main_grad)
            wgrad.add(_tokens(grad_output), _tokens(h))
            dw = wgrad.result(a.dtype)
        return (da if ctx.needs_input_grad[0] else None), dw, None, None


def local_linear(x: Tensor, weight: Tensor, main_grad: Tensor | None = None) -> Tensor:
    """``[..., K] x [N, K] -> [..., N]``, no communication (module docstring)."""
    return _LocalLinear.apply(x, weight, main_grad)


def activation_linear(
    a: Tensor, weight: Tensor, act: Activation, main_grad: Tensor | None = None
) -> Tensor:
    """``act(a) W^T`` for ``a`` ``[..., F]``, ``act``: ``[..., F] -> [..., F']``, ``weight``
    ``[N, F']``; saves ``a`` only (module docstring)."""
    return _ActivationLinear.apply(a, weight, act, main_grad)
