"""A cpu group over several nodes keeps to the ranks per node the plan counted (the planner gave each
node's RAM to ceil(TP / N) ranks). Each node's share is one bundle (resources.node_split: TP 3 over
2 nodes is 2 + 1) under STRICT_SPREAD; Ray's PACK, used before where N did not divide TP, filled the
roomiest node first (all of TP 3 on one node). launcher/cluster/tp_group.py still checks the
placement Ray reports, placing it again within --placement-timeout, then refusing it: here a fake
placement group reports the bundles on one node, which STRICT_SPREAD never does. A fake clock; no
Ray."""

from __future__ import annotations

import pytest

import launcher.cluster.tp_group as tg
from launcher.cluster.resources import RankResources
from launcher.errors import PlacementTimeout
from tests.test_placement_keeps_to_its_timeout import clock  # noqa: F401 - a fixture: time stood still

PLACEMENT_S = 5.0


@pytest.mark.parametrize("ranks_per_node, tp, nodes, expected", [
    ({"node-a": 3}, 3, 2, ("node-a", 3)),                 # all of TP 3 on one node; the plan counted 2
    ({"node-a": 2, "node-b": 1}, 3, 2, None),             # ceil(3 / 2) = 2 on the fuller node
    ({"node-a": 3, "node-b": 2}, 5, 2, None),
    ({"node-a": 4, "node-b": 1}, 5, 2, ("node-a", 4)),
    ({"node-a": 2, "node-b": 1, "node-c": 2}, 5, 3, None),
    ({"node-a": 3, "node-b": 2}, 5, 3, ("node-a", 3)),    # ceil(5 / 3) = 2
    ({"node-a": 4}, 4, 1, None),                          # one node: the plan gave it all TP ranks
    ({}, 3, 2, None),
])
def test_crowded_node_names_a_node_holding_more_ranks_than_the_plan_counted(ranks_per_node, tp, nodes, expected):
    assert tg.crowded_node(ranks_per_node, tp, nodes) == expected


def _group(monkeypatch, clock, placed: dict[int, str], tp: int, nodes: int):
    """A group whose every placement lands its bundles (one a node's share) as `placed` says, at once."""
    class FakePlacementGroup:
        def ready(self):  # asked by the clock fixture's placed_by_now
            return self

        def wait(self, timeout_s):
            return True

    tries = []
    monkeypatch.setattr(tg, "placement_group", lambda *a, **k: tries.append(clock[0]) or FakePlacementGroup())
    monkeypatch.setattr(tg, "remove_placement_group", lambda pg: None)
    monkeypatch.setattr(tg, "bundle_nodes", lambda pg: dict(placed))
    group = tg.TPGroup(tp_degree=tp, backend="cpu", nodes=nodes,
                       resources=RankResources(bundle={"CPU": 1}, num_cpus=1, threads=1),
                       timeouts=tg.GroupTimeouts(placement_s=PLACEMENT_S))
    return group, tries


def test_a_group_with_more_ranks_on_one_node_than_planned_is_placed_again_then_refused(monkeypatch, clock):
    node = "a1b2c3d4e5f6a7b8"
    group, tries = _group(monkeypatch, clock, {0: node, 1: node}, tp=3, nodes=2)  # both shares (2 + 1) on one

    with pytest.raises(PlacementTimeout) as info:
        group._place_within_nodes()

    message = str(info.value)
    assert len(tries) > 1 and clock[0] <= PLACEMENT_S, f"{len(tries)} tries, raised at {clock[0]:g} s"
    assert "placed 3 of the 3 ranks' bundles" in message and "(a1b2c3d4)" in message, message
    assert "more than the 2 (ceil(TP 3 / --nodes 2))" in message, message
    assert f"for {PLACEMENT_S:g} s" in message, message
    assert "--nodes that divides 3 (1, 3)" in message and "fewer ranks" in message, message
    assert group._pg is None  # the last try's group was removed


def test_a_group_within_its_planned_share_per_node_is_kept(monkeypatch, clock):
    placed = {0: "node-a", 1: "node-b"}  # 2 ranks on node-a, 1 on node-b
    group, tries = _group(monkeypatch, clock, placed, tp=3, nodes=2)

    assert group._place_within_nodes() == placed
    assert len(tries) == 1


def test_a_group_split_evenly_counts_its_bundles_as_nodes_not_ranks(monkeypatch, clock):
    """Split evenly, each bundle holds TP / nodes ranks: 2 bundles on 2 nodes are 4 ranks, 2 a node."""
    placed = {0: "node-a", 1: "node-b"}
    group, tries = _group(monkeypatch, clock, placed, tp=4, nodes=2)

    assert group._place_within_nodes() == placed
    assert len(tries) == 1
