"""The dist-checkpoint view of a Cannon GLU fc1 in Megatron's format.

Megatron's checkpoint of a gated fc1 (``gated_linear_unit``: SwiGLU, GeGLU) holds the natural
weight ``[gate; up]`` ``[2f, h]`` (gate rows 0..f, up rows f..2f). Each TP rank holds the
interleaved shard ``[gate_d; up_d]`` (stride 2), and ``MLP.sharded_state_dict`` passes it
through ``apply_swiglu_sharded_factory``, which assumes that row split: it saves the two
halves as ``gate`` block d and ``up`` block d of P.

A Cannon rank (r, c) holds a two-dimensional block of the interleaved W'
(``layers/cannon.py``): rows NB_c (the q shards ``cq .. cq+q-1``), columns
KB_k with k = (r+c) % q::

    local [2f/q, h/q] = [gate_cq; up_cq; gate_cq+1; up_cq+1; ...][:, KB_k]
                      = view [q, 2, f/P, h/q]: [:, 0] -> gate rows block c of q (f/q rows)
                                               [:, 1] -> up rows block c of q

Megatron's factory keeps only the axis-0 offset and halves the local block, so its global
shape and offsets come out wrong. :func:`cannon_glu_factory` (which
:class:`~ds_stpar.layers.mlp.StparMLP` gives fc1's weight) saves the gate and up parts of the
block at their places in ``[gate; up]`` (axis 0: blocks c and q + c of 2q; axis 1: block k of
q) and re-interleaves them on load. The global tensor is the
one Megatron and the ring write, so checkpoints move between Megatron TP, ring and Cannon.
The fc1 bias ``[2f/P]`` is Megatron's shard in every mode and keeps Megatron's factory.
"""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from torch import Tensor

Offsets = tuple[tuple[int, int, int], ...]


def _split_glu(block: Tensor, q: int) -> tuple[Tensor, Tensor]:
    """[2f/q, K] Cannon block -> its (gate [f/q, K], up [f/q, K]) rows, in natural order."""
    pairs = block.reshape(q, 2, -1, block.shape[-1])
    return pairs[:, 0].reshape(-1, block.shape[-1]), pairs[:, 1].reshape(-1, block.shape[-1])


def _join_glu(gate: Tensor, up: Tensor, q: int) -> Tensor:
    """Inverse of :func:`_split_glu`."""
    k = gate.shape[-1]
    pairs = torch.stack((gate.reshape(q, -1, k), up.reshape(q, -1, k)), dim=1)
    return pairs.reshape(-1, k)


def cannon_glu_factory(
    weight: ShardedTensor,
    shard_offsets: Offsets,
    sharded_offsets: tuple = (),
    singleton_local_shards: bool = False,
) -> ShardedTensorFactory:
    """The checkpoint view of a Cannon GLU fc1 weight block (see the module docstring).

    ``weight``: the layer's own ShardedTensor of its block of W'; ``shard_offsets``: the
    layer's ``((0, c, q), (1, k, q))``; ``sharded_offsets``: the prepended axes (layer
    index) as Megatron passes them. With ``singleton_local_shards`` gate and up are saved as
    two tensors ``<key>_w`` and ``<key>_v`` of ``[f, h]`` each, as Megatron's factory does.
    """
    (_, c, q), (_, k, _) = shard_offsets
    prepend = len(sharded_offsets)
    columns = (prepend + 1, k, q)

    @torch.no_grad()
    def build(key: str, data: Tensor, replica_id, flattened_range) -> list[ShardedTensor]:
        gate, up = _split_glu(data, q)
        if singleton_local_shards:
            parts = ((f"{key}_w", gate, (prepend, c, q)), (f"{key}_v", up, (prepend, c, q)))
        else:
            parts = ((key, gate, (prepend, c, 2 * q)), (key, up, (prepend, q + c, 2 * q)))
        return [
            ShardedTensor.from_rank_offsets(
                name,
                part,
                *sharded_offsets,
                rows,
                columns,
                replica_id=replica_id,
                prepend_axis_num=prepend,
            )
            for name, part, rows in parts
        ]

    @torch.no_grad()
    def merge(loaded: list[Tensor]) -> Tensor:
        return _join_glu(loaded[0], loaded[1], q)

    return ShardedTensorFactory(
        weight.key,
        weight.data,
        build,
        merge,
        weight.replica_id,
        flattened_range=weight.flattened_range,
    )
