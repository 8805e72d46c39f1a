"""Rank actors that misbehave on purpose, for the fault-tolerance tests (imported by Ray workers:
the driver's working directory, the repository root, is on their sys.path)."""

from __future__ import annotations

import os
import time

import ray

from launcher.cluster.ray_worker import ACTOR_OPTIONS, RayRankWorker


class _CrashOnGenerate(RayRankWorker):
    """Starts and loads normally, then its process dies on every request (a static batch, or
    streaming requests handed to its serving loop): a crash loop."""

    def generate(self, request, static_id=None):
        os._exit(3)

    def submit_requests(self, requests, number=None):
        os._exit(3)


class _NeverJoins(RayRankWorker):
    """Rank 1 never arrives at the rendezvous (stuck before joining the process group)."""

    def init_backend(self, host, port, timeout_s, node_groups=None):
        if self.spec.rank == 1:
            time.sleep(3600)
        return super().init_backend(host, port, timeout_s, node_groups)


class _SlowBackendImport(RayRankWorker):
    """Its backend takes 5 s to import (tests/slow_import_backend.py), as torch's import can on a
    busy host; otherwise a normal rank."""

    def __init__(self, spec):
        import dataclasses

        import workers.backends

        entry = workers.backends.BACKENDS["cpu"]
        slow = "tests.slow_import_backend:CpuBackend"
        workers.backends.BACKENDS["cpu"] = (slow if isinstance(entry, str)
                                            else dataclasses.replace(entry, implementation=slow))
        super().__init__(spec)


class _SlowLoad(RayRankWorker):
    """Rank 1 takes an hour to load its shard."""

    def load(self, load_spec):
        if self.spec.rank == 1:
            time.sleep(3600)
        return super().load(load_spec)


class _SlowToLeave(RayRankWorker):
    """Rank 1's serving loop takes 3 s more to return once stopped, and its shutdown never returns:
    both of a group shutdown's waits meet it."""

    def serve(self):
        out = super().serve()
        if self.spec.rank == 1:
            time.sleep(3)
        return out

    def shutdown(self) -> None:
        if self.spec.rank == 1:
            time.sleep(3600)
        super().shutdown()


CrashOnGenerate = ray.remote(**ACTOR_OPTIONS)(_CrashOnGenerate)
SlowLoad = ray.remote(**ACTOR_OPTIONS)(_SlowLoad)
SlowToLeave = ray.remote(**ACTOR_OPTIONS)(_SlowToLeave)
NeverJoins = ray.remote(**ACTOR_OPTIONS)(_NeverJoins)
SlowBackendImport = ray.remote(**ACTOR_OPTIONS)(_SlowBackendImport)
