"""What each backend plans against, and whether this host has a CUDA GPU: everything the driver
asks of a backend before Ray starts, apart from the backends themselves.

Kept apart from cpu.py, neuron.py and cuda.py because those import torch (about 2 s on a 2-core
host), and planning needs none of it: `corelaunch plan|generate|serve` and every Serve replica
plan first. torch is imported here only on a host that exposes an NVIDIA device node, to ask
whether torch can use it.
"""

from __future__ import annotations

import glob

from shardlib.instances import CPU_TARGET, GIB, gpu_node

GPU_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/dxg")
"""Where an NVIDIA GPU shows itself to a Linux process: the driver's device nodes, or WSL 2's GPU
paravirtualisation device. Without any of them torch.cuda cannot find a GPU."""

_NO_GPU_HERE = ("--backend cuda: this host shows no CUDA GPU to torch (torch.cuda.is_available() is False: no "
                "GPU or driver, or torch's CPU build, which constraints.txt installs); on a GPU host install a "
                "CUDA build of torch")
NO_GPU = (f"{_NO_GPU_HERE}, for a Ray cluster whose GPUs are on other nodes pass --ray-address and "
          "--device-memory-gib (the memory of one GPU), or use --backend cpu")
NO_GPU_FOR_SERVE = (f"{_NO_GPU_HERE}, for a Ray cluster whose GPUs are on other nodes deploy "
                    "launcher.serving.openai_app:build_app there with `serve run` or `serve deploy` (corelaunch "
                    "serve starts a private Ray of this host alone), or use --backend cpu")
"""NO_GPU as `corelaunch serve` words it: it takes no --ray-address."""


def cpu_target(request):
    """The cpu backend plans against --instance when given (sizing for another machine), else this
    host's cores and RAM."""
    if request.device_memory_gib is not None:
        raise ValueError(f"--device-memory-gib ({request.device_memory_gib}) is for device backends; the cpu "
                         f"backend plans against this host's RAM: drop it")
    return request.instance or CPU_TARGET


def neuron_target(request):
    """A Neuron launch plans against the instance type it names (shardlib/instances.py's table)."""
    if request.instance is None:
        raise ValueError("the neuron backend needs --instance (e.g. trn1.32xlarge) for planning")
    if request.device_memory_gib is not None:
        raise ValueError(f"--device-memory-gib ({request.device_memory_gib}) does not apply to the neuron "
                         f"backend: the memory per NeuronCore comes from --instance {request.instance}; drop it")
    return request.instance


def cuda_devices_present() -> bool:
    """True where torch can use a CUDA GPU (a GPU with the CPU build of torch does not count)."""
    if not any(glob.glob(pattern) for pattern in GPU_DEVICE_FILES):
        return False  # no GPU device node: nothing for torch to find, and no reason to import it
    import torch

    return torch.cuda.is_available()


def cuda_target(request):
    """The GPUs of this host (count and memory from torch.cuda; --device-memory-gib overrides the
    memory), or, for a remote cluster this host cannot see into, GPUs of --device-memory-gib each,
    their number left to Ray's placement to check."""
    if request.instance is not None:
        raise ValueError(f"--instance {request.instance} names a Neuron instance type or the cpu host; the cuda "
                         f"backend plans against GPU memory: drop --instance (and give --device-memory-gib "
                         f"for GPUs this host cannot see)")
    given = None if request.device_memory_gib is None else int(request.device_memory_gib * GIB)
    if not cuda_devices_present():
        if request.cluster_on_this_host or given is None:
            raise ValueError(NO_GPU)
        return gpu_node(given)
    import torch

    # This initialises CUDA in the driver process; that is safe because Ray starts ranks as new
    # processes, never as forks of the driver.
    props = torch.cuda.get_device_properties(0)
    return gpu_node(given or props.total_memory, torch.cuda.device_count(), props.name)
