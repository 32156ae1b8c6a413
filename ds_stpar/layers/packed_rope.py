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

The rotation itself, ``t cos + rotate_half(t) sin`` (:func:`rotate`), is one fused kernel
each way on CUDA (``torch.compile``, as megatron-core fuses its SwiGLU): megatron-core's eager
version runs six kernels per call (two products, a negation, two concatenations and a sum)
over strided views, 0.35 ms for a 16K-token query of llama-4b at TP2, 7% of a
no-recompute step (bench/results/2026-11-26-s12-2xH200/call50). It computes in fp32 and
rounds once to ``t``'s dtype, where the eager bf16 version rounds after every operation: in
fp32 the two agree bitwise, in bf16 the fused one is the closer to the exact rotation
(tests/test_packed_rope.py). The angles, ``cos``/``sin`` of ``freqs[index]`` (fp32, times
``mscale``), are computed once per micro-batch and shared by every layer's query and key.
``DS_STPAR_FUSED_ROPE=0`` in the environment restores megatron-core's arithmetic on the
same block (for comparison).

Shapes: ``t`` [T, heads, d] (``thd`` squeezed), ``freqs`` [S, 1, 1, d] with ``S`` >= the
longest segment, ``index`` [T] int64 on ``t``'s device, ``cos``/``sin`` [T, 1, d] fp32;
out [T, heads, d].
"""

from __future__ import annotations

import os

import megatron.core.transformer.attention as megatron_attention
import torch
from megatron.core.models.common.embeddings import rope_utils
from torch import Tensor

_SEGMENT_INDEX = "_stpar_segment_index"
_ANGLES = "_stpar_rope_angles"
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


def rotate(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``t cos + rotate_half(t) sin`` in fp32, rounded once to ``t``'s dtype; ``t`` [T, h, d]
    (any strides), ``cos``/``sin`` [T, 1, d] fp32; rotate_half(x) = cat(-x[d/2:], x[:d/2])."""
    x = t.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(t.dtype)


_FUSED_ROTATE = torch.compile(rotate, dynamic=True)  # compiled on first use, on CUDA only


def fused_rope_enabled() -> bool:
    """The fused rotation is on unless ``DS_STPAR_FUSED_ROPE=0`` (module docstring)."""
    return os.environ.get("DS_STPAR_FUSED_ROPE", "1") != "0"


def angles(
    cu_seqlens: Tensor, index: Tensor, freqs: Tensor, mscale: float
) -> tuple[Tensor, Tensor]:
    """``cos``/``sin`` of ``freqs[index]`` times ``mscale``, [T, 1, d] fp32, computed once per
    micro-batch: kept on the marked ``cu_seqlens`` for the same ``freqs`` and ``mscale``."""
    cached = getattr(cu_seqlens, _ANGLES, None)
    if cached is not None and cached[0] is freqs and cached[1] == mscale:
        return cached[2], cached[3]
    with torch.no_grad():
        selected = freqs[index].float().squeeze(1)  # [T, 1, d]
        cos, sin = torch.cos(selected) * mscale, torch.sin(selected) * mscale
    setattr(cu_seqlens, _ANGLES, (freqs, mscale, cos, sin))
    return cos, sin


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
    mscale = kwargs.get("mscale", 1.0)
    whole = freqs.shape[-1] == t.shape[-1] and not config.rotary_interleaved
    if whole and fused_rope_enabled():
        cos, sin = angles(cu_seqlens, index, freqs, mscale)
        return (_FUSED_ROTATE if t.is_cuda else rotate)(t, cos, sin)
    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1),
        freqs[index],
        rotary_interleaved=config.rotary_interleaved,
        mscale=mscale,
    ).squeeze(1)


def install() -> None:
    """Route megatron-core attention's RoPE through :func:`apply_rotary_pos_emb`."""
    megatron_attention.apply_rotary_pos_emb = apply_rotary_pos_emb
