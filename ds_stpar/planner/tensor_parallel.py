"""Time of one transformer block's linears under each TP mode, per GPU and micro-batch.

Each function returns a :class:`BlockTP`: GEMM seconds, exposed communication seconds
(forward, backward) and the raw seconds per collective kind (all_reduce, all_gather,
reduce_scatter, p2p, for reports and tests). ``S = e T h`` is the full activation of the
micro-batch (T = b s tokens).

Megatron (planner.md "Collectives"): per block 2 all-reduces of S forward and 2 backward, or
with sequence parallelism 2 all-gathers + 2 reduce-scatters forward and the mirror backward.
Backward of a column-parallel linear overlaps its communication with GEMMs when
``tp_async_backward`` (Megatron since late 2021, CUDA_DEVICE_MAX_CONNECTIONS=1): the SP
re-gather of the input with the input-gradient GEMM, the all-reduce / reduce-scatter of the
input gradient with the weight-gradient GEMM; what the GEMM does not cover is exposed.

Ring (temporal-partition.md, Instance A), P = t: every pass (forward; per column linear two
backward passes, dX accumulator and dW operand rotation; per row linear one backward pass)
runs P steps of a chunk GEMM with P - 1 neighbour hops of a ``T/P x dim`` chunk. Every hop
runs beside a GEMM (``layers/comm.ring_pass``): a rotating chunk's first hop starts with the
GEMM on the local chunk, an accumulator's hop with the next partial GEMM; it hides behind
that GEMM up to ``ring_hop_overlap`` of its length (the measured share, ``hop hidden`` of
``bench/layers.py``): pass = P g + (P - 1) max(hop - g, (1 - overlap) hop). No all-reduce.

Cannon (Instance B), P = q x q: q steps per pass of a ``(T/q x k/q) @ (k/q x n/q)`` GEMM while
both operands shift one hop (the larger hop counts); three passes per linear (forward, dX,
dW), one exposed re-skew hop of the output per linear forward and of its gradient backward,
and a small all-reduce of norm statistics over the q ranks of a row per norm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ds_stpar.config import ModelSpec
from ds_stpar.planner.comm import Link
from ds_stpar.planner.compute import Gemm, Phase, Speed, block_linears, megatron_gemm

NORMS_PER_BLOCK = 2
NORM_STAT_BYTES = 8  # fp32 mean and variance per token


@dataclass
class BlockTP:
    gemm: Phase
    comm: Phase  # exposed
    collectives: dict[str, float] = field(default_factory=dict)  # raw seconds per kind

    def count(self, kind: str, seconds: float, times: int = 1) -> None:
        self.collectives[kind] = self.collectives.get(kind, 0.0) + seconds * times


def megatron_block(
    model: ModelSpec,
    tokens: float,
    tp: int,
    sp: bool,
    link: Link,
    speed: Speed,
    async_backward: bool,
    overlap: float,
) -> BlockTP:
    """Megatron TP (+ SP) block: GEMMs on all tokens and 1/t of each weight."""
    fwd_gemm = bwd_gemm = 0.0
    fwd_comm = bwd_comm = 0.0
    size = speed.e * tokens * model.hidden_size
    result = BlockTP(Phase(0, 0), Phase(0, 0))
    for lin in block_linears(model):
        g = megatron_gemm(lin, tokens, tp)
        fwd = speed.gemm(g)
        dgrad, wgrad = speed.gemm(g.dgrad()), speed.gemm(g.wgrad())
        fwd_gemm += fwd
        bwd_gemm += dgrad + wgrad
        if tp == 1:
            continue
        if not sp:
            ar = link.all_reduce(size)
            result.count("all_reduce", ar)
            if lin.column:  # forward: identity; backward: all-reduce of dX
                bwd_comm += _hidden(ar, wgrad, overlap) if async_backward else ar
            else:  # forward: all-reduce of Y; backward: identity
                fwd_comm += ar
            continue
        ag, rs = link.all_gather(size), link.reduce_scatter(size)
        if lin.column:  # fwd all-gather X; bwd re-gather X (for dW) and reduce-scatter dX
            result.count("all_gather", ag, 2)
            result.count("reduce_scatter", rs)
            fwd_comm += ag
            if async_backward:
                bwd_comm += _hidden(ag, dgrad, overlap) + _hidden(rs, wgrad, overlap)
            else:
                bwd_comm += ag + rs
        else:  # fwd reduce-scatter Y; bwd all-gather dY
            result.count("reduce_scatter", rs)
            result.count("all_gather", ag)
            fwd_comm += rs
            bwd_comm += ag
    result.gemm = Phase(fwd_gemm, bwd_gemm)
    result.comm = Phase(fwd_comm, bwd_comm)
    return result


def _hidden(comm: float, gemm: float, overlap: float) -> float:
    """Exposed part of ``comm`` run concurrently with a GEMM that hides ``overlap`` of itself."""
    return max(0.0, comm - overlap * gemm)


def pipelined_pass(steps: int, step_gemm: float, hop: float, overlap: float) -> tuple[float, float]:
    """(GEMM seconds, exposed comm seconds) of ``steps`` steps with ``steps - 1`` hops, each
    hop running beside one step GEMM that hides up to ``overlap`` of it: a hop longer than
    the GEMM shows its excess, a shorter one its unhidden share ``(1 - overlap) hop``."""
    if steps == 1:
        return step_gemm, 0.0
    return steps * step_gemm, (steps - 1) * max(hop - step_gemm, (1.0 - overlap) * hop)


def ring_block(
    model: ModelSpec, tokens: float, tp: int, hop_link: Link, speed: Speed, overlap: float
) -> BlockTP:
    """Ring (P = t): chunk GEMMs of T/P tokens, neighbour hops of T/P x dim chunks."""
    p, e = tp, speed.e
    chunk = tokens / p
    result = BlockTP(Phase(0, 0), Phase(0, 0))
    fwd_g = bwd_g = fwd_c = bwd_c = 0.0

    def run(step_gemms: list[Gemm], hop_dim: int) -> tuple[float, float]:
        hop = hop_link.p2p(e * chunk * hop_dim)
        result.count("p2p", hop, p - 1)
        return pipelined_pass(p, speed.gemms(step_gemms), hop, overlap)

    for lin in block_linears(model):
        if lin.column:  # W_d = W[:, n/P]; X chunks (T/P x k) rotate
            step = Gemm(chunk, lin.n / p, lin.k)
            g, c = run([step], lin.k)
            fwd_g, fwd_c = fwd_g + g, fwd_c + c
            for back in (step.dgrad(), step.wgrad()):  # dX accumulator pass, dW rotation pass
                g, c = run([back], lin.k)
                bwd_g, bwd_c = bwd_g + g, bwd_c + c
        else:  # W_d = W[k/P, :]; forward rotating accumulator of T/P x n
            step = Gemm(chunk, lin.n, lin.k / p)
            g, c = run([step], lin.n)
            fwd_g, fwd_c = fwd_g + g, fwd_c + c
            g, c = run([step.dgrad(), step.wgrad()], lin.n)  # dY chunks rotate
            bwd_g, bwd_c = bwd_g + g, bwd_c + c
    result.gemm = Phase(fwd_g, bwd_g)
    result.comm = Phase(fwd_c, bwd_c)
    return result


def cannon_block(
    model: ModelSpec,
    tokens: float,
    tp: int,
    hop_link: Link,
    row_link: Link,
    speed: Speed,
    overlap: float,
) -> BlockTP:
    """Cannon (P = q^2): q-step passes of (T/q x k/q) @ (k/q x n/q) with both operands shifting."""
    q, e = math.isqrt(tp), speed.e
    m = tokens / q
    result = BlockTP(Phase(0, 0), Phase(0, 0))
    fwd_g = bwd_g = fwd_c = bwd_c = 0.0

    def run(step: Gemm, hop_a: float, hop_b: float) -> tuple[float, float]:
        hop = max(hop_link.p2p(e * hop_a), hop_link.p2p(e * hop_b))
        result.count("p2p", hop, q - 1)
        return pipelined_pass(q, speed.gemm(step), hop, overlap)

    for lin in block_linears(model):
        n, k = lin.n / q, lin.k / q
        step = Gemm(m, n, k)
        g, c = run(step, m * k, k * n)  # X moves left, W moves up
        reskew = hop_link.p2p(e * m * n)
        result.count("p2p", reskew, 2)
        fwd_g, fwd_c = fwd_g + g, fwd_c + c + reskew
        g1, c1 = run(step.dgrad(), k * n, m * k)  # W rotates, dX accumulators move
        g2, c2 = run(step.wgrad(), m * k, m * n)  # X moves diagonally, dY moves up
        bwd_g, bwd_c = bwd_g + g1 + g2, bwd_c + c1 + c2 + reskew
    stats = row_link.all_reduce(NORM_STAT_BYTES * m)
    result.count("all_reduce", stats, 2 * NORMS_PER_BLOCK)
    result.gemm = Phase(fwd_g, bwd_g)
    result.comm = Phase(fwd_c + NORMS_PER_BLOCK * stats, bwd_c + NORMS_PER_BLOCK * stats)
    return result


def sharded_boundary(tp: int, mode: str, sp: bool) -> bool:
    """Whether activations between blocks are split over TP (SP, ring, Cannon)."""
    return tp > 1 and (sp or mode != "megatron")


def head_seqs(micro_batch: int, model: ModelSpec, tp: int) -> float:
    """(sequence, head) pairs of attention on one GPU: b a / t for every mode (Cannon splits
    the batch q ways and the heads q ways)."""
    return micro_batch * model.num_attention_heads / tp
