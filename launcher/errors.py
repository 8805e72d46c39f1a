"""Errors the coordinator raises; each message names the values involved and what to change."""


class LaunchError(RuntimeError):
    """Base class: corelaunch could not start or serve the model."""


class PlanRejected(LaunchError):
    """The planner proved the requested layout impossible (no process was started)."""

    def __init__(self, message: str, errors: list[dict]):
        super().__init__(message)
        self.errors = errors


class PlacementTimeout(LaunchError):
    """Ray could not reserve the workers' resources in time."""


class RendezvousTimeout(LaunchError):
    """A rank did not join the process group (or finish a set-up step) in time."""


class WorkerDied(LaunchError):
    """A rank's process died; the message names the rank and its node."""


class RequestTimeout(LaunchError):
    """A request did not finish within the request timeout."""
