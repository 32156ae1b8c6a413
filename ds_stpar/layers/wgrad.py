"""Weight-gradient accumulation over the steps of a temporal pass, Megatron's way.

A temporal layer computes dW = sum_t dY_t^T X_t one step at a time, on the rank that owns the
weight block (no all-reduce). Without ``gradient_accumulation_fusion`` the sum is returned
as the weight's gradient. With it (Megatron-core semantics, which its DDP relies on) the sum is
added in fp32 straight into ``weight.main_grad`` and the autograd gradient is ``None`` -- or,
when the weight carries ``grad_added_to_main_grad`` (DDP with overlapped grad reduce), a dummy
tensor of ``main_grad``'s shape (zeros if ``weight.zero_out_wgrad``) and the flag is set.
"""

from __future__ import annotations

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
    """acc += a @ b, accumulated in ``acc``'s dtype (fp32 main_grad for bf16/fp16 inputs)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif a.is_cuda:
        acc.add_(torch.mm(a, b, out_dtype=acc.dtype))
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
