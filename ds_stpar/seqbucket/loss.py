"""Per-token loss normalised over the whole mini-batch.

``loss = sum of per-token cross-entropy over this micro-batch's targets / N``, where ``N``
is the number of target tokens in the whole mini-batch: all buckets, micro-batches and DP
ranks. Summing these losses over every micro-batch of every rank gives the mean token loss
of the mini-batch, and so its gradient, whatever the bucketing, packing or layout (a per
micro-batch mean, as HotSPa and most gradient-accumulation loops take, weights a token by
``1 / tokens in its micro-batch`` instead).

``N`` comes from the plan (:attr:`~ds_stpar.seqbucket.sampler.MiniBatchPlan.num_targets`)
or, when no plan knows it, from :func:`all_reduce_num_targets` before the first backward.

Gradients must then be *summed* over data-parallel ranks. Engines that average them over a
DP group of ``d`` ranks (DDP, DeepSpeed) need the loss multiplied by ``d``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_stpar.seqbucket.packing import IGNORE_INDEX


def masked_token_loss(
    token_losses: torch.Tensor, labels: torch.Tensor, num_targets: int | torch.Tensor
) -> torch.Tensor:
    """``sum(token_losses where labels != -100) / num_targets``; shapes equal (any layout).

    For per-token losses computed elsewhere (e.g. Megatron's vocab-parallel cross-entropy,
    fed with the -100 labels replaced by any valid id).
    """
    if token_losses.shape != labels.shape:
        raise ValueError(
            f"token losses {tuple(token_losses.shape)} vs labels {tuple(labels.shape)}"
        )
    mask = labels != IGNORE_INDEX
    return torch.where(mask, token_losses, torch.zeros_like(token_losses)).sum() / num_targets


def token_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    num_targets: int | torch.Tensor,
    seq_first: bool = False,
) -> torch.Tensor:
    """Cross-entropy summed over target tokens, divided by ``num_targets``.

    ``labels``: ``[b, s]``, already shifted (the packer's labels), -100 for no target.
    ``logits``: ``[b, s, V]``, or ``[s, b, V]`` with ``seq_first=True`` (Megatron's layout).
    Computed in float32 at least (half-precision logits are upcast), float64 stays float64.
    """
    if seq_first:
        labels = labels.transpose(0, 1)
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}"
            f"{' (transposed, seq_first)' if seq_first else ''}"
        )
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    losses = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    return masked_token_loss(losses, labels.reshape(-1), num_targets)


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    """Target tokens in ``labels`` (int64 scalar tensor)."""
    return (labels != IGNORE_INDEX).sum()


def all_reduce_num_targets(
    local: int | torch.Tensor, group: dist.ProcessGroup, device: torch.device | str = "cpu"
) -> int:
    """The mini-batch's target count from each rank's local count, summed over ``group``.

    ``group`` must hold each data shard exactly once: for one layout its DP group (TP and
    PP peers see the same tokens and would count them again). ``device``: where the
    collective runs (``"cuda"`` for NCCL).
    """
    count = torch.as_tensor(local, dtype=torch.int64, device=device).reshape(())
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return int(count.item())
