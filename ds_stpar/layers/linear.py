"""Drop-in spatial-temporal replacements for Megatron-core's parallel linear layers.

:class:`TemporalColumnParallelLinear` and :class:`TemporalRowParallelLinear` take Megatron-core
0.19's constructor arguments (plus ``tp_mode``), return ``(output, output_bias)`` as Megatron
does and keep its sequence-parallel boundary layouts::

    column: [s/P, b, K] -> [s, b, N/P]        row: [s, b, K/P] -> [s/P, b, N]

so QKV -> core attention -> out-proj and fc1 -> activation -> fc2 chain unchanged. Inside, no
collective runs: ``tp_mode="ring"`` is Instance A (``ring.py``), ``tp_mode="cannon"`` Instance B
(``cannon.py``, P = q*q, with boundary re-layouts).

Weights. The *Megatron-ordered global weight* W' [out, in] is what Megatron's TP shards
concatenate to (rank-major, so GLU interleaving with stride=2 -- rank d's rows are
[gate_d; up_d] -- and the per-rank QKV order are built in); it is also the global tensor of
Megatron's distributed checkpoint. Ring rank d holds Megatron's own shard, W'[N_d, :] (column,
[N/P, K]) or W'[:, K_d] (row, [N, K/P]); Cannon rank (r, c) holds the block
W'[NB_c, KB_(r+c)%q] ([N/q, K/q]). With ``use_cpu_initialization`` the full master weight is
initialised with ``init_method`` and sliced, so with the same seed the shards equal Megatron's;
otherwise the local block is initialised on the GPU under Megatron's CUDA RNG tracker.

Weight attributes: exactly Megatron's (``tensor_model_parallel=True``, ``partition_dim`` 0 for
column / 1 for row, ``partition_stride=stride``, ``allreduce=True``) plus
``stpar_tp_mode`` and ``stpar_shard_offsets`` -- ((axis, index, parts), ...) of the local block
in W', one axis for ring, two for Cannon. Column bias: [N/P], Megatron's shard, with the TP
attributes; row bias: [N] full, ``sequence_parallel=True`` (its gradient is this rank's tokens'
share: Megatron's finalize_model_grads all-reduces it over TP, as for RowParallelLinear).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter

from ds_stpar.errors import ConfigError
from ds_stpar.layers.cannon import cannon_column_linear, cannon_row_linear, cannon_weight_offsets
from ds_stpar.layers.comm import Group
from ds_stpar.layers.deferred_wgrad import ProjectionWgradDeferral
from ds_stpar.layers.local import LocalCompute, local_linear
from ds_stpar.layers.ring import ring_column_linear, ring_row_linear
from ds_stpar.layers.wgrad import fused_main_grad

TP_MODES = ("ring", "cannon")
Offsets = tuple[tuple[int, int, int], ...]


def resolve_tp_group(tp_group: Group | None) -> Group:
    """``tp_group`` itself; if None, Megatron's TP group when its model parallel state exists."""
    if tp_group is not None:
        return tp_group
    if dist.is_initialized():
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_tensor_model_parallel_group()
    raise ConfigError(
        "temporal linear layers need tp_group=<process group> (Megatron's model parallel "
        "state is not initialised)"
    )


def megatron_weight_order(master: Tensor, partition_dim: int, size: int, stride: int) -> Tensor:
    """W': the master weight reordered so Megatron's TP shards are its consecutive chunks.

    Megatron cuts the master into ``size * stride`` pieces along ``partition_dim`` and gives
    rank d pieces d, d+size, ...; W' concatenates those per-rank shards in rank order.
    """
    pieces = master.chunk(size * stride, dim=partition_dim)
    per_rank = [torch.cat(pieces[rank::size], dim=partition_dim) for rank in range(size)]
    return torch.cat(per_rank, dim=partition_dim)


def shard_offsets(tp_mode: str, partition_dim: int, rank: int, size: int) -> Offsets:
    """((axis, index, parts), ...) of group rank ``rank``'s weight block in W'."""
    if tp_mode == "cannon":
        return cannon_weight_offsets(rank, size)
    return ((partition_dim, rank, size),)


def take_block(full: Tensor, offsets: Offsets) -> Tensor:
    """The block of ``full`` that ``offsets`` describe."""
    for axis, index, parts in offsets:
        full = full.chunk(parts, dim=axis)[index]
    return full


def _check_divisible(what: str, value: int, by: int, why: str) -> None:
    if value % by:
        raise ConfigError(f"{what}={value} must be divisible by {by} ({why})")


class TemporalLinear(torch.nn.Module):
    """What both layers share: group and mode checks, weight creation, checkpoint sharding.

    ``local_compute`` (a :class:`~ds_stpar.layers.local.LocalCompute`, set by
    :func:`ds_stpar.layers.interleave.local_compute` for the length of one call): run only
    this rank's GEMM (``local.py``) on an input the caller gathered (column: [s, b, K] ->
    [s, b, N/P]) or return this rank's term of the output for the caller to reduce (row:
    [s, b, K/P] -> [s, b, N]), the weight gradient summed over the call's uses.

    ``wgrad_deferral`` (set on a QKV and projection pair by
    :meth:`TemporalColumnParallelLinear.defer_weight_grad_of`): the projection's weight
    gradient is made in the QKV linear's backward (``deferred_wgrad``).
    """

    partition_dim: int
    megatron_class: str
    local_compute: LocalCompute | None = None
    wgrad_deferral: ProjectionWgradDeferral | None = None

    def _setup(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method: Callable,
        stride: int,
        keep_master_weight_for_test: bool,
        is_expert: bool,
        tp_group: Group | None,
        tp_mode: str,
        name: str | None,
        allocate_weight: bool = True,
    ) -> None:
        if tp_mode == "megatron":
            raise ConfigError(
                f"tp_mode='megatron': use megatron.core.tensor_parallel.{self.megatron_class}"
            )
        if tp_mode not in TP_MODES:
            raise ConfigError(f"tp_mode must be one of {TP_MODES}, got {tp_mode!r}")
        if is_expert:
            raise ConfigError("is_expert=True: MoE experts keep Megatron's own parallel linears")
        if config.defer_embedding_wgrad_compute:
            raise ConfigError("defer_embedding_wgrad_compute is not supported by temporal layers")
        self.input_size, self.output_size = input_size, output_size
        self.config, self.tp_mode, self.name, self.is_expert = config, tp_mode, name, is_expert
        self.tp_group = resolve_tp_group(tp_group)
        size, rank = self.tp_group.size(), self.tp_group.rank()
        if size > 1 and not config.sequence_parallel:
            raise ConfigError(
                "temporal layers keep Megatron's sequence-parallel layout: set "
                "sequence_parallel=True (or tp_mode='megatron' for plain TP)"
            )
        self.sequence_parallel = config.sequence_parallel and size > 1
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        sharded = output_size if self.partition_dim == 0 else input_size
        _check_divisible(
            "output_size" if self.partition_dim == 0 else "input_size",
            sharded,
            size * stride,
            f"TP size {size} x stride {stride}",
        )
        self.shard_offsets = shard_offsets(tp_mode, self.partition_dim, rank, size)
        if tp_mode == "cannon":  # blocks [out/q, in/q]: the other dim is cut too
            q = math.isqrt(size)  # exact: shard_offsets refused a non-square group
            _check_divisible(
                "input_size" if self.partition_dim == 0 else "output_size",
                input_size if self.partition_dim == 0 else output_size,
                q,
                f"Cannon's {q} x {q} weight blocks",
            )
        self.master_weight = None
        if not allocate_weight:
            self.weight = None
            return
        shape = (output_size, input_size)
        local = take_block(torch.empty(shape, device="meta"), self.shard_offsets).shape
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = Parameter(torch.empty(local, dtype=config.params_dtype, device=device))
        if config.perform_initialization and config.use_cpu_initialization:
            master = torch.empty(shape, dtype=torch.float)
            init_method(master)
            master = master.to(config.params_dtype)
            full = megatron_weight_order(master, self.partition_dim, size, stride)
            with torch.no_grad():
                self.weight.copy_(take_block(full, self.shard_offsets))
            self.master_weight = master if keep_master_weight_for_test else None
        elif config.perform_initialization:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                init_method(self.weight)
        self._mark(self.weight, stride)
        self.weight.allreduce = True

    def _mark(self, weight: Tensor, stride: int) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        set_tensor_model_parallel_attributes(weight, True, self.partition_dim, stride)
        weight.stpar_tp_mode = self.tp_mode
        weight.stpar_shard_offsets = self.shard_offsets

    def _new_bias(self, size: int) -> Parameter:
        device = None if self.config.use_cpu_initialization else torch.cuda.current_device()
        bias = Parameter(torch.empty(size, dtype=self.config.params_dtype, device=device))
        if self.config.perform_initialization:
            with torch.no_grad():
                bias.zero_()
        bias.allreduce = True
        return bias

    def _algorithm(self) -> Callable:
        column = self.partition_dim == 0
        if self.tp_mode == "ring":
            return ring_column_linear if column else ring_row_linear
        return cannon_column_linear if column else cannon_row_linear

    def _check_input(self, x: Tensor, features: int) -> None:
        if x.dim() != 3 or x.shape[-1] != features:
            raise ConfigError(
                f"{type(self).__name__} expects input [s, b, {features}], got {tuple(x.shape)}"
            )

    def _with_bias(self, output: Tensor) -> tuple[Tensor, Tensor | None]:
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Megatron dist-checkpointing view; the global weight is W' for both modes, so a
        ring checkpoint loads into a Cannon layer and back."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        dp_cp_group = (metadata or {}).get("dp_cp_group")
        state_dict = self.state_dict(prefix="", keep_vars=True)
        axes = {"bias": 0} if self.partition_dim == 0 else {}
        if self.tp_mode == "ring":
            axes["weight"] = self.partition_dim
        else:
            weight = state_dict.pop("weight")
        sharded = make_sharded_tensors_for_checkpoint(
            state_dict,
            prefix,
            axes,
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=dp_cp_group,
        )
        if self.tp_mode == "cannon":
            prepend = len(sharded_offsets)
            blocks = [(axis + prepend, index, parts) for axis, index, parts in self.shard_offsets]
            dp_rank = dp_cp_group.rank() if dp_cp_group is not None else 0
            sharded[f"{prefix}weight"] = ShardedTensor.from_rank_offsets(
                f"{prefix}weight",
                weight,
                *sharded_offsets,
                *blocks,
                replica_id=(0, 0, dp_rank),
                prepend_axis_num=prepend,
            )
        return sharded

    def set_extra_state(self, state) -> None:
        """Extra state is ignored (as in Megatron's local linears)."""

    def get_extra_state(self) -> None:
        """No extra state; kept for Transformer Engine state-dict compatibility."""
        return None

    def backward_dw(self) -> None:
        """dW is computed inside backward; nothing is deferred (Megatron's interface)."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(in_features={self.input_size}, out_features="
            f"{self.output_size}, bias={self.bias is not None}, TP={self.tp_group.size()}, "
            f"tp_mode={self.tp_mode})"
        )


class TemporalColumnParallelLinear(TemporalLinear):
    """Y = X W^T + b with W split along its output dim; Megatron ColumnParallelLinear's
    interface with sequence parallelism: ``y_shard_n [s, b, N/P] = f(x_shard_m [s/P, b, K])``.

    ``gather_output`` / ``runtime_gather_output`` are not supported (Megatron uses them for the
    output layer, which stays a Megatron layer); ``disable_grad_reduce`` has no effect under
    sequence parallelism, as in Megatron; ``tp_comm_buffer_name`` is unused, as in Megatron.
    """

    partition_dim = 0
    megatron_class = "ColumnParallelLinear"

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method: Callable,
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        embedding_activation_buffer: list[Tensor] | None = None,
        grad_output_buffer: list[Tensor] | None = None,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        disable_grad_reduce: bool = False,
        tp_group: Group | None = None,
        name: str | None = None,
        tp_mode: str = "ring",
    ):
        super().__init__()
        if gather_output:
            raise ConfigError("gather_output=True is not supported; use Megatron's layer there")
        if skip_weight_param_allocation and tp_mode == "cannon":
            raise ConfigError("skip_weight_param_allocation needs tp_mode='ring' (Megatron shards)")
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.disable_grad_reduce = disable_grad_reduce
        self._setup(
            input_size,
            output_size,
            config=config,
            init_method=init_method,
            stride=stride,
            keep_master_weight_for_test=keep_master_weight_for_test,
            is_expert=is_expert,
            tp_group=tp_group,
            tp_mode=tp_mode,
            name=name,
            allocate_weight=not skip_weight_param_allocation,
        )
        self.output_size_per_partition = output_size // self.tp_group.size()
        if bias:
            self.bias = self._new_bias(self.output_size_per_partition)
            from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)
        self._register_load_state_dict_pre_hook(
            lambda state_dict, prefix, *args, **kwargs: state_dict.setdefault(
                f"{prefix}_extra_state"
            )
        )

    def forward(
        self,
        input_: Tensor,
        weight: Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """[s/P, b, K] -> ([s, b, N/P], bias if skip_bias_add else None)."""
        if runtime_gather_output:
            raise ConfigError("runtime_gather_output=True is not supported by temporal layers")
        if weight is None:
            if self.weight is None:
                raise ConfigError("skip_weight_param_allocation=True: pass weight= to forward")
            weight = self.weight
        elif tuple(weight.shape) != (self.output_size_per_partition, self.input_size):
            raise ConfigError(
                f"supplied weight has shape {tuple(weight.shape)}, expected "
                f"{(self.output_size_per_partition, self.input_size)}"
            )
        self._check_input(input_, self.input_size)
        main_grad = fused_main_grad(weight, self.gradient_accumulation_fusion)
        if self.local_compute is not None:
            call = self.local_compute
            grads = call.weight_grad(weight, main_grad)
            return self._with_bias(local_linear(input_, weight, grads, call.weight_grad_first))
        if self.wgrad_deferral is not None:
            deferred = self.wgrad_deferral.start(self.tp_group, input_.device)
            output = ring_column_linear(input_, weight, self.tp_group, main_grad, deferred)
            return self._with_bias(output)
        output = self._algorithm()(input_, weight, self.tp_group, main_grad)
        return self._with_bias(output)

    def defer_weight_grad_of(self, row: TemporalRowParallelLinear, always: bool = False) -> None:
        """Make ``row``'s (the attention projection's) weight gradient in this layer's (the
        QKV linear's) backward, after the attention's, where that saves memory and costs
        none: ring mode, P = 2, no ``gradient_accumulation_fusion``, hops by the copy engines
        (``deferred_wgrad``; ``always``: any transport, for tests). Both layers must be ring
        layers of one TP group, and each forward of this layer must be followed by ``row``'s
        before the next."""
        if self.tp_mode != "ring" or row.tp_mode != "ring":
            raise ConfigError("deferring the projection's weight gradient needs tp_mode='ring'")
        if row.tp_group is not self.tp_group:
            raise ConfigError("the QKV and projection layers must share one TP group")
        deferral = ProjectionWgradDeferral(row, always)
        self.wgrad_deferral = row.wgrad_deferral = deferral


class TemporalRowParallelLinear(TemporalLinear):
    """Y = X W^T + b with W split along its input dim; Megatron RowParallelLinear's
    interface with sequence parallelism: ``y_shard_m [s/P, b, N] = f(x_shard_k [s, b, K/P])``.

    ``input_is_parallel`` must be True (as Megatron requires with sequence parallelism); the
    sequence length s must be divisible by P.
    """

    partition_dim = 1
    megatron_class = "RowParallelLinear"

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method: Callable,
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group: Group | None = None,
        name: str | None = None,
        tp_mode: str = "ring",
    ):
        super().__init__()
        if not input_is_parallel:
            raise ConfigError("input_is_parallel=False is not supported (sequence parallelism)")
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self._setup(
            input_size,
            output_size,
            config=config,
            init_method=init_method,
            stride=stride,
            keep_master_weight_for_test=keep_master_weight_for_test,
            is_expert=is_expert,
            tp_group=tp_group,
            tp_mode=tp_mode,
            name=name,
        )
        self.input_size_per_partition = input_size // self.tp_group.size()
        if bias:
            self.bias = self._new_bias(output_size)
            self.bias.sequence_parallel = self.config.sequence_parallel
        else:
            self.register_parameter("bias", None)
        self._register_load_state_dict_pre_hook(
            lambda state_dict, prefix, *args, **kwargs: state_dict.setdefault(
                f"{prefix}_extra_state"
            )
        )

    def forward(self, input_: Tensor) -> tuple[Tensor, Tensor | None]:
        """[s, b, K/P] -> ([s/P, b, N], bias if skip_bias_add else None)."""
        self._check_input(input_, self.input_size_per_partition)
        main_grad = fused_main_grad(self.weight, self.gradient_accumulation_fusion)
        if self.local_compute is not None:
            if self.bias is not None and not self.skip_bias_add:
                raise ConfigError(
                    "local_compute returns a partial sum: the bias must be added after the "
                    "reduction (skip_bias_add=True)"
                )
            call = self.local_compute
            grads = call.weight_grad(self.weight, main_grad)
            return local_linear(input_, self.weight, grads, call.weight_grad_first), self.bias
        size = self.tp_group.size()
        if input_.shape[0] % size:
            raise ConfigError(
                f"sequence length {input_.shape[0]} is not divisible by the TP size {size}: "
                f"pad sequences to a multiple of {size}"
            )
        if self.wgrad_deferral is not None:
            deferred = self.wgrad_deferral.take()
            output = ring_row_linear(input_, self.weight, self.tp_group, main_grad, deferred)
            return self._with_bias(output)
        output = self._algorithm()(input_, self.weight, self.tp_group, main_grad)
        return self._with_bias(output)
