"""How `corelaunch serve` routes HTTP (launcher/serving/ingress.py): the mode for a replica count, the
environment each mode gives Serve, and that the Ray Serve installed here reads that environment.
Real servers in both modes: tests/test_openai_server.py (direct, the default, and proxy)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from launcher.serving.ingress import CONTROL_LOOP_INTERVAL_S, choose_mode, plan_ingress


@pytest.mark.parametrize("requested, replicas, autoscaling, mode", [
    ("auto", 1, False, "direct"),
    ("auto", 2, False, "proxy"),
    ("auto", 1, True, "proxy"),  # autoscaling may add replicas
    ("proxy", 1, False, "proxy"),
    ("direct", 1, False, "direct"),
])
def test_mode_for_the_replica_count(requested, replicas, autoscaling, mode):
    assert choose_mode(requested, replicas, autoscaling) == mode


def test_direct_ingress_with_several_replicas_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"may run 3 .*use --ingress proxy"):
        choose_mode("direct", 3, False)
    with pytest.raises(ValueError, match=r"--ingress \('side'\) must be one of auto, direct, proxy"):
        choose_mode("side", 1, False)


def test_direct_plan_gives_the_replica_exactly_the_port_and_the_proxy_another():
    offered = iter([8000, 8000, 41234])  # a free-port probe may return --port itself: it is not bound yet
    plan = plan_ingress("direct", 8000, lambda: next(offered), {})
    assert (plan.mode, plan.port, plan.proxy_port) == ("direct", 8000, 41234)
    assert plan.environment == {
        "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": CONTROL_LOOP_INTERVAL_S,
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "8000",
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "8001",
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        "RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }


def test_serve_picks_the_idle_proxy_port_below_the_ephemeral_range():
    """The proxy binds it after the private Ray has started: a port from the ephemeral range may be
    taken meanwhile by any of Ray's start-up connections (a benchmark run failed so)."""
    import argparse

    from launcher.cli.serve_command import ingress_plan

    ephemeral_low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    if ephemeral_low <= 20000:
        pytest.skip(f"this host's ephemeral ports start at {ephemeral_low}: no late-bind range below them")
    ports = {ingress_plan(argparse.Namespace(host="127.0.0.1", port=18000), "direct").proxy_port for _ in range(5)}
    assert all(20000 <= port < min(30000, ephemeral_low) for port in ports), ports  # not Serve's 30000-31000 either


def test_proxy_plan_keeps_the_port_and_turns_direct_ingress_off():
    plan = plan_ingress("proxy", 8000, lambda: pytest.fail("proxy mode needs no second port"),
                        {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"})
    assert (plan.port, plan.proxy_port) == (8000, 8000)
    # a control-loop interval the user set is kept
    assert plan.environment == {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}


def test_the_installed_ray_serve_reads_the_plan():
    """The variables are Ray Serve's own: a process started with them sees the settings (a Ray upgrade
    that renamed one would fail here, not silently serve through the proxy)."""
    plan = plan_ingress("direct", 18000, lambda: 18555, {})
    probe = ("import json; from ray.serve._private import constants as c, node_port_manager as n; "
             "a = n.PortAllocator(c.RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT, c.RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT, "
             "'http', 'node'); "
             "print(json.dumps([c.RAY_SERVE_ENABLE_DIRECT_INGRESS, a.allocate('r1'), c.RAY_SERVE_PORT_QUARANTINE_S, "
             "c.CONTROL_LOOP_INTERVAL_S, c.RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS, "
             "c.RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S]))")
    out = subprocess.run([sys.executable, "-c", probe], env={**_base_env(), **plan.environment}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    enabled, port, quarantine, interval, force_stop, draining = json.loads(out.stdout.strip().splitlines()[-1])
    assert enabled is True and port == 18000 and quarantine == 0 and interval == float(CONTROL_LOOP_INTERVAL_S)
    assert force_stop is True and draining == 0


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}


def test_in_direct_mode_serves_ready_line_naming_its_idle_proxy_is_left_out():
    import logging

    from launcher.serving.ingress import IdleProxyAddressHidden

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("ray.serve", logging.INFO, __file__, 1, message, None, None)

    hidden = IdleProxyAddressHidden()
    assert not hidden.filter(record("Application 'corelaunch' is ready at http://127.0.0.1:26901/."))
    assert hidden.filter(record("Started Serve in namespace 'serve'."))
    assert hidden.filter(record("Deploying new version of Deployment(name='OpenAIServer', app='corelaunch')."))
