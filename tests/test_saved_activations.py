"""The planner's activation memory per layer against the bytes a real layer saves.

One megatron-core ``GPTModel`` per layer variant, built from ds_stpar's spec on 2 gloo ranks
(fp32, GeLU, LayerNorm, no biases, learned positions; SDPA's CPU flash kernel, which saves
what its CUDA one does: Q, K, V, the output and the fp32 log-sum-exp). Everything the second
of three layers' forward (an interleaved one takes its input in flight and hands its output
on) hands autograd to keep (``torch.autograd.graph.saved_tensors_hooks``) is
counted once per storage, parameters left out, at the end of the step's forward (the ring
and interleaved layers keep their norms' inputs, not their outputs: ``layers/norm_recipe.py``).
The planner's ``memory.layer_activation_bytes`` for the same layer (local stack, e = 4)
must equal it to the byte: at TP2 Megatron + SP, the ring with the fused MLP and with the
two passes, and the interleaved layer of 2 pieces; at TP4 Megatron, the two passes and
Cannon (a 2 x 2 torus). The reference is the count; no tolerance. (It found Cannon's second
copy of the attention output, the interleaved layer's norm statistics, which it did not keep
under Megatron's ``CheckpointWithoutOutput`` and keeps for every token since the norm recipe,
and the two norm outputs the ring layers no longer keep.)
"""

from __future__ import annotations

import pytest
import torch

from ds_stpar.config import ClusterSpec, Layout, ModelSpec, Strategy, TrainSpec, load_gpu
from ds_stpar.planner import cost
from ds_stpar.planner import memory as mem
from ds_stpar.planner.profile import Calibration
from tests.distributed import run_workers

SPEC = ModelSpec(
    "saved",
    3,
    64,
    4,
    vocab_size=128,
    max_position_embeddings=64,
    normalization="layernorm",
    activation="gelu",
    add_bias_linear=False,
)
SEQ, BATCH = 32, 4
VARIANTS = {  # group size: {name: (TP mode, fused ring MLP, interleave pieces)}
    2: {
        "megatron": ("megatron", True, 0),
        "ring, fused MLP": ("ring", True, 0),
        "ring, two passes": ("ring", False, 0),
        "interleaved, 2 pieces": ("ring", True, 2),
    },
    4: {
        "megatron": ("megatron", True, 0),
        "ring, two passes": ("ring", False, 0),
        "cannon": ("cannon", True, 0),
    },
}


def _strategy(world: int, mode: str, fused: bool, pieces: int) -> Strategy:
    return Strategy(
        Layout(tp=world, tp_mode=mode),
        micro_batch=BATCH,
        sequence_parallel=True,
        fused_ring_mlp=fused,
        interleave=pieces,
    )


def _planned(world: int, mode: str, fused: bool, pieces: int) -> float:
    cal = Calibration.load_default("h100-80g", stack="megatron-core-local")
    train = TrainSpec(SEQ, BATCH, dtype="fp32")
    ev = cost.Evaluator(SPEC, ClusterSpec(load_gpu("h100-80g"), world, world), train, cal)
    ctx = cost._Context(ev, _strategy(world, mode, fused, pieces))
    return mem.layer_activation_bytes(ctx.activations, ctx.tokens, world, ctx.sharded, "none")


def _saved_bytes(model, tokens, positions) -> int:
    """Bytes the second layer's forward saves for backward, once per storage, no parameters,
    as they stand when the forward ends."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[torch.Tensor] = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
    layer = model.decoder.layers[1]
    layer.register_forward_pre_hook(lambda *_: hooks.__enter__())
    layer.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    loss.backward()
    return sum(n for ptr, n in storages.items() if ptr not in parameters)


def _worker(rank: int, world: int) -> None:
    from ds_stpar.integrations import megatron_cpu

    megatron_cpu.apply()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel

    from ds_stpar.integrations.megatron import transformer_config
    from ds_stpar.layers.megatron_spec import get_gpt_block_stpar_spec

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(3)
    tokens = torch.randint(0, SPEC.vocab_size, (BATCH, SEQ + 1))
    positions = torch.arange(SEQ).expand(BATCH, -1)
    found = {}
    for name, (mode, fused, pieces) in VARIANTS[world].items():
        config = transformer_config(SPEC, _strategy(world, mode, fused, pieces), "fp32")
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_block_stpar_spec(
                config, mode, fused_ring_mlp=fused, interleave=pieces
            ),
            vocab_size=SPEC.vocab_size,
            max_sequence_length=SEQ,
            share_embeddings_and_output_weights=False,
            position_embedding_type="learned_absolute",
        )
        found[name] = (_saved_bytes(model, tokens, positions), _planned(world, mode, fused, pieces))
    parallel_state.destroy_model_parallel()
    assert all(saved == planned for saved, planned in found.values()), found
    # the order the layer benchmark reads: every ring mode keeps less than Megatron
    rings = [saved for name, (saved, _) in found.items() if name not in ("megatron", "cannon")]
    assert max(rings) < found["megatron"][0], found


@pytest.mark.parametrize("world", sorted(VARIANTS))
def test_planned_layer_activations_are_the_saved_bytes(world: int) -> None:
    run_workers(_worker, world)
