"""Errors the coordinator raises; each message names the values involved and what to change."""


class LaunchError(RuntimeError):
    """Base class: corelaunch could not start or serve the model."""


class PlanRejected(LaunchError):
    """The planner proved the requested layout impossible (no process was started)."""

    def __init__(self, message: str, errors: list[dict]):
        super().__init__(message)
        self.errors = errors


class RayStartFailed(LaunchError):
    """The private Ray cluster a launch starts did not come up (Ray's own start-up wait ran out):
    the machine's state, not the command's input; the same command may work on a retry."""


class PlacementTimeout(LaunchError):
    """Ray could not reserve the workers' resources in time."""


class PlacementImpossible(PlacementTimeout):
    """The cluster's nodes together could never hold one group (a private cluster has no
    autoscaler): refused at once, as bad input, rather than after the placement timeout."""


class RendezvousTimeout(LaunchError):
    """A rank did not join the process group (or finish a set-up step) in time."""


class GroupFault(LaunchError):
    """The TP group broke while working (a rank died, failed or hung); restarting it may help."""


class WorkerDied(GroupFault):
    """A rank's process died; the message names the rank and its node."""


def error_chain(err: BaseException | None):
    """err, then each error it was raised from or during (__cause__, else __context__), once each."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


class RequestTimeout(GroupFault):
    """A request did not finish within the request timeout."""

    def __init__(self, message: str, timeout_s: float | None = None, waited_for_a_slot: bool = False,
                 lost_to_a_restart: bool = False) -> None:
        super().__init__(message)
        self.timeout_s = timeout_s
        """The time the request was given (a wave's more for each wave of rows queued before it), where
        the error is that one request's past its timeout (not a hung group's, nor a static batch's):
        the OpenAI server tells it in its client's terms."""
        self.waited_for_a_slot = waited_for_a_slot
        """It never got a sequence slot (every one held by requests before it): fewer tokens would not
        have helped it, a later retry or more slots would."""
        self.lost_to_a_restart = lost_to_a_restart
        """Its group failed and restarted past its timeout, so it was not resumed: a retry is served by
        the restarted group, and fewer tokens would not have helped it."""


class RankFailed(GroupFault):
    """A rank raised an unexpected error (not the user's input) while serving; the group was stopped."""


class DevicesMissing(LaunchError):
    """A node that declares a backend's device resource (e.g. `neuron_cores`) shows none of its
    device files to the rank placed on it."""


NeuronDevicesMissing = DevicesMissing
"""Its name from when Neuron was the only backend with devices."""


class NoDeviceResource(LaunchError):
    """No alive node of the Ray cluster declares the resource the backend's ranks ask for."""


class NoDeviceResourceHere(NoDeviceResource, PlacementImpossible):
    """No node of the launch's own private cluster (this host alone) declares it: it never will, so
    it is bad input as PlacementImpossible is (exit 2), not a run that may succeed again (exit 3)."""


class ReplicaFailed(LaunchError):
    """A replica's TP group failed and could not be restarted (the cluster cannot host it any more);
    the requests it had in flight fail with this error, other replicas keep serving."""


class RestartLimitExceeded(ReplicaFailed):
    """A replica failed more often than max_restarts within restart_window_s (a crash loop)."""


class RequestFailed(LaunchError):
    """One request failed by itself (say, choosing its next token raised); its TP group and every
    other request in it carry on."""


class RequestCancelled(LaunchError):
    """A stream was cancelled by someone other than the reader that now reads it: closed from another
    thread or task, or cancelled when the task reading it was; its row is already free."""


class NoReplicaAvailable(LaunchError):
    """Every replica has failed for good: nothing is left to serve requests."""


class QueueFull(LaunchError):
    """More requests wait for a free cache row than max_queued_requests allows; retry later."""

    def __init__(self, message: str, retry_after_s: float = 1.0, slots: int | None = None,
                 queue_limit: int | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.slots, self.queue_limit = slots, queue_limit
        """Each replica's sequence slots (max_num_seqs) and the queue's size (max_queued_requests):
        the server words its own answer from them, without the operator's fix."""
