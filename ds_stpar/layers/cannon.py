"""Instance B of temporal-partition.md: Cannon's algorithm on a q x q torus (P = q*q ranks).

Core (``Y = X W^T`` as ``F.linear``). Rank (r, c) = group rank r*q + c. Tokens M, features
K (in) and N (out) are each cut into q blocks: MB_r, KB_k, NB_c. Resting layouts are
pre-skewed, so no initial skew is needed::

    W home (r, c) = W[NB_c, KB_(r+c)%q]   one block [N/q, K/q] per rank, never replicated
    X      (r, c) = X[MB_r, KB_(r+c)%q]   [M/q, K/q]
    Y      (r, c) = Y[MB_r, NB_c]         [M/q, N/q]

    forward:  q steps; Y_rc += A B^T; A moves left (to (r, c-1)), B moves up (to (r-1, c))
    backward: dX: dY_rc stays, W blocks move up as in forward, the dX accumulator for
              KB_(r+c+t) moves left; one final hop lands dX[MB_r, KB_(r+c)] on (r, c).
              dW: the accumulator stays home; dY blocks move up, X blocks diagonally (to
              (r-1, c+1)); (r, c) adds dY[MB_(r+t), NB_c]^T X[MB_(r+t), KB_(r+c)] at step t.

Every hop is one P2P message; those of step t+1 are in flight while step t's sub-GEMMs run.

Boundary with Megatron (the choice). The modules are drop-ins, so their inputs and outputs
keep Megatron's sequence-parallel layout: column [s/P, b, K] -> [s, b, N/P], row
[s, b, K/P] -> [s/P, b, N]. Token block MB_r is the sequence block r of q (= SP chunks
rq .. rq+q-1; the batch dim is never split, so causal attention still sees whole sequences
per head), and the feature blocks are unions of q consecutive Megatron shards (so the
Megatron-ordered global weight -- GLU interleaving and per-rank QKV order included -- is cut
into a regular q x q grid). Blocking re-layouts (:func:`~ds_stpar.layers.comm.exchange`)
convert at the boundaries. Received per rank per forward, in elements (M = s*b)::

    column in   SP -> X(r, c)        (q-1)/q * M*K/P    from its own torus row
    column out  Y(r, c) -> [M, N/P]  ~ M*N/P            from torus column r
    row in      [M, K/P] -> X(r, c)  ~ M*K/P            from torus row (r+c)%q
    row out     Y(r, c) -> SP        (q-1)/q * M*N/P    from its own torus row
    core        (q-1) * (M*K + N*K)/P                   overlapped with the sub-GEMMs

(backward: the same volumes mirrored, plus (q-1) hops each of the X and dY blocks for dW).
The ring (Instance A) moves (P-1)/P * M*K per rank, overlapped. Cannon's core traffic shrinks
as 1/q, but the two re-layouts cost about (M*K + M*N)/P per layer and are exposed; so at
P = 4 the ring moves less, and Cannon pays off for large P and many tokens per step (M > K),
where the weight hops are small. A model built on Cannon layouts end to end (norms with a
small all-reduce of statistics, attention split along the batch) would skip the re-layouts:
that is a different module contract, not this drop-in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from ds_stpar.errors import ConfigError
from ds_stpar.layers.comm import ExchangePlan, Group, Message, TorusGrid, exchange, start_p2p
from ds_stpar.layers.wgrad import WeightGrad


def cannon_weight_offsets(rank: int, size: int) -> tuple[tuple[int, int, int], ...]:
    """Where group rank ``rank``'s weight block sits in the Megatron-ordered global weight
    [out, in]: ((axis, block index, number of blocks), ...) as Megatron's ShardedTensor
    ``from_rank_offsets`` takes them. (r, c) holds block (c, (r+c) % q)."""
    q = math.isqrt(size)
    if q * q != size:
        raise ConfigError(f"tp_mode=cannon needs a square TP group (4, 9, 16, ...), got {size}")
    row, col = divmod(rank, q)
    return ((0, col, q), (1, (row + col) % q, q))


@dataclass(frozen=True)
class _Block:
    """A rank's rectangle of a [seq, batch, feat] activation: sequence and feature ranges."""

    seq: tuple[int, int]
    feat: tuple[int, int]

    def meet(self, other: _Block) -> _Block | None:
        seq = (max(self.seq[0], other.seq[0]), min(self.seq[1], other.seq[1]))
        feat = (max(self.feat[0], other.feat[0]), min(self.feat[1], other.feat[1]))
        if seq[0] >= seq[1] or feat[0] >= feat[1]:
            return None
        return _Block(seq, feat)

    def region(self, inside: _Block) -> tuple[slice, ...]:
        """This block as index slices of the local tensor of ``inside``."""
        s0, f0 = inside.seq[0], inside.feat[0]
        return (
            slice(self.seq[0] - s0, self.seq[1] - s0),
            slice(None),
            slice(self.feat[0] - f0, self.feat[1] - f0),
        )


def _block(layout: str, rank: int, size: int, seq: int, feat: int) -> _Block:
    """The block of ``rank`` in one of the four layouts of a [seq, b, feat] activation."""
    q = math.isqrt(size)
    row, col = divmod(rank, q)
    if layout == "seq":  # Megatron sequence parallel: sequence chunk d, all features
        return _Block((rank * seq // size, (rank + 1) * seq // size), (0, feat))
    if layout == "feat":  # Megatron tensor parallel: all tokens, feature shard d
        return _Block((0, seq), (rank * feat // size, (rank + 1) * feat // size))
    k = (row + col) % q if layout == "cannon_in" else col  # "cannon_out": no skew
    return _Block((row * seq // q, (row + 1) * seq // q), (k * feat // q, (k + 1) * feat // q))


@lru_cache(maxsize=256)
def _plan(src: str, dst: str, me: int, size: int, seq: int, batch: int, feat: int) -> ExchangePlan:
    mine_src, mine_dst = _block(src, me, size, seq, feat), _block(dst, me, size, seq, feat)
    sends, recvs = [], []
    for peer in range(size):
        if (piece := mine_src.meet(_block(dst, peer, size, seq, feat))) is not None:
            sends.append((peer, piece.region(mine_src)))
        if (piece := _block(src, peer, size, seq, feat).meet(mine_dst)) is not None:
            recvs.append((peer, piece.region(mine_dst)))
    shape = (mine_dst.seq[1] - mine_dst.seq[0], batch, mine_dst.feat[1] - mine_dst.feat[0])
    return ExchangePlan(shape, tuple(sends), tuple(recvs))


def _relayout(x: Tensor, src: str, dst: str, group: Group, seq: int, feat: int) -> Tensor:
    plan = _plan(src, dst, group.rank(), group.size(), seq, x.shape[1], feat)
    return exchange(x, plan, group)


class _CannonLinear(torch.autograd.Function):
    """forward: q Cannon steps (A left, B up); backward: dX by a left-moving accumulator with
    W moving up, dW accumulated at home with dY moving up and X diagonally."""

    @staticmethod
    def forward(ctx, x_block: Tensor, w_block: Tensor, group: Group, main_grad):
        grid = TorusGrid.of(group)
        q, r, c = grid.q, grid.row, grid.col
        left, right = grid.rank(r, c - 1), grid.rank(r, c + 1)
        up, down = grid.rank(r - 1, c), grid.rank(r + 1, c)
        a, b = x_block.reshape(-1, x_block.shape[-1]), w_block
        spare_a = [torch.empty_like(a) for _ in range(min(2, q - 1))]
        spare_b = [torch.empty_like(b) for _ in range(min(2, q - 1))]
        y = None
        for step in range(q):
            if step < q - 1:
                pending = start_p2p(
                    [Message(a, left, 0), Message(b, up, 1)],
                    [Message(spare_a[step % 2], right, 0), Message(spare_b[step % 2], down, 1)],
                    group,
                )
            y = a @ b.t() if y is None else y.addmm_(a, b.t())
            if step < q - 1:
                a, b = pending.wait()
        ctx.save_for_backward(x_block, w_block)
        ctx.group, ctx.main_grad = group, main_grad
        return y.view(*x_block.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        x_block, w_block = ctx.saved_tensors
        group = ctx.group
        grid = TorusGrid.of(group)
        q, r, c = grid.q, grid.row, grid.col
        left, right = grid.rank(r, c - 1), grid.rank(r, c + 1)
        up, down = grid.rank(r - 1, c), grid.rank(r + 1, c)
        diag_to, diag_from = grid.rank(r - 1, c + 1), grid.rank(r + 1, c - 1)
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy = grad_output.contiguous().view(-1, w_block.shape[0])
        x = x_block.reshape(-1, x_block.shape[-1])
        wgrad = WeightGrad(w_block, ctx.main_grad) if need_dw else None
        # Moving operands by tag: [current block, destination, source, receive buffers].
        n_spare = min(2, q - 1)
        moving = {}
        if need_dx:
            moving[1] = [w_block, up, down, [torch.empty_like(w_block) for _ in range(n_spare)]]
        if need_dw:
            moving[2] = [x, diag_to, diag_from, [torch.empty_like(x) for _ in range(n_spare)]]
            moving[3] = [dy, up, down, [torch.empty_like(dy) for _ in range(n_spare)]]
        acc_buffer = torch.empty_like(x) if need_dx and q > 1 else None
        part, pending = None, None
        for step in range(q):
            if pending is not None:
                received = pending.wait()
                for tag in moving:
                    moving[tag][0] = received.pop(0)
                acc_in = received.pop(0) if need_dx else None
            if need_dx:  # contribution to dX[MB_r, KB_(r+c+step)], passed on to the left
                part = dy @ moving[1][0]
                if step > 0:
                    part += acc_in
            sends, recvs = [], []
            if step < q - 1:
                for tag, (block, dst, src, buffers) in moving.items():
                    sends.append(Message(block, dst, tag))
                    recvs.append(Message(buffers[step % 2], src, tag))
            if need_dx and q > 1:
                sends.append(Message(part, left, 0))
                recvs.append(Message(acc_buffer, right, 0))
            pending = start_p2p(sends, recvs, group) if sends else None
            if need_dw:
                wgrad.add(moving[3][0], moving[2][0])
        if need_dx and q > 1:
            part = pending.wait()[-1]
        dx = part.view(x_block.shape) if need_dx else None
        dw = wgrad.result(x_block.dtype) if need_dw else None
        return dx, dw, None, None


def cannon_column_linear(
    x_shard_m: Tensor, w_block: Tensor, group: Group, main_grad: Tensor | None = None
) -> Tensor:
    """[s/P, b, K] (sequence chunk d) x W block [N/q, K/q] -> [s, b, N/P] (Megatron layout).

    ``main_grad`` as in :func:`~ds_stpar.layers.ring.ring_column_linear`.
    """
    size = group.size()
    seq, in_features = x_shard_m.shape[0] * size, x_shard_m.shape[-1]
    out_features = w_block.shape[0] * math.isqrt(size)
    x_block = _relayout(x_shard_m, "seq", "cannon_in", group, seq, in_features)
    y_block = _CannonLinear.apply(x_block, w_block, group, main_grad)
    return _relayout(y_block, "cannon_out", "feat", group, seq, out_features)


def cannon_row_linear(
    x_shard_k: Tensor, w_block: Tensor, group: Group, main_grad: Tensor | None = None
) -> Tensor:
    """[s, b, K/P] x W block [N/q, K/q] -> [s/P, b, N] (sequence chunk d); s must divide by P."""
    size = group.size()
    seq, in_features = x_shard_k.shape[0], x_shard_k.shape[-1] * size
    out_features = w_block.shape[0] * math.isqrt(size)
    x_block = _relayout(x_shard_k, "feat", "cannon_in", group, seq, in_features)
    y_block = _CannonLinear.apply(x_block, w_block, group, main_grad)
    return _relayout(y_block, "cannon_out", "seq", group, seq, out_features)
