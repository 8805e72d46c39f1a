"""Device backends behind one small interface (see base.Backend).

`get_backend(name)` is the only way the rest of corelaunch picks one, so adding a backend (cuda
over NCCL, say) is one module plus one line in BACKENDS.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from workers.backends.base import Backend

# backend name -> "module:class"; imported lazily so the neuron libraries load only when asked for.
BACKENDS = {
    "cpu": "workers.backends.cpu:CpuBackend",
    "neuron": "workers.backends.neuron:NeuronBackend",
}


def get_backend(name: str, **options) -> Backend:
    """Instantiate backend `name`; `options` go to its constructor (the neuron backend takes lnc)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    module_name, cls_name = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)(**options)


def neuron_devices_present() -> bool:
    """True on a host whose Neuron driver exposes devices (/dev/neuron0, ...)."""
    return any(Path("/dev").glob("neuron[0-9]*"))


def default_backend_name() -> str:
    """neuron where Neuron devices are present, else cpu."""
    return "neuron" if neuron_devices_present() else "cpu"
