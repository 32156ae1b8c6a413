"""Instance A for a whole MLP block: fc1 (column) -> activation -> fc2 (row) as one ring pass.

Per-linear rings (``ring.py``) overlap a hop only with the one sub-GEMM beside it. At P = 2 a
ring pass has a single hop carrying half the activation, so on a slow link, where that hop takes
2-4x the sub-GEMM, most of it stays exposed. Fused, every hop overlaps the *whole block's* work
on a chunk (both GEMMs, the activation), and the reduce of fc2's partial outputs is cut into
row pieces that leave as soon as each piece is computed, behind the next piece's GEMMs.

Notation as ``ring.py``: Y = X W^T, M tokens sequence-major (chunk c of P is a contiguous block
of M/P rows), rank d of P, F = fc1's output features (2f for a GLU), F' = fc2's input features::

    x_shard_m [M/P, K] (chunk d)  w1 [F/P, K]  b1 [F/P]  w2 [K, F'/P]  ->  y_shard_m [M/P, K]

    forward:  X chunks rotate (d -> d-1); step t holds chunk c = (d+t) % P:
                A[c] = X[c] W1_d^T + b1_d      (saved)
                Z    = act(A[c]) W2_d^T        rank d's term of Y[c]
              t = 0: Z is kept (own chunk). t >= 1: Z is cut into row pieces; each piece adds
              the partial sum for c received from d+1 (sent at step t-1; t >= 2) and goes on to
              d-1 at once. The sum leaving rank c+1 at step P-1 has every term but c's own,
              which c adds at the end: P-1 hops of X, P-1 hops of partial sums.
    backward: dY chunks rotate the same way; step t, chunk c:
                H = act(A[c]) (recomputed)     dW2_d += dY[c]^T H    db1_d += sum_rows dA
                dA = act'(A[c]) (dY[c] W2_d), written over A[c]
                rank d's term of dX[c] = dA W1_d, summed over the ranks like Y[c] above;
              then, while the last partial sums travel, dW1_d = sum_c dA[c]^T X[c] (into a
              main_grad: dW1_d += dA^T X[c] piece by piece, in the ring).

Saved for backward: every X chunk (``[M, K]``, they all passed through in the forward; keeping them
saves the third activation stream a memory-lean backward would need; the own chunk is the input
itself, the others land in one ``[(P-1) M/P, K]`` buffer) and the pre-activation A (``[M, F/P]``),
not act(A): the activation is recomputed per piece, one elementwise pass. Against Megatron TP+SP,
which saves X's own chunk, A and act(A) (``M K/P + M F/P + M F'/P``), this holds ``M K + M F/P``: at
P = 2 with F = F' = 4K, 3 MK instead of 4.5 MK. Every piece's backward runs once, so dA goes over
the piece's rows of A (a :class:`ClosedFormActivation` computes it there, act(A) freed before dY W2
is made: :func:`~ds_stpar.layers.activation.activation_backward`; any other callable's dA is copied
over); a second backward through the same graph is then refused by autograd's in-place check. With
dA kept that way, dW1 needs no step of its own in the ring: it is made after the rotation's spare
chunk and the pieces' recomputed activations are gone, so those never meet dW1; the partial-sum
inbox and the last partial sums in flight do (at P = 2 and T = h, the backward's peak above its
inputs fell from 20 to 17 ``[M/P, K]`` blocks, and the h 8192 / 8K block's peak from 0.94x to 0.83x
Megatron's; BENCHMARKS.md, twenty-fifth session). The price: the ring's hops hide behind three GEMMs
of a piece rather than four. Into a ``main_grad`` (gradient_accumulation_fusion), where dW1
allocates nothing, it is accumulated piece by piece in the ring, beside the hops, as before.
Communication volume equals Megatron's all-gather / reduce-scatter minus the backward's re-gather of
X: four streams of (P-1)/P of the activation instead of five. An input that the spec's norm made
(``norm_recipe``) is not kept either: the own chunk is made again from the norm's input for dW1,
after the other chunks, whose buffer is released once dW1 has read them (a second backward is
refused anyway), so the two never meet.

**Two passes**, :func:`ring_two_pass_mlp`: fc1's column pass, act, fc2's row pass
(``ring.py``'s passes, each hop beside its own linear's sub-GEMM only), in one autograd node
that owns A: it saves A and X's own chunk, not act(A) (the row's backward recomputes it per
dY chunk) and writes dA over A chunk by chunk, so the backward holds A and one chunk's
act(A), dact(A) and dA where Megatron's MLP holds A, act(A) and a whole dact(A)
(BENCHMARKS.md, seventeenth session). With a :class:`ClosedFormActivation` (what
``StparMLP`` passes for gelu, silu, relu, plain or gated) the chunk's act(A) is gone before
its dA is computed, straight over A, so one chunk's dact(A) is all it holds beside A.
Communication: the two linears' own (the column's backward rotates X again for dW, in its own
pass after the dX accumulator's: ``ring.column_backward``). X's own chunk, when the spec's norm
made it (``norm_recipe``), is not kept but made again after fc2's pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ds_stpar.layers.activation import Activation, activation_backward
from ds_stpar.layers.comm import Group, Message, PendingP2P, ring_pass, start_ring_hop
from ds_stpar.layers.norm_recipe import kept, norm_of, recipe_of, remade
from ds_stpar.layers.ring import column_backward, column_forward, row_forward
from ds_stpar.layers.wgrad import WeightGrad
from ds_stpar.planner.tensor_parallel import MIN_PIECE_FLOP, PIECES, piece_count

_ROTATE_TAG = 0  # gloo tells the streams apart by tag (NCCL by order, the same on every rank)


def _piece_bounds(rows: int, count: int) -> list[tuple[int, int]]:
    """``count`` contiguous row ranges covering ``rows`` (sizes differ by at most one)."""
    count = max(1, min(count, rows))
    edges = [rows * i // count for i in range(count + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def _accumulate_around_ring(
    group: Group,
    rotate: Tensor,
    term: Callable[[int, Tensor, int, int, Tensor | None], Tensor],
    bounds: list[tuple[int, int]],
    own: Tensor,
    kept: Tensor | None = None,
    last: Callable[[], None] | None = None,
) -> Tensor:
    """The schedule of the module docstring; partial sums travel in row pieces ``bounds``.

    ``rotate``: this rank's chunk d ``[rows, ...]``; ``term(c, chunk_c, lo, hi, out)``: this
    rank's term of the sum for rows ``lo:hi`` of chunk c, written into ``out`` when given,
    else as a fresh tensor (made by the term's last op, after its temporaries, and received
    into a buffer like it: under autocast its dtype may not be ``own``'s). ``own``:
    ``[rows, ...]``, where the complete sum for chunk d is built and returned. ``kept``:
    ``[(P - 1) rows, ...]`` to keep the other chunks in (the one of step t >= 1 in row block
    t - 1); else min(2, P - 1) spare buffers taken in turn, freed before the own chunk's last
    rows are computed. ``last()``: work queued after those rows, while the last partial sums
    travel.

    Order of the work: this rank's own chunk but its last piece's rows (while the first hop
    travels), the pieces of the other chunks (each partial sum leaving when computed), then the
    own chunk's last rows (while the last partial sum travels).

    A rotating chunk travels whole: one message per hop. Cutting it into pieces as well was
    measured slower over both links on 2 x H200 (BENCHMARKS.md, fourth session): NCCL's
    per-message cost over host memory outweighs the shorter exposed first piece.
    """
    size, me = group.size(), group.rank()
    left, right = (me - 1) % size, (me + 1) % size
    rows = rotate.shape[0]
    if size == 1:
        term(me, rotate, 0, rows, own)
        if last is not None:
            last()
        return own
    if kept is not None:
        landing = [rotate] + [kept[(t - 1) * rows : t * rows] for t in range(1, size)]
    else:
        spares = [torch.empty_like(rotate) for _ in range(min(2, size - 1))]
        landing = [rotate] + [spares[t % 2] for t in range(size - 1)]
        del spares  # ``landing`` holds them, and lets them go below

    def start_rotation(step: int) -> PendingP2P:
        sends = [Message(landing[step], left, _ROTATE_TAG)]
        return start_ring_hop(sends, [Message(landing[step + 1], right, _ROTATE_TAG)], group)

    rotation = start_rotation(0)
    tail = bounds[-1][0] if len(bounds) > 1 else rows  # own rows left for the end
    term(me, rotate, 0, tail, own[:tail])
    inbox: list[Tensor | None] = [None] * len(bounds)
    incoming: list[PendingP2P | None] = [None] * len(bounds)
    for step in range(1, size):
        chunk = rotation.wait()[0]
        if step < size - 1:
            rotation = start_rotation(step)
        here = (me + step) % size
        for i, (lo, hi) in enumerate(bounds):
            partial = term(here, chunk, lo, hi, None)
            if incoming[i] is not None:
                partial.add_(incoming[i].wait()[0])
            if inbox[i] is None:
                inbox[i] = torch.empty_like(partial)
            # The received piece was added (queued before this batch) so its buffer is free.
            tag = _ROTATE_TAG + 1 + i
            incoming[i] = start_ring_hop(
                [Message(partial, left, tag)], [Message(inbox[i], right, tag)], group
            )
    # The last chunk has been used: without ``kept`` its spare goes before the tail's term.
    landing.clear()
    del chunk, rotation, partial
    if tail < rows:
        term(me, rotate, tail, rows, own[tail:])
    if last is not None:
        last()
    for (lo, hi), pending in zip(bounds, incoming, strict=True):
        own[lo:hi].add_(pending.wait()[0])
    return own


class _RingMLP(torch.autograd.Function):
    """forward / backward: the schedule of the module docstring."""

    @staticmethod
    def forward(ctx, x_shard_m, w1, b1, w2, act, group, main_grad1, main_grad2, pieces, recipe):
        size = group.size()
        x_tokens = x_shard_m.reshape(-1, x_shard_m.shape[-1])
        rows = x_tokens.shape[0]
        bounds = _piece_bounds(rows, piece_count(rows, 2 * (w1.numel() + w2.numel()), *pieces))
        x_kept = x_tokens.new_empty((size - 1) * rows, x_tokens.shape[1])
        a_all = x_tokens.new_empty(size * rows, w1.shape[0])

        def term(c: int, x_c: Tensor, lo: int, hi: int, out: Tensor | None) -> Tensor:
            a = a_all[c * rows + lo : c * rows + hi]
            if b1 is None:
                torch.mm(x_c[lo:hi], w1.t(), out=a)
            else:
                torch.addmm(b1, x_c[lo:hi], w1.t(), out=a)
            return torch.mm(act(a), w2.t(), out=out)

        y_tokens = _accumulate_around_ring(
            group, x_tokens, term, bounds, x_tokens.new_empty(rows, w2.shape[0]), x_kept
        )
        ctx.save_for_backward(kept(x_shard_m, recipe), x_kept, a_all, w1, b1, w2)
        ctx.act, ctx.group, ctx.bounds, ctx.norm = act, group, bounds, norm_of(recipe)
        ctx.main_grads = (main_grad1, main_grad2)
        ctx.x_shape = x_shard_m.shape
        return y_tokens.view(*x_shard_m.shape[:-1], w2.shape[0])

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        saved_x, x_kept, a_all, w1, b1, w2 = ctx.saved_tensors
        size, me = ctx.group.size(), ctx.group.rank()
        need_dx, need_dw1, need_db1, need_dw2 = ctx.needs_input_grad[:4]
        dy_tokens = grad_output.contiguous().view(-1, w2.shape[0])
        rows = dy_tokens.shape[0]
        wgrad1 = WeightGrad(w1, ctx.main_grads[0]) if need_dw1 else None
        wgrad2 = WeightGrad(w2, ctx.main_grads[1]) if need_dw2 else None
        # the bias gradient sums over every token: accumulate at least in fp32
        db1 = (
            torch.zeros_like(b1, dtype=torch.promote_types(b1.dtype, torch.float32))
            if need_db1
            else None
        )

        # dW1 into a main_grad allocates nothing: its GEMMs stay beside the ring's hops
        fc1_in_ring = wgrad1 is not None and wgrad1.main_grad is not None
        own_x = []  # this rank's chunk, made again (norm_recipe) where dW1 first needs it

        def x_chunk(c: int) -> Tensor:
            if c == me:
                if not own_x:
                    own_x.append(remade(saved_x, ctx.norm).reshape(rows, -1))
                return own_x[0]
            block = (c - me) % size - 1  # chunk c arrived at step (c - me) % P
            return x_kept[block * rows : (block + 1) * rows]

        def grad_pre_activation(c: int, dy_c: Tensor, lo: int, hi: int) -> Tensor:
            """dA for rows lo:hi of chunk c, over their A (each rows' backward runs once; a
            closed form computes it there), accumulating dW2, db1 and, into a main_grad,
            dW1."""
            a = a_all[c * rows + lo : c * rows + hi]
            da = activation_backward(ctx.act, a, dy_c[lo:hi], w2, wgrad2)
            if da is not a:  # dW1 after the ring reads it there; a second backward is refused
                a.copy_(da)
            if fc1_in_ring:
                wgrad1.add(a, x_chunk(c)[lo:hi])
            if db1 is not None:
                db1.add_(a.sum(0, dtype=db1.dtype))
            return a

        def fc1_weight_grad() -> None:
            """dW1 = dA^T X over every chunk, once dA is all written over A: a new tensor is
            made after the ring's buffers are gone (module docstring). The other ranks'
            chunks go first and their buffer is released once read, so this rank's chunk,
            when made again from a norm's input, never meets them."""
            if wgrad1 is None or fc1_in_ring:
                return
            for c in range(size):
                if c != me:
                    wgrad1.add(a_all[c * rows : (c + 1) * rows], x_chunk(c))
            x_kept.untyped_storage().resize_(0)  # a second backward is refused (A changed)
            wgrad1.add(a_all[me * rows : (me + 1) * rows], x_chunk(me))

        if need_dx:
            dx_tokens = _accumulate_around_ring(
                ctx.group,
                dy_tokens,
                lambda c, dy_c, lo, hi, out: torch.mm(
                    grad_pre_activation(c, dy_c, lo, hi), w1, out=out
                ),
                ctx.bounds,
                dy_tokens.new_empty(rows, w1.shape[1]),
                last=fc1_weight_grad,
            )
            dx = dx_tokens.view(ctx.x_shape)
        else:
            ring_pass(
                ctx.group,
                rotate=dy_tokens,
                visit=lambda c, dy_c: grad_pre_activation(c, dy_c, 0, rows),
            )
            fc1_weight_grad()
            dx = None
        dw1 = wgrad1.result(a_all.dtype) if wgrad1 is not None else None
        dw2 = wgrad2.result(a_all.dtype) if wgrad2 is not None else None
        db1 = db1.to(b1.dtype) if db1 is not None else None
        return dx, dw1, db1, dw2, None, None, None, None, None, None


def ring_mlp(
    x_shard_m: Tensor,
    w1: Tensor,
    b1: Tensor | None,
    w2: Tensor,
    act: Activation,
    group: Group,
    main_grad1: Tensor | None = None,
    main_grad2: Tensor | None = None,
    pieces: int = PIECES,
    min_piece_flop: float = MIN_PIECE_FLOP,
) -> Tensor:
    """``[s/P, b, K]`` (sequence chunk d) -> ``[s/P, b, K]``: fc2(act(fc1(x) + b1)) over the
    ring of ``group`` (module docstring), fc2's bias left to the caller (Megatron's
    ``skip_bias_add``). ``w1 [F/P, K]`` and ``w2 [K, F'/P]`` are Megatron's shards; ``act``
    maps ``[..., F/P] -> [..., F'/P]`` (a GLU halves it). ``main_grad1/2``: accumulate the
    weight gradients there in fp32 (Megatron's gradient_accumulation_fusion). Chunks travel in
    at most ``pieces`` row pieces of at least ``min_piece_flop`` forward GEMM FLOPs each
    (``min_piece_flop`` <= 0: exactly ``pieces``). The backward writes dA over the saved A,
    so a second backward through the same graph (``retain_graph=True``) is refused by
    autograd's in-place check."""
    recipe = recipe_of(x_shard_m)
    return _RingMLP.apply(
        x_shard_m.contiguous(),
        w1,
        b1,
        w2,
        act,
        group,
        main_grad1,
        main_grad2,
        (pieces, min_piece_flop),
        recipe,
    )


class _RingTwoPassMLP(torch.autograd.Function):
    """fc1's column pass, act, fc2's row pass; A owned, dA written over it (module
    docstring, "Two passes")."""

    @staticmethod
    def forward(ctx, x_shard_m, w1, b1, w2, act, group, main_grad1, main_grad2, recipe):
        x_tokens = x_shard_m.reshape(-1, x_shard_m.shape[-1])
        a_tokens = column_forward(x_tokens, w1, group)
        if b1 is not None:
            a_tokens.add_(b1)
        y_tokens = row_forward(a_tokens, w2, group, act)
        ctx.save_for_backward(kept(x_shard_m, recipe), a_tokens, w1, b1, w2)
        ctx.act, ctx.group, ctx.norm = act, group, norm_of(recipe)
        ctx.main_grads = (main_grad1, main_grad2)
        return y_tokens.view(*x_shard_m.shape[:-1], w2.shape[0])

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        saved_x, a_tokens, w1, b1, w2 = ctx.saved_tensors
        need_dx, need_dw1, need_db1, need_dw2 = ctx.needs_input_grad[:4]
        rows = a_tokens.shape[0] // ctx.group.size()
        dy_tokens = grad_output.contiguous().view(rows, w2.shape[0])
        wgrad2 = WeightGrad(w2, ctx.main_grads[1]) if need_dw2 else None

        def visit(c: int, dy_c: Tensor) -> None:  # dA over A's chunk c
            a = a_tokens[c * rows : (c + 1) * rows]
            da = activation_backward(ctx.act, a, dy_c, w2, wgrad2)
            if da is not a:
                a.copy_(da)

        ring_pass(ctx.group, rotate=dy_tokens, visit=visit)
        da_tokens = a_tokens
        db1 = da_tokens.sum(0, dtype=torch.float32).to(b1.dtype) if need_db1 else None
        wgrad1 = WeightGrad(w1, ctx.main_grads[0]) if need_dw1 else None
        x_shard_m = remade(saved_x, ctx.norm)  # fc1's input, made again after fc2's pass
        x_tokens = x_shard_m.reshape(-1, x_shard_m.shape[-1])
        dx_tokens = column_backward(x_tokens, w1, da_tokens, ctx.group, need_dx, wgrad1)
        dx = dx_tokens.view(x_shard_m.shape) if need_dx else None
        dw1 = wgrad1.result(x_tokens.dtype) if need_dw1 else None
        dw2 = wgrad2.result(x_tokens.dtype) if need_dw2 else None
        return dx, dw1, db1, dw2, None, None, None, None, None


def ring_two_pass_mlp(
    x_shard_m: Tensor,
    w1: Tensor,
    b1: Tensor | None,
    w2: Tensor,
    act: Activation,
    group: Group,
    main_grad1: Tensor | None = None,
    main_grad2: Tensor | None = None,
) -> Tensor:
    """``[s/P, b, K]`` (sequence chunk d) -> ``[s/P, b, K]``: fc2(act(fc1(x) + b1)) as two ring
    passes (module docstring, "Two passes"), fc2's bias left to the caller; shards, ``act`` and
    ``main_grad1/2`` as :func:`ring_mlp`. The backward writes dA over the saved A, so a second
    backward through the same graph (``retain_graph=True``) is refused by autograd's in-place
    check."""
    recipe = recipe_of(x_shard_m)
    return _RingTwoPassMLP.apply(
        x_shard_m.contiguous(), w1, b1, w2, act, group, main_grad1, main_grad2, recipe
    )
