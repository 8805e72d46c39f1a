"""A Serve replica reads the options Serve really deployed it with (launcher/serving/serve_deployment.py):
a config file's `deployments:` entry overrides build_app's. Ray Serve's own DeploymentConfig objects,
as Serve 2.60 builds them from a config file's entry; the redeploy itself was run by hand (README)."""

from __future__ import annotations

from ray.serve._private.config import DeploymentConfig
from ray.serve.config import AutoscalingConfig

from launcher.serving.serve_deployment import DRAIN_MARGIN_S, DeploymentFacts, facts_of, placement_wait_s


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
