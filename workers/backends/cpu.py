"""CPU backend: torch.distributed over gloo, one process per rank, a fixed number of torch threads."""

from __future__ import annotations

import os
import warnings

import torch

from workers.backends.base import (Backend, CompileOptions, RendezvousInfo, join_torch_distributed,
                                   leave_torch_distributed)
from workers.backends.inductor import compile_per_bucket, prefetch_compiler
from workers.collectives import Collectives, SingleRank


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
        """gloo for every rank, plus shared memory between ranks that share a node.

        CORELAUNCH_COLLECTIVES (read here, in the worker's environment) picks the path: auto (the
        default: shared memory where ranks share a node, gloo across nodes and as the fallback),
        gloo (gloo only), shm (like auto, but fail instead of falling back). See workers/shm/."""
        if world_size == 1:
            return SingleRank()
        from workers.shm.group import build_cpu_collectives, mode_from_env

        mode = mode_from_env()  # before joining, so a bad value fails alike on every rank
        join_torch_distributed("gloo", rendezvous, rank, world_size, timeout_s)
        # A waiting rank gives up after the process group's own timeout, naming whom it waited for.
        return build_cpu_collectives(rank, world_size, node_groups, timeout_s, mode)

    def prefetch_compiler(self) -> None:
        prefetch_compiler()

    def prepare_model(self, model: torch.nn.Module, compile: CompileOptions | None = None):
        """Float32 linear weights repacked as column panels (workers/packed_weight.py), then eager,
        or inductor graphs per bucket (workers/backends/inductor.py)."""
        from workers import native_build
        from workers.kernels import packed_linear, prefill_attention
        from workers.packed_weight import pack_linear_weights

        pack_linear_weights(model)
        if not packed_linear.available() and not packed_linear.turned_off():
            # Slower, not wrong: the layers fall back to the small-batch kernel and F.linear.
            warnings.warn(f"corelaunch: float32 weights are not packed ({packed_linear.unavailable_reason}); "
                          f"decode products take the slower paths", RuntimeWarning, stacklevel=2)
        # Eager and compiled prefills alike take it, float32 only: a model in another dtype never
        # builds it (workers/serving/loop.py asks the same way), so it is not built for nothing here.
        if (getattr(model, "dtype", torch.float32) == torch.float32 and not prefill_attention.available()
                and not native_build.turned_off("CORELAUNCH_PREFILL_ATTENTION")):
            warnings.warn(f"corelaunch: prefill attention stays on torch's attention "
                          f"({prefill_attention.unavailable_reason})", RuntimeWarning, stacklevel=2)
        from workers.kernels import decode_attention

        # Built now (first use on this host), not at the first eager decode step or while the first
        # decode graph is traced; float32 only, the one dtype it takes (layers.py asks per step).
        if (getattr(model, "dtype", torch.float32) == torch.float32 and not decode_attention.available()
                and not native_build.turned_off("CORELAUNCH_DECODE_ATTENTION")):
            warnings.warn(f"corelaunch: decode attention stays on torch's attention (eager) or the traced "
                          f"products and sums (compiled) ({decode_attention.unavailable_reason})",
                          RuntimeWarning, stacklevel=2)
        if compile is None:
            return model
        return compile_per_bucket(model, compile)

    def shutdown(self) -> None:
        leave_torch_distributed()
