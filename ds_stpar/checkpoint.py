"""Layout-independent checkpoints: save under one layout and world size, resume under another.

Format: Megatron-core's ``dist_checkpointing`` (its ``torch_dist`` backend, i.e.
torch.distributed.checkpoint files), so no format of our own. Every local tensor of the home
model is cut into the boxes :func:`~ds_stpar.seqbucket.shards.rank_pieces` says it holds
(a TP shard, both halves of a GLU fc1 shard, a replicated norm, ...) and each box becomes a
``ShardedTensor`` at its global offset in the full tensor; of the ranks holding one box only
the lowest saves it (``replica_id`` 0). Loading asks for the boxes of the *new* layout, and
``dist_checkpointing`` reads whatever parts of the saved boxes cover them.

Saved, per parameter (global name ``model.<name>``): the fp32 master weight; per optimizer
state tensor (AdamW: ``optim.exp_avg.<name>``, ``optim.exp_avg_sq.<name>``) its fp32 value,
whatever ZeRO stage partitioned it (:mod:`~ds_stpar.integrations.deepspeed` reads the full
local shard). Common state (rank 0, ``common.pt``): the step, the sampler's state (so the data
order continues exactly), the optimizer's step counter and per-group settings (lr, betas: a
scheduler's own state does not restore the lr in use), the LR scheduler, the full parameter
shapes (checked on load) and where it was saved from. Dropout RNG streams are not saved: with
dropout > 0 a resumed run (under any layout) draws different masks.

Atomicity: a checkpoint is written into ``<root>/.tmp-step-N``, renamed to ``<root>/step-N``
when every rank has finished, and only then does ``<root>/latest`` (replaced atomically) name
it. A run killed at any moment leaves the previous ``latest`` intact; a half-written
temporary folder is ignored and overwritten.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ds_stpar.errors import ConfigError
from ds_stpar.integrations import deepspeed as ds
from ds_stpar.seqbucket.runner import BucketRunner
from ds_stpar.seqbucket.sampler import BucketSampler
from ds_stpar.seqbucket.shards import ParamSpec, Placement, rank_pieces, regions

FORMAT = "ds_stpar-checkpoint-1"
LATEST = "latest"


def _rank_offsets(box, shape, name: str) -> list[tuple[int, int, int]]:
    """Megatron's ``(axis, offset, fragments)`` for a box on a regular grid of the full tensor."""
    offsets = []
    for axis, ((a, b), n) in enumerate(zip(box, shape)):
        size = b - a
        if size == n:
            continue
        if a % size or n % size:
            raise ConfigError(f"{name}: box {box} is not on a regular grid of {shape}")
        offsets.append((axis, a // size, n // size))
    return offsets


def _sharded(key: str, local: torch.Tensor, spec: ParamSpec, placement: Placement, rank: int):
    """``ShardedTensor`` s of the boxes ``rank`` holds, with views into ``local``."""
    from megatron.core.dist_checkpointing import ShardedTensor

    holders = regions(spec, placement)
    out = []
    for piece in rank_pieces(spec, placement, rank):
        data = local[piece.local_slices(piece.box)]
        replica = 0 if holders[piece.box][0] == rank else 1
        out.append(
            ShardedTensor.from_rank_offsets(
                key, data, *_rank_offsets(piece.box, spec.shape, key), replica_id=replica
            )
        )
    return out


def _sharded_state(runner: BucketRunner, tensors: dict[str, dict[str, torch.Tensor]]) -> dict:
    """``{"model.<name>#k": ShardedTensor}`` for every kind of tensor in ``tensors``
    (``{"model": {name: local}, "optim.exp_avg": {...}, ...}``)."""
    placement = runner.planner.placement(runner.home_key)
    rank = dist.get_rank()
    state = {}
    for kind, by_name in tensors.items():
        for name, local in by_name.items():
            key = f"{kind}.{name}"
            for k, sh in enumerate(_sharded(key, local, runner.specs[name], placement, rank)):
                state[f"{key}#{k}"] = sh
    return state


def _barrier() -> None:
    dist.barrier()


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    runner: BucketRunner,
    sampler: BucketSampler,
    extra: dict | None = None,
) -> Path:
    """Save the home model's master weights, optimizer state and the data position after
    ``step`` optimizer steps into ``root/step-<step>`` and point ``root/latest`` at it.
    Collective over the world."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    final, tmp = root / f"step-{step:08d}", root / f".tmp-step-{step:08d}"
    engine = runner.engine
    params = runner.home.params
    keys = ds.optimizer_state_keys(engine)
    tensors = {"model": {n: ds.get_fp32_param(p).contiguous() for n, p in params.items()}}
    for key in keys:
        tensors[f"optim.{key}"] = {
            n: ds.get_optimizer_state(engine, p, key).contiguous() for n, p in params.items()
        }
    state = _sharded_state(runner, tensors)
    scheduler = getattr(engine, "lr_scheduler", None)
    state["common"] = {
        "format": FORMAT,
        "step": step,
        "sampler": sampler.state_dict(),
        "optimizer_keys": keys,
        "optimizer_step": ds.optimizer_step_count(engine),
        "optimizer_hyperparameters": ds.optimizer_hyperparameters(engine),
        "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
        "global_samples": engine.global_samples,
        "shapes": {n: list(s.shape) for n, s in runner.specs.items()},
        "saved_under": {
            "layout": runner.home_key.layout.to_dict(),
            "world_size": dist.get_world_size(),
        },
        "extra": extra or {},
    }
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dist_checkpointing.save(state, str(tmp))
    _barrier()
    if dist.get_rank() == 0:
        old = root / f".old-step-{step:08d}"  # re-saving a step (resumed from an earlier one)
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        pointer = root / f".{LATEST}.tmp"
        pointer.write_text(final.name + "\n", encoding="utf-8")
        os.replace(pointer, root / LATEST)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder, or a root holding ``latest``; ConfigError otherwise."""
    path = Path(path)
    if (path / LATEST).is_file():
        path = path / (path / LATEST).read_text(encoding="utf-8").strip()
    if not (path / "metadata.json").is_file():
        raise ConfigError(
            f"{path}: no checkpoint here (no 'latest' file and no metadata.json); pass the "
            "--save folder of an earlier run or one of its step-N folders"
        )
    return path


def load_checkpoint(path: str | os.PathLike, runner: BucketRunner, sampler: BucketSampler) -> dict:
    """Load a checkpoint saved under any layout into ``runner``'s home model and optimizer
    and ``sampler``; returns its common state (``step``, ``extra``, ...). Collective."""
    from megatron.core import dist_checkpointing

    path = resolve_checkpoint(path)
    common = dist_checkpointing.load_common_state_dict(str(path))["common"]
    if common.get("format") != FORMAT:
        raise ConfigError(f"{path}: not a ds_stpar checkpoint (format {common.get('format')!r})")
    shapes = {n: list(s.shape) for n, s in runner.specs.items()}
    if common["shapes"] != shapes:
        diff = sorted(set(common["shapes"].items()) ^ set(shapes.items()), key=str)
        raise ConfigError(
            f"{path}: saved for a different model (first difference: {diff[:1]}); resume "
            "with the model of the saved run"
        )
    engine = runner.engine
    params = runner.home.params
    keys = common["optimizer_keys"]
    tensors = {"model": {n: torch.empty(p.shape, dtype=torch.float32) for n, p in params.items()}}
    for key in keys:
        tensors[f"optim.{key}"] = {
            n: torch.empty(p.shape, dtype=torch.float32) for n, p in params.items()
        }
    sharded = _sharded_state(runner, tensors)
    loaded = dist_checkpointing.load(sharded, str(path))
    placement = runner.planner.placement(runner.home_key)
    rank = dist.get_rank()
    for kind, by_name in tensors.items():
        for name, local in by_name.items():
            pieces = rank_pieces(runner.specs[name], placement, rank)
            for k, piece in enumerate(pieces):
                local[piece.local_slices(piece.box)] = loaded[f"{kind}.{name}#{k}"]
    for name, param in params.items():
        ds.set_fp32_param(param, tensors["model"][name])
    if keys:
        ds.prepare_optimizer_state(engine, keys, common["optimizer_step"])
        for key in keys:
            for name, param in params.items():
                ds.set_optimizer_state(engine, param, key, tensors[f"optim.{key}"][name])
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and common["lr_scheduler"] is not None:
        scheduler.load_state_dict(common["lr_scheduler"])
    ds.set_optimizer_hyperparameters(engine, common["optimizer_hyperparameters"])
    engine.global_steps = common["step"]
    engine.global_samples = common["global_samples"]
    sampler.load_state_dict(common["sampler"])
    runner.weights_changed()
    return common
