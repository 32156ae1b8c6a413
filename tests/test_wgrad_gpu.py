"""Weight gradients of bf16 GEMMs into an fp32 ``main_grad`` on CUDA (Megatron's gradient
accumulation fusion, ``wgrad.addmm_into``); skipped without a GPU, as on CI.

Reference: main_grad + sum_t dY_t^T X_t in float64 from the same bf16 inputs. Tolerance 1e-5
relative to the largest entry: the products of bf16 values are exact in fp32 and the sums run
in fp32 over at most 3 x 1024 tokens (about sqrt(3072) x 6e-8 = 3e-6 relative); a bf16
accumulator or a transposed operand gives 1e-3 or O(1). The accumulation must not allocate a
product the size of the weight (the point of the fused form): after the first add (cuBLAS
allocates its workspace on first use) each add may allocate at most a tenth of it.
"""

from __future__ import annotations

import pytest
import torch

from ds_stpar.layers.wgrad import WeightGrad

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)"),
]


def test_bf16_weight_gradient_adds_into_fp32_main_grad_in_place():
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, k, tokens = 2048, 1536, 1024
    weight = torch.nn.Parameter(torch.zeros(n, k, device="cuda", dtype=torch.bfloat16))
    main_grad = torch.randn(n, k, device="cuda", generator=gen)
    expected = main_grad.double()
    wgrad = WeightGrad(weight, main_grad)
    for step in range(3):
        dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16, generator=gen)
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        expected += dy.double().t() @ x.double()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        wgrad.add(dy, x)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
        assert step == 0 or extra <= main_grad.numel() * 4 // 10, f"allocated {extra} bytes"
    err = (main_grad.double() - expected).abs().max() / expected.abs().max()
    assert err <= 1e-5, float(err)
    assert wgrad.result(torch.bfloat16) is None  # the gradient went into main_grad
