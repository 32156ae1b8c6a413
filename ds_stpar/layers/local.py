"""A tensor-parallel rank's own GEMMs with no communication in them.

:mod:`ds_stpar.layers.interleave` moves the transfers out of the linears (it gathers a
column's input before and reduces a row's output after, so another micro-batch's work runs in
between); inside, a temporal linear in *local* mode runs only this:

    column: x [s, b, K] (gathered) x W_d [N/P, K] -> [s, b, N/P]
    row:    x [s, b, K/P]          x W_d [N, K/P] -> [s, b, N]   (this rank's term of the sum)

Both save their input for dW (the column's is the gathered one: the backward needs no second
gather), or, when the spec's norm made it, the norm's input, from which dW makes it again
(``norm_recipe``). A linear runs once per piece of the micro-batch, and every use's dW goes into its
weight's :class:`~ds_stpar.layers.wgrad.SharedWeightGrad` for the call (:class:`LocalCompute`
holds them): one gradient tensor per weight, or fp32 ``main_grad`` with Megatron's gradient
accumulation fusion.

:func:`activation_linear` is the row GEMM with the activation in front, y = act(a) W^T,
saving ``a`` and recomputing act(a) in the backward (one elementwise pass, in
:data:`ACTIVATION_CHUNKS` row chunks), as the fused ring MLP does: a Megatron MLP would keep
both fc1's output and act(fc1's output). With a
:class:`~ds_stpar.layers.activation.ClosedFormActivation` the backward frees act(a) before it
makes fc2's input gradient and, when the caller hands ``a`` over (``consume_a``, as
``StparMLP`` does with fc1's output), writes dA over it
(:func:`~ds_stpar.layers.activation.activation_backward`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ds_stpar.layers.activation import Activation, activation_backward
from ds_stpar.layers.norm_recipe import kept, norm_of, recipe_of, remade
from ds_stpar.layers.wgrad import SharedWeightGrad


class LocalCompute:
    """One call of local mode over some modules: the :class:`SharedWeightGrad` of each weight
    their linears use, made on first use (module docstring), and the order the uses made now
    run their backward in (``weight_grad_first``, :func:`local_linear`), which the caller sets
    per piece of its micro-batch."""

    def __init__(self) -> None:
        self._grads: dict[int, SharedWeightGrad] = {}
        self.weight_grad_first = False

    def weight_grad(self, weight: Tensor, main_grad: Tensor | None) -> SharedWeightGrad:
        """``weight``'s accumulator for this call (``main_grad``: Megatron's fusion target,
        the same at every use)."""
        grads = self._grads.get(id(weight))
        if grads is None:
            grads = self._grads[id(weight)] = SharedWeightGrad(weight, main_grad)
        elif grads.main_grad is not main_grad:
            raise ValueError("one weight used with two different main_grad tensors in one call")
        return grads


ACTIVATION_CHUNKS = 2
"""Row chunks :func:`activation_linear`'s backward makes act(a) and dy W2 (``[rows, F']``
each) in: each is alive one chunk at a time. Each chunk past the first adds one more pass
over the weight gradient (dW2 += dy_c^T act(a_c) reads and writes all of it), so few: at
h 8192 / 8K tokens (TP2) an interleaved layer's pieces made 64 and 128 MiB of each at once,
about 32 MiB above 0.85x Megatron TP2 + SP's peak; in halves they lie below it. In 16 MiB
chunks (4-16 of them) the layer ran 4-5% slower (BENCHMARKS.md, thirty-fifth session). A bf16
weight gradient without ``main_grad`` takes one more bf16 rounding per chunk, as per use."""


def _tokens(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])


def _use(weight: Tensor, grads: SharedWeightGrad) -> SharedWeightGrad:
    """Count a use whose backward will hand in a weight gradient."""
    return grads.use() if torch.is_grad_enabled() and weight.requires_grad else grads


class _LocalLinear(torch.autograd.Function):
    """y = x W^T; backward dX = dY W, dW = dY^T X into the weight's shared accumulator (X made
    again from the norm's input when a marked norm output was handed in: ``norm_recipe``), in
    that order, or dW first (``weight_grad_first``)."""

    @staticmethod
    def forward(
        ctx, x: Tensor, weight: Tensor, grads: SharedWeightGrad, recipe, weight_grad_first: bool
    ) -> Tensor:
        ctx.save_for_backward(kept(x, recipe), weight)
        ctx.grads, ctx.norm, ctx.weight_grad_first = grads, norm_of(recipe), weight_grad_first
        return torch.matmul(x, weight.t())

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        saved_x, weight = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        need_dx, need_dw = ctx.needs_input_grad[:2]

        def weight_grad() -> Tensor | None:
            x = remade(saved_x, ctx.norm)
            ctx.grads.add(_tokens(grad_output), _tokens(x))
            return ctx.grads.result(x.dtype)  # x, a remade norm output, is freed here

        dw = weight_grad() if need_dw and ctx.weight_grad_first else None
        dx = torch.matmul(grad_output, weight) if need_dx else None
        if need_dw and not ctx.weight_grad_first:
            dw = weight_grad()
        return dx, dw, None, None, None


class _ActivationLinear(torch.autograd.Function):
    """y = act(a) W^T saving ``a`` only; act(a) is recomputed in the backward (dA written over
    ``a`` when ``consume_a``)."""

    @staticmethod
    def forward(ctx, a: Tensor, weight: Tensor, act: Activation, grads, consume_a: bool):
        ctx.save_for_backward(a, weight)
        ctx.act, ctx.grads, ctx.consume_a = act, grads, consume_a
        return torch.matmul(act(a), weight.t())

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        a, weight = ctx.saved_tensors
        need_da, need_dw = ctx.needs_input_grad[:2]
        grads = ctx.grads if need_dw else None
        dy = _tokens(grad_output.contiguous())
        rows = -(-dy.shape[0] // ACTIVATION_CHUNKS)
        da = activation_backward(ctx.act, _tokens(a), dy, weight, grads, ctx.consume_a, rows)
        dw = grads.result(a.dtype) if grads is not None else None
        return (da.view(a.shape) if need_da else None), dw, None, None, None


def local_linear(
    x: Tensor, weight: Tensor, grads: SharedWeightGrad, weight_grad_first: bool = False
) -> Tensor:
    """``[..., K] x [N, K] -> [..., N]``, no communication; dW into ``grads`` (module
    docstring). An ``x`` the spec's norm marked is not kept: dW makes it again.

    The backward makes dX first, so that whatever it feeds (a norm's backward, then a
    transfer of the input gradient) starts as early as it can, unless ``weight_grad_first``:
    then dW first, so that dX ``[..., K]`` and the remade input are never alive together,
    nor dX beside the weight gradient's first allocation (where the use makes it). For an
    interleaved layer's pieces after the first, whose input gradients' transfers hide behind
    the earlier pieces' backward anyway: at h 8192 / 8K tokens (TP2) piece B's QKV
    backward held dX, the remade norm and the 192 MiB weight gradient together, the layer's
    backward peak (BENCHMARKS.md, thirty-fifth session)."""
    return _LocalLinear.apply(x, weight, _use(weight, grads), recipe_of(x), weight_grad_first)


def activation_linear(
    a: Tensor,
    weight: Tensor,
    act: Activation,
    grads: SharedWeightGrad,
    consume_a: bool = False,
) -> Tensor:
    """``act(a) W^T`` for ``a`` ``[..., F]``, ``act``: ``[..., F] -> [..., F']``, ``weight``
    ``[N, F']``; saves ``a`` only, dW into ``grads`` (module docstring). ``consume_a``: the
    caller does not read ``a`` after the forward (fc1's fresh output), so a closed-form
    backward writes dA over it; the memory of one ``a`` less at the backward's peak."""
    return _ActivationLinear.apply(a, weight, act, _use(weight, grads), consume_a)
