"""Where a TP group's ranks go: one placement-group bundle per rank, ranks numbered node by node.

Ray chooses the node of each bundle (PACK: as few nodes as the free resources allow; STRICT_PACK
when the group must stay on one node). corelaunch then numbers the ranks so that each node's ranks
are contiguous, the node holding the most ranks first: rank 0 (the rendezvous host) sits with the
largest co-located set, and `node_groups` like [[0, 1], [2, 3]] let co-located ranks use their
fast path while only node-to-node traffic goes through gloo.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    address: str
    total: dict[str, float]
    free: dict[str, float]

    @property
    def name(self) -> str:
        return f"node {self.address} ({self.node_id[:8]})"


def placement_strategy(nodes: int) -> str:
    """STRICT_PACK when the group must fit one node (--nodes 1, or a group of one rank); a group over
    several nodes reserves a bundle a node (STRICT_SPREAD, launcher/cluster/tp_group.py) and never
    asks this, but for TP 1, whose one bundle takes any node (PACK)."""
    return "STRICT_PACK" if nodes == 1 else "PACK"



def rank_order(bundle_nodes: dict[int, str]) -> list[int]:
    """The bundle index of each rank: ranks grouped by node, nodes holding more bundles first (ties:
    the node of the lower bundle index), bundles in index order within a node.

    >>> rank_order({0: "a", 1: "b", 2: "a", 3: "b"})
    [0, 2, 1, 3]
    """
    by_node: dict[str, list[int]] = {}
    for index in sorted(bundle_nodes):
        by_node.setdefault(bundle_nodes[index], []).append(index)
    groups = sorted(by_node.values(), key=lambda g: (-len(g), g[0]))
    return [index for group in groups for index in group]


def bundle_nodes(pg) -> dict[int, str]:
    """Node id of each bundle of a ready placement group."""
    from ray.util.placement_group import placement_group_table

    table = placement_group_table(pg)
    return {int(index): node for index, node in table.get("bundles_to_node_id", {}).items()}


def alive_nodes() -> list[NodeInfo]:
    """The cluster's alive nodes with their total and (best effort) free resources."""
    import ray

    free: dict | None = None
    try:  # per-node availability is not in Ray's public API; messages do without it
        from ray._private.state import available_resources_per_node

        free = available_resources_per_node()
    except Exception:  # noqa: BLE001 - only used to make error messages more precise
        free = None
    out = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        total = {k: float(v) for k, v in node.get("Resources", {}).items()}
        out.append(NodeInfo(node_id=node["NodeID"], address=node.get("NodeManagerAddress", "?"), total=total,
                            free=total if free is None else {k: float(v) for k, v in free.get(node["NodeID"], {}).items()}))
    return out
