"""The word embedding a pipelined home layout ties to its LM head: a copy on the first stage
and one on the last, whose gradients must be summed before DeepSpeed reduces them.

Megatron-LM sums the two in ``finalize_model_grads`` (the embedding-group all-reduce), after
every micro-batch's backward and before the optimizer step. Under DeepSpeed the reduction over
DP runs inside the boundary micro-batch's backward, and a sum in a per-micro-batch hook would
deadlock 1F1B: the last stage would wait in it for the first stage's gradient of that
micro-batch, and the first stage waits for the last stage's output gradient. So each copy's
gradient is parked instead (:class:`TiedEmbedding`):

1. a tensor hook adds every fresh gradient of the copy into a private fp32 accumulator and
   hands DeepSpeed zeros; what other layouts' buckets carry home for the copy goes into the
   accumulator too (:meth:`TiedEmbedding.add`);
2. after the home bucket's last micro-batch, whose backward is then not DeepSpeed's boundary,
   the accumulators are all-reduced over the embedding group (the first and last stage of one
   pipeline, :meth:`TiedEmbedding.reduce`);
3. one more backward, DeepSpeed's boundary, of ``0 x`` the sum of every parameter of the
   stage (:meth:`TiedEmbedding.boundary`): the hook hands DeepSpeed the copies' sum, which it
   accumulates, reduces over DP and clips like any gradient, and the accumulator is cleared.
   Every parameter takes part (with a zero gradient), as in any boundary micro-batch: ZeRO-1
   reduces a gradient over DP in the hook that DeepSpeed's boundary backward fires for it,
   and a parameter outside that backward would stay unreduced.

Both copies get the same gradient, so from the same initial values (megatron-core all-reduces
them at build over the same group) the same optimizer arithmetic keeps them equal. The last
stage's copy is marked ``ds_pipe_replicated`` so that DeepSpeed's gradient norm counts the
weight once. A stage holding no copy (pp > 2) runs the same boundary backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from ds_stpar.parallel import LayoutGroups

TIED_NAME = "embedding.word_embeddings.weight"  # the copies' global name on both stages


class TiedEmbedding:
    """This rank's copy of a pipelined home's tied embedding (``param``; ``None`` on a stage
    without one), its fp32 gradient accumulator and the embedding group (module docstring)."""

    def __init__(self, param: torch.nn.Parameter | None, groups: LayoutGroups) -> None:
        self.param = param
        self.group = groups.embd_group
        self.acc: Tensor | None = None
        self._injecting = False
        if param is not None:
            self.acc = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
            param.register_hook(self._hook)
            if groups.pp_index > 0:
                param.ds_pipe_replicated = True  # DeepSpeed's norm counts the first stage's

    def _hook(self, grad: Tensor) -> Tensor:
        if self._injecting:
            return self.acc.to(grad.dtype)
        self.acc.add_(grad)
        return torch.zeros_like(grad)

    def add(self, value: Tensor) -> None:
        """Gradient carried home for this copy (fp32, already scaled as the loss is)."""
        self.acc.add_(value)

    def reduce(self) -> None:
        """Sum the two copies' accumulators (collective over the embedding group)."""
        if self.param is not None:
            dist.all_reduce(self.acc, group=self.group)

    def boundary(
        self, params: Iterable[torch.nn.Parameter], backward: Callable[[Tensor], None]
    ) -> None:
        """Run ``backward`` (DeepSpeed's boundary backward of a scalar) on ``0 x`` the sum of
        the stage's ``params``, handing DeepSpeed the copies' summed gradient. Each term is
        ``0 x sum(p)``: its gradient, zero, is expanded, not allocated, per parameter."""
        self._injecting = True
        try:
            backward(sum(p.sum() * 0 for p in params))
        finally:
            self._injecting = False
        if self.acc is not None:
            self.acc.zero_()
