"""Each timeout a TP group's start can run out of is named with the option that raises it: rank 0's
choice of a rendezvous port, waited for under the rendezvous timeout, said only "raise the timeout"."""

from __future__ import annotations

from types import SimpleNamespace

from launcher.cluster.tp_group import TPGroup


def test_a_rendezvous_port_never_chosen_names_the_rendezvous_timeout():
    group = SimpleNamespace(_where=lambda rank: f"rank {rank}", tp_degree=2)
    error = TPGroup._timeout_error(group, [0], "choose a rendezvous port", 30)
    assert "rank 0 did not choose a rendezvous port within 30 s" in str(error), error
    assert "rendezvous_timeout_s (--rendezvous-timeout)" in str(error) and "the timeout" not in str(error), error
