"""A norm's output kept as its recipe: the column passes that read it make it again, not keep it.

In a pre-norm layer the norms' outputs go straight into column linears (QKV, fc1), and a
column linear keeps its input, ``[s/P, b, h]`` under sequence parallelism, until its
backward. The norm's own autograd node already keeps the norm's *input* (LayerNorm and
RMSNorm save it, with their fp32 statistics), so the layer holds two ``[s/P, b, h]`` tensors
per norm from its forward to its backward. Megatron-core keeps both.

The spec's norms (:class:`MarkedLayerNorm`, :class:`MarkedRMSNorm`, made by
``megatron_modules.SequenceParallelNorm``; ``hf.apply_stpar`` marks a HuggingFace model's
norms the same way) mark each output they make with how to make it again: the module and its
input. A ring column pass, ring MLP or local GEMM handed a marked tensor that nothing has
changed since, nor the norm's input (their version counters say so), keeps the norm's input
instead, a tensor that is alive anyway, and runs the norm again in its backward where it first
needs the output:

- QKV's column linear: after the attention core's backward, whose transients make the
  layer's backward peak (h 8192 / 8K tokens on 2 x H100, twenty-fifth session, call 151);
- the two-pass MLP: after fc2's pass, for fc1's;
- the fused ring MLP: its own chunk of X, for dW1 after the other chunks (or at the
  backward's start when dW1 goes into a ``main_grad`` inside the ring, where it is then held
  through the ring);
- the interleaved layer's local column GEMMs (``local.local_linear``): for their dW.

Between a layer's forward and its backward it holds one ``[s/P, b, h]`` per norm less, and
QKV's input is not alive beside the attention core's backward. The cost is one norm forward per
norm in the backward (memory-bound: it reads and writes ``[s/P, b, h]`` once), bitwise the
forward's output (the same kernel on the same input and weights; autocast off, as marked).

Nothing is marked under autocast (the recompute would need its state) or with gradients off
(a checkpoint's first forward, Megatron's ``CheckpointWithoutOutput``, inference); any other
consumer ignores the mark.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

_ATTRIBUTE = "_stpar_norm_recipe"


@dataclass(frozen=True)
class NormRecipe:
    """``norm(input)`` made again: ``norm`` is the norm's plain forward."""

    norm: Callable[[Tensor], Tensor]
    input: Tensor

    def make(self) -> Tensor:
        """The output again: gradients off, and autocast off as when it was marked (a backward
        run inside an autocast region would otherwise remake it in another dtype)."""
        with torch.no_grad(), torch.autocast(self.input.device.type, enabled=False):
            return self.norm(self.input)


def mark(output: Tensor, norm: Callable[[Tensor], Tensor], input_: Tensor) -> Tensor:
    """``output`` (= ``norm(input_)``) marked with its recipe, when a recompute could repeat it."""
    if torch.is_grad_enabled() and not torch.is_autocast_enabled(output.device.type):
        versions = (output._version, input_._version)
        setattr(output, _ATTRIBUTE, (NormRecipe(norm, input_), versions))
    return output


def recipe_of(tensor: Tensor) -> NormRecipe | None:
    """The recipe ``tensor`` was marked with, if nothing has written to it, nor to the norm's
    input, since."""
    marked = getattr(tensor, _ATTRIBUTE, None)
    if marked is None:
        return None
    recipe, versions = marked
    if versions != (tensor._version, recipe.input._version):
        return None
    return recipe


def kept(x: Tensor, recipe: NormRecipe | None) -> Tensor:
    """What a pass saves for ``x``: the norm's input when ``x`` has a recipe, else ``x``."""
    return x if recipe is None else recipe.input


def norm_of(recipe: NormRecipe | None) -> Callable[[Tensor], Tensor] | None:
    """The norm :func:`remade` needs, to keep on the autograd context (None: no recipe)."""
    return None if recipe is None else recipe.norm


def remade(saved: Tensor, norm: Callable[[Tensor], Tensor] | None) -> Tensor:
    """The pass's input from what :func:`kept` saved: ``norm(saved)`` again, or ``saved``."""
    return saved if norm is None else NormRecipe(norm, saved).make()


class _Marking:
    """A torch norm whose outputs carry their :class:`NormRecipe`."""

    def forward(self, x: Tensor) -> Tensor:
        plain = super().forward  # type: ignore[misc]
        return mark(plain(x), plain, x)


class MarkedLayerNorm(_Marking, torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` (same parameters and names) that marks its outputs."""


class MarkedRMSNorm(_Marking, torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (same parameters and names) that marks its outputs."""
