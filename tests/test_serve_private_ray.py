"""`corelaunch serve` always starts a private Ray of this host. Inside a Ray job (which sets
RAY_ADDRESS) or beside a cluster `ray start` recorded here, it started one beside that cluster
without a word, its ranks taking CPUs the cluster's scheduler also counts; and `--ray-address`,
which every other launch command takes, was argparse's bare "unrecognized arguments"."""

from __future__ import annotations

import socket

import pytest

from launcher.cli import main, serve_command
from launcher.cluster import ray_cluster


def _free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def test_ray_address_is_refused_with_where_a_cluster_server_comes_from(capsys, ray_tripwire):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--ray-address", "10.0.0.5:6379"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert ("argument --ray-address: (10.0.0.5:6379) is not taken: corelaunch serve always starts a private Ray of "
            "this host alone; to serve on a Ray cluster, deploy launcher.serving.openai_app:build_app there with "
            "`serve run` or `serve deploy`") in err, err


def test_a_cluster_the_server_does_not_join_is_named(monkeypatch, capsys, ray_tripwire):
    monkeypatch.setattr(ray_cluster, "recorded_cluster", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert serve_command.cluster_not_joined() is None
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert serve_command.cluster_not_joined() is None
    monkeypatch.setattr(ray_cluster, "recorded_cluster", lambda: "127.0.0.1:6390")
    monkeypatch.delenv("RAY_ADDRESS")
    assert serve_command.cluster_not_joined().startswith(
        "the cluster `ray start` recorded on this machine (127.0.0.1:6390) is not joined: corelaunch serve always "
        "starts a private Ray of this host alone, beside that cluster and unseen by its scheduler")
    # a Ray job's driver: the command plans, then says so before starting its own Ray (stopped here)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6390")
    monkeypatch.setattr(serve_command, "_serve", lambda *args: 0)
    assert main(["serve", "--port", _free_port(), "--no-compile", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "corelaunch serve: RAY_ADDRESS (127.0.0.1:6390) is not joined: corelaunch serve always starts" in err, err


def test_a_private_ray_that_does_not_start_is_one_line_with_its_exit_code(monkeypatch, capsys):
    """generate said it in one line (exit 3, or 2 naming a setting); serve let the error escape as a
    traceback (exit 1)."""
    from launcher.errors import RayStartFailed
    from launcher.serving.ingress import IngressPlan

    monkeypatch.setattr(ray_cluster, "recorded_cluster", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(serve_command, "ingress_plan", lambda args, mode: IngressPlan(mode, 1, 1, {}))  # no env
    for err, code in ((RayStartFailed("the private Ray cluster did not start: raylet late"), 3),
                      (ValueError("the private Ray cluster did not start (...): raise the limit"), 2)):
        def refused(*args, error=err, **kwargs):
            raise error

        monkeypatch.setattr(ray_cluster, "connect", refused)
        assert main(["serve", "--port", _free_port(), "--no-compile", "--quiet"]) == code
        assert f"corelaunch serve: {err}\n" in capsys.readouterr().err
