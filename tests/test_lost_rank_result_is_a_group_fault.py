"""A rank's result that Ray lost (ObjectLostError, OwnerDiedError: its node died with it) is a
group fault (launcher/cluster/tp_group.py _wait_all): the group is stopped and a RankFailed raised,
which the replica pool answers by restarting the group and running the batch again. Neither is a
RayActorError in Ray 2.60: they escaped the wait as they were, the group not stopped (its other
ranks left in a collective) and the batch not re-run. Ray's calls are faked here; no Ray runs."""

from __future__ import annotations

import pytest
import ray

import launcher.cluster.tp_group as tg
from launcher.cluster.resources import RankResources
from launcher.errors import GroupFault, RankFailed

LOST = "0" * 56  # an object ref's hex


class FakeActor:
    def __init__(self, rank: int):
        self.generate = self.describe = self
        self.rank = rank

    def remote(self, *args):
        return f"result-of-rank-{self.rank}"


@pytest.fixture
def fake_ray(monkeypatch):
    killed: list = []
    outcomes: dict = {}

    def get(ref, timeout=None):
        outcome = outcomes.get(ref, ref)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(tg.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(tg.ray, "wait", lambda refs, num_returns=1, timeout=None: (list(refs), []))
    monkeypatch.setattr(tg.ray, "get", get)
    monkeypatch.setattr(tg.ray, "kill", lambda actor, no_restart=True: killed.append(actor))
    return outcomes, killed


def two_rank_group() -> tg.TPGroup:
    group = tg.TPGroup(tp_degree=2, backend="cpu", resources=RankResources(bundle={"CPU": 1}, num_cpus=1, threads=1))
    group.actors = [FakeActor(0), FakeActor(1)]
    group.workers = [{"rank": r, "node_id": f"n{r}", "node_ip": f"10.0.0.{r}", "pid": 100 + r} for r in range(2)]
    return group


@pytest.mark.parametrize("lost", [ray.exceptions.ObjectLostError(LOST, None, ""),
                                  ray.exceptions.OwnerDiedError(LOST, None, "")],
                         ids=["ObjectLostError", "OwnerDiedError"])
def test_a_lost_result_stops_the_group_and_raises_a_group_fault(fake_ray, lost):
    outcomes, killed = fake_ray
    outcomes["result-of-rank-1"] = lost
    group = two_rank_group()
    actors = list(group.actors)

    with pytest.raises(GroupFault) as info:
        group.generate(object())

    assert isinstance(info.value, RankFailed)
    assert "rank 1 (node 10.0.0.1" in str(info.value) and type(lost).__name__ in str(info.value)
    assert killed == actors and group.actors == []  # stopped: no rank left waiting in a collective


def test_the_ranks_answers_still_come_back_when_none_is_lost(fake_ray):
    group = two_rank_group()
    assert group.generate(object()) == "result-of-rank-0"
    assert len(group.actors) == 2
