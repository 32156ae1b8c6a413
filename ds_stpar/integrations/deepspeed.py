"""The DeepSpeed engine of the home layout: CPU set-up, the mpu adapter, the engine config.

Only the home layout (the longest bucket's, :attr:`StparConfig.home`) is wrapped by
DeepSpeed: fp32 master weights and optimizer state live there and never move. The other
layouts' models are plain modules that the runner fills by hot switching.

- :func:`prepare_cpu` — on a machine without CUDA: ``DS_ACCELERATOR=cpu`` and no JIT build of
  DeepSpeed's shared-memory comm op (~50 s of g++ per fresh machine). It must run before
  ``deepspeed`` is imported; it does nothing where CUDA is available.
- :class:`LayoutMPU` — DeepSpeed asks an ``mpu`` for the old Megatron names
  (``get_model_parallel_*`` = tensor parallel, ``get_data_parallel_*``, ``get_pipe_parallel_*``);
  this adapter answers them from the home layout's :class:`~ds_stpar.parallel.LayoutGroups`,
  so DeepSpeed reduces gradients over the home DP group and counts TP shards once in the
  gradient norm.
- :func:`engine_config` — the DeepSpeed dict to initialise with: the user's config minus the
  "ds_stpar" section, with the batch fields made consistent with how ds_stpar batches (tokens
  per step come from the section; DeepSpeed sees ``micro_batch x dp`` rows and
  ``gradient_accumulation_steps`` 1, since the number of micro-batches per step varies and the
  runner marks the accumulation boundary itself). On CPU: fp32 (bf16/fp16 off) and torch's
  Adam (DeepSpeed's own would JIT-compile).
- :func:`check_world_size` — the plan's world size must equal the launched one; otherwise a
  one-line error naming the ``ds-stpar plan`` command that fits.
- :func:`build_engine` — ``deepspeed.initialize`` with all of the above. ZeRO 0, 1 and 2 are
  supported; ZeRO 3 partitions the home parameters themselves over DP, which the switch
  descriptors cannot address: refused with a :class:`~ds_stpar.errors.ConfigError`.
"""

from __future__ import annotations

import copy
import importlib
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from ds_stpar.config import StparConfig
from ds_stpar.errors import ConfigError
from ds_stpar.parallel import LayoutGroups

SUPPORTED_ZERO = (0, 1, 2)


def on_cpu() -> bool:
    return not torch.cuda.is_available()


def prepare_cpu() -> None:
    """CPU-only: select DeepSpeed's CPU accelerator and skip its shm op build (idempotent).

    Call before importing ``deepspeed``. The accelerator choice is read once, at import.
    """
    if not on_cpu():
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    comm = importlib.import_module("deepspeed.comm.torch")
    comm.build_shm_op = lambda: None
    sys.modules["deepspeed.comm.torch"].build_shm_op = comm.build_shm_op


class LayoutMPU:
    """DeepSpeed's ``mpu`` interface over one layout's explicit process groups."""

    def __init__(self, groups: LayoutGroups) -> None:
        self.groups = groups

    # tensor parallel (DeepSpeed's "model parallel")
    def get_tensor_model_parallel_group(self):
        return self.groups.tp_group

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.groups.layout.tp

    def get_tensor_model_parallel_rank(self) -> int:
        return self.groups.tp_index

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.groups.tp_ranks[0]

    # model parallel: one model replica, TP x PP (gradient norms are summed over it; with
    # pp = 1 it is the TP group)
    def get_model_parallel_group(self):
        return self.groups.model_group

    def get_model_parallel_world_size(self) -> int:
        return self.groups.layout.tp * self.groups.layout.pp

    def get_model_parallel_rank(self) -> int:
        return self.groups.pp_index * self.groups.layout.tp + self.groups.tp_index

    # data parallel
    def get_data_parallel_group(self):
        return self.groups.dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.groups.layout.dp

    def get_data_parallel_rank(self) -> int:
        return self.groups.dp_index

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.groups.dp_ranks)

    # pipeline parallel
    def get_pipeline_model_parallel_group(self):
        return self.groups.pp_group

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.groups.layout.pp

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.groups.pp_index

    get_pipe_parallel_group = get_pipeline_model_parallel_group
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank


def plan_command(cfg: StparConfig, world: int) -> str:
    """The ``ds-stpar plan`` command that writes a plan for ``world`` GPUs of this run."""
    train = cfg.train
    return (
        f"ds-stpar plan --gpus {world} --model <{cfg.model.name} or its JSON> "
        f"--seq-len {train.seq_len} --global-batch {train.global_batch} --dtype {train.dtype} "
        f"--gpus-per-node {min(world, cfg.gpus_per_node)} --out DIR"
    )


def check_world_size(cfg: StparConfig, world: int, where: str = "config") -> None:
    """Refuse a launch whose world size differs from the plan's."""
    if cfg.world_size != world:
        raise ConfigError(
            f"{where}: the plan is for {cfg.world_size} processes but {world} were launched; "
            f"launch {cfg.world_size} or re-plan with `{plan_command(cfg, world)}`"
        )


def zero_stage(ds_config: dict) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def engine_config(ds_config: dict, cfg: StparConfig, cpu: bool | None = None) -> dict[str, Any]:
    """The dict given to ``deepspeed.initialize`` (see the module docstring)."""
    cpu = on_cpu() if cpu is None else cpu
    out = copy.deepcopy({k: v for k, v in ds_config.items() if k != "ds_stpar"})
    stage = zero_stage(out)
    if stage not in SUPPORTED_ZERO:
        raise ConfigError(
            f"ZeRO stage {stage} is not supported: ZeRO 3 partitions the home layout's "
            "parameters over data parallel ranks, which hot switching cannot read; use "
            "zero_optimization.stage 0, 1 or 2"
        )
    home = cfg.home
    out["train_micro_batch_size_per_gpu"] = home.micro_batch
    out["gradient_accumulation_steps"] = 1
    out["train_batch_size"] = home.micro_batch * home.layout.dp
    if cpu:
        for key in ("bf16", "fp16"):
            if key in out:
                out[key] = {**out[key], "enabled": False}
        optimizer = out.get("optimizer")
        if optimizer and str(optimizer.get("type", "")).lower() in ("adam", "adamw"):
            optimizer["params"] = {**optimizer.get("params", {}), "torch_adam": True}
    return out


def model_dtype(ds_config: dict, cpu: bool | None = None) -> str:
    """The dtype the models run in: fp32 on CPU, else what the DeepSpeed config enables."""
    if on_cpu() if cpu is None else cpu:
        return "fp32"
    if ds_config.get("bf16", {}).get("enabled"):
        return "bf16"
    if ds_config.get("fp16", {}).get("enabled"):
        return "fp16"
    return "fp32"


def build_engine(model: torch.nn.Module, ds_config: dict, groups: LayoutGroups):
    """``deepspeed.initialize`` of the home ``model`` over ``groups`` (an initialised
    torch.distributed world is reused). ``ds_config``: from :func:`engine_config`."""
    prepare_cpu()
    import deepspeed

    if not dist.is_initialized():
        raise ConfigError("torch.distributed is not initialised; launch with `deepspeed`")
    if zero_stage(ds_config) not in SUPPORTED_ZERO:
        raise ConfigError("ZeRO stage 3 is not supported with hot switching; use 0, 1 or 2")
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config,
        mpu=LayoutMPU(groups),
        dist_init_required=False,
    )
    return engine


# --------------------------------------------------------------------------------------
# Master weights and optimizer state of the home model (for layout-independent checkpoints)
# --------------------------------------------------------------------------------------
# Each function works on one local parameter of the home model and returns or takes its
# whole local (TP-shard) tensor, whatever ZeRO stage 0-2 partitions over DP: DeepSpeed's
# safe_get/set_full_* where it keeps an fp32 copy (ZeRO 1/2, bf16), the parameter itself and
# the torch optimizer's state where it does not (ZeRO 0 in fp32).


def _torch_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer doing the update (its params: flat fp32 partitions under ZeRO)."""
    return engine.basic_optimizer


def get_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_fp32_param

    value = safe_get_full_fp32_param(param)
    return (param.detach() if value is None else value).float()


def set_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set the master copy (if any) and the module parameter itself."""
    from deepspeed.utils import safe_set_full_fp32_param

    value = value.to(param.device)
    if hasattr(param, "_hp_mapping"):
        safe_set_full_fp32_param(param, value.float())
    with torch.no_grad():
        param.copy_(value.to(param.dtype))


def optimizer_state_keys(engine) -> list[str]:
    """Per-element state tensors of the optimizer (AdamW: exp_avg, exp_avg_sq); none before
    the first step."""
    opt = _torch_optimizer(engine)
    for state in opt.state.values():
        return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0)
    return []


def optimizer_step_count(engine) -> int:
    """The optimizer's own step counter (Adam's bias correction), 0 before the first step."""
    for state in _torch_optimizer(engine).state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def get_optimizer_state(engine, param: torch.nn.Parameter, key: str) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_optimizer_state

    if hasattr(param, "_hp_mapping"):
        return safe_get_full_optimizer_state(param, key).float()
    return _torch_optimizer(engine).state[param][key].float()


def optimizer_hyperparameters(engine) -> list[dict]:
    """Per param group, the scalar settings a scheduler may have changed (lr, betas, ...):
    a scheduler's ``load_state_dict`` restores its counter but not the optimizer's lr."""
    plain = (int, float, bool, str, tuple, list, type(None))
    return [
        {k: v for k, v in group.items() if k != "params" and isinstance(v, plain)}
        for group in _torch_optimizer(engine).param_groups
    ]


def set_optimizer_hyperparameters(engine, groups: list[dict]) -> None:
    opt = _torch_optimizer(engine)
    if len(groups) != len(opt.param_groups):
        raise ConfigError(
            f"the checkpoint has {len(groups)} optimizer parameter groups, this run "
            f"{len(opt.param_groups)}; resume with the saved run's optimizer settings"
        )
    for group, saved in zip(opt.param_groups, groups):
        group.update(saved)


def prepare_optimizer_state(engine, keys: list[str], step: int) -> None:
    """Create the optimizer's state tensors (zeros) where no step has made them yet, set its
    step counter to ``step`` and link DeepSpeed's per-parameter views of the state."""
    opt = _torch_optimizer(engine)
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            for key in keys:
                if key not in state:
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            old = state.get("step")
            state["step"] = (
                torch.full_like(old, float(step))
                if torch.is_tensor(old)
                else torch.tensor(float(step), dtype=torch.float32)
            )
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()


def set_optimizer_state(engine, param: torch.nn.Parameter, key: str, value: torch.Tensor) -> None:
    from deepspeed.utils import safe_set_full_optimizer_state

    if hasattr(param, "_hp_mapping"):
        safe_set_full_optimizer_state(param, value.to(param.device).float(), key)
    else:
        state = _torch_optimizer(engine).state[param][key]
        state.copy_(value.to(device=state.device, dtype=state.dtype))
