"""The coordinator, planner front end, driver API and CLI.

`from launcher import Launcher, LaunchConfig, SamplingParams` — imported lazily so that
`corelaunch plan` and `python -m launcher --help` do not pay for torch and Ray.
"""

_EXPORTS = {
    "Launcher": "launcher.api",
    "LaunchConfig": "launcher.api",
    "GenerationResult": "launcher.api",
    "SamplingParams": "workers.sampling",
}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'launcher' has no attribute {name!r}")
