"""RoPE over packed ``thd`` rows (ds_stpar.layers.packed_rope) against megatron-core's own
and against the exact rotation.

The references:
- megatron-core 0.16's ``apply_rotary_pos_emb`` on the same rows (its per-segment ``thd``
  path, which reads the segment lengths back to the host). In fp32 both compute
  ``t cos + rotate_half(t) sin`` with the same operations in the same order, so they must be
  bitwise equal; with ``DS_STPAR_FUSED_ROPE=0`` ours runs megatron-core's own bf16
  arithmetic, bitwise equal too.
- the rotation in float64. In bf16 ours computes in fp32 and rounds once, so every element
  is within one bf16 unit in the last place (2^-8 relative) plus 2^-21 of the two products'
  magnitudes (fp32's own roundings, which matter only where the products cancel), and its
  largest and total errors are below megatron-core's, which rounds after each of its four
  operations.
Run on one gloo rank because megatron-core's ``thd`` path asks the context-parallel group
for its size. The CUDA kernel (``torch.compile``) is checked in tests/test_attention_gpu.py.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.transformer_config import TransformerConfig

from ds_stpar.layers import packed_rope
from tests.distributed import run_workers

# segments of unequal lengths, one of a single token, one filling most of the row
CU = torch.tensor([0, 5, 6, 40, 41, 97, 100], dtype=torch.int32)


def exact_rotation(t: torch.Tensor, freqs: torch.Tensor, cu: torch.Tensor, mscale: float):
    """The rotation in float64, token by token (position = offset in its segment), and the
    sum of its two products' magnitudes."""
    out = torch.empty(t.shape, dtype=torch.float64)
    size = torch.empty(t.shape, dtype=torch.float64)
    x = t.double()
    half = x.shape[-1] // 2
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        for i in range(a, b):
            angle = freqs[i - a, 0, 0].double()
            rotated = torch.cat((-x[i, :, half:], x[i, :, :half]), dim=-1)
            first, second = x[i] * torch.cos(angle) * mscale, rotated * torch.sin(angle) * mscale
            out[i], size[i] = first + second, first.abs() + second.abs()
    return out, size


def _check_against_megatron(rank: int, world_size: int) -> None:
    group = torch.distributed.new_group([0])
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    longest = int((CU[1:] - CU[:-1]).max())
    # any angles serve: both paths must pick the same ones for each token
    freqs = torch.randn(longest, 1, 1, 16, generator=torch.Generator().manual_seed(3))
    for dtype, mscale in ((torch.float32, 1.0), (torch.float32, 0.5), (torch.bfloat16, 1.0)):
        t = torch.randn(int(CU[-1]), 4, 16, generator=torch.Generator().manual_seed(7)).to(dtype)
        extra = {"cp_group": group, "mscale": mscale}
        expected = rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=CU, **extra)
        marked = packed_rope.mark_segments(CU.clone(), CU)
        got = packed_rope.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=marked, **extra)
        if dtype == torch.float32:
            assert torch.equal(got, expected), (mscale, (got - expected).abs().max())
        else:
            exact, size = exact_rotation(t, freqs, CU, mscale)
            ours, theirs = (got.double() - exact).abs(), (expected.double() - exact).abs()
            # one bf16 rounding, plus fp32's own (2^-21 of the products, where they cancel)
            assert bool((ours <= exact.abs() * 2**-8 + size * 2**-21).all())
            assert ours.max() <= theirs.max() and ours.sum() < theirs.sum()
        # the second call (the key, another layer) reuses the micro-batch's angles
        cos, _ = packed_rope.angles(marked, None, freqs, mscale)
        assert cos is getattr(marked, packed_rope._ANGLES)[2]
        # unmarked rows and plain (sbhd) calls go to megatron-core's function unchanged
        plain = packed_rope.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=CU, **extra)
        assert torch.equal(plain, expected)
        sbhd = t[:8].unsqueeze(1)
        assert torch.equal(
            packed_rope.apply_rotary_pos_emb(sbhd, freqs[:8], config, **extra),
            rope_utils.apply_rotary_pos_emb(sbhd, freqs[:8], config, **extra),
        )


def _check_unfused_switch(rank: int, world_size: int) -> None:
    import os

    group = torch.distributed.new_group([0])
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    freqs = torch.randn(56, 1, 1, 16, generator=torch.Generator().manual_seed(3))
    t = torch.randn(100, 4, 16, generator=torch.Generator().manual_seed(7)).bfloat16()
    expected = rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=CU, cp_group=group)
    os.environ["DS_STPAR_FUSED_ROPE"] = "0"
    marked = packed_rope.mark_segments(CU.clone(), CU)
    got = packed_rope.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=marked, cp_group=group)
    assert torch.equal(got, expected)


def test_packed_rope_equals_megatron_thd_rope():
    run_workers(_check_against_megatron, 1)


def test_unfused_rope_is_megatron_arithmetic_bitwise():
    run_workers(_check_unfused_switch, 1)


def test_segment_index_restarts_at_every_boundary():
    cu = torch.tensor([0, 3, 4, 8])
    assert packed_rope.segment_index(cu).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]


def test_install_routes_megatron_attention_through_it():
    import megatron.core.transformer.attention as attention

    packed_rope.install()
    packed_rope.install()  # idempotent
    assert attention.apply_rotary_pos_emb is packed_rope.apply_rotary_pos_emb
    assert packed_rope._MEGATRON_APPLY is rope_utils.apply_rotary_pos_emb


def test_angles_follow_the_frequencies_and_mscale_of_each_call():
    """The per-micro-batch angle cache serves only the same ``freqs`` and ``mscale``: another
    table (a model with another RoPE base) or scale recomputes them (reference: the fp32
    rotation with angles computed here, bitwise, as both run the same operations)."""
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    gen = torch.Generator().manual_seed(5)
    t = torch.randn(int(CU[-1]), 4, 16, generator=gen)
    marked = packed_rope.mark_segments(CU.clone(), CU)
    index = packed_rope.segment_index(CU)
    first, second = (torch.randn(56, 1, 1, 16, generator=gen) for _ in range(2))
    for freqs, mscale in [(first, 1.0), (first, 1.0), (second, 1.0), (second, 0.25)]:
        got = packed_rope.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=marked, mscale=mscale)
        angle = freqs[index].squeeze(1)
        want = packed_rope.rotate(t, torch.cos(angle) * mscale, torch.sin(angle) * mscale)
        assert torch.equal(got, want)
