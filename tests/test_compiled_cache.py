"""A persisted compile cache is reused by a fresh process: nothing is compiled again.

Each step runs in its own process, as a restarted worker would: one RankWorker (no Ray) loads a
tiny model with compiling on, warm-up on and its compile cache in a temporary directory, then
generates. The first process finds the cache empty and compiles every graph; the second finds them
all there (inductor's FX-graph and AOTAutograd cache counters) and gives the same tokens. Two
processes compiling with a cold cache take most of a minute: slow (compiling itself is checked in
the fast lane by tests/test_compiled.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.model_factory import build_random_model, save_model

REPO = Path(__file__).resolve().parents[1]

WORKER = """
import json, sys
from shardlib.buckets import Buckets
from shardlib.model_config import load_model_config
from shardlib.sharding import ShardLayout
from workers.rank_worker import GenerateRequest, LoadSpec, RankWorker, WorkerSpec
from workers.sampling import SamplingParams

model_dir, cache_dir = sys.argv[1], sys.argv[2]
config = load_model_config(model_dir)
worker = RankWorker(WorkerSpec(rank=0, world_size=1, backend="cpu", threads=1))
worker.init_backend("127.0.0.1", 0, timeout_s=60)
stats = worker.load(LoadSpec(config=config, layout=ShardLayout.for_model(config, 1), dtype="float32",
                             model_dir=model_dir, compile=True, buckets=Buckets.build(context=[16], token=[16]),
                             compile_cache_dir=cache_dir, warm_up=True))
[out] = worker.generate(GenerateRequest(prompts=[[5, 9, 33, 17, 80]], params=[SamplingParams()], max_new_tokens=6))
print(json.dumps({"load": stats.compile, "after": worker.compile_stats(), "tokens": out.token_ids}))
"""


def run_worker(model_dir: Path, cache_dir: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", WORKER, str(model_dir), str(cache_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_fresh_process_reuses_the_persisted_graphs(tmp_path):
    model_dir = save_model(build_random_model("llama", seed=3), tmp_path / "tiny")
    cache = tmp_path / "cache"
    cold = run_worker(model_dir, cache)
    assert [(g["phase"], g["length"]) for g in cold["load"]["graphs"]] == [("context", 16), ("token", 16)]
    assert cold["load"]["fxgraph_cache_miss"] > 0 and cold["load"]["autograd_cache_miss"] > 0
    assert any(cache.iterdir())  # the cache went where it was told

    warm = run_worker(model_dir, cache)
    assert warm["tokens"] == cold["tokens"]
    assert len(warm["load"]["graphs"]) == 2
    assert warm["load"]["fxgraph_cache_miss"] == 0 and warm["load"]["autograd_cache_miss"] == 0
    assert warm["load"]["fxgraph_cache_hit"] == cold["load"]["fxgraph_cache_miss"]
    # the request used only the warmed-up graphs: nothing was traced or compiled after load
    assert warm["after"]["fxgraph_cache_miss"] == 0 and len(warm["after"]["graphs"]) == 2
    assert warm["after"]["dynamo_graphs"] == warm["load"]["dynamo_graphs"]

