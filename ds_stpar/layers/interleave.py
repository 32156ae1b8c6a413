"""A transformer layer that runs pieces of its micro-batch interleaved, each piece's
tensor-parallel transfers hidden behind the other pieces' compute.

Why. At P = 2 a ring pass has one hop, and within one layer every transfer depends on the
compute just before it and feeds the compute just after: the attention's output reduction
can only hide behind the projection GEMM that makes it, the MLP's input gather behind fc1's
own-chunk rows. Over a slow link, where a hop outlasts those GEMMs several times, most of it
stays exposed (BENCHMARKS.md: the ring layer ran 1.06-1.11x Megatron TP+SP over host memory,
the no-communication limit is 1.4-2.2x). The sequences of a batch are independent all the way
through the layer, so one piece's transfer can run beside another piece's attention or MLP.

What runs. The input ``[s/P, b, h]`` (Megatron's sequence-parallel layout, as every ring layer)
is cut along the batch into k pieces ``[s/P, b/k, h]``. ``gather``/``reduce`` are the
transfers of :mod:`ds_stpar.layers.async_comm` (started in one line, finished in a later
one); the attention and the MLP are this layer's own submodules with their linears in
``local_compute`` mode, so they run only this rank's GEMMs. For k = 2 (pieces A, B) the layer
issues, in order::

    norm1(A), start gather A;  norm1(B), start gather B
    finish gather A, attention(A), start reduce A           (gather B travels)
    finish gather B, attention(B)                           (reduce A travels)
      on the P2P stream: finish reduce A, + residual, norm2, start gather A'
    start reduce B
    finish gather A', MLP(A')                               (reduce B travels)
      on the P2P stream: finish reduce B, + residual, norm2, start gather B'
    start reduce A'
    finish gather B', MLP(B'), start reduce B'              (reduce A' travels)
    finish reduce A', + residual;  finish reduce B', + residual;  output = [A; B]

and for larger k the same software pipeline: piece i's tail (the middle line) goes behind
piece i+1's attention, the last piece's behind the first piece's MLP. Every transfer but the
first gather and the last reduction can hide behind another piece's attention or MLP. The
tails run on the P2P stream, so a piece's gather for the MLP leaves while the next piece's
attention computes instead of queueing behind it. The backward mirrors all of it (autograd
runs the newest ready node first and each node on its forward's stream; see ``async_comm``).

Communication volume per layer is Megatron TP+SP's less the backward's two re-gathers (the
column GEMMs keep the gathered input: (P-1)/P of the activation more memory per column than
the ring layer's own chunk); the MLP saves fc1's output only, recomputing the activation
(``StparMLP``), as the fused ring MLP.

When it runs: TP group of P > 1, a batch the pieces divide (else gcd(batch, k) pieces; one:
Megatron's forward), training or not, no packed sequences (a packed micro-batch is one row),
no inference context, cross-attention, recompute of the norms or the MLP, or activation
offloading, and row linears that leave their bias to the caller (Megatron's projection and
fc2 do). Otherwise the layer is Megatron's ``TransformerLayer`` over the ring linears (same
weights, same function).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor
from torch import Tensor

from ds_stpar.errors import ConfigError
from ds_stpar.layers.async_comm import (
    gather_finish,
    gather_start,
    on_p2p_stream,
    reduce_scatter_finish,
    reduce_scatter_start,
)
from ds_stpar.layers.linear import TemporalColumnParallelLinear, _TemporalLinear

ATTENTION_KWARGS = (
    "rotary_pos_emb",
    "rotary_pos_cos",
    "rotary_pos_sin",
    "rotary_pos_cos_sin",
    "sequence_len_offset",
)


@contextmanager
def local_compute(*modules: torch.nn.Module):
    """Every temporal linear inside ``modules`` runs only its local GEMM while the block runs."""
    linears = [m for module in modules for m in module.modules() if isinstance(m, _TemporalLinear)]
    for linear in linears:
        linear.local_compute = True
    try:
        yield
    finally:
        for linear in linears:
            linear.local_compute = False


class InterleavedTransformerLayer(TransformerLayer):
    """Megatron's ``TransformerLayer`` whose forward interleaves pieces of the batch (module
    docstring); same submodules, parameters and checkpoint as the ring layer.

    ``pieces``: how many (2, 4, ...); a call whose batch it does not divide takes gcd(batch,
    pieces) pieces, and Megatron's forward when that is 1.
    """

    def __init__(self, *args, pieces: int = 2, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if pieces < 2:
            raise ConfigError(f"an interleaved layer needs pieces >= 2, got {pieces}")
        self.pieces = pieces

    def _tp_group(self):
        qkv = self.self_attention.linear_qkv
        return qkv.tp_group if isinstance(qkv, TemporalColumnParallelLinear) else None

    def pieces_for(self, hidden_states: Tensor, kwargs: dict) -> int:
        """How many pieces this call runs in; 1: Megatron's forward (module docstring)."""
        group = self._tp_group()
        rows_linears = (self.self_attention.linear_proj, self.mlp.linear_fc2)
        unsupported = ("context", "inference_context", "packed_seq_params", "attention_bias")
        supported = (
            group is not None
            and group.size() > 1
            and not any(kwargs.get(name) is not None for name in unsupported)
            and kwargs.get("inference_params") is None
            and isinstance(self.pre_cross_attn_layernorm, IdentityOp)
            and not self.recompute_input_layernorm
            and not self.recompute_pre_mlp_layernorm
            and not self.recompute_mlp
            and not self.offload_attn_norm
            and not self.offload_mlp_norm
            and all(
                isinstance(m, _TemporalLinear) and (m.bias is None or m.skip_bias_add)
                for m in rows_linears
            )
        )
        return math.gcd(hidden_states.shape[1], self.pieces) if supported else 1

    def forward(self, hidden_states: Tensor, *args, **kwargs):
        count = 1 if args else self.pieces_for(hidden_states, kwargs)
        if count == 1:
            return super().forward(hidden_states, *args, **kwargs)
        kwargs.pop("dynamic_inference_decode_only", None)
        group = self._tp_group()
        masks = _split_mask(kwargs.pop("attention_mask", None), hidden_states.shape[1], count)
        extra = {name: kwargs[name] for name in ATTENTION_KWARGS if kwargs.get(name) is not None}
        inputs = hidden_states.chunk(count, dim=1)
        gathers = [gather_start(self.input_layernorm(x), group) for x in inputs]
        reduces, middles = [], [None] * count
        for i in range(count):
            out, bias = self._attention(gathers[i], masks[i], extra)
            if i > 0:  # the previous piece's tail, behind this piece's attention
                middles[i - 1], gathers[i - 1] = self._attention_tail(
                    reduces[i - 1], inputs[i - 1], group
                )
            reduces.append((reduce_scatter_start(out, group), bias))
        for i in range(count):
            out, bias = self._mlp(gathers[i])
            if i == 0:  # the last piece's tail, behind the first piece's MLP
                middles[-1], gathers[-1] = self._attention_tail(reduces[-1], inputs[-1], group)
            reduces[i] = reduce_scatter_start(out, group), bias
        outputs = [self._mlp_tail(r, middle) for r, middle in zip(reduces, middles, strict=True)]
        output = torch.cat(outputs, dim=1)
        output = make_viewless_tensor(
            inp=output, requires_grad=output.requires_grad, keep_graph=True
        )
        return output, None

    def _attention(self, gather, mask: Tensor | None, extra: dict) -> tuple[Tensor, Tensor | None]:
        """This rank's term of the attention block's output, ``[s, b/2, h]``, and its bias."""
        with local_compute(self.self_attention):
            return self.self_attention(gather_finish(*gather), attention_mask=mask, **extra)

    def _mlp(self, gather) -> tuple[Tensor, Tensor | None]:
        """This rank's term of the MLP's output, ``[s, b/2, h]``, and fc2's bias."""
        with local_compute(self.mlp):
            return self.mlp(gather_finish(*gather))

    def _attention_tail(self, reduce, residual: Tensor, group):
        """Finish the attention's reduction, add the residual, normalise and start the MLP's
        gather, all on the P2P stream: the compute stream runs the other half meanwhile and
        the gather leaves as soon as the reduction lands. Returns (residual stream, gather)."""
        (token, transfer), bias = reduce
        with on_p2p_stream(residual.device):
            with self.bias_dropout_add_exec_handler():
                middle = self.self_attn_bda(self.training, self.config.bias_dropout_fusion)(
                    (reduce_scatter_finish(token, transfer), bias), residual, self.hidden_dropout
                )
            gather = gather_start(self.pre_mlp_layernorm(middle), group)
        if middle.is_cuda:  # made on the side stream, used on the compute stream
            middle.record_stream(torch.cuda.current_stream(middle.device))
        return middle, gather

    def _mlp_tail(self, reduce, residual: Tensor) -> Tensor:
        (token, transfer), bias = reduce
        with self.bias_dropout_add_exec_handler():
            return self.mlp_bda(self.training, self.config.bias_dropout_fusion)(
                (reduce_scatter_finish(token, transfer), bias), residual, self.hidden_dropout
            )


def _split_mask(mask: Tensor | None, batch: int, count: int) -> list[Tensor | None]:
    """The attention mask per piece: one shared by the batch (dim 0 of 1) goes to all."""
    if mask is None or mask.shape[0] == 1:
        return [mask] * count
    if mask.shape[0] != batch:
        raise ValueError(f"attention mask of batch {mask.shape[0]} for a batch of {batch}")
    return list(mask.chunk(count, dim=0))
