"""megatron-core's fused SwiGLU as the GPU loop runs it (``bias_activation_fusion``, chosen by
``integrations.megatron.fused_swiglu``; skipped without a GPU, as on CI).

Reference: SiLU(gate) * up and its gradients in float64 from the same bf16 inputs. Tolerance
2e-2 relative norm: the kernel reads and writes bf16 (~4e-3 per rounding, a few in the
chain); a swapped gate/up half or a wrong SiLU derivative gives O(1) errors. Several token
counts, as the loop's packed micro-batches vary in length (``torch.compile`` recompiles or
goes dynamic; either must stay correct).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)"),
]

TOL = 2e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def test_the_gpu_config_fuses_swiglu_except_under_the_fused_ring_mlp():
    from ds_stpar.config import Layout, ModelSpec, Strategy
    from ds_stpar.integrations.megatron import transformer_config

    model = ModelSpec.load("bench/models/llama-4b-untied.json")
    linear = Strategy(Layout(tp=2, tp_mode="ring"), zero=0, fused_ring_mlp=False)
    fused_ring = Strategy(Layout(tp=2, tp_mode="ring"), zero=0, fused_ring_mlp=True)
    assert transformer_config(model, linear).bias_activation_fusion
    assert not transformer_config(model, fused_ring).bias_activation_fusion


@pytest.mark.parametrize("tokens", [1000, 4096, 16384])
def test_fused_swiglu_equals_float64(tokens):
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    torch.manual_seed(tokens)
    f = 1536
    y = torch.randn(tokens, 1, 2 * f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, 1, f, device="cuda", dtype=torch.bfloat16)
    out = bias_swiglu_impl(y, None)
    out.backward(grad)
    ref_y = y.detach().double().requires_grad_()
    gate, up = ref_y.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    ref.backward(grad.double())
    assert out.shape == (tokens, 1, f)
    assert _rel(out, ref.detach()) < TOL
    assert _rel(y.grad, ref_y.grad) < TOL
