"""A Serve replica reads the options Serve really deployed it with (launcher/serving/serve_deployment.py):
a config file's `deployments:` entry overrides build_app's. Ray Serve's own DeploymentConfig objects,
as Serve 2.60 builds them from a config file's entry; the redeploy itself was run by hand (README)."""

from __future__ import annotations

import pytest
from ray.serve._private.config import DeploymentConfig
from ray.serve.config import AutoscalingConfig

from launcher.serving.serve_deployment import (DRAIN_MARGIN_S, DeploymentFacts, facts_of, placement_wait_s,
                                               this_replicas_facts)


def test_the_replica_count_is_serves_not_the_builders():
    """`num_replicas: 2` in a config file: each rank was still sized for the builder's one replica,
    and the second replica's group never fit."""
    assert facts_of(DeploymentConfig(num_replicas=2)) == DeploymentFacts(most_replicas=2, drain_s=20.0)
    # an autoscaling_config entry replaces the builder's whole: its maximum is the count
    scaled = DeploymentConfig(num_replicas=None, autoscaling_config=AutoscalingConfig(min_replicas=1, max_replicas=3))
    assert facts_of(scaled).most_replicas == 3
    overridden = DeploymentConfig(num_replicas=None, autoscaling_config=AutoscalingConfig(upscale_delay_s=3))
    assert facts_of(overridden).most_replicas == 1  # Serve's default maximum, whatever the builder asked


def test_a_replica_waits_for_its_placement_through_a_replaced_replicas_drain():
    """A redeploy with `graceful_shutdown_timeout_s: 60` and a stream running: the new replica gave up
    placing its group after 60 s while the old one still drained with the CPUs, and the app was left
    with no replica."""
    long_drain = facts_of(DeploymentConfig(graceful_shutdown_timeout_s=60))
    assert long_drain.drain_s == 60.0
    assert placement_wait_s(60.0, long_drain) == 60.0 + DRAIN_MARGIN_S
    assert placement_wait_s(300.0, long_drain) == 300.0  # a longer wait asked for is kept
    assert placement_wait_s(15.0, None) == 15.0  # not in a replica (or an unknown Serve): as configured


def test_an_unknown_shape_of_serves_config_gives_no_facts():
    assert facts_of(None) is None
    assert facts_of(object()) is None


def test_a_replica_reads_the_options_of_the_replica_context_serve_gives_it(monkeypatch):
    """Through the installed Serve's own context (a release that moved its private
    _deployment_config would fail here rather than silently fall back to the builder's settings)."""
    import dataclasses

    from ray.serve import context
    from ray.serve._private.common import DeploymentID, ReplicaID

    assert this_replicas_facts() is None  # not in a replica
    fields = {f.name for f in dataclasses.fields(context.ReplicaContext)}
    given = {"replica_id": ReplicaID("r1", DeploymentID("OpenAIServer", "corelaunch")), "servable_object": None,
             "_deployment_config": DeploymentConfig(num_replicas=2, graceful_shutdown_timeout_s=45), "rank": None,
             "world_size": 2}
    assert set(given) <= fields, fields
    monkeypatch.setattr(context, "_INTERNAL_REPLICA_CONTEXT", context.ReplicaContext(**given))
    assert this_replicas_facts() == DeploymentFacts(most_replicas=2, drain_s=45.0)


def test_ranks_are_sized_for_what_the_serve_replicas_own_cpus_leave():
    """A config file's `ray_actor_options` (a runtime_env for the API key, say) replaces build_app's
    whole, num_cpus 0 included, and Serve gives the replica actor 1 CPU: the ranks, sized from the
    whole node, no longer fit beside it, and the app failed to deploy (PlacementTimeout)."""
    from launcher.cluster.resources import cpu_rank_resources
    from launcher.serving.serve_deployment import without_replica_cpus

    assert without_replica_cpus([2.0], 0.0, 1) == [2.0]  # as build_app deploys it
    assert without_replica_cpus([2.0], 1.0, 1) == [1.0]
    assert cpu_rank_resources(1, without_replica_cpus([2.0], 1.0, 1)).num_cpus == 1.0  # 2 before: never placed
    # several replicas: every node is taken to host them all (Serve places them where it likes)
    assert without_replica_cpus([4.0, 8.0], 1.0, 2) == [2.0, 6.0]
    assert without_replica_cpus([1.0], 1.0, 3) == [0.0]


@pytest.mark.slow  # an actor on the session's Ray
def test_a_replica_reads_the_cpus_it_holds_and_a_driver_holds_none(ray_session):
    from launcher.serving import serve_deployment

    ray = ray_session
    held = ray.remote(num_cpus=1)(_OwnCpus).remote()
    assert ray.get(held.read.remote(), timeout=60) == 1.0
    assert ray.get(ray.remote(num_cpus=0)(_OwnCpus).remote().read.remote(), timeout=60) == 0.0
    assert serve_deployment.own_cpus() == 0.0  # the driver: no actor's resources


class _OwnCpus:
    def read(self) -> float:
        from launcher.serving.serve_deployment import own_cpus

        return own_cpus()


def test_reading_the_cpus_held_outside_ray_starts_no_ray(monkeypatch):
    """ray.get_runtime_context() starts a local Ray where none is connected (14 s here)."""
    import ray

    from launcher.serving.serve_deployment import own_cpus

    asked = []

    def tripwire():
        asked.append(1)
        raise AssertionError("the runtime context was asked for with no Ray connected: it starts one")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a process with no Ray
    monkeypatch.setattr(ray, "get_runtime_context", tripwire)
    assert own_cpus() == 0.0 and asked == []
