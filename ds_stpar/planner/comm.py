"""Where a layout's groups sit on the machines, and what a collective over them costs.

Placement follows :class:`~ds_stpar.config.Layout`'s rank order (TP innermost, then PP, then
DP): ``rank = (dp_index * pp + pp_index) * tp + tp_index``, with ``gpus_per_node`` (G)
consecutive ranks per node.

- A TP group is ``tp`` consecutive ranks: inside one node when tp <= G and G % tp == 0.
- A DP group strides by ``tp * pp``: ``k = G // (tp * pp)`` members share a node (1 when the
  model replica fills whole nodes); it crosses nodes unless the world is one node.
- Pipeline stage ``i`` starts at rank ``(d * pp + i) * tp``; the boundary i -> i+1 crosses a
  node when some replica ``d`` has ``(d * pp + i + 1) * tp`` at a node edge.

Bandwidth (alpha-beta, nccl-tests bus-bandwidth convention, planner.md "Collectives"): a
group inside a node gets NVLink busbw (the profile's measured all-reduce busbw for its size
when there is one; all-gather and reduce-scatter reach about the same busbw). A group crossing nodes with ``k`` members per node runs hierarchically: its
inter-node phase moves ``1/k`` of the data per member over that member's own NIC, so its
busbw is ``min(NVLink, k x per-GPU network bandwidth)`` (k = 8 on a DGX: ~8 x 21 GB/s on
A100 with 8 x HDR). Point-to-point transfers across nodes get one NIC.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ds_stpar.config import ClusterSpec, Layout, Strategy

GB = 1e9


@dataclass(frozen=True)
class Link:
    """A group of ``n`` ranks with its bus bandwidth (bytes/s) and per-step latency (s)."""

    n: int
    busbw: float
    alpha: float

    def all_reduce(self, nbytes: float) -> float:
        """2(n-1) alpha + 2(n-1)/n S / B_bus."""
        if self.n == 1:
            return 0.0
        return 2 * (self.n - 1) * self.alpha + 2 * (self.n - 1) / self.n * nbytes / self.busbw

    def all_gather(self, nbytes: float) -> float:
        """(n-1) alpha + (n-1)/n S / B_bus; S is the gathered (full) size."""
        if self.n == 1:
            return 0.0
        return (self.n - 1) * self.alpha + (self.n - 1) / self.n * nbytes / self.busbw

    reduce_scatter = all_gather  # same volume and step count; S is the unreduced full size

    def p2p(self, nbytes: float) -> float:
        """alpha + S / B for one transfer between two ranks of the group."""
        return self.alpha + nbytes / self.busbw


@dataclass(frozen=True)
class Placement:
    """The links of one layout on one cluster (per collective where the profile differs)."""

    tp: Link
    tp_p2p: Link  # neighbour hops of ring / Cannon inside the TP group
    dp: Link
    pp_p2p: Link  # the slowest pipeline boundary
    tp_in_node: bool
    dp_in_node: bool
    pp_in_node: bool


def _intra_busbw(cluster: ClusterSpec, collective: str, n: int) -> float:
    measured = cluster.profile.bus_bandwidth(collective, n) if cluster.profile else None
    return (measured or cluster.gpu.nvlink_gbs) * GB


def _group_link(
    cluster: ClusterSpec, collective: str, n: int, per_node: int, in_node: bool
) -> Link:
    gpu = cluster.gpu
    intra = _intra_busbw(cluster, collective, min(n, max(per_node, 2)))
    if in_node:
        return Link(n, intra, gpu.intra_latency_us * 1e-6)
    return Link(n, min(intra, per_node * gpu.internode_gbs * GB), gpu.inter_latency_us * 1e-6)


@lru_cache(maxsize=4096)
def _pp_boundary_crosses(dp: int, tp: int, pp: int, node: int) -> bool:
    """Whether some pipeline boundary of some replica crosses a node edge."""
    if pp == 1:
        return False
    if tp >= node or node % tp:
        return True
    stages_per_node = node // tp
    return any(
        (d * pp + i + 1) % stages_per_node == 0
        for d in range(min(dp, stages_per_node))
        for i in range(pp - 1)
    )


def tp_in_node(layout: Layout, cluster: ClusterSpec) -> bool:
    node = cluster.node_size
    return layout.tp <= node and node % layout.tp == 0


def ring_copy_engines(layout: Layout, cluster: ClusterSpec, transport: str) -> bool:
    """Whether the GPUs' copy engines carry the ring linears' hops, as ``transport``
    (``DS_STPAR_RING_TRANSPORT``) picks them on the machines (``layers/symmetric.py``):
    ``symmetric-memory`` always, ``nccl`` never, ``auto`` for a TP group inside a node whose
    GPUs reach each other's memory (the profile's ``peer_copies``; nodes without a profile
    are taken to)."""
    if layout.tp < 2 or transport == "nccl":
        return False
    if transport == "symmetric-memory":
        return True
    peer = cluster.profile.peer_copies if cluster.profile is not None else True
    return tp_in_node(layout, cluster) and peer


def staged_transfers(strategy: Strategy, cluster: ClusterSpec, transport: str) -> bool:
    """Whether the GPUs' copy engines carry the ring layouts' transfers through host memory
    (the interleaved layer's, and the ring layers' hops: the fused ring MLP's, the ring
    linears'), as ``transport`` (``DS_STPAR_TRANSFER_TRANSPORT``) picks them on the machines
    (``layers/host_staged.py``, ``layers/comm.start_ring_hop``): only for a ring layout over
    more than one GPU with its TP group inside a node; ``host-staged`` always there,
    ``nccl`` never, ``auto`` where the node's GPUs do not reach each other's memory (the
    profile's ``peer_copies``; nodes without a profile are taken to). The emitted
    environment then allows more than one hardware queue, which the transport needs."""
    layout = strategy.layout
    if layout.tp < 2 or layout.tp_mode != "ring" or transport == "nccl":
        return False
    if not tp_in_node(layout, cluster):
        return False
    peer = cluster.profile.peer_copies if cluster.profile is not None else True
    return transport == "host-staged" or not peer


def placement(layout: Layout, cluster: ClusterSpec) -> Placement:
    """Links of the TP, DP and PP groups of ``layout`` on ``cluster``."""
    node = cluster.node_size
    t, p, d = layout.tp, layout.pp, layout.dp
    tp_local = tp_in_node(layout, cluster)
    tp_per_node = t if tp_local else max(1, node if t % node == 0 else 1)
    dp_local = layout.world_size <= node
    dp_per_node = d if dp_local else max(1, node // (t * p))
    pp_local = not _pp_boundary_crosses(d, t, p, node)
    gpu = cluster.gpu
    p2p_intra = _intra_busbw(cluster, "p2p", 2)
    tp_hop = Link(
        t,
        p2p_intra if tp_local else gpu.internode_gbs * GB,
        (gpu.intra_latency_us if tp_local else gpu.inter_latency_us) * 1e-6,
    )
    pp_hop = Link(
        p,
        p2p_intra if pp_local else gpu.internode_gbs * GB,
        (gpu.intra_latency_us if pp_local else gpu.inter_latency_us) * 1e-6,
    )
    return Placement(
        tp=_group_link(cluster, "all_reduce", t, tp_per_node, tp_local),
        tp_p2p=tp_hop,
        dp=_group_link(cluster, "all_reduce", d, dp_per_node, dp_local),
        pp_p2p=pp_hop,
        tp_in_node=tp_local,
        dp_in_node=dp_local,
        pp_in_node=pp_local,
    )
