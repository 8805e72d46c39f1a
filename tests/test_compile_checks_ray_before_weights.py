"""`corelaunch compile` reaches Ray, and refuses a --cpus-per-rank its private cluster can never
hold, before it writes any rank's weights: both were found only after the weights were written
(minutes for a large model), and that work thrown away."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from launcher.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tests.model_factory import build_random_model, save_model

    return save_model(build_random_model(seed=3), tmp_path_factory.mktemp("model"))


@pytest.fixture
def weights_written(monkeypatch) -> list:
    """Records each save_presharded call (and writes nothing)."""
    from shardlib import presharded

    calls = []

    def record(out_dir, *args, **kwargs):
        calls.append(out_dir)
        raise RuntimeError("the weights were written")

    monkeypatch.setattr(presharded, "save_presharded", record)
    return calls


def test_a_ray_address_that_does_not_answer_is_refused_before_the_weights(model_dir, tmp_path, capsys,
                                                                            monkeypatch, weights_written):
    """Ray's connect is stood in for by its refusal (tests/test_ray_connect_e2e.py runs the real one):
    a test process may hold a Ray session already, which connect shares whatever the address."""
    from launcher.cluster import ray_cluster
    from launcher.errors import LaunchError

    def unanswered(address, **kwargs):
        raise LaunchError(f"no Ray cluster answered at {address!r} (--ray-address; connection refused); start one")
    monkeypatch.setattr(ray_cluster, "connect", unanswered)
    address = "127.0.0.1:1"
    code = main(["compile", "--model", str(model_dir), "--out", str(tmp_path / "c"), "--buckets", "16",
                 "--ray-address", address, "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and f"no Ray cluster answered at '{address}'" in err, err
    assert weights_written == [] and list(tmp_path.iterdir()) == []


@dataclass
class PrivateCluster:
    """What ray_cluster.connect returns for a private cluster started here (closing it is the test's)."""
    started_here: bool = True
    address: str = "private"
    closed: bool = False

    def close(self) -> None:
        self.closed = True


def test_cpus_per_rank_a_private_cluster_cannot_hold_is_refused_before_the_weights(model_dir, tmp_path, capsys,
                                                                                    monkeypatch, weights_written):
    from launcher.cluster import placement, ray_cluster

    cluster = PrivateCluster()
    monkeypatch.setattr(ray_cluster, "connect", lambda *args, **kwargs: cluster)
    # the check before the start (launch_plan.refuse_what_a_private_start_cannot_hold) counts this
    # host's CPUs: a host of 64 passes it, and the fake cluster's 2-CPU node is what refuses
    monkeypatch.setattr(ray_cluster, "private_cluster_cpus", lambda num_cpus=None: 64)
    monkeypatch.setattr(placement, "alive_nodes", lambda: [placement.NodeInfo(
        node_id="n1", address="127.0.0.1", total={"CPU": 2.0}, free={"CPU": 2.0})])
    code = main(["compile", "--model", str(model_dir), "--out", str(tmp_path / "c"), "--buckets", "16",
                 "--cpus-per-rank", "4", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "the private Ray cluster started here cannot place a TP group" in err, err
    assert "Lower --cpus-per-rank (at most 2" in err and err.rstrip().endswith("no weights were written"), err
    assert weights_written == [] and list(tmp_path.iterdir()) == []
    assert cluster.closed  # the connection made for the check is closed again
