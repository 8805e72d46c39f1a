"""`corelaunch serve` plans for the private Ray it starts, whatever RAY_ADDRESS says: planned with
no address, RAY_ADDRESS (which serve never joins) made it plan for a cluster elsewhere, skipping
this host's checks, so `--backend cuda` on a host without a GPU started Ray and Serve and failed
25 s later inside a replica; refused in 0.4 s without RAY_ADDRESS. Serve's processes must not
inherit RAY_ADDRESS either: each replica's Launcher plans with no address, and read it as well."""

from __future__ import annotations

import os
import socket

import pytest

from launcher.cli import main, serve_command
from launcher.cluster import ray_cluster
from workers.backends import planner_targets

plain_host_only = pytest.mark.skipif(planner_targets.cuda_devices_present(), reason="this host has a CUDA GPU")


def _free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


@plain_host_only
def test_cuda_without_a_gpu_is_refused_before_ray_though_ray_address_names_a_cluster(monkeypatch, capsys,
                                                                                     ray_tripwire):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")
    served = []
    monkeypatch.setattr(serve_command, "_serve", lambda *args: served.append(args) or 0)
    code = main(["serve", "--backend", "cuda", "--device-memory-gib", "16", "--port", _free_port(), "--no-compile",
                 "--quiet"])
    err = capsys.readouterr().err
    assert (code, served) == (2, []), err
    # serve's own fixes: it takes no --ray-address
    assert err == f"corelaunch serve: {planner_targets.NO_GPU_FOR_SERVE}\n", err
    assert "--ray-address" not in err and "serve run" in err and "--backend cpu" in err


def test_serves_processes_do_not_inherit_ray_address(monkeypatch, capsys, ray_tripwire):
    monkeypatch.setattr(ray_cluster, "recorded_cluster", lambda: None)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")
    seen = []
    monkeypatch.setattr(serve_command, "_serve", lambda *args: seen.append(os.environ.get("RAY_ADDRESS")) or 0)
    assert main(["serve", "--port", _free_port(), "--no-compile", "--quiet"]) == 0
    assert "RAY_ADDRESS (127.0.0.1:9) is not joined" in capsys.readouterr().err  # the note still comes first
    assert seen == [None]
