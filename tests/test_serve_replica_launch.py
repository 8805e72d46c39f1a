"""What a Serve replica hands its Launcher when Serve deployed it with other options than the
builder's (a config file's `deployments:` entry): the ranks' CPU share sized for the replicas Serve
may run and the CPUs each replica actor holds, and the placement wait through a replaced replica's
drain. The helpers are tested in tests/test_serve_deployment.py; this drives OpenAIServer.__init__
itself, on the session's real Ray (its node list), as far as the Launcher it builds. Serve's replica
context stands in for what Serve would say (no Serve runs here), and the Launcher records its
config instead of loading a model."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # the session's Ray: its node list sizes the ranks


class _Recorded(Exception):
    pass


def test_a_replica_sizes_its_ranks_and_placement_wait_from_what_serve_deployed(monkeypatch, ray_session):
    from launcher import api
    from launcher.serving import port_rebind, serve_deployment
    from launcher.serving.openai_app import OpenAIServer
    from launcher.serving.server_settings import settings_from_args

    monkeypatch.setattr(port_rebind, "allow_port_rebinding", lambda: True)  # Serve's sockets: not this test's
    monkeypatch.delenv("CORELAUNCH_API_KEY", raising=False)
    configs = []

    def recording(config):
        configs.append(config)
        raise _Recorded

    monkeypatch.setattr(api, "Launcher", recording)
    wrapper = OpenAIServer.func_or_class
    ours = next(c for c in wrapper.__mro__[1:] if c.__module__ == "launcher.serving.openai_app")

    def launched_with(facts, held_cpus: float):
        monkeypatch.setattr(serve_deployment, "this_replicas_facts", lambda: facts)
        monkeypatch.setattr(serve_deployment, "own_cpus", lambda: held_cpus)
        with pytest.raises(_Recorded):  # the builder asked for one replica, TP 1, no placement timeout
            ours.__init__(object.__new__(ours), settings_from_args({"tp": 1, "replicas": 1}))
        return configs.pop()

    from launcher.cluster.resources import cpu_rank_resources  # the share's rule, tested in tests/test_replicas.py

    cpus = ray_session.cluster_resources()["CPU"]  # one node: the session's
    as_built = launched_with(None, 0.0)  # not in a replica Serve describes: the builder's arguments
    assert as_built.cpus_per_rank == cpu_rank_resources(1, [cpus], replicas=1).num_cpus
    assert as_built.placement_timeout_s == api.LaunchConfig.placement_timeout_s
    # a config file's entry: 2 replicas, each actor holding 0.25 CPU, drained for 500 s when replaced
    deployed = launched_with(serve_deployment.DeploymentFacts(most_replicas=2, drain_s=500.0), 0.25)
    assert deployed.cpus_per_rank == cpu_rank_resources(1, [cpus - 2 * 0.25], replicas=2).num_cpus
    assert deployed.cpus_per_rank < as_built.cpus_per_rank
    assert deployed.placement_timeout_s == 500.0 + serve_deployment.DRAIN_MARGIN_S
