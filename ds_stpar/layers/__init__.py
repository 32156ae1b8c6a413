"""Spatial-temporal ("temporal-partition") linear layers and their communication patterns.

- :class:`TemporalColumnParallelLinear`, :class:`TemporalRowParallelLinear`: drop-ins for
  Megatron-core's ColumnParallelLinear / RowParallelLinear (``tp_mode`` "ring" or "cannon").
- ``comm``: batched-P2P patterns (ring shift, rotating accumulator, torus shifts, block
  exchange), each a differentiable function taking an explicit process group.
- ``interleave``: :class:`~ds_stpar.layers.interleave.InterleavedTransformerLayer`, a
  Megatron layer run in micro-batch pieces whose transfers (``async_comm``: started in one
  autograd node, finished in a later one) hide behind each other's compute; its linears run
  their local GEMMs (``local``). The spec's ``interleave=k`` selects it.
- ``megatron_weight_order`` / ``shard_offsets`` / ``take_block``: how a weight is sharded.
- :func:`apply_stpar` / :func:`full_state_dict`: shard a HuggingFace causal LM through its
  ``base_model_tp_plan`` and gather it back (``hf.py``).
"""

from ds_stpar.layers.comm import (
    ExchangePlan,
    Message,
    PendingP2P,
    TorusGrid,
    exchange,
    ring_all_gather,
    ring_pass,
    ring_reduce_scatter,
    ring_shift,
    start_p2p,
    torus_shift,
)
from ds_stpar.layers.hf import apply_stpar, full_state_dict
from ds_stpar.layers.linear import (
    TP_MODES,
    TemporalColumnParallelLinear,
    TemporalRowParallelLinear,
    megatron_weight_order,
    resolve_tp_group,
    shard_offsets,
    take_block,
)

__all__ = [
    "TP_MODES",
    "ExchangePlan",
    "Message",
    "PendingP2P",
    "TemporalColumnParallelLinear",
    "TemporalRowParallelLinear",
    "TorusGrid",
    "apply_stpar",
    "exchange",
    "full_state_dict",
    "megatron_weight_order",
    "resolve_tp_group",
    "ring_all_gather",
    "ring_pass",
    "ring_reduce_scatter",
    "ring_shift",
    "shard_offsets",
    "start_p2p",
    "take_block",
    "torus_shift",
]
