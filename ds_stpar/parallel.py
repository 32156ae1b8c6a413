"""Process groups for several layouts over one world, built once and cached.

Hot switching runs different buckets under different :class:`~ds_stpar.config.Layout` s on
the same ranks, so every layout's groups must exist at once and be passed explicitly to the
layers (never read from a module global). ``torch.distributed.new_group`` is collective over
the whole world and must be called in the same order on every rank: :class:`GroupCache`
creates all TP, DP and PP groups of a layout, in a fixed order, the first time the layout is
asked for, on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ds_stpar.config import Layout
from ds_stpar.errors import ConfigError


@dataclass(frozen=True)
class LayoutGroups:
    """This rank's view of one layout: its coordinates and its three groups."""

    layout: Layout
    rank: int
    dp_index: int
    pp_index: int
    tp_index: int
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    pp_group: dist.ProcessGroup | None
    tp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    pp_ranks: tuple[int, ...]
    self_group: dist.ProcessGroup | None = None  # this rank alone (context parallel size 1)
    embd_group: dist.ProcessGroup | None = None  # first + last pipeline stage (tied embeddings)
    model_group: dist.ProcessGroup | None = None  # TP x PP: one model replica (Megatron's "mp")


class GroupCache:
    """Creates and caches the process groups of each layout used on this world."""

    def __init__(self) -> None:
        self._groups: dict[Layout, LayoutGroups] = {}
        self._by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def _group(self, ranks: list[int]) -> dist.ProcessGroup:
        key = tuple(ranks)
        if key not in self._by_ranks:
            whole = key == tuple(range(dist.get_world_size()))
            self._by_ranks[key] = dist.group.WORLD if whole else dist.new_group(ranks)
        return self._by_ranks[key]

    def get(self, layout: Layout) -> LayoutGroups:
        """This rank's groups for ``layout``; collective on first use of a layout."""
        if layout in self._groups:
            return self._groups[layout]
        world, rank = dist.get_world_size(), dist.get_rank()
        if layout.world_size != world:
            raise ConfigError(
                f"layout {layout.short()} needs {layout.world_size} ranks, the world has {world}"
            )
        mine: dict[str, tuple[dist.ProcessGroup, tuple[int, ...]]] = {}
        embd_groups = [[g[0], g[-1]] for g in layout.pp_groups()] if layout.pp > 1 else []
        replicas = [
            [layout.rank_of(d, p, t) for p in range(layout.pp) for t in range(layout.tp)]
            for d in range(layout.dp)
        ]
        for kind, all_groups in (
            ("tp", layout.tp_groups()),
            ("dp", layout.dp_groups()),
            ("pp", layout.pp_groups()),
            ("self", [[r] for r in range(world)]),
            ("embd", embd_groups),
            ("model", replicas),
        ):
            for ranks in all_groups:  # every rank creates every group, in the same order
                group = self._group(ranks)
                if rank in ranks:
                    mine[kind] = (group, tuple(ranks))
        dp_index, pp_index, tp_index = layout.coords(rank)
        groups = LayoutGroups(
            layout=layout,
            rank=rank,
            dp_index=dp_index,
            pp_index=pp_index,
            tp_index=tp_index,
            tp_group=mine["tp"][0],
            dp_group=mine["dp"][0],
            pp_group=mine["pp"][0],
            tp_ranks=mine["tp"][1],
            dp_ranks=mine["dp"][1],
            pp_ranks=mine["pp"][1],
            self_group=mine["self"][0],
            embd_group=mine["embd"][0] if "embd" in mine else None,
            model_group=mine["model"][0],
        )
        self._groups[layout] = groups
        return groups
