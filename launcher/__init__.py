"""The coordinator: the driver API (api.py), its errors and planning front end, and below it
cli/ (the corelaunch command), cluster/ (Ray placement, rank actors, TP groups, replicas) and
artifacts/ (compiled-model and pre-sharded cache directories).

`from launcher import Launcher, LaunchConfig, SamplingParams` — imported lazily so that
`corelaunch plan` and `python -m launcher --help` do not pay for torch and Ray.
"""

_EXPORTS = {
    "Launcher": "launcher.api",
    "LaunchConfig": "launcher.api",
    "GenerationResult": "launcher.api",
    "SamplingParams": "shardlib.sampling_params",  # workers.sampling's own, without importing torch
}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'launcher' has no attribute {name!r}")
