"""Which pieces of each full (logical) parameter a rank holds under a layout.

A parameter has one full tensor. Under a :class:`~ds_stpar.config.Layout` every rank of the
owning pipeline stage(s) holds some boxes of it, packed into one local tensor. A box is a
region of the full tensor, ``((start, stop), ...)`` per dim; a :class:`Piece` says where the
box's first element sits in the local tensor. Rank coordinates follow ``Layout.coords``:
``rank = (dp_index * pp + pp_index) * tp + tp_index``.

Tensor-parallel sharding is the layers' own rule (``ds_stpar.layers.linear``), computed with
their helpers so the two cannot drift. Along ``partition_dim`` the full tensor is first put in
Megatron order, ``W' = megatron_weight_order(full, partition_dim, tp, stride)`` (dim of length n
cut into ``tp * stride`` chunks of ``n/(tp*stride)``; TP rank t's Megatron shard is chunks
``t, t + tp, ..., t + (stride-1)*tp`` stacked in that order, and W' concatenates the shards in
rank order); the local tensor is ``take_block(W', offsets)``:

* not ``tensor_model_parallel``: every TP rank holds the whole tensor.
* ``tensor_model_parallel`` (tp_mode megatron or ring; under cannon every parameter without
  ``cannon_blocks``: embeddings, column biases): ``offsets = ((partition_dim, t, tp),)``,
  Megatron's shard. With ``stride=2`` (GLU fc1, full tensor ``[gate; up]``) rank t holds
  ``[gate_t; up_t]``.
* ``cannon_blocks`` (a 2-D weight [out, in] = [N, K] of a temporal linear) under tp_mode
  cannon (tp = q*q, TP rank t = r*q + c): ``offsets = cannon_weight_offsets(t, tp)``, the
  pre-skewed home block ``W'[NB_c, KB_(r+c)%q]`` (``layers/cannon.py``). Along
  ``partition_dim`` the block is the q consecutive Megatron shards ``cq .. cq+q-1``, so with
  stride 2 (fc1, q = 2) rank (r, 0) holds rows ``[gate_0; up_0; gate_1; up_1]``, not
  ``[gate_0 gate_1; up_0 up_1]``. The Cannon column bias is [N/P], Megatron's shard (the
  previous bullet), added to the column output after its re-layout.

A piece is a maximal run of consecutive full-tensor indices per dim of the local block.

Pipeline ownership: a parameter of transformer layer ``layer`` lives on the stage that runs
that layer (``config.stage_layers``; with interleaving, model chunk ``layer // vpp_layers``
on stage ``chunk % pp``); parameters outside the blocks name their stages: "first"
(embeddings), "last" (final norm, untied LM head), "first+last" (tied word embeddings: Megatron
keeps a copy on both ends), "all".

Gradient copies. Before any reduction, the copies of one region that a layout holds are
either *partial* sums (to be added) or *identical* (computed redundantly). Copies in different
DP replicas are partial; copies on different pipeline stages (tied embeddings) are partial;
copies on different TP ranks are partial when the parameter is ``sequence_parallel_grad``
(Megatron's ``sequence_parallel`` attribute: norms and row biases under sequence parallelism)
and the strategy runs sequence parallel, identical otherwise.
:func:`grad_class` names the class of a copy: one class = one partial sum; its members hold
identical values.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ds_stpar.config import Layout, ModelSpec, Strategy, stage_layers
from ds_stpar.errors import ConfigError
from ds_stpar.layers.linear import Offsets, megatron_weight_order, shard_offsets, take_block

Box = tuple[tuple[int, int], ...]
STAGES = ("first", "last", "first+last", "all")


@dataclass(frozen=True)
class Piece:
    """Box ``box`` of the full tensor sits at ``offset`` (per-dim start) in the local tensor."""

    box: Box
    offset: tuple[int, ...]

    def local_slices(self, sub: Box) -> tuple[slice, ...]:
        """Local-tensor slices of ``sub``, a box inside ``self.box``."""
        return tuple(
            slice(o + a - b0, o + b - b0) for (a, b), (b0, _), o in zip(sub, self.box, self.offset)
        )

    def contains(self, sub: Box) -> bool:
        return all(b0 <= a and b <= b1 for (a, b), (b0, b1) in zip(sub, self.box))


def box_numel(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common region of two boxes, or None when they do not overlap."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: full shape, TP attributes (Megatron's names), placement over stages.

    ``cannon_blocks``: a 2-D [out, in] weight of a temporal linear, held as a Cannon block
    under tp_mode cannon (module docstring). ``layer``: global transformer-layer index
    (0-based) or None for parameters outside the blocks, whose stages ``stages`` names (one of
    :data:`STAGES`).
    """

    shape: tuple[int, ...]
    tensor_model_parallel: bool = False
    partition_dim: int = 0
    partition_stride: int = 1
    sequence_parallel_grad: bool = False
    cannon_blocks: bool = False
    layer: int | None = None
    stages: str = "all"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        if not self.shape or any(n < 1 for n in self.shape):
            raise ConfigError(f"parameter shape must be non-empty and positive, got {self.shape}")
        if self.tensor_model_parallel and not 0 <= self.partition_dim < len(self.shape):
            raise ConfigError(
                f"partition_dim {self.partition_dim} outside a {len(self.shape)}-d parameter"
            )
        if self.partition_stride < 1:
            raise ConfigError(f"partition_stride must be >= 1, got {self.partition_stride}")
        if self.cannon_blocks and len(self.shape) != 2:
            raise ConfigError(
                f"cannon_blocks describes a 2-d [out, in] weight, got shape {self.shape} (a "
                "Cannon layer's column bias is Megatron's shard: drop cannon_blocks)"
            )
        if self.layer is not None and self.layer < 0:
            raise ConfigError(f"layer index must be >= 0, got {self.layer}")
        if self.layer is None and self.stages not in STAGES:
            raise ConfigError(f"stages must be one of {STAGES}, got {self.stages!r}")

    @classmethod
    def from_param(
        cls, param: Any, layout: Layout, *, layer: int | None = None, stages: str = "all"
    ) -> ParamSpec:
        """Read Megatron's TP attributes and the temporal layers' ``stpar_tp_mode`` /
        ``stpar_shard_offsets`` from a local parameter of ``layout``; infer the full shape.

        A temporal linear's weight (it carries ``stpar_tp_mode``, ring or cannon) is a Cannon
        block weight (``cannon_blocks``; an explicit ``cannon_blocks`` attribute overrides).
        The full shape is the local one times the block counts of the layout's offsets
        (local x tp along ``partition_dim``, or local x q along both dims for Cannon blocks);
        a weight whose ``stpar_shard_offsets`` count other blocks was built for another
        layout. Vocabulary padding must already be common to every layout: full shapes are
        compared across layouts. Caveat: a Megatron layer's weight (tp_mode megatron) carries
        no ``stpar_tp_mode``, so read Cannon-ness from a ring or Cannon model's parameter."""
        tmp = bool(getattr(param, "tensor_model_parallel", False))
        dim = int(getattr(param, "partition_dim", 0))
        stride = int(getattr(param, "partition_stride", 1))
        blocks = bool(getattr(param, "cannon_blocks", hasattr(param, "stpar_tp_mode")))
        shape = list(param.shape)
        if tmp:
            offsets = _offsets(len(shape), dim, blocks, layout.tp, layout.tp_mode, 0)
            held = getattr(param, "stpar_shard_offsets", None)
            if held is not None and _cuts(held) != _cuts(offsets):
                raise ConfigError(
                    f"a parameter sharded as {held} (blocks of the Megatron-ordered weight) "
                    f"is not one of layout {layout.short()}: pass the layout its model was "
                    "built for"
                )
            for axis, _, parts in offsets:
                shape[axis] *= parts
        return cls(
            shape=tuple(shape),
            tensor_model_parallel=tmp,
            partition_dim=dim,
            partition_stride=stride,
            sequence_parallel_grad=bool(getattr(param, "sequence_parallel", False)),
            cannon_blocks=blocks and len(shape) == 2,
            layer=layer,
            stages=stages,
        )


@dataclass(frozen=True)
class Placement:
    """A layout plus what placing parameters needs from its strategy: the stage of every
    transformer layer and whether TP copies of sequence-parallel parameters hold partial
    gradients (sequence parallel is on for ``strategy.sequence_parallel`` and always for ring
    and Cannon TP, whose activations are token-sharded: see ``integrations/megatron.py``)."""

    layout: Layout
    layer_stages: tuple[int, ...]
    sequence_parallel: bool

    @classmethod
    def of(cls, strategy: Strategy | Layout, num_layers: int) -> Placement:
        if isinstance(strategy, Layout):
            strategy = Strategy(strategy)
        layout = strategy.layout
        if layout.pp == 1 or num_layers == 0:
            stages = (0,) * num_layers
        elif strategy.vpp_layers:
            if strategy.first_stage_layers or strategy.last_stage_layers:
                raise ConfigError("interleaved stages (vpp_layers) with uneven first/last stages")
            if num_layers % (strategy.vpp_layers * layout.pp):
                raise ConfigError(
                    f"num_layers {num_layers} is not a multiple of vpp_layers "
                    f"{strategy.vpp_layers} x pp {layout.pp}"
                )
            stages = tuple((i // strategy.vpp_layers) % layout.pp for i in range(num_layers))
        else:
            counts = stage_layers(num_layers, strategy)
            stages = tuple(s for s, n in enumerate(counts) for _ in range(n))
        sp = strategy.sequence_parallel or (layout.tp > 1 and layout.tp_mode != "megatron")
        return cls(layout, stages, sp and layout.tp > 1)


def described_layers(specs: Mapping[str, ParamSpec]) -> int:
    """Transformer layers the descriptors place (one past the highest layer index; 0 for
    none)."""
    return 1 + max((s.layer for s in specs.values() if s.layer is not None), default=-1)


def param_stages(spec: ParamSpec, placement: Placement) -> tuple[int, ...]:
    """Pipeline stages holding ``spec`` under ``placement``."""
    pp = placement.layout.pp
    if spec.layer is not None:
        if spec.layer >= len(placement.layer_stages):
            raise ConfigError(
                f"layer {spec.layer} outside a model of {len(placement.layer_stages)} layers"
            )
        return (placement.layer_stages[spec.layer],)
    return {
        "first": (0,),
        "last": (pp - 1,),
        "first+last": tuple(sorted({0, pp - 1})),
        "all": tuple(range(pp)),
    }[spec.stages]


def _offsets(ndim: int, partition_dim: int, blocks: bool, tp: int, mode: str, t: int) -> Offsets:
    """``linear.shard_offsets`` of TP rank ``t``: a 2-D Cannon block weight under cannon,
    Megatron's shard (the ring layers' and Megatron's own) otherwise."""
    cannon = mode == "cannon" and blocks and ndim == 2
    return shard_offsets("cannon" if cannon else "ring", partition_dim, t, tp)


def _cuts(offsets: Offsets) -> list[tuple[int, int]]:
    """(axis, parts) of the axes ``offsets`` actually cut."""
    return [(axis, parts) for axis, _, parts in offsets if parts > 1]


def _axis_runs(n: int, order: tuple[int, int] | None, blocks: Offsets, what: str) -> list[tuple]:
    """[(start, stop, local_start)]: the maximal runs of consecutive full indices along one
    dim of length n in the local block. ``order``: (tp, stride) when this is the partition
    dim (Megatron order first); ``blocks``: this dim's (0, index, parts) offsets."""
    need = math.prod(parts for _, _, parts in blocks)
    if order is not None:
        need = math.lcm(need, order[0] * order[1])
    if n % need:
        cut = f"{order[0]} ranks x stride {order[1]}" if order else f"{need} Cannon blocks"
        raise ConfigError(
            f"{what}: length {n} is not divisible by {cut}; pad it (e.g. the vocabulary) to a "
            "multiple of every layout's TP degree"
        )
    index = torch.arange(n)
    if order is not None:
        index = megatron_weight_order(index, 0, *order)
    index = take_block(index, blocks)
    breaks = (torch.nonzero(index[1:] != index[:-1] + 1).flatten() + 1).tolist()
    starts, stops = [0, *breaks], [*breaks, len(index)]
    return [(int(index[a]), int(index[b - 1]) + 1, a) for a, b in zip(starts, stops)]


def tp_pieces(spec: ParamSpec, layout: Layout, tp_index: int) -> tuple[Piece, ...]:
    """Pieces held by TP rank ``tp_index`` of ``layout`` (ignoring pipeline ownership)."""
    return _tp_pieces(
        spec.shape,
        spec.tensor_model_parallel,
        spec.partition_dim,
        spec.partition_stride,
        spec.cannon_blocks,
        layout.tp,
        layout.tp_mode,
        tp_index,
    )


@functools.lru_cache(maxsize=4096)
def _tp_pieces(shape, tensor_parallel, partition_dim, stride, cannon_blocks, tp, mode, tp_index):
    if not tensor_parallel or tp == 1:
        return (Piece(tuple((0, n) for n in shape), (0,) * len(shape)),)
    offsets = _offsets(len(shape), partition_dim, cannon_blocks, tp, mode, tp_index)
    per_dim = [
        _axis_runs(
            n,
            (tp, stride) if d == partition_dim else None,
            tuple((0, index, parts) for axis, index, parts in offsets if axis == d),
            f"parameter of shape {shape}, dim {d}",
        )
        for d, n in enumerate(shape)
    ]
    pieces = [((), ())]
    for chunks in per_dim:
        pieces = [(box + ((a, b),), off + (o,)) for box, off in pieces for a, b, o in chunks]
    return tuple(Piece(box, off) for box, off in pieces)


def local_shape(spec: ParamSpec, layout: Layout) -> tuple[int, ...]:
    """Shape of every holder's local tensor (the same on all TP ranks)."""
    pieces = tp_pieces(spec, layout, 0)
    return tuple(
        max(p.offset[d] + p.box[d][1] - p.box[d][0] for p in pieces) for d in range(len(spec.shape))
    )


def rank_pieces(spec: ParamSpec, placement: Placement, rank: int) -> tuple[Piece, ...]:
    """Pieces global ``rank`` holds; empty when its pipeline stage does not own ``spec``."""
    _, pp_index, tp_index = placement.layout.coords(rank)
    if pp_index not in param_stages(spec, placement):
        return ()
    return tp_pieces(spec, placement.layout, tp_index)


def regions(spec: ParamSpec, placement: Placement) -> dict[Box, list[int]]:
    """Distinct regions of ``spec`` under ``placement``, each with its holders (ascending
    global ranks). For a valid layout they tile the full tensor."""
    layout = placement.layout
    stages = param_stages(spec, placement)
    out: dict[Box, list[int]] = {}
    for t in range(layout.tp):
        for piece in tp_pieces(spec, layout, t):
            holders = out.setdefault(piece.box, [])
            holders.extend(layout.rank_of(d, s, t) for d in range(layout.dp) for s in stages)
    return {box: sorted(holders) for box, holders in out.items()}


def grad_class(spec: ParamSpec, placement: Placement, rank: int) -> tuple[int, int, int]:
    """Partial-sum class of ``rank``'s gradient copy (see the module docstring)."""
    dp_index, pp_index, tp_index = placement.layout.coords(rank)
    partial_tp = placement.sequence_parallel and spec.sequence_parallel_grad
    return dp_index, pp_index, tp_index if partial_tp else -1


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def model_param_specs(model: ModelSpec, tp_degrees: Iterable[int] = (1,)) -> dict[str, ParamSpec]:
    """Every parameter of a Megatron GPTModel (local spec) for ``model``, by global name.

    Megatron pads the vocabulary to a multiple of 128 x tp; layouts exchanging weights need
    one padded size, so it is padded to 128 x lcm(``tp_degrees``). Tied word embeddings are
    one parameter on the first and last stage (Megatron names the last stage's copy
    ``output_layer.weight``).
    """
    h, f = model.hidden_size, model.ffn_hidden_size
    qkv = model.q_size + 2 * model.kv_size
    vocab = _pad(model.vocab_size, 128 * math.lcm(*tp_degrees))
    bias, norm_bias = model.add_bias_linear, model.normalization == "layernorm"
    specs: dict[str, ParamSpec] = {
        "embedding.word_embeddings.weight": ParamSpec(
            (vocab, h), True, 0, stages="first+last" if model.tied_embeddings else "first"
        )
    }
    if model.position_embedding == "learned":
        specs["embedding.position_embeddings.weight"] = ParamSpec(
            (model.max_position_embeddings, h), stages="first"
        )
    for i in range(model.num_layers):
        p = f"decoder.layers.{i}."
        norm = ParamSpec((h,), sequence_parallel_grad=True, layer=i)
        col = {"tensor_model_parallel": True, "partition_dim": 0, "layer": i}
        row = {"tensor_model_parallel": True, "partition_dim": 1, "layer": i}
        fc1 = 2 * f if model.gated else f
        stride = 2 if model.gated else 1
        layer = {
            "input_layernorm.weight": norm,
            "self_attention.linear_qkv.weight": ParamSpec((qkv, h), cannon_blocks=True, **col),
            "self_attention.linear_proj.weight": ParamSpec(
                (h, model.q_size), cannon_blocks=True, **row
            ),
            "pre_mlp_layernorm.weight": norm,
            "mlp.linear_fc1.weight": ParamSpec(
                (fc1, h), partition_stride=stride, cannon_blocks=True, **col
            ),
            "mlp.linear_fc2.weight": ParamSpec((h, f), cannon_blocks=True, **row),
        }
        if norm_bias:
            layer["input_layernorm.bias"] = layer["pre_mlp_layernorm.bias"] = norm
        if bias:
            # column biases: Megatron's shard in every mode, complete gradients (all tokens)
            layer["self_attention.linear_qkv.bias"] = ParamSpec((qkv,), **col)
            layer["self_attention.linear_proj.bias"] = norm
            layer["mlp.linear_fc1.bias"] = ParamSpec((fc1,), partition_stride=stride, **col)
            layer["mlp.linear_fc2.bias"] = norm
        specs.update({p + k: v for k, v in layer.items()})
    final = ParamSpec((h,), sequence_parallel_grad=True, stages="last")
    specs["decoder.final_layernorm.weight"] = final
    if norm_bias:
        specs["decoder.final_layernorm.bias"] = final
    if not model.tied_embeddings:
        specs["output_layer.weight"] = ParamSpec((vocab, h), True, 0, stages="last")
    return specs
