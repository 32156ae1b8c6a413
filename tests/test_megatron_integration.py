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
        model = build_gpt(spec, Strategy(Layout(tp=world), sequence_parallel=True), groups, dtype="fp32")
        local = torch.tensor([sum(p.numel() for p in model.parameters() if getattr(p, "tensor_model_parallel", False))])
        replicated = sum(p.numel() for p in model.parameters() if not getattr(p, "tensor_model_parallel", False))
        dist.all_reduce(local)
        # ModelSpec.num_params is an independent closed-form count: exact equality.
        assert local.item() + replicated == spec.num_params(), (spec.name, local.item() + replicated)

    # Vocab-parallel CE against float64 F.cross_entropy over the full vocabulary.
    torch.manual_seed(0)
    full = torch.randn(3, 5, 40, dtype=torch.float64)
    labels = torch.randint(0, 40, (3, 5))
    labels[0, 1] = -100
    shard = full.chunk(world, dim=-1)[rank].clone().float().requires_grad_()
    losses = vocab_parallel_cross_entropy(shard, labels, group=cache.get(Layout(tp=world)).tp_group)
    ref_full = full.clone().requires_grad_()
    ref = F.cross_entropy(ref_full.reshape(-1, 40), labels.reshape(-1), reduction="none").reshape(3, 5)
    # fp32 softmax of 40 logits: relative error ~1e-7; 1e-5 leaves room for the all-reduce order.
    torch.testing.assert_close(losses.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    losses.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(shard.grad.double(), ref_full.grad.chunk(world, dim=-1)[rank], rtol=1e-5, atol=1e-6)


def test_gpt_parameter_count_and_vocab_parallel_cross_entropy():
    run_workers(_param_count_and_ce, 2)
