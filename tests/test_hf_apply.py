"""apply_stpar on HF LlamaForCausalLM (GQA) and GPT2LMHeadModel against the unsharded model.

Each sharded model runs in fp32 and is compared with a float64 copy of the same randomly
initialised model (``deepcopy(...).double()``) on the same tokens: the logits and the HF loss,
and the gradient of every parameter -- the rank's block of a sharded weight or bias (cut from
the reference gradient by the layer's own ``weight_block`` / ``bias_block``) or the whole
gradient of a replicated one. Tolerance: max |fp32 - fp64| <= 2e-5 * max |fp64| per tensor.
Why: the unsharded fp32 model itself is ~1e-6 away from fp64 here (dot products of length
<= 128, two layers, softmax and norms: a few dozen roundings of 6e-8 with condition numbers of
order 1-10; Llama's RMSNorm even computes in fp32 inside the float64 model); sharding only
reorders sums (ring/Cannon accumulation order, the TP all-reduce of norm gradients), so 2e-5
leaves a 10x margin while any wrong block, head split or missing gradient sum is O(1).
Gathering the shards back (:func:`full_state_dict`) must give the original weights bit for bit.

One launch of 4 workers (~30 s on 2 cores): TP=4 ring, Cannon and Megatron over the world;
TP=2 ring in the two TP groups of a dp2 x tp2 layout (each group on its own tokens), also with
a packed micro-batch (one row: 4-D block-diagonal mask, restarting positions), with gradient
checkpointing, and with the gathered weights loaded into a plain model; the input errors.
Under the ring, autograd keeps none of the layers' norm outputs: the ring columns keep the
norms' inputs and make the outputs again (``layers/norm_recipe.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from ds_stpar.config import Layout
from ds_stpar.errors import ConfigError
from ds_stpar.layers import apply_stpar
from ds_stpar.layers.hf import GPT2_TP_PLAN, full_state_dict, tp_plan
from ds_stpar.parallel import GroupCache
from ds_stpar.seqbucket.packing import Piece, RowPlan, collate, token_multiple
from tests.distributed import run_workers

RTOL = 2e-5
VOCAB, SEQ, BATCH = 96, 8, 2


def _llama(kv_heads: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        initializer_range=0.2,
    )
    return LlamaForCausalLM(config)


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_head=4,
        n_layer=2,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        initializer_range=0.2,
    )
    return GPT2LMHeadModel(config)


BUILDERS = {"llama": _llama, "gpt2": _gpt2}


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = (actual.double() - expected.double()).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= RTOL * scale, f"{what}: max error {err:.3g} > {RTOL} * {scale:.3g}"


def _check_grads(model, ref, what: str) -> None:
    ref_params = dict(ref.named_parameters())
    assert ref_params.keys() == dict(model.named_parameters()).keys()
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        expected = ref_params[name].grad
        if owner in model.stpar.linears:
            layer = model.get_submodule(owner)
            expected = (
                layer.weight_block(expected) if leaf == "weight" else layer.bias_block(expected)
            )
            if leaf == "weight":
                assert param.numel() * model.stpar.tp_size == ref_params[name].numel(), name
        assert param.grad is not None, f"{what}: {name} got no gradient"
        _close(param.grad, expected, f"{what} grad {name}")


def _parity(kind: str, layout: Layout, cache: GroupCache, seed: int, **inputs) -> None:
    """Sharded fp32 vs float64 reference: logits, loss, every gradient, gathered weights."""
    base = BUILDERS[kind]()
    ref = copy.deepcopy(base).double()
    model = apply_stpar(copy.deepcopy(base), layout, cache=cache)
    assert model.stpar.tp_size == layout.tp
    assert len(model.stpar.linears) == {"llama": 14, "gpt2": 8}[kind]  # 7 or 4 per layer
    shape = tuple(inputs["position_ids"].shape) if "position_ids" in inputs else (BATCH, SEQ)
    ids = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))
    norm_outputs, saved = [], []  # the layers' norm outputs, and what autograd keeps
    for name, module in model.named_modules():
        if name.startswith(f"{model.stpar.layers}.") and "norm" in type(module).__name__.lower():
            module.register_forward_hook(lambda mod, args, output: norm_outputs.append(output))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = model(input_ids=ids, labels=ids, use_cache=False, **inputs)
    expected = ref(input_ids=ids, labels=ids, use_cache=False, **inputs)
    if layout.tp_mode == "ring":  # the ring columns keep the norms' inputs (norm_recipe)
        kept = {t.untyped_storage().data_ptr() for t in saved}
        assert len(norm_outputs) == 4
        assert not any(o.untyped_storage().data_ptr() in kept for o in norm_outputs), kind
    saved.clear()
    what = f"{kind} {layout.short()}"
    _close(out.logits, expected.logits, f"{what} logits")
    _close(out.loss, expected.loss, f"{what} loss")
    out.loss.backward()
    expected.loss.backward()
    _check_grads(model, ref, what)
    gathered = full_state_dict(model)
    original = base.state_dict()
    assert gathered.keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(gathered[key], value), f"{what}: gathered {key} differs"


def _packed(length: int, tp: int) -> dict[str, torch.Tensor]:
    """A micro-batch of two packed rows of documents 0-3 as collate feeds it: one row of the
    pieces end to end (position ids restart, block-diagonal mask), padded to a multiple of
    token_multiple(tp) tokens."""
    docs = {
        d: torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(d)).numpy()
        for d in range(4)
    }
    rows = [
        RowPlan(length, (Piece(0, 0, 5, True), Piece(1, 0, 3, True))),
        RowPlan(length, (Piece(2, 0, 6, True),)),  # two pad tokens of its own, dropped
    ]
    batch = collate(rows, docs.__getitem__, pad_id=0, multiple=token_multiple(tp))
    # 14 real tokens, two pad tokens at the end: a multiple of 8 (and of the TP size)
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1]]
    assert batch.attention_mask().shape == (1, 1, 16, 16)
    return {"position_ids": batch.position_ids, "attention_mask": batch.attention_mask()}


def _packed_checkpointed_reloaded(cache: GroupCache) -> None:
    layout = Layout(dp=2, tp=2, tp_mode="ring")
    _parity("llama", layout, cache, seed=3, **_packed(SEQ, layout.tp))
    _parity("gpt2", layout, cache, seed=4, **_packed(SEQ, layout.tp))

    # gradient checkpointing recomputes the layers (and their scatter/proxy hooks)
    base = _llama()
    ref = copy.deepcopy(base).double()
    model = apply_stpar(copy.deepcopy(base), layout, cache=cache)
    model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    ref(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    _check_grads(model, ref, "llama checkpointed")

    unsupported = _llama()
    unsupported.config.base_model_tp_plan = {"layers.*.self_attn.q_proj": "colwise_rep"}
    with pytest.raises(ConfigError, match="style 'colwise_rep' is not supported"):
        apply_stpar(unsupported, layout, cache=cache)

    # after an update of the shards, the gathered weights make a plain HF model that
    # computes what the sharded one does
    with torch.no_grad():
        for param in model.parameters():
            param -= 0.1 * param.grad
    plain = _llama()
    plain.load_state_dict(full_state_dict(model))
    with torch.no_grad():
        _close(model(input_ids=ids).logits, plain(input_ids=ids).logits.double(), "reloaded")


def _four_workers(rank: int, world_size: int) -> None:
    cache = GroupCache()
    for kind in BUILDERS:
        for mode in ("ring", "cannon", "megatron"):
            _parity(kind, Layout(tp=4, tp_mode=mode), cache, seed=1)
        layout = Layout(dp=2, tp=2, tp_mode="ring")
        _parity(kind, layout, cache, seed=10 + cache.get(layout).dp_index)

    with pytest.raises(ConfigError, match="num_key_value_heads=2 is not divisible"):
        apply_stpar(_llama(kv_heads=2), Layout(tp=4, tp_mode="ring"), cache=cache)
    with pytest.raises(ConfigError, match="pp=1"):
        apply_stpar(_llama(), Layout(tp=2, pp=2, tp_mode="ring"), cache=cache)
    model = apply_stpar(_gpt2(), Layout(tp=4, tp_mode="ring"), cache=cache)
    with pytest.raises(ConfigError, match="already applied"):
        apply_stpar(model, Layout(tp=4, tp_mode="ring"), cache=cache)
    with pytest.raises(ConfigError, match="sequence length 6 is not a multiple of the TP size 4"):
        model(input_ids=torch.zeros(1, 6, dtype=torch.long))
    _packed_checkpointed_reloaded(cache)


def test_gpt2_uses_the_derived_plan() -> None:
    assert GPT2Config.base_model_tp_plan is None  # if HF ships one, compare it with ours
    assert tp_plan(_gpt2()) == GPT2_TP_PLAN
    assert tp_plan(_llama()) == LlamaConfig.base_model_tp_plan


def test_no_group_is_an_input_error() -> None:
    with pytest.raises(ConfigError, match="needs a Layout"):
        apply_stpar(_llama())


def test_hf_models_on_four_workers() -> None:
    run_workers(_four_workers, 4)
