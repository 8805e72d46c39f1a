"""The same shutdown as tests/test_rank_worker_shutdown.py, through real Ray actors: rank 0 serves,
rank 1 never joins its serving loop (a peer that stopped or hung), and a static batch holds rank
0's loop in a collective for it. actor.shutdown() returns within SHUTDOWN_LOOP_WAIT_S and a margin,
the stuck call ending with CollectivesClosed; it waited until the launcher's ray.kill before."""

from __future__ import annotations

import time

import pytest

from tests.model_factory import build_random_model, save_model

MARGIN_S = 8.0
"""The forced close, the compute thread's release (at most SHUTDOWN_RELEASE_WAIT_S) and Ray's calls."""


@pytest.mark.slow  # not exclusive: its bound (5 to 13 s) leaves a busy neighbour 8 s
def test_an_actors_shutdown_ends_a_loop_stuck_for_a_peer_that_never_joins(tmp_path, ray_session):
    import ray

    from launcher.cluster.ray_worker import RankWorkerActor
    from shardlib.model_config import load_model_config
    from shardlib.sampling_params import SamplingParams
    from shardlib.sharding import ShardLayout
    from workers.rank_worker import SHUTDOWN_LOOP_WAIT_S, GenerateRequest, LoadSpec, ServeSpec, WorkerSpec

    path = save_model(build_random_model("llama"), tmp_path / "m")
    config = load_model_config(path)
    actors = [RankWorkerActor.options(num_cpus=0).remote(WorkerSpec(rank=r, world_size=2, backend="cpu", threads=1))
              for r in range(2)]
    try:
        port = ray.get(actors[0].rendezvous_port.remote("127.0.0.1"), timeout=60)
        ray.get([a.init_backend.remote("127.0.0.1", port, 60.0, [[0, 1]]) for a in actors], timeout=60)
        load = LoadSpec(config=config, layout=ShardLayout.for_model(config, 2), dtype="float32", model_dir=str(path))
        ray.get([a.load.remote(load) for a in actors], timeout=60)
        ray.get([a.prepare_serving.remote(ServeSpec(max_num_seqs=2, max_prefill_tokens=64, cache_slots=64))
                 for a in actors], timeout=60)
        serving = actors[0].serve.remote()  # rank 1's serve() is never called
        batch = actors[0].generate.remote(GenerateRequest([[5, 6, 7]], [SamplingParams()], 4), 1)
        ready, _ = ray.wait([serving, batch], timeout=2.0)
        assert ready == [], "rank 0's loop ended without its peer"  # it waits in a collective for rank 1
        start = time.monotonic()
        ray.get(actors[0].shutdown.remote(), timeout=SHUTDOWN_LOOP_WAIT_S + MARGIN_S + 10)
        took = time.monotonic() - start
        assert SHUTDOWN_LOOP_WAIT_S <= took < SHUTDOWN_LOOP_WAIT_S + MARGIN_S, took
        with pytest.raises(Exception, match="CollectivesClosed"):
            ray.get(serving, timeout=10)
        with pytest.raises(Exception):  # noqa: PT011 - whichever of the loop's errors the batch carries
            ray.get(batch, timeout=10)
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
