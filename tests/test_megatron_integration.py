"""megatron-core GPT built from ModelSpec/Strategy with explicit groups."""

import contextlib
import dataclasses
import logging
import math
import os

import pytest
import torch
import torch.distributed as dist

from ds_stpar.config import Layout, ModelSpec, Strategy
from ds_stpar.errors import ConfigError
from ds_stpar.layers import interleave as interleave_module
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


def _param_count(rank: int, world: int) -> None:
    from ds_stpar.integrations import megatron_cpu
    from ds_stpar.integrations.megatron import build_gpt
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


def test_gpt_parameter_count():
    run_workers(_param_count, 2)


def _record_pieces(layers, calls: list[int]) -> None:
    """Append to ``calls`` how many pieces each interleaved layer call runs in."""
    for layer in layers:

        def pieces_for(hidden, kwargs, layer=layer):
            calls.append(type(layer).pieces_for(layer, hidden, kwargs))
            return calls[-1]

        layer.pieces_for = pieces_for


# the interleaved layer's transfers
TRANSFERS = ("gather", "gather_others", "all_reduce", "reduce_others")


@contextlib.contextmanager
def _counted_transfers():
    """Count the interleaved layers' transfers by kind while inside (yields the counts):
    ``interleave``'s ``*_start`` names wrapped, and restored on the way out."""
    from ds_stpar.layers import interleave

    counts: dict[str, int] = {}
    starts = {kind: getattr(interleave, f"{kind}_start") for kind in TRANSFERS}

    def counted(kind: str):
        def start(*args, **kwargs):
            counts[kind] = counts.get(kind, 0) + 1
            return starts[kind](*args, **kwargs)

        return start

    for kind in TRANSFERS:
        setattr(interleave, f"{kind}_start", counted(kind))
    try:
        yield counts
    finally:
        for kind, start in starts.items():
            setattr(interleave, f"{kind}_start", start)


def _interleaved_transfers(layers: int, pieces: int, recompute: str) -> dict[str, int]:
    """Transfers per forward of a block of interleaved layers: handed on from layer to layer
    (at the block's ends one gather and one reduction per piece, the first piece's gather of
    the other ranks' rows only, every reduction of those rows only; two all-reduces per
    piece per layer but the last), or per layer under full recompute, each layer run twice."""
    ends = {"gather": pieces - 1, "gather_others": 1, "reduce_others": pieces}
    if recompute == "full":
        return {kind: 2 * layers * n for kind, n in {**ends, "all_reduce": pieces}.items()}
    return {**ends, "all_reduce": (2 * layers - 1) * pieces}


SPEC_VARIANTS = (  # tp_mode, fused ring MLP, recompute, interleave pieces
    ("megatron", True, "none", 0),
    ("ring", True, "none", 0),
    ("ring", True, "full", 0),
    ("ring", False, "none", 0),
    ("ring", True, "none", 2),  # the batch in 2 pieces, interleaved
    ("ring", True, "none", 4),
    ("ring", True, "full", 2),  # in pieces inside Megatron's layer checkpoints
)


def _projection_grad_order(layer) -> list[str]:
    """Records, in a backward through ``layer``, when the attention's backward is done (its
    query's gradient made) and when the projection's weight gradient is accumulated."""
    events: list[str] = []
    attention = layer.self_attention

    def hook_query(module, args, kwargs):
        query = args[0] if args else kwargs["query"]
        if query.requires_grad:  # not in the no-grad forward that full recompute runs first
            query.register_hook(lambda grad: events.append("attention"))

    attention.core_attention.register_forward_pre_hook(hook_query, with_kwargs=True)
    attention.linear_proj.weight.register_post_accumulate_grad_hook(
        lambda param: events.append("projection dW")
    )
    return events


def _spec_parity(
    rank: int,
    world: int,
    spec: ModelSpec = TINY_LLAMA,
    variants: tuple = SPEC_VARIANTS,
    defer_always: bool = False,
) -> None:
    """GPTModel with ds_stpar's spec (Megatron linears + SP; ring with its MLP fused, fused
    under full activation recompute, as two ring linears, and in the layer that interleaves
    pieces of the batch) vs Megatron's local spec.

    The ring layers' projection weight gradient: on gloo the spec does not defer it (no copy
    engines), so it is accumulated before the attention's backward; ``defer_always`` defers it
    anyway (``deferred_wgrad``), and it must come after, with the same gradients."""
    from ds_stpar.integrations import megatron_cpu

    megatron_cpu.apply()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from ds_stpar.integrations.megatron import transformer_config
    from ds_stpar.layers.activation import ClosedFormActivation
    from ds_stpar.layers.megatron_spec import get_gpt_block_stpar_spec

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    seq, batch = 16, 4

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
    for tp_mode, fused, recompute, interleave in variants:
        strategy = Strategy(
            Layout(tp=world, tp_mode=tp_mode),
            recompute=recompute,
            sequence_parallel=True,
            fused_ring_mlp=fused,
        )
        config = transformer_config(spec, strategy, "fp32")
        block = get_gpt_block_stpar_spec(
            config, tp_mode, fused_ring_mlp=fused, interleave=interleave
        )
        ours = build(block, config)
        if tp_mode == "ring":  # silu GLU: StparMLP hands the ring its closed-form derivative
            mlp = ours.decoder.layers[0].mlp
            assert isinstance(mlp.ring_activation, ClosedFormActivation), mlp.ring_activation
            config.activation_func_clamp_value = 7.0  # a clamp has no closed form here
            assert mlp._closed_form_activation() is None
            config.activation_func_clamp_value = None
        calls = []
        if interleave:
            _record_pieces(ours.decoder.layers, calls)
        order = None
        if tp_mode == "ring" and not interleave:
            for layer in ours.decoder.layers:
                attention = layer.self_attention
                deferral = attention.linear_qkv.wgrad_deferral
                assert deferral is not None and deferral is attention.linear_proj.wgrad_deferral
                if defer_always:
                    attention.linear_qkv.defer_weight_grad_of(attention.linear_proj, always=True)
            order = _projection_grad_order(ours.decoder.layers[0])
            if defer_always:  # with hidden dropout the spec does not pair them
                dropped = build(block, dataclasses.replace(config, hidden_dropout=0.1))
                assert dropped.decoder.layers[0].self_attention.linear_qkv.wgrad_deferral is None
        missing, unexpected = ours.load_state_dict(reference.state_dict(), strict=False)
        assert not [k for k in missing + unexpected if not k.endswith("_extra_state")], (
            missing,
            unexpected,
        )
        with _counted_transfers() as transfers:
            loss, grads = loss_and_grads(ours)
        runs = len(ours.decoder.layers) * (2 if recompute == "full" else 1)  # + the recompute
        assert calls == [interleave] * runs if interleave else not calls, calls
        if interleave:
            layers = len(ours.decoder.layers)
            assert transfers == _interleaved_transfers(layers, interleave, recompute), transfers
        if order is not None:
            deferred = ["attention", "projection dW"]
            assert order == (deferred if defer_always else deferred[::-1]), order
        # Same weights and data; only the reduction order (SP collectives, ring steps, SDPA vs
        # baddbmm softmax) differs: fp32 rounding over K <= 96-term sums, far below 1e-5.
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(
                grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"{strategy.short()}: {name}"
            )
        if interleave:  # the last layer Megatron builds in the block ends the hand-on
            assert [layer.hands_on for layer in ours.decoder.layers][-2:] == [True, False]
        if interleave == 4:
            _check_pieces(ours.decoder.layers[0])
    parallel_state.destroy_model_parallel()


def test_gpt_with_deferred_projection_weight_grad_matches_megatron_local_spec():
    variants = (("ring", False, "none", 0), ("ring", True, "full", 0))
    run_workers(_spec_parity, 2, TINY_LLAMA, variants, True)


def _check_pieces(layer) -> None:
    """When an interleaved layer (4 pieces) runs in pieces and when it runs Megatron's forward."""
    hidden = torch.empty(8, 6, 64)
    assert layer.pieces_for(hidden, {}) == 2  # gcd(batch 6, 4)
    assert layer.pieces_for(torch.empty(8, 3, 64), {}) == 1
    assert layer.pieces_for(torch.empty(8, 8, 64), {}) == 4
    assert layer.pieces_for(torch.empty(8, 8, 64), {"packed_seq_params": object()}) == 1
    layer.self_attention.offload_qkv_linear = True  # would offload the QKV GEMM's input
    assert layer.pieces_for(hidden, {}) == 1
    layer.self_attention.offload_qkv_linear = False
    layer.hidden_dropout = 0.1  # a dropout mask per rank would differ between the ranks
    assert layer.train().pieces_for(hidden, {}) == 1
    assert layer.whole_because({}) == "hidden dropout while training"
    assert layer.eval().pieces_for(hidden, {}) == 2
    assert layer.whole_because({}) is None
    packed = {"packed_seq_params": object(), "attention_bias": object()}
    assert layer.whole_because(packed) == "packed_seq_params, attention_bias passed"
    # said once per reason, on global rank 0 only
    said: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = said.append
    logger = logging.getLogger(interleave_module.__name__)
    logger.addHandler(handler)
    interleave_module._SAID.clear()  # what the runs before said
    try:
        for _ in range(2):
            interleave_module._say_once(layer, hidden, (), packed)
            interleave_module._say_once(layer, torch.empty(8, 3, 64), (), {})
    finally:
        logger.removeHandler(handler)
    expect = [
        "packed_seq_params, attention_bias passed",
        "a micro-batch of 3 rows makes no 4 pieces",
    ]
    got = [record.getMessage().split(": ")[-1] for record in said]
    assert got == (expect if dist.get_rank() == 0 else []), got
    with pytest.raises(ConfigError, match="pieces >= 2"):
        type(layer)(layer.config, layer.submodules_config, pieces=1)


def test_gpt_with_stpar_spec_matches_megatron_local_spec():
    run_workers(_spec_parity, 2)


def _hand_on_per_stage(rank: int, world: int) -> None:
    """Which interleaved layers hand on, per pipeline stage: all but the last each stage's
    block builds, even and uneven stages (the layers' global numbers run on across stages),
    from the block spec (set per layer) and from one layer spec the block repeats (read off
    Megatron's layer count by each layer)."""
    from ds_stpar.integrations import megatron_cpu

    megatron_cpu.apply()
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_block import TransformerBlock

    from ds_stpar.integrations.megatron import transformer_config
    from ds_stpar.layers.megatron_spec import get_gpt_block_stpar_spec, get_gpt_layer_stpar_spec

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world)
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "pp", "cp"])
    model = dataclasses.replace(TINY_LLAMA, num_layers=6)
    for first, expect in ((0, {0: [1, 2, 3], 1: [4, 5, 6]}), (5, {0: [1, 2, 3, 4, 5], 1: [6]})):
        strategy = Strategy(Layout(pp=world, tp_mode="ring"), first_stage_layers=first)
        config = transformer_config(model, strategy, "fp32")
        for spec in (
            get_gpt_block_stpar_spec(config, "ring", pp_rank=rank, interleave=2),
            get_gpt_layer_stpar_spec("ring", interleave=2),
        ):
            block = TransformerBlock(config, spec, post_layer_norm=False, pg_collection=pgs)
            numbers = [layer.layer_number for layer in block.layers]
            assert numbers == expect[rank], (first, numbers)
            hands_on = [layer.hands_on for layer in block.layers]
            assert hands_on == [True] * (len(numbers) - 1) + [False], (first, hands_on)
    parallel_state.destroy_model_parallel()


def _ring_layers(world: int, layers: int):
    """Megatron's model-parallel state over a TP group of ``world`` gloo ranks, and the tiny
    Llama of ``layers`` layers as a ring layout's config: (model, config, process groups)."""
    from ds_stpar.integrations import megatron_cpu

    megatron_cpu.apply()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from ds_stpar.integrations.megatron import transformer_config

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "pp", "cp"])
    model = dataclasses.replace(TINY_LLAMA, num_layers=layers)
    strategy = Strategy(Layout(tp=world, tp_mode="ring"), sequence_parallel=True)
    return model, transformer_config(model, strategy, "fp32"), pgs


def _hand_on_landings(rank: int, world: int) -> None:
    """A block of two interleaved layers, the first handing on: the same output and gradients
    as with the first layer reducing its own output, with and without autograd; when the
    second layer runs in other pieces (4 against 2), it lands the pieces and gathers again;
    when nothing interleaved takes them, the placeholder lands on first use; landed early, it
    feeds the next layer its rows; taken, it refuses further use; made with autograd on, it
    refuses to land with it off."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
    )

    from ds_stpar.layers.megatron_spec import get_gpt_layer_stpar_spec

    model, config, pgs = _ring_layers(world, layers=2)
    torch.manual_seed(11)
    x = torch.randn(16 // world, 4, model.hidden_size)
    dy = torch.randn_like(x)

    def spec(pieces: int, hands_on: bool):
        layer = get_gpt_layer_stpar_spec("ring", interleave=pieces)
        return dataclasses.replace(layer, params={**layer.params, "hands_on": hands_on})

    def run(block):
        block.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        out = block(leaf, attention_mask=None)
        out.backward(dy)
        grads = {name: p.grad.clone() for name, p in block.named_parameters()}
        with torch.no_grad():
            assert torch.equal(block(x, attention_mask=None), out.detach()), "no_grad differs"
        return out.detach(), leaf.grad, grads

    for second in (2, 4):
        layers = TransformerBlockSubmodules(layer_specs=[spec(2, True), spec(second, False)])
        block = TransformerBlock(config, layers, post_layer_norm=False, pg_collection=pgs)
        with _counted_transfers() as transfers:
            handed = run(block)
        # per forward (run makes two): 4 pieces after 2, the second layer lands the first
        # one's 2 pieces and gathers 4 itself; a layer's first piece gathers, and every piece
        # of a layer that does not hand on reduces, the other ranks' rows only
        gathers = 1 + (second - 1 if second == 4 else 0)
        ends = {"reduce_others": second}
        others = {"gather_others": 1 + (second == 4)}
        expect = {"gather": gathers, **others, "all_reduce": 4 + second, **ends}
        assert transfers == {kind: 2 * n for kind, n in expect.items()}, (second, transfers)
        block.layers[0].hands_on = False
        reduced = run(block)
        # the forward's sums have 2 terms (exact in any order): the same output to the bit;
        # the backward adds the residual's and the branch's gradients on all rows or on this
        # rank's, in another order: fp32 roundings, measured at most 5e-7 on gradients of
        # magnitude up to 4
        torch.testing.assert_close(handed[0], reduced[0], rtol=0, atol=0)
        torch.testing.assert_close(handed[1], reduced[1], rtol=1e-5, atol=1e-6)
        for name, grad in handed[2].items():
            torch.testing.assert_close(grad, reduced[2][name], rtol=1e-5, atol=1e-6, msg=name)
    # a layer told to hand on where no interleaved layer takes the pieces (a layer that is not
    # interleaved next, or the block's output itself) lands them on first use: the result of
    # the same layers reducing their own output, within the tolerances above
    plain = get_gpt_layer_stpar_spec("ring")
    for specs, interleaved in (([spec(2, True), plain], 1), ([spec(2, True), spec(2, True)], 2)):
        block = TransformerBlock(
            config,
            TransformerBlockSubmodules(layer_specs=specs),
            post_layer_norm=False,
            pg_collection=pgs,
        )
        with _counted_transfers() as transfers:
            handed = run(block)
        # per forward: the first layer's 2 gathers (the first piece's of the others' rows), 2
        # all-reduces per piece per interleaved layer, no reduction (the pieces land as
        # all-reduced rows)
        expect = {"gather": 2, "gather_others": 2, "all_reduce": 2 * 4 * interleaved}
        assert transfers == expect, transfers
        for layer in block.layers:
            layer.hands_on = False
        reduced = run(block)
        torch.testing.assert_close(handed[0], reduced[0], rtol=0, atol=0)
        torch.testing.assert_close(handed[1], reduced[1], rtol=1e-5, atol=1e-6)
        for name, grad in handed[2].items():
            torch.testing.assert_close(grad, reduced[2][name], rtol=1e-5, atol=1e-6, msg=name)
    # a placeholder that something used (landed) before the next layer gets it: that layer
    # runs from the landed rows, to the bit (the same all-reduced rows, gathered again); one
    # whose pieces a layer took refuses any further use
    specs = [spec(2, True), spec(2, False)]
    block = TransformerBlock(
        config,
        TransformerBlockSubmodules(layer_specs=specs),
        post_layer_norm=False,
        pg_collection=pgs,
    )
    first, second = block.layers
    with torch.no_grad():
        expected = block(x, attention_mask=None)
        placeholder = first(hidden_states=x, attention_mask=None)[0]
        assert torch.isfinite(placeholder * 1).all()  # lands
        landed = second(hidden_states=placeholder, attention_mask=None)[0]
        torch.testing.assert_close(landed, expected, rtol=0, atol=0)
        placeholder = first(hidden_states=x, attention_mask=None)[0]
        second(hidden_states=placeholder, attention_mask=None)
        with pytest.raises(RuntimeError, match="already taken"):
            placeholder.sum()
    # made with autograd on, first used with it off: refused (the rows would carry no graph
    # back to the first layer); used with it on, it lands and the gradients reach x
    leaf = x.clone().requires_grad_()
    placeholder = first(hidden_states=leaf, attention_mask=None)[0]
    assert placeholder.shape == x.shape and placeholder.numel() == x.numel()  # no landing
    with torch.no_grad(), pytest.raises(RuntimeError, match="autograd off"):
        placeholder.sum()
    (placeholder * dy).sum().backward()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()
    parallel_state.destroy_model_parallel()


def _one_interleaved_layer(world: int):
    """A block of one interleaved layer (2 pieces, reducing its output) over a TP group of
    ``world`` gloo ranks, and an input: 16 // world rows of a batch of 4 sequences."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
    )

    from ds_stpar.layers.megatron_spec import get_gpt_layer_stpar_spec

    model, config, pgs = _ring_layers(world, layers=1)
    layer = get_gpt_layer_stpar_spec("ring", interleave=2)
    layer = dataclasses.replace(layer, params={**layer.params, "hands_on": False})
    block = TransformerBlock(
        config,
        TransformerBlockSubmodules(layer_specs=[layer]),
        post_layer_norm=False,
        pg_collection=pgs,
    )
    return block, torch.randn(16 // world, 4, model.hidden_size, requires_grad=True)


def _backward_fills(rank: int, world: int) -> None:
    """The interleaved layer's backward pads one gradient with zeros, not seven. Its views of
    one tensor's rows (the own rows, the others', the first piece's assembly) come from
    splits, whose backward concatenates the parts' gradients; slices' backward made a zero
    tensor of the whole per part and autograd added them up (seven per layer step at h 8192,
    twenty-eighth session, call 178). The one left: the first piece's residual takes only
    this rank's rows of its middle, so the split's backward fills the others' rows; it runs
    after that piece's MLP backward, so the padded gradient is not held through it (the
    cut is made before the MLP in the forward; thirty-fourth session, call 223)."""
    from megatron.core import parallel_state
    from torch.utils._python_dispatch import TorchDispatchMode

    from ds_stpar.layers import local

    block, x = _one_interleaved_layer(world)
    piece = x.shape[0] * 2 * x.shape[2]  # this rank's rows of one piece
    events = []

    class Fills(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in ("zeros", "new_zeros", "zero_", "fill_", "zeros_like", "slice_backward"):
                if isinstance(out, torch.Tensor) and out.numel() >= piece:
                    events.append((name, tuple(out.shape)))
            return out

    fc2_backward = local._ActivationLinear.backward

    def recorded(ctx, *grads):
        events.append(("fc2", ctx.saved_tensors[0].shape[0]))  # the rows of A it saved
        return fc2_backward(ctx, *grads)

    out = block(x, attention_mask=None)
    local._ActivationLinear.backward = staticmethod(recorded)
    try:
        with Fills():
            out.backward(torch.randn_like(out))
    finally:
        local._ActivationLinear.backward = staticmethod(fc2_backward)
    fills = [event for event in events if event[0] != "fc2"]
    assert fills == [("zeros", (x.shape[0] * (world - 1), 2, x.shape[2]))], events
    first_piece_mlp = events.index(("fc2", x.shape[0] * world))  # all s rows of the piece
    assert events.index(fills[0]) > first_piece_mlp, events
    parallel_state.destroy_model_parallel()


def test_interleaved_backward_pads_one_gradient_with_zeros():
    run_workers(_backward_fills, 2)


def _sums_in_place(rank: int, world: int) -> None:
    """The interleaved layer's forward all-reduces (one per piece, of the attention's output)
    are handed fresh GEMM outputs and sum them in place (``consume``), with the same output
    as summing copies."""
    from megatron.core import parallel_state

    from ds_stpar.layers import interleave

    block, x = _one_interleaved_layer(world)
    start = interleave.all_reduce_start
    consumed = []

    def recorded(*args, consume: bool = False):
        consumed.append(consume)
        return start(*args, consume=consume)

    def copying(*args, consume: bool = False):
        return start(*args)

    outputs = []
    for wrapper in (recorded, copying):
        interleave.all_reduce_start = wrapper
        try:
            outputs.append(block(x, attention_mask=None))
        finally:
            interleave.all_reduce_start = start
    assert consumed == [True, True], consumed
    assert torch.equal(outputs[0], outputs[1])
    parallel_state.destroy_model_parallel()


def test_interleaved_forward_sums_its_outputs_in_place():
    run_workers(_sums_in_place, 2)


def _backward_order(rank: int, world: int) -> None:
    """The interleaved layer's backward order that lets its edge transfers hide (layers.md):
    it issues the last piece's gather of the other ranks' gradient rows, then runs that
    piece's own rows' MLP backward before it issues any other transfer (a collective queued
    behind the first on NCCL's stream would hold the own rows' kernels behind it on the GPU),
    and it ends by issuing the first piece's reduction of the other ranks' rows and running
    the own rows' QKV backward before waiting for it; every piece but the first makes its
    weight gradients before its input gradients."""
    from megatron.core import parallel_state

    from ds_stpar.layers import async_comm, local

    block, x = _one_interleaved_layer(world)
    own = x.shape[0]
    out = block(x, attention_mask=None)

    events: list[str] = []
    originals = {}

    def record(cls, name: str, label) -> None:
        originals[(cls, name)] = original = getattr(cls, name)

        def backward(ctx, *grads):
            events.append(label(ctx))
            return original(ctx, *grads)

        setattr(cls, name, staticmethod(backward))

    record(async_comm._Finish, "backward", lambda ctx: f"issue {ctx.adjoint.__name__}")
    record(async_comm._Start, "backward", lambda ctx: "wait")
    rows = lambda ctx: ctx.saved_tensors[0].shape[0]  # noqa: E731
    record(local._ActivationLinear, "backward", lambda ctx: f"fc2 {rows(ctx)}")
    first = lambda ctx: " dW first" if ctx.weight_grad_first else ""  # noqa: E731
    record(local._LocalLinear, "backward", lambda ctx: f"linear {rows(ctx)}{first(ctx)}")
    try:
        out.backward(torch.randn_like(out))
    finally:
        for (cls, name), original in originals.items():
            setattr(cls, name, staticmethod(original))
    issues = [i for i, event in enumerate(events) if event.startswith("issue")]
    assert events[0] == "issue start_gather_others", events
    assert events[1] == f"fc2 {own}", events  # the own rows' MLP before any other transfer
    assert issues[1] > 1, events
    last = issues[-1]
    assert events[last] == "issue start_reduce_others", events
    # the own rows' QKV backward (its saved rows: this rank's) runs before the last wait
    assert events[-1] == "wait" and f"linear {own}" in events[last:-1], events
    # every piece but the first (A) makes dW before dX: in the backward's order B's own and
    # other rows' fc1, A's fc1, B's projection and QKV, A's projection, A's QKV of the other
    # ranks' rows and of its own
    firsts = [event.endswith("dW first") for event in events if event.startswith("linear")]
    assert firsts == [True, True, False, True, True, False, False, False], events
    parallel_state.destroy_model_parallel()


def test_interleaved_backward_runs_the_own_rows_beside_the_edge_transfers():
    run_workers(_backward_order, 2)


def test_interleaved_layer_handing_on_matches_reducing_and_lands_for_other_pieces():
    run_workers(_hand_on_landings, 2)


def test_interleaved_layers_hand_on_within_each_pipeline_stage():
    run_workers(_hand_on_per_stage, 2)


def test_interleaved_layer_matches_megatron_at_tp4():
    # 4 ranks: the pieces' gathers, all-reduces and reductions over more than one
    # neighbour, ranks 1 and 2 holding middle chunks (their own rows and the residual slice
    # sit between the others'), 4 pieces of a batch of 4 as well as 2.
    # 3 layers: the middle one takes its input in flight and hands its output on.
    spec = dataclasses.replace(TINY_LLAMA, num_layers=3, num_query_groups=4)
    interleaved = tuple(v for v in SPEC_VARIANTS if v[0] == "megatron" or v[3])
    run_workers(_spec_parity, 4, spec, interleaved)


def test_interleaved_layer_with_biases_matches_megatron():
    # Linear biases: the projection's and fc2's (left to the caller) are added on every row
    # of every rank where the layer hands on, on this rank's rows where it reduces; their
    # gradients, sequence-parallel parameters, are each rank's share and Megatron's TP sum
    # adds them up (the parity's gradients sum them as Megatron's DDP would).
    spec = dataclasses.replace(TINY_LLAMA, num_layers=3, add_bias_linear=True)
    interleaved = tuple(v for v in SPEC_VARIANTS if v[3] and v[2] == "none")
    run_workers(_spec_parity, 2, spec, interleaved)


def _glu_masters(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Global (Megatron checkpoint) tensors of a gated MLP: fc1 ``[gate; up]`` [2f, h] with
    its bias [2f], fc2 [h, f] with its bias [h]; random so that every element differs."""
    h, f = spec.hidden_size, spec.ffn_hidden_size
    gen = torch.Generator().manual_seed(11)
    shapes = {
        "linear_fc1.weight": (2 * f, h),
        "linear_fc1.bias": (2 * f,),
        "linear_fc2.weight": (h, f),
        "linear_fc2.bias": (h,),
    }
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def _glu_rows(full: torch.Tensor, shards: range, size: int) -> torch.Tensor:
    """Megatron's stride-2 GLU rows of TP ranks ``shards``: [gate_d; up_d] for each d in turn."""
    gate, up = full.chunk(2, dim=0)
    return torch.cat([torch.cat((gate.chunk(size)[d], up.chunk(size)[d])) for d in shards])


def _set_mlp(mlp, masters: dict[str, torch.Tensor], mode: str, rank: int, size: int) -> None:
    """This rank's blocks, cut by hand from the global tensors: ring holds Megatron's shards
    (fc1 rows of rank d, fc2 columns d); Cannon rank (r, c) holds rows NB_c of the
    interleaved fc1 (shards cq .. cq+q-1) and columns KB_(r+c)%q, and of fc2 rows NB_c and
    columns KB_(r+c)%q (the fc2 shards (r+c)%q * q .. + q-1 together)."""
    q = math.isqrt(size)
    r, c = divmod(rank, q)
    fc1, fc2 = masters["linear_fc1.weight"], masters["linear_fc2.weight"]
    if mode == "ring":
        w1, w2 = _glu_rows(fc1, range(rank, rank + 1), size), fc2.chunk(size, dim=1)[rank]
    else:
        k = (r + c) % q
        w1 = _glu_rows(fc1, range(c * q, c * q + q), size).chunk(q, dim=1)[k]
        w2 = fc2.chunk(q, dim=0)[c].chunk(q, dim=1)[k]
    with torch.no_grad():
        mlp.linear_fc1.weight.copy_(w1)
        mlp.linear_fc2.weight.copy_(w2)
        mlp.linear_fc1.bias.copy_(
            _glu_rows(masters["linear_fc1.bias"], range(rank, rank + 1), size)
        )
        mlp.linear_fc2.bias.copy_(masters["linear_fc2.bias"])


def _assemble(sharded: dict, prefix: str, group) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(global tensor, how many main-replica shards cover each element), summed over ranks."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        ShardedTensorFactory,
        is_main_replica,
    )

    out = {}
    for key, item in sharded.items():
        pieces = item.build() if isinstance(item, ShardedTensorFactory) else [item]
        for piece in pieces:
            if not isinstance(piece, ShardedTensor):
                continue  # _extra_state objects
            name = key[len(prefix) :]
            full, cover = out.setdefault(
                name, (torch.zeros(piece.global_shape), torch.zeros(piece.global_shape))
            )
            assert full.shape == piece.global_shape, (name, full.shape, piece.global_shape)
            if is_main_replica(piece.replica_id):
                full[piece.global_slice()] += piece.data
                cover[piece.global_slice()] += 1
    for full, cover in out.values():
        dist.all_reduce(full, group=group)
        dist.all_reduce(cover, group=group)
    return out


def _cannon_glu_checkpoint(rank: int, world: int) -> None:
    """The dist-checkpoint view of a SwiGLU MLP built from the Cannon spec: every tensor has
    Megatron's global shape, its shards tile it exactly once and assemble to the global
    tensors (checked bit-exactly: no arithmetic); a save under Cannon loads under ring
    (Megatron's own GLU factory) and back, bit-exactly."""
    import dataclasses
    import shutil
    import tempfile

    from ds_stpar.integrations import megatron_cpu

    megatron_cpu.apply()
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.transformer.spec_utils import build_module

    from ds_stpar.integrations.megatron import transformer_config
    from ds_stpar.layers.megatron_spec import get_gpt_layer_stpar_spec
    from ds_stpar.layers.mlp import StparMLP

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    group = parallel_state.get_tensor_model_parallel_group()
    spec = dataclasses.replace(TINY_LLAMA, add_bias_linear=True)  # h 64, f 96, P 4: q 2
    config = transformer_config(
        spec, Strategy(Layout(tp=world, tp_mode="cannon"), sequence_parallel=True), "fp32"
    )
    masters = _glu_masters(spec)

    def build(mode: str, filled: bool):
        mlp_spec = get_gpt_layer_stpar_spec(mode).submodules.mlp
        mlp = build_module(mlp_spec, config=config, ffn_hidden_size=spec.ffn_hidden_size)
        assert type(mlp) is StparMLP, type(mlp)
        if filled:
            _set_mlp(mlp, masters, mode, rank, world)
        else:
            with torch.no_grad():
                for param in mlp.parameters():
                    param.zero_()
        return mlp

    mlps = {mode: build(mode, True) for mode in ("ring", "cannon")}
    for mode, mlp in mlps.items():
        views = _assemble(mlp.sharded_state_dict(prefix="mlp."), "mlp.", group)
        assert views.keys() == masters.keys(), (mode, views.keys())
        for name, (full, cover) in views.items():
            assert torch.equal(cover, torch.ones_like(cover)), (mode, name, cover.unique())
            assert torch.equal(full, masters[name]), (mode, name)

    path = [tempfile.mkdtemp(prefix="stpar-glu-") if rank == 0 else None]
    dist.broadcast_object_list(path)
    for saved, loaded in (("cannon", "ring"), ("ring", "cannon")):
        folder = f"{path[0]}/{saved}"
        if rank == 0:
            os.makedirs(folder)
        dist.barrier()
        dist_checkpointing.save(mlps[saved].sharded_state_dict(prefix="mlp."), folder)
        fresh = build(loaded, False)
        state = dist_checkpointing.load(fresh.sharded_state_dict(prefix="mlp."), folder)
        fresh.load_state_dict({key[len("mlp.") :]: value for key, value in state.items()})
        for name, param in fresh.named_parameters():
            assert torch.equal(param, dict(mlps[loaded].named_parameters())[name]), (
                f"{saved} -> {loaded}: {name}"
            )
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path[0])
    parallel_state.destroy_model_parallel()


def test_cannon_swiglu_mlp_checkpoint_is_megatrons():
    run_workers(_cannon_glu_checkpoint, 4)


def test_fused_ring_mlp_flag_from_the_environment(monkeypatch):
    # Megatron-LM's --spec imports a spec object, so the fusion comes from the environment:
    # "0"/"1" choose, anything else is refused with the variable's name.
    from ds_stpar.errors import ConfigError
    from ds_stpar.layers.megatron_spec import get_gpt_layer_stpar_spec

    for value, fused in (("0", False), ("1", True)):
        monkeypatch.setenv("DS_STPAR_FUSED_RING_MLP", value)
        assert get_gpt_layer_stpar_spec("ring").submodules.mlp.params["fused_ring"] is fused
    monkeypatch.setenv("DS_STPAR_FUSED_RING_MLP", "yes")
    with pytest.raises(ConfigError, match="DS_STPAR_FUSED_RING_MLP must be 0 or 1, got 'yes'"):
        get_gpt_layer_stpar_spec("ring")
    # an explicit argument wins over the environment
    assert get_gpt_layer_stpar_spec("ring", fused_ring_mlp=False).submodules.mlp.params == {
        "fused_ring": False
    }


def test_interleave_from_the_environment(monkeypatch):
    # DS_STPAR_INTERLEAVE=k (k >= 2) builds the interleaved layer in k pieces for the ring,
    # 0 keeps Megatron's layer, anything but a whole number is refused with the name.
    from ds_stpar.layers.interleave import InterleavedTransformerLayer
    from ds_stpar.layers.megatron_spec import get_gpt_layer_stpar_spec

    monkeypatch.setenv("DS_STPAR_INTERLEAVE", "4")
    spec = get_gpt_layer_stpar_spec("ring")
    assert spec.module is InterleavedTransformerLayer and spec.params == {"pieces": 4}
    assert get_gpt_layer_stpar_spec("megatron").module is not InterleavedTransformerLayer
    monkeypatch.setenv("DS_STPAR_INTERLEAVE", "0")
    assert get_gpt_layer_stpar_spec("ring").module is not InterleavedTransformerLayer
    monkeypatch.setenv("DS_STPAR_INTERLEAVE", "two")
    with pytest.raises(ConfigError, match="DS_STPAR_INTERLEAVE must be a whole number"):
        get_gpt_layer_stpar_spec("ring")
    assert get_gpt_layer_stpar_spec("ring", interleave=2).params == {"pieces": 2}
