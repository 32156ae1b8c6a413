"""One mini-batch across layouts: switch weights in, run a bucket, carry its gradient home.

Per :class:`~ds_stpar.seqbucket.sampler.MiniBatchPlan` (buckets shortest first, empty ones
skipped), with one model per :func:`~ds_stpar.config.model_key` the plan uses
(:func:`build_layout_models`; buckets differing only in micro-batch or full recompute share
one, the recompute switched per bucket):

1. a bucket whose layout is not the home one: its model gets the home model's current weights
   (:func:`~ds_stpar.seqbucket.switch.switch`, once per optimizer step), runs the bucket's
   micro-batches forward and backward, and after the last bucket of that model in the step
   its gradient (accumulated in fp32, nothing reduced) is added into the *carry*, fp32
   buffers of the home layout's local shapes, by
   :func:`~ds_stpar.seqbucket.switch.switch_grads` (the DP reduction of that layout is fused
   into the move): each model switches once each way per step;
2. a bucket in the home layout runs under the DeepSpeed engine; before its first forward
   the carry is added into the home parameters' ``.grad`` (so that DeepSpeed's own reduction
   sees it) and freed;
3. ``engine.step()``.

Memory. A non-home model holds memory only from switching its weights in to carrying its
gradient home (:class:`_AwayModel`: parameter storage resized to nothing in between, fp32
accumulators dropped), and the carry only from the first carry to the next home bucket; both
switches run in rounds of at most ``SWITCH_ROUND_BYTES`` per rank. So the home bucket runs
beside the home model states alone, and a non-home bucket beside the home states, its own
model and (when another non-home bucket ran since the last home bucket) the carry: what
:mod:`ds_stpar.planner.buckets` charges. Keeping every model resident would charge the
home bucket with every other layout's weights and gradients, which at 32K tokens decides
whether a short-bucket DP layout fits next to a TP home at all.

Loss. Every micro-batch's loss is ``sum of its token losses / N``, ``N`` the mini-batch's
target count (:mod:`~ds_stpar.seqbucket.loss`), computed with the LM head by
:func:`~ds_stpar.layers.cross_entropy.vocab_parallel_linear_cross_entropy` over the layout's TP
group, chunk by chunk (the models' output layers return the hidden states,
:func:`~ds_stpar.integrations.megatron.defer_output_layer`): the micro-batch's logits never
exist at once.
The sum of these over all micro-batches of all ranks is the mean token loss of the
mini-batch, so the gradient is independent of bucketing, packing and layout.

Packed rows. A micro-batch of ``b`` rows is fed as ONE ``thd`` row: the pieces of its rows
end to end, without the rows' padding, rounded up to a multiple of
:func:`~ds_stpar.seqbucket.packing.token_multiple` of the layout's TP degree
(:func:`~ds_stpar.seqbucket.packing.collate`), with ``PackedSeqParams(qkv_format="thd",
cu_seqlens_q = cu_seqlens_kv = the segments)`` and position ids restarting at every segment,
so no token attends across a document boundary. The work of a micro-batch is its real tokens;
a padding micro-batch (a DP rank short of rows) is a few pad tokens.

DP arithmetic under DeepSpeed (home layout, ``d`` DP ranks). DeepSpeed *averages* gradients
over its DP group; the sum of token losses is wanted. The home loss is therefore scaled by
``d`` (``engine.backward(loss * d, scale_wrt_gas=False)``), and so is the carry: the grads
plan adds each carried cell into exactly ONE partial-sum class of the home layout (one DP
replica, like a reduce-scatter), so DeepSpeed's average of ``d * C`` on that replica and 0
elsewhere is ``C``.

Sequence parallel home layouts (ring TP, or ``sequence_parallel``): the norm and row-bias
gradients of each TP rank are partial sums (Megatron's ``finalize_model_grads`` all-reduces
them over TP; DeepSpeed does not). A tensor hook all-reduces each fresh gradient of such a
parameter over the home TP group before it is accumulated, and the carry of those parameters
is all-reduced over TP once per step (the grads plan put it on one TP rank only).

Boundaries. DeepSpeed's accumulation boundary is set by hand
(``engine.set_gradient_accumulation_boundary``): True only for the last home micro-batch.
The home bucket always runs at least one micro-batch per rank (a zero-weight padding row when
the mini-batch has no piece of the longest bucket), so the carry always reaches a backward
and DeepSpeed's step always follows one.

Pipeline layouts (``pp > 1``, not interleaved) run their micro-batches in 1F1B order
(:class:`~ds_stpar.seqbucket.pipeline.PipelineStage`) on megatron-core's stage models. Every
stage's backward of the home model goes through ``engine.backward``, so DeepSpeed's hooks,
reduction and boundary see every micro-batch: the last stage's on the loss (scaled by ``d`` as
above), the others' on the scalar ``sum(output * grad)``, whose gradient with respect to the
stage output is exactly the received ``grad``. Parameters are named globally on every stage
(``decoder.layers.<global index>``; a tied LM head on the last stage under the embedding's
name), which is what the switch descriptors place. A pipelined home that ties embeddings and
LM head holds the weight on its first and last stage; their gradients are summed across the
two before DeepSpeed reduces them (:mod:`~ds_stpar.seqbucket.tied`: parked in fp32 during the
micro-batches, summed, and handed to DeepSpeed by one more, boundary, backward).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ds_stpar.config import Layout, ModelSpec, Strategy, model_key
from ds_stpar.errors import ConfigError
from ds_stpar.layers.cross_entropy import vocab_parallel_linear_cross_entropy
from ds_stpar.parallel import GroupCache, LayoutGroups
from ds_stpar.seqbucket.packing import (
    PackedBatch,
    RowPlan,
    collate,
    micro_batch_length,
    token_multiple,
)
from ds_stpar.seqbucket.pipeline import PipelineStage
from ds_stpar.seqbucket.sampler import BucketPlan, MicroBatch, MiniBatchPlan
from ds_stpar.seqbucket.shards import (
    ParamSpec,
    Placement,
    described_layers,
    local_shape,
    param_stages,
    tp_pieces,
)
from ds_stpar.seqbucket.switch import SWITCH_ROUND_BYTES, SwitchPlanner, switch, switch_grads
from ds_stpar.seqbucket.tied import TIED_NAME, TiedEmbedding

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


LOOP_ZERO = (0, 1, 2)  # ZeRO-3 shards the parameters the switch reads
LOOP_RULE = "pp >= 1 (1F1B, even stages), ZeRO <= 2, no interleaved layer"  # in words


def loop_refusal(strategy: Strategy) -> str:
    """Why this training loop cannot run ``strategy``, as a home layout or another bucket's,
    every reason; "" when it can. It runs ZeRO 0-2 (ZeRO-3 shards the parameters that the
    switch reads), pipelines in non-interleaved 1F1B over even stages, and packed rows (no
    interleaved layer). The planner holds
    its plans to the same rule (``planner.buckets``)."""
    reasons = []
    if strategy.zero not in LOOP_ZERO:
        reasons.append(f"ZeRO-{strategy.zero} shards the parameters the switch reads")
    if strategy.vpp_layers:
        reasons.append(
            f"its 1F1B schedule does not interleave stages (vpp_layers={strategy.vpp_layers})"
        )
    if strategy.first_stage_layers or strategy.last_stage_layers:
        reasons.append("it splits the layers evenly over the stages (uneven first/last stages)")
    if strategy.runs_interleaved:
        reasons.append(
            f"it packs documents into rows, which the interleaved layer cannot cut into "
            f"pieces of whole sequences (interleave={strategy.interleave}: a Megatron-LM run "
            "of unpacked micro-batches, DS_STPAR_INTERLEAVE)"
        )
    return ", and ".join(reasons)


def check_strategies(strategies: Sequence[Strategy], edges: Sequence[int]) -> None:
    """Refuse what the runner cannot run (:func:`loop_refusal`), and sequence-parallel
    buckets whose rows do not split evenly over TP."""
    for strategy, edge in zip(strategies, edges):
        layout = strategy.layout
        refusal = loop_refusal(strategy)
        if refusal:
            raise ConfigError(
                f"bucket {edge}: the ds_stpar training loop cannot run {strategy.short()}: "
                f"{refusal}; re-plan, or train this layout with Megatron-LM or DeepSpeed"
            )
        sp = strategy.sequence_parallel or layout.tp_mode != "megatron"
        if layout.tp > 1 and sp and edge % layout.tp:
            raise ConfigError(
                f"bucket {edge}: sequence-parallel TP={layout.tp} needs the edge to be a "
                f"multiple of {layout.tp}"
            )


def _layout_specs(
    params: Mapping[str, torch.nn.Parameter], layout: Layout, tied: bool
) -> dict[str, ParamSpec]:
    """Descriptors of one layout's GPTModel parameters, by global name."""
    specs = {}
    for name, param in params.items():
        match = _LAYER.match(name)
        if match:
            kw = {"layer": int(match.group(1))}
        elif name.startswith("embedding.word_embeddings"):
            kw = {"stages": "first+last" if tied else "first"}
        elif name.startswith("embedding."):
            kw = {"stages": "first"}
        elif name.startswith(("decoder.final_layernorm", "output_layer")):
            kw = {"stages": "last"}
        else:
            raise ConfigError(f"{name}: a parameter the switch descriptors do not place")
        specs[name] = ParamSpec.from_param(param, layout, **kw)
    return specs


def megatron_global_names(module: torch.nn.Module) -> dict[str, str]:
    """A megatron-core GPT stage's parameter names that differ from their global names:
    ``decoder.layers.<i>`` counts the stage's own layers (its ``layer_number`` is global and
    1-based), and a later stage's tied LM head is the embedding's copy."""
    renames = {}
    for name, _ in module.named_parameters():
        match = _LAYER.match(name)
        if match:
            local = int(match.group(1))
            layer = module.decoder.layers[local].layer_number - 1
            if layer != local:
                renames[name] = f"decoder.layers.{layer}.{name[match.end() :]}"
        elif name == "output_layer.weight" and getattr(
            module, "share_embeddings_and_output_weights", False
        ):
            renames[name] = "embedding.word_embeddings.weight"
    return renames


def param_specs(models: Mapping[Strategy, LayoutModel], tied: bool) -> dict[str, ParamSpec]:
    """Full-tensor descriptors of megatron-core GPTModels' parameters, by global name, one per
    parameter whatever the layout, read from the TP attributes of every layout's model (so
    padding and layer choices are the models'). A pipeline stage holds some of them; the
    descriptors are the union over the models and, when a model is pipelined, over the ranks
    (collective then), and a parameter seen by several models must agree.

    Two flags say how a parameter is held under layouts of one kind, and only a model of that
    kind carries them: ``cannon_blocks`` (a temporal linear's weight: ``stpar_tp_mode``, which
    Megatron's own layers of tp_mode megatron lack) matters under tp_mode cannon only, and
    ``sequence_parallel_grad`` (Megatron's ``sequence_parallel``) under sequence parallelism
    only (``Placement``). Each is therefore True when any model sets it; everything else
    (full shape, partitioning, placement) must agree across the models."""
    merged: dict[str, ParamSpec] = {}
    for key, model in models.items():
        for name, spec in _layout_specs(model.params, key.layout, tied).items():
            _merge_spec(merged, name, spec, f"the {key.layout.short()} model's")
    if dist.is_initialized() and any(key.layout.pp > 1 for key in models):
        # a stage sees its own parameters only: the union over the ranks describes them all
        everyone: list[dict[str, ParamSpec]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, merged)
        for rank, specs in enumerate(everyone):
            for name, spec in specs.items():
                _merge_spec(merged, name, spec, f"rank {rank}'s")
    return merged


def _merge_spec(merged: dict[str, ParamSpec], name: str, spec: ParamSpec, whose: str) -> None:
    """Add ``spec`` to ``merged``: the flags of param_specs' docstring are OR-ed, everything
    else must agree with what is there."""
    seen = merged.setdefault(name, spec)
    flags = {
        "cannon_blocks": spec.cannon_blocks or seen.cannon_blocks,
        "sequence_parallel_grad": spec.sequence_parallel_grad or seen.sequence_parallel_grad,
    }
    spec = dataclasses.replace(spec, **flags)
    if spec != dataclasses.replace(seen, **flags):
        raise ConfigError(
            f"{name}: {whose} full parameter differs from the other layouts' (its shape or "
            "sharding); pad the vocabulary to a multiple of every TP degree"
        )
    merged[name] = spec


def check_local_shapes(
    models: Mapping[Strategy, LayoutModel], specs: Mapping[str, ParamSpec]
) -> None:
    """Every layout's model holds exactly the described parameters its pipeline stage owns,
    each of the local shape its descriptor gives under that layout (what switching will write
    into it)."""
    num_layers = described_layers(specs)
    for key, model in models.items():
        params = model.described(model.params)
        placement = Placement.of(key, num_layers)
        stage = model.groups.pp_index
        held = {n for n, s in specs.items() if stage in param_stages(s, placement)}
        if params.keys() != held:
            missing = sorted(params.keys() ^ held)[:3]
            raise ConfigError(
                f"the {key.layout.short()} model's parameters differ from the descriptors' "
                f"(e.g. {', '.join(missing)})"
            )
        for name, param in params.items():
            want = local_shape(specs[name], key.layout)
            if tuple(param.shape) != want:
                raise ConfigError(
                    f"{name}: the {key.layout.short()} model holds a {tuple(param.shape)} "
                    f"shard where its descriptor gives {want}; every layout must shard the "
                    "same full parameter (pad the vocabulary to a multiple of every TP degree)"
                )


@dataclass
class LayoutModel:
    """One layout's model on this rank, its groups and its parameters by global name.

    ``transposed``: parameters this model stores transposed against their descriptors (an
    HF Conv1D weight, [in, out], where the parallel layers and descriptors hold [out, in]);
    :meth:`described` views them the descriptors' way, which is what switching reads and
    writes."""

    strategy: Strategy
    groups: LayoutGroups
    module: torch.nn.Module
    transposed: frozenset[str] = frozenset()
    renames: Mapping[str, str] = field(default_factory=dict)

    @property
    def params(self) -> dict[str, torch.nn.Parameter]:
        """This rank's parameters by global name (``renames``: module name -> global name,
        where they differ: a pipeline stage's layers, :func:`megatron_global_names`)."""
        return {self.renames.get(n, n): p for n, p in self.module.named_parameters()}

    def described(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``tensors`` (this model's parameters or tensors of their shapes) as views in the
        descriptors' orientation."""
        return {n: t.t() if n in self.transposed else t for n, t in tensors.items()}


def seed_megatron(seed: int, tp_index: int) -> None:
    """Seed torch and Megatron's model-parallel RNG tracker (CPU: the shims route it to torch)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", seed + 2718 + tp_index)


VOCAB_MULTIPLE = 128  # Megatron-LM's --make-vocab-size-divisible-by default


def padded_vocab(vocab_size: int, strategies: Sequence[Strategy]) -> int:
    """``vocab_size`` rounded up to a multiple of ``VOCAB_MULTIPLE`` and of every TP degree
    (all layouts share one shape). For power-of-two TP up to 128 that is 128 whatever the
    layouts, so a checkpoint resumes under any of them (Megatron-LM's 128 x TP would give
    each TP degree its own vocabulary). The 128 matters on GPU: an LM-head GEMM with an odd
    dimension (GPT-2's 50257) misses cuBLAS's aligned tensor-core kernels; on H200 its three
    GEMMs per micro-batch took 85 ms where the aligned rate gives 16 ms, 18% of a gpt3-1.3b
    step (bench/results/2026-11-26-4xH200/pretrain-gpt3-1.3b-profile-step-3.txt)."""
    multiple = math.lcm(VOCAB_MULTIPLE, *(s.layout.tp for s in strategies))
    return -(-vocab_size // multiple) * multiple


def _ensure_memory_buffer() -> None:
    """Megatron's sequence-parallel all-gather (its ColumnParallelLinear, e.g. the output
    layer) takes scratch space from a process-wide buffer that only
    ``initialize_model_parallel`` creates; models built with explicit groups create it here.
    It holds no process group."""
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


def build_layout_models(
    model: ModelSpec,
    strategies: Sequence[Strategy],
    home: Strategy,
    cache: GroupCache,
    dtype: str,
    seed: int,
    seq_len: int = 0,
) -> dict[Strategy, LayoutModel]:
    """One GPTModel per distinct :func:`model_key` of ``strategies`` (collective: groups are
    created on first use). The home model is built first, right after seeding, so with CPU
    initialisation its weights depend on the seed only, not on the layout; the others'
    initial weights are irrelevant (switched in before use)."""
    from ds_stpar.integrations.megatron import build_gpt, defer_output_layer

    if not torch.cuda.is_available():
        from ds_stpar.integrations import megatron_cpu

        megatron_cpu.apply()
    _ensure_memory_buffer()
    keys = [model_key(home)] + [model_key(s) for s in strategies if model_key(s) != model_key(home)]
    models: dict[Strategy, LayoutModel] = {}
    for key in keys:
        if key in models:
            continue
        groups = cache.get(key.layout)
        if key == model_key(home):
            seed_megatron(seed, groups.tp_index)
        module = defer_output_layer(build_gpt(model, key, groups, dtype=dtype, seq_len=seq_len))
        models[key] = LayoutModel(key, groups, module, renames=megatron_global_names(module))
    return models


@dataclass
class StepStats:
    """What one mini-batch did. Times in seconds, measured on this rank."""

    epoch: int
    index: int
    loss: float  # mean token loss of the mini-batch (all ranks)
    num_targets: int
    num_tokens: int
    step_s: float = 0.0
    switch_s: float = 0.0
    optimizer_s: float = 0.0
    bucket_s: dict[int, float] = field(default_factory=dict)
    micro_batches: dict[int, int] = field(default_factory=dict)
    bucket_tokens: dict[int, int] = field(default_factory=dict)  # real tokens, all ranks
    layouts: list[str] = field(default_factory=list)
    switches: int = 0

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["bucket_s"] = {str(k): v for k, v in self.bucket_s.items()}
        out["micro_batches"] = {str(k): v for k, v in self.micro_batches.items()}
        out["bucket_tokens"] = {str(k): v for k, v in self.bucket_tokens.items()}
        return out


def _own_storage(param: torch.nn.Parameter) -> bool:
    return (
        param.is_contiguous()
        and param.storage_offset() == 0
        and param.untyped_storage().nbytes() == param.numel() * param.element_size()
    )


class _AwayModel:
    """A non-home model's memory, held only between switching its weights in and carrying
    its gradient home: the parameters' storage (resized to nothing in between, so the module
    and its views stay valid) and fp32 gradient accumulators filled by post-accumulate hooks
    (each micro-batch's ``.grad`` is added, then dropped, so bf16 models accumulate in fp32).
    While the home bucket runs, no other layout's model takes memory."""

    def __init__(self, params: Mapping[str, torch.nn.Parameter]) -> None:
        shared = [n for n, p in params.items() if not _own_storage(p)]
        if shared:
            raise ConfigError(
                f"parameters {shared[:3]} share storage with other tensors: a non-home model's "
                "memory cannot be released between its buckets"
            )
        self.params = dict(params)
        self.grads: dict[str, Tensor] = {}
        for name, param in self.params.items():
            param.register_post_accumulate_grad_hook(self._hook(name))
        self.release_weights()

    def _hook(self, name: str) -> Callable:
        def hook(param: torch.nn.Parameter) -> None:
            self.grads[name].add_(param.grad)
            param.grad = None

        return hook

    def acquire(self) -> None:
        """Storage for the weights (contents undefined until switched in) and zeroed fp32
        gradient accumulators."""
        for param in self.params.values():
            param.untyped_storage().resize_(param.numel() * param.element_size())
        self.grads = {
            n: torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            for n, p in self.params.items()
        }

    def release_weights(self) -> None:
        for param in self.params.values():
            param.untyped_storage().resize_(0)

    def release_grads(self) -> None:
        self.grads = {}


def _sequence_parallel_params(
    model: LayoutModel, specs: Mapping[str, ParamSpec]
) -> dict[str, torch.nn.Parameter]:
    """Home parameters whose TP copies hold partial gradients (same region on every TP rank:
    norms and row biases under sequence parallelism).

    A ``sequence_parallel_grad`` parameter whose region is shared by only part of the TP group
    (none under the current layers: every TP-split parameter, the Cannon column bias included,
    is held once per TP group) would need sub-groups: refused."""
    layout = model.strategy.layout
    placement = Placement.of(model.strategy, 0)
    if not placement.sequence_parallel:
        return {}
    out = {}
    for name, param in model.params.items():
        spec = specs[name]
        if not spec.sequence_parallel_grad:
            continue
        pieces = {tp_pieces(spec, layout, t) for t in range(layout.tp)}
        if len(pieces) == 1:
            out[name] = param
        elif len(pieces) != layout.tp:
            raise ConfigError(
                f"{name}: its gradient is partial over part of the TP group under "
                f"{layout.short()}; use it for a shorter bucket, not as the home layout"
            )
    return out


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """``host`` on ``device``; to a GPU through pinned memory without waiting: a copy from
    pageable memory makes the host wait for the GPU's queue to drain, four times per
    micro-batch here (torch.cuda.set_sync_debug_mode, bench/results/2026-11-26-s11-2xH200/
    call47)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def packed_inputs(batch: PackedBatch, device: torch.device):
    """``[1, T]`` ids, positions and labels and the ``thd`` PackedSeqParams of a micro-batch
    (its ``cu_seqlens`` marked with the tokens' segment offsets for RoPE,
    :mod:`~ds_stpar.layers.packed_rope`)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from ds_stpar.layers.packed_rope import mark_segments

    ids, positions, labels = (
        to_device(x, device) for x in (batch.input_ids, batch.position_ids, batch.labels)
    )
    cu = mark_segments(to_device(batch.cu_seqlens.to(torch.int32), device), batch.cu_seqlens)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=batch.max_seqlen,
        max_seqlen_kv=batch.max_seqlen,
    )
    return ids, positions, labels, params


class BucketRunner:
    """Runs mini-batch plans over the layout models, with the home one under ``engine``.

    ``models``: from :func:`build_layout_models`; ``engine``: the DeepSpeed engine wrapping
    ``models[model_key(home)].module``; ``tokens(doc)``: a document's ids (e.g.
    :class:`~ds_stpar.seqbucket.data.Documents`); ``pad_id``: the padding id;
    ``tied_embeddings``: the models tie word embeddings and LM head; ``gpus_per_node``: for the
    switch planner's node preference; ``specs``: the full-tensor descriptors, common to every
    layout (default :func:`param_specs` of the models; ``tied_embeddings`` is read for those
    only). Every model must hold each parameter in the local shape its descriptor gives under
    the model's layout (:func:`check_local_shapes`).
    """

    def __init__(
        self,
        engine,
        models: Mapping[Strategy, LayoutModel],
        home: Strategy,
        tokens: Callable[[int], np.ndarray],
        pad_id: int,
        tied_embeddings: bool,
        gpus_per_node: int = 8,
        specs: Mapping[str, ParamSpec] | None = None,
    ) -> None:
        self.engine = engine
        self.home_key = model_key(home)
        self.home = models[self.home_key]
        self.models = dict(models)
        self.tokens, self.pad_id = tokens, pad_id
        self.device = next(self.home.module.parameters()).device
        self.specs = dict(specs) if specs is not None else param_specs(models, tied_embeddings)
        check_local_shapes(self.models, self.specs)
        self.planner = SwitchPlanner(self.specs, gpus_per_node)
        self.away = {k: _AwayModel(m.params) for k, m in self.models.items() if k != self.home_key}
        self.carry: dict[str, Tensor] | None = None  # allocated by the first carry of a step
        self._weight_round = (
            SWITCH_ROUND_BYTES // next(iter(self.home.params.values())).element_size()
        )
        self._grad_round = SWITCH_ROUND_BYTES // 4
        self.home_dp = self.home.strategy.layout.dp
        self.sp_params = _sequence_parallel_params(self.home, self.specs)
        for param in self.sp_params.values():
            param.register_hook(self._tp_all_reduce)
        self._fresh: set[Strategy] = set()  # layouts whose weights match the home's
        self.tied = None  # a pipelined home's tied embedding: seqbucket/tied.py
        if self.home.strategy.layout.pp > 1 and tied_embeddings:
            self.tied = TiedEmbedding(self.home.params.get(TIED_NAME), self.home.groups)
        for key, model in self.models.items():
            if key.layout.pp > 1:
                # NCCL creates a group's communicator at its first use, collectively; a batched
                # P2P as first use must involve every rank of the group, which the first
                # transfers of 1F1B do not (pp > 2)
                dist.all_reduce(torch.zeros(1, device=self.device), group=model.groups.pp_group)

    # ---- pieces ----------------------------------------------------------------------
    def _tp_all_reduce(self, grad: Tensor) -> Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=self.home.groups.tp_group)
        return grad

    @staticmethod
    def _set_recompute(model: LayoutModel, strategy: Strategy) -> None:
        """The bucket's recompute on its (possibly shared) megatron-core model: none, full of
        every layer, or full of the first ``recompute_layers`` of this rank's stage (the block
        method), read by megatron-core's block at every forward; selective recompute is fixed
        when the model is built (its model_key is its own)."""
        if strategy.recompute != "selective":
            from ds_stpar.integrations.megatron import set_full_recompute

            set_full_recompute(model.module.config, strategy.recompute, strategy.recompute_layers)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _micro_batches(self, bucket: BucketPlan, model: LayoutModel, is_home: bool):
        mbs = bucket.micro_batches(model.groups.dp_index)
        if is_home and not mbs:  # keep a backward before DeepSpeed's step: zero weight
            mbs = (MicroBatch((RowPlan(bucket.edge),)),)
        return mbs

    def _batch(self, model: LayoutModel, mb: MicroBatch) -> PackedBatch:
        """The micro-batch as fed to ``model``: its rows' pieces end to end, a multiple of
        :func:`~ds_stpar.seqbucket.packing.token_multiple` of the layout's TP degree."""
        multiple = token_multiple(model.strategy.layout.tp)
        return collate(mb.rows, self.tokens, self.pad_id, multiple)

    def _loss(self, module, model: LayoutModel, mb: MicroBatch, num_targets: int) -> Tensor:
        """A micro-batch's loss through a whole (not pipelined) megatron-core model."""
        return self._forward_stage(module, model, mb, num_targets, None)

    def _forward_stage(
        self, module, model: LayoutModel, mb: MicroBatch, num_targets: int, hidden: Tensor | None
    ) -> Tensor:
        """Megatron-core stage forward: the loss on the last stage, else the hidden state."""
        from ds_stpar.integrations.megatron import head_weight

        ids, positions, labels, params = packed_inputs(self._batch(model, mb), self.device)
        if hidden is not None:
            model.module.set_input_tensor(hidden)
        out = module(ids, positions, None, packed_seq_params=params)
        if model.groups.pp_index < model.strategy.layout.pp - 1:
            return out
        gpt = model.module  # out: the final norm's hidden states (defer_output_layer)
        return vocab_parallel_linear_cross_entropy(
            out,
            head_weight(gpt),
            labels,
            num_targets,
            group=model.groups.tp_group,
            sequence_parallel=gpt.output_layer.sequence_parallel,
        )

    def _forward(
        self, module, model: LayoutModel, mb: MicroBatch, num_targets: int, hidden: Tensor | None
    ) -> Tensor:
        """The micro-batch through this rank's stage of ``model`` (``module``: it, or the
        engine wrapping it): its loss on the last stage (:meth:`_loss` when not pipelined),
        else its output hidden state. ``hidden``: the previous stage's output (None on the
        first stage)."""
        if model.strategy.layout.pp == 1:
            return self._loss(module, model, mb, num_targets)
        return self._forward_stage(module, model, mb, num_targets, hidden)

    def _backward(self, is_home: bool, boundary: bool, output: Tensor, grad: Tensor | None):
        """Backward of one micro-batch on this stage: from the loss (``grad`` None), or from
        the stage output and its received gradient. The home model's goes through
        ``engine.backward`` (module docstring: the loss scaled by the home DP size, a stage
        output as ``sum(output * grad)``), with DeepSpeed's boundary at ``boundary``."""
        if not is_home:
            output.backward(grad)
            return
        scalar = output * self.home_dp if grad is None else (output * grad).sum()
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(scalar, scale_wrt_gas=False)

    def _run_micro_batches(
        self, model: LayoutModel, mbs: Sequence[MicroBatch], is_home: bool, boundary: bool, n: int
    ) -> Tensor:
        """Forward and backward of ``mbs`` on ``model`` (1F1B over its pipeline when pp > 1);
        ``boundary``: the last one closes DeepSpeed's accumulation. Returns the sum of the
        losses this rank reports (its TP rank 0 of the last stage; 0 elsewhere)."""
        module = self.engine if is_home else model.module
        groups = model.groups
        reports = groups.tp_index == 0 and groups.pp_index == model.strategy.layout.pp - 1
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        last = len(mbs) - 1

        def forward(k: int, hidden: Tensor | None) -> Tensor:
            nonlocal total
            out = self._forward(module, model, mbs[k], n, hidden)
            if reports:
                total += out.detach().double()
            return out

        def backward(k: int, output: Tensor, grad: Tensor | None) -> None:
            self._backward(is_home, boundary and k == last, output, grad)

        if model.strategy.layout.pp == 1:
            for k in range(len(mbs)):
                backward(k, forward(k, None), None)
            return total
        stage = PipelineStage(groups.pp_group, model.module.config.params_dtype, self.device)
        stage.run(len(mbs), lambda k: self._hidden_shape(model, mbs[k]), forward, backward)
        return total

    @staticmethod
    def _hidden_shape(model: LayoutModel, mb: MicroBatch) -> tuple[int, int, int]:
        """What passes between pipeline stages: ``[S/tp, 1, h]`` for a micro-batch of ``S``
        tokens as :func:`~ds_stpar.seqbucket.packing.collate` feeds it (split over TP under
        sequence parallelism)."""
        config = model.module.config
        tp = model.strategy.layout.tp
        tokens = micro_batch_length(mb.rows, token_multiple(tp))
        if config.sequence_parallel:
            tokens //= tp
        return (tokens, 1, config.hidden_size)

    def _switch_weights(self, key: Strategy) -> None:
        self.away[key].acquire()
        plan = self.planner.weights(self.home_key, key)
        src = self.home.described({n: p.detach() for n, p in self.home.params.items()})
        away = self.models[key]
        dst = away.described({n: p.detach() for n, p in away.params.items()})
        switch(src, dst, plan, round_elements=self._weight_round)
        self._fresh.add(key)

    def _carry_grads(self, key: Strategy) -> None:
        """The layout's gradient (all its buckets of the step) into the carry; its weights are
        released first (the move needs only the gradients), its gradients after."""
        away = self.away[key]
        away.release_weights()
        self._fresh.discard(key)
        if self.carry is None:
            self.carry = {
                n: torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                for n, p in self.home.params.items()
            }
        plan = self.planner.grads(key, self.home_key)
        grads, carry = self.models[key].described(away.grads), self.home.described(self.carry)
        switch_grads(grads, carry, plan, round_elements=self._grad_round)
        away.release_grads()

    def _add_carry(self) -> None:
        """Carry -> home ``.grad`` (TP-summed for SP parameters, scaled by the home DP size),
        then the carry is freed."""
        carry = self.carry
        if self.sp_params:
            names = list(self.sp_params)
            flat = torch.cat([carry[n].reshape(-1) for n in names])
            dist.all_reduce(flat, group=self.home.groups.tp_group)
            for name, part in zip(names, flat.split([carry[n].numel() for n in names])):
                carry[name].copy_(part.view_as(carry[name]))
        with torch.no_grad():
            for name, param in self.home.params.items():
                if self.tied is not None and param is self.tied.param:
                    self.tied.add(carry.pop(name) * self.home_dp)  # summed over the stages
                    continue
                add = (carry.pop(name) * self.home_dp).to(param.dtype)
                if param.grad is None:
                    param.grad = add
                else:
                    param.grad.add_(add)
        self.carry = None

    def _tied_boundary(self) -> None:
        """A tied pipelined home's embedding gradients summed over its first and last stage,
        then DeepSpeed's boundary backward (:mod:`~ds_stpar.seqbucket.tied`)."""
        self.tied.reduce()
        params = self.home.params.values()
        self.tied.boundary(params, lambda scalar: self._backward(True, True, scalar, None))

    # ---- one mini-batch --------------------------------------------------------------
    def accumulate(self, plan: MiniBatchPlan) -> StepStats:
        """Forward and backward of every bucket, gradients reduced into the home layout
        (DeepSpeed's reduction included); everything but the optimizer step."""
        start = time.perf_counter()
        stats = StepStats(plan.epoch, plan.index, 0.0, plan.num_targets, plan.num_tokens)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        n = max(plan.num_targets, 1)
        last = len(plan.buckets) - 1
        runs = [i for i, b in enumerate(plan.buckets) if b.num_micro_batches > 0 or i == last]
        last_use = {model_key(plan.buckets[i].strategy): i for i in runs}
        for i in runs:
            bucket = plan.buckets[i]
            key = model_key(bucket.strategy)
            is_home = key == self.home_key
            model = self.models[key]
            self._set_recompute(model, bucket.strategy)
            self._sync()
            t0 = time.perf_counter()
            if not is_home and key not in self._fresh:
                self._switch_weights(key)
                stats.switches += 1
                self._sync()
            t1 = time.perf_counter()
            mbs = self._micro_batches(bucket, model, is_home)
            if is_home and self.carry is not None:
                self._add_carry()  # before any activation of this bucket exists
            boundary = i == last and self.tied is None
            loss_sum += self._run_micro_batches(model, mbs, is_home, boundary, n)
            if i == last and self.tied is not None:
                self._tied_boundary()
            self._sync()
            t2 = time.perf_counter()
            if not is_home and last_use[key] == i:
                self._carry_grads(key)
                stats.switches += 1
                self._sync()
            t3 = time.perf_counter()
            stats.switch_s += (t1 - t0) + (t3 - t2)
            stats.bucket_s[bucket.edge] = stats.bucket_s.get(bucket.edge, 0.0) + (t2 - t1)
            stats.micro_batches[bucket.edge] = len(mbs)
            stats.bucket_tokens[bucket.edge] = bucket.num_tokens
            stats.layouts.append(bucket.strategy.layout.short())
        dist.all_reduce(loss_sum)
        stats.loss = float(loss_sum)
        stats.step_s = time.perf_counter() - start
        return stats

    def weights_changed(self) -> None:
        """The home weights changed (optimizer step, checkpoint load): switch them in again."""
        self._fresh.clear()

    def step(self, plan: MiniBatchPlan) -> StepStats:
        """:meth:`accumulate`, then the optimizer step in the home layout."""
        stats = self.accumulate(plan)
        t0 = time.perf_counter()
        self.engine.step()
        self.weights_changed()
        self._sync()
        stats.optimizer_s = time.perf_counter() - t0
        stats.step_s += stats.optimizer_s
        return stats
