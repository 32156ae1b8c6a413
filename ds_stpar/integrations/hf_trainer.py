"""``StparTrainer``: a ``transformers.Trainer`` that trains with a ds_stpar plan.

    args = TrainingArguments(output_dir=..., deepspeed="ds_stpar.json", max_steps=...,
                             use_cpu=True)          # use_cpu on CPU-only machines
    trainer = StparTrainer(model=model, args=args, train_dataset=documents)
    trainer.train()

``train_dataset`` holds documents (an ``input_ids`` column: a ``datasets.Dataset``, e.g. from
:func:`~ds_stpar.seqbucket.data.load_documents`, or a
:class:`~ds_stpar.seqbucket.data.Documents`). The plan (the "ds_stpar" section of the
DeepSpeed JSON) decides everything about batching; TrainingArguments decide the optimisation.

What happens, and where:

- ``__init__``: the plan is read and checked against the launched world; the model is sharded
  in place for the home layout (the longest bucket's) with
  :func:`~ds_stpar.layers.hf.apply_stpar`, and a sharded copy is made for every other layout
  the buckets use. The DeepSpeed config given to the Trainer is
  :func:`~ds_stpar.integrations.deepspeed.engine_config` of the user's (micro-batch = the home
  strategy's, ``gradient_accumulation_steps`` 1 -- one Trainer step is one whole mini-batch
  plan --, CPU: fp32 and torch's Adam), minus ``train_batch_size`` (see "batch arithmetic"),
  with the optimizer's lr/betas/eps/weight decay and ``gradient_clipping`` set to "auto" so
  that TrainingArguments fill them (transformers refuses a DeepSpeed value that differs from
  the TrainingArguments one unless it is "auto"; and a missing ``gradient_clipping`` would
  silently become accelerate's 1.0, whatever ``max_grad_norm`` says).
- data: the train dataloader yields one :class:`~ds_stpar.seqbucket.sampler.MiniBatchPlan` per
  step (every rank the same plan; it says which rows each DP rank runs), from a
  :class:`~ds_stpar.seqbucket.sampler.BucketSampler` seeded with ``args.seed``. It is not
  sharded by accelerate.
- ``training_step``: the whole plan, through :class:`HFBucketRunner` (the runner of
  ``seqbucket.runner`` with HF models): for each bucket, switch the weights into its layout,
  run its micro-batches (packed rows: position ids restart per document, block-diagonal
  causal mask, loss = sum of token losses / the mini-batch's target count), carry the
  gradients home; then the DeepSpeed step. Switching lives here because callbacks may only
  change ``TrainerControl``. It returns the mini-batch's mean token loss (all ranks).
- DeepSpeed gets an ``mpu`` (:class:`~ds_stpar.integrations.deepspeed.LayoutMPU` of the home
  layout), so it reduces gradients over the home DP group only, counts TP shards once in the
  gradient norm and names checkpoints per TP rank. accelerate 1.15 builds the engine in
  ``Accelerator._prepare_deepspeed`` and passes an ``mpu`` only for its Ulysses sequence
  parallelism; there is no argument for it. :func:`deepspeed_initialize_with` therefore
  wraps ``deepspeed.initialize`` while ``StparTrainer.train`` runs (restored right after),
  adding ``mpu=``.
- batch arithmetic: DeepSpeed asserts ``train_batch_size = micro x GAS x DP``; transformers
  computes ``train_batch_size`` from the whole world (``world x micro x GAS``), which is wrong
  under TP. The key is dropped, so transformers checks nothing and DeepSpeed derives it from
  the micro-batch, GAS 1 and the DP size of the mpu.
- ``save_model`` writes an unsharded HF checkpoint (``full_state_dict``, collective), loadable
  by ``from_pretrained``; the Trainer's DeepSpeed checkpoints stay per TP rank.

Limits: ZeRO 3 is refused (it partitions the home parameters); pipeline parallelism is
refused; resuming needs the same layout and world; evaluation runs the home model on HF
batches (sequence lengths a multiple of the home TP size). Models with Conv1D projections
(GPT-2) keep them as Conv1D in a tp=1 layout, stored [in, out]; the switch reads and writes
them through transposed views (``LayoutModel.transposed``), so tp=1 and TP layouts switch
either way.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from transformers import Trainer, TrainingArguments

from ds_stpar.config import StparConfig, Strategy, read_json
from ds_stpar.errors import ConfigError
from ds_stpar.integrations.deepspeed import (
    LayoutMPU,
    check_world_size,
    engine_config,
    model_dtype,
    prepare_cpu,
)
from ds_stpar.layers.hf import apply_stpar, full_state_dict, linear_shape
from ds_stpar.parallel import GroupCache
from ds_stpar.seqbucket.data import Documents
from ds_stpar.seqbucket.loss import token_loss
from ds_stpar.seqbucket.runner import BucketRunner, LayoutModel, check_strategies, model_key
from ds_stpar.seqbucket.sampler import BucketSampler, MicroBatch, RowCost
from ds_stpar.seqbucket.shards import ParamSpec

PLAN_KEY = "stpar_plan"  # the key of the plan in each "batch" the Trainer loop sees
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OPTIMIZER_ARGUMENT_KEYS = ("lr", "betas", "eps", "weight_decay")  # filled from TrainingArguments
SCHEDULER_ARGUMENT_KEYS = ("total_num_steps", "warmup_num_steps", "warmup_max_lr")  # likewise


# --------------------------------------------------------------------------------------
# DeepSpeed plumbing
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def deepspeed_initialize_with(mpu) -> Iterator[None]:
    """While active, ``deepspeed.initialize`` is called with ``mpu=mpu`` (see the module
    docstring: accelerate has no argument for it)."""
    import deepspeed

    original = deepspeed.initialize

    def initialize(*args, **kwargs):
        if kwargs.get("mpu") is not None:
            raise ConfigError(
                "accelerate passes its own mpu (Ulysses sequence parallelism); it cannot be "
                "combined with a ds_stpar plan: drop parallelism_config's sp settings"
            )
        return original(*args, **{**kwargs, "mpu": mpu})

    deepspeed.initialize = initialize
    try:
        yield
    finally:
        deepspeed.initialize = original


def hf_engine_config(ds_config: dict, cfg: StparConfig) -> dict:
    """The DeepSpeed dict for the Trainer (module docstring: batch fields from the plan,
    ``train_batch_size`` dropped, optimisation values "auto").

    ``gradient_clipping`` is always set to "auto": when the key is missing, accelerate inserts
    its own default of 1.0 instead of ``TrainingArguments.max_grad_norm``. The scheduler's step
    counts and LR bounds (``ds-stpar plan`` writes its own) become "auto" too: the Trainer's
    ``max_steps``/``warmup_steps``/``learning_rate`` decide, and transformers refuses a
    DeepSpeed value that differs from them.
    """
    out = engine_config(ds_config, cfg)
    out.pop("train_batch_size", None)
    out["gradient_clipping"] = "auto"
    optimizer = out.get("optimizer")
    if optimizer is not None:
        params = optimizer.setdefault("params", {})
        for key in OPTIMIZER_ARGUMENT_KEYS:
            if key == "lr" or key in params:  # betas/eps only where the optimizer takes them
                params[key] = "auto"
    scheduler = out.get("scheduler")
    if scheduler is not None:  # the planner's step counts give way to max_steps/warmup_steps
        params = scheduler.setdefault("params", {})
        for key in SCHEDULER_ARGUMENT_KEYS:
            if key in params:
                params[key] = "auto"
    return out


def _read_plan(args: TrainingArguments) -> tuple[dict, StparConfig]:
    if not args.deepspeed:
        raise ConfigError(
            "StparTrainer needs TrainingArguments(deepspeed='ds_stpar.json'): write one with "
            "`ds-stpar plan --out DIR`"
        )
    where = args.deepspeed if isinstance(args.deepspeed, str) else "the deepspeed dict"
    ds_config = read_json(args.deepspeed) if isinstance(args.deepspeed, str) else args.deepspeed
    if not isinstance(ds_config, dict) or "ds_stpar" not in ds_config:
        raise ConfigError(
            f'{where}: no "ds_stpar" section; write one with `ds-stpar plan --out DIR`'
        )
    return ds_config, StparConfig.from_dict(ds_config["ds_stpar"], f"{where}: ds_stpar")


def _check_plan(cfg: StparConfig) -> None:
    strategies = [b.strategy for b in cfg.buckets]
    edges = [b.max_len for b in cfg.buckets]
    check_strategies(strategies, edges)
    for strategy, edge in zip(strategies, edges):
        if strategy.layout.pp > 1:
            raise ConfigError(
                f"bucket {edge}: pp={strategy.layout.pp}; a transformers model runs without "
                "pipeline parallelism here (launch/pretrain.py runs pipelined megatron-core "
                "models): re-plan with pp=1"
            )
        tp = strategy.layout.tp
        if edge % tp:  # apply_stpar scatters every sequence over the TP group
            raise ConfigError(f"bucket {edge}: TP={tp} needs the edge to be a multiple of {tp}")
        if strategy.recompute == "selective":
            raise ConfigError(
                f"bucket {edge}: selective recompute is megatron-core's; a transformers model "
                "recomputes whole layers (gradient checkpointing): use recompute none or full"
            )


# --------------------------------------------------------------------------------------
# Models of every layout, and the runner over them
# --------------------------------------------------------------------------------------


def build_hf_layout_models(
    model: nn.Module,
    cfg: StparConfig,
    cache: GroupCache,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[Strategy, LayoutModel]:
    """``model`` sharded in place for the home layout, plus a sharded copy for every other
    layout of the plan (collective: groups are created on first use, in the same order on
    every rank). The copies' weights are overwritten by switching before they are used."""
    home_key = model_key(cfg.home)
    others = []
    for bucket in cfg.buckets:
        key = model_key(bucket.strategy)
        if key != home_key and key not in others:
            others.append(key)
    models = {}
    for key in others:
        groups = cache.get(key.layout)
        module = apply_stpar(copy.deepcopy(model), groups).to(device=device, dtype=dtype)
        models[key] = LayoutModel(key, groups, module, conv1d_weights(module))
    groups = cache.get(home_key.layout)
    module = apply_stpar(model, groups)
    models[home_key] = LayoutModel(home_key, groups, module, conv1d_weights(module))
    return models


def conv1d_weights(module: nn.Module) -> frozenset[str]:
    """Weights of planned projections that ``apply_stpar`` left as HF Conv1D (a tp=1 layout
    of GPT-2): stored [in, out], transposed against the descriptors' [out, in]."""
    from transformers.pytorch_utils import Conv1D

    return frozenset(
        f"{owner}.weight"
        for owner in module.stpar.plan
        if isinstance(module.get_submodule(owner), Conv1D)
    )


def hf_param_specs(model: nn.Module) -> dict[str, ParamSpec]:
    """Full-tensor descriptors of a model prepared by ``apply_stpar``, by parameter name.

    They follow the model's TP plan, whatever its own TP size and mode, so one set describes
    every layout: planned weights in the [out, in] orientation of the parallel layers (a
    Conv1D's is transposed), sharded along dim 0 (column) or 1 (row) with the plan's stride,
    ``cannon_blocks`` (2-D blocks under tp_mode cannon, Megatron's shards otherwise, as
    ``_HFLinear`` holds them); column biases along dim 0 with the same stride (Megatron's
    shard in every mode); everything else replicated. ``apply_stpar`` completes TP-partial
    gradients during backward, so no TP copy is a partial sum (``sequence_parallel_grad``
    False throughout).
    """
    info = model.stpar
    in_stack = re.compile(rf"^{re.escape(info.layers)}\.(\d+)\.")
    specs = {}
    for name, param in model.named_parameters():
        match = in_stack.match(name)
        layer = int(match.group(1)) if match else None
        owner, _, leaf = name.rpartition(".")
        if owner not in info.plan:
            specs[name] = ParamSpec(tuple(param.shape), layer=layer)
            continue
        kind, stride = info.plan[owner]
        dim = 0 if kind == "column" else 1
        out_features, in_features = linear_shape(model.get_submodule(owner))
        if leaf == "weight":
            shape = (out_features, in_features)
            specs[name] = ParamSpec(shape, True, dim, stride, cannon_blocks=True, layer=layer)
        elif kind == "column":
            specs[name] = ParamSpec((out_features,), True, 0, stride, layer=layer)
        else:
            specs[name] = ParamSpec((out_features,), layer=layer)
    return specs


class HFBucketRunner(BucketRunner):
    """:class:`~ds_stpar.seqbucket.runner.BucketRunner` over HF models sharded by
    ``apply_stpar``: descriptors from :func:`hf_param_specs` of the home model, the HF
    forward in ``_loss``; switching, gradient carry, loss accounting and the DeepSpeed
    boundary handling are the base class's (no TP all-reduce hooks: no descriptor is
    ``sequence_parallel_grad``, ``apply_stpar`` sums TP-partial gradients in backward).
    """

    def __init__(
        self,
        engine,
        models: Mapping[Strategy, LayoutModel],
        home: Strategy,
        tokens: Callable[[int], np.ndarray],
        pad_id: int,
        gpus_per_node: int = 8,
    ) -> None:
        specs = hf_param_specs(models[model_key(home)].module)
        # tied_embeddings: read by the Megatron descriptors only (an HF tied pair is one
        # parameter, replicated)
        super().__init__(engine, models, home, tokens, pad_id, False, gpus_per_node, specs)

    @staticmethod
    def _set_recompute(model: LayoutModel, strategy: Strategy) -> None:
        """Full recompute = transformers' gradient (activation) checkpointing, non-reentrant,
        switched per bucket on the shared model: of every decoder layer, or with
        ``recompute_layers`` k of the first k (Megatron's block method; pp is 1 here, so the
        model is the one stage).

        Why per-layer flags do that (transformers 5.24, modeling_layers.py and
        modeling_utils.py): a decoder layer derived from ``GradientCheckpointingLayer``
        (Llama, Qwen2, GPT-2, ...) has its ``forward`` wrapped to run through
        ``_gradient_checkpointing_func`` iff its own ``gradient_checkpointing`` flag is set
        (and it trains with grad enabled), read at every call. Enabling checkpointing gives
        every module that function and sets every flag (transformers' own ``every_n_layers``
        sets the layers' flags one by one the same way); the flags of layers k and on are then
        cleared. Layers without that class (older transformers) are checkpointed by the
        model's own loop, all or none: k short of all of them is refused here, at the bucket's
        first run. Turning recompute off also removes the input-embedding hook that enabling
        registers, which transformers' disable leaves (each off-on switch would add one)."""
        module = model.module
        layers = module.get_submodule(module.stpar.layers)
        k = strategy.recomputed_layers(len(layers))
        on = any(getattr(m, "gradient_checkpointing", False) for m in module.modules())
        if not k:
            if on:
                disable = getattr(module, "activation_checkpointing_disable", None)
                (disable or module.gradient_checkpointing_disable)()
                if getattr(module, "_require_grads_hooks", None) or hasattr(
                    module, "_require_grads_hook"
                ):
                    module.disable_input_require_grads()
            return
        try:
            from transformers.modeling_layers import GradientCheckpointingLayer as checkpointed
        except ImportError:  # transformers before GradientCheckpointingLayer
            checkpointed = ()
        per_layer = all(isinstance(layer, checkpointed) for layer in layers)
        if k < len(layers) and not per_layer:
            raise ConfigError(
                f"{strategy.short()}: recompute_layers={strategy.recompute_layers} needs decoder "
                f"layers derived from transformers' GradientCheckpointingLayer (checkpointed one "
                f"by one); {type(layers[0]).__name__} is not: use recompute_layers 0"
            )
        if not on:
            enable = getattr(module, "activation_checkpointing_enable", None)
            (enable or module.gradient_checkpointing_enable)({"use_reentrant": False})
        if per_layer:
            for index, layer in enumerate(layers):
                layer.gradient_checkpointing = index < k

    def _loss(self, module, model: LayoutModel, mb: MicroBatch, num_targets: int):
        """Packed rows through the HF forward; sum of token losses / the mini-batch's count."""
        batch = self._batch(model, mb)
        out = module(
            input_ids=batch.input_ids.to(self.device),
            position_ids=batch.position_ids.to(self.device),
            attention_mask=batch.attention_mask().to(self.device),
            use_cache=False,
        )
        return token_loss(out.logits, batch.labels.to(self.device), num_targets)


# --------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------


class PlanStream(IterableDataset):
    """The sampler's mini-batch plans, one ``{PLAN_KEY: plan}`` per Trainer step; every
    rank iterates the same plans. ``len``: mini-batches in the sampler's current epoch."""

    def __init__(self, sampler: BucketSampler) -> None:
        self.sampler = sampler

    def __iter__(self):
        for plan in self.sampler:
            yield {PLAN_KEY: plan}

    def __len__(self) -> int:
        return self.sampler.num_mini_batches()


def _as_is(item):
    return item


# --------------------------------------------------------------------------------------
# The Trainer
# --------------------------------------------------------------------------------------


class StparTrainer(Trainer):
    """A ``transformers.Trainer`` that shards, batches and switches by a ds_stpar plan.

    ``train_dataset``: documents (``input_ids`` column, or a ``Documents``); ``pad_id``: the
    id put in padding positions (masked out of attention and loss; default the model's
    ``pad_token_id`` or 0). Other arguments are the Trainer's (no ``data_collator``: the plan
    collates). See the module docstring.
    """

    def __init__(
        self,
        model: nn.Module,
        args: TrainingArguments,
        train_dataset=None,
        *,
        pad_id: int | None = None,
        **kwargs,
    ) -> None:
        if train_dataset is None:
            raise ConfigError("StparTrainer needs train_dataset= (documents with input_ids)")
        ds_config, cfg = _read_plan(args)
        prepare_cpu()
        if not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialised: launch with torchrun")
        check_world_size(cfg, dist.get_world_size(), "ds_stpar section")
        _check_plan(cfg)
        engine_cfg = hf_engine_config(ds_config, cfg)
        dtype = model_dtype(engine_cfg)
        args = dataclasses.replace(
            args,
            deepspeed=engine_cfg,
            per_device_train_batch_size=cfg.home.micro_batch,
            gradient_accumulation_steps=1,
            bf16=dtype == "bf16",
            fp16=dtype == "fp16",
        )
        self.stpar_config = cfg
        self.stpar_cache = GroupCache()
        self._dense_params = model.num_parameters(exclude_embeddings=True)
        self.stpar_models = build_hf_layout_models(
            model, cfg, self.stpar_cache, args.device, TORCH_DTYPES[dtype]
        )
        self.stpar_home = self.stpar_models[model_key(cfg.home)]
        docs = train_dataset if isinstance(train_dataset, Documents) else Documents(train_dataset)
        self.stpar_documents = docs
        self.stpar_sampler = BucketSampler(
            docs.lengths,
            cfg.buckets,
            cfg.train.tokens_per_step,
            seed=args.seed,
            cost=RowCost(model.config.get_text_config().hidden_size),
        )
        config_pad = model.config.get_text_config().pad_token_id
        self.stpar_pad_id = pad_id if pad_id is not None else (config_pad or 0)
        self.stpar_runner: HFBucketRunner | None = None
        self.stpar_last_stats = None
        super().__init__(
            model=model, args=args, train_dataset=PlanStream(self.stpar_sampler), **kwargs
        )

    def get_train_dataloader(self) -> DataLoader:
        """Plans, unsharded (each says what every DP rank runs)."""
        return DataLoader(self.train_dataset, batch_size=None, collate_fn=_as_is)

    def train(self, *args, **kwargs):
        """``Trainer.train`` with the home layout's mpu given to ``deepspeed.initialize``."""
        with deepspeed_initialize_with(LayoutMPU(self.stpar_home.groups)):
            return super().train(*args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """One whole mini-batch plan: every bucket in its layout, then the DeepSpeed step."""
        if self.stpar_runner is None:
            self.stpar_runner = HFBucketRunner(
                self.model_wrapped,
                self.stpar_models,
                self.stpar_config.home,
                self.stpar_documents.__getitem__,
                self.stpar_pad_id,
                self.stpar_config.gpus_per_node,
            )
        for layout_model in self.stpar_models.values():
            layout_model.module.train()
        model.train()
        self.stpar_last_stats = self.stpar_runner.step(inputs[PLAN_KEY])
        return torch.tensor(self.stpar_last_stats.loss, device=self.args.device)

    def floating_point_ops(self, inputs) -> int:
        """This rank's share of ``6 x dense parameters x tokens`` of the plan (the Trainer
        sums the shares over processes)."""
        plan = inputs[PLAN_KEY]
        return 6 * self._dense_params * plan.num_tokens // dist.get_world_size()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """An unsharded HF checkpoint of the home model (every rank must call it)."""
        state = full_state_dict(self.model)
        if self.args.should_save:
            self._save(output_dir or self.args.output_dir, state_dict=state)
