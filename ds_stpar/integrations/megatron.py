"""Build megatron-core GPT models from a :class:`~ds_stpar.config.ModelSpec` and a
:class:`~ds_stpar.config.Strategy`, with explicit process groups.

Hot switching keeps one model object per layout on the same ranks, so nothing here reads
Megatron's global parallel state: each model gets a ``ProcessGroupCollection`` built from
our :class:`~ds_stpar.parallel.LayoutGroups`, and its layers use those groups.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

from ds_stpar.config import ModelSpec, Strategy, stage_layers
from ds_stpar.layers import packed_rope
from ds_stpar.layers.megatron_spec import get_gpt_block_stpar_spec
from ds_stpar.parallel import LayoutGroups

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def recompute_fields(recompute: str, layers: int = 0) -> dict:
    """TransformerConfig's recompute fields for the planner's ``none``/``selective``/``full``.

    Full with ``layers`` 0: every layer's input kept, the layer recomputed in backward
    (Megatron-LM's --recompute-granularity full --recompute-method uniform
    --recompute-num-layers 1). Full with ``layers`` k > 0: the block method
    (--recompute-method block --recompute-num-layers k), the first k layers of each pipeline
    stage recomputed, the others keeping all their activations; a stage of at most k layers
    recomputes them all (megatron-core checkpoints layer i of the stage iff i < k, and checks
    k against nothing). ``layers`` belongs to full recompute only
    (:class:`~ds_stpar.config.Strategy` refuses it elsewhere), so it is refused here too."""
    if layers < 0:
        raise ValueError(f"recompute layers must be >= 0, got {layers}")
    if recompute == "full":
        return {
            "recompute_granularity": "full",
            "recompute_method": "block" if layers else "uniform",
            "recompute_num_layers": layers or 1,
        }
    if layers:
        raise ValueError(f"recompute layers ({layers}) need full recompute, got {recompute!r}")
    granularity = "selective" if recompute == "selective" else None
    return {
        "recompute_granularity": granularity,
        "recompute_method": None,
        "recompute_num_layers": None,
    }


def set_full_recompute(config: TransformerConfig, recompute: str, layers: int = 0) -> None:
    """Switch a built model between no recompute, full recompute of every layer and full
    recompute of the first ``layers`` of its stage (:func:`recompute_fields`), so one model
    serves buckets that differ only in that; selective recompute is fixed when the layers are
    built (megatron-core's attention and layers read it in ``__init__``).

    Why a runtime switch works (megatron-core 0.16.1, transformer/transformer_block.py):
    ``TransformerBlock.forward`` tests ``config.recompute_granularity == 'full' and
    self.training`` at every call, and ``_checkpointed_forward`` reads
    ``config.recompute_method`` and ``config.recompute_num_layers`` at every call -- uniform:
    checkpoints of ``recompute_num_layers`` consecutive layers; block: layer i of the stage
    checkpointed iff i < ``recompute_num_layers``, the rest run plainly (without a
    ``padding_mask``, which ds_stpar never passes). Nothing in the GPT model reads the two
    fields when it is built (the multi-token-prediction block does at forward; ds_stpar builds
    none), and the model's modules hold the config object, not a copy. TransformerConfig
    checks the fields only in ``__post_init__``, which setting them here skips:
    :func:`recompute_fields` gives only combinations it accepts."""
    if config.recompute_granularity == "selective" or recompute == "selective":
        raise ValueError("selective recompute is fixed when a model is built")
    for name, value in recompute_fields(recompute, layers).items():
        setattr(config, name, value)


def fused_swiglu(model: ModelSpec, strategy: Strategy, cuda: bool) -> bool:
    """Whether the MLP runs megatron-core's fused SwiGLU (``bias_activation_fusion``: one
    ``torch.compile``d kernel each way, saving only fc1's output): on GPU, for gated MLPs,
    except under the fused ring MLP, whose own pass computes the activation
    (``layers/mlp.py``). Per token and layer it keeps 3 e f / t bytes where the unfused GLU
    keeps 5 e f / t (fc1's output, the SiLU output, the zero-offset sum, fc2's input) and
    moves 8 e f / t bytes where that moves 20 e f / t. On CPU the GLU stays unfused:
    inductor's first compile costs ~20 s per process, the CPU runs are tests of tiny models."""
    return cuda and strategy.runs_fused_swiglu(model)


def transformer_config(
    model: ModelSpec, strategy: Strategy, dtype: str = "bf16", **overrides
) -> TransformerConfig:
    """Megatron TransformerConfig for ``model`` under ``strategy`` (dropout off by default)."""
    layout = strategy.layout
    params_dtype = _DTYPES[dtype]
    fields = recompute_fields(strategy.recompute, strategy.recompute_layers)
    recompute = {k: v for k, v in fields.items() if v is not None}
    layers = stage_layers(model.num_layers, strategy)
    kwargs = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        ffn_hidden_size=model.ffn_hidden_size,
        gated_linear_unit=model.gated,
        activation_func=torch.nn.functional.silu if model.gated else torch.nn.functional.gelu,
        normalization="RMSNorm" if model.normalization == "rmsnorm" else "LayerNorm",
        add_bias_linear=model.add_bias_linear,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        sequence_parallel=strategy.sequence_parallel
        or (layout.tp > 1 and layout.tp_mode != "megatron"),
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_activation_fusion=fused_swiglu(model, strategy, torch.cuda.is_available()),
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        **recompute,
    )
    if layout.pp > 1 and (strategy.first_stage_layers or strategy.last_stage_layers):
        kwargs["num_layers_in_first_pipeline_stage"] = layers[0]
        kwargs["num_layers_in_last_pipeline_stage"] = layers[-1]
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def process_groups(groups: LayoutGroups) -> ProcessGroupCollection:
    """Megatron's group collection for one layout (TP, PP, DP and their combinations)."""
    pgs = ProcessGroupCollection()
    pgs.tp = groups.tp_group
    pgs.pp = groups.pp_group
    pgs.dp = groups.dp_group
    pgs.cp = groups.self_group
    pgs.dp_cp = groups.dp_group
    pgs.embd = groups.embd_group
    return pgs


def build_gpt(
    model: ModelSpec,
    strategy: Strategy,
    groups: LayoutGroups,
    dtype: str = "bf16",
    seq_len: int = 0,
) -> GPTModel:
    """This rank's pipeline stage of a GPT model with ds_stpar's layer spec (and RoPE over
    packed rows without a host sync per layer, :mod:`~ds_stpar.layers.packed_rope`)."""
    packed_rope.install()
    config = transformer_config(model, strategy, dtype)
    pp_rank, pp = groups.pp_index, groups.layout.pp
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_block_stpar_spec(
            config,
            groups.layout.tp_mode,
            pp_rank=pp_rank,
            tp_group=groups.tp_group,
            fused_ring_mlp=strategy.fused_ring_mlp,
        ),
        vocab_size=model.vocab_size,
        max_sequence_length=max(seq_len, model.max_position_embeddings),
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
        share_embeddings_and_output_weights=model.tied_embeddings,
        position_embedding_type="rope"
        if model.position_embedding == "rope"
        else "learned_absolute",
        pg_collection=process_groups(groups),
    )
    if torch.cuda.is_available():
        # torch.nn.Embedding (learned positions) is created on the CPU in fp32 whatever the
        # config says; DeepSpeed moves and casts only the model it wraps, so do it here for all.
        gpt = gpt.to(device=torch.cuda.current_device(), dtype=config.params_dtype)
    return gpt


class DeferredOutputLayer(torch.nn.Module):
    """Stands in for a GPTModel's ``output_layer`` (a ColumnParallelLinear without bias) and
    returns its input: the model's forward then ends at the final norm's hidden states
    ([b, s, h], or this rank's [b, s/t, h] under sequence parallelism, after GPTModel's
    [s, b] -> [b, s] transpose), and the loss forms the logits chunk by chunk
    (:func:`~ds_stpar.layers.cross_entropy.vocab_parallel_linear_cross_entropy`, with
    :func:`head_weight`). It holds the same ``weight`` Parameter (``None`` where the model's
    forward passes the tied embedding), so parameter names, attributes and state dicts are
    unchanged."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        if getattr(layer, "bias", None) is not None:
            raise ValueError("the deferred LM head takes an output layer without bias")
        self.weight = layer.weight
        self.sequence_parallel = layer.sequence_parallel

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return hidden, None


def defer_output_layer(gpt: GPTModel) -> GPTModel:
    """Give a last-stage ``gpt`` a :class:`DeferredOutputLayer` (in place; returns it)."""
    if gpt.post_process:
        gpt.output_layer = DeferredOutputLayer(gpt.output_layer)
    return gpt


def head_weight(gpt: GPTModel) -> torch.Tensor:
    """The LM head's [V/t, h] rows on a last stage: the tied embedding's, or its own."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight
