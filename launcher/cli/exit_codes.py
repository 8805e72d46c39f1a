"""Exit codes shared by the commands that run a model (generate, check, bench, compile).

2 means the invocation cannot work as given (a bad value, a missing file, a layout the planner
refuses): running it again unchanged fails again. 3 means it was valid but the run did not reach its
end on this cluster (a rank died or hung, Ray could not place or start the ranks, a node lacks its
devices): a script may retry it or look at the cluster, and `check` does not confuse it with 1, an
accuracy failure. 130 and 141 (interrupted, broken pipe) are in launcher/cli/__init__.py.
"""

from __future__ import annotations

EXIT_BAD_INPUT = 2
EXIT_RUN_FAILED = 3


def exit_code_for(err: BaseException) -> int:
    """EXIT_RUN_FAILED for a failure of the cluster or of the ranks, else EXIT_BAD_INPUT (a group the
    cluster could never hold included: the same command fails the same way)."""
    from launcher.errors import (DevicesMissing, GroupFault, NoDeviceResource, NoReplicaAvailable, PlacementImpossible,
                                 PlacementTimeout, RayStartFailed, RendezvousTimeout, ReplicaFailed, RequestFailed)

    if isinstance(err, PlacementImpossible):
        return EXIT_BAD_INPUT
    if isinstance(err, (ConnectionError, TimeoutError)):  # a connection dropped, a lock or wait timed out
        return EXIT_RUN_FAILED
    run_failures = (GroupFault, ReplicaFailed, NoReplicaAvailable, PlacementTimeout, RendezvousTimeout,
                    DevicesMissing, NoDeviceResource, RequestFailed, RayStartFailed)
    return EXIT_RUN_FAILED if isinstance(err, run_failures) else EXIT_BAD_INPUT
