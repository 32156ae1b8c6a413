"""The norm recipe (``layers/norm_recipe.py``): the spec's norms mark their outputs, and the
ring's column passes and the local GEMMs keep the norm's input instead, making the output
again in their backward.

What is compared: every pass handed a marked norm output against the same pass handed an
unmarked copy of it, on the same ranks and inputs. The forward is the same computation and
the backward's remade output is the forward's bit for bit (same kernel, input and weights),
so outputs and all gradients must be *equal*, not close; with a LayerNorm and an RMSNorm whose
weights are random, not torch's defaults. What each pass keeps is read off
``torch.autograd.graph.saved_tensors_hooks``: the norm's output never, its input instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_stpar.layers.local import local_linear
from ds_stpar.layers.norm_recipe import MarkedLayerNorm, MarkedRMSNorm, recipe_of
from ds_stpar.layers.ring import ring_column_linear
from ds_stpar.layers.ring_mlp import ring_mlp, ring_two_pass_mlp
from ds_stpar.layers.wgrad import SharedWeightGrad
from tests.distributed import run_workers

H, ROWS = 16, 6  # hidden, rows per rank


def test_marks_only_what_a_recompute_can_repeat() -> None:
    torch.manual_seed(0)
    norm = MarkedRMSNorm(H)
    x = torch.randn(ROWS, 1, H, requires_grad=True)
    out = norm(x)
    recipe = recipe_of(out)
    assert recipe is not None and recipe.input is x
    assert torch.equal(recipe.make(), out)
    assert [name for name, _ in norm.named_parameters()] == ["weight"]  # torch's own names
    out.mul_(2)  # written after the norm: no longer the recipe's output
    assert recipe_of(out) is None
    with torch.no_grad():  # a checkpoint's first forward, inference
        assert recipe_of(norm(x)) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert recipe_of(norm(x)) is None
    assert recipe_of(x) is None


def _saved(fn, *args):
    """fn(*args) and the storages its graph keeps."""
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = fn(*args)
    return out, {t.untyped_storage().data_ptr() for t in kept}


def _worker(rank: int, world: int) -> None:
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(ROWS, 1, H, generator=gen)
    w1 = torch.randn(4 * H // world, H, generator=gen)
    w2 = torch.randn(H, 4 * H // world, generator=gen)
    dy_col = torch.randn(world * ROWS, 1, 4 * H // world, generator=gen)
    dy = torch.randn(ROWS, 1, H, generator=gen)
    passes = {
        "column": (lambda t, a, b: ring_column_linear(t, a, group), dy_col),
        "two passes": (lambda t, a, b: ring_two_pass_mlp(t, a, None, b, F.gelu, group), dy),
        "fused": (lambda t, a, b: ring_mlp(t, a, None, b, F.gelu, group, min_piece_flop=0), dy),
        "local": (
            lambda t, a, b: local_linear(t, a, SharedWeightGrad(a, None)),
            torch.randn(ROWS, 1, 4 * H // world, generator=gen),
        ),
    }
    for norm in (MarkedLayerNorm(H), MarkedRMSNorm(H)):
        with torch.no_grad():  # weights a remake must use, not the defaults 1 and 0
            for param in norm.parameters():
                param.copy_(torch.randn(param.shape, generator=gen))
        for name, (run, grad) in passes.items():
            results = []
            for marked in (True, False):
                leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
                normed = norm(leaves[0])
                if not marked:
                    normed = normed + 0  # the same values, unmarked
                assert (recipe_of(normed) is not None) == marked
                out, kept = _saved(run, normed, leaves[1], leaves[2])
                assert (normed.untyped_storage().data_ptr() in kept) != marked, name
                if marked:  # the norm's input instead
                    assert leaves[0].untyped_storage().data_ptr() in kept, name
                out.backward(grad)
                grads = [p.grad.clone() for p in norm.parameters()]
                results.append([out.detach(), *(t.grad for t in leaves), *grads])
                norm.zero_grad()
            for got, want in zip(*results, strict=True):
                if want is not None:
                    assert torch.equal(got, want), (type(norm).__name__, name)


def test_marked_inputs_give_the_same_result_keeping_the_norm_input() -> None:
    run_workers(_worker, 2)
