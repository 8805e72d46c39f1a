"""What Serve really deploys a replica with, read inside the replica.

A config file's `deployments:` entry (`serve deploy`) overrides the options build_app gave: its
`num_replicas` or `autoscaling_config` (which Serve replaces whole) change how many replicas share
the cluster's CPUs, and its `graceful_shutdown_timeout_s` how long a replica being replaced keeps
its TP group. The builder's arguments know neither, so a replica sized its ranks for the builder's
count (a second replica from `num_replicas: 2` never fit) and waited for its placement group only
`placement_timeout_s` (a redeploy whose old replica drained for longer left the app with no
replica). Serve keeps the effective options in the replica context's private `_deployment_config`
(Ray 2.60); if a release changes that, these facts are None and the builder's settings stand.
"""

from __future__ import annotations

import dataclasses

DRAIN_MARGIN_S = 30.0
"""Past a replaced replica's drain: Serve kills it, its TP group's actors exit and Ray frees their
placement group before the new group's bundles can be reserved."""


@dataclasses.dataclass(frozen=True)
class DeploymentFacts:
    most_replicas: int
    """Replicas there can be at once: num_replicas, or the autoscaling maximum."""
    drain_s: float
    """graceful_shutdown_timeout_s: how long a stopped replica keeps serving (and its group)."""


def facts_of(deployment_config) -> DeploymentFacts | None:
    """The facts from Serve's DeploymentConfig; None for an object of another shape."""
    try:
        autoscaling = deployment_config.autoscaling_config
        most = int(autoscaling.max_replicas if autoscaling is not None else deployment_config.num_replicas)
        drain_s = float(deployment_config.graceful_shutdown_timeout_s)
    except (AttributeError, TypeError, ValueError):
        return None
    return DeploymentFacts(most_replicas=max(1, most), drain_s=max(0.0, drain_s))


def this_replicas_facts() -> DeploymentFacts | None:
    """The facts of the Serve replica this runs in; None outside one (or on an unknown Serve)."""
    from ray import serve

    try:
        context = serve.get_replica_context()
    except Exception:  # noqa: BLE001 - RayServeException outside a replica; nothing else to tell
        return None
    return facts_of(getattr(context, "_deployment_config", None))


def placement_wait_s(configured_s: float, facts: DeploymentFacts | None) -> float:
    """How long a replica waits for its group's placement: at least through a replaced replica's
    drain and teardown (Serve starts the new replica while the old one drains, with the CPUs the
    old group holds), else the configured wait."""
    if facts is None:
        return configured_s
    return max(configured_s, facts.drain_s + DRAIN_MARGIN_S)


def without_replica_cpus(node_cpus: list[float], replica_cpus: float, serve_replicas: int) -> list[float]:
    """The nodes' CPUs left to the ranks when each Serve replica actor holds `replica_cpus` itself.
    Serve places its replicas where it likes, so every node is taken to host all of them: exact on
    one node, on several a smaller share than could fit rather than a group that never fits (the
    ranks were sized from the whole node, and the last group waited out its placement)."""
    held = max(0.0, replica_cpus) * max(1, serve_replicas)
    return [max(0.0, c - held) for c in node_cpus]


def own_cpus() -> float:
    """The CPUs this Serve replica actor holds: none as build_app deploys it, but a config file's
    `ray_actor_options` replaces the builder's whole, and Serve then gives the actor 1 CPU unless the
    entry repeats `num_cpus: 0`."""
    import ray

    if not ray.is_initialized():  # the runtime context would start a Ray of its own
        return 0.0
    try:
        return float(ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0))
    except Exception:  # noqa: BLE001 - outside an actor (nothing held) or an unknown Ray: as deployed
        return 0.0
