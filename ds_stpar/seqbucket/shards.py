"""Which pieces of each full (logical) parameter a rank holds under a layout.

A parameter has one full tensor. Under a :class:`~ds_stpar.config.Layout` every rank of the
owning pipeline stage(s) holds some boxes of it, packed into one local tensor. A box is a
region of the full tensor, ``((start, stop), ...)`` per dim; a :class:`Piece` says where the
box's first element sits in the local tensor. Rank coordinates follow ``Layout.coords``:
``rank = (dp_index * pp + pp_index) * tp + tp_index``.

Tensor-parallel sharding (Megatron's parameter attributes, same meaning):

* not ``tensor_model_parallel``: every TP rank holds the whole tensor.
* ``tensor_model_parallel`` (tp_mode megatron or ring, or cannon without ``cannon_blocks``):
  dim ``partition_dim`` of length n is cut into ``tp * stride`` chunks of ``c = n/(tp*stride)``;
  TP rank t holds chunks ``t, t + tp, ..., t + (stride-1)*tp`` stacked in that order. With
  ``stride=2`` (GLU fc1, full tensor ``[gate; up]``) rank t holds ``[gate_t; up_t]``::

      local[k*c:(k+1)*c] = full[(k*tp + t)*c : (k*tp + t + 1)*c]      k = 0..stride-1

* ``cannon_blocks`` under tp_mode cannon (tp = q*q, TP rank t = r*q + c on a row-major
  torus): a weight stored Megatron-style ``[out, in]`` = ``[N, K]`` (W^T of the GEMM
  ``Y = X W``, W: ``[K, N]``) is held as the pre-skewed Cannon home block
  ``W[(r+c)%q, c]``: dim 0 (N) cut into q blocks, block c; dim 1 (K) cut into q blocks,
  block ``(r+c)%q``. ``partition_stride`` applies along ``partition_dim`` as above (chunks
  ``c, c+q, ...``). A 1-D ``cannon_blocks`` parameter (the column bias, added to the output
  block Y[r, c]) is cut into q blocks along dim 0, block c: replicated over the torus rows r.

Pipeline ownership: a parameter of transformer layer ``layer`` lives on the stage that runs
that layer (``config.stage_layers``; with interleaving, model chunk ``layer // vpp_layers``
on stage ``chunk % pp``); parameters outside the blocks name their stages: "first"
(embeddings), "last" (final norm, untied LM head), "first+last" (tied word embeddings: Megatron
keeps a copy on both ends), "all".

Gradient copies. Before any reduction, the copies of one region that a layout holds are
either *partial* sums (to be added) or *identical* (computed redundantly). Copies in different
DP replicas are partial; copies on different pipeline stages (tied embeddings) are partial;
copies on different TP ranks are partial when the parameter is ``sequence_parallel_grad``
(Megatron's ``sequence_parallel`` attribute: norms and row biases under sequence parallelism,
Cannon column biases) and the strategy runs sequence parallel, identical otherwise.
:func:`grad_class` names the class of a copy: one class = one partial sum; its members hold
identical values.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ds_stpar.config import Layout, ModelSpec, Strategy, stage_layers
from ds_stpar.errors import ConfigError

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

    ``layer``: global transformer-layer index (0-based) or None for parameters outside the
    blocks, whose stages ``stages`` names (one of :data:`STAGES`).
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
        if self.layer is not None and self.layer < 0:
            raise ConfigError(f"layer index must be >= 0, got {self.layer}")
        if self.layer is None and self.stages not in STAGES:
            raise ConfigError(f"stages must be one of {STAGES}, got {self.stages!r}")

    @classmethod
    def from_param(
        cls, param: Any, layout: Layout, *, layer: int | None = None, stages: str = "all"
    ) -> ParamSpec:
        """Read Megatron's attributes (and ``cannon_blocks``) from a local parameter of
        ``layout`` and infer the full shape: local x tp along ``partition_dim``, or local x q
        along both dims for Cannon blocks (vocabulary padding must already be common to every
        layout: full shapes are compared across layouts)."""
        tmp = bool(getattr(param, "tensor_model_parallel", False))
        dim = int(getattr(param, "partition_dim", 0))
        blocks = bool(getattr(param, "cannon_blocks", False))
        shape = list(param.shape)
        if tmp and layout.tp_mode == "cannon" and blocks:
            q = math.isqrt(layout.tp)
            shape[0] *= q
            if len(shape) == 2:
                shape[1] *= q
        elif tmp:
            shape[dim] *= layout.tp
        return cls(
            shape=tuple(shape),
            tensor_model_parallel=tmp,
            partition_dim=dim,
            partition_stride=int(getattr(param, "partition_stride", 1)),
            sequence_parallel_grad=bool(getattr(param, "sequence_parallel", False)),
            cannon_blocks=blocks,
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


def _axis_chunks(n: int, parts: int, index: int, stride: int, what: str) -> list[tuple]:
    """[(start, stop, local_start)] of the chunks ``index, index+parts, ...`` of dim length n."""
    if n % (parts * stride):
        raise ConfigError(
            f"{what}: length {n} is not divisible by {parts} ranks x stride {stride}; pad it "
            f"(e.g. the vocabulary) to a multiple of every layout's TP degree"
        )
    c = n // (parts * stride)
    return [((k * parts + index) * c, (k * parts + index + 1) * c, k * c) for k in range(stride)]


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
    # per dim: (parts, block index, stride)
    axes = [(1, 0, 1)] * len(shape)
    if tensor_parallel and tp > 1:
        if mode == "cannon" and cannon_blocks:
            if len(shape) > 2:
                raise ConfigError(f"Cannon blocks need a 1-d or 2-d parameter, got {shape}")
            q = math.isqrt(tp)
            r, c = divmod(tp_index, q)
            axes[0] = (q, c, stride if partition_dim == 0 else 1)
            if len(shape) == 2:
                axes[1] = (q, (r + c) % q, stride if partition_dim == 1 else 1)
        else:
            axes[partition_dim] = (tp, tp_index, stride)
    per_dim = [
        _axis_chunks(n, parts, index, step, f"parameter of shape {shape}, dim {d}")
        for d, (n, (parts, index, step)) in enumerate(zip(shape, axes))
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
            layer["self_attention.linear_qkv.bias"] = ParamSpec(
                (qkv,), sequence_parallel_grad=True, cannon_blocks=True, **col
            )
            layer["self_attention.linear_proj.bias"] = norm
            layer["mlp.linear_fc1.bias"] = ParamSpec(
                (fc1,),
                partition_stride=stride,
                sequence_parallel_grad=True,
                cannon_blocks=True,
                **col,
            )
            layer["mlp.linear_fc2.bias"] = norm
        specs.update({p + k: v for k, v in layer.items()})
    final = ParamSpec((h,), sequence_parallel_grad=True, stages="last")
    specs["decoder.final_layernorm.weight"] = final
    if norm_bias:
        specs["decoder.final_layernorm.bias"] = final
    if not model.tied_embeddings:
        specs["output_layer.weight"] = ParamSpec((vocab, h), True, 0, stages="last")
    return specs
