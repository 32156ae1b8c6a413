"""How long one GPU computes: GEMMs by shape, attention, memory-bound kernels.

Everything here is per GPU and per micro-batch of ``T = b s`` tokens, with the TP degree t
already applied. :class:`Speed` turns work into seconds:

- a GEMM ``(m x k) @ (k x n)`` takes ``max(2 m n k / (peak eff(m, n, k)), bytes / (HBM x
  memory_efficiency))``: the calibration curve (or the profile's measured TFLOP/s for that
  shape) under a roofline, so small and skinny GEMMs run slower;
- flash attention takes its FLOPs over ``peak x flash_fraction``;
- memory-bound kernels (norms, activations, dropout-add, softmax of unfused attention,
  the optimizer) take their bytes over ``HBM x memory_efficiency``.

Causal convention: model FLOPs count the full s^2 of attention (the 72-formula of
planner.md). Time: flash attention skips masked blocks, so it runs half the s^2 FLOPs;
unfused attention (Megatron's baddbmm + fused softmax path, as in the published 2021/2022
runs) computes the whole s x s score matrix and masks it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_stpar.config import GPUSpec, ModelSpec
from ds_stpar.planner.profile import Calibration, Profile

FLASH_BACKWARD_RATIO = 2.5  # flash backward runs 5 s^2 GEMMs per head to the forward's 2
CAUSAL_FRACTION = 0.5  # share of the s x s blocks a causal flash kernel computes
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

    def flash(self, flops: float) -> float:
        return flops / (self.peak * self.cal.flash_fraction)


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
        fwd = speed.flash(4.0 * s * s * d * head_seqs * CAUSAL_FRACTION)
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
    model: ModelSpec, tokens: float, tp: int, sharded_boundary: bool, speed: Speed
) -> Phase:
    """Norms, residual (bias-dropout-)adds, the activation and RoPE of one block.

    Forward bytes per token (e per element, fused bias-add as Megatron does):
    residual stream (T h / r elements, r = t when sharded else 1): two norms (read + write:
    2e each), two residual adds (read branch + residual, write: 3e each) and with dropout
    their masks (1 each); inside the TP region (1/t): GeLU reads and writes f (2e f), SwiGLU
    reads 2f and writes f (3e f), RoPE reads and writes q + kv (2e (q + kv)).
    Backward moves ``ELEMENTWISE_BACKWARD_RATIO`` times the forward bytes.
    """
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
    Cross-entropy bytes per logit: cast e + 4, max 4, exp r+w 8, sum 4, grad 4 + e."""
    h, e = model.hidden_size, speed.e
    fwd, bwd = forward_backward(Gemm(tokens, model.vocab_size / tp, h))
    logits = tokens * model.vocab_size / tp
    norm = speed.memory(2 * e * tokens * h)
    return Phase(
        speed.gemms(fwd) + speed.memory((e + 16) * logits) + norm,
        speed.gemms(bwd) + speed.memory((e + 4) * logits) + 2 * norm,
    )


def embedding(model: ModelSpec, tokens: float, speed: Speed) -> Phase:
    """Lookup (write e h per token, plus read + add of learned positions) and its
    scatter-add gradient."""
    e, h = speed.e, model.hidden_size
    learned = model.position_embedding == "learned"
    fwd = speed.memory(tokens * h * e * (3 if learned else 1))
    return Phase(fwd, 2 * fwd)
