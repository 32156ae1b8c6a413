"""Cross-entropy over vocabulary-parallel logits, with an explicit TP group.

Megatron's ``vocab_parallel_cross_entropy`` reads the global TP group; hot switching needs
the group of the layout in use. Rank r of a TP group of size t holds logits
``z[..., r V/t : (r+1) V/t]``. Per token:

    loss = log(sum_v exp(z_v - m)) - (z_y - m),   m = max_v z_v

where the max, the sum of exponentials and the target logit are each one all-reduce over the
group. Gradient: ``softmax(z) - onehot(y)`` on each rank's slice. Tokens whose label is
``ignore_index`` get loss 0 and no gradient. Returns per-token losses (no reduction): the
caller divides the sum by the mini-batch's target-token count (see seqbucket.loss).

Memory, per logit: the caller's logits (e bytes) and one fp32 copy that the forward turns into
the softmax in place and the backward into the gradient in place -- e + 4 bytes, as
megatron-core's own vocab-parallel cross entropy and as the planner counts it
(``planner.cost.head_bytes_per_logit``). Out-of-place steps would hold four fp32 copies at once:
at 4 x 32K tokens and a 32K vocabulary that is 62 GiB instead of 23. Because the backward
reuses the saved softmax, the graph cannot be run backward twice (``retain_graph``): a second
backward raises instead of returning a wrong gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """forward: per-token CE from vocab-sharded logits; backward: local softmax - onehot."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, group, ignore_index: int) -> Tensor:
        # one fp32 copy of our own (a clone when the logits are fp32 already), worked in place
        work = logits.float() if logits.dtype != torch.float32 else logits.clone()
        world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        vocab_local = work.shape[-1]
        start = rank * vocab_local

        logits_max = work.max(dim=-1).values
        if world > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        work.sub_(logits_max.unsqueeze(-1))  # shifted logits z - m

        valid = labels != ignore_index
        local_target = labels - start
        in_range = valid & (local_target >= 0) & (local_target < vocab_local)
        index = torch.where(in_range, local_target, torch.zeros_like(local_target))
        target_logit = work.gather(-1, index.unsqueeze(-1)).squeeze(-1) * in_range

        work.exp_()
        sum_exp = work.sum(dim=-1)
        if world > 1:
            dist.all_reduce(target_logit, group=group)
            dist.all_reduce(sum_exp, group=group)
        loss = (sum_exp.log() - target_logit) * valid

        work.div_(sum_exp.unsqueeze(-1))  # softmax
        ctx.save_for_backward(work, index, in_range, valid)
        ctx.spent = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        if ctx.spent:
            raise RuntimeError(
                "vocab_parallel_cross_entropy: backward ran twice through the same graph "
                "(retain_graph=True); its saved softmax became the first gradient in place"
            )
        ctx.spent = True
        grad, index, in_range, valid = ctx.saved_tensors  # the softmax, turned into dz in place
        grad.scatter_add_(-1, index.unsqueeze(-1), -in_range.unsqueeze(-1).to(grad.dtype))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor, labels: Tensor, group: dist.ProcessGroup | None = None, ignore_index: int = -100
) -> Tensor:
    """Per-token cross-entropy (fp32) of vocab-sharded ``logits`` [..., V/t] against ``labels`` [...]."""
    return _VocabParallelCrossEntropy.apply(logits, labels, group, ignore_index)
