"""Instance A of temporal-partition.md: the 1-D ring, P ranks, P steps.

Boundary layouts are Megatron's with sequence parallelism, so the two functions chain
(QKV -> out-proj, fc1 -> fc2) with no re-layout. Notation: Y = X W^T as ``F.linear``; M tokens
(sequence-major, so sequence chunk c of P is a contiguous block of rows), rank d of P.

Column, ``y_shard_n = ring_column_linear(x_shard_m, w_shard_n)``::

    x_shard_m [M/P, K] (chunk d)   w_shard_n [N/P, K]   ->   y_shard_n [M, N/P]
    forward:  chunks of X rotate (d -> d-1);  step t: Y[c] = X[c] W_d^T,  c = (d+t) % P
    backward: dX[d] = sum_e dY_e[d] W_e     by the rotating accumulator (no reduce-scatter)
              dW_d  = sum_c dY[c]^T X[c]    local, X chunks rotating again (not saved)

Row, ``y_shard_m = ring_row_linear(x_shard_k, w_shard_k)``::

    x_shard_k [M, K/P]   w_shard_k [N, K/P]   ->   y_shard_m [M/P, N] (chunk d)
    forward:  Y[d] = sum_e X_e[d] W_e^T     by the rotating accumulator (no reduce-scatter)
    backward: chunks of dY rotate; step t: dX[c] = dY[c] W_d,  dW_d += dY[c]^T X[c]

The row pass can take an activation in front (act(X) W^T chunk by chunk), for the MLP's
two-pass node (``ring_mlp.ring_two_pass_mlp``), which composes these passes.

Versus Megatron TP+SP: the all-gather / reduce-scatter become P-1 neighbour hops of the same
volume ((P-1)/P of the activation) of which only the first is exposed, the rest hiding behind
the sub-GEMMs; no all-reduce; the column saves only its local input chunk (none when the
spec's norm made it: ``norm_recipe``) and never holds the gathered [M, K] input, the row never
holds the [M, N] pre-reduction partial output.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ds_stpar.layers.activation import Activation
from ds_stpar.layers.comm import Group, ring_pass
from ds_stpar.layers.deferred_wgrad import DeferredWeightGrad
from ds_stpar.layers.norm_recipe import kept, norm_of, recipe_of, remade
from ds_stpar.layers.wgrad import WeightGrad


def _rows(x: Tensor, index: int, rows: int) -> Tensor:
    return x[index * rows : (index + 1) * rows]


def column_forward(x_tokens: Tensor, w_shard_n: Tensor, group: Group) -> Tensor:
    """[rows, K] (chunk d) -> [P rows, N/P]: every chunk of X through this rank's W_d."""
    rows = x_tokens.shape[0]
    y_tokens = x_tokens.new_empty(group.size() * rows, w_shard_n.shape[0])
    ring_pass(
        group,
        rotate=x_tokens,
        visit=lambda c, x_c: torch.mm(x_c, w_shard_n.t(), out=_rows(y_tokens, c, rows)),
    )
    return y_tokens


def column_backward(
    x_tokens: Tensor,
    w_shard_n: Tensor,
    dy_tokens: Tensor,
    group: Group,
    need_dx: bool,
    wgrad: WeightGrad | None,
) -> Tensor | None:
    """dX chunk d by the rotating accumulator, then dW into ``wgrad`` as X rotates again.

    Two passes rather than one carrying both streams: the accumulator's buffers (this rank's
    partial sum, the one in flight, the one arriving) are freed before the weight gradient
    is first allocated, so they never coexist with it. Same bytes, P - 1 more P2P batches.
    With the two-pass MLP's closed-form activation, its backward peak at the proportions of
    h 8192 / 8K tokens, P = 2, fell from 17 to 15 [tokens/P, h] blocks above its inputs
    (``bench/cpu_peak.py``; BENCHMARKS.md, eighteenth session)."""
    rows = x_tokens.shape[0]
    dx_tokens = None
    if need_dx:
        dx_tokens = ring_pass(group, partial=lambda m: _rows(dy_tokens, m, rows) @ w_shard_n)
    if wgrad is not None:
        ring_pass(
            group,
            rotate=x_tokens,
            visit=lambda c, x_c: wgrad.add(_rows(dy_tokens, c, rows), x_c),
        )
    return dx_tokens


def row_forward(
    x_tokens: Tensor, w_shard_k: Tensor, group: Group, act: Activation | None = None
) -> Tensor:
    """[P rows, K/P] -> [rows, N] (chunk d) by the rotating accumulator; ``act`` in front."""
    rows = x_tokens.shape[0] // group.size()

    def partial(m: int) -> Tensor:
        x_m = _rows(x_tokens, m, rows)
        return (x_m if act is None else act(x_m)) @ w_shard_k.t()

    return ring_pass(group, partial=partial)


class _RingColumnLinear(torch.autograd.Function):
    """forward: rotate X chunks, one sub-GEMM per step; backward: rotating accumulator for
    dX and a second rotation of X for the local dW (see the module docstring). With a
    ``deferred`` weight gradient (``deferred_wgrad``: the attention projection's), that
    weight is an input too, and its gradient is made first in the backward."""

    @staticmethod
    def forward(
        ctx, x_shard_m: Tensor, w_shard_n: Tensor, group: Group, main_grad, recipe, _, deferred
    ):
        x_tokens = x_shard_m.reshape(-1, x_shard_m.shape[-1])
        y_tokens = column_forward(x_tokens, w_shard_n, group)
        ctx.save_for_backward(kept(x_shard_m, recipe), w_shard_n)
        ctx.group, ctx.main_grad, ctx.norm = group, main_grad, norm_of(recipe)
        ctx.deferred = deferred
        return y_tokens.view(group.size() * x_shard_m.shape[0], *x_shard_m.shape[1:-1], -1)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        # first: the pass below writes over the copy engines' buffer the deferred dW reads
        deferred_dw = ctx.deferred.result() if ctx.deferred is not None else None
        ctx.deferred = None
        saved_x, w_shard_n = ctx.saved_tensors
        x_shard_m = remade(saved_x, ctx.norm)
        x_tokens = x_shard_m.reshape(-1, x_shard_m.shape[-1])
        dy_tokens = grad_output.contiguous().view(-1, w_shard_n.shape[0])
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        wgrad = WeightGrad(w_shard_n, ctx.main_grad) if need_dw else None
        dx_tokens = column_backward(x_tokens, w_shard_n, dy_tokens, ctx.group, need_dx, wgrad)
        dx = dx_tokens.view(x_shard_m.shape) if need_dx else None
        dw = wgrad.result(x_shard_m.dtype) if need_dw else None
        return dx, dw, None, None, None, deferred_dw, None


class _RingRowLinear(torch.autograd.Function):
    """forward: rotating accumulator of the partial outputs; backward: rotate dY chunks,
    writing dX[c] in place and accumulating dW locally (see the module docstring), or, with a
    ``deferred`` weight gradient, keeping the chunks for the QKV linear's backward to make it
    (``deferred_wgrad``)."""

    @staticmethod
    def forward(ctx, x_shard_k: Tensor, w_shard_k: Tensor, group: Group, main_grad, deferred):
        size = group.size()
        x_tokens = x_shard_k.reshape(-1, x_shard_k.shape[-1])
        y_tokens = row_forward(x_tokens, w_shard_k, group)
        ctx.save_for_backward(x_shard_k, w_shard_k)
        ctx.group, ctx.main_grad, ctx.deferred = group, main_grad, deferred
        return y_tokens.view(x_shard_k.shape[0] // size, *x_shard_k.shape[1:-1], -1)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        x_shard_k, w_shard_k = ctx.saved_tensors
        x_tokens = x_shard_k.reshape(-1, x_shard_k.shape[-1])
        rows = x_tokens.shape[0] // ctx.group.size()
        dy_tokens = grad_output.contiguous().view(rows, w_shard_k.shape[0])
        deferred, ctx.deferred = ctx.deferred, None
        need_dx = ctx.needs_input_grad[0]
        need_dw = ctx.needs_input_grad[1] and deferred is None
        wgrad = WeightGrad(w_shard_k, ctx.main_grad) if need_dw else None
        dx_tokens = torch.empty_like(x_tokens) if need_dx else None

        def visit(c: int, dy_c: Tensor) -> None:
            if need_dx:
                torch.mm(dy_c, w_shard_k, out=_rows(dx_tokens, c, rows))
            if need_dw:
                wgrad.add(dy_c, _rows(x_tokens, c, rows))
            if deferred is not None:
                deferred.keep(dy_c, _rows(x_tokens, c, rows))

        if need_dx or need_dw or deferred is not None:
            ring_pass(ctx.group, rotate=dy_tokens, visit=visit)
        if deferred is not None:
            deferred.seal()
        dx = dx_tokens.view(x_shard_k.shape) if need_dx else None
        dw = wgrad.result(x_shard_k.dtype) if need_dw else None
        return dx, dw, None, None, None


def ring_column_linear(
    x_shard_m: Tensor,
    w_shard_n: Tensor,
    group: Group,
    main_grad: Tensor | None = None,
    deferred: DeferredWeightGrad | None = None,
) -> Tensor:
    """[s/P, b, K] (sequence chunk d) x [N/P, K] -> [s, b, N/P]; see the module docstring.

    ``main_grad``: accumulate dW there in fp32 and return no weight gradient (Megatron's
    gradient_accumulation_fusion); ``None`` returns dW as the gradient. An ``x_shard_m``
    marked by the spec's norm (``norm_recipe``) is not kept: its backward makes it again.
    ``deferred``: another weight's gradient (the attention projection's) that this node's
    backward makes and returns (``deferred_wgrad``).
    """
    recipe = recipe_of(x_shard_m)
    tied = deferred.weight if deferred is not None else None
    return _RingColumnLinear.apply(
        x_shard_m.contiguous(), w_shard_n, group, main_grad, recipe, tied, deferred
    )


def ring_row_linear(
    x_shard_k: Tensor,
    w_shard_k: Tensor,
    group: Group,
    main_grad: Tensor | None = None,
    deferred: DeferredWeightGrad | None = None,
) -> Tensor:
    """[s, b, K/P] x [N, K/P] -> [s/P, b, N] (sequence chunk d); s must divide by P.
    ``deferred``: leave dW to the column linear whose node returns it (``deferred_wgrad``)."""
    return _RingRowLinear.apply(x_shard_k.contiguous(), w_shard_k, group, main_grad, deferred)
