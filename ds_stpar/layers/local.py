"""A tensor-parallel rank's own GEMMs with no communication in them.

:mod:`ds_stpar.layers.interleave` moves the transfers out of the linears (it gathers a
column's input before and reduces a row's output after, so another micro-batch's work runs in
between); inside, a temporal linear in *local* mode runs only this:

    column: x [s, b, K] (gathered) x W_d [N/P, K] -> [s, b, N/P]
    row:    x [s, b, K/P]          x W_d [N, K/P] -> [s, b, N]   (this rank's term of the sum)

Both save their input for dW (the column's is the gathered one: the backward needs no second
gather). A linear runs once per piece of the micro-batch, and every use's dW goes into its
weight's :class:`~ds_stpar.layers.wgrad.SharedWeightGrad` for the call (:class:`LocalCompute`
holds them): one gradient tensor per weight, or fp32 ``main_grad`` with Megatron's gradient
accumulation fusion.

:func:`activation_linear` is the row GEMM with the activation in front, y = act(a) W^T,
saving ``a`` and recomputing act(a) in the backward (one elementwise pass), as the fused ring
MLP does: a Megatron MLP would keep both fc1's output and act(fc1's output). With a
:class:`~ds_stpar.layers.activation.ClosedFormActivation` the backward frees act(a) before it
makes fc2's input gradient and writes dA over ``a``
(:func:`~ds_stpar.layers.activation.activation_backward`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ds_stpar.layers.activation import Activation, activation_backward
from ds_stpar.layers.wgrad import SharedWeightGrad


class LocalCompute:
    """One call of local mode over some modules: the :class:`SharedWeightGrad` of each weight
    their linears use, made on first use (module docstring)."""

    def __init__(self) -> None:
        self._grads: dict[int, SharedWeightGrad] = {}

    def weight_grad(self, weight: Tensor, main_grad: Tensor | None) -> SharedWeightGrad:
        """``weight``'s accumulator for this call (``main_grad``: Megatron's fusion target)."""
        grads = self._grads.get(id(weight))
        if grads is None:
            grads = self._grads[id(weight)] = SharedWeightGrad(weight, main_grad)
        return grads


def _tokens(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])


def _use(weight: Tensor, grads: SharedWeightGrad) -> SharedWeightGrad:
    """Count a use whose backward will hand in a weight gradient."""
    return grads.use() if torch.is_grad_enabled() and weight.requires_grad else grads


class _LocalLinear(torch.autograd.Function):
    """y = x W^T; backward dX = dY W, dW = dY^T X into the weight's shared accumulator."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, grads: SharedWeightGrad) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.grads = grads
        return torch.matmul(x, weight.t())

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        x, weight = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        dx = torch.matmul(grad_output, weight) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            ctx.grads.add(_tokens(grad_output), _tokens(x))
            dw = ctx.grads.result(x.dtype)
        return dx, dw, None


class _ActivationLinear(torch.autograd.Function):
    """y = act(a) W^T saving ``a`` only; act(a) is recomputed in the backward."""

    @staticmethod
    def forward(ctx, a: Tensor, weight: Tensor, act: Activation, grads: SharedWeightGrad):
        ctx.save_for_backward(a, weight)
        ctx.act, ctx.grads = act, grads
        return torch.matmul(act(a), weight.t())

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        a, weight = ctx.saved_tensors
        need_da, need_dw = ctx.needs_input_grad[:2]
        grads = ctx.grads if need_dw else None
        da = activation_backward(
            ctx.act, _tokens(a), _tokens(grad_output.contiguous()), weight, grads
        )
        dw = grads.result(a.dtype) if grads is not None else None
        return (da.view(a.shape) if need_da else None), dw, None, None


def local_linear(x: Tensor, weight: Tensor, grads: SharedWeightGrad) -> Tensor:
    """``[..., K] x [N, K] -> [..., N]``, no communication; dW into ``grads`` (module
    docstring)."""
    return _LocalLinear.apply(x, weight, _use(weight, grads))


def activation_linear(
    a: Tensor, weight: Tensor, act: Activation, grads: SharedWeightGrad
) -> Tensor:
    """``act(a) W^T`` for ``a`` ``[..., F]``, ``act``: ``[..., F] -> [..., F']``, ``weight``
    ``[N, F']``; saves ``a`` only, dW into ``grads`` (module docstring)."""
    return _ActivationLinear.apply(a, weight, act, _use(weight, grads))
