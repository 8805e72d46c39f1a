"""A static generate()'s watchdog outlasts every restart its policy allows: a restart may spend each
of a new group's timeouts (placement, start-up, rendezvous, the load and the serving loop's
preparation, then the request again). Budgeting each as the load and request timeouts alone gave up
with RequestTimeout while a replica was still restarting within its own timeouts."""

from __future__ import annotations

from launcher.api import WATCHDOG_GRACE_S, LaunchConfig, static_watchdog_s


def test_the_watchdog_waits_out_each_restart_and_each_part():
    cfg = LaunchConfig(placement_timeout_s=60, startup_timeout_s=120, rendezvous_timeout_s=30, load_timeout_s=900,
                       request_timeout_s=600, max_restarts=2)
    restart = 60 + 120 + 30 + 2 * 900 + 600  # every wait of a new group's, then the request again
    assert static_watchdog_s(cfg, parts=1) >= 600 + 2 * restart + WATCHDOG_GRACE_S
    assert static_watchdog_s(cfg, parts=3) - static_watchdog_s(cfg, parts=1) >= 2 * 600  # parts queue behind others
    no_restarts = LaunchConfig(load_timeout_s=900, request_timeout_s=600, max_restarts=0)
    assert static_watchdog_s(no_restarts, parts=1) == 600 + 900 + WATCHDOG_GRACE_S  # as before without restarts
