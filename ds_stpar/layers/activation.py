"""The MLP activation as the ring passes recompute it in their backward.

The ring MLPs (``ring_mlp``) and :func:`~ds_stpar.layers.local.activation_linear` save fc1's
output A and recompute act(A) in the backward, one chunk at a time
(:func:`activation_backward`). Two ways:

- any callable: :func:`recompute_activation` builds a small graph on the chunk and asks
  autograd for dA (a nested ``torch.autograd.grad``, which costs the host tens of
  microseconds per chunk and holds act(A), dA and the graph's buffers at once);
- :class:`ClosedFormActivation`, for the activations Megatron's GPT and Llama configs name
  (``F.gelu``, ``F.silu``, ``F.relu``, plain or gated): the forward function and autograd's
  own backward kernel for it (``gelu_backward``, ``silu_backward``, ``threshold_backward``),
  so dA is computed with the same kernels autograd would run, bit for bit, and can be written
  over A itself (:meth:`ClosedFormActivation.grad` with ``out=a``).

Gated (Megatron's GLU, fc1's local output ``[gate_d; up_d]``)::

    act(A)       = f(gate) * (up + offset)
    dL/d up      = dH * f(gate)
    dL/d gate    = f'(gate) applied to dH * (up + offset)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ds_stpar.layers.wgrad import WeightGrad

Activation = Callable[[Tensor], Tensor]

_aten = torch.ops.aten
# f -> its backward kernel, (grad_output, input, out) -> out
_BACKWARD: dict[Callable, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    F.gelu: lambda grad, a, out: _aten.gelu_backward.grad_input(grad, a, grad_input=out),
    F.silu: lambda grad, a, out: _aten.silu_backward.grad_input(grad, a, grad_input=out),
    F.relu: lambda grad, a, out: _aten.threshold_backward.grad_input(grad, a, 0, grad_input=out),
}


class ClosedFormActivation:
    """``f(a)``, or gated ``f(gate) * (up + offset)`` over the halves of the last dim, with
    its derivative from autograd's own backward kernel for ``f`` (module docstring)."""

    def __init__(self, func: Callable, gated: bool = False, offset: float = 0.0):
        if func not in _BACKWARD:
            raise ValueError(f"no closed-form derivative for {func!r}")
        self.func, self.gated, self.offset = func, gated, offset
        self._backward = _BACKWARD[func]

    @staticmethod
    def supports(func: Callable) -> bool:
        """Whether ``func`` is one of the activations with a closed form here."""
        return func in _BACKWARD

    def __call__(self, a: Tensor) -> Tensor:
        if not self.gated:
            return self.func(a)
        gate, up = torch.chunk(a, 2, dim=-1)
        return self.func(gate) * (up + self.offset)

    def grad(self, a: Tensor, grad_h: Tensor, out: Tensor | None = None) -> Tensor:
        """d act(a)/da applied to ``grad_h`` (``[..., F']``) -> ``[..., F]``, into ``out``
        (``out=a`` overwrites A elementwise: each element is read before it is written)."""
        out = torch.empty_like(a) if out is None else out
        if not self.gated:
            return self._backward(grad_h, a, out)
        gate, up = torch.chunk(a, 2, dim=-1)
        d_gate, d_up = torch.chunk(out, 2, dim=-1)
        grad_f = grad_h * (up + self.offset)  # before ``up`` may be overwritten
        torch.mul(grad_h, self.func(gate), out=d_up)
        self._backward(grad_f, gate, d_gate)
        return out


def recompute_activation(act: Activation, a: Tensor, grad_h: Tensor) -> tuple[Tensor, Tensor]:
    """(act(a), d act(a) / d a applied to ``grad_h``) for any callable, from a fresh graph
    on ``a`` (a :class:`ClosedFormActivation` needs none: :func:`activation_backward`)."""
    with torch.enable_grad():
        a = a.detach().requires_grad_()
        h = act(a)
    (grad_a,) = torch.autograd.grad(h, a, grad_h)
    return h.detach(), grad_a


def activation_backward(
    act: Activation,
    a: Tensor,
    dy: Tensor,
    w2: Tensor,
    wgrad2: WeightGrad | None,
    overwrite: bool = True,
    rows_per_chunk: int | None = None,
) -> Tensor:
    """dA for rows ``a`` ``[T, F]`` of fc1's saved output, given fc2's output gradient ``dy``
    ``[T, N]`` for them and fc2's weight ``w2`` ``[N, F']``: dW2 += dy^T act(a) (when
    ``wgrad2``), dA = act'(a) (dy W2). With a :class:`ClosedFormActivation` act(a) is freed
    before dy W2 is made, and with ``overwrite`` dA is written over ``a`` (returned: the
    caller must not need A's rows again; autograd's version check then refuses a second
    backward through a graph that saved ``a``); otherwise act(a) and dA come from a small
    graph (:func:`recompute_activation`) and dA is a fresh tensor.

    ``rows_per_chunk`` (closed form only): the rows go through in chunks of that many, so
    act(a) and dy W2, ``[T, F']`` each, are alive one chunk at a time (more kernels, each
    GEMM over fewer rows)."""
    if isinstance(act, ClosedFormActivation):
        rows = max(1, a.shape[0] if rows_per_chunk is None else rows_per_chunk)
        da = a if overwrite else torch.empty_like(a)
        for start in range(0, max(1, a.shape[0]), rows):  # no rows: one empty chunk, dW2 0
            a_rows, dy_rows = a[start : start + rows], dy[start : start + rows]
            if wgrad2 is not None:
                wgrad2.add(dy_rows, act(a_rows))
            act.grad(a_rows, dy_rows @ w2, out=da[start : start + rows])
        return da
    h, da = recompute_activation(act, a, dy @ w2)
    if wgrad2 is not None:
        wgrad2.add(dy, h)
    return da
