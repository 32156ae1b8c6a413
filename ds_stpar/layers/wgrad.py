"""Weight-gradient accumulation over the steps of a temporal pass, Megatron's way.

A temporal layer computes dW = sum_t dY_t^T X_t one step at a time, on the rank that owns the
weight block (no all-reduce). Without ``gradient_accumulation_fusion`` the sum is returned
as the weight's gradient. With it (Megatron-core semantics, which its DDP relies on) the sum is
added in fp32 straight into ``weight.main_grad`` and the autograd gradient is ``None`` -- or,
when the weight carries ``grad_added_to_main_grad`` (DDP with overlapped grad reduce), a dummy
tensor of ``main_grad``'s shape (zeros if ``weight.zero_out_wgrad``) and the flag is set.

:class:`SharedWeightGrad` sums one weight's gradient over several autograd Functions of one
forward (an interleaved layer's pieces) into one tensor.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from ds_stpar.errors import ConfigError


def fused_main_grad(weight: Tensor, fuse: bool) -> Tensor | None:
    """``weight.main_grad`` when fusion is on and a gradient will be needed, else ``None``."""
    if not fuse or not (weight.requires_grad and torch.is_grad_enabled()):
        return None
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise ConfigError(
            "gradient_accumulation_fusion=True needs weight.main_grad (created by Megatron's "
            "DistributedDataParallel); wrap the model in it or set the flag to False"
        )
    return main_grad


def _addmm_into(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b, accumulated in ``acc``'s dtype (fp32 main_grad for bf16/fp16 inputs).

    On CUDA one GEMM adds its fp32 product straight into ``acc`` (``out_dtype``, beta = 1), as
    Megatron's fused weight-gradient kernel does: no product tensor the size of the weight
    (BENCHMARKS.md, twentieth session: 512 MiB less per h 8192 MLP weight at TP2, and
    0.38-3.1 ms against 0.46-3.2 ms). The CPU has no such kernel: inputs are upcast first."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif a.is_cuda:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


class WeightGrad:
    """Accumulates dW += dY_t^T X_t (2-D, tokens on dim 0) for one weight block."""

    def __init__(self, weight: Tensor, main_grad: Tensor | None):
        self.weight = weight
        self.main_grad = main_grad
        self.grad: Tensor | None = None

    def add(self, grad_output: Tensor, inputs: Tensor) -> None:
        if self.main_grad is not None:
            _addmm_into(self.main_grad, grad_output.t(), inputs)
        elif self.grad is None:
            self.grad = grad_output.t() @ inputs
        else:
            self.grad.addmm_(grad_output.t(), inputs)

    def result(self, input_dtype: torch.dtype) -> Tensor | None:
        """What the autograd Function returns for the weight."""
        if self.main_grad is None:
            return self.grad
        weight = self.weight
        if not hasattr(weight, "grad_added_to_main_grad"):
            return None
        make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
        weight.grad_added_to_main_grad = True
        return make(self.main_grad.shape, dtype=input_dtype, device=self.main_grad.device)


class SharedWeightGrad(WeightGrad):
    """One weight's gradient summed over every use of it in one forward, each use's backward
    adding into the same tensor (or ``main_grad``); the last use's backward returns what
    :class:`WeightGrad` would, the others ``None``.

    Why: an interleaved layer runs each linear once per piece of the micro-batch. With a
    gradient per use, autograd holds a piece's dW beside the sum it adds it to: one
    weight-sized block more at the backward's peak (a quarter GiB per MLP weight at h 8192,
    TP2). With ``main_grad`` and Megatron's DDP (``grad_added_to_main_grad``) each use would
    hand in a dummy of the weight's size instead; one dummy is enough.

    :meth:`use` counts a forward application; after the last use's backward the count starts
    over, so a second backward through the same graph (``retain_graph=True``) sums afresh.
    Every use's backward must run in each backward pass, or the sum is never handed over: true
    of an interleaved layer, every piece of which reaches its output (concatenated, or handed
    on to the next layer). Where some uses' backward ran and
    others' did not, the accumulator warns when it is freed (the gradient was lost).
    """

    def __init__(self, weight: Tensor, main_grad: Tensor | None):
        super().__init__(weight, main_grad)
        self._uses = 0
        self._pending = 0

    def use(self) -> SharedWeightGrad:
        """Count one forward application; returns ``self`` for its Function to keep."""
        self._uses += 1
        self._pending += 1
        return self

    def __del__(self) -> None:
        if 0 < self._pending < self._uses:
            warnings.warn(
                f"{self._uses - self._pending} of {self._uses} uses of a weight of shape "
                f"{tuple(self.weight.shape)} ran their backward, the others did not: its "
                "gradient was never handed to autograd (every piece of an interleaved "
                "layer's output must reach the loss)",
                RuntimeWarning,
                stacklevel=1,
            )

    def result(self, input_dtype: torch.dtype) -> Tensor | None:
        self._pending -= 1
        if self._pending > 0:
            return None
        self._pending = self._uses
        handed = super().result(input_dtype)
        self.grad = None
        return handed
