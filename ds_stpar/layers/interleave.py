"""A transformer layer that runs two halves of its micro-batch interleaved, each half's
tensor-parallel transfers hidden behind the other half's compute.

Why. At P = 2 a ring pass has one hop, and within one layer every transfer depends on the
compute just before it and feeds the compute just after: the attention's output reduction
can only hide behind the projection GEMM that makes it, the MLP's input gather behind fc1's
own-chunk rows. Over a slow link, where a hop outlasts those GEMMs several times, most of it
stays exposed (BENCHMARKS.md: the ring layer ran 1.06-1.11x Megatron TP+SP over host memory,
the no-communication limit is 1.4-2.2x). Two halves of the batch are independent all the way
through the layer, so one half's transfer can run beside the other half's attention or MLP.

What runs. The input ``[s/P, b, h]`` (Megatron's sequence-parallel layout, as every ring layer)
is cut along the batch into A and B, ``[s/P, b/2, h]`` each. ``gather``/``reduce`` are the
transfers of :mod:`ds_stpar.layers.async_comm` (started in one line, finished in a later
one); the attention and the MLP are this layer's own submodules with their linears in
``local_compute`` mode, so they run only this rank's GEMMs. The layer issues, in order::

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

Every transfer hides behind the other half's attention or MLP but the first gather and the
last reduction. The small work between A's two transfers in the middle runs on the P2P
stream, so A's gather for the MLP leaves while B's attention computes instead of after it:
on the compute stream it would queue behind B's attention and leave two transfers exposed
back to back. The P2P stream is the one every hop is issued on, which orders each transfer
after the work that feeds it. The backward mirrors all of it (autograd runs the newest ready
node first and each node on its forward's stream; see ``async_comm``).

Communication volume per layer is Megatron TP+SP's less the backward's two re-gathers (the
column GEMMs keep the gathered input: (P-1)/P of the activation more memory per column than
the ring layer's own chunk); the MLP saves fc1's output only, recomputing the activation
(``StparMLP``), as the fused ring MLP.

When it runs: TP group of P > 1, batch even, training or not, no packed sequences (a packed
micro-batch is one row), no inference context, cross-attention, recompute of the norms or the
MLP, or activation offloading, and row linears that leave their bias to the caller (Megatron's
projection and fc2 do). Otherwise the layer is Megatron's ``TransformerLayer`` over the ring
linears (same weights, same function).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor
from torch import Tensor

from ds_stpar.layers.async_comm import (
    gather_finish,
    gather_start,
    on_p2p_stream,
    reduce_scatter_finish,
    reduce_scatter_start,
)
from ds_stpar.layers.linear import TemporalColumnParallelLinear, _TemporalLinear

HALVES = 2
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
    """Megatron's ``TransformerLayer`` whose forward interleaves two batch halves (module
    docstring); same submodules, parameters and checkpoint as the ring layer."""

    def _tp_group(self):
        qkv = self.self_attention.linear_qkv
        return qkv.tp_group if isinstance(qkv, TemporalColumnParallelLinear) else None

    def interleaves(self, hidden_states: Tensor, kwargs: dict) -> bool:
        """Whether this call takes the interleaved path (module docstring)."""
        group = self._tp_group()
        rows_linears = (self.self_attention.linear_proj, self.mlp.linear_fc2)
        unsupported = ("context", "inference_context", "packed_seq_params", "attention_bias")
        return (
            group is not None
            and group.size() > 1
            and hidden_states.shape[1] % HALVES == 0
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

    def forward(self, hidden_states: Tensor, *args, **kwargs):
        if args or not self.interleaves(hidden_states, kwargs):
            return super().forward(hidden_states, *args, **kwargs)
        kwargs.pop("dynamic_inference_decode_only", None)
        group = self._tp_group()
        mask_a, mask_b = _split_mask(kwargs.pop("attention_mask", None), hidden_states.shape[1])
        extra = {name: kwargs[name] for name in ATTENTION_KWARGS if kwargs.get(name) is not None}
        x_a, x_b = hidden_states.chunk(HALVES, dim=1)
        gather_a = gather_start(self.input_layernorm(x_a), group)
        gather_b = gather_start(self.input_layernorm(x_b), group)
        attention_a = self._attention(gather_a, mask_a, extra)
        reduce_a = reduce_scatter_start(attention_a[0], group), attention_a[1]
        attention_b = self._attention(gather_b, mask_b, extra)
        middle_a, gather_a = self._attention_tail(reduce_a, x_a, group)
        reduce_b = reduce_scatter_start(attention_b[0], group), attention_b[1]
        mlp_a = self._mlp(gather_a)
        middle_b, gather_b = self._attention_tail(reduce_b, x_b, group)
        reduce_a = reduce_scatter_start(mlp_a[0], group), mlp_a[1]
        mlp_b = self._mlp(gather_b)
        reduce_b = reduce_scatter_start(mlp_b[0], group), mlp_b[1]
        output = torch.cat(
            (self._mlp_tail(reduce_a, middle_a), self._mlp_tail(reduce_b, middle_b)), 1
        )
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


def _split_mask(mask: Tensor | None, batch: int) -> list[Tensor | None]:
    """The attention mask per half: one shared by the batch (dim 0 of 1) goes to both."""
    if mask is None or mask.shape[0] == 1:
        return [mask] * HALVES
    if mask.shape[0] != batch:
        raise ValueError(f"attention mask of batch {mask.shape[0]} for a batch of {batch}")
    return list(mask.chunk(HALVES, dim=0))
