"""How long one GPU computes: GEMMs by shape, attention, memory-bound kernels.

Everything here is per GPU and per micro-batch of ``T = b s`` tokens, with the TP degree t
already applied. :class:`Speed` turns work into seconds:

- a GEMM ``(m x k) @ (k x n)`` takes ``max(2 m n k / (peak eff(m, n, k)), bytes / (HBM x
  memory_efficiency))``: the calibration curve (or the profile's measured TFLOP/s for that
  shape) under a roofline, so small and skinny GEMMs run slower;
- flash attention takes its FLOPs over ``peak x flash_fraction`` (another fraction for head
  dims other than 64 and 128, :class:`~ds_stpar.planner.profile.Calibration`);
- memory-bound kernels (norms, activations, dropout-add, softmax of unfused attention,
  the optimizer) take their bytes over ``HBM x memory_efficiency``; on megatron-core's
  local stack (``Calibration.stack``) its out-of-place bias / residual adds and its fp32
  main-gradient accumulation take theirs over ``HBM x elementwise_efficiency``, the
  efficiency measured for those kernels (:meth:`Speed.elementwise`).

The elementwise passes of the two stacks are counted apart: the fused stack of the published
runs (:func:`block_elementwise`, :func:`lm_head`, :func:`embedding`) and megatron-core's
local modules (the ``local_*`` functions), whose passes are read off their code
(``transformer_layer.py``, ``mlp.py``, ``fused_bias_dropout.py`` unfused path,
``tensor_parallel/cross_entropy.py``, torch's LayerNorm / GeLU / embedding kernels).

Causal convention: model FLOPs count the full s^2 of attention (the 72-formula of
planner.md). Time: flash attention skips masked blocks, so it runs half the s^2 FLOPs;
unfused attention (Megatron's baddbmm + fused softmax path, as in the published 2021/2022
runs) computes the whole s x s score matrix and masks it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ds_stpar.config import GPUSpec, ModelSpec
from ds_stpar.layers.cross_entropy import chunk_tokens
from ds_stpar.planner.memory import norm_stat_bytes
from ds_stpar.planner.profile import Calibration, Profile

FLASH_BACKWARD_RATIO = 2.5  # flash backward runs 5 s^2 GEMMs per head to the forward's 2
CAUSAL_FRACTION = 0.5  # share of the s x s blocks a causal flash kernel computes
CUDNN_HEAD_DIMS = (64, 128)  # PyTorch's SDPA takes cuDNN's kernel at these head dims
MASK_BYTES = 1


@dataclass(frozen=True)
class Gemm:
    """``count`` independent ``(m x k) @ (k x n)`` products."""

    m: float
    n: float
    k: float
    count: float = 1.0

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count

    def dgrad(self) -> Gemm:
        """dX = dY W^T: (m x n) @ (n x k)."""
        return Gemm(self.m, self.k, self.n, self.count)

    def wgrad(self) -> Gemm:
        """dW = X^T dY: (k x m) @ (m x n)."""
        return Gemm(self.k, self.n, self.m, self.count)


class Speed:
    """Seconds for work on one GPU (datasheet + calibration + optional profile)."""

    def __init__(self, gpu: GPUSpec, cal: Calibration, profile: Profile | None, e: int) -> None:
        self.cal = cal
        self.profile = profile
        self.e = e
        # fp32 runs on TF32 tensor cores: half the 16-bit dense peak on A100/H100/H200.
        self.peak = gpu.peak_tflops * 1e12 / (2 if e == 4 else 1)
        self.hbm = gpu.hbm_gbs * 1e9 * cal.memory_efficiency
        unfused = cal.elementwise_efficiency if cal.local else cal.memory_efficiency
        self.hbm_elementwise = gpu.hbm_gbs * 1e9 * unfused
        self._cache: dict[tuple[float, float, float], float] = {}

    def gemm(self, g: Gemm) -> float:
        key = (g.m, g.n, g.k)
        one = self._cache.get(key)
        if one is None:
            one = self._gemm_once(g.m, g.n, g.k)
            self._cache[key] = one
        return one * g.count

    def _gemm_once(self, m: float, n: float, k: float) -> float:
        flops = 2.0 * m * n * k
        measured = self.profile.gemm_tflops(m, n, k) if self.profile is not None else None
        if measured:
            compute = flops / (measured * 1e12)
        else:
            compute = flops / (self.peak * self.cal.gemm_efficiency(m, n, k))
        traffic = self.e * (m * k + k * n + m * n) / self.hbm
        return max(compute, traffic)

    def gemms(self, gemms: list[Gemm]) -> float:
        return sum(self.gemm(g) for g in gemms)

    def memory(self, nbytes: float) -> float:
        return nbytes / self.hbm

    def elementwise(self, nbytes: float) -> float:
        """Seconds of standalone add kernels moving ``nbytes``: on the local stack the
        broadcast bias / residual adds and the mixed-dtype main-gradient accumulation (at
        ``elementwise_efficiency``), elsewhere any kernel (``memory_efficiency``)."""
        return nbytes / self.hbm_elementwise

    def flash(self, flops: float, head_dim: int = 128) -> float:
        """Seconds of flash-attention FLOPs at ``head_dim`` (:class:`Calibration`)."""
        fraction = self.cal.flash_fraction
        if head_dim not in CUDNN_HEAD_DIMS and self.cal.flash_fraction_other_dims:
            fraction = self.cal.flash_fraction_other_dims
        return flops / (self.peak * fraction)


# --------------------------------------------------------------------------------------
# The GEMMs of one block
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Linear:
    """A linear of the block, by its full (unsharded) shape: tokens x ``k`` -> ``n``.
    ``column``: split along n over TP (QKV, fc1); otherwise along k (projection, fc2)."""

    name: str
    n: int
    k: int
    column: bool


def block_linears(model: ModelSpec) -> tuple[Linear, ...]:
    h, f = model.hidden_size, model.ffn_hidden_size
    return (
        Linear("qkv", model.q_size + 2 * model.kv_size, h, True),
        Linear("proj", h, model.q_size, False),
        Linear("fc1", 2 * f if model.gated else f, h, True),
        Linear("fc2", h, f, False),
    )


def megatron_gemm(lin: Linear, tokens: float, tp: int) -> Gemm:
    """The per-GPU forward GEMM of a Megatron TP linear: all tokens, 1/t of the weight."""
    if lin.column:
        return Gemm(tokens, lin.n / tp, lin.k)
    return Gemm(tokens, lin.n, lin.k / tp)


def forward_backward(g: Gemm) -> tuple[list[Gemm], list[Gemm]]:
    return [g], [g.dgrad(), g.wgrad()]


# --------------------------------------------------------------------------------------
# Attention core
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """Seconds of a piece of work in forward and backward."""

    fwd: float
    bwd: float

    def __add__(self, other: Phase) -> Phase:
        return Phase(self.fwd + other.fwd, self.bwd + other.bwd)


def attention_core(model: ModelSpec, seq: int, head_seqs: float, speed: Speed) -> Phase:
    """Q K^T, softmax, dropout, softmax.V for ``head_seqs`` (sequence, head) pairs on this
    GPU (b a / t). Flash: FLOPs 4 s^2 d_h per pair times the causal fraction, backward 2.5x.
    Unfused: the four batched GEMMs of the score matrix plus the softmax/dropout bytes per
    score element, forward 2e (softmax r+w) + 2e + 1 (dropout r+w+mask), backward 3e
    (softmax grad) + 2e + 1 (dropout grad)."""
    s, d = seq, model.kv_channels
    if speed.cal.flash_attention:
        fwd = speed.flash(4.0 * s * s * d * head_seqs * CAUSAL_FRACTION, d)
        return Phase(fwd, FLASH_BACKWARD_RATIO * fwd)
    scores, context = Gemm(s, s, d, head_seqs), Gemm(s, d, s, head_seqs)
    fwd_gemms = [scores, context]
    bwd_gemms = [scores, context, context, context]  # dP = dO V^T; dV, dQ, dK: s x d outputs
    e = speed.e
    dropout = model.dropout > 0
    fwd_bytes = 2 * e + (2 * e + MASK_BYTES if dropout else 0)
    bwd_bytes = 3 * e + (2 * e + MASK_BYTES if dropout else 0)
    elements = s * s * head_seqs
    return Phase(
        speed.gemms(fwd_gemms) + speed.memory(fwd_bytes * elements),
        speed.gemms(bwd_gemms) + speed.memory(bwd_bytes * elements),
    )


# --------------------------------------------------------------------------------------
# Memory-bound kernels of a block
# --------------------------------------------------------------------------------------

ELEMENTWISE_BACKWARD_RATIO = 2.0  # backward reads grad + saved input, writes grad, adds residual


def block_elementwise(
    model: ModelSpec,
    tokens: float,
    tp: int,
    sharded_boundary: bool,
    speed: Speed,
    fused_glu: bool = False,
) -> Phase:
    """Norms, residual (bias-dropout-)adds, the activation and RoPE of one block.

    Forward bytes per token (e per element, fused bias-add as Megatron does):
    residual stream (T h / r elements, r = t when sharded else 1): two norms (read + write:
    2e each), two residual adds (read branch + residual, write: 3e each) and with dropout
    their masks (1 each); inside the TP region (1/t): GeLU reads and writes f (2e f), SwiGLU
    reads 2f and writes f (3e f), RoPE reads and writes q + kv (2e (q + kv)).
    Backward moves ``ELEMENTWISE_BACKWARD_RATIO`` times the forward bytes.
    On the local stack: :func:`local_block_elementwise` (``fused_glu``: its SwiGLU fused).
    """
    if speed.cal.local:
        return local_block_elementwise(model, tokens, tp, sharded_boundary, speed, fused_glu)
    e, h = speed.e, model.hidden_size
    r = tp if sharded_boundary else 1
    residual = 2 * 2 * e + 2 * 3 * e + (2 * MASK_BYTES if model.dropout > 0 else 0)
    act = (3 if model.gated else 2) * e * model.ffn_hidden_size
    rope = 2 * e * (model.q_size + model.kv_size) if model.position_embedding == "rope" else 0
    fwd_bytes = tokens * (residual * h / r + (act + rope) / tp)
    fwd = speed.memory(fwd_bytes)
    return Phase(fwd, ELEMENTWISE_BACKWARD_RATIO * fwd)


def lm_head(model: ModelSpec, tokens: float, tp: int, speed: Speed) -> Phase:
    """Final norm, the vocab-parallel LM head GEMM and the fp32 vocab-parallel cross entropy.
    Cross-entropy bytes per logit: cast e + 4, max 4, exp r+w 8, sum 4, grad 4 + e.
    On the local stack: :func:`local_lm_head`."""
    if speed.cal.local:
        return local_lm_head(model, tokens, tp, speed)
    h, e = model.hidden_size, speed.e
    fwd, bwd = forward_backward(Gemm(tokens, model.vocab_size / tp, h))
    logits = tokens * model.vocab_size / tp
    norm = speed.memory(2 * e * tokens * h)
    return Phase(
        speed.gemms(fwd) + speed.memory((e + 16) * logits) + norm,
        speed.gemms(bwd) + speed.memory((e + 4) * logits) + 2 * norm,
    )


def embedding(model: ModelSpec, tokens: float, speed: Speed, tp: int = 1) -> Phase:
    """Lookup (write e h per token, plus read + add of learned positions) and its
    scatter-add gradient. On the local stack: :func:`local_embedding`."""
    if speed.cal.local:
        return local_embedding(model, tokens, tp, speed)
    e, h = speed.e, model.hidden_size
    learned = model.position_embedding == "learned"
    fwd = speed.memory(tokens * h * e * (3 if learned else 1))
    return Phase(fwd, 2 * fwd)


# --------------------------------------------------------------------------------------
# megatron-core's local modules (no Transformer Engine, no Apex)
# --------------------------------------------------------------------------------------

NORM_BACKWARD_PASSES = 5  # dX: read dY, X, write dX; dgamma/dbeta: read dY, X again
MAIN_GRAD_BYTES = 10  # main_grad.add_(grad): read bf16 grad 2 + fp32 main grad 4, write 4
CE_BYTES = 4 + 4 + 8 + 8 + 4 + 8 + 8 + 4  # + 2e: .float(), max, sub_, exp_, sum, div_, mul_, cast
ROPE_ANGLE_BYTES = 2 * 2 * 4  # fp32 cos and sin, read by the query's and the key's kernel


def local_block_elementwise(
    model: ModelSpec,
    tokens: float,
    tp: int,
    sharded_boundary: bool,
    speed: Speed,
    fused_glu: bool = False,
) -> Phase:
    """The standalone elementwise kernels of one megatron-core local TransformerLayer.

    Bytes per token, e per element, r = t when the residual stream is split (SP, ring) else 1,
    q_kv = q + 2 kv (the fused QKV output), f1 = 2f for SwiGLU else f. Forward:

    - the out-of-place adds (:meth:`Speed.elementwise`, the kernel family the local stack's
      ``elementwise_efficiency`` was measured on): the QKV and fc1 bias adds (``output +
      bias`` in the linear and the MLP, 2e q_kv / t and 2e f1 / t) and the two unfused
      bias-dropout-adds (``x + bias`` 2e h and ``residual + out`` 3e h per r tokens);
    - at ``memory_efficiency``: two torch norms (read + write h / r, fp32 statistics); the
      activation (GeLU 2e f / t; megatron's local GLU splits fc1, adds its zero offset 2e f,
      runs SiLU 2e f and multiplies 3e f: 7e f / t; with ``fused_glu``, megatron-core's
      fused SwiGLU, one kernel reading 2f and writing f: 3e f / t); dropout > 0 (read + write + mask
      2e + 1 per element); RoPE as the training loop runs it on packed rows
      (:mod:`ds_stpar.layers.packed_rope`: one fused kernel each for the query and the key,
      reading and writing them, 2e (q + kv) / t, and reading the fp32 cos and sin of the
      token's angles twice, 16 d per token, d the head dim).

    Backward, at ``memory_efficiency``: norms 5e h / r each; bias gradients (a reduction
    reading the output gradient) e q_kv / t, e f1 / t and e h / r per row-linear bias; the
    residual stream's two gradient sums 3e h / r each; GeLU backward 3e f / t (GLU: products
    6e f, SiLU 3e f, split 4e f: 13e f; fused: one kernel reading the output gradient f and
    fc1's output 2f, writing 2f: 5e f); the QKV split backward (cat of dq, dk, dv) 2e q_kv / t;
    RoPE backward as its forward; dropout backward 2e + 1 per element. The fp32
    main-gradient accumulation of the weights is per parameter, :func:`main_grad_accumulation`.
    """
    e, h, f = speed.e, model.hidden_size, model.ffn_hidden_size
    r = tp if sharded_boundary else 1
    qkv = model.q_size + 2 * model.kv_size
    bias = model.add_bias_linear
    f1 = 2 * f if model.gated else f
    dropout = (2 * e + MASK_BYTES) if model.dropout > 0 else 0
    rope = 0.0
    if model.position_embedding == "rope":
        # the angles are whole on every rank: times t, as the sum is divided by t below
        rope = 2 * e * (model.q_size + model.kv_size) + ROPE_ANGLE_BYTES * model.kv_channels * tp
    act_fwd, act_bwd = (2 * e * f, 3 * e * f)
    if model.gated:
        act_fwd, act_bwd = (3 * e * f, 5 * e * f) if fused_glu else (7 * e * f, 13 * e * f)
    adds = 2 * ((2 * e if bias else 0) + 3 * e) * h / r
    adds += (2 * e * qkv + 2 * e * f1) / tp if bias else 0
    other_fwd = (2 * (2 * e * h + norm_stat_bytes(model)) + 2 * dropout * h) / r
    other_fwd += (act_fwd + rope) / tp
    bwd_residual = (2 * NORM_BACKWARD_PASSES * e + 2 * 3 * e + (2 * e if bias else 0)) * h
    bwd_residual += 2 * dropout * h
    bwd_parallel = (e * qkv + e * f1 if bias else 0) + act_bwd + 2 * e * qkv + rope
    fwd = speed.elementwise(tokens * adds) + speed.memory(tokens * other_fwd)
    bwd = speed.memory(tokens * (bwd_residual / r + bwd_parallel / tp))
    return Phase(fwd, bwd)


def main_grad_accumulation(params: float, speed: Speed) -> float:
    """Seconds per micro-batch to add ``params`` bf16 weight gradients into Megatron DDP's
    fp32 main gradients (``main_grad.add_(grad)`` after every backward; the local stack has no
    gradient-accumulation fusion). The fused stack accumulates inside the wgrad GEMM: 0."""
    if not speed.cal.local:
        return 0.0
    return speed.elementwise(MAIN_GRAD_BYTES * params)


def head_chunk(model: ModelSpec, tokens: float, tp: int, e: int) -> float:
    """Tokens per chunk of the local stack's LM head (:func:`chunk_tokens` at this GPU's
    vocabulary slice), at most the micro-batch's."""
    return min(tokens, chunk_tokens(math.ceil(model.vocab_size / tp), e))


def local_lm_head(model: ModelSpec, tokens: float, tp: int, speed: Speed) -> Phase:
    """Final norm, then the LM head and its vocab-parallel cross entropy chunk by chunk
    (:mod:`ds_stpar.layers.cross_entropy`): the three GEMMs and every pass over the logits run
    in the forward.

    Per logit (T V / t on this GPU): read the e-byte GEMM output and write fp32 (e + 4), max
    (4), ``-= max`` (8), ``exp_`` (8), sum (4), ``div_`` (8), ``mul_`` by 1/N (8), cast to e
    (4 + e): ``CE_BYTES`` + 2e. Per chunk the weight gradient's e-byte GEMM output is added
    into fp32 (2e + 8 per weight). The backward scales the saved input gradient (2e per hidden
    element) and weight gradient (8 per weight) and casts the latter (4 + e). All at
    ``memory_efficiency`` (large contiguous tensors).
    """
    h, e = model.hidden_size, speed.e
    vocab = model.vocab_size / tp
    fwd, bwd = forward_backward(Gemm(tokens, vocab, h))
    logits, weights = tokens * vocab, vocab * h
    chunks = math.ceil(tokens / head_chunk(model, tokens, tp, e))
    norm = 2 * e * h + norm_stat_bytes(model)
    forward = (CE_BYTES + 2 * e) * logits + chunks * (2 * e + 8) * weights + tokens * norm
    backward = (12 + e) * weights + tokens * (2 + NORM_BACKWARD_PASSES) * e * h
    return Phase(
        speed.gemms(fwd) + speed.gemms(bwd) + speed.memory(forward), speed.memory(backward)
    )


def local_embedding(model: ModelSpec, tokens: float, tp: int, speed: Speed) -> Phase:
    """megatron-core's LanguageModelEmbedding: forward the lookup (write e h), with TP the
    masked-row fill (read + write e h), with learned positions their lookup and the add
    (e h + 3e h), and the transpose to [s, b, h] (read + write e h); backward the sort-based
    embedding backward of each table (read the e h gradient, write fp32 partial sums 4 h and
    add them into the e-byte table gradient 4 h + e h) after zero-filling the table gradient
    (e V h / t, and e h per position row); at ``memory_efficiency``."""
    e, h = speed.e, model.hidden_size
    learned = model.position_embedding == "learned"
    tables = 2 if learned else 1
    fwd = tokens * h * (e + (2 * e if tp > 1 else 0) + (4 * e if learned else 0) + 2 * e)
    bwd = tables * tokens * h * (2 * e + 8) + e * h * model.vocab_size / tp
    if learned:
        bwd += e * h * model.max_position_embeddings
    return Phase(speed.memory(fwd), speed.memory(bwd))
