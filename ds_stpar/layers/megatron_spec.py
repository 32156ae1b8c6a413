"""Megatron-core spec for GPT layers built from ds_stpar's layers.

``get_gpt_layer_stpar_spec(tp_mode=...)`` builds the layer spec. Megatron-LM's ``--spec
MODULE NAME`` passes the object it names to ``GPTModel`` as it is (it does not call it), so
Megatron-LM users give ``--spec ds_stpar.layers.megatron_spec gpt_layer_stpar_spec``: a
module-level spec built at import in the mode ``DS_STPAR_TP_MODE`` names (default ``ring``).
The layer structure is Megatron's own
(``TransformerLayer``, ``SelfAttention``, ``MLP``, bias-dropout-add; so the per-rank QKV
ordering and the GLU interleaving of fc1 are Megatron's); :class:`StparSpecProvider` swaps:

- linears: :class:`~ds_stpar.layers.linear.TemporalColumnParallelLinear` /
  :class:`~ds_stpar.layers.linear.TemporalRowParallelLinear` in the chosen mode, or
  Megatron's ColumnParallelLinear/RowParallelLinear for ``tp_mode="megatron"``;
- core attention: SDPA (flash on GPU; document masking for packed rows);
- norms: LayerNorm/RMSNorm that accept sequence parallelism (ring and Cannon layers exchange
  activations in Megatron's sequence-parallel layout, so such models run with SP on);
- self-attention, for ring and Cannon: :class:`~ds_stpar.layers.megatron_modules.
  StparSelfAttention`, Megatron's, whose ring QKV linear makes the projection's weight
  gradient after the attention's backward where that costs no memory;
- MLP, for ring and Cannon: :class:`~ds_stpar.layers.mlp.StparMLP`, Megatron's MLP that runs
  a ring block as one fused ring pass and whose dist checkpoint of a Cannon gated fc1
  describes the two-dimensional blocks in Megatron's ``[gate; up]`` format (Megatron's own
  GLU factory assumes a row split).

With a layer spec alone, Megatron builds the block's final norm from its own default (a
torch norm that refuses SP when neither Apex nor Transformer Engine is installed), so models
built in-process should pass :func:`get_gpt_block_stpar_spec` (layers + final norm) as
``GPTModel(transformer_layer_spec=...)``.
"""

from __future__ import annotations

import dataclasses
import os

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from ds_stpar.config import TP_MODES
from ds_stpar.errors import ConfigError
from ds_stpar.layers.interleave import InterleavedTransformerLayer
from ds_stpar.layers.megatron_modules import (
    SDPACoreAttention,
    SequenceParallelNorm,
    StparSelfAttention,
)
from ds_stpar.layers.mlp import StparMLP


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    if value not in ("0", "1"):
        raise ConfigError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def _env_count(name: str) -> int:
    value = os.environ.get(name, "0")
    if not value.isdigit():
        raise ConfigError(f"{name} must be a whole number, got {value!r}")
    return int(value)


class StparSpecProvider(LocalSpecProvider):
    """Megatron's local backend with ds_stpar linears, SDPA attention and SP-capable norms."""

    def __init__(self, tp_mode: str = "ring") -> None:
        if tp_mode not in TP_MODES:
            raise ConfigError(f"tp_mode must be one of {TP_MODES}, got {tp_mode!r}")
        self.tp_mode = tp_mode

    def column_parallel_linear(self) -> type | ModuleSpec:
        if self.tp_mode == "megatron":
            return ColumnParallelLinear
        from ds_stpar.layers.linear import TemporalColumnParallelLinear

        return ModuleSpec(module=TemporalColumnParallelLinear, params={"tp_mode": self.tp_mode})

    def row_parallel_linear(self) -> type | ModuleSpec:
        if self.tp_mode == "megatron":
            return RowParallelLinear
        from ds_stpar.layers.linear import TemporalRowParallelLinear

        return ModuleSpec(module=TemporalRowParallelLinear, params={"tp_mode": self.tp_mode})

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return SequenceParallelNorm

    def core_attention(self) -> type:
        return SDPACoreAttention


def get_gpt_layer_stpar_spec(
    tp_mode: str | None = None,
    tp_group=None,
    fused_ring_mlp: bool | None = None,
    interleave: int | None = None,
) -> ModuleSpec:
    """A GPT transformer-layer spec with ds_stpar modules (see the module docstring).

    The norm type (LayerNorm/RMSNorm) follows ``TransformerConfig.normalization``.
    ``fused_ring_mlp`` (ring only): one fused ring pass per MLP block (``StparMLP``) or the
    two ring linears' passes; None reads ``DS_STPAR_FUSED_RING_MLP`` (``0`` or ``1``, default ``1``).
    ``interleave`` (ring only): k >= 2 makes the layer
    :class:`~ds_stpar.layers.interleave.InterleavedTransformerLayer`, which runs k pieces of
    the micro-batch interleaved so each piece's transfers hide behind the others' compute;
    0 or 1: Megatron's layer; None reads ``DS_STPAR_INTERLEAVE`` (a whole number, default 0).
    ``tp_group``: the TP group of models built with explicit groups. Megatron's
    ``TransformerLayer`` hands its TP group only to an MLP of type exactly ``MLP``, so the
    ring / Cannon ``StparMLP`` gets it from the spec (None: Megatron's global parallel state).
    """
    backend = StparSpecProvider(tp_mode or os.environ.get("DS_STPAR_TP_MODE", "ring"))
    if fused_ring_mlp is None:
        fused_ring_mlp = _env_flag("DS_STPAR_FUSED_RING_MLP", True)
    if interleave is None:
        interleave = _env_count("DS_STPAR_INTERLEAVE")
    layer, layer_params = TransformerLayer, {}
    if interleave > 1 and backend.tp_mode == "ring":
        layer, layer_params = InterleavedTransformerLayer, {"pieces": interleave}
    mlp_params = {"fused_ring": fused_ring_mlp}
    if tp_group is not None:
        mlp_params["tp_group"] = tp_group
    norm = backend.layer_norm()
    return ModuleSpec(
        module=layer,
        params=layer_params,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention if backend.tp_mode == "megatron" else StparSelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=backend.column_parallel_linear(),
                    core_attention=backend.core_attention(),
                    linear_proj=backend.row_parallel_linear(),
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=ModuleSpec(
                module=MLP if backend.tp_mode == "megatron" else StparMLP,
                params={} if backend.tp_mode == "megatron" else mlp_params,
                submodules=MLPSubmodules(
                    linear_fc1=backend.column_parallel_linear(),
                    linear_fc2=backend.row_parallel_linear(),
                ),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def get_gpt_block_stpar_spec(
    config: TransformerConfig,
    tp_mode: str | None = None,
    pp_rank: int | None = None,
    vp_stage: int | None = None,
    tp_group=None,
    fused_ring_mlp: bool | None = None,
    interleave: int | None = None,
) -> TransformerBlockSubmodules:
    """The whole decoder block of one pipeline stage: ds_stpar layers plus an SP-capable final
    norm. Interleaved layers hand their pieces on to the next (``hands_on``), all but the last
    of the list."""
    layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    spec = get_gpt_layer_stpar_spec(tp_mode, tp_group, fused_ring_mlp, interleave)
    specs = [spec] * layers
    if spec.module is InterleavedTransformerLayer:
        specs = [
            dataclasses.replace(spec, params={**spec.params, "hands_on": index < layers - 1})
            for index in range(layers)
        ]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=SequenceParallelNorm)


#: The spec object Megatron-LM's ``--spec ds_stpar.layers.megatron_spec gpt_layer_stpar_spec``
#: imports (Megatron-LM hands the named object to GPTModel without calling it); its mode and
#: MLP fusion and interleaving come from ``DS_STPAR_TP_MODE``, ``DS_STPAR_FUSED_RING_MLP`` and
#: ``DS_STPAR_INTERLEAVE``.
gpt_layer_stpar_spec: ModuleSpec = get_gpt_layer_stpar_spec()
