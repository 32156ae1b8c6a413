"""The LM head and its cross-entropy in one pass over token chunks, vocabulary-parallel over an
explicit TP group: the logits of the whole micro-batch never exist at once.

Rank r of a TP group of size t holds the head's rows ``W[r V/t : (r+1) V/t]`` ([V/t, h]).
For a chunk of C tokens with hidden states ``x`` ([C, h]) it forms ``z = x W_r^T`` ([C, V/t])
and per token

    loss = log(sum_v exp(z_v - m)) - (z_y - m),   m = max_v z_v

(the max one all-reduce over the group, the target logit and the sum of exponentials one more),
and at once the chunk's gradients for a loss of ``sum(token losses) / N``:

    dz = (softmax(z) - onehot(y)) / N,   dx = dz W_r,   dW_r += dz^T x

Tokens whose label is ``ignore_index`` get loss 0 and ``dz = 0``. The forward returns that
scalar loss and keeps ``dx`` and ``dW_r``; the backward scales them by the incoming gradient
(a scalar, so the scaling commutes with the sums). The input gradient of a replicated hidden
state is all-reduced over TP, that of a sequence-parallel one ([s/t] tokens per rank,
all-gathered here first) reduce-scattered: Megatron's ColumnParallelLinear does the same in its
backward.

Why: the head's logits are the largest activation of a long-context model. With V = 128K and
64K tokens, the e-byte logits, the loss's fp32 working copy and the e-byte logit gradient of
megatron-core's output layer plus cross entropy take ``(2e + 4) V s / t`` bytes, 50 GiB at
t = 1 in bf16, and decide which layouts fit at all. Here they take ``(2e + 4) V C / t`` for a
chunk of :func:`chunk_tokens` tokens, plus ``dW_r`` in fp32 and one chunk's e-byte
contribution to it (``(4 + e) V h / t``), ``dx`` and, under sequence parallelism, the
gathered hidden state (``e s h`` each): what the planner counts (``planner.cost.head_bytes``). The GEMMs are the output layer's own (forward, input and
weight gradient, 6 s h V / t FLOPs), only run in the forward.

The backward reuses the saved gradients in place, so the graph cannot be run backward twice
(``retain_graph``): a second backward raises instead of returning a wrong gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ds_stpar.errors import ConfigError

HEAD_CHUNK_BYTES = 2 << 30
"""Bytes of one chunk's logit tensors (e-byte logits, their fp32 working copy and the e-byte
gradient). Each chunk also adds its e-byte weight gradient into the fp32 one, ``(2e + 8) V h
/ t`` bytes of memory traffic against the chunk's ``6 C h V / t`` GEMM FLOPs: about 480 / C of
the head's GEMM time on an H100. 2 GiB gives C = 2K tokens at V/t = 128K (about a fifth of the
head's GEMM time, under 1% of a long-context step) and keeps the memory a few percent of a
GPU; at V/t = 32K, C = 8K."""


def chunk_tokens(vocab_local: int, element_bytes: int, budget: int = HEAD_CHUNK_BYTES) -> int:
    """Tokens per chunk: ``budget / ((2e + 4) V/t)``, at least 1."""
    return max(1, budget // ((2 * element_bytes + 4) * vocab_local))


def _gather_sequence(x: Tensor, group, world: int) -> Tensor:
    """[b, s/t, h] -> [b, s, h]: the sequence-parallel shards of the TP group in rank order."""
    seq_first = x.transpose(0, 1).contiguous()
    out = seq_first.new_empty((world * seq_first.shape[0], *seq_first.shape[1:]))
    dist.all_gather_into_tensor(out, seq_first, group=group)
    return out.transpose(0, 1)


def _reduce_scatter_sequence(grad: Tensor, group, world: int) -> Tensor:
    """[b, s, h] -> [b, s/t, h]: sum over the TP group, this rank's sequence shard kept."""
    seq_first = grad.transpose(0, 1).contiguous()
    out = seq_first.new_empty((seq_first.shape[0] // world, *seq_first.shape[1:]))
    dist.reduce_scatter_tensor(out, seq_first, group=group)
    return out.transpose(0, 1)


class _LinearCrossEntropy(torch.autograd.Function):
    """forward: the scalar loss and both gradients, chunk by chunk; backward: their scaling."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        num_targets: float,
        group,
        sequence_parallel: bool,
        ignore_index: int,
        chunk: int,
    ) -> Tensor:
        world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        if sequence_parallel and world > 1:
            full = _gather_sequence(hidden, group, world)
        else:
            full = hidden
        if full.shape[:-1] != labels.shape:
            raise ValueError(
                f"hidden states {tuple(full.shape)} (gathered over TP) do not match labels "
                f"{tuple(labels.shape)}"
            )
        x = full.reshape(-1, full.shape[-1])
        y = labels.reshape(-1)
        vocab_local = weight.shape[0]
        start = rank * vocab_local
        grad_x = torch.empty_like(x)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        for lo in range(0, x.shape[0], chunk):
            xc, yc = x[lo : lo + chunk], y[lo : lo + chunk]
            work = (xc @ weight.t()).float()  # the chunk's logits, worked on in place
            logits_max = work.max(dim=-1).values
            if world > 1:
                dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
            work.sub_(logits_max.unsqueeze(-1))
            valid = yc != ignore_index
            local_target = yc - start
            in_range = valid & (local_target >= 0) & (local_target < vocab_local)
            index = torch.where(in_range, local_target, torch.zeros_like(local_target))
            target_logit = work.gather(-1, index.unsqueeze(-1)).squeeze(-1) * in_range
            work.exp_()
            sums = torch.stack((target_logit, work.sum(dim=-1)))
            if world > 1:
                dist.all_reduce(sums, group=group)
            target_logit, sum_exp = sums
            loss += ((sum_exp.log() - target_logit) * valid).sum()
            work.div_(sum_exp.unsqueeze(-1))  # softmax
            work.scatter_add_(-1, index.unsqueeze(-1), -in_range.unsqueeze(-1).to(work.dtype))
            work.mul_((valid.to(work.dtype) / num_targets).unsqueeze(-1))
            dz = work.to(x.dtype)
            del work
            torch.mm(dz, weight, out=grad_x[lo : lo + chunk])
            grad_w.add_(dz.t() @ xc)
        grad_full = grad_x.view(full.shape)
        if world > 1:
            if sequence_parallel:
                grad_hidden = _reduce_scatter_sequence(grad_full, group, world)
            else:
                dist.all_reduce(grad_full, group=group)
                grad_hidden = grad_full
        else:
            grad_hidden = grad_full
        ctx.save_for_backward(grad_hidden, grad_w)
        ctx.weight_dtype = weight.dtype
        ctx.spent = False
        return loss / num_targets

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        if ctx.spent:
            raise RuntimeError(
                "vocab_parallel_linear_cross_entropy: backward ran twice through the same graph "
                "(retain_graph=True); its saved gradients were scaled in place by the first"
            )
        ctx.spent = True
        grad_hidden, grad_w = ctx.saved_tensors
        grad_hidden.mul_(grad_loss.to(grad_hidden.dtype))
        grad_w.mul_(grad_loss)
        return grad_hidden, grad_w.to(ctx.weight_dtype), None, None, None, None, None, None


def vocab_parallel_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    num_targets: float,
    group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    ignore_index: int = -100,
    chunk_bytes: int = HEAD_CHUNK_BYTES,
) -> Tensor:
    """``sum over target tokens of CE(hidden W^T, labels) / num_targets`` (fp32 scalar).

    ``hidden``: [b, s, h], or [b, s/t, h] with ``sequence_parallel`` (this rank's contiguous
    sequence shard, as Megatron's sequence parallelism splits it); ``weight``: this rank's
    vocabulary rows [V/t, h] of the TP ``group``; ``labels``: [b, s], ``ignore_index`` for
    no target. Every rank of the group returns the same loss.
    """
    if num_targets <= 0:
        raise ConfigError(f"num_targets must be positive, got {num_targets}")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden states {tuple(hidden.shape)} vs weight {tuple(weight.shape)}")
    chunk = chunk_tokens(weight.shape[0], weight.element_size(), chunk_bytes)
    return _LinearCrossEntropy.apply(
        hidden, weight, labels, float(num_targets), group, sequence_parallel, ignore_index, chunk
    )
