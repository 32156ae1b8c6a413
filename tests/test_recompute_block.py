"""Full recompute of the first k layers of a stage (Megatron's block method,
``Strategy.recompute_layers``), switched at runtime on one model.

megatron-core: a tiny 4-layer GPTModel (fp32, CPU, a gloo world of 1) built by
``build_layout_models`` for strategies that differ only in recompute (one model_key, so one
model), run on one packed micro-batch (three documents; the runner's inputs and loss) with
the recompute switched by ``BucketRunner._set_recompute`` (``set_full_recompute``) between
runs: none, full of every layer, block 1, block 3, block 6 (more than the stage holds: all),
none again. transformers: a tiny random Llama (4 decoder layers, fp32, a gloo world of 1 for
``apply_stpar``'s groups) under ``HFBucketRunner._set_recompute`` in the same order, then
block 2 and none.

Each run must give the loss and every parameter gradient of the first run (no recompute) bit
for bit. Why exact: recompute reruns the same fp32 ops on the same inputs in the same order,
single-threaded (the workers set one thread), so the recomputed activations, hence the
gradient kernels' inputs, equal the stored ones; the only sums autograd might order
differently are accumulations into one parameter's gradient, and each parameter here gets one
contribution per backward, or two for the megatron model's tied embedding and head (a sum of
two terms commutes exactly). Measured: equal. (On a GPU machine the megatron-core model
runs on the GPU, whose kernels may sum in another order from run to run: there the check is
fp32 rounding, rtol 1e-5 on the loss and 1e-4 on the gradients.) A recompute mode silently
ignored would pass
that too, so the runs also count each layer's forward calls: layers below k run twice (the
forward and the recompute in backward), the others once.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ds_stpar.config import Layout, ModelSpec, Strategy
from ds_stpar.errors import ConfigError
from tests.distributed import run_workers

SPEC = ModelSpec(
    "tiny-llama-4",
    4,
    64,
    4,
    vocab_size=256,
    num_query_groups=2,
    ffn_hidden_size=96,
    activation="swiglu",
    normalization="rmsnorm",
    add_bias_linear=False,
    position_embedding="rope",
    max_position_embeddings=64,
)
# (recompute, recompute_layers) in the order they are switched on one model
MODES = (("none", 0), ("full", 0), ("full", 1), ("full", 3), ("full", 6), ("none", 0))


def _recomputed(recompute: str, k: int, num_layers: int) -> int:
    return Strategy(Layout(), recompute=recompute, recompute_layers=k).recomputed_layers(num_layers)


# --------------------------------------------------------------------------------------
# Strategy and the TransformerConfig fields
# --------------------------------------------------------------------------------------


def test_strategy_recompute_layers_checks_and_old_dicts() -> None:
    with pytest.raises(ConfigError, match="recompute_layers=2 needs recompute 'full'"):
        Strategy(Layout(), recompute="none", recompute_layers=2)
    with pytest.raises(ConfigError, match="recompute_layers must be >= 0, got -1"):
        Strategy(Layout(), recompute="full", recompute_layers=-1)
    old = Strategy(Layout(dp=2), recompute="full").to_dict()
    del old["recompute_layers"]  # a plan written before the field existed
    assert Strategy.from_dict(old).recompute_layers == 0
    assert Strategy.from_dict(old) == Strategy(Layout(dp=2), recompute="full")
    assert [_recomputed("full", k, 4) for k in (0, 1, 3, 4, 6)] == [4, 1, 3, 4, 4]
    assert _recomputed("none", 0, 4) == 0


def test_recompute_fields_and_transformer_config() -> None:
    from ds_stpar.integrations.megatron import recompute_fields, transformer_config

    uniform = {"recompute_granularity": "full", "recompute_method": "uniform"}
    assert recompute_fields("full") == {**uniform, "recompute_num_layers": 1}
    assert recompute_fields("none") == dict.fromkeys(uniform.keys() | {"recompute_num_layers"})
    for k in (1, 3, 6):
        block = {"recompute_granularity": "full", "recompute_method": "block"}
        assert recompute_fields("full", k) == {**block, "recompute_num_layers": k}
    with pytest.raises(ValueError, match="need full recompute"):
        recompute_fields("selective", 2)
    with pytest.raises(ValueError, match=">= 0"):
        recompute_fields("full", -1)

    def fields(strategy: Strategy) -> tuple:
        config = transformer_config(SPEC, strategy, "fp32")
        return config.recompute_granularity, config.recompute_method, config.recompute_num_layers

    assert fields(Strategy(Layout())) == (None, None, None)
    assert fields(Strategy(Layout(), recompute="full")) == ("full", "uniform", 1)
    for k in (1, 3):
        assert fields(Strategy(Layout(), recompute="full", recompute_layers=k)) == (
            "full",
            "block",
            k,
        )
    # per pipeline stage: 2 layers a stage, the first of each recomputed
    assert fields(Strategy(Layout(pp=2), recompute="full", recompute_layers=1)) == (
        "full",
        "block",
        1,
    )


# --------------------------------------------------------------------------------------
# megatron-core: one model, the recompute switched at runtime
# --------------------------------------------------------------------------------------


def _assert_same(what: str, loss: torch.Tensor, grads: dict, ref: tuple, exact: bool) -> None:
    """The loss and every gradient equal the first run's: bit for bit (``exact``, on the CPU:
    module docstring), else within fp32 rounding (GPU kernels may sum in another order from
    run to run: rtol 1e-5 on the loss, 1e-4 on the gradients)."""
    assert grads.keys() == ref[1].keys()
    if not exact:
        torch.testing.assert_close(loss, ref[0], rtol=1e-5, atol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref[1][name], rtol=1e-4, atol=1e-6, msg=name)
        return
    assert torch.equal(loss, ref[0]), (what, loss.item(), ref[0].item())
    for name, grad in grads.items():
        diff = (grad - ref[1][name]).abs().max().item()
        assert torch.equal(grad, ref[1][name]), f"{what}: {name} differs by {diff:.3g}"


def _megatron_runs(rank: int, world: int) -> None:
    from ds_stpar.config import model_key
    from ds_stpar.integrations.megatron import head_weight
    from ds_stpar.layers.cross_entropy import vocab_parallel_linear_cross_entropy
    from ds_stpar.parallel import GroupCache
    from ds_stpar.seqbucket.packing import Piece, RowPlan, collate, token_multiple
    from ds_stpar.seqbucket.runner import BucketRunner, build_layout_models, packed_inputs

    strategies = [Strategy(Layout(), recompute=rc, recompute_layers=k) for rc, k in MODES]
    models = build_layout_models(SPEC, strategies, strategies[-1], GroupCache(), "fp32", 0)
    assert len(models) == 1, list(models)  # model_key drops the recompute: one model
    model = models[model_key(strategies[0])]
    gpt = model.module
    gpt.train()
    assert gpt.decoder.config is gpt.config  # what set_full_recompute writes is what it reads

    rng = np.random.default_rng(0)
    docs = [rng.integers(1, SPEC.vocab_size, n) for n in (13, 9, 10)]
    pieces = tuple(Piece(i, 0, len(doc), True) for i, doc in enumerate(docs))
    batch = collate([RowPlan(32, pieces)], docs.__getitem__, 0, token_multiple(1))
    device = next(gpt.parameters()).device  # a GPU where there is one
    ids, positions, labels, params = packed_inputs(batch, device)
    num_targets = sum(p.num_targets for p in pieces)

    layers = list(gpt.decoder.layers)
    assert len(layers) == SPEC.num_layers
    calls = [0] * len(layers)
    for index, layer in enumerate(layers):
        layer.register_forward_hook(lambda m, a, o, i=index: calls.__setitem__(i, calls[i] + 1))

    ref = None
    for strategy in strategies:
        BucketRunner._set_recompute(model, strategy)
        config = gpt.config
        if strategy.recompute == "full":
            k = strategy.recompute_layers
            assert config.recompute_granularity == "full"
            assert (config.recompute_method, config.recompute_num_layers) == (
                ("block", k) if k else ("uniform", 1)
            )
        else:
            assert config.recompute_granularity is None
        calls[:] = [0] * len(layers)
        gpt.zero_grad(set_to_none=True)
        out = gpt(ids, positions, None, packed_seq_params=params)
        loss = vocab_parallel_linear_cross_entropy(
            out, head_weight(gpt), labels, num_targets, group=model.groups.tp_group
        )
        loss.backward()
        k = strategy.recomputed_layers(len(layers))
        assert calls == [2] * k + [1] * (len(layers) - k), (strategy.short(), calls)
        grads = {n: p.grad.clone() for n, p in gpt.named_parameters()}
        assert all(g is not None for g in grads.values())
        if ref is None:
            ref = loss.detach(), grads
            continue
        _assert_same(strategy.short(), loss.detach(), grads, ref, exact=device.type == "cpu")


@pytest.mark.dist
def test_megatron_block_recompute_switched_on_one_model() -> None:
    run_workers(_megatron_runs, 1)


# --------------------------------------------------------------------------------------
# transformers: first-k gradient checkpointing through the per-layer flags
# --------------------------------------------------------------------------------------


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.2,
    )
    return LlamaForCausalLM(config)


def _hf_runs(rank: int, world: int) -> None:
    from ds_stpar.integrations.hf_trainer import HFBucketRunner
    from ds_stpar.layers import apply_stpar
    from ds_stpar.parallel import GroupCache
    from ds_stpar.seqbucket.runner import LayoutModel

    cache = GroupCache()
    module = apply_stpar(_tiny_llama(), Layout(), cache=cache)  # tp 1: the model as it is
    module.train()
    layers = list(module.get_submodule(module.stpar.layers))
    embedding = module.get_input_embeddings()
    calls = [0] * len(layers)
    for index, layer in enumerate(layers):
        # transformers checkpoints a layer's forward, not its __call__ (the layer's own hooks
        # run once): count its first submodule's calls, which the recompute repeats
        layer.input_layernorm.register_forward_pre_hook(
            lambda m, a, i=index: calls.__setitem__(i, calls[i] + 1)
        )
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    ref = None
    for recompute, k in (*MODES, ("full", 2), ("none", 0)):
        strategy = Strategy(Layout(), recompute=recompute, recompute_layers=k)
        HFBucketRunner._set_recompute(LayoutModel(strategy, cache.get(Layout()), module), strategy)
        calls[:] = [0] * len(layers)
        module.zero_grad(set_to_none=True)
        loss = module(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        expected = strategy.recomputed_layers(len(layers))
        assert calls == [2] * expected + [1] * (len(layers) - expected), (k, calls)
        if not expected:  # off: no checkpointing flag and no input hook left behind
            assert not any(getattr(m, "gradient_checkpointing", False) for m in module.modules())
            assert not embedding._forward_hooks
        grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        assert all(g is not None for g in grads.values())
        if ref is None:
            ref = loss.detach(), grads
            continue
        _assert_same(strategy.short(), loss.detach(), grads, ref, exact=True)

    # decoder layers that transformers does not checkpoint one by one (here: the Llama
    # layers inside plain modules) refuse k short of all of them
    plain = apply_stpar(_tiny_llama(), Layout(), cache=cache)
    stack = plain.get_submodule(plain.stpar.layers)
    for index, layer in enumerate(stack):
        stack[index] = _Plain(layer)
    strategy = Strategy(Layout(), recompute="full", recompute_layers=2)
    with pytest.raises(ConfigError, match="recompute_layers=2 needs decoder layers derived"):
        HFBucketRunner._set_recompute(LayoutModel(strategy, cache.get(Layout()), plain), strategy)


@pytest.mark.dist
def test_hf_first_k_layers_checkpointed() -> None:
    run_workers(_hf_runs, 1)


class _Plain(torch.nn.Module):
    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args, **kwargs):
        return self.layer(*args, **kwargs)
