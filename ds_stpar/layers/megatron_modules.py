"""Megatron-core building blocks that the stock local spec lacks without Apex/TE.

- :class:`SDPACoreAttention` — core attention through ``torch.nn.functional.
  scaled_dot_product_attention``: flash/memory-efficient kernels on GPU (no [b, a, s, s]
  score tensor is kept, so activation memory loses Korthikanti's ``5as/h`` term), the math
  kernel on CPU. Packed rows (``PackedSeqParams`` with ``cu_seqlens_q``): no token attends
  across a document boundary. On GPU (bf16/fp16, no attention dropout) one variable-length
  flash kernel (``torch.nn.attention.varlen``) runs every document of the micro-batch; on CPU,
  or where that kernel is missing, documents are attended one at a time (one SDPA call each,
  the segment bounds read to the host once per micro-batch).
- :class:`StparSelfAttention` — Megatron's ``SelfAttention`` whose ring QKV linear makes the
  projection's weight gradient, after the attention's backward (``deferred_wgrad``).
- :class:`SequenceParallelNorm` — LayerNorm/RMSNorm that accepts ``sequence_parallel=True``.
  Megatron's ``WrappedTorchNorm`` refuses it. Under SP every TP rank normalises its own s/t
  tokens, so the norm weight gradient is a partial sum: the ``sequence_parallel`` attribute
  on the parameters makes Megatron's ``finalize_model_grads`` all-reduce it over TP. Its
  outputs carry their recipe (``norm_recipe``), so the ring's column passes and the interleaved
  layer's local GEMMs need not keep them.

Shapes follow Megatron: queries [s, b, heads/t, d], keys/values [s, b, groups/t, d], output
[s, b, heads/t * d].
"""

from __future__ import annotations

import inspect
import os

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from ds_stpar.layers.linear import TemporalColumnParallelLinear, TemporalRowParallelLinear
from ds_stpar.layers.norm_recipe import MarkedLayerNorm, MarkedRMSNorm
from ds_stpar.planner.memory import FLASH_HEAD_DIM_MULTIPLE


class SDPACoreAttention(MegatronModule):
    """Causal attention via SDPA; document-masked when given packed sequence params."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        **unused,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise ValueError("SDPACoreAttention does not implement context parallelism")
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention does not take an attention bias")
        if query.dim() == 3:  # qkv_format="thd": Megatron squeezed the batch of 1: [t, n, d]
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        seq, batch, heads, dim = query.shape
        # [s, b, n, d] -> [b, n, s, d]; GQA: SDPA broadcasts groups with enable_gqa
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout = self.dropout if self.training else 0.0
        gqa = k.shape[1] != heads
        if packed_seq_params is not None and varlen_usable(query, dropout):
            out = varlen_causal(q, k, v, packed_seq_params, self.softmax_scale)
        elif packed_seq_params is not None:
            bounds = host_bounds(packed_seq_params)
            parts = [
                F.scaled_dot_product_attention(
                    q[:, :, a:b],
                    k[:, :, a:b],
                    v[:, :, a:b],
                    dropout_p=dropout,
                    is_causal=True,
                    scale=self.softmax_scale,
                    enable_gqa=gqa,
                )
                for a, b in zip(bounds[:-1], bounds[1:])
                if b > a
            ]
            out = torch.cat(parts, dim=2)
        elif attention_mask is not None and self.attn_mask_type != AttnMaskType.causal:
            # Megatron masks are True where attention is NOT allowed; SDPA wants the opposite.
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=~attention_mask,
                dropout_p=dropout,
                scale=self.softmax_scale,
                enable_gqa=gqa,
            )
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=True, scale=self.softmax_scale, enable_gqa=gqa
            )
        return out.permute(2, 0, 1, 3).reshape(seq, batch, heads * dim)


def host_bounds(params: PackedSeqParams) -> list[int]:
    """``cu_seqlens_q`` as a Python list, read once per micro-batch: every layer gets the same
    ``params`` object, and reading a GPU tensor on the host waits for the GPU, which would
    stall the kernel queue once per layer."""
    bounds = getattr(params, "_stpar_host_bounds", None)
    if bounds is None:
        bounds = params.cu_seqlens_q.tolist()
        params._stpar_host_bounds = bounds
    return bounds


def _varlen_kernel():
    """PyTorch's variable-length flash attention (``torch.nn.attention.varlen``), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


VARLEN_ATTN = _varlen_kernel()
VARLEN_PARAMS = set(inspect.signature(VARLEN_ATTN).parameters) if VARLEN_ATTN else set()


def varlen_usable(query: Tensor, dropout: float) -> bool:
    """One varlen flash kernel for all segments: CUDA bf16/fp16, batch 1 (Megatron's ``thd``
    rows flattened), no attention dropout (the kernel has none); ``DS_STPAR_VARLEN=0`` in the
    environment turns it off (the per-document path, for comparison)."""
    return (
        VARLEN_ATTN is not None
        and os.environ.get("DS_STPAR_VARLEN", "1") != "0"
        and query.is_cuda
        and query.dtype in (torch.bfloat16, torch.float16)
        and query.shape[1] == 1
        and dropout == 0.0
    )


def varlen_causal(
    q: Tensor, k: Tensor, v: Tensor, params: PackedSeqParams, scale: float | None
) -> Tensor:
    """Causal attention inside each ``cu_seqlens`` segment in one kernel.

    ``q`` [1, n, t, d], ``k``/``v`` [1, g, t, d] (the ``[b, heads, s, d]`` view of the caller)
    -> [1, n, t, d]. The kernel takes [t, heads, d]; GQA groups are repeated when this
    PyTorch's kernel does not broadcast them itself. The flash kernel needs d to be a multiple
    of 8: other head dims (OpenLLaMA-3B's 100) are zero-padded to the next multiple, which
    leaves q.k and the output's first d columns unchanged, with the scale fixed to the real
    d's 1/sqrt(d) (the kernel's default would use the padded one)."""
    dim = q.shape[-1]
    pad = -dim % FLASH_HEAD_DIM_MULTIPLE
    if pad:
        q, k, v = (F.pad(x, (0, pad)) for x in (q, k, v))
    qt, kt, vt = (x[0].transpose(0, 1) for x in (q, k, v))  # [t, heads, d]
    heads, groups = qt.shape[1], kt.shape[1]
    kwargs = {"scale": scale if scale is not None else dim**-0.5}
    if groups != heads:
        if "enable_gqa" in VARLEN_PARAMS:
            kwargs["enable_gqa"] = True
        else:
            kt, vt = (x.repeat_interleave(heads // groups, dim=1) for x in (kt, vt))
    if "window_size" in VARLEN_PARAMS:
        kwargs["window_size"] = (-1, 0)  # causal
    else:
        kwargs["is_causal"] = True
    cu = params.cu_seqlens_q.to(torch.int32)
    longest = params.max_seqlen_q
    if not longest:
        bounds = host_bounds(params)
        longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    longest = int(longest)
    out = VARLEN_ATTN(qt, kt, vt, cu, cu, longest, longest, **kwargs)
    return out[..., :dim].transpose(0, 1).unsqueeze(0)


class StparSelfAttention(SelfAttention):
    """Megatron's self-attention, unchanged but for one link: when QKV and projection are
    ring layers and the layer has no hidden dropout, the QKV linear's backward makes the
    projection's weight gradient where that costs no memory (P = 2, hops by the copy engines;
    ``deferred_wgrad``), which lowers the layer's peak inside the attention's backward by
    that gradient. With hidden dropout the projection's output gradient is a tensor of its
    own (the dropout's mask applied), not the residual stream's, and keeping it would cost
    what the deferral saves: no link."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        qkv, proj = self.linear_qkv, self.linear_proj
        if (
            isinstance(qkv, TemporalColumnParallelLinear)
            and isinstance(proj, TemporalRowParallelLinear)
            and qkv.tp_mode == proj.tp_mode == "ring"
            and self.config.hidden_dropout == 0
        ):
            qkv.defer_weight_grad_of(proj)


class SequenceParallelNorm:
    """``config.normalization`` (LayerNorm or RMSNorm) over the last dim, SP-aware.

    Like Megatron's ``WrappedTorchNorm`` it returns a torch norm (so parameter names match
    the local spec: ``input_layernorm.weight``), but it accepts sequence parallelism. The norm
    marks its outputs with their recipe (``norm_recipe``): the ring's column linears and MLPs
    and the interleaved layer's local GEMMs keep the norm's input instead and make the output
    again in their backward.
    """

    def __new__(
        cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused
    ) -> torch.nn.Module:
        if config.normalization == "LayerNorm":
            norm = MarkedLayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "RMSNorm":
            norm = MarkedRMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"unsupported normalization {config.normalization!r}")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
