"""A group over several nodes where --nodes does not divide TP takes ceil or floor of TP / nodes
ranks on each node, one bundle a node (STRICT_SPREAD), as an even split does. It was PACKed, and
the arithmetic (launcher/cluster/resources.py place_group) modelled PACK filling the roomiest node
first with no limit, while the launcher refuses more than ceil(TP / nodes) ranks on one node: the
default CPU share, the --replicas auto count and never_placeable assumed placements the launcher
then refused until --placement-timeout ran out (TP 3 over two 4-CPU nodes: all 3 on one node).
Pure arithmetic and a fake placement group; no Ray."""

from __future__ import annotations

import pytest

import launcher.cluster.tp_group as tg
from launcher.errors import PlacementTimeout
from launcher.cluster.resources import (RankResources, cpu_rank_resources, explain_unplaceable, groups_that_fit,
                                        never_placeable, place_group)


@pytest.mark.parametrize("tp, nodes, expected", [
    (3, 2, [2, 1]), (5, 3, [2, 2, 1]), (7, 3, [3, 2, 2]), (4, 2, [2, 2]), (2, 4, [1, 1]), (4, 1, None),
    # --nodes is at most that many: the fewest nodes at the ceil(TP / N) ranks a node the plan counted
    (4, 3, [2, 2]), (6, 4, [2, 2, 2]), (5, 4, [2, 2, 1]), (1, 2, None),
])
def test_each_node_gets_ceil_or_floor_of_its_share_fullest_first(tp, nodes, expected):
    from launcher.cluster.resources import node_split

    assert node_split(tp, nodes) == expected


@pytest.mark.parametrize("free, tp, nodes, expected", [
    ([{"CPU": 4.0}, {"CPU": 4.0}], 3, 2, [2, 1]),          # PACK's model: [3, 0], which the launcher refuses
    ([{"CPU": 1.0}, {"CPU": 4.0}], 3, 2, [1, 2]),          # the fuller share on the roomier node
    ([{"CPU": 6.0}, {"CPU": 0.0}], 3, 2, None),            # one node would hold all 3; the plan gave it 2
    ([{"CPU": 2.0}, {"CPU": 2.0}, {"CPU": 1.0}], 5, 3, [2, 2, 1]),
    ([{"CPU": 3.0}, {"CPU": 2.0}, {"CPU": 0.0}], 5, 3, None),  # two nodes hold 5 only at 3 on one
])
def test_a_group_not_split_evenly_is_placed_with_at_most_ceil_tp_over_nodes_a_node(free, tp, nodes, expected):
    assert place_group([dict(f) for f in free], {"CPU": 1.0}, tp, nodes) == expected


def test_never_placeable_and_the_replica_count_agree_with_the_ranks_a_node_may_hold():
    # a head with no CPUs and one 6-CPU worker: PACK's model put TP 3 (--nodes 2) on the worker, twice
    nodes = [{"CPU": 6.0}, {"CPU": 0.0}]
    assert never_placeable({"CPU": 1.0}, 3, 2, nodes)
    assert groups_that_fit(nodes, {"CPU": 1.0}, 3, 2) == 0
    # two 4-CPU nodes: two groups, [2, 1] and [1, 2]; a third would need 2 ranks on a node with 1 left
    assert groups_that_fit([{"CPU": 4.0}] * 2, {"CPU": 1.0}, 3, 2) == 2
    assert groups_that_fit([{"CPU": 4.0}] * 2, {"CPU": 0.5}, 3, 2) == 5


def test_the_default_cpu_share_is_one_the_smaller_node_holds_its_rank_at():
    # 6 + 1 CPUs over TP 3, --nodes 2: 2 CPUs a rank fit only as 3 ranks on the 6-CPU node
    assert cpu_rank_resources(3, [6.0, 1.0], nodes=2).bundle == {"CPU": 1}
    assert cpu_rank_resources(3, [4.0, 4.0], nodes=2, replicas=2).bundle == {"CPU": 1}  # [2, 1] + [1, 2]


def test_the_explanation_names_each_nodes_share():
    why = explain_unplaceable({"CPU": 1.0}, 3, 2, [{"CPU": 6.0}, {"CPU": 0.0}], node_names=["a", "b"])
    assert "3 bundle(s) of {CPU: 1}, 2 + 1 on 2 different nodes" in why, why
    assert "roomiest nodes hold 6 + 0 such bundles, where it needs 2 + 1" in why, why
    three = explain_unplaceable({"CPU": 1.0}, 3, 2, [{"CPU": 1.0}] * 3)  # 1 CPU a node: --nodes 3 holds it
    assert "--nodes 3 holds it" in three, three


def test_the_group_reserves_one_bundle_a_node_and_numbers_ranks_bundle_by_bundle(monkeypatch):
    asked = []

    class FakePlacementGroup:
        def ready(self):
            return self

        def wait(self, timeout_s):
            return True

    def fake_placement_group(bundles, strategy, name):
        asked.append((bundles, strategy))
        return FakePlacementGroup()

    monkeypatch.setattr(tg, "placement_group", fake_placement_group)
    monkeypatch.setattr(tg, "placed_by_now", lambda ready, timeout_s: ready.wait(timeout_s))
    monkeypatch.setattr(tg, "bundle_nodes", lambda pg: {0: "node-a", 1: "node-b"})
    group = tg.TPGroup(tp_degree=3, backend="cpu", nodes=2,
                       resources=RankResources(bundle={"CPU": 0.5}, num_cpus=0.5, threads=1))

    assert group._place_within_nodes() == {0: "node-a", 1: "node-b"}
    assert asked == [([{"CPU": 1.0}, {"CPU": 0.5}], "STRICT_SPREAD")]
    assert group._split_bundle_of_rank() == [0, 0, 1]


def test_a_group_never_placed_names_each_bundle_it_asked_for(monkeypatch):
    class NeverPlaced:
        def ready(self):
            return self

        def wait(self, timeout_s):
            return False

    monkeypatch.setattr(tg, "placement_group", lambda *a, **k: NeverPlaced())
    monkeypatch.setattr(tg, "placed_by_now", lambda ready, timeout_s: ready.wait(timeout_s))
    monkeypatch.setattr(tg, "remove_placement_group", lambda pg: None)
    monkeypatch.setattr(tg, "alive_nodes", lambda: [])
    group = tg.TPGroup(tp_degree=3, backend="cpu", nodes=2, timeouts=tg.GroupTimeouts(placement_s=0.05),
                       resources=RankResources(bundle={"CPU": 0.5}, num_cpus=0.5, threads=1))

    with pytest.raises(PlacementTimeout) as info:
        group._place_within_nodes()
    message = str(info.value)
    assert "could not reserve 2 bundles ({'CPU': 1.0}, {'CPU': 0.5}) (STRICT_SPREAD) within 0.05 s" in message, message
    assert "3 bundle(s) of {CPU: 0.5}, 2 + 1 on 2 different nodes" in message, message
