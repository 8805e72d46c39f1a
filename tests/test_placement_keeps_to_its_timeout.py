"""A group's placement keeps to --placement-timeout in all (launcher/cluster/tp_group.py
_place_within_nodes): a try that places late but on more nodes than --nodes allows is retried only
within what is left of it. Each try waited the whole timeout again: about twice the timeout in all.
A fake clock and a fake placement group; no Ray."""

from __future__ import annotations

import pytest

import launcher.cluster.tp_group as tg
from launcher.cluster.resources import RankResources
from launcher.errors import PlacementTimeout

PLACEMENT_S = 60.0
PLACED_AFTER_S = 50.0  # each placement group is placed this long after it is asked for


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(tg.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(tg.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    return now


def test_a_placement_spread_too_wide_is_retried_only_within_the_placement_timeout(monkeypatch, clock):
    class FakePlacementGroup:
        def __init__(self):
            self.placed_at = clock[0] + PLACED_AFTER_S

        def wait(self, timeout_seconds):  # as Ray's: waits up to timeout_seconds for the placement
            clock[0] = min(self.placed_at, clock[0] + timeout_seconds)
            return clock[0] >= self.placed_at

    monkeypatch.setattr(tg, "placement_group", lambda *a, **k: FakePlacementGroup())
    monkeypatch.setattr(tg, "remove_placement_group", lambda pg: None)
    monkeypatch.setattr(tg, "bundle_nodes", lambda pg: {0: "node-a", 1: "node-b"})  # always 2 nodes
    monkeypatch.setattr(tg, "placement_strategy", lambda nodes: "PACK")
    monkeypatch.setattr(tg, "alive_nodes", lambda: [])
    monkeypatch.setattr(tg, "explain_unplaceable", lambda *a, **k: "its resources are held by others")
    group = tg.TPGroup(tp_degree=2, backend="cpu", nodes=1,
                       resources=RankResources(bundle={"CPU": 1}, num_cpus=1, threads=1),
                       timeouts=tg.GroupTimeouts(placement_s=PLACEMENT_S))

    with pytest.raises(PlacementTimeout) as info:
        group._place_within_nodes()

    # the old code waited a second whole timeout on the retry and raised at 101 s
    assert clock[0] <= PLACEMENT_S + tg._POLL_S, f"raised after {clock[0]:g} s: {info.value}"
    assert f"for {PLACEMENT_S:g} s" in str(info.value)  # the timeout the user gave, not what was left
    # the cause, the spread, not the last try's wait of what was left ("its resources are held by others")
    assert "on 2 nodes, more than the 1 --nodes allows" in str(info.value) and "--nodes 2" in str(info.value)
    assert group._pg is None  # the last try's group was removed


def test_a_refused_placement_is_tried_once_more_at_the_end_of_the_timeout(monkeypatch, clock):
    """Tries were a second apart and stopped once less than a second was left: a placement that
    became acceptable in the last second was never seen, though the message named the whole timeout."""
    placement_s = 5.5
    tried_at = []

    class PlacedAtOnce:
        def wait(self, timeout_seconds):
            return True

    def bundle_nodes(pg):  # spread over 2 nodes until the very end of the timeout, then on one
        tried_at.append(clock[0])
        return {0: "node-a", 1: "node-b"} if clock[0] < placement_s else {0: "node-a", 1: "node-a"}

    monkeypatch.setattr(tg, "placement_group", lambda *a, **k: PlacedAtOnce())
    monkeypatch.setattr(tg, "remove_placement_group", lambda pg: None)
    monkeypatch.setattr(tg, "bundle_nodes", bundle_nodes)
    group = tg.TPGroup(tp_degree=2, backend="cpu", nodes=1,
                       resources=RankResources(bundle={"CPU": 1}, num_cpus=1, threads=1),
                       timeouts=tg.GroupTimeouts(placement_s=placement_s))

    assert group._place_within_nodes() == {0: "node-a", 1: "node-a"}, tried_at
    assert tried_at[-1] == placement_s and tried_at[-2] == placement_s - 0.5, tried_at


def test_the_wait_for_placement_asks_without_waiting_then_sleeps(monkeypatch, clock):
    """Ray takes a placement group's wait in whole seconds: wait(timeout_seconds=0.5) returned at once,
    and a group waiting to be placed had the driver ask the GCS about a thousand times a second for
    the whole --placement-timeout. It asks without waiting, then sleeps its poll."""
    asked: list[float] = []

    class NeverPlaced:
        def wait(self, timeout_seconds):
            asked.append(timeout_seconds)  # as Ray's: returns at once for anything under a second
            return False

    monkeypatch.setattr(tg, "placement_group", lambda *a, **k: NeverPlaced())
    monkeypatch.setattr(tg, "remove_placement_group", lambda pg: None)
    monkeypatch.setattr(tg, "alive_nodes", lambda: [])
    monkeypatch.setattr(tg, "explain_unplaceable", lambda *a, **k: "its resources are held by others")
    group = tg.TPGroup(tp_degree=2, backend="cpu", nodes=1,
                       resources=RankResources(bundle={"CPU": 1}, num_cpus=1, threads=1),
                       timeouts=tg.GroupTimeouts(placement_s=PLACEMENT_S))

    with pytest.raises(PlacementTimeout):
        group._place_within_nodes()
    assert set(asked) == {0}, sorted(set(asked))  # never a fraction of a second Ray would read as 0
    assert len(asked) <= PLACEMENT_S / tg._POLL_S + 2, len(asked)  # one ask a poll, the last at the deadline
