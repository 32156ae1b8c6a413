"""The attention projection's weight gradient, made after the attention's backward.

A ring layer's backward runs the projection (row linear, ``W_o`` [h, h/P]), the core
attention, then the QKV linear (column). The projection's ring pass makes
``dW_o = sum_c dY[c]^T O[c]`` beside its hops, so ``dW_o`` is alive through the attention's
backward, which is where the two-pass ring layer peaks at h 8192 / 8K tokens over NVLink
(twenty-sixth session, call 161: the weight gradients made so far, cuDNN's dQ, dK, dV and
workspace, the saved QKV output, O and its gradient, the residual stream's gradient, the
copy engines' buffer).

Deferred, ``dW_o`` is made at the start of the QKV linear's backward instead, right after
the attention's, from what its GEMMs read, kept until then:

- this rank's dY chunk: the residual stream's gradient, which autograd keeps for the first
  norm's backward anyway (without hidden dropout, whose mask would make it a tensor of its
  own: ``megatron_modules.StparSelfAttention`` links the two layers only then);
- the chunk that arrived from the neighbour: at P = 2 over the copy engines, a view of the
  ring's buffer (``symmetric.py``), held anyway and written again only by the next ring
  batch, which is the QKV linear's own;
- O, the attention's output as the projection got it: alive at that peak with or without
  the deferral in the measured layer (calls 161 and 187). Where it is a copy that nothing
  else keeps, the deferral keeps it, [T, h/P], through the attention's backward: as many
  bytes as dW_o at T = h.

So at P = 2 on the copy engines the peak loses [h, h/2] and keeps nothing new. It is not
done where it would save nothing or cost memory:

- with ``gradient_accumulation_fusion`` dW is added into Megatron's persistent fp32
  ``main_grad``, so there is no dW tensor to defer;
- with NCCL's hops the arrived chunk is a buffer of its own, [T/2, h] for [h, h/2]: a saving
  only where the micro-batch has fewer tokens than h, and the hop would lose the dW GEMM it
  hides behind;
- at P > 2 the arrivals are overwritten within the pass.

The gradient still reaches the weight through autograd: the QKV linear's node takes ``W_o``
as an input and returns its gradient, so ``AccumulateGrad`` and the hooks on it (Megatron's
DDP, DeepSpeed's ZeRO) see ``dW_o`` once, as from any node, right after the attention's
backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ds_stpar.layers.comm import Group
from ds_stpar.layers.symmetric import SymmetricRing, symmetric_ring
from ds_stpar.layers.wgrad import WeightGrad


class DeferredWeightGrad:
    """One projection's dW for one forward: the row linear's backward :meth:`keep`-s the
    (dY chunk, input chunk) pairs of its ring pass; the column linear's backward takes
    :meth:`result`."""

    def __init__(self, weight: Tensor, ring: SymmetricRing | None):
        self.weight, self._ring = weight, ring
        self._terms: list[tuple[Tensor, Tensor]] = []
        self._batches: int | None = None

    def keep(self, dy_chunk: Tensor, x_chunk: Tensor) -> None:
        """One step's operands of ``dW += dY[c]^T X[c]`` (2-D, tokens on dim 0)."""
        self._terms.append((dy_chunk, x_chunk))

    def seal(self) -> None:
        """The row linear's pass is over: its arrivals must stay unwritten from here on."""
        self._batches = self._ring.batches if self._ring is not None else None

    def result(self) -> Tensor | None:
        """dW; None when the row linear's backward kept nothing."""
        if not self._terms:
            return None
        if self._ring is not None and self._ring.batches != self._batches:
            raise RuntimeError(
                "a ring pass ran between the attention projection's backward and the QKV "
                "linear's: the copy engines' buffer holding the projection's dY chunk was "
                "written over before its deferred weight gradient was made"
            )
        wgrad = WeightGrad(self.weight, None)
        for dy_chunk, x_chunk in self._terms:
            wgrad.add(dy_chunk, x_chunk)
        self._terms.clear()
        return wgrad.grad


class ProjectionWgradDeferral:
    """Pairs a QKV column linear with the projection row linear whose dW it makes.

    The column's forward :meth:`start`-s a :class:`DeferredWeightGrad` and the row's forward
    of the same layer, next, :meth:`take`-s it (a layer's forward runs its attention as one
    unit, also under pipeline schedules and activation recompute, which runs it again).
    ``always``: defer at P = 2 without fusion whatever the transport (for tests on gloo);
    otherwise only where it costs nothing (module docstring)."""

    def __init__(self, projection: torch.nn.Module, always: bool = False):
        self.projection, self.always = projection, always
        self._pending: DeferredWeightGrad | None = None

    def start(self, group: Group, device: torch.device) -> DeferredWeightGrad | None:
        """A deferral for this forward, or None when it would not pay or no dW is wanted."""
        self._pending = None
        weight = self.projection.weight
        if (
            group.size() != 2
            or not torch.is_grad_enabled()
            or not weight.requires_grad
            or self.projection.gradient_accumulation_fusion
        ):
            return None
        ring = symmetric_ring(group, device)
        if ring is None and not self.always:
            return None
        self._pending = DeferredWeightGrad(weight, ring)
        return self._pending

    def take(self) -> DeferredWeightGrad | None:
        pending, self._pending = self._pending, None
        return pending
