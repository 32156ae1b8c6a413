"""Non-interleaved 1F1B over one layout's pipeline group, with explicit groups.

Stage ``s`` of ``p`` runs ``m`` micro-batches in the order of PipeDream-Flush / Megatron's
``forward_backward_pipelining_without_interleaving``::

    warm-up:   w = min(p - s - 1, m) forwards
    steady:    m - w times (forward of micro-batch w + i, backward of micro-batch i)
    cool-down: the w remaining backwards

so a stage holds at most ``p - s`` micro-batches' activations (stage 0: ``p``), and the step
takes ``(m + p - 1)`` stage times: the bubble the planner's cost model charges.

Between stages travel the hidden state ``[S/tp, 1, h]`` forward (``S`` the micro-batch's
packed tokens; sequence parallel splits it over TP) and its gradient backward. Each
transfer that pairs with one in the other direction goes in one batched isend/irecv
(:func:`~ds_stpar.layers.comm.start_p2p`; forward and backward messages carry their own tags,
which gloo matches by and NCCL ignores), so no ordering of blocking sends can deadlock.

Why not Megatron's own schedule: it calls ``torch.autograd.backward`` on the stage output,
past the DeepSpeed engine that owns the home model's gradient reduction, and it divides the
loss by the micro-batch count. Here the caller's ``backward(k, output, grad)`` decides how a
stage's backward runs (the home model: through ``engine.backward``, see
:mod:`~ds_stpar.seqbucket.runner`), and the loss is the caller's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ds_stpar.layers.comm import Group, Message, PendingP2P, start_p2p

FORWARD_TAG, BACKWARD_TAG = 0, 1

Forward = Callable[[int, Tensor | None], Tensor]
"""``forward(k, input)``: micro-batch ``k`` through this stage (``input`` None on the first
stage, else the received hidden state, which requires grad); returns the hidden state for
the next stage, or on the last stage the scalar to differentiate."""

Backward = Callable[[int, Tensor, Tensor | None], None]
"""``backward(k, output, grad)``: backward of micro-batch ``k`` from this stage's ``output``
(``grad`` None on the last stage, where ``output`` is the loss)."""


class PipelineStage:
    """This rank's stage of a ``pp``-stage pipeline (``group``: the pipeline group, group
    rank = stage index). ``shape(k)``: the hidden state's shape for micro-batch ``k``;
    ``dtype``/``device``: its dtype and device."""

    def __init__(self, group: Group, dtype: torch.dtype, device: torch.device) -> None:
        self.group, self.dtype, self.device = group, dtype, device
        self.stage, self.stages = group.rank(), group.size()
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1

    def _exchange(
        self, sends: list[Message], recvs: list[tuple[tuple[int, ...], int, int]]
    ) -> list[Tensor]:
        """Send ``sends`` and receive ``(shape, peer, tag)`` buffers in one batch; waits."""
        buffers = [Message(self._empty(shape), peer, tag) for shape, peer, tag in recvs]
        if not sends and not buffers:
            return []
        pending: PendingP2P = start_p2p(sends, buffers, self.group)
        return pending.wait()

    def _empty(self, shape: tuple[int, ...]) -> Tensor:
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def run(
        self,
        count: int,
        shape: Callable[[int], tuple[int, ...]],
        forward: Forward,
        backward: Backward,
    ) -> None:
        """Forward and backward of micro-batches ``0 .. count-1`` in 1F1B order."""
        prev, nxt = self.stage - 1, self.stage + 1
        inputs: dict[int, Tensor | None] = {}
        outputs: dict[int, Tensor] = {}

        def recv_forward(k: int) -> list[tuple[tuple[int, ...], int, int]]:
            return [] if self.first else [(shape(k), prev, FORWARD_TAG)]

        def recv_backward(k: int) -> list[tuple[tuple[int, ...], int, int]]:
            return [] if self.last else [(shape(k), nxt, BACKWARD_TAG)]

        def send_forward(k: int) -> list[Message]:
            return [] if self.last else [Message(outputs[k].detach(), nxt, FORWARD_TAG)]

        def run_forward(k: int, received: list[Tensor]) -> None:
            x = received[0].requires_grad_() if received else None
            inputs[k] = x
            outputs[k] = forward(k, x)

        def run_backward(k: int, received: list[Tensor]) -> list[Message]:
            grad = received[0] if received else None
            backward(k, outputs.pop(k), grad)
            x = inputs.pop(k)
            return [] if x is None else [Message(x.grad, prev, BACKWARD_TAG)]

        warmup = min(self.stages - self.stage - 1, count)
        for k in range(warmup):
            run_forward(k, self._exchange([], recv_forward(k)))
            self._exchange(send_forward(k), [])
        received = self._exchange([], recv_forward(warmup)) if warmup < count else []
        for i in range(count - warmup):
            k = warmup + i
            run_forward(k, received)
            grads = self._exchange(send_forward(k), recv_backward(i))
            sends = run_backward(i, grads)
            more = k + 1 < count
            received = self._exchange(sends, recv_forward(k + 1) if more else [])
        for i in range(count - warmup, count):
            sends = run_backward(i, self._exchange([], recv_backward(i)))
            self._exchange(sends, [])
