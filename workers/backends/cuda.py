"""CUDA backend: one NVIDIA GPU per rank, torch.distributed over NCCL. Run on a GPU once, at TP 1:
benchmarks/gpu_rank.py built rank 0 with this backend on one H200 (no Ray, so no NCCL group and
no placement) and compared its tokens and logits with transformers' there (README, Measured).
NCCL between ranks and Ray's GPU placement have never run: no machine with several GPUs (or a
Ray install on the GPU machine) was available. CI has no GPU.

What it does on a GPU host (written against torch's documented CUDA and NCCL APIs):
- Each rank's bundle asks Ray for one `GPU`; Ray sets CUDA_VISIBLE_DEVICES for the actor, so the
  rank's GPU is cuda:0 inside its process.
- `init_process_group` joins NCCL through rank 0's rendezvous store, as the cpu backend joins gloo
  (workers/backends/base.py join_torch_distributed); the collectives are workers.collectives.TorchDistributedCollectives, which allocate
  on the tensor's device.
- `prepare_model` moves the rank's model onto the GPU and compiles it with inductor exactly as the
  cpu backend does (workers/backends/inductor.py); the engine puts inputs, KV cache and sampling on
  the model's device.
- The planner plans against the GPUs' memory: measured on this host with torch.cuda, or given with
  --device-memory-gib for a cluster whose GPUs the driver cannot see (planner_targets.py).
Nothing here is installed with corelaunch: it needs a CUDA build of torch on every node.
"""

from __future__ import annotations

import os
import socket

import torch

from workers.backends.base import (Backend, CompileOptions, RendezvousInfo, join_torch_distributed,
                                   leave_torch_distributed)
from workers.backends.inductor import compile_per_bucket, prefetch_compiler
from workers.collectives import Collectives, SingleRank, TorchDistributedCollectives


class CudaBackend(Backend):
    name = "cuda"

    def setup_process(self, rank: int, world_size: int, threads: int) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"rank {rank} on {socket.gethostname()} sees no CUDA GPU (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}, torch {torch.__version__}); the node declares "
                f"GPUs to Ray but torch cannot use them: install a CUDA build of torch there, or check its "
                f"driver with nvidia-smi")
        visible = torch.cuda.device_count()
        if visible != 1:  # every rank would take cuda:0, the same GPU (Ray told not to set the variable)
            raise RuntimeError(
                f"rank {rank} on {socket.gethostname()} sees {visible} GPUs (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}) where Ray should have left it its own one: every rank "
                f"would run on the first; unset RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES where Ray starts")
        torch.cuda.set_device(self.device)
        # Host-side work (sampling bookkeeping, the Python loop) needs few threads.
        torch.set_num_threads(max(1, int(threads)))

    def init_process_group(self, rendezvous: RendezvousInfo, rank: int, world_size: int,
                           timeout_s: float, node_groups: list[list[int]] | None = None) -> Collectives:
        """NCCL between every rank (it picks NVLink or shared memory between GPUs of one node by
        itself, so node_groups is not needed)."""
        if world_size == 1:
            return SingleRank()
        join_torch_distributed("nccl", rendezvous, rank, world_size, timeout_s, device_id=self.device)
        return TorchDistributedCollectives()

    @property
    def device(self) -> torch.device:
        # Ray makes only this rank's GPU visible to its process, so it is always device 0.
        return torch.device("cuda", 0)

    def prefetch_compiler(self) -> None:
        prefetch_compiler()

    def prepare_model(self, model: torch.nn.Module, compile: CompileOptions | None = None):
        """The model on this rank's GPU (its rotary tables are then built there on first use), run
        eagerly or through inductor graphs per bucket like the cpu backend."""
        model = model.to(self.device)
        return model if compile is None else compile_per_bucket(model, compile)

    def shutdown(self) -> None:
        leave_torch_distributed()
