"""A group's placement keeps to --placement-timeout in all (launcher/cluster/tp_group.py
_place_within_nodes): a try that places late but on more nodes than --nodes allows is retried only
within what is left of it. Each try waited the whole timeout again: about twice the timeout in all.
A fake clock and a fake placement group, no Ray, but for the last test, which asks a real Ray."""

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
    # a fake group's ready() is the group itself, asked with its own wait(timeout_s)
    monkeypatch.setattr(tg, "placed_by_now", lambda ready, timeout_s: ready.wait(timeout_s))
    return now


def test_a_placement_spread_too_wide_is_retried_only_within_the_placement_timeout(monkeypatch, clock):
    class FakePlacementGroup:
        def __init__(self):
            self.placed_at = clock[0] + PLACED_AFTER_S

        def ready(self):
            return self

        def wait(self, timeout_s):  # as ray.wait on ready(): waits up to timeout_s for the placement
            clock[0] = min(self.placed_at, clock[0] + timeout_s)
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
        def ready(self):
            return self

        def wait(self, timeout_s):
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


def test_the_wait_for_placement_waits_in_slices_of_its_poll(monkeypatch, clock):
    """Ray takes a placement group's own wait in whole seconds: wait(timeout_seconds=0.5) returned at
    once, and a group waiting to be placed had the driver ask the GCS about a thousand times a second
    for the whole --placement-timeout. Each ask waits a poll (ray.wait takes fractions)."""
    asked: list[float] = []

    class NeverPlaced:
        def ready(self):
            return self

        def wait(self, timeout_s):
            asked.append(timeout_s)
            clock[0] += timeout_s
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
    assert set(asked[:-1]) == {tg._POLL_S} and asked[-1] == 0, sorted(set(asked))  # the last at the deadline
    assert len(asked) == PLACEMENT_S / tg._POLL_S + 1, len(asked)


def test_a_placed_group_is_seen_placed_by_every_wait_of_no_time(ray_session):
    """Ray's pg.wait(timeout_seconds=0) asks the GCS with a deadline of no time and answered False for
    a group placed long before, about one ask in eight: a 3 s --placement-timeout timed out in CI with
    its bundle reserved (the last try at the deadline is such an ask). Real Ray."""
    from ray.util.placement_group import placement_group, remove_placement_group

    group = tg.TPGroup(tp_degree=1, backend="cpu", nodes=1,
                       resources=RankResources(bundle={"CPU": 0.01}, num_cpus=0.01, threads=1),
                       timeouts=tg.GroupTimeouts(placement_s=PLACEMENT_S))
    group._pg = placement_group([{"CPU": 0.01}], strategy="STRICT_PACK")
    try:
        ready = group._pg.ready()
        assert group._placed_within(ready, 30)  # placed: from here on every ask must say so
        seen = [group._placed_within(ready, 0) for _ in range(100)]
    finally:
        remove_placement_group(group._pg)
    assert all(seen), f"{seen.count(False)} of {len(seen)} waits of no time missed a placed group"
