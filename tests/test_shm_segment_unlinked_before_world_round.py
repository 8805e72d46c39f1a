"""A node leader's shared-memory segment loses its name as soon as the node's ranks have attached,
not after set-up's last world-wide round (workers/shm/group.py).

A review: the leader unlinked only after that round, so while a rank on another node was slow to
reach it, a SIGKILL of every rank (the driver's rendezvous timeout ray.kills the actors) left the
4 MiB segment named until another group's orphan sweep. Here ranks 0 and 1 share "node 0", rank 2
is "node 1" and stalls before that round; every rank is killed while ranks 0 and 1 wait in it.

The segments go under tmp_path (group.SHM_DIR), never the host's /dev/shm: only this test's own
names are watched, so it need not run alone.
"""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
import torch

from workers.net import free_port_for_a_late_bind

LAST_ROUND = 3  # _agree's third call: step 3's round, after the attach
SET_UP_S = 120.0  # three spawned processes importing torch on a busy two-core host
UNLINK_GRACE_S = 5.0  # the leader's watch polls every millisecond: this is slack, not the expected wait


def _rank(rank: int, world_size: int, port: int, shm_dir: str, markers: str) -> None:
    """A rank that records reaching set-up's last round (with its own step-3 error, None when it
    attached) in markers/<rank>; rank 2 then stalls there until killed."""
    import torch.distributed as dist

    import workers.shm.group as group

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=SET_UP_S))
    group.SHM_DIR = shm_dir
    real_agree, calls = group._agree, [0]

    def agree_marking_the_last_round(error, size):
        calls[0] += 1
        if calls[0] == LAST_ROUND:
            with open(os.path.join(markers, str(rank)), "w") as out:
                out.write(repr(error))
            if rank == 2:
                time.sleep(10 * SET_UP_S)  # "another node", slow to reach the round: killed first
        return real_agree(error, size)

    group._agree = agree_marking_the_last_round
    group.build_cpu_collectives(rank, world_size, [[0, 1], [2]], SET_UP_S, "shm")
    time.sleep(10 * SET_UP_S)


def _wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.slow
def test_a_leader_killed_in_the_last_world_round_leaves_no_segment(tmp_path):
    shm_dir, markers = tmp_path / "shm", tmp_path / "markers"
    shm_dir.mkdir()
    markers.mkdir()
    ctx = torch.multiprocessing.get_context("spawn")
    port = free_port_for_a_late_bind()
    procs = [ctx.Process(target=_rank, args=(r, 3, port, str(shm_dir), str(markers)), daemon=True)
             for r in range(3)]
    for p in procs:
        p.start()
    try:
        reached = _wait_for(lambda: len(list(markers.iterdir())) == 3, SET_UP_S)
        assert reached, f"only ranks {sorted(p.name for p in markers.iterdir())} reached set-up's last round"
        # Both ranks of node 0 attached, so the segment existed under its name and was mapped.
        assert [(markers / r).read_text() for r in ("0", "1")] == ["None", "None"]
        _wait_for(lambda: not any(shm_dir.iterdir()), UNLINK_GRACE_S)
    finally:
        for p in procs:
            if p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)  # what ray.kill does on the driver's timeout
        for p in procs:
            p.join(timeout=10)
    left = sorted(p.name for p in shm_dir.iterdir())
    assert left == [], f"the killed leader's segment was left behind: {left}"
