"""A transformer layer that runs pieces of its micro-batch interleaved, each piece's
tensor-parallel transfers hidden behind the other pieces' compute.

Why. At P = 2 a ring pass has one hop, and within one layer every transfer depends on the
compute just before it and feeds the compute just after: the attention's output reduction
can only hide behind the projection GEMM that makes it, the MLP's input gather behind fc1's
own-chunk rows. Over a slow link, where a hop outlasts those GEMMs several times, most of it
stays exposed (BENCHMARKS.md: the ring layer ran 1.06-1.11x Megatron TP+SP over host memory,
the no-communication limit is 1.4-2.2x). The sequences of a batch are independent all the way
through the layer, so one piece's transfer can run beside another piece's attention or MLP.

What runs. The input ``[s/P, b, h]`` (Megatron's sequence-parallel layout, as every ring layer)
is cut along the batch into k pieces ``[s/P, b/k, h]``. The transfers are
:mod:`ds_stpar.layers.async_comm`'s (started in one line, finished in a later one); the
attention and the MLP are this layer's own submodules with their linears in
``local_compute`` mode, so they run only this rank's GEMMs. For k = 2 (pieces A, B)::

    start sending x_A's rows to the other ranks;  norm1 + QKV(A own rows);  start gather x_B
    others' rows of A: norm1 + QKV(A others' rows), attention(A), start all-reduce A
                                                                  (gather B travels)
    finish gather B: norm1, attention(B), start all-reduce B      (all-reduce A travels)
    finish all-reduce A: + residual, norm2, MLP(A), start reducing A         (all-reduce B)
    finish all-reduce B: + residual, norm2, MLP(B rows of the other ranks),
                         start sending them;  land A;  MLP(B own rows)        (reduce A, B)
    finish B: the other ranks' terms + its own, + residual (own rows);  output = [A; B]

and for larger k the same loops over more pieces. Every transfer hides behind another piece's
attention or MLP, but the layer's first and last, which hide behind this rank's own rows:
the GEMMs and norms work row by row, so the first piece gathers only the other ranks' rows
(``gather_others_start``) while its own rows run their norm and QKV GEMM, and the last piece
runs the rows the other ranks keep first and sends this rank's terms of them
(``reduce_others_start``: the reduce-scatter without the own term) while its own rows run
their MLP; both move Megatron's volume, as one all-to-all each. The other pieces' MLP outputs
are reduced the same way, their other rows sent and the own term added when they land
(:func:`_own_term`), for the backward's memory. The backward mirrors it: it
starts with the last piece's own rows, whose output gradient is local, while the other
ranks' gradient rows arrive, and ends with the first piece's own QKV GEMM while the others'
input gradients travel (the adjoints of a gather and a reduce-scatter had nothing to hide
behind). The other pieces land before the last piece's own rows run, which puts the own
rows' backward ahead of the other pieces' output-gradient transfers on the compute stream
(``_last_piece``). Every piece but the first makes its weight gradients before its input
gradients (``_pieces``).
Over the slow link (2 x H100, twenty-seventh session, call 169) this took a layer from
1.19-1.20x Megatron TP2 + SP to 1.242-1.295x at h 8192 and from 1.37-1.42x to 1.43-1.475x
at h 4096; over NVLink, where the planner does not choose the layer, 0.89-0.98x against
0.93-1.01x (call 170).

In a stack the layer hands on. A layer followed by another interleaved layer in its block
(``hands_on``) ends with an all-reduce per piece instead of the reduction, and returns
before waiting for it: its output is a placeholder ``[s/P, b, h]`` (NaN, zero storage)
carrying the pieces in flight (:class:`Handoff`). The next layer takes them instead of
gathering, and finishes each piece's all-reduce and residual add only when it reaches that
piece::

    layer i:    ...  MLP(A), start all-reduce A;  MLP(B), start all-reduce B;  return
    layer i+1:  finish all-reduce A: + residual, norm1, attention(A), start all-reduce A
                finish all-reduce B: + residual, ...                   (all-reduce A travels)

So the block's boundary transfers hide as its middle ones do: only the first layer's gather
and the last layer's reduction hide behind this rank's own rows alone, once per model chunk
(a pipeline stage's block, or each virtual stage's), not per layer. The reduce-scatter then
gather at a boundary become one all-reduce (same bytes; a transfer back to back with a little
work between would stay exposed, as in the middle). Not under Megatron's full-layer
recompute or CPU offloading (the block then wraps layers in checkpoints or offload hooks that
take plain tensors). A receiving layer whose own call would run otherwise (other pieces,
positional arguments) lands the pieces and keeps its rows, the real ``[s/P, b, h]``, and runs
from that. Anything else that
uses the placeholder (a layer that is not interleaved, the final norm, a loss) lands it too
on first use (:class:`HandoffTensor`): a layer told to hand on where nothing takes its pieces
is late, never wrong.

Which layers hand on: :func:`~ds_stpar.layers.megatron_spec.get_gpt_block_stpar_spec` says so
per layer (all but the last of its list). A layer spec that Megatron's ``TransformerBlock``
repeats over its layers (``get_gpt_layer_stpar_spec``, Megatron-LM's ``--spec``) leaves it to
the layer, which reads Megatron's own count of the layers the block builds for its pipeline
stage (``get_num_layers_to_build``): all but the last. Built alone from such a spec with a
config of several layers, a layer would hand on to nothing: pass ``hands_on=False``.

Why an all-reduce in the middle and not Megatron's reduce-scatter, residual add, norm and
gather: those are two transfers back to back with a little work between them, and that work
cannot run beside the other piece's GEMMs (cuBLAS's persistent kernels hold every SM until
they end; a transfer's kernel only runs beside a GEMM when it was launched first), so one of
the two stayed exposed (BENCHMARKS.md, sixteenth session: about 1.5 ms per piece at h 8192
over host memory). One all-reduce moves the same bytes in one kernel; each rank then adds the
residual and normalises all s rows itself (the gathered input is the residual, so the layer
gathers x, not norm1(x)). The norms see every row on every rank, so their parameter gradients
are each rank's share over all rows, and Megatron's sum over TP of sequence-parallel
parameters' gradients adds the shares up as it adds the rows' shares under sequence
parallelism. The backward mirrors all of it (autograd runs the newest ready node first; an
all-reduce's adjoint is an all-reduce, a gather's a reduce-scatter).

Communication volume per layer equals Megatron TP+SP's forward (gather, all-reduce =
reduce-scatter + gather, reduce-scatter) and its backward less the two re-gathers. Memory:
the layer keeps the gathered residual and the all-reduced middle (the norms' inputs), (P-1)/P
of the activation more each than the ring layer's own chunks; the norms' outputs, the column
GEMMs' gathered inputs, are not kept: the spec's norms mark them (``norm_recipe``) and the
local column GEMMs keep the norms' inputs instead, making the outputs again for their weight
gradients (QKV's after the attention core's backward; until the twenty-sixth session Megatron's
``CheckpointWithoutOutput`` made them again when the backward reached the block's output, and
held them twice from there on); the MLP saves fc1's output only, recomputing the activation
(``StparMLP``), as the fused ring MLP.

When it runs: TP group of P > 1, a batch the pieces divide (else gcd(batch, k) pieces; one:
Megatron's forward), no hidden dropout while training (every rank adds the residual to all
rows, so a dropout mask drawn per rank would differ between ranks), no packed sequences (a
packed micro-batch is one row), no inference context, cross-attention, recompute of the norms
or the MLP, or activation offloading (the QKV linear's included), and row linears that leave
their bias to the caller (Megatron's projection and fc2 do). Otherwise the layer is
Megatron's ``TransformerLayer`` over the ring linears (same weights, same function), and
global rank 0 logs why, once per reason (``InterleavedTransformerLayer.whole_because``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    get_transformer_layer_offset,
)
from megatron.core.utils import get_pg_rank, make_viewless_tensor
from torch import Tensor
from torch.utils._pytree import tree_map

from ds_stpar.errors import ConfigError
from ds_stpar.layers.async_comm import (
    all_reduce_finish,
    all_reduce_start,
    gather_finish,
    gather_others_finish,
    gather_others_start,
    gather_start,
    reduce_others_finish,
    reduce_others_start,
)
from ds_stpar.layers.linear import TemporalColumnParallelLinear, TemporalLinear
from ds_stpar.layers.local import LocalCompute

ATTENTION_KWARGS = (
    "rotary_pos_emb",
    "rotary_pos_cos",
    "rotary_pos_sin",
    "rotary_pos_cos_sin",
    "sequence_len_offset",
)


@contextmanager
def local_compute(*modules: torch.nn.Module):
    """Every temporal linear inside ``modules`` runs only its local GEMM while the layer runs,
    each weight's gradient summed over its uses in one tensor; yields the call's
    :class:`LocalCompute`."""
    linears = [m for module in modules for m in module.modules() if isinstance(m, TemporalLinear)]
    call = LocalCompute()
    for linear in linears:
        linear.local_compute = call
    try:
        yield call
    finally:
        for linear in linears:
            linear.local_compute = None


HANDOFF = "stpar_handoff"  # the placeholder's attribute holding the Handoff


@dataclass
class Handoff:
    """A layer's output still in flight (module docstring): per piece, a call that waits for
    the piece's all-reduce and adds the residual, giving the piece's rows ``[s, b/k, h]``
    on every rank (``group``'s)."""

    arrivals: list[Callable[[], Tensor]]
    group: object

    def own_rows(self) -> Tensor:
        """Land every piece and keep this rank's rows: ``[s/P, b, h]``, the output a layer
        that does not hand on gives."""
        return torch.cat([_own_rows(arrive(), self.group) for arrive in self.arrivals], dim=1)


_METADATA = {  # queries the placeholder answers as the rows would, without landing them
    torch.Tensor.shape.__get__,
    torch.Tensor.dtype.__get__,
    torch.Tensor.device.__get__,
    torch.Tensor.is_cuda.__get__,
    torch.Tensor.ndim.__get__,
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.element_size,
    torch.Tensor.__len__,
}


class HandoffTensor(torch.Tensor):
    """The placeholder a layer handing on returns: ``[s/P, b, h]`` of one NaN broadcast (no
    storage) carrying its pieces in flight (:class:`Handoff`, under ``stpar_handoff``).

    The next interleaved layer takes the pieces (:meth:`take`) and reads only the shape. Any
    other torch operation on it, a layer that is not interleaved or the block's final norm,
    first lands the pieces and runs on this rank's rows (:meth:`Handoff.own_rows`), so a
    misplaced hand-on costs the overlap, never the result. Shape, size, dtype and device
    queries (``_METADATA``) do not land; everything else does, ``requires_grad`` and strides
    included. A placeholder made with autograd on refuses to land with it off (under
    ``no_grad``, or inside an ``autograd.Function``'s forward): the rows would carry no graph
    back to the layers before, and their gradients would be lost without a word."""

    @staticmethod
    def carrying(handoff: Handoff, like: Tensor) -> HandoffTensor:
        nan = torch.full((), math.nan, dtype=like.dtype, device=like.device).expand(like.shape)
        placeholder = torch.Tensor._make_subclass(HandoffTensor, nan)
        setattr(placeholder, HANDOFF, handoff)
        placeholder._grad_mode = torch.is_grad_enabled()
        return placeholder

    def pending_pieces(self) -> int:
        """How many pieces are in flight; 0 once taken or landed."""
        return len(self.__dict__[HANDOFF].arrivals) if HANDOFF in self.__dict__ else 0

    def take(self) -> Handoff:
        """The pieces in flight, for the next interleaved layer; the placeholder is spent."""
        if HANDOFF not in self.__dict__:
            raise RuntimeError("this layer output's pieces were already taken by another layer")
        return self.__dict__.pop(HANDOFF)

    def land(self) -> Tensor:
        """This rank's rows ``[s/P, b, h]``, landing the pieces on first use."""
        if "_rows" not in self.__dict__:
            if self._grad_mode and not torch.is_grad_enabled():
                raise RuntimeError(
                    "a hand-on layer's output was first used with autograd off (no_grad, or "
                    "inside an autograd.Function): its rows would lose the gradient path; use "
                    "it with autograd on first, or build that layer with hands_on=False"
                )
            self._rows = self.take().own_rows()
        return self._rows

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = tree_map(_landed, (args, kwargs))
        return func(*args, **kwargs)


_SAID: set[str] = set()


def _say_once(
    layer: InterleavedTransformerLayer, hidden: Tensor, args: tuple, kwargs: dict
) -> None:
    """Log on global rank 0, once per reason, that an interleaved layer ran Megatron's forward
    and why: the layout asked for pieces, and the step runs without their overlap. The other
    ranks return at once (no reason is worked out there)."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank():
        return
    if args:
        reason = "positional arguments after the hidden states"
    else:
        reason = layer.whole_because(kwargs) or (
            f"a micro-batch of {hidden.shape[1]} rows makes no {layer.pieces} pieces"
        )
    if reason in _SAID:
        return
    _SAID.add(reason)
    logging.getLogger(__name__).warning(
        "ds_stpar: an interleaved layer runs Megatron's forward (not in pieces): %s", reason
    )


def _landed(value):
    return value.land() if isinstance(value, HandoffTensor) else value


class InterleavedTransformerLayer(TransformerLayer):
    """Megatron's ``TransformerLayer`` whose forward interleaves pieces of the batch (module
    docstring); same submodules, parameters and checkpoint as the ring layer.

    ``pieces``: how many (2, 4, ...); a call whose batch it does not divide takes gcd(batch,
    pieces) pieces, and Megatron's forward when that is 1. ``hands_on``: whether the layer
    hands its pieces in flight to the next layer of its block (module docstring); None: all
    but the last layer ``get_num_layers_to_build`` counts for the block, as when Megatron's
    block repeats one layer spec.
    """

    def __init__(
        self,
        config,
        submodules,
        layer_number: int = 1,
        hidden_dropout: float | None = None,
        pg_collection=None,
        vp_stage: int | None = None,
        pieces: int = 2,
        hands_on: bool | None = None,
    ) -> None:
        if pieces < 2:
            raise ConfigError(f"an interleaved layer needs pieces >= 2, got {pieces}")
        super().__init__(config, submodules, layer_number, hidden_dropout, pg_collection, vp_stage)
        self.pieces = pieces
        if hands_on is None:
            pp_rank = get_pg_rank(self.pg_collection.pp)
            offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
            built = get_num_layers_to_build(config, vp_stage, pp_rank)
            hands_on = self.layer_number - offset < built
        self.hands_on = hands_on

    def _tp_group(self):
        qkv = self.self_attention.linear_qkv
        return qkv.tp_group if isinstance(qkv, TemporalColumnParallelLinear) else None

    def pieces_for(self, hidden_states: Tensor, kwargs: dict) -> int:
        """How many pieces this call runs in; 1: Megatron's forward (module docstring)."""
        if self.whole_because(kwargs) is not None:
            return 1
        return math.gcd(hidden_states.shape[1], self.pieces)

    def whole_because(self, kwargs: dict) -> str | None:
        """Why a call with these keyword arguments cannot run in pieces (the first reason the
        module docstring gives that holds), or None when it can."""
        group = self._tp_group()
        unsupported = (
            "context",
            "inference_context",
            "inference_params",
            "packed_seq_params",
            "attention_bias",
        )
        passed = [name for name in unsupported if kwargs.get(name) is not None]
        recomputed = self.recompute_input_layernorm or self.recompute_pre_mlp_layernorm
        offloaded = self.offload_attn_norm or self.offload_mlp_norm
        offloaded = offloaded or getattr(self.self_attention, "offload_qkv_linear", False)
        rows_linears = (self.self_attention.linear_proj, self.mlp.linear_fc2)
        for holds, reason in (
            (group is None or group.size() == 1, "no temporal QKV linear in a TP group of P > 1"),
            (bool(passed), f"{', '.join(passed)} passed"),
            (not isinstance(self.pre_cross_attn_layernorm, IdentityOp), "cross-attention"),
            (recomputed or self.recompute_mlp, "norm or MLP recompute"),
            (offloaded, "activation offloading"),
            (self.training and self.hidden_dropout > 0, "hidden dropout while training"),
            (
                not all(
                    isinstance(m, TemporalLinear) and (m.bias is None or m.skip_bias_add)
                    for m in rows_linears
                ),
                "a row linear that adds its own bias (or is not a temporal linear)",
            ),
        ):
            if holds:
                return reason
        return None

    def _hand_on_now(self) -> bool:
        """Whether this call hands on: the block calls the next layer directly (module
        docstring)."""
        full_recompute = self.config.recompute_granularity == "full" and self.training
        return self.hands_on and not full_recompute and not self.config.cpu_offloading

    def forward(self, hidden_states: Tensor, *args, **kwargs):
        count = 1 if args else self.pieces_for(hidden_states, kwargs)
        handoff = None
        if isinstance(hidden_states, HandoffTensor):
            if hidden_states.pending_pieces() == count:
                handoff = hidden_states.take()
            else:  # landed already, or this call runs otherwise: from the real rows
                hidden_states = hidden_states.land()
        if count == 1:
            _say_once(self, hidden_states, args, kwargs)
            return super().forward(hidden_states, *args, **kwargs)
        group = self._tp_group()
        masks = _split_mask(kwargs.pop("attention_mask", None), hidden_states.shape[1], count)
        extra = {name: kwargs[name] for name in ATTENTION_KWARGS if kwargs.get(name) is not None}
        hand_on = self._hand_on_now()
        with local_compute(self.self_attention, self.mlp) as call:
            if handoff is None:
                first, *rest = hidden_states.chunk(count, dim=1)
                arrivals = [self._first_piece(first, group)]  # issued before the others' gathers
                arrivals += [partial(_plain, gather_finish, *gather_start(x, group)) for x in rest]
            else:
                arrivals = [partial(_plain, arrive) for arrive in handoff.arrivals]
                handoff = None
            output = self._pieces(arrivals, group, masks, extra, hand_on, call)
        if hand_on:
            return HandoffTensor.carrying(output, like=hidden_states), None
        output = make_viewless_tensor(
            inp=output, requires_grad=output.requires_grad, keep_graph=True
        )
        return output, None

    def _pieces(
        self, arrivals: list, group, masks: list, extra: dict, hand_on: bool, call: LocalCompute
    ):
        """The interleaved schedule of the module docstring over the pieces ``arrivals``
        give; the output rows ``[s/P, b, h]``, or the pieces in flight when ``hand_on``.

        Every piece but the first makes its weight gradients before its input gradients
        (``call.weight_grad_first``, :func:`~ds_stpar.layers.local.local_linear`): less
        memory in the backward, whose transfers for those pieces hide behind the first
        piece's backward, which follows; the first piece's input gradients feed the
        layer's last transfers, which only its own remaining work hides."""
        sums, residuals = [], []
        attention = self.self_attention
        for index, mask in enumerate(masks):
            call.weight_grad_first = index > 0
            (full, qkv), arrivals[index] = arrivals[index](), None  # free what the arrival holds
            if qkv is None:
                out, bias = attention(self.input_layernorm(full), attention_mask=mask, **extra)
            else:  # the QKV GEMM ran already; ``full`` only gives the shape there
                with _given_output(attention.linear_qkv, qkv):
                    out, bias = attention(full, attention_mask=mask, **extra)
            sums.append((all_reduce_start(out, group, consume=True), bias))
            residuals.append(full)
        landings = []
        for index, (((token, transfer), bias), full) in enumerate(
            zip(sums, residuals, strict=True)
        ):
            middle = self._add(self.self_attn_bda, all_reduce_finish(token, transfer), bias, full)
            call.weight_grad_first = index > 0
            if not hand_on and index == len(sums) - 1:
                return torch.cat(self._last_piece(middle, group, landings), dim=1)
            # the own rows, this piece's residual at the output, are cut before the MLP runs:
            # autograd runs the newest node first, so the cut's backward, which pads their
            # gradient to all s rows with zeros, then runs after the MLP's, not beside it
            # (BENCHMARKS.md, thirty-fourth session: h 8192 / 8K's peak 32 MiB lower)
            own = None if hand_on else _own_rows(middle, group)
            out, bias = self.mlp(self.pre_mlp_layernorm(middle))
            if hand_on:
                summed = all_reduce_start(out, group, consume=True)
                land = (all_reduce_finish, *summed, bias, middle)
            else:  # the reduce-scatter as its two halves, the own term kept here (_own_term)
                own_out, others = _own_term(out, group)
                land = (partial(_plus, own_out), *reduce_others_start(others, group), bias, own)
            landings.append(partial(self._land, *land))
        return Handoff(landings, group)

    def _first_piece(self, x: Tensor, group) -> Callable[[], tuple[Tensor, tuple]]:
        """Start the first piece (module docstring): send its rows ``x`` ``[s/P, b/k, h]`` to
        the other ranks and run their norm and QKV GEMM while the other ranks' rows come;
        returns the piece's arrival: its rows ``[s, b/k, h]`` and its QKV output with bias."""
        qkv_linear = self.self_attention.linear_qkv
        token, transfer = gather_others_start(x, group)
        qkv_own, bias = qkv_linear(self.input_layernorm(x))

        def arrive() -> tuple[Tensor, tuple]:
            others = gather_others_finish(token, transfer)
            qkv_others, _ = qkv_linear(self.input_layernorm(others))
            cut = group.rank() * x.shape[0]
            full = _with_own(others, x, cut)
            qkv = _with_own(qkv_others, qkv_own, cut)
            return full, (qkv, bias)

        return arrive

    def _last_piece(self, middle: Tensor, group, landings: list[Callable]) -> list[Tensor]:
        """The last piece's MLP (module docstring): the rows ``[s, b/k, h]`` of ``middle``
        that the other ranks keep, their terms sent to them, then this rank's own rows
        ``[s/P, b/k, h]`` while those travel; returns every piece's output rows.

        The other pieces land before the own rows run, so that the backward (newest node
        first) runs the own rows' MLP before it issues the other pieces' output-gradient
        transfers: queued behind this piece's transfer on NCCL's stream, such a launch would
        hold the compute stream's kernels behind it too (``CUDA_DEVICE_MAX_CONNECTIONS=1``:
        one hardware queue), as it did before this order (twenty-seventh session, call 167)."""
        before, own, after = _rows_around_own(middle, group)
        outs = [self.mlp(self.pre_mlp_layernorm(rows)) for rows in (before, after) if len(rows)]
        others = _joined([out for out, _ in outs])
        token, transfer = reduce_others_start(others, group)
        landed = [land() for land in landings]
        own_out, bias = self.mlp(self.pre_mlp_layernorm(own))
        landed.append(self._land(partial(_plus, own_out), token, transfer, bias, own))
        return landed

    def _land(self, finish: Callable, token: Tensor, transfer, bias, residual: Tensor) -> Tensor:
        """A piece's MLP output: wait for its transfer, add it onto the residual."""
        return self._add(self.mlp_bda, finish(token, transfer), bias, residual)

    def _add(self, bda, out: Tensor, bias: Tensor | None, residual: Tensor) -> Tensor:
        """Megatron's bias-dropout-add of the attention's or the MLP's output onto the residual."""
        with self.bias_dropout_add_exec_handler():
            return bda(self.training, self.config.bias_dropout_fusion)(
                (out, bias), residual, self.hidden_dropout
            )


def _own_rows(full: Tensor, group) -> Tensor:
    return _rows_around_own(full, group)[1]


def _rows_around_own(full: Tensor, group) -> tuple[Tensor, Tensor, Tensor]:
    """``full`` ``[s, ...]`` cut at this rank's chunk of dim 0: (the rows before it, it, the
    rows after it), views of one split. Its backward concatenates the parts' gradients once;
    slices would each make a zero tensor of ``full``'s size for their gradient, which autograd
    then adds up (twenty-eighth session, call 178: seven such fills a layer step, with their
    copies and adds, these and :func:`_with_own`'s)."""
    rows, me = full.shape[0] // group.size(), group.rank()
    before, own, after = torch.split(full, [me * rows, rows, full.shape[0] - (me + 1) * rows])
    return before, own, after


def _own_term(out: Tensor, group) -> tuple[Tensor, Tensor]:
    """A piece's MLP output ``[s, ...]`` (this rank's terms of every row) as (its terms for
    its own rows, for the other ranks' rows in rank order), the reduce-scatter's operands
    when the own term stays here: :func:`reduce_others_start` sends the others' and
    ``_plus`` adds the own one to what arrives (Megatron's volume, the own term's add as
    the reduce-scatter's). Why not the reduce-scatter: its backward gathers the output
    gradient into one ``[s, ...]`` buffer, allocated when the gather is issued, which at
    h 8192 / 8K tokens (TP2) held 64 MiB through the last piece's MLP backward; the
    adjoint here receives the others' rows only (32 MiB), this rank's gradient rows are
    the caller's, and the ``[s, ...]`` gradient is made (the split's backward) only where
    this piece's MLP backward takes it (BENCHMARKS.md, thirty-fifth session). At P > 2 the
    others' rows are copied together (the own chunk lies between them)."""
    before, own, after = _rows_around_own(out, group)
    return own, _joined([before, after])


def _joined(parts: list[Tensor]) -> Tensor:
    """The non-empty ``parts`` along dim 0: the one itself (no copy) when only one is."""
    rows = [part for part in parts if len(part)]
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def _with_own(others: Tensor, own: Tensor, cut: int) -> Tensor:
    """``[others[:cut]; own; others[cut:]]`` (dim 0), splitting ``others`` only where ``own``
    falls inside it (for the gradients, as in :func:`_rows_around_own`)."""
    if cut == 0:
        return torch.cat([own, others])
    if cut == others.shape[0]:
        return torch.cat([others, own])
    before, after = torch.split(others, [cut, others.shape[0] - cut])
    return torch.cat([before, own, after])


def _plain(arrive: Callable, *args) -> tuple[Tensor, None]:
    """An arrival whose rows still need their norm and QKV GEMM: (rows, None)."""
    return arrive(*args), None


@contextmanager
def _given_output(linear: torch.nn.Module, output: tuple):
    """``linear`` returns ``output`` (its ``(output, bias)``) on its calls inside; its own
    ``forward``, an instance's included, again after."""
    own = linear.__dict__.get("forward")
    linear.forward = lambda *args, **kwargs: output
    try:
        yield
    finally:
        if own is None:
            del linear.forward
        else:
            linear.forward = own


def _plus(own: Tensor, token: Tensor, transfer) -> Tensor:
    """Chunk d of a piece's reduction: the other ranks' terms, landed, and this rank's."""
    return reduce_others_finish(token, transfer) + own


def _split_mask(mask: Tensor | None, batch: int, count: int) -> list[Tensor | None]:
    """The attention mask per piece: one shared by the batch (dim 0 of 1) goes to all."""
    if mask is None or mask.shape[0] == 1:
        return [mask] * count
    if mask.shape[0] != batch:
        raise ValueError(f"attention mask of batch {mask.shape[0]} for a batch of {batch}")
    return list(mask.chunk(count, dim=0))
