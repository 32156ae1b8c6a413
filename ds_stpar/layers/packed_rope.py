"""Rotary embeddings of packed rows without a host sync per layer.

megatron-core 0.16 applies RoPE to ``thd`` rows (documents packed end to end, positions
restarting at every ``cu_seqlens`` boundary) in ``_apply_rotary_pos_emb_thd``: it reads the
segment lengths back to the host (``.tolist()``, which waits for the GPU), splits the tokens
per segment and concatenates ``freqs[:len]`` slices, for the query and again for the key of
every layer. That is two GPU drains and a few small kernels per segment, per layer and
micro-batch: 1,409 ``cudaStreamSynchronize`` calls in one step of llama-4b at 16K
(bench/results/2026-11-26-s11-2xH200/call44), each leaving the GPU idle while the host
refills its queue.

The result is ``freqs[index]`` applied as one ``[T, 1, heads, d]`` block, where
``index[i]`` is token ``i``'s offset in its segment. :func:`mark_segments` computes that
index once per micro-batch on the host (where the runner already holds ``cu_seqlens``) and
attaches it to the ``cu_seqlens`` tensor that megatron-core passes down;
:func:`apply_rotary_pos_emb` uses it when present and otherwise defers to megatron-core's
own function, so every other caller and format is untouched. :func:`install` puts it in
place of the name megatron-core's attention module calls (idempotent).

Shapes: ``t`` [T, heads, d] (``thd`` squeezed), ``freqs`` [S, 1, 1, d] with ``S`` >= the
longest segment, ``index`` [T] int64 on ``t``'s device; out [T, heads, d].
"""

from __future__ import annotations

import megatron.core.transformer.attention as megatron_attention
import torch
from megatron.core.models.common.embeddings import rope_utils
from torch import Tensor

_SEGMENT_INDEX = "_stpar_segment_index"
_MEGATRON_APPLY = rope_utils.apply_rotary_pos_emb  # kept before install() replaces the name


def segment_index(cu_seqlens: Tensor) -> Tensor:
    """Each token's offset in its segment, ``[T]`` int64, from host ``cu_seqlens`` [n + 1]."""
    bounds = cu_seqlens.to(device="cpu", dtype=torch.int64)
    lengths = bounds[1:] - bounds[:-1]
    starts = torch.repeat_interleave(bounds[:-1], lengths)
    return torch.arange(int(bounds[-1])) - starts


def mark_segments(cu_seqlens: Tensor, host_cu_seqlens: Tensor) -> Tensor:
    """Attach the segment index of ``host_cu_seqlens`` (on the host) to the device tensor
    ``cu_seqlens`` that the micro-batch's PackedSeqParams carries; returns ``cu_seqlens``."""
    index = segment_index(host_cu_seqlens)
    if cu_seqlens.is_cuda:
        index = index.pin_memory().to(cu_seqlens.device, non_blocking=True)
    setattr(cu_seqlens, _SEGMENT_INDEX, index)
    return cu_seqlens


def apply_rotary_pos_emb(t: Tensor, freqs: Tensor, config, cu_seqlens=None, **kwargs) -> Tensor:
    """megatron-core's ``apply_rotary_pos_emb`` with marked ``thd`` rows done in one block."""
    index = getattr(cu_seqlens, _SEGMENT_INDEX, None)
    cp_group = kwargs.get("cp_group")
    plain = (
        index is None
        or config.apply_rope_fusion
        or config.multi_latent_attention
        or (cp_group is not None and cp_group.size() > 1)
    )
    if plain:
        return _MEGATRON_APPLY(t, freqs, config, cu_seqlens=cu_seqlens, **kwargs)
    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1),
        freqs[index],
        rotary_interleaved=config.rotary_interleaved,
        mscale=kwargs.get("mscale", 1.0),
    ).squeeze(1)


def install() -> None:
    """Route megatron-core attention's RoPE through :func:`apply_rotary_pos_emb`."""
    megatron_attention.apply_rotary_pos_emb = apply_rotary_pos_emb
