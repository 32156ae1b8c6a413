"""The runner: one mini-batch's gradient is the same under one device, static layouts and
hot switching (DeepSpeed ZeRO 0/1/2; Cannon buckets with a Megatron-mode home, for
megatron-core GPT and for an HF GPT-2 through HFBucketRunner), and a 20-step switching run
follows a static run.

Reference: a float64 single-device copy of the same weights (gathered from the home shards
through the sharding descriptors, independent of the switch), run on every document piece of
the mini-batch ALONE (no packing, positions from 0, its own next-token labels), summed and
divided by the mini-batch's target count.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_stpar.config import Bucket, Layout, ModelSpec, StparConfig, Strategy, TrainSpec
from tests.distributed import run_workers

TINY = ModelSpec("tiny", 2, 64, 4, vocab_size=258, max_position_embeddings=256, dropout=0.0)
UNTIED = dataclasses.replace(TINY, tied_embeddings=False)
EDGES = (64, 128, 256)
DP2, TP2, RING2 = Layout(dp=2), Layout(tp=2), Layout(tp=2, tp_mode="ring")
DP4, TP4, CANNON4 = Layout(dp=4), Layout(tp=4), Layout(tp=4, tp_mode="cannon")  # 2x2 torus
PP2, PP4, RING2_PP2 = Layout(pp=2), Layout(pp=4), Layout(tp=2, pp=2, tp_mode="ring")
DP2_PP2 = Layout(dp=2, pp=2)


def _config(
    layouts, zero=0, mb=2, model=TINY, global_batch=8, edges=EDGES, recompute=None
) -> StparConfig:
    edges = edges[: len(layouts)]
    recompute = recompute or ("none",) * len(layouts)
    buckets = tuple(
        Bucket(edge, Strategy(layout, micro_batch=mb, zero=zero, recompute=rc))
        for edge, layout, rc in zip(edges, layouts, recompute)
    )
    return StparConfig(model, TrainSpec(edges[-1], global_batch, "fp32"), buckets, gpus_per_node=2)


def _ds_config(zero: int, lr: float = 1e-3) -> dict:
    return {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": zero, "overlap_comm": zero >= 1, "reduce_scatter": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.0, "torch_adam": True},
        },
        "steps_per_print": 1 << 30,
    }


def _documents():
    """~120 short standard-library files (< 1500 bytes each), byte-level ids."""
    from datasets import Dataset

    from ds_stpar.seqbucket.corpus import stdlib_documents
    from ds_stpar.seqbucket.data import Documents
    from ds_stpar.seqbucket.tokenize import ByteTokenizer, tokenize_dataset

    texts = [d["text"] for d in stdlib_documents(max_files=600) if len(d["text"].encode()) < 1500]
    return Documents(tokenize_dataset(Dataset.from_dict({"text": texts}), ByteTokenizer()))


def _full_plan(sampler):
    """The first mini-batch with pieces in every bucket."""
    return next(
        p
        for p in map(sampler.plan, range(len(sampler)))
        if all(b.num_micro_batches for b in p.buckets)
    )


def _setup(cfg: StparConfig, ds: dict, cache, docs, seed: int = 0):
    from ds_stpar.integrations.deepspeed import build_engine, engine_config
    from ds_stpar.seqbucket.runner import BucketRunner, build_layout_models, model_key, padded_vocab
    from ds_stpar.seqbucket.tokenize import BYTE_PAD_ID

    strategies = [b.strategy for b in cfg.buckets]
    model = dataclasses.replace(
        cfg.model, vocab_size=padded_vocab(cfg.model.vocab_size, strategies)
    )
    models = build_layout_models(model, strategies, cfg.home, cache, "fp32", seed)
    home = models[model_key(cfg.home)]
    engine = build_engine(home.module, engine_config(ds, cfg), home.groups)
    tied = model.tied_embeddings
    runner = BucketRunner(engine, models, cfg.home, docs.__getitem__, BYTE_PAD_ID, tied, 2)
    return model, runner


def _self_groups(cache, rank):
    from ds_stpar.parallel import LayoutGroups

    me = cache.get(Layout(dp=dist.get_world_size())).self_group
    return LayoutGroups(Layout(), rank, 0, 0, 0, me, me, me, (rank,), (rank,), (rank,), me)


def _gather_full(local: dict, runner) -> dict:
    """Full tensors from this layout's local shards: all-gather (a rank whose pipeline stage
    holds no piece of a parameter sends zeros), then place every rank's pieces by the
    sharding descriptors (shards.rank_pieces)."""
    from ds_stpar.seqbucket.shards import local_shape, rank_pieces

    placement = runner.planner.placement(runner.home_key)
    layout = runner.home_key.layout
    out = {}
    for name in sorted(runner.specs):
        spec = runner.specs[name]
        mine = local.get(name)
        if mine is None:
            mine = torch.zeros(local_shape(spec, layout), dtype=torch.float32)
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine.contiguous())
        full = torch.empty(spec.shape, dtype=mine.dtype)
        for r, part in enumerate(parts):
            for piece in rank_pieces(spec, placement, r):
                full[tuple(slice(a, b) for a, b in piece.box)] = part[piece.local_slices(piece.box)]
        out[name] = full
    return out


def _reference(ref: torch.nn.Module, forward, weights: dict, plan, docs):
    """float64 loss and full gradients of the mini-batch, one document piece at a time:
    ``ref`` (a single-device model) loaded with ``weights``; ``forward(ref, ids, positions)``
    -> logits ``[1, s, V]``. ``ref`` is converted to float64 in place."""
    ref = ref.double()
    with torch.no_grad():
        for name, param in ref.named_parameters():
            param.copy_(weights[name])
    total = torch.zeros((), dtype=torch.float64)
    for bucket in plan.buckets:
        for rank_mbs in bucket.ranks:
            for mb in rank_mbs:
                for row in mb.rows:
                    for p in row.pieces:
                        doc = torch.from_numpy(docs[p.doc].astype(np.int64))
                        ids = doc[p.start : p.start + p.length][None]
                        labels = torch.full((1, p.length), -100)
                        labels[0, : p.num_targets] = doc[p.start + 1 : p.start + 1 + p.num_targets]
                        logits = forward(ref, ids, torch.arange(p.length)[None])
                        total = total + F.cross_entropy(
                            logits[0], labels[0], ignore_index=-100, reduction="sum"
                        )
    loss = total / plan.num_targets
    loss.backward()
    return loss.item(), {n: p.grad for n, p in ref.named_parameters()}


def _megatron_reference(model: ModelSpec, weights: dict, plan, docs, cache, rank):
    from ds_stpar.integrations.megatron import build_gpt

    ref = build_gpt(model, Strategy(Layout()), _self_groups(cache, rank), dtype="fp32")
    return _reference(ref, lambda m, ids, pos: m(ids, pos, None), weights, plan, docs)


def _home_grads(runner) -> dict:
    from deepspeed.utils import safe_get_full_grad

    grads = {n: safe_get_full_grad(p).detach().float() for n, p in runner.home.params.items()}
    return runner.home.described(grads)


def _check_tied_copies_agree(what: str, runner) -> None:
    """A pipelined home's tied embedding: the first and the last stage's copies hold the same
    gradient (bit for bit: one all-reduced sum), which _compare checked against the
    reference through one of them."""
    from deepspeed.utils import safe_get_full_grad

    tied = runner.tied
    if tied.param is None:  # a middle stage
        return
    mine = safe_get_full_grad(tied.param).detach().float()
    other = [torch.empty_like(mine) for _ in range(dist.get_world_size(tied.group))]
    dist.all_gather(other, mine.contiguous(), group=tied.group)
    assert torch.equal(other[0], other[1]), what
    assert mine.abs().max() > 0, what


def _compare(what: str, runner, stats, plan, ref_loss: float, ref_grads: dict) -> None:
    grads = _gather_full(_home_grads(runner), runner)
    # fp32 against float64: the loss is a mean of ~1000-2000 token losses from fp32 logits;
    # measured relative error 2-3e-8, so 1e-6 leaves a 30x margin.
    assert math.isclose(stats.loss, ref_loss, rel_tol=1e-6), (what, stats.loss, ref_loss)
    assert grads.keys() == ref_grads.keys(), what
    for name, ref in ref_grads.items():
        # Gradients: fp32 sums over ~1000-2000 tokens and 32-256 features; elementwise
        # relative error is unbounded near zero (cancellation), so the tolerance is scaled by
        # the tensor's largest entry. Measured worst: 9e-7 of it; the bound
        # |g - g_ref| <= 1e-5 * max|g_ref| leaves a 10x margin and still catches a token
        # counted twice or lost (~1/2000 = 5e-4 of the gradient).
        scale = ref.abs().max().item()
        torch.testing.assert_close(
            grads[name].double(), ref, rtol=0, atol=1e-5 * scale, msg=f"{what}: {name}"
        )
    # weights in and gradients out: once each per non-home layout (dp2,dp2 share a model)
    home = runner.home_key.layout
    away = {b.strategy.layout for b in plan.buckets if b.strategy.layout != home}
    assert stats.switches == 2 * len(away), (what, stats.switches)


def _check_against_reference(
    what, cfg, model, runner, docs, cache, rank, tokens, grad_norm: bool = False
) -> None:
    """One mini-batch holding every bucket, accumulated by ``runner``: its loss and home
    gradients against the float64 megatron-core reference on the same weights; with
    ``grad_norm``, also the global gradient norm DeepSpeed computes in its step (summed over
    DP, TP and pipeline stages through the mpu); then the engine is released."""
    from ds_stpar.seqbucket.sampler import BucketSampler

    plan = _full_plan(BucketSampler(docs.lengths, cfg.buckets, tokens, seed=2))
    weights = _gather_full({n: p.detach() for n, p in runner.home.params.items()}, runner)
    stats = runner.accumulate(plan)
    # between steps no other layout's model nor the carry holds memory
    assert runner.carry is None, what
    for away in runner.away.values():
        assert not away.grads, what
        assert all(p.untyped_storage().nbytes() == 0 for p in away.params.values()), what
    ref_loss, ref_grads = _megatron_reference(model, weights, plan, docs, cache, rank)
    _compare(what, runner, stats, plan, ref_loss, ref_grads)
    if runner.tied is not None:
        _check_tied_copies_agree(what, runner)
    if grad_norm:
        runner.engine.step()
        ref_norm = math.sqrt(sum(g.pow(2).sum().item() for g in ref_grads.values()))
        # fp32 sums of ~1e4-1e5 squared entries against float64: 1e-5 relative is ~100x
        # their rounding; a stage or TP rank left out of the sum moves it by far more
        norm = runner.engine.get_global_grad_norm()
        assert math.isclose(float(norm), ref_norm, rel_tol=1e-5), (what, norm, ref_norm)
    runner.engine.destroy()


def _check_gradients(rank: int, world: int) -> None:
    from ds_stpar.parallel import GroupCache

    docs = _documents()
    cache = GroupCache()
    cases = [
        ("dp2 static, ZeRO 1", (DP2, DP2, DP2), 1),
        ("tp2 static, ZeRO 1", (TP2, TP2, TP2), 1),
        ("dp2,dp2 -> tp2 switching, ZeRO 0", (DP2, DP2, TP2), 0),
        ("ring2,tp2 -> dp2 switching, ZeRO 2", (RING2, TP2, DP2), 2),
        ("dp2,tp2 -> tp2 ring switching, ZeRO 1", (DP2, TP2, RING2), 1),
        ("pp2 static, ZeRO 1", (PP2, PP2, PP2), 1, UNTIED),
        ("dp2,tp2 -> pp2 switching, ZeRO 0", (DP2, TP2, PP2), 0, UNTIED),
        ("pp2 (tied LM head on stage 1) -> dp2 switching, ZeRO 2", (PP2, PP2, DP2), 2),
        ("pp2 static, tied embedding on both stages, ZeRO 1", (PP2, PP2, PP2), 1, TINY, True),
        ("dp2,tp2 -> pp2 home with a tied embedding, ZeRO 0", (DP2, TP2, PP2), 0, TINY),
    ]
    for what, layouts, zero, *rest in cases:
        cfg = _config(layouts, zero, model=rest[0] if rest else TINY)
        model, runner = _setup(cfg, _ds_config(zero), cache, docs)
        norm = bool(rest[1:])
        _check_against_reference(what, cfg, model, runner, docs, cache, rank, 2048, norm)
    _check_recompute_shares_the_home_model(docs, cache, rank)


def _check_recompute_shares_the_home_model(docs, cache, rank: int) -> None:
    """Buckets that differ only in full recompute run on one model, each with its own
    recompute (read by megatron-core's block at every forward), and the gradient is the
    reference's."""

    what = "dp2 short without recompute, dp2 home with full recompute: one model, ZeRO 1"
    cfg = _config((DP2, DP2, DP2), 1, recompute=("none", "full", "full"))
    model, runner = _setup(cfg, _ds_config(1), cache, docs)
    assert len(runner.models) == 1  # no second model, nothing to switch
    seen = []
    block = runner.home.module.decoder
    block.register_forward_pre_hook(lambda m, a: seen.append(m.config.recompute_granularity))
    _check_against_reference(what, cfg, model, runner, docs, cache, rank, 2048)
    assert set(seen) == {None, "full"}, seen  # each bucket ran with its own recompute


def _losses(cfg, ds, cache, docs, steps):
    from ds_stpar.seqbucket.sampler import BucketSampler

    _, runner = _setup(cfg, ds, cache, docs, seed=5)
    sampler = BucketSampler(docs.lengths, cfg.buckets, 1024, seed=11)
    out = []
    for plan, _ in zip(sampler, range(steps)):
        stats = runner.step(plan)
        out.append((plan.index, stats.loss, stats.switches))
    runner.engine.destroy()
    return out


def _check_golden_losses(rank: int, world: int) -> None:
    from ds_stpar.parallel import GroupCache

    docs, cache = _documents(), GroupCache()
    static = _losses(_config((DP2, DP2, DP2), 0), _ds_config(0), cache, docs, 20)
    switching = _losses(_config((DP2, DP2, TP2), 1), _ds_config(1), cache, docs, 20)
    assert [i for i, _, _ in static] == [i for i, _, _ in switching] == list(range(20))
    assert all(s == 0 for _, _, s in static)
    assert sum(s > 0 for _, _, s in switching) >= 10  # most steps switch layouts
    a, b = (np.array([loss for _, loss, _ in run]) for run in (static, switching))
    assert a[-1] < a[0] - 0.5, a  # it learns
    # Same initial weights (CPU initialisation depends on the seed only), same data; the
    # runs differ in fp32 rounding (reduction order across layouts), which AdamW carries
    # forward. Measured: at most 2e-7 relative over 20 steps; 1e-5 leaves a 50x margin
    # (a lost or doubled micro-batch moves a step's loss by >1e-2).
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=0)


def _check_all(rank: int, world: int) -> None:
    import os

    os.environ["LOCAL_RANK"] = str(rank)  # what a launcher sets; DeepSpeed requires it
    _check_gradients(rank, world)
    _check_golden_losses(rank, world)


@pytest.mark.dist
def test_gradient_invariance_and_golden_losses():
    """One launch of 2 workers: gradients of one mini-batch against the float64 reference
    under static layouts and switching (ZeRO 0/1/2, Megatron and ring TP), then 20 steps of a
    switching run against a static run."""
    run_workers(_check_all, 2)


def _gpt2():
    """A tiny random GPT-2 over byte ids: fused c_attn (column of partition stride 3), Conv1D
    weights, learned positions."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=TINY.vocab_size,
        n_embd=32,
        n_head=4,
        n_layer=2,
        n_positions=128,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def _check_cannon_buckets(rank: int, world: int) -> None:
    """A Cannon bucket (tp4 as a 2x2 torus) switched from and to a Megatron-mode tp4 home
    (whose layers carry no Cannon marks): megatron-core GPT, and HF GPT-2 (c_attn: a fused
    projection, partition stride 3), also with a tp=1 layout that keeps GPT-2's Conv1D
    weights [in, out] on either side of the switch."""
    import os

    from ds_stpar.integrations.deepspeed import build_engine, engine_config, prepare_cpu
    from ds_stpar.parallel import GroupCache
    from ds_stpar.seqbucket.sampler import BucketSampler
    from ds_stpar.seqbucket.tokenize import BYTE_PAD_ID

    os.environ["LOCAL_RANK"] = str(rank)
    prepare_cpu()  # before transformers imports deepspeed
    from ds_stpar.integrations.hf_trainer import HFBucketRunner, build_hf_layout_models
    from ds_stpar.seqbucket.runner import model_key

    docs, cache, cpu = _documents(), GroupCache(), torch.device("cpu")
    edges = (64, 128)

    what = "cannon4 -> tp4 (megatron home), ZeRO 1"
    cfg = _config((CANNON4, TP4), 1, edges=edges)
    model, runner = _setup(cfg, _ds_config(1), cache, docs)
    assert runner.specs["decoder.layers.0.mlp.linear_fc1.weight"].cannon_blocks
    _check_against_reference(what, cfg, model, runner, docs, cache, rank, 1024)
    _check_pipelines(docs, cache, rank, edges)

    # HF: descriptors in the parallel layers' [out, in]; GPT-2's Conv1D stores [in, out],
    # and a tp=1 layout keeps it (switched through transposed views)
    spec = dataclasses.replace(TINY, hidden_size=32, max_position_embeddings=128)

    def forward(module, ids, positions):
        return module(input_ids=ids, position_ids=positions, use_cache=False).logits

    conv1d = {f"{n}.weight" for n, m in _gpt2().named_modules() if type(m).__name__ == "Conv1D"}

    def transpose_conv1d(tensors: dict) -> dict:
        return {n: t.t() if n in conv1d else t for n, t in tensors.items()}

    for what, layouts in (
        ("HF GPT-2 cannon4 -> tp4 (megatron home), ZeRO 1", (CANNON4, TP4)),
        ("HF GPT-2 dp4 (Conv1D kept) -> tp4 (megatron home), ZeRO 1", (DP4, TP4)),
        ("HF GPT-2 cannon4 -> dp4 (Conv1D home), ZeRO 1", (CANNON4, DP4)),
    ):
        print("CASE", rank, what, flush=True)
        base = _gpt2()  # the same weights every time (seeded); _reference makes it float64
        cfg = _config(layouts, 1, model=spec, edges=edges)
        models = build_hf_layout_models(copy.deepcopy(base), cfg, cache, cpu, torch.float32)
        for key, layout_model in models.items():  # tp=1 keeps the Conv1D weights
            assert layout_model.transposed == (conv1d if key.layout.tp == 1 else set()), what
        home = models[model_key(cfg.home)]
        engine = build_engine(home.module, engine_config(_ds_config(1), cfg), home.groups)
        runner = HFBucketRunner(engine, models, cfg.home, docs.__getitem__, BYTE_PAD_ID, 2)
        assert runner.specs["transformer.h.0.attn.c_attn.weight"].partition_stride == 3
        plan = _full_plan(BucketSampler(docs.lengths, cfg.buckets, 1024, seed=2))
        local = home.described({n: p.detach() for n, p in home.params.items()})
        weights = _gather_full(local, runner)
        stats = runner.accumulate(plan)
        ref_loss, ref_grads = _reference(base, forward, transpose_conv1d(weights), plan, docs)
        _compare(what, runner, stats, plan, ref_loss, transpose_conv1d(ref_grads))
        runner.engine.destroy()


def _check_pipelines(docs, cache, rank: int, edges) -> None:
    """Pipelined homes on 4 ranks: TP ring x PP (the hidden state crosses stages split by
    sequence parallelism) and PP4 over 4 layers (1F1B warm-up of 3 forwards on stage 0),
    untied and tied (the two middle stages hold no copy of the embedding), and DP2 x PP2 tied
    (each pipeline sums its own two copies, then DeepSpeed averages over DP)."""
    four = dataclasses.replace(UNTIED, num_layers=4)
    tied_four = dataclasses.replace(TINY, num_layers=4)
    for what, layouts, model, zero in (
        ("dp4 -> tp2 ring x pp2 home, ZeRO 1", (DP4, RING2_PP2), UNTIED, 1),
        ("dp4 -> pp4 home, 4 layers, ZeRO 2", (DP4, PP4), four, 2),
        ("dp4 -> pp4 home, 4 layers, tied embedding, ZeRO 2", (DP4, PP4), tied_four, 2),
        ("dp4 -> dp2 x pp2 home, tied embedding, ZeRO 1", (DP4, DP2_PP2), TINY, 1),
    ):
        cfg = _config(layouts, zero, model=model, edges=edges)
        model, runner = _setup(cfg, _ds_config(zero), cache, docs)
        _check_against_reference(what, cfg, model, runner, docs, cache, rank, 1024, True)


@pytest.mark.dist
def test_cannon_buckets():
    """One launch of 4 workers: gradients of one mini-batch with a Cannon bucket and a
    Megatron-mode tp4 home against the float64 reference (megatron-core GPT; HF GPT-2)."""
    run_workers(_check_cannon_buckets, 4)


def test_away_model_storage_is_held_only_between_acquire_and_release():
    from ds_stpar.errors import ConfigError
    from ds_stpar.seqbucket.runner import _AwayModel

    params = {"w": torch.nn.Parameter(torch.ones(3, 4)), "b": torch.nn.Parameter(torch.ones(4))}
    away = _AwayModel(params)
    assert all(p.untyped_storage().nbytes() == 0 for p in params.values())  # released at once
    away.acquire()
    assert params["w"].untyped_storage().nbytes() == 3 * 4 * 4  # fp32: its own bytes again
    assert {n: g.dtype for n, g in away.grads.items()} == {"w": torch.float32, "b": torch.float32}
    (params["w"].sum() * 2).backward()  # the hook moves .grad into the fp32 accumulator
    assert params["w"].grad is None and torch.equal(away.grads["w"], torch.full((3, 4), 2.0))
    away.release_weights()
    away.release_grads()
    assert params["w"].untyped_storage().nbytes() == 0 and away.grads == {}
    # a parameter viewing another tensor's storage cannot be released alone: refused by name
    base = torch.zeros(8)
    with pytest.raises(ConfigError, match=r"\['v'\] share storage"):
        _AwayModel({"v": torch.nn.Parameter(base[:4])})
