"""``StparMLP``: Megatron's MLP for the ring and Cannon specs.

Two changes to ``megatron.core.transformer.mlp.MLP``, nothing else (same submodules, weights,
attributes and checkpoint keys, so a model moves between the specs by its dist checkpoint):

- **ring**: with a ring fc1 and fc2 in a TP group of P > 1, the forward runs the whole block as
  one ring pass (:func:`~ds_stpar.layers.ring_mlp.ring_mlp`): each hop overlaps both GEMMs of a
  chunk, fc2's partial sums leave in row pieces, and act(A) is recomputed in the backward
  instead of saved. With ``fused_ring=False`` the two ring linears run one after the other in
  one node (:func:`~ds_stpar.layers.ring_mlp.ring_two_pass_mlp`), which also saves A only,
  recomputes act(A) and writes dA over A in its backward. Both get the activation as a
  :class:`~ds_stpar.layers.activation.ClosedFormActivation` where Megatron's config names one
  it has (gelu, silu, relu, plain or gated, no clamp): its derivative runs autograd's own
  kernel without a nested graph, and the two passes compute dA straight over A. Cases where the
  ring cannot own the activation run Megatron's forward over the per-linear ring layers (same
  result): ``per_token_scale`` (MoE experts), Transformer Engine activations,
  ``bias_activation_fusion`` (Megatron's fused kernels: the fused SwiGLU the GPU runs select,
  tanh GELU), fp8 activation storage.
- **inside an interleaved layer** (its linears in ``local_compute`` mode, the transfers
  outside): in the same cases, fc1's GEMM then act(A) W2^T saving A only
  (:func:`~ds_stpar.layers.local.activation_linear`; Megatron's forward would keep act(A) as
  well), dA written over A with a closed form, as the ring passes do.
- **Cannon, gated fc1**: fc1's weight is saved with
  :func:`~ds_stpar.layers.cannon_mlp.cannon_glu_factory` instead of Megatron's row-split GLU
  factory.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.mlp import MLP
from torch import Tensor

from ds_stpar.layers.activation import ClosedFormActivation
from ds_stpar.layers.cannon_mlp import cannon_glu_factory
from ds_stpar.layers.local import activation_linear
from ds_stpar.layers.ring_mlp import ring_mlp, ring_two_pass_mlp
from ds_stpar.layers.wgrad import fused_main_grad


class StparMLP(MLP):
    """Megatron's MLP with the ring forwards and the Cannon GLU checkpoint view (module
    docstring). ``fused_ring=False``: the two ring linears' passes in one node."""

    def __init__(self, *args, fused_ring: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fused_ring = fused_ring
        self.ring_activation = self._closed_form_activation() or self._activation

    def _closed_form_activation(self) -> ClosedFormActivation | None:
        """:meth:`_activation` with its derivative in closed form, where there is one."""
        cfg = self.config
        func = cfg.activation_func if cfg.gated_linear_unit else self.activation_func
        if cfg.gated_linear_unit and cfg.activation_func_clamp_value is not None:
            return None
        if not ClosedFormActivation.supports(func):
            return None
        return ClosedFormActivation(func, cfg.gated_linear_unit, cfg.glu_linear_offset)

    def _tp_mode(self) -> str | None:
        return getattr(self.linear_fc1, "tp_mode", None)

    def _ring_owns_activation(self, per_token_scale: Tensor | None) -> bool:
        """Whether a ring forward runs the block and computes act itself (the fused pass or the
        two-pass node): ring fc1 and fc2 over P > 1 and an activation it can recompute."""
        fc1, fc2, cfg = self.linear_fc1, self.linear_fc2, self.config
        return (
            self._tp_mode() == "ring"
            and getattr(fc2, "tp_mode", None) == "ring"
            and fc1.tp_group.size() > 1
            and fc1.weight is not None
            and per_token_scale is None
            and not cfg.use_te_activation_func
            and not cfg.bias_activation_fusion
            and not cfg.activation_func_fp8_input_store
        )

    def _activation(self, a: Tensor) -> Tensor:
        """act(A) of the bias-added fc1 output, as Megatron's unfused forward computes it
        (a GLU takes ``[gate_d; up_d]``, Megatron's stride-2 fc1 shard)."""
        cfg = self.config
        if not cfg.gated_linear_unit:
            return self.activation_func(a)
        gate, linear = torch.chunk(a, 2, dim=-1)
        if (clamp := cfg.activation_func_clamp_value) is not None:
            gate = gate.clamp(min=None, max=clamp)
            linear = linear.clamp(min=-clamp, max=clamp)
        return cfg.activation_func(gate) * (linear + cfg.glu_linear_offset)

    def forward(self, hidden_states: Tensor, per_token_scale: Tensor | None = None, **kwargs):
        """[s/P, b, h] -> ([s/P, b, h], fc2 bias or None), as Megatron's MLP."""
        if not self._ring_owns_activation(per_token_scale):
            return super().forward(hidden_states, per_token_scale, **kwargs)
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        main_grad2 = fused_main_grad(fc2.weight, fc2.gradient_accumulation_fusion)
        if fc1.local_compute is not None and fc2.local_compute is not None:
            a, bias = fc1(hidden_states)
            a = a + bias if bias is not None else a
            grads2 = fc2.local_compute.weight_grad(fc2.weight, main_grad2)
            out = activation_linear(a, fc2.weight, self.ring_activation, grads2, consume_a=True)
            return out, fc2.bias
        fc1._check_input(hidden_states, fc1.input_size)
        output = (ring_mlp if self.fused_ring else ring_two_pass_mlp)(
            hidden_states,
            fc1.weight,
            fc1.bias,
            fc2.weight,
            self.ring_activation,
            fc1.tp_group,
            fused_main_grad(fc1.weight, fc1.gradient_accumulation_fusion),
            main_grad2,
        )
        return fc2._with_bias(output)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        fc1 = self.linear_fc1
        if not self.config.gated_linear_unit or self._tp_mode() != "cannon":
            return sharded
        key = f"{prefix}linear_fc1.weight"
        own = fc1.sharded_state_dict(f"{prefix}linear_fc1.", sharded_offsets, metadata)[key]
        singleton = (metadata or {}).get("singleton_local_shards", False)
        sharded[key] = cannon_glu_factory(own, fc1.shard_offsets, sharded_offsets, singleton)
        return sharded
