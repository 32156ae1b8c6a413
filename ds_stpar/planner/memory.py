"""Memory per GPU of one strategy: parameters per stage, model states per ZeRO stage,
activations per layer (derived from the tensors each layer saves), in-flight micro-batches.

All sizes are bytes on ONE GPU unless a name says otherwise. Notation as planner.md:
h hidden, a heads, g query groups, d_h head dim, q = a d_h, kv = g d_h, f FFN size, V vocab,
s sequence, b micro-batch, t TP degree, p PP degree, d DP degree, m micro-batches, v virtual
stages, e bytes per activation element (2 for bf16/fp16).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ds_stpar.config import ModelSpec, Strategy, TrainSpec, stage_layers

MASK_BYTES = 1  # a dropout mask element (torch.bool / uint8)
FP32 = 4
FLASH_HEAD_DIM_MULTIPLE = 8  # flash kernels take head dims that are multiples of 8 (else: pad)


def element_bytes(train: TrainSpec) -> int:
    return 4 if train.dtype == "fp32" else 2


# --------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------


def layer_params_split(model: ModelSpec) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of one block.

    Sharded over t: QKV weight and bias (column), projection weight (row), fc1 weight and
    bias (column), fc2 weight (row). Replicated: the two norms and the two row-parallel
    biases (Megatron adds them after the reduction). The sum is ``params_per_layer()``.
    """
    h, f = model.hidden_size, model.ffn_hidden_size
    qkv_out = model.q_size + 2 * model.kv_size
    fc1_out = 2 * f if model.gated else f
    sharded = h * qkv_out + model.q_size * h + h * fc1_out + f * h
    if model.add_bias_linear:
        sharded += qkv_out + fc1_out
    replicated = model.params_per_layer() - sharded
    return sharded, replicated


def layer_params_per_gpu(model: ModelSpec, tp: int) -> float:
    sharded, replicated = layer_params_split(model)
    return sharded / tp + replicated


def embedding_params_per_gpu(model: ModelSpec, tp: int) -> float:
    """First stage: vocab-parallel word embedding V h / t plus replicated learned positions."""
    return model.vocab_size * model.hidden_size / tp + (
        model.embedding_params() - model.vocab_size * model.hidden_size
    )


def head_params_per_gpu(model: ModelSpec, tp: int, pp: int) -> float:
    """Last stage: final norm plus the vocab-parallel LM head V h / t. A tied head shares the
    embedding when pp == 1; with pp > 1 the last stage holds its own copy (Megatron)."""
    head = model.vocab_size * model.hidden_size / tp
    if model.tied_embeddings and pp == 1:
        head = 0.0
    return model.final_norm_params() + head


def stage_params(model: ModelSpec, strategy: Strategy) -> list[float]:
    """Parameters held by one GPU of each pipeline stage (Psi of planner.md, per stage)."""
    tp, pp = strategy.layout.tp, strategy.layout.pp
    layers = stage_layers(model.num_layers, strategy)
    per_layer = layer_params_per_gpu(model, tp)
    params = [n * per_layer for n in layers]
    params[0] += embedding_params_per_gpu(model, tp)
    params[-1] += head_params_per_gpu(model, tp, pp)
    return params


# --------------------------------------------------------------------------------------
# Model states
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelStates:
    weights: float
    grads: float
    optimizer: float


def optimizer_state_bytes(train: TrainSpec) -> int:
    """fp32 master copy (mixed precision only) + Adam m, v (or one SGD momentum)."""
    master = 0 if train.dtype == "fp32" else FP32
    moments = FP32 if train.optimizer == "sgd" else 2 * FP32
    return master + moments


def model_state_bytes(
    psi: float, zero: int, dp: int, train: TrainSpec, grad_bytes: int
) -> ModelStates:
    """Weights, gradients and optimizer state of ``psi`` parameters under a ZeRO stage.

    With bf16 weights (2), bf16 grads (``grad_bytes`` = 2) and Adam (12) this is planner.md:
    ZeRO-0 16 Psi; ZeRO-1 4 Psi + 12 Psi/d; ZeRO-2 2 Psi + 14 Psi/d; ZeRO-3 16 Psi/d.
    Megatron's fp32 main grads (``grad_bytes`` = 4) give 18 Psi, and 6 + 12/d with its
    distributed optimizer (= ZeRO-1).
    """
    weight_bytes = element_bytes(train)
    grad = FP32 if train.dtype == "fp32" else grad_bytes
    return ModelStates(
        weights=weight_bytes * psi / (dp if zero >= 3 else 1),
        grads=grad * psi / (dp if zero >= 2 else 1),
        optimizer=optimizer_state_bytes(train) * psi / (dp if zero >= 1 else 1),
    )


# --------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerActivations:
    """Bytes per token of one layer, split by how TP divides them.

    ``residual``: tensors of hidden size between the TP regions (replicated under Megatron
    TP, divided by t with sequence parallelism, ring or Cannon). ``parallel``: tensors inside
    the TP regions (always divided by t). ``scores``: the s-proportional softmax tensors of
    unfused attention (divided by t; gone with flash attention or selective recompute).
    ``layer_input``: e h, all that full recompute keeps. ``whole``: tensors every TP rank
    keeps for all tokens (the fused ring MLP's gathered fc1 input; never divided).
    """

    residual: float
    parallel: float
    scores: float
    layer_input: float
    whole: float = 0.0


NORM_STAT_BYTES = 8  # fp32 mean and rstd per token that a torch LayerNorm saves


def norm_stat_bytes(model: ModelSpec) -> int:
    """fp32 statistics per token a torch norm saves: mean and rstd (LayerNorm), rstd (RMSNorm)."""
    return NORM_STAT_BYTES if model.normalization == "layernorm" else NORM_STAT_BYTES // 2


def layer_activations(
    model: ModelSpec, seq: int, e: int, flash: bool, local: bool = False
) -> LayerActivations:
    """Saved tensors of one block per token, with no TP and no recompute.

    Derivation (Korthikanti et al. 2022, Section 4.1, generalised to GQA and SwiGLU):

    residual (per token): LN1 input e h, LN1 output = QKV input e h, LN2 input e h, LN2
    output = fc1 input e h, and with hidden dropout two masks h (after the projection and
    after fc2) -> 4 e h (+ 2 h).

    attention (parallel): unfused (Megatron's baddbmm + softmax path; K and V expanded to
    the a heads) saves Q and K for Q K^T (2 e q), V for softmax.V (e q) and the projection
    input (e q) -> 4 e q; flash attention saves Q, K, V unexpanded (e (q + 2 kv)), its
    output = the projection input (e q) and the fp32 log-sum-exp (4 a).
    scores (unfused only): softmax output e a s, and with attention dropout its mask a s and
    output e a s -> (2e + 1) a s = 5 a s for bf16.

    MLP (parallel): GeLU saves fc1's output (GeLU input) e f and fc2's input e f -> 2 e f;
    SwiGLU saves fc1's output [gate, up] 2 e f and fc2's input e f -> 3 e f.

    A 4h GeLU MHA block with dropout in bf16: residual 8h + 2h = 10h, parallel 8h + 16h =
    24h, scores 5as: sbh (34 + 5as/h), and with TP sbh (10 + 24/t + 5as/(ht)) -- planner.md.
    Llama-3 8B (SwiGLU f = 3.5h, GQA kv = h/4, flash, no dropout) also comes to ~34 h.

    ``local`` (megatron-core's local modules): the two torch norms also save their fp32
    statistics (:func:`norm_stat_bytes` each, residual), and the unfused GLU keeps fc1's output 2e f, the
    SiLU output e f, the zero-offset sum e f and fc2's input e f: 5 e f instead of 3 e f
    (:func:`fused_glu_activations` for the fused SwiGLU the GPU loop runs).
    With flash attention, a head dim d that is not a multiple of 8 is zero-padded to d'
    (by ``layers.megatron_modules.varlen_causal`` on packed rows, inside PyTorch's SDPA on full
    rows): the kernel saves the padded Q, K, V and its padded output, and the projection
    input is a separate copy of the unpadded output --
    e (q + 2 kv) d'/d + e q d'/d + e q instead of e (q + 2 kv) + e q.
    """
    h, q, kv, f, a = (
        model.hidden_size,
        model.q_size,
        model.kv_size,
        model.ffn_hidden_size,
        model.num_attention_heads,
    )
    dropout = model.dropout > 0
    residual = 4 * e * h + (2 * MASK_BYTES * h if dropout else 0)
    if flash:
        attention = e * (q + 2 * kv) + e * q + FP32 * a
        pad = -model.kv_channels % FLASH_HEAD_DIM_MULTIPLE if local else 0
        if pad:
            padded = (model.kv_channels + pad) / model.kv_channels
            attention += e * (q + 2 * kv) * (padded - 1) + e * q * padded
        scores = 0.0
    else:
        attention = 4 * e * q
        scores = (2 * e + MASK_BYTES if dropout else e) * a * seq
    mlp = (3 if model.gated else 2) * e * f
    if local:
        residual += 2 * norm_stat_bytes(model)
        mlp += 2 * e * f if model.gated else 0
    return LayerActivations(residual, attention + mlp, scores, e * h)


def layer_activation_bytes(
    acts: LayerActivations, tokens: float, tp: int, sharded_boundary: bool, recompute: str
) -> float:
    """Bytes one GPU keeps for one layer of one micro-batch of ``tokens`` tokens.

    none: tokens (residual / r + parallel / t + scores / t) with r = t when the boundary is
    sharded (SP, ring, Cannon) else 1 -- planner.md rows "TP" and "TP + SP".
    selective: the same without the score tensors (rows "TP + selective", "TP + SP + selective").
    full: only the layer input, tokens e h / r (row "full recompute").
    """
    r = tp if sharded_boundary else 1
    if recompute == "full":
        return tokens * acts.layer_input / r
    scores = 0.0 if recompute == "selective" else acts.scores / tp
    return tokens * (acts.residual / r + acts.parallel / tp + scores + acts.whole)


def fused_glu_activations(acts: LayerActivations, model: ModelSpec, e: int) -> LayerActivations:
    """The local stack's ``acts`` with megatron-core's fused SwiGLU (``bias_activation_fusion``,
    :func:`~ds_stpar.integrations.megatron.fused_swiglu`): it saves fc1's output 2e f and fc2
    its input e f, not the unfused GLU's SiLU output and zero-offset sum: 2e f less."""
    if not model.gated:
        return acts
    return dataclasses.replace(acts, parallel=acts.parallel - 2 * e * model.ffn_hidden_size)


def ring_mlp_activations(
    acts: LayerActivations, model: ModelSpec, e: int, local: bool
) -> LayerActivations:
    """``acts`` with the MLP run by the ring's two-pass node (``layers/ring_mlp.py``,
    ``ring_two_pass_mlp``): it keeps fc1's output (e f, GLU 2 e f), not act(fc1) nor fc2's
    input, which its backward recomputes: the MLP's 2 e f (SwiGLU 3 e f; unfused GLU of the
    local stack 5 e f) become e f (2 e f)."""
    f = model.ffn_hidden_size
    kept = (3 if model.gated else 2) * e * f + (2 * e * f if local and model.gated else 0)
    recomputed = (2 if model.gated else 1) * e * f
    return dataclasses.replace(acts, parallel=acts.parallel - kept + recomputed)


def fused_ring_mlp_activations(
    acts: LayerActivations, model: ModelSpec, e: int, local: bool
) -> LayerActivations:
    """``acts`` with the MLP run as one fused ring pass (``layers/ring_mlp.py``): the two-pass
    node's MLP (:func:`ring_mlp_activations`), and every rank's chunk of the fc1 input kept
    (e h per token, whole instead of 1/t)."""
    h = model.hidden_size
    acts = ring_mlp_activations(acts, model, e, local)
    return dataclasses.replace(acts, residual=acts.residual - e * h, whole=acts.whole + e * h)


def ring_norm_recipe_activations(
    acts: LayerActivations, model: ModelSpec, e: int, tp: int, fused_mlp: bool
) -> LayerActivations:
    """``acts`` of a ring layer (its MLP's own transform applied) whose column passes are handed
    the spec's marked norm outputs (``layers/norm_recipe.py``): they keep the norms' inputs,
    which the norms keep anyway, and make the outputs again in their backward. QKV's input
    (LN1's output, e h) leaves ``residual``; so does fc1's (LN2's output) under the two passes
    or ring linears, and under the fused pass, which keeps every rank's chunk of it
    (``whole``), this rank's own chunk, e h / t."""
    h = model.hidden_size
    if fused_mlp:
        return dataclasses.replace(
            acts, residual=acts.residual - e * h, whole=acts.whole - e * h / tp
        )
    return dataclasses.replace(acts, residual=acts.residual - 2 * e * h)


def interleaved_activations(
    acts: LayerActivations, model: ModelSpec, e: int, local: bool
) -> LayerActivations:
    """``acts`` (with the MLP's own transform applied) under the interleaved layer
    (``layers/interleave.py``): it keeps the gathered layer input and the all-reduced middle,
    the two norms' inputs, for all tokens on every rank (``whole``, 2 e h); the norms, which
    run on all tokens, keep their fp32 statistics there too (local stack), and their outputs,
    the column GEMMs' inputs, are made again in the backward (``layers/norm_recipe.py``): the
    residual stream's 4 e h and statistics leave ``residual``."""
    stats = 2 * norm_stat_bytes(model) if local else 0
    h = model.hidden_size
    return dataclasses.replace(
        acts, residual=acts.residual - 4 * e * h - stats, whole=acts.whole + 2 * e * h + stats
    )


def cannon_activations(acts: LayerActivations, model: ModelSpec, e: int) -> LayerActivations:
    """``acts`` under Cannon (``layers/cannon.py``): each linear saves its input as the torus
    block it re-laid out, the same bytes as the Megatron tensor it replaces, but the
    projection's block is a copy of the attention output, which the attention core keeps too
    (under Megatron the projection saves a view of it): e q more per token, over t."""
    return dataclasses.replace(acts, parallel=acts.parallel + e * model.q_size)


def inflight_layers(stage: int, layers: int, pp: int, m: int, v: int) -> float:
    """Layers' worth of micro-batch activations stage ``stage`` holds at its peak.

    1F1B (v = 1): stage i runs p - i - 1 warm-up forwards and one more before its first
    backward, so it holds min(m, p - i) micro-batches of its ``layers`` layers (stage 0: p, planner.md).
    Interleaved (v > 1, Megatron's schedule): 2(p - i - 1) + (v - 1) p + 1 model chunks of
    layers / v layers each, at most m v; for stage 0 that is p (1 + (p - 1)/(p v)) micro-batches
    of layers, the factor of planner.md.
    """
    if v <= 1:
        return min(m, pp - stage) * layers
    chunks = min(m * v, 2 * (pp - stage - 1) + (v - 1) * pp + 1)
    return chunks * layers / v
