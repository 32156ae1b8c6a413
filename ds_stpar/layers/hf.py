"""Tensor parallelism for HuggingFace causal LMs, driven by the model's own TP plan.

:func:`apply_stpar` replaces, in place, the linears that ``config.base_model_tp_plan`` names
with ds_stpar's parallel linears (``tp_mode`` "ring" or "cannon": the spatial-temporal layers;
"megatron": Megatron-core's own, as a baseline), keeps each rank's shard of the weights the
model already holds (a model built or loaded identically on every rank is sharded exactly),
and adapts HF's batch-first activations to the layers' Megatron sequence-parallel boundaries.

Plan. Keys are relative to the base model (``*`` = a layer index). Styles: "colwise" ->
column, "rowwise" -> row, "packed_colwise" (gate/up fused along the output, HF's
``_StridedShard(split_factor=2)``) -> column with partition stride 2; "replicated_with_grad_
allreduce" (Qwen3's q/k norms) and "embedding_*" need nothing (parameters inside the stack get
their gradients summed over TP anyway; embeddings stay replicated); any other style (e.g.
"colwise_rep", MoE styles) is refused. LlamaConfig ships q/k/v/gate/up "colwise", o/down
"rowwise". GPT-2 ships none (``GPT2Config.base_model_tp_plan`` is None in transformers 5.24);
:data:`GPT2_TP_PLAN` is the equivalent, derived here: ``attn.c_attn`` (fused [q; k; v]) is a
column of stride 3 ("qkv_colwise", our own style name: rank d keeps [q_d; k_d; v_d]),
``mlp.c_fc`` a column, both ``c_proj`` rows. GPT-2's Conv1D stores W as [in, out] (y = x W):
it is transposed to the [out, in] of ``nn.Linear`` and Megatron. Embeddings, the final norm
and the LM head stay replicated (the head's GEMM is repeated on every TP rank; a
vocabulary-parallel head is not done here).

Activations (HF is batch-first ``[b, s, h]``; Megatron's sequence-parallel layers are
``[s, b, h]``)::

    embeddings, position ids, masks, RoPE   full [b, s, h] on every TP rank
    layer 0 input    scatter: rank d keeps token block d   [b, s/P, h]   backward: all-gather
    norms, residual adds                    on the token block [b, s/P, h]
    column   [b, s/P, K] -> [s/P, b, K] -> layer -> [s, b, N/P] -> [b, s, N/P]
    core attention, activation              all tokens, heads / features block d
    row      [b, s, K/P] -> [s, b, K/P] -> layer -> [s/P, b, N] -> [b, s/P, N]
    last layer output   gather: all-gather tokens      [b, s, h]     backward: own block
    final norm, LM head, logits, loss       full and identical on every TP rank

Each transpose is a view; the column output is made contiguous because HF views it into
heads. The sequence length must be a multiple of P. HF attention takes its shapes from its
input (``hidden_states.shape[:-1]``), which is a token block, while the column projections
return every token: the attention (and MLP) module therefore runs on a full-length shape
proxy that the column projections swap back for the block (:func:`_run_on_shape_proxy`).
Heads: HF attention infers its heads from the projection width (``view(..., -1,
head_dim)``), so the config stays untouched (as with transformers' own TP, and so
``save_pretrained`` of :func:`full_state_dict` writes the real model); the per-module counts
``num_heads``, ``num_key_value_heads`` and GPT-2's ``split_size`` (how it splits c_attn's
output) are divided by P.

Gradients. Parameters outside the layer stack see the whole sequence on every rank and get
complete, identical gradients (the scatter's backward all-gathers the token-block gradients;
the gather's backward keeps this rank's block of an identical gradient). Sharded weights and
column biases get the complete gradient of their block. Replicated parameters inside the stack
(norms, row biases) see only this rank's tokens: partial sums. At each use they pass through
an identity whose backward all-reduces over TP (:func:`sum_grads`), so every ``.grad`` is final
when backward returns, whatever reduces over data parallelism next (DDP, DeepSpeed ZeRO 0-2).
Consequence: no parameter needs a TP reduction after backward, and the hot-switching
descriptors treat all TP copies as identical.

Norms. The stack's norms mark their outputs with their recipe (``norm_recipe``), as the
Megatron spec's do; the column layers' transpose carries the mark, so a ring column keeps the
norm's input, which the norm keeps anyway, and makes its output again in its backward (each of
q, k and v its own, one at a time).

Limits: no pipeline parallelism; no KV cache (generation: load :func:`full_state_dict` into a
plain model); ``output_hidden_states`` of inner layers are token blocks; dropout before the
scatter (GPT-2's ``embd_pdrop``) needs the same RNG state on the ranks of a TP group
(``transformers.set_seed`` gives every rank the same seed).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ds_stpar.config import Layout
from ds_stpar.errors import ConfigError
from ds_stpar.layers.comm import Group
from ds_stpar.layers.linear import megatron_weight_order, shard_offsets, take_block
from ds_stpar.layers.norm_recipe import mark, recipe_of
from ds_stpar.parallel import GroupCache, LayoutGroups

# style -> (kind, partition stride)
STYLES = {
    "colwise": ("column", 1),
    "packed_colwise": ("column", 2),
    "qkv_colwise": ("column", 3),
    "rowwise": ("row", 1),
}
GPT2_TP_PLAN = {
    "h.*.attn.c_attn": "qkv_colwise",
    "h.*.attn.c_proj": "rowwise",
    "h.*.mlp.c_fc": "colwise",
    "h.*.mlp.c_proj": "rowwise",
}
# entries that need nothing here: norms inside the stack get their gradients summed over TP
# anyway, and embeddings stay replicated
HANDLED_STYLES = ("replicated_with_grad_allreduce", "embedding_rowwise", "embedding_colwise")
HEAD_ATTRIBUTES = ("num_heads", "num_key_value_heads", "split_size")
HF_TP_MODES = ("megatron", "ring", "cannon")


# --------------------------------------------------------------------------------------
# Boundary communication (one autograd.Function per pattern, explicit group)
# --------------------------------------------------------------------------------------


def _all_gather(x: Tensor, group: Group, dim: int) -> Tensor:
    size = group.size()
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((size * moved.shape[0], *moved.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, moved, group=group)
    return out.movedim(0, dim)


def _own_block(x: Tensor, group: Group, dim: int) -> Tensor:
    return x.chunk(group.size(), dim=dim)[group.rank()].contiguous()


class _ScatterSequence(torch.autograd.Function):
    """forward: keep token block d of P along ``dim``; backward: all-gather the blocks."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Group, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _own_block(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_gather(grad, ctx.group, ctx.dim), None, None


class _GatherSequence(torch.autograd.Function):
    """forward: all-gather token blocks along ``dim``; backward: this rank's block (what
    follows runs identically on every rank, so every rank holds the same full gradient)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Group, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _own_block(grad, ctx.group, ctx.dim), None, None


class _SumGrads(torch.autograd.Function):
    """forward: identity; backward: one all-reduce (sum) over ``group`` of all gradients."""

    @staticmethod
    def forward(ctx, group: Group, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.group = group
        ctx.shapes = [t.shape for t in tensors]
        ctx.dtype, ctx.device = tensors[0].dtype, tensors[0].device
        return tensors

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        zeros = functools.partial(torch.zeros, dtype=ctx.dtype, device=ctx.device)
        flat = torch.cat(
            [
                (g if g is not None else zeros(shape)).reshape(-1)
                for g, shape in zip(grads, ctx.shapes)
            ]
        )
        dist.all_reduce(flat, group=ctx.group)
        parts = flat.split([shape.numel() for shape in ctx.shapes])
        return (None, *(p.view(shape) for p, shape in zip(parts, ctx.shapes)))


def scatter_sequence(x: Tensor, group: Group, dim: int = 1) -> Tensor:
    """Token block ``group.rank()`` of ``group.size()`` along ``dim`` (differentiable)."""
    size = group.size()
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ConfigError(
            f"sequence length {x.shape[dim]} is not a multiple of the TP size {size}: pad "
            f"sequences to a multiple of {size}"
        )
    return _ScatterSequence.apply(x, group, dim)


def gather_sequence(x: Tensor, group: Group, dim: int = 1) -> Tensor:
    """All token blocks of ``group`` concatenated along ``dim`` (differentiable)."""
    if group.size() == 1:
        return x
    return _GatherSequence.apply(x, group, dim)


def sum_grads(group: Group, *tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors themselves; their gradients are summed over ``group`` in backward."""
    if group.size() == 1 or not tensors:
        return tensors
    return _SumGrads.apply(group, *tensors)


# --------------------------------------------------------------------------------------
# Batch-first linears
# --------------------------------------------------------------------------------------


class _HFLinear:
    """What the batch-first adapters share: where their weight block sits in the HF weight.

    ``hf_transposed``: the HF module was a Conv1D (weight stored [in, out]); ``hf_stride``:
    partition stride along the sharded dim (fused projections); ``stpar_tp_mode``: "megatron",
    "ring" or "cannon" (Megatron and ring blocks are the same: Megatron's shards).
    """

    partition_dim: int
    hf_transposed: bool
    hf_stride: int
    stpar_tp_mode: str
    tp_group: Group

    def _offsets(self, rank: int) -> tuple[tuple[int, int, int], ...]:
        mode = "cannon" if self.stpar_tp_mode == "cannon" else "ring"
        return shard_offsets(mode, self.partition_dim, rank, self.tp_group.size())

    def weight_block(self, full: Tensor, rank: int | None = None) -> Tensor:
        """This rank's (or ``rank``'s) block of a full HF-layout weight (or its gradient)."""
        w = full.t() if self.hf_transposed else full
        ordered = megatron_weight_order(w, self.partition_dim, self.tp_group.size(), self.hf_stride)
        rank = self.tp_group.rank() if rank is None else rank
        return take_block(ordered, self._offsets(rank))

    def bias_block(self, full: Tensor) -> Tensor:
        """This rank's part of a full HF bias: a column's output block, a row's whole bias."""
        if self.partition_dim == 1:
            return full
        size = self.tp_group.size()
        return megatron_weight_order(full, 0, size, self.hf_stride).chunk(size)[
            self.tp_group.rank()
        ]

    def full_weight(self) -> Tensor:
        """The HF-layout weight from every rank's block (collective over the TP group)."""
        size = self.tp_group.size()
        blocks = [torch.empty_like(self.weight) for _ in range(size)]
        dist.all_gather(blocks, self.weight.detach().contiguous(), group=self.tp_group)
        shape = list(self.weight.shape)
        for axis, _, parts in self._offsets(0):
            shape[axis] *= parts
        ordered = self.weight.new_empty(shape)
        for rank, block in enumerate(blocks):
            take_block(ordered, self._offsets(rank)).copy_(block)
        w = _undo_megatron_order(ordered, self.partition_dim, size, self.hf_stride)
        return w.t().contiguous() if self.hf_transposed else w

    def full_bias(self) -> Tensor | None:
        """The HF bias (collective over the TP group for a column)."""
        if self.bias is None:
            return None
        if self.partition_dim == 1:
            return self.bias.detach().clone()
        size = self.tp_group.size()
        out = self.bias.new_empty(size * self.bias.shape[0])
        dist.all_gather(list(out.chunk(size)), self.bias.detach().contiguous(), group=self.tp_group)
        return _undo_megatron_order(out, 0, size, self.hf_stride)


def _undo_megatron_order(ordered: Tensor, dim: int, size: int, stride: int) -> Tensor:
    """Inverse of :func:`megatron_weight_order`: chunk ``d*stride + k`` is piece ``k*size + d``."""
    pieces = ordered.chunk(size * stride, dim=dim)
    return torch.cat([pieces[d * stride + k] for k in range(stride) for d in range(size)], dim=dim)


class _ColumnForward:
    """``[b, s/P, K] -> [b, s, N/P]`` over a Megatron-style ``[s/P, b, K] -> [s, b, N/P]``.

    ``input_proxy``: (proxy, token block) while the parent module runs on a shape proxy (see
    :func:`_run_on_shape_proxy`); the proxy is replaced by the token block it stands for.
    """

    input_proxy: tuple[Tensor, Tensor] | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.input_proxy is not None:
            proxy, block = self.input_proxy
            if x is not proxy:
                raise ConfigError(
                    f"{type(self).__name__}: its parent module transformed its input before this "
                    "column projection; ds_stpar needs the projections applied to the "
                    "module's input itself"
                )
            x = block
        y, _ = super().forward(_transposed_marked(x))
        return y.transpose(0, 1).contiguous()


def _transposed_marked(x: Tensor) -> Tensor:
    """``x.transpose(0, 1)``, carrying ``x``'s norm recipe (``norm_recipe``) if it has one: a
    ring column keeps the norm's input and makes ``norm(input).transpose(0, 1)`` again."""
    xt = x.transpose(0, 1)
    recipe = recipe_of(x)
    if recipe is not None:
        mark(xt, functools.partial(_norm_transposed, recipe.norm), recipe.input)
    return xt


def _norm_transposed(norm, x: Tensor) -> Tensor:
    return norm(x).transpose(0, 1)


class _RowForward:
    """``[b, s, K/P] -> [b, s/P, N]``; the replicated bias is added here with its gradient
    summed over TP (it sees only this rank's tokens)."""

    def forward(self, x: Tensor) -> Tensor:
        y, bias = super().forward(x.transpose(0, 1))
        y = y.transpose(0, 1)
        if bias is None:
            return y
        (bias,) = sum_grads(self.tp_group, bias)
        return y + bias


@functools.cache
def _classes(tp_mode: str) -> tuple[type, type]:
    """(column, row) batch-first classes over the linears of ``tp_mode``."""
    if tp_mode == "megatron":
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        column_base, row_base, prefix = ColumnParallelLinear, RowParallelLinear, "Megatron"
    else:
        from ds_stpar.layers.linear import TemporalColumnParallelLinear, TemporalRowParallelLinear

        column_base, row_base = TemporalColumnParallelLinear, TemporalRowParallelLinear
        prefix = "Stpar"
    column = type(
        f"{prefix}HFColumnLinear", (_ColumnForward, _HFLinear, column_base), {"partition_dim": 0}
    )
    row = type(f"{prefix}HFRowLinear", (_RowForward, _HFLinear, row_base), {"partition_dim": 1})
    column.__module__ = row.__module__ = __name__
    return column, row


def _prepare_megatron() -> None:
    """Megatron's sequence-parallel all-gather takes scratch space from a process-wide buffer
    that only ``initialize_model_parallel`` creates (it holds no process group), allocated on
    ``torch.cuda.current_device()``: on CPU the shims of ``integrations.megatron_cpu``."""
    from megatron.core import parallel_state

    if not torch.cuda.is_available():
        from ds_stpar.integrations import megatron_cpu

        megatron_cpu.apply()
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


def linear_shape(module: nn.Module) -> tuple[int, int]:
    """(out, in) of a planned linear: an HF Linear/Conv1D or its parallel replacement."""
    if isinstance(module, _HFLinear):
        return module.output_size, module.input_size
    _, _, in_features, out_features = _hf_weight(module)
    return out_features, in_features


def _hf_weight(module: nn.Module) -> tuple[Tensor, bool, int, int]:
    """(weight as stored, stored transposed?, in_features, out_features) of a Linear/Conv1D."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, nn.Linear):
        return module.weight, False, module.in_features, module.out_features
    if isinstance(module, Conv1D):
        return module.weight, True, module.weight.shape[0], module.nf
    raise ConfigError(
        f"{type(module).__name__} is not an nn.Linear or Conv1D; its TP-plan entry cannot be "
        "applied by ds_stpar"
    )


def _parallel_linear(
    module: nn.Module, kind: str, stride: int, group: Group, tp_mode: str
) -> nn.Module:
    """The batch-first parallel replacement of ``module`` holding this rank's block."""
    from megatron.core.model_parallel_config import ModelParallelConfig

    weight, transposed, in_features, out_features = _hf_weight(module)
    size = group.size()
    config = ModelParallelConfig(
        tensor_model_parallel_size=size,
        sequence_parallel=True,
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=weight.dtype,
    )
    column_cls, row_cls = _classes(tp_mode)
    common = {
        "config": config,
        "init_method": nn.init.zeros_,  # not called: perform_initialization=False
        "bias": module.bias is not None,
        "stride": stride,
        "tp_group": group,
    }
    if tp_mode != "megatron":
        common["tp_mode"] = tp_mode
    if kind == "column":
        layer = column_cls(in_features, out_features, **common)
    else:
        if stride != 1:
            raise ConfigError("row-parallel entries with a partition stride are not supported")
        layer = row_cls(
            in_features, out_features, input_is_parallel=True, skip_bias_add=True, **common
        )
    layer.hf_transposed, layer.hf_stride, layer.stpar_tp_mode = transposed, stride, tp_mode
    with torch.no_grad():
        layer.weight.copy_(layer.weight_block(weight.detach()))
        if module.bias is not None:
            layer.bias.copy_(layer.bias_block(module.bias.detach()))
    return layer.to(weight.device)


# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StparHF:
    """What :func:`apply_stpar` did to a model (kept as ``model.stpar``)."""

    tp_group: Group | None
    tp_mode: str
    tp_size: int
    layers: str  # the layer stack, e.g. "model.layers"
    plan: dict[str, tuple[str, int]]  # module -> ("column" | "row", partition stride)
    linears: tuple[str, ...]  # the replaced modules (none when tp_size is 1)


def tp_plan(model: nn.Module) -> dict[str, str]:
    """The base-model TP plan of ``model``: its config's, or :data:`GPT2_TP_PLAN` for GPT-2."""
    config = model.config.get_text_config()
    plan = getattr(config, "base_model_tp_plan", None)
    if plan:
        return dict(plan)
    if config.model_type == "gpt2":
        return dict(GPT2_TP_PLAN)
    raise ConfigError(
        f"model type {config.model_type!r} has no base_model_tp_plan; supported: models whose "
        "config carries one (e.g. llama, mistral, qwen2) and gpt2"
    )


def _resolve(model: nn.Module, plan: dict[str, str]) -> tuple[str, dict[str, tuple[str, int]]]:
    """(layer-stack name, {module name: (kind, stride)}) of ``plan`` on ``model``."""
    prefix = model.base_model_prefix
    base = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    stacks = set()
    patterns = []
    for key, style in plan.items():
        if style in HANDLED_STYLES:
            continue
        if style not in STYLES:
            raise ConfigError(
                f"TP-plan entry {key!r}: style {style!r} is not supported; supported: "
                f"{', '.join(STYLES)}"
            )
        if ".*." not in key:
            raise ConfigError(f"TP-plan entry {key!r} is outside the layer stack ('<stack>.*.')")
        stacks.add(base + key.split(".*.")[0])
        regex = re.escape(base + key).replace(r"\*", r"\d+")
        patterns.append((re.compile(regex + "$"), STYLES[style]))
    if len(stacks) != 1:
        raise ConfigError(f"the TP plan must address one layer stack, got {sorted(stacks)}")
    targets = {}
    for name, _ in model.named_modules():
        for regex, style in patterns:
            if regex.match(name):
                targets[name] = style
    if not targets:
        raise ConfigError(f"no module of {type(model).__name__} matches its TP plan {plan}")
    return stacks.pop(), targets


def _check_heads(model: nn.Module, size: int) -> None:
    config = model.config.get_text_config()
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name, None)
        if heads and heads % size:
            raise ConfigError(f"{name}={heads} is not divisible by the TP size {size}")


def _split_heads(attention: nn.Module, size: int) -> None:
    for attribute in HEAD_ATTRIBUTES:
        value = getattr(attention, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(attention, attribute, value // size)


def _sum_grads_at_use(module: nn.Module, group: Group) -> None:
    """Make ``module`` use its own parameters through :func:`sum_grads` in every forward."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        names = [n for n, p in module._parameters.items() if p is not None and p.requires_grad]
        if not names or not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        originals = [module._parameters[n] for n in names]
        module._parameters.update(zip(names, sum_grads(group, *originals)))
        try:
            return inner(*args, **kwargs)
        finally:
            module._parameters.update(zip(names, originals))

    module.forward = forward


def _mark_norm_outputs(module: nn.Module) -> None:
    """Make a norm of the stack mark its outputs with their recipe (``norm_recipe``), as the
    Megatron spec's norms do, so that the ring columns it feeds keep its input instead. The
    recipe calls the module's forward again, which, with gradients off in the backward, is the
    model's own (no :func:`sum_grads`)."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(hidden_states: Tensor, *args, **kwargs):
        out = inner(hidden_states, *args, **kwargs)
        if args or kwargs or not isinstance(out, Tensor):
            return out
        return mark(out, inner, hidden_states)

    module.forward = forward


def _run_on_shape_proxy(module: nn.Module, columns: Sequence[nn.Module], group: Group) -> None:
    """Make ``module`` (an attention or MLP whose column projections read its input) see a
    full-length input shape.

    HF attention takes its shapes from its input (``input_shape = hidden_states.shape[:-1]``,
    then ``view(*input_shape, -1, head_dim)``), but the input is this rank's token block
    ``[b, s/P, h]`` while the column projections return all ``s`` tokens. ``module`` is run on
    a proxy of shape ``[b, s, h]`` (one NaN element broadcast: no memory, and any arithmetic
    on it would poison the output instead of passing silently) and each column projection
    swaps the proxy back for the token block.
    """
    inner = module.forward
    size = group.size()

    @functools.wraps(inner)
    def forward(hidden_states: Tensor, *args, **kwargs):
        shape = list(hidden_states.shape)
        shape[1] *= size
        proxy = hidden_states.new_full((), float("nan")).expand(shape)
        for column in columns:
            column.input_proxy = (proxy, hidden_states)
        try:
            return inner(proxy, *args, **kwargs)
        finally:
            for column in columns:
                column.input_proxy = None

    module.forward = forward


def _install_boundaries(stack: Sequence[nn.Module], group: Group) -> None:
    def scatter(module, args, kwargs):
        if args:
            return (scatter_sequence(args[0], group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": scatter_sequence(kwargs["hidden_states"], group)}

    def gather(module, args, output):
        if isinstance(output, tuple):
            return (gather_sequence(output[0], group), *output[1:])
        return gather_sequence(output, group)

    stack[0].register_forward_pre_hook(scatter, with_kwargs=True)
    stack[-1].register_forward_hook(gather)


def _groups_of(
    layout_or_groups: Layout | LayoutGroups | None,
    tp_group: Group | None,
    tp_mode: str | None,
    cache: GroupCache | None,
) -> tuple[Group | None, str]:
    if isinstance(layout_or_groups, Layout):
        layout_or_groups = (cache or GroupCache()).get(layout_or_groups)
    if isinstance(layout_or_groups, LayoutGroups):
        layout = layout_or_groups.layout
        if layout.pp != 1:
            raise ConfigError(
                f"layout {layout.short()}: HF models run without pipeline parallelism; use pp=1"
            )
        if tp_group is not None and tp_group is not layout_or_groups.tp_group:
            raise ConfigError("pass either a layout/groups or tp_group, not both")
        if tp_mode is not None and tp_mode != layout.tp_mode:
            raise ConfigError(f"tp_mode {tp_mode!r} contradicts the layout's {layout.tp_mode!r}")
        return layout_or_groups.tp_group, layout.tp_mode
    if layout_or_groups is not None:
        raise ConfigError(f"expected a Layout or LayoutGroups, got {type(layout_or_groups)}")
    if tp_group is None:
        raise ConfigError("apply_stpar needs a Layout, its LayoutGroups, or tp_group=")
    return tp_group, tp_mode or "ring"


def apply_stpar(
    model: nn.Module,
    layout_or_groups: Layout | LayoutGroups | None = None,
    *,
    tp_group: Group | None = None,
    tp_mode: str | None = None,
    cache: GroupCache | None = None,
) -> nn.Module:
    """Shard ``model`` (an HF causal LM) over a TP group in place; returns it.

    Give a :class:`~ds_stpar.config.Layout` (its groups come from ``cache``, a new
    :class:`~ds_stpar.parallel.GroupCache` if None; collective on first use), its
    :class:`~ds_stpar.parallel.LayoutGroups`, or ``tp_group`` and ``tp_mode`` ("ring" by
    default). A TP size of 1 leaves the model as it is. See the module docstring for layouts.
    """
    if getattr(model, "stpar", None) is not None:
        raise ConfigError("apply_stpar was already applied to this model")
    group, mode = _groups_of(layout_or_groups, tp_group, tp_mode, cache)
    if mode not in HF_TP_MODES:
        raise ConfigError(f"tp_mode must be one of {HF_TP_MODES}, got {mode!r}")
    stack_name, targets = _resolve(model, tp_plan(model))
    size = group.size() if group is not None else 1
    if size == 1:
        model.stpar = StparHF(group, mode, 1, stack_name, targets, ())
        return model
    _check_heads(model, size)
    if mode == "megatron":
        _prepare_megatron()
    replaced = {}
    for name, (kind, stride) in targets.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        replaced[name] = _parallel_linear(getattr(parent, child), kind, stride, group, mode)
        setattr(parent, child, replaced[name])
    columns_of: dict[str, list[nn.Module]] = {}  # attention / MLP -> its column projections
    for name, layer in replaced.items():
        if layer.partition_dim == 0:
            columns_of.setdefault(name.rpartition(".")[0], []).append(layer)
    for parent_name, columns in columns_of.items():
        parent = model.get_submodule(parent_name)
        _split_heads(parent, size)
        _run_on_shape_proxy(parent, columns, group)
    stack = model.get_submodule(stack_name)
    parallel = {id(layer) for layer in replaced.values()}
    for module in stack.modules():
        if id(module) not in parallel and next(module.parameters(recurse=False), None) is not None:
            _sum_grads_at_use(module, group)
            if "norm" in type(module).__name__.lower():  # LlamaRMSNorm, nn.LayerNorm, ...
                _mark_norm_outputs(module)
    _install_boundaries(stack, group)
    model.stpar = StparHF(group, mode, size, stack_name, targets, tuple(sorted(replaced)))
    return model


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The unsharded HF state dict of a model that :func:`apply_stpar` sharded (collective
    over its TP group: every rank must call it); loads into a plain model of the same config."""
    info = getattr(model, "stpar", None)
    if info is None:
        raise ConfigError("full_state_dict needs a model sharded by apply_stpar")
    state = {
        key: value.detach().clone()
        for key, value in model.state_dict().items()
        if isinstance(value, Tensor)  # the parallel linears' empty "_extra_state"
    }
    for name in info.linears:
        layer = model.get_submodule(name)
        state[f"{name}.weight"] = layer.full_weight()
        bias = layer.full_bias()
        if bias is not None:
            state[f"{name}.bias"] = bias
    return state
