"""megatron-core GPT built from ModelSpec/Strategy with explicit groups; vocab-parallel CE."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_stpar.config import Layout, ModelSpec, Strategy
from tests.distributed import run_workers

TINY_GPT = ModelSpec("tiny-gpt", 2, 64, 4, vocab_size=256, max_position_embeddings=64)
TINY_LLAMA = ModelSpec(
    "tiny-llama",
    2,
    64,
    4,
    vocab_size=256,
    num_query_groups=2,
    ffn_hidden_size=96,
    activation="swiglu",
    normalization="rmsnorm",
    add_bias_linear=False,
    tied_embeddings=False,
    position_embedding="rope",
)


def _param_count_and_ce(rank: int, world: int) -> None:
    from ds_stpar.integrations import megatron_cpu
    from ds_stpar.integrations.megatron import build_gpt
    from ds_stpar.layers.cross_entropy import vocab_parallel_cross_entropy
    from ds_stpar.parallel import GroupCache

    megatron_cpu.apply()
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.get_cuda_rng_tracker().add("model-parallel-rng", 1234)
    cache = GroupCache()
    for spec in (TINY_GPT, TINY_LLAMA):
        groups = cache.get(Layout(tp=world))
        model = build_gpt(
            spec, Strategy(Layout(tp=world), sequence_parallel=True), groups, dtype="fp32"
        )
        local = torch.tensor(
            [
                sum(
                    p.numel()
                    for p in model.parameters()
                    if getattr(p, "tensor_model_parallel", False)
                )
            ]
        )
        replicated = sum(
            p.numel() for p in model.parameters() if not getattr(p, "tensor_model_parallel", False)
        )
        dist.all_reduce(local)
        # ModelSpec.num_params is an independent closed-form count: exact equality.
        assert local.item() + replicated == spec.num_params(), (
            spec.name,
            local.item() + replicated,
        )

    # Vocab-parallel CE against float64 F.cross_entropy over the full vocabulary.
    torch.manual_seed(0)
    full = torch.randn(3, 5, 40, dtype=torch.float64)
    labels = torch.randint(0, 40, (3, 5))
    labels[0, 1] = -100
    shard = full.chunk(world, dim=-1)[rank].clone().float().requires_grad_()
    losses = vocab_parallel_cross_entropy(shard, labels, group=cache.get(Layout(tp=world)).tp_group)
    ref_full = full.clone().requires_grad_()
    ref = F.cross_entropy(ref_full.reshape(-1, 40), labels.reshape(-1), reduction="none").reshape(
        3, 5
    )
    # fp32 softmax of 40 logits: relative error ~1e-7; 1e-5 leaves room for the all-reduce order.
    torch.testing.assert_close(losses.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    losses.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(
        shard.grad.double(), ref_full.grad.chunk(world, dim=-1)[rank], rtol=1e-5, atol=1e-6
    )


def test_gpt_parameter_count_and_vocab_parallel_cross_entropy():
    run_workers(_param_count_and_ce, 2)


def _spec_parity(rank: int, world: int) -> None:
    """GPTModel with ds_stpar's spec (ring; Megatron linears + SP) vs Megatron's local spec."""
    from ds_stpar.integrations import megatron_cpu

    megatron_cpu.apply()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from ds_stpar.integrations.megatron import transformer_config
    from ds_stpar.layers.megatron_spec import get_gpt_block_stpar_spec

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    spec = TINY_LLAMA
    seq, batch = 16, 2

    def build(layer_spec, config):
        return GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=spec.vocab_size,
            max_sequence_length=seq,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
        )

    base = Strategy(Layout(tp=world))
    ref_config = transformer_config(spec, base, "fp32")
    reference = build(get_gpt_layer_local_spec(normalization="RMSNorm"), ref_config)
    torch.manual_seed(7)
    tokens = torch.randint(0, spec.vocab_size, (batch, seq + 1))
    position_ids = torch.arange(seq).expand(batch, -1)
    # Megatron's local attention builds its default causal mask on "cuda": pass it (True = masked)
    causal_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]

    def loss_and_grads(model):
        model.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], position_ids, causal_mask, labels=tokens[:, 1:]).mean()
        loss.backward()
        grads = {}
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            if getattr(param, "sequence_parallel", False):  # partial over this rank's tokens
                dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
            grads[name] = grad
        return loss.detach(), grads

    ref_loss, ref_grads = loss_and_grads(reference)
    for tp_mode in ("megatron", "ring"):
        config = transformer_config(
            spec, Strategy(Layout(tp=world, tp_mode=tp_mode), sequence_parallel=True), "fp32"
        )
        ours = build(get_gpt_block_stpar_spec(config, tp_mode), config)
        missing, unexpected = ours.load_state_dict(reference.state_dict(), strict=False)
        assert not [k for k in missing + unexpected if not k.endswith("_extra_state")], (
            missing,
            unexpected,
        )
        loss, grads = loss_and_grads(ours)
        # Same weights and data; only the reduction order (SP collectives, ring steps, SDPA vs
        # baddbmm softmax) differs: fp32 rounding over K <= 96-term sums, far below 1e-5.
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(
                grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"{tp_mode}: {name}"
            )
    parallel_state.destroy_model_parallel()


def test_gpt_with_stpar_spec_matches_megatron_local_spec():
    run_workers(_spec_parity, 2)
