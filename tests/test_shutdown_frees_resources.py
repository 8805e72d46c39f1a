"""A shutdown hands the cluster back whole (launcher/api.py Launcher.shutdown,
launcher/cluster/tp_group.py wait_until_released). Removing a placement group returns before Ray
has freed its resources: Launcher.shutdown returned with part of the cluster still held, and a
replicas="auto" launch right after it counted only the rest and silently started fewer replicas
(3 of 6 CPUs free right after the exit, all 6 three seconds later). replicas="auto" also says when
it starts fewer than the idle cluster holds, and what holds the rest."""

from __future__ import annotations

import pytest

from launcher.api import Launcher
from launcher.cluster.placement import NodeInfo, alive_nodes
from tests.model_factory import build_random_model, save_model
from tests.test_replicas import wait_until_all_cpus_free

EAGER = dict(compile=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    model = build_random_model("llama", num_heads=4, num_kv_heads=2, seed=7)
    return str(save_model(model, tmp_path_factory.mktemp("shutdown_frees")))


def free_cpus() -> float:
    return sum(node.free.get("CPU", 0.0) for node in alive_nodes())


@pytest.mark.slow
def test_a_removed_placement_group_is_waited_for_until_its_cpus_are_free(ray_session):
    """An actor inside the group, killed just before the group is removed, as a group's ranks are."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from launcher.cluster.tp_group import wait_until_released

    cpus = wait_until_all_cpus_free(ray_session)

    @ray.remote(num_cpus=1)
    class Rank:
        def ping(self) -> int:
            return 1

    pg = placement_group([{"CPU": 1}] * cpus, strategy="PACK")
    ray.get(pg.ready(), timeout=60)
    rank = Rank.options(scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg)).remote()
    assert ray.get(rank.ping.remote(), timeout=60) == 1
    assert free_cpus() == 0
    ray.kill(rank, no_restart=True)
    remove_placement_group(pg)

    assert wait_until_released([pg], 30.0) == []
    assert free_cpus() == cpus  # at once: nothing of the group is left for a launch to miscount


@pytest.mark.slow
def test_an_auto_launch_right_after_a_shutdown_starts_as_many_replicas_as_a_fresh_one(model_dir, ray_session):
    cpus = wait_until_all_cpus_free(ray_session)
    with Launcher(model=model_dir, tp=1, replicas="auto", progress=False, **EAGER) as first:
        assert first.replicas == cpus  # one CPU per rank: one TP 1 replica per CPU
    assert free_cpus() == cpus, "the shutdown returned with part of the cluster still held"
    with Launcher(model=model_dir, tp=1, replicas="auto", progress=False, **EAGER) as second:
        assert second.replicas == cpus


def test_auto_says_it_starts_fewer_replicas_than_the_idle_cluster_holds(model_dir, in_process_cluster,
                                                                        monkeypatch, capsys):
    from launcher.cluster import placement

    busy = NodeInfo(node_id="a1b2c3d4e5f6", address="10.0.0.7", total={"CPU": 2.0}, free={"CPU": 1.0})
    monkeypatch.setattr(placement, "alive_nodes", lambda: [busy])  # one of its 2 CPUs held by another job
    with Launcher(model=model_dir, tp=1, replicas="auto", progress=True, **EAGER) as launcher:
        assert launcher.replicas == 1
    said = " ".join(capsys.readouterr().err.split())
    assert ("replicas=auto: starting 1 replica(s) of the 2 the cluster holds when idle; other groups or jobs "
            "hold node 10.0.0.7 (a1b2c3d4): CPU 1 of 2") in said, said
