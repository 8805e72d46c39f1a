"""Why a Serve replica failed to start, in one line, from Serve's own status.

serve.run raises "Deploying application corelaunch failed: Failed to update the deployments
['OpenAIServer']." when every try of a replica's constructor failed: the reason (the model's load
failing, a rank dying) is only in the ServeController's traceback printed far above, or in its log.
Serve keeps that traceback in the failed deployment's status message ("... See controller logs for
details. Error:\\n<traceback>"), whose last lines are the exception itself.
"""

from __future__ import annotations

import threading

STATUS_WAIT_S = 10.0
"""How long the command waits for Serve's controller to answer serve.status() (it answers in
milliseconds; a controller that died with the deployment must not hang the exit)."""

_TRACEBACK_MARK = "Error:\n"


def exception_lines(traceback_text: str) -> str:
    """The exception a Python traceback ends with ("ValueError: ..."), its lines joined by a space:
    what follows the last frame (the last `  File "..."` line and the indented source and caret lines
    under it). The exception's own lines are kept, indented ones included (a message listing each
    rank's share, a PlanRejected's "  [code] ..." lines). The whole text when it has no frame."""
    lines = [line for line in traceback_text.splitlines() if line.strip()]
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    start = frames[-1] + 1 if frames else 0
    while frames and start < len(lines) and lines[start][:1].isspace():
        start += 1  # the frame's source line and its carets
    tail = lines[start:] or lines
    return " ".join(line.strip() for line in tail)


def failed_deployments(status, app_name: str) -> list[str]:
    """Why each failed deployment of `app_name` in `status` (serve.status()'s ServeStatus) failed:
    its exception ("ValueError: ..."), taken from the traceback Serve keeps in its message; [] when
    the application or no failed deployment is there."""
    app = getattr(status, "applications", {}).get(app_name)
    if app is None:
        return []
    reasons = []
    for deployment in app.deployments.values():
        if str(getattr(deployment.status, "value", deployment.status)) != "DEPLOY_FAILED":
            continue
        message = deployment.message or ""
        _, mark, traceback_text = message.partition(_TRACEBACK_MARK)
        reasons.append(exception_lines(traceback_text) if mark else message.strip())
    return reasons


def replica_failure(serve, app_name: str, wait_s: float = STATUS_WAIT_S) -> str | None:
    """Why `app_name`'s replicas failed to start, read from serve.status() within `wait_s`; None when
    Serve does not say (or does not answer in time)."""
    found: dict = {}

    def ask() -> None:
        try:
            found["reasons"] = failed_deployments(serve.status(), app_name)
        except Exception:  # noqa: BLE001 - no status to read: the caller reports Serve's own error
            found["reasons"] = []

    asking = threading.Thread(target=ask, name="serve-status", daemon=True)
    asking.start()
    asking.join(wait_s)
    return "; ".join(found.get("reasons") or []) or None
