"""CPU backend: torch.distributed over gloo, one process per rank, a fixed number of torch threads."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from workers.backends.base import Backend, RendezvousInfo
from workers.collectives import Collectives, SingleRank, TorchDistributedCollectives


class CpuBackend(Backend):
    name = "cpu"

    def setup_process(self, rank: int, world_size: int, threads: int) -> None:
        # Each rank gets a fixed thread count chosen by the coordinator from its CPU bundle: ranks
        # on one host must not oversubscribe the cores, or every rank's matmuls slow down together.
        threads = max(1, int(threads))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)

    def init_process_group(self, rendezvous: RendezvousInfo, rank: int, world_size: int,
                           timeout_s: float, node_groups: list[list[int]] | None = None) -> Collectives:
        if world_size == 1:
            return SingleRank()
        dist.init_process_group(
            backend="gloo",
            init_method=f"tcp://{rendezvous.host}:{rendezvous.port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        return TorchDistributedCollectives()

    def shutdown(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
