"""SDPACoreAttention on a CUDA GPU: over packed rows the one-kernel varlen path, over rows of
whole sequences SDPA (cuDNN's kernel on an H100, flash's where cuDNN does not run the call),
each equal to a float64 per-document reference (skipped without a GPU, as on CI).

Reference: each document's causal softmax attention computed alone in float64 from the same
bf16 inputs. Tolerance 2e-2 relative norm for outputs and input gradients: the kernel runs
bf16 inputs with fp32 accumulation, so it differs from float64 by bf16 roundings (~4e-3 per
rounding, a few in a chain); a segment attended across a boundary or a wrong causal corner
gives O(1) errors.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)"),
]

TOL = 2e-2


def _module(heads: int, groups: int, dim: int):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ds_stpar.layers.megatron_modules import SDPACoreAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        attention_dropout=0.0,
        bf16=True,
    )
    return SDPACoreAttention(config, 1, AttnMaskType.causal)


def _reference(q, k, v, bounds):
    """float64 causal attention per segment; q [t, n, d], k/v [t, g, d] -> [t, n * d]."""
    heads, groups = q.shape[1], k.shape[1]
    k, v = (x.repeat_interleave(heads // groups, dim=1) for x in (k, v))
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (x[a:b].double().transpose(0, 1) for x in (q, k, v))  # [n, l, d]
        scores = qs @ ks.transpose(1, 2) / qs.shape[-1] ** 0.5
        causal = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(outs).reshape(q.shape[0], -1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize(
    "heads, groups, dim",
    [(8, 8, 128), (8, 2, 128), (8, 8, 100)],  # 100: OpenLLaMA-3B's, padded for the kernel
)
def test_varlen_kernel_equals_documents_attended_alone(heads, groups, dim):
    from megatron.core.packed_seq_params import PackedSeqParams

    from ds_stpar.layers import megatron_modules as mm

    assert mm.VARLEN_ATTN is not None, "this PyTorch has no torch.nn.attention.varlen"
    torch.manual_seed(0)
    bounds = [0, 700, 713, 1500, 2048, 4096]
    t = bounds[-1]
    q = torch.randn(t, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(t, groups, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(t, groups, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=2048, max_seqlen_kv=2048
    )
    module = _module(heads, groups, dim)
    out = module(q, k, v, None, packed_seq_params=params)  # thd: [t, n, d] in, [t, 1, n d] out
    assert mm.varlen_usable(q.unsqueeze(1), 0.0)
    ref = _reference(q.detach(), k.detach(), v.detach(), bounds)
    assert _rel(out.reshape(t, -1), ref) < TOL
    grad = torch.randn_like(out)
    out.backward(grad)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    _reference(*leaves, bounds).backward(grad.reshape(t, -1).double())
    for got, want in zip((q.grad, k.grad, v.grad), leaves):
        assert _rel(got, want.grad) < TOL


@pytest.mark.parametrize("heads, groups, dim", [(8, 8, 128), (8, 2, 128), (8, 8, 100)])
def test_full_rows_equal_sequences_attended_alone(heads, groups, dim):
    """Rows of whole sequences (no packing), Megatron's ``[s, b, n, d]`` views, b = 2, as the
    layer benchmark runs them (PyTorch picks cuDNN's kernel there on an H100)."""
    torch.manual_seed(0)
    seq, batch = 1024, 2
    shape = (seq, batch)
    q = torch.randn(*shape, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(*shape, groups, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(*shape, groups, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = _module(heads, groups, dim)(q, k, v, None)  # [s, b, n d]
    grad = torch.randn_like(out)
    out.backward(grad)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = torch.stack([_reference(*(x[:, i] for x in leaves), [0, seq]) for i in range(batch)], 1)
    assert _rel(out, ref) < TOL
    ref.backward(grad.double())
    for got, want in zip((q.grad, k.grad, v.grad), leaves):
        assert _rel(got, want.grad) < TOL


def test_fused_rope_kernel_equals_the_exact_rotation_and_its_gradient():
    """The compiled CUDA rotation (packed_rope's fused kernel) on a strided query view as
    megatron-core's QKV split leaves it: every output element within one bf16 ulp (2^-8
    relative) of the float64 rotation (it rounds once from fp32), plus 2^-21 of the two
    products' magnitudes (fp32's own roundings, which matter only where they cancel); its
    input gradient, the inverse rotation of the output gradient, within the same bound."""
    from ds_stpar.layers import packed_rope

    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, heads, dim = 4096, 12, 128
    mixed = torch.randn(tokens, heads + 8, dim, device="cuda", generator=gen).bfloat16()
    t = mixed[:, :heads].detach().requires_grad_(True)  # non-contiguous, like the split
    angle = torch.rand(tokens, 1, dim, device="cuda", generator=gen) * 100
    cos, sin = torch.cos(angle), torch.sin(angle)
    out = packed_rope._FUSED_ROTATE(t, cos, sin)
    grad = torch.randn(out.shape, device="cuda", generator=gen).bfloat16()
    out.backward(grad)

    def within_bound(got, first, second):
        want = first + second
        bound = want.abs() * 2**-8 + (first.abs() + second.abs()) * 2**-21
        return bool(((got.double() - want).abs() <= bound).all())

    half = dim // 2
    c64, s64 = cos.double(), sin.double()
    x = t.detach().double()
    assert within_bound(out, x * c64, torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s64)
    # d/dx of x cos + R x sin is cos g + R^T (sin g), R^T = -R
    g = grad.double()
    g_sin = g * s64
    assert within_bound(t.grad, g * c64, torch.cat((g_sin[..., half:], -g_sin[..., :half]), -1))
