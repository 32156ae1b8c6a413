"""TemporalColumnParallelLinear / TemporalRowParallelLinear against single-device float64.

Every distributed result is computed in fp32 and compared with a float64 ``nn.Linear``
reference built from the layer's own master weight (``keep_master_weight_for_test``):
output, input gradient, weight gradient and bias gradient, for ring (P=2, P=4) and Cannon
(P=4). Tolerance: max |fp32 - fp64| <= 1e-5 * max |fp64|.
Why: an fp32 dot product of length K <= 64 (the largest reduction here; all <= 256) has a
relative rounding error of about sqrt(K) * 6e-8 <= 5e-7, the ring and the Cannon grid only
reorder those sums, and the chained MLP / attention checks compose a handful of such steps, so
1e-5 is >10x the expected error yet far below any indexing mistake (which is O(1)). Data
movement that involves no arithmetic (weight shards vs Megatron's own layers, checkpoint
shards) is checked bit-exactly.

One launch of 4 workers (10-30 s on 2 cores) covers P=4 ring and Cannon on the world, P=2
ring in two TP groups of 2 inside it (each group on its own data), and P=1. The bare Cannon
functions on a 3 x 3 torus are checked in test_layers_comm.py's 9-worker launch.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_stpar.config import Layout
from ds_stpar.errors import ConfigError
from ds_stpar.layers import TemporalColumnParallelLinear, TemporalRowParallelLinear
from ds_stpar.layers.activation import ClosedFormActivation
from ds_stpar.layers.local import LocalCompute
from ds_stpar.layers.ring_mlp import ring_mlp, ring_two_pass_mlp
from ds_stpar.parallel import GroupCache
from tests.distributed import run_workers

S, B, HIDDEN, FFN, HEADS = 8, 2, 16, 32, 4  # sequence, micro-batch, hidden, ffn, heads
RTOL = 1e-5


def _rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = (actual.double() - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= RTOL * scale, f"{what}: max error {err:.3g} > {RTOL} * {scale:.3g}"


def _config(size: int, fusion: bool = False):
    from megatron.core.model_parallel_config import ModelParallelConfig

    return ModelParallelConfig(
        tensor_model_parallel_size=size,
        sequence_parallel=size > 1,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=fusion,
    )


def _init():
    from megatron.core.utils import init_method_normal

    return init_method_normal(0.5)


def _megatron_index(n: int, size: int, stride: int, rank: int) -> torch.Tensor:
    """Megatron's shard of n output (column) or input (row) features: pieces of
    n/(size*stride), rank d takes pieces d, d+size, ... (stride=2: [gate_d; up_d])."""
    width = n // (size * stride)
    return torch.cat(
        [
            torch.arange((j * size + rank) * width, (j * size + rank + 1) * width)
            for j in range(stride)
        ]
    )


def _megatron_order(n: int, size: int, stride: int) -> torch.Tensor:
    return torch.cat([_megatron_index(n, size, stride, d) for d in range(size)])


def _weight_block(full: torch.Tensor, mode: str, dim: int, rank: int, size: int) -> torch.Tensor:
    """The documented local block of the Megatron-ordered weight: ring shard, or Cannon
    (r, c) -> block (c, (r+c) % q)."""
    if mode == "ring":
        return full.chunk(size, dim=dim)[rank]
    q = math.isqrt(size)
    row, col = divmod(rank, q)
    return full.chunk(q, dim=0)[col].chunk(q, dim=1)[(row + col) % q]


def _reference(layer, seed: int) -> torch.nn.Linear:
    """float64 nn.Linear with the layer's master weight and a random bias, copied into the layer
    (the layer's bias shard is the reference bias in Megatron order)."""
    out_features, in_features = layer.master_weight.shape
    ref = torch.nn.Linear(in_features, out_features, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(layer.master_weight.double())
        ref.bias.copy_(_rand(seed, out_features))
    return ref


def _set_bias(layer, ref, cols: torch.Tensor | None) -> None:
    with torch.no_grad():
        layer.bias.copy_(ref.bias[cols] if cols is not None else ref.bias)


def _column(
    group, mode, seed, *, hidden=HIDDEN, out=FFN, stride=1, skip_bias_add=False, fusion=False
):
    torch.manual_seed(seed)
    return TemporalColumnParallelLinear(
        hidden,
        out,
        config=_config(group.size(), fusion),
        init_method=_init(),
        stride=stride,
        keep_master_weight_for_test=True,
        skip_bias_add=skip_bias_add,
        tp_group=group,
        tp_mode=mode,
    )


def _row(group, mode, seed, *, inp=FFN, hidden=HIDDEN, skip_bias_add=False, fusion=False):
    torch.manual_seed(seed)
    return TemporalRowParallelLinear(
        inp,
        hidden,
        config=_config(group.size(), fusion),
        init_method=_init(),
        bias=True,
        input_is_parallel=True,
        skip_bias_add=skip_bias_add,
        keep_master_weight_for_test=True,
        tp_group=group,
        tp_mode=mode,
    )


def _seq_chunk(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    return t.chunk(size, dim=0)[rank]


def check_column(group, mode, seed, *, stride=1, skip_bias_add=False, fusion=False) -> None:
    size, me = group.size(), group.rank()
    layer = _column(group, mode, seed, stride=stride, skip_bias_add=skip_bias_add, fusion=fusion)
    ref = _reference(layer, seed + 1)
    cols = _megatron_index(FFN, size, stride, me)
    _set_bias(layer, ref, cols)
    if fusion:  # Megatron DDP's buffers: accumulate on top of what is there, flag the grad
        layer.weight.main_grad = torch.full(layer.weight.shape, 0.25)
        layer.weight.grad_added_to_main_grad = False
        layer.weight.zero_out_wgrad = True
    x_full = _rand(seed + 2, S, B, HIDDEN).requires_grad_()
    x = _seq_chunk(x_full.detach(), me, size).float().requires_grad_()
    y, y_bias = layer(x)
    what = f"column {mode} P={size} stride={stride} skip_bias_add={skip_bias_add} fusion={fusion}"
    if skip_bias_add:
        assert y_bias is layer.bias, what
        _close(y, F.linear(x_full, ref.weight)[..., cols].detach(), f"{what}: output")
        y = y + y_bias
    else:
        assert y_bias is None, what
    y_ref = ref(x_full)
    _close(y, y_ref[..., cols].detach(), f"{what}: output")
    grad = _rand(seed + 3, S, B, FFN)
    y.backward(grad[..., cols].float())
    y_ref.backward(grad)
    _close(x.grad, _seq_chunk(x_full.grad, me, size), f"{what}: input grad")
    expect_dw = _weight_block(
        ref.weight.grad[_megatron_order(FFN, size, stride)], mode, 0, me, size
    )
    if fusion:
        _close(layer.weight.main_grad - 0.25, expect_dw, f"{what}: main_grad")
        assert layer.weight.grad_added_to_main_grad, what
        assert torch.equal(layer.weight.grad, torch.zeros_like(layer.weight)), what
    else:
        _close(layer.weight.grad, expect_dw, f"{what}: weight grad")
    _close(layer.bias.grad, ref.bias.grad[cols], f"{what}: bias grad")


def check_row(group, mode, seed, *, skip_bias_add=False, fusion=False) -> None:
    size, me = group.size(), group.rank()
    layer = _row(group, mode, seed, skip_bias_add=skip_bias_add, fusion=fusion)
    ref = _reference(layer, seed + 1)
    _set_bias(layer, ref, None)
    if fusion:  # without grad_added_to_main_grad Megatron returns no weight gradient at all
        layer.weight.main_grad = torch.full(layer.weight.shape, -1.0)
    cols = _megatron_index(FFN, size, 1, me)
    x_full = _rand(seed + 2, S, B, FFN).requires_grad_()
    x = x_full.detach()[..., cols].float().requires_grad_()
    y, y_bias = layer(x)
    what = f"row {mode} P={size} skip_bias_add={skip_bias_add} fusion={fusion}"
    if skip_bias_add:
        assert y_bias is layer.bias, what
        y = y + y_bias
    else:
        assert y_bias is None, what
    y_ref = ref(x_full)
    _close(y, _seq_chunk(y_ref, me, size).detach(), f"{what}: output")
    grad = _rand(seed + 3, S, B, HIDDEN)
    y.backward(_seq_chunk(grad, me, size).float())
    y_ref.backward(grad)
    _close(x.grad, x_full.grad[..., cols], f"{what}: input grad")
    expect_dw = _weight_block(ref.weight.grad, mode, 1, me, size)
    if fusion:
        _close(layer.weight.main_grad + 1.0, expect_dw, f"{what}: main_grad")
        assert layer.weight.grad is None, what
    else:
        _close(layer.weight.grad, expect_dw, f"{what}: weight grad")
    # The bias sees only this rank's tokens; Megatron all-reduces it (sequence_parallel attr).
    assert layer.bias.sequence_parallel is (size > 1)
    bias_grad = layer.bias.grad.clone()
    dist.all_reduce(bias_grad, group=group)
    _close(bias_grad, ref.bias.grad, f"{what}: bias grad (summed over TP)")


def _activation(glu: bool):
    def act(h: torch.Tensor) -> torch.Tensor:
        if glu:  # Megatron's GLU: the local fc1 output is [gate_d; up_d]
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(h)

    return act


def check_mlp(group, mode, seed, *, glu: bool) -> None:
    """fc1 (column; stride=2 GLU or plain) -> activation -> fc2 (row) vs float64."""
    size, me = group.size(), group.rank()
    fc1_out = 2 * FFN if glu else FFN
    fc1 = _column(group, mode, seed, out=fc1_out, stride=2 if glu else 1)
    fc2 = _row(group, mode, seed + 10)
    ref1, ref2 = _reference(fc1, seed + 1), _reference(fc2, seed + 11)
    _set_bias(fc1, ref1, _megatron_index(fc1_out, size, 2 if glu else 1, me))
    _set_bias(fc2, ref2, None)
    act = _activation(glu)
    x_full = _rand(seed + 2, S, B, HIDDEN).requires_grad_()
    x = _seq_chunk(x_full.detach(), me, size).float().requires_grad_()
    y = fc2(act(fc1(x)[0]))[0]
    y_ref = ref2(act(ref1(x_full)))
    what = f"{'glu' if glu else 'gelu'} mlp {mode} P={size}"
    _close(y, _seq_chunk(y_ref, me, size).detach(), f"{what}: output")
    grad = _rand(seed + 3, S, B, HIDDEN)
    y.backward(_seq_chunk(grad, me, size).float())
    y_ref.backward(grad)
    _close(x.grad, _seq_chunk(x_full.grad, me, size), f"{what}: input grad")
    order1 = _megatron_order(fc1_out, size, 2 if glu else 1)
    _close(fc1.weight.grad, _weight_block(ref1.weight.grad[order1], mode, 0, me, size), what)
    _close(fc2.weight.grad, _weight_block(ref2.weight.grad, mode, 1, me, size), what)


def check_ring_mlp(
    group,
    seed,
    *,
    glu: bool,
    fusion: bool,
    pieces: int,
    dx: bool = True,
    two_pass: bool = False,
    closed_form: bool = False,
) -> None:
    """The fused ring MLP (``ring_mlp``) or the two-pass one (``ring_two_pass_mlp``) vs
    float64: fc1 + bias -> activation -> fc2 (its bias is the caller's). ``pieces`` > 1 cuts
    each partial-sum hop of the fused pass into row pieces (pieces of one row allowed here, so
    the 4-8 rows of a chunk give uneven pieces). ``closed_form``: the activation as the
    ``ClosedFormActivation`` StparMLP passes (dA from autograd's kernel, computed over A)
    instead of a plain callable (a nested autograd graph, dA copied over A)."""
    size, me = group.size(), group.rank()
    fc1_out, stride = (2 * FFN, 2) if glu else (FFN, 1)
    fc1 = _column(group, "ring", seed, out=fc1_out, stride=stride, fusion=fusion)
    fc2 = _row(group, "ring", seed + 10, fusion=fusion)
    ref1, ref2 = _reference(fc1, seed + 1), _reference(fc2, seed + 11)
    _set_bias(fc1, ref1, _megatron_index(fc1_out, size, stride, me))
    main_grads = (None, None)
    if fusion:  # accumulate on top of what Megatron DDP's buffers already hold
        main_grads = (torch.full(fc1.weight.shape, 0.5), torch.full(fc2.weight.shape, -0.5))
    act = ClosedFormActivation(F.silu if glu else F.gelu, glu) if closed_form else _activation(glu)
    x_full = _rand(seed + 2, S, B, HIDDEN).requires_grad_()
    x = _seq_chunk(x_full.detach(), me, size).float().requires_grad_(dx)
    args = (x, fc1.weight, fc1.bias, fc2.weight, act, group, *main_grads)
    y = ring_two_pass_mlp(*args) if two_pass else ring_mlp(*args, pieces, 0)
    y_ref = F.linear(act(ref1(x_full)), ref2.weight)
    name = "ring_two_pass_mlp" if two_pass else f"ring_mlp pieces={pieces}"
    name += " closed-form" if closed_form else ""
    what = f"{name} {'glu' if glu else 'gelu'} P={size} fusion={fusion}"
    _close(y, _seq_chunk(y_ref, me, size).detach(), f"{what}: output")
    grad = _rand(seed + 3, S, B, HIDDEN)
    y.backward(_seq_chunk(grad, me, size).float())
    y_ref.backward(grad)
    if dx:
        _close(x.grad, _seq_chunk(x_full.grad, me, size), f"{what}: input grad")
    expect1 = _weight_block(
        ref1.weight.grad[_megatron_order(fc1_out, size, stride)], "ring", 0, me, size
    )
    expect2 = _weight_block(ref2.weight.grad, "ring", 1, me, size)
    if fusion:
        _close(main_grads[0] - 0.5, expect1, f"{what}: fc1 main_grad")
        _close(main_grads[1] + 0.5, expect2, f"{what}: fc2 main_grad")
        assert fc1.weight.grad is None and fc2.weight.grad is None, what
    else:
        _close(fc1.weight.grad, expect1, f"{what}: fc1 weight grad")
        _close(fc2.weight.grad, expect2, f"{what}: fc2 weight grad")
    cols = _megatron_index(fc1_out, size, stride, me)
    _close(fc1.bias.grad, ref1.bias.grad[cols], f"{what}: fc1 bias grad")


def check_a_second_backward_over_da_is_refused(group) -> None:
    """Both ring MLPs' backwards write dA over the saved A (by a copy, or by the closed
    form's kernel writing into it; the fused pass then makes dW1 from it): autograd must
    refuse to run them again through the same graph rather than compute from dA."""
    x = _rand(1, S, B, HIDDEN).float().requires_grad_()
    w1, w2 = _rand(2, FFN, HIDDEN).float(), _rand(3, HIDDEN, FFN).float().requires_grad_()
    for mlp in (ring_two_pass_mlp, ring_mlp):
        for act in (F.gelu, ClosedFormActivation(F.gelu)):
            y = mlp(x, w1, None, w2, act, group)
            y.sum().backward(retain_graph=True)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.sum().backward()


def check_attention(group, mode, seed, *, defer=False, fusion=False) -> None:
    """QKV (column) -> causal attention on this rank's heads -> out-proj (row) vs float64.
    ``defer``: the QKV linear makes the projection's weight gradient (``deferred_wgrad``; at
    P = 2 only, whatever the transport), after the attention's backward; ``fusion``: into the
    projection's ``main_grad``, where nothing is deferred (no dW tensor to defer)."""
    size, me = group.size(), group.rank()
    head_dim = HIDDEN // HEADS
    qkv = _column(group, mode, seed, out=3 * HIDDEN)
    proj = _row(group, mode, seed + 10, inp=HIDDEN, fusion=fusion)
    ref_qkv, ref_proj = _reference(qkv, seed + 1), _reference(proj, seed + 11)
    _set_bias(qkv, ref_qkv, _megatron_index(3 * HIDDEN, size, 1, me))
    _set_bias(proj, ref_proj, None)
    if fusion:  # Megatron DDP's buffers, as in check_column
        proj.weight.main_grad = torch.full(proj.weight.shape, 0.25)
        proj.weight.grad_added_to_main_grad = False
    order = []
    if defer:
        qkv.defer_weight_grad_of(proj, always=True)
        proj.weight.register_post_accumulate_grad_hook(lambda p: order.append("projection dW"))

    def attend(mixed: torch.Tensor) -> torch.Tensor:
        """[s, b, heads * 3 * hd] (Megatron's per-head [q, k, v]) -> [s, b, heads * hd]."""
        s, b = mixed.shape[:2]
        q, k, v = mixed.view(s, b, -1, 3 * head_dim).permute(1, 2, 0, 3).chunk(3, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    x_full = _rand(seed + 2, S, B, HIDDEN).requires_grad_()
    x = _seq_chunk(x_full.detach(), me, size).float().requires_grad_()
    mixed = qkv(x)[0]
    if defer:
        mixed.register_hook(lambda grad: order.append("attention"))
    y = proj(attend(mixed))[0]
    y_ref = ref_proj(attend(ref_qkv(x_full)))
    what = f"attention {mode} P={size} defer={defer} fusion={fusion}"
    _close(y, _seq_chunk(y_ref, me, size).detach(), f"{what}: output")
    grad = _rand(seed + 3, S, B, HIDDEN)
    y.backward(_seq_chunk(grad, me, size).float())
    y_ref.backward(grad)
    _close(x.grad, _seq_chunk(x_full.grad, me, size), f"{what}: input grad")
    _close(qkv.weight.grad, _weight_block(ref_qkv.weight.grad, mode, 0, me, size), what)
    expect_dw = _weight_block(ref_proj.weight.grad, mode, 1, me, size)
    if fusion:
        _close(proj.weight.main_grad - 0.25, expect_dw, f"{what}: main_grad")
        assert proj.weight.grad_added_to_main_grad, what
    else:
        _close(proj.weight.grad, expect_dw, what)
    if defer:  # made after the attention's backward where deferred, before elsewhere
        deferred = ["attention", "projection dW"]
        assert order == (deferred if size == 2 and not fusion else deferred[::-1]), (what, order)


def check_megatron_weights(group, mode, seed) -> None:
    """Same seed -> our shards are Megatron's (ring) or blocks of Megatron's global weight
    (Cannon), bit for bit; the TP attributes are Megatron's."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    size, me = group.size(), group.rank()
    for stride in (1, 2):
        ours = _column(group, mode, seed, stride=stride)
        torch.manual_seed(seed)
        theirs = ColumnParallelLinear(
            HIDDEN,
            FFN,
            config=_config(size),
            init_method=_init(),
            stride=stride,
            tp_group=group,
        )
        _same_weights(ours, theirs, group, mode, 0, stride)
    ours = _row(group, mode, seed)
    torch.manual_seed(seed)
    theirs = RowParallelLinear(
        FFN,
        HIDDEN,
        config=_config(size),
        init_method=_init(),
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
        tp_group=group,
    )
    _same_weights(ours, theirs, group, mode, 1, 1)
    assert ours.bias.shape == theirs.bias.shape and theirs.bias.sequence_parallel
    assert me == group.rank()


def _same_weights(ours, theirs, group, mode, dim, stride) -> None:
    shards = [torch.empty_like(theirs.weight.data) for _ in range(group.size())]
    dist.all_gather(shards, theirs.weight.data.contiguous(), group=group)
    expect = _weight_block(torch.cat(shards, dim=dim), mode, dim, group.rank(), group.size())
    assert torch.equal(ours.weight.data, expect), f"{mode} dim={dim} stride={stride} weights"
    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce"):
        assert getattr(ours.weight, attr) == getattr(theirs.weight, attr), attr
    assert ours.weight.stpar_tp_mode == mode
    if dim == 0:
        assert ours.bias.shape == theirs.bias.shape
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            assert getattr(ours.bias, attr) == getattr(theirs.bias, attr), f"bias {attr}"


def check_checkpoint_shards(group, seed) -> None:
    """sharded_state_dict: assembling every rank's ShardedTensor at its global offset gives the
    same global weight (Megatron order) for ring and Cannon, so checkpoints interchange."""
    size = group.size()
    for make, dim in (
        (lambda m: _column(group, m, seed, stride=2), 0),
        (lambda m: _row(group, m, seed), 1),
    ):
        globals_ = []
        for mode in ("ring", "cannon"):
            layer = make(mode)
            sharded = layer.sharded_state_dict(prefix="fc.", metadata={"dp_cp_group": None})
            tensor = sharded["fc.weight"]
            full = torch.zeros(tensor.global_shape)
            full[tensor.global_slice()] = tensor.data
            dist.all_reduce(full, group=group)
            globals_.append(full)
        stride = 2 if dim == 0 else 1
        master = layer.master_weight
        order = _megatron_order(master.shape[dim], size, stride)
        expect = master[order] if dim == 0 else master[:, order]
        assert torch.equal(globals_[0], expect) and torch.equal(globals_[1], expect), dim
        if dim == 0:  # the column bias is Megatron's shard in both modes
            assert sharded["fc.bias"].global_shape == (FFN,)


def check_errors(group) -> None:
    size = group.size()
    row = _row(group, "ring", 5)
    with pytest.raises(ConfigError, match="not divisible by the TP size"):
        row(torch.zeros(S - 1, B, FFN // size))
    with pytest.raises(ConfigError, match="expects input"):
        row(torch.zeros(S, B, FFN))
    if math.isqrt(size) ** 2 != size:
        with pytest.raises(ConfigError, match="square"):
            _column(group, "cannon", 5)
    with pytest.raises(ConfigError, match="ColumnParallelLinear"):
        _column(group, "megatron", 5)
    if math.isqrt(size) ** 2 == size:
        with pytest.raises(ConfigError, match="tp_mode='ring'"):
            _column(group, "ring", 5).defer_weight_grad_of(_row(group, "cannon", 5))
    q = math.isqrt(size)
    if q > 1 and q * q == size:  # Cannon's blocks cut the unsharded dim by q as well
        with pytest.raises(ConfigError, match=f"input_size=17 must be divisible by {q}"):
            _column(group, "cannon", 5, hidden=17)
        with pytest.raises(ConfigError, match=f"output_size=17 must be divisible by {q}"):
            _row(group, "cannon", 5, hidden=17)
    other = dist.new_group(list(range(dist.get_world_size())))  # collective: every rank
    with pytest.raises(ConfigError, match="one TP group"):
        _column(group, "ring", 5).defer_weight_grad_of(_row(other, "ring", 5))
    biased = _row(group, "ring", 5)  # adds its bias itself (skip_bias_add=False)
    biased.local_compute = LocalCompute()  # a partial sum: the bias would be added on every rank
    with pytest.raises(ConfigError, match="skip_bias_add=True"):
        biased(torch.zeros(S, B, FFN // size))
    layer = _column(group, "ring", 5, fusion=True)
    with pytest.raises(ConfigError, match="main_grad"):
        layer(torch.zeros(S // size, B, HIDDEN))
    with pytest.raises(ConfigError, match="skip_weight_param_allocation"):
        TemporalColumnParallelLinear(
            HIDDEN,
            FFN,
            config=_config(size),
            init_method=_init(),
            tp_group=group,
            skip_weight_param_allocation=True,
            tp_mode="cannon",
        )


def check_external_weight(group, seed) -> None:
    """skip_weight_param_allocation (ring): the weight passed to forward is used as the
    layer's own would be -- same algorithm, so the outputs are bit-identical."""
    size = group.size()
    owner = _column(group, "ring", seed)
    borrower = TemporalColumnParallelLinear(
        HIDDEN,
        FFN,
        config=_config(size),
        init_method=_init(),
        tp_group=group,
        skip_weight_param_allocation=True,
    )
    assert borrower.weight is None
    with torch.no_grad():
        borrower.bias.copy_(owner.bias)
    x = _rand(seed, S // size, B, HIDDEN).float()
    assert torch.equal(borrower(x, weight=owner.weight)[0], owner(x)[0])
    with pytest.raises(ConfigError, match="pass weight="):
        borrower(x)


def _all_layer_checks(group, mode, seed) -> None:
    check_column(group, mode, seed)
    check_column(group, mode, seed + 100, skip_bias_add=True)
    check_column(group, mode, seed + 200, stride=2)
    check_column(group, mode, seed + 300, fusion=True)
    check_row(group, mode, seed + 400)
    check_row(group, mode, seed + 500, skip_bias_add=True)
    check_row(group, mode, seed + 600, fusion=True)
    check_mlp(group, mode, seed + 700, glu=False)
    check_mlp(group, mode, seed + 800, glu=True)
    check_attention(group, mode, seed + 900)
    if mode == "ring":
        check_attention(group, mode, seed + 950, defer=True)
        check_attention(group, mode, seed + 960, defer=True, fusion=True)
    check_megatron_weights(group, mode, seed + 1000)
    if mode == "ring":
        check_external_weight(group, seed + 1100)
        check_ring_mlp(group, seed + 1200, glu=False, fusion=False, pieces=1)
        check_ring_mlp(group, seed + 1300, glu=True, fusion=False, pieces=3)
        check_ring_mlp(group, seed + 1400, glu=True, fusion=True, pieces=2)
        check_ring_mlp(group, seed + 1500, glu=False, fusion=False, pieces=3, dx=False)
        check_ring_mlp(group, seed + 1600, glu=False, fusion=False, pieces=1, two_pass=True)
        check_ring_mlp(group, seed + 1700, glu=True, fusion=True, pieces=1, two_pass=True)
        check_ring_mlp(
            group, seed + 1800, glu=True, fusion=True, pieces=1, two_pass=True, closed_form=True
        )
        check_ring_mlp(
            group, seed + 1900, glu=False, fusion=False, pieces=1, two_pass=True, closed_form=True
        )
        check_ring_mlp(group, seed + 2000, glu=True, fusion=False, pieces=3, closed_form=True)
        check_ring_mlp(group, seed + 2100, glu=False, fusion=True, pieces=2, closed_form=True)
        check_ring_mlp(
            group, seed + 2200, glu=True, fusion=False, pieces=1, dx=False, closed_form=True
        )
        # into main_grad the fused pass's dW1 stays in the ring: with and without dX
        check_ring_mlp(group, seed + 2300, glu=False, fusion=True, pieces=2, dx=False)


def _worker(rank: int, world_size: int) -> None:
    world = dist.group.WORLD
    _all_layer_checks(world, "ring", 30_000)
    _all_layer_checks(world, "cannon", 40_000)
    check_checkpoint_shards(world, 50_000)
    check_errors(world)
    # Two TP groups of 2 ({0, 1} and {2, 3}) inside the world of 4, each on its own data.
    pair = GroupCache().get(Layout(dp=2, tp=2)).tp_group
    _all_layer_checks(pair, "ring", 60_000 + 1000 * (rank // 2))
    check_errors(pair)
    single = GroupCache().get(Layout(dp=4, tp=1)).tp_group  # P=1: plain local GEMMs
    check_column(single, "ring", 70_000 + rank)
    check_row(single, "ring", 71_000 + rank)
    check_ring_mlp(single, 72_000 + rank, glu=True, fusion=False, pieces=2)
    check_ring_mlp(single, 74_000 + rank, glu=False, fusion=True, pieces=1)
    check_ring_mlp(single, 73_000 + rank, glu=True, fusion=False, pieces=1, two_pass=True)
    check_a_second_backward_over_da_is_refused(single)
    check_a_second_backward_over_da_is_refused(pair)


@pytest.mark.dist
def test_temporal_layers_p4_p2_p1() -> None:
    """P=4 ring and Cannon on the world; P=2 ring in two TP groups of 2; P=1."""
    run_workers(_worker, 4)


def test_group_is_required_without_megatron_state() -> None:
    from ds_stpar.layers import resolve_tp_group

    with pytest.raises(ConfigError, match="tp_group"):
        resolve_tp_group(None)
