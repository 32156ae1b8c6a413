"""RoPE over packed ``thd`` rows (ds_stpar.layers.packed_rope) against megatron-core's own.

The reference is megatron-core 0.16's ``apply_rotary_pos_emb`` on the same rows (its
per-segment ``thd`` path, which reads the segment lengths back to the host). Both apply the
same ``_apply_rotary_pos_emb_bshd`` arithmetic to the same frequencies, so the results must
be bitwise equal, in fp32 and bf16; run on one gloo rank because megatron-core's ``thd`` path
asks the context-parallel group for its size.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.transformer_config import TransformerConfig

from ds_stpar.layers import packed_rope
from tests.distributed import run_workers


def _check_against_megatron(rank: int, world_size: int) -> None:
    group = torch.distributed.new_group([0])
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    # segments of unequal lengths, one of a single token, one filling most of the row
    cu = torch.tensor([0, 5, 6, 40, 41, 97, 100], dtype=torch.int32)
    # any angles serve: both paths must pick the same ones for each token
    longest = int((cu[1:] - cu[:-1]).max())
    freqs = torch.randn(longest, 1, 1, 16, generator=torch.Generator().manual_seed(3))
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.randn(int(cu[-1]), 4, 16, generator=torch.Generator().manual_seed(7)).to(dtype)
        expected = rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, cp_group=group)
        marked = packed_rope.mark_segments(cu.clone(), cu)
        got = packed_rope.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=marked, cp_group=group)
        assert torch.equal(got, expected), (dtype, (got - expected).abs().max())
        # unmarked rows and plain (sbhd) calls go to megatron-core's function unchanged
        plain = packed_rope.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, cp_group=group)
        assert torch.equal(plain, expected)
        sbhd = t[:8].unsqueeze(1)
        assert torch.equal(
            packed_rope.apply_rotary_pos_emb(sbhd, freqs[:8], config, cp_group=group),
            rope_utils.apply_rotary_pos_emb(sbhd, freqs[:8], config, cp_group=group),
        )


def test_packed_rope_equals_megatron_thd_rope():
    run_workers(_check_against_megatron, 1)


def test_segment_index_restarts_at_every_boundary():
    cu = torch.tensor([0, 3, 4, 8])
    assert packed_rope.segment_index(cu).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]


def test_install_routes_megatron_attention_through_it():
    import megatron.core.transformer.attention as attention

    packed_rope.install()
    packed_rope.install()  # idempotent
    assert attention.apply_rotary_pos_emb is packed_rope.apply_rotary_pos_emb
    assert packed_rope._MEGATRON_APPLY is rope_utils.apply_rotary_pos_emb
