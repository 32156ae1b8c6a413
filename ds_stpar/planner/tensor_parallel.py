"""Time of one transformer block's linears under each TP mode, per GPU and micro-batch.

Each function returns a :class:`BlockTP`: GEMM seconds, exposed communication seconds
(forward, backward) and the raw seconds per collective kind (all_reduce, all_gather,
reduce_scatter, p2p, all_to_all; for reports and tests). ``S = e T h`` is the full
activation of the micro-batch (T = b s tokens).

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

Cannon (Instance B, ``layers/cannon.py``), P = q x q. The layer keeps Megatron's
sequence-parallel boundary layouts, so per linear it runs:

- four blocking re-layouts (``layers/comm.exchange``, an all-to-all-v of P2P messages),
  forward in and out and their transposes in backward, which receive the same volumes
  (:func:`cannon_relayout_elements`). None overlaps compute. Each is priced as one transfer
  of what a rank receives over the TP P2P link, ``alpha + e V / B`` (a rank receives from
  its peers at once, through its own links);
- a forward pass of q steps of a ``(T/q x k/q) @ (k/q x n/q)`` GEMM while the X block moves
  left and the W block up (the larger hop counts), hidden as in the ring;
- a backward of q steps of the dX and dW sub-GEMMs: step j's hops (W up, X diagonally, dY
  up, the dX accumulator left; the largest counts) run beside step j's dW GEMM, the last
  step's hop carries only the accumulator; each shows ``max(hop - g_dW, (1 - overlap) hop)``.

Norms, attention and the residual stream run in Megatron's SP layout, as for the ring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ds_stpar.config import ModelSpec
from ds_stpar.planner.comm import Link
from ds_stpar.planner.compute import Gemm, Linear, Phase, Speed, block_linears, megatron_gemm

#: The fused ring MLP (``layers/ring_mlp.py``) sends a partial-sum hop in at most PIECES row
#: pieces, each worth at least MIN_PIECE_FLOP of forward GEMM work (here so that the planner
#: prices the pieces the layer runs without importing torch). More pieces shorten the exposed
#: last hop (1/pieces of a chunk's); a piece below ~0.4 ms of GEMMs lets the host (a dozen
#: Python-issued ops and a P2P batch per piece) fall behind the GPU: on 2 x H200 over NVLink
#: 4 pieces of 1024 rows at h 4096 ran 0.72-0.95x Megatron, 1-2 pieces 0.99-1.02x.
PIECES, MIN_PIECE_FLOP = 4, 2.5e11


def piece_count(rows: int, flop_per_row: float, pieces: int, min_piece_flop: float) -> int:
    """Pieces a chunk of ``rows`` is cut into: at most ``pieces``, each >= ``min_piece_flop``
    (``min_piece_flop`` <= 0: exactly ``pieces``)."""
    if min_piece_flop <= 0:
        return pieces
    return max(1, min(pieces, int(rows * flop_per_row // min_piece_flop)))


@dataclass
class BlockTP:
    gemm: Phase
    comm: Phase  # exposed
    collectives: dict[str, float] = field(default_factory=dict)  # raw seconds per kind

    def count(self, kind: str, seconds: float, times: float = 1) -> None:
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


def _beside(hop: float, gemm: float, overlap: float) -> float:
    """Exposed part of a hop run beside a GEMM that hides up to ``overlap`` of the hop: a hop
    longer than the GEMM shows its excess, a shorter one its unhidden share."""
    return max(hop - gemm, (1.0 - overlap) * hop)


def pipelined_pass(steps: int, step_gemm: float, hop: float, overlap: float) -> tuple[float, float]:
    """(GEMM seconds, exposed comm seconds) of ``steps`` steps with ``steps - 1`` hops, each
    hop running beside one step GEMM that hides up to ``overlap`` of it: a hop longer than
    the GEMM shows its excess, a shorter one its unhidden share ``(1 - overlap) hop``."""
    if steps == 1:
        return step_gemm, 0.0
    return steps * step_gemm, (steps - 1) * _beside(hop, step_gemm, overlap)


def ring_mlp_pieces(model: ModelSpec, tokens: float, tp: int) -> int:
    """Row pieces a fused ring MLP cuts each chunk's partial sum into (``layers/ring_mlp``'s
    rule: at most PIECES, each worth MIN_PIECE_FLOP of forward GEMM work)."""
    _, _, fc1, fc2 = block_linears(model)
    flop_per_row = 2 * (fc1.n * fc1.k + fc2.n * fc2.k) / tp
    return piece_count(int(tokens / tp), flop_per_row, PIECES, MIN_PIECE_FLOP)


def fused_ring_mlp(
    model: ModelSpec, tokens: float, tp: int, hop_link: Link, speed: Speed, overlap: float
) -> tuple[Phase, Phase, float]:
    """(GEMM seconds, exposed comm seconds, one hop's seconds) of the MLP as one fused ring
    pass (``layers/ring_mlp.py``), P = t, k pieces (:func:`ring_mlp_pieces`), g = a chunk's
    work in the ring (both GEMMs forward; both dgrads and fc2's wgrad backward), H = one
    ``T/P x h`` hop.

    Each pass (forward: X rotates, partial sums of Y travel; backward: dY rotates, partial
    sums of dX travel) runs the own chunk but its last piece beside the first rotation hop,
    then P - 1 chunk steps whose partial sums (and, but for the last step, the next rotation:
    two hops on the link) leave piece by piece beside that step's work, the own last piece
    and, in the backward, fc1's wgrad over all T tokens (w, made after the ring) covering the
    final partial sum::

        exposed = beside(H, g (k-1)/k) + sum_{t=1}^{P-1} beside(hops_t H, g + [t = P-1] w)

    with ``beside`` as the ring's (module docstring); with k = 1 the last step's partial sum
    has no chunk work beside it. The backward does not rotate X (the forward kept the chunks),
    and recomputes act(A) for all T tokens: one more elementwise pass reading fc1's output
    (e f/t, GLU 2 e f/t) and writing act(A) (e f/t), counted with the backward GEMMs. Priced
    as the GPU loop runs it (gradient_accumulation_fusion off); a Megatron-LM run with the
    fusion on accumulates fc1's wgrad in the ring, beside the hops, and runs at most as long
    (up to 1% shorter on a layer at h 4096 over the slow link, by this model)."""
    _, _, fc1, fc2 = block_linears(model)
    p, chunk = tp, tokens / tp
    k = ring_mlp_pieces(model, tokens, tp)
    steps = (Gemm(chunk, fc1.n / p, fc1.k), Gemm(chunk, fc2.n, fc2.k / p))
    g_fwd = speed.gemms(list(steps))
    g_ring = speed.gemms([steps[0].dgrad(), steps[1].dgrad(), steps[1].wgrad()])
    fc1_wgrad = p * speed.gemms([steps[0].wgrad()])
    hop = hop_link.p2p(speed.e * chunk * model.hidden_size)

    def exposed(g: float, after: float) -> float:
        head = g * (k - 1) / k if k > 1 else g
        total = _beside(hop, head, overlap)
        for t in range(1, p):
            hops = 2 if t < p - 1 else 1
            window = g if (k > 1 or t < p - 1) else 0.0
            total += _beside(hops * hop, window + (after if t == p - 1 else 0.0), overlap)
        return total

    recompute = speed.elementwise(speed.e * tokens * (fc1.n + fc2.k) / p)
    gemm = Phase(p * g_fwd, p * g_ring + fc1_wgrad + recompute)
    floor = speed.cal.ring_mlp_pass_s
    return gemm, Phase(max(exposed(g_fwd, 0.0), floor), max(exposed(g_ring, fc1_wgrad), floor)), hop


def ring_block(
    model: ModelSpec,
    tokens: float,
    tp: int,
    hop_link: Link,
    speed: Speed,
    overlap: float,
    fused_mlp: bool = False,
    two_pass_mlp: bool = False,
    mlp_overlap: float | None = None,
    mlp_link: Link | None = None,
) -> BlockTP:
    """Ring (P = t): chunk GEMMs of T/P tokens, neighbour hops of T/P x dim chunks, each
    hidden up to ``overlap``; with ``fused_mlp`` the MLP as :func:`fused_ring_mlp`, its hops
    over ``mlp_link`` (default ``hop_link``) hidden up to ``mlp_overlap`` (default ``overlap``:
    the fused pass's hops go by NCCL, or staged through host memory, never by the linears'
    peer-link copy engines); with ``two_pass_mlp`` (the MLP's two
    passes in one node, ``layers/ring_mlp.py``) its linears as two ring linears plus, in the
    backward, act(A) recomputed for fc2's weight gradient (read fc1's output e f1/t, write
    e f/t); its derivative kernel writes dA over A, as Megatron's writes it anywhere (the
    closed-form activations: gelu, silu, relu, plain or gated). A column's backward is two
    passes, the dX accumulator's then the dW rotation's (``ring.column_backward``)."""
    p, e = tp, speed.e
    chunk = tokens / p
    result = BlockTP(Phase(0, 0), Phase(0, 0))
    fwd_g = bwd_g = fwd_c = bwd_c = 0.0

    def run(step_gemms: list[Gemm], hop_dim: int) -> tuple[float, float]:
        hop = hop_link.p2p(e * chunk * hop_dim)
        result.count("p2p", hop, p - 1)
        return pipelined_pass(p, speed.gemms(step_gemms), hop, overlap)

    linears = block_linears(model)
    if fused_mlp and p > 1:
        mlp_share = overlap if mlp_overlap is None else mlp_overlap
        mlp_hops = mlp_link or hop_link
        gemm, comm, hop = fused_ring_mlp(model, tokens, p, mlp_hops, speed, mlp_share)
        result.count("p2p", hop, 4 * (p - 1))
        fwd_g, bwd_g, fwd_c, bwd_c = gemm.fwd, gemm.bwd, comm.fwd, comm.bwd
        linears = linears[:2]
    for lin in linears:
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
    if two_pass_mlp and not fused_mlp and p > 1:
        fc1, fc2 = linears[2], linears[3]
        bwd_g += speed.elementwise(e * tokens * (fc1.n + fc2.k) / p)
    result.gemm = Phase(fwd_g, bwd_g)
    result.comm = Phase(fwd_c, bwd_c)
    return result


def _flow_shop(
    attention: float,
    mlp: float,
    gather: float,
    middle: float,
    reduce: float,
    pieces: int,
    layers: int = 1,
    head: float = 0.0,
    tail: float = 0.0,
) -> float:
    """Seconds from the first gather to the end of one pass of ``layers`` interleaved layers
    handing on (a block's; 1: a layer alone): the compute stream runs every piece's attention
    half, then every piece's MLP half, layer after layer; the link runs every piece's gather,
    then per layer the middle all-reduces and the boundary all-reduces (the last layer's:
    the reductions), one at a time. A half waits for its piece's transfer before it, a
    transfer for its piece's half before it; but ``head`` seconds of the first piece's first
    half wait for nothing, and the last reduction does not wait for the last ``tail``
    seconds of the last piece's last half (the work on this rank's own rows)."""
    link, ready = _in_turn(0.0, [0.0] * pieces, [gather] * pieces)
    compute = head
    for layer in range(layers):
        first = [attention] * pieces
        if layer == 0:
            first[0] -= head
        compute, ready = _in_turn(compute, ready, first)
        link, ready = _in_turn(link, ready, [middle] * pieces)
        compute, ready = _in_turn(compute, ready, [mlp] * pieces)
        if layer == layers - 1:
            ready[-1] -= tail
        link, ready = _in_turn(link, ready, [reduce if layer == layers - 1 else middle] * pieces)
    return max(link, compute)


def _in_turn(free: float, ready: list[float], lengths: list[float]) -> tuple[float, list[float]]:
    """One resource, free from ``free``, running a job of ``lengths[i]`` per entry of
    ``ready`` in order, none before its ready time: (when the resource is free again, each
    job's end)."""
    ends = []
    for at, length in zip(ready, lengths, strict=True):
        free = max(free, at) + length
        ends.append(free)
    return free, ends


def interleaved_block(
    model: ModelSpec,
    tokens: float,
    tp: int,
    link: Link,
    speed: Speed,
    overlap: float,
    pieces: int,
    attention: Phase,
    elementwise: Phase,
    layers: int = 1,
) -> BlockTP:
    """The interleaved layer (``layers/interleave.py``), k pieces of T/k tokens: Megatron's
    GEMMs on each piece (the linears run locally), and per piece a gather of its input, an
    all-reduce in the middle and a reduce-scatter of its output (sent as the other ranks'
    rows, the own term added where it lands), each of S/k (S = e T h); the backward runs the
    adjoints (reduce-scatter, all-reduce, gather) in the mirror order.
    ``layers``: how many layers hand their pieces on in one block (a model chunk's; 1 under
    full recompute): the block's inner boundaries are one all-reduce each instead of a
    reduce-scatter and a gather, and the returned costs are the block's per layer.

    Each pass is a two-machine flow shop (:func:`_flow_shop`) of the pieces' attention halves
    (QKV and projection GEMMs, the attention core, half the elementwise work) and MLP halves
    (fc1 and fc2, the other half). Exposed communication = the span minus the pass's work,
    plus ``(1 - overlap)`` of the communication the span hides (a collective beside a GEMM
    slows it, as Megatron's overlapped backward collectives in :func:`megatron_block`).
    The first piece's gather and the last piece's reduction leave out this rank's own rows,
    whose QKV GEMM and MLP run while the others' rows travel (backward: the MLP's adjoint
    first, the QKV GEMM's last): the flow shop's ``head`` and ``tail``, 1/P of that work.
    ``attention`` and ``elementwise`` are the block's (all T tokens); the returned GEMMs are
    the pieces' together, the communication what stays exposed beside all of it. The
    transfers of the other ranks' rows (the first piece's gather, every piece's reduction)
    are priced as the gather and reduce-scatter they replace (alone the all-to-all
    took 3.2-3.4 ms against their 2.7-2.9 ms at h 8192 / 16K over the slow link, call 169's
    trace; beside GEMMs the all-to-all was no slower than the gather, call 181)."""
    k, e = pieces, speed.e
    qkv, proj, fc1, fc2 = (megatron_gemm(lin, tokens / k, tp) for lin in block_linears(model))
    size = e * tokens * model.hidden_size / k
    gather, middle, reduce = link.all_gather(size), link.all_reduce(size), link.reduce_scatter(size)
    result = BlockTP(Phase(0, 0), Phase(0, 0))
    n = layers  # per layer of the block: the ends' gather and reduction 1/n, 2 - 1/n all-reduces
    for kind, seconds, times in (
        ("all_gather", gather, 1 / n),
        ("all_reduce", middle, 2 - 1 / n),
        ("reduce_scatter", reduce, 1 / n),
    ):
        result.count(kind, seconds, 2 * k * times)

    def backward(g: Gemm) -> float:
        return speed.gemm(g.dgrad()) + speed.gemm(g.wgrad())

    attention_gemms = Phase(speed.gemms([qkv, proj]), backward(qkv) + backward(proj))
    mlp_gemms = Phase(speed.gemms([fc1, fc2]), backward(fc1) + backward(fc2))
    gemm = Phase(
        k * (attention_gemms.fwd + mlp_gemms.fwd), k * (attention_gemms.bwd + mlp_gemms.bwd)
    )
    # per piece: (the half the pass starts with, the other), each with half the elementwise
    # work; the forward starts with attention, the backward with the MLP's adjoint
    forward = (
        attention_gemms.fwd + attention.fwd / k + elementwise.fwd / (2 * k),
        mlp_gemms.fwd + elementwise.fwd / (2 * k),
    )
    backward_pass = (
        mlp_gemms.bwd + elementwise.bwd / (2 * k),
        attention_gemms.bwd + attention.bwd / k + elementwise.bwd / (2 * k),
    )
    comm = k * ((gather + reduce) / n + middle * (2 - 1 / n))
    exposed = []
    # this rank's own rows: the first piece's QKV GEMM and the last piece's MLP forward, the
    # latter's adjoint first and the former's last backward
    ends = (
        (speed.gemm(qkv) / tp, forward[1] / tp),
        (backward_pass[0] / tp, backward(qkv) / tp),
    )
    for (first, second), (head, tail) in zip((forward, backward_pass), ends, strict=True):
        span = _flow_shop(first, second, gather, middle, reduce, k, n, head, tail) / n
        shown = max(0.0, span - k * (first + second))
        exposed.append(shown + (1.0 - overlap) * max(0.0, comm - shown))
    result.gemm, result.comm = gemm, Phase(*exposed)
    return result


def cannon_relayout_elements(lin: Linear, tokens: float, q: int) -> tuple[float, float]:
    """Elements one rank receives in the (in, out) re-layouts of a Cannon linear's forward
    (``layers/cannon.py``; M = T tokens, P = q^2), the most any rank of the group receives:

        column in   SP [M/P, K] -> X(r, c)    (q-1)/q M K / P   (its own SP chunk is local)
        column out  Y(r, c) -> [M, N/P]       M N / P           (off-diagonal ranks)
        row in      [M, K/P] -> X(r, c)       M K / P           (ranks with c != 0)
        row out     Y(r, c) -> SP [M/P, N]    (q-1)/q M N / P

    The backward runs the transposed exchanges, which receive the same volumes."""
    p = q * q
    near = (q - 1) / q
    if lin.column:
        return near * tokens * lin.k / p, tokens * lin.n / p
    return tokens * lin.k / p, near * tokens * lin.n / p


def cannon_block(
    model: ModelSpec,
    tokens: float,
    tp: int,
    hop_link: Link,
    speed: Speed,
    overlap: float,
) -> BlockTP:
    """Cannon (P = q^2): per linear two exposed re-layouts each way and q-step passes of
    (T/q x k/q) @ (k/q x n/q) with the operands shifting (see the module docstring)."""
    q, e = math.isqrt(tp), speed.e
    m = tokens / q
    result = BlockTP(Phase(0, 0), Phase(0, 0))
    fwd_g = bwd_g = fwd_c = bwd_c = 0.0

    def hop(*elements: float) -> float:
        return max(hop_link.p2p(e * size) for size in elements)

    for lin in block_linears(model):
        n, k = lin.n / q, lin.k / q
        relayout = sum(hop_link.p2p(e * v) for v in cannon_relayout_elements(lin, tokens, q))
        result.count("all_to_all", relayout, 2)
        step = Gemm(m, n, k)
        shift = hop(m * k, k * n)  # X moves left, W moves up
        result.count("p2p", shift, q - 1)
        g, c = pipelined_pass(q, speed.gemm(step), shift, overlap)
        fwd_g, fwd_c = fwd_g + g, fwd_c + c + relayout
        dgrad, wgrad = speed.gemm(step.dgrad()), speed.gemm(step.wgrad())
        moving = hop(k * n, m * k, m * n)  # W up; X diagonally, dX accumulator left; dY up
        last = hop(m * k)  # the accumulator's final hop lands dX[MB_r, KB_(r+c)] on (r, c)
        result.count("p2p", moving, q - 1)
        result.count("p2p", last)
        bwd_g += q * (dgrad + wgrad)
        bwd_c += (
            relayout + (q - 1) * _beside(moving, wgrad, overlap) + _beside(last, wgrad, overlap)
        )
    result.gemm = Phase(fwd_g, bwd_g)
    result.comm = Phase(fwd_c, bwd_c)
    return result


def sharded_boundary(tp: int, mode: str, sp: bool) -> bool:
    """Whether activations between blocks are split over TP (SP, ring, Cannon)."""
    return tp > 1 and (sp or mode != "megatron")


def head_seqs(micro_batch: int, model: ModelSpec, tp: int) -> float:
    """(sequence, head) pairs of attention on one GPU: b a / t for every mode (ring and
    Cannon keep Megatron's attention, heads and query groups split over all t ranks)."""
    return micro_batch * model.num_attention_heads / tp
