"""`corelaunch generate` on a cold compile cache, end to end through Ray (a fresh process, so
corelaunch starts its own Ray and forwards the workers' output): rank 0's lines about each graph
reach stderr once (not once per rank), the driver then says once how long compiling took, and
stdout stays one JSON object. At TP 2 with --granularity model, which the ranks really use. One new
token, so the prefill chunk's graph is the only one built: a decode graph would add a cold compile of
its own (about 15 s a rank) and say nothing more about the messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.test_compile_cli import PROMPT, REPO, eager_tokens, model_dir  # noqa: F401 - model_dir is a fixture

pytestmark = pytest.mark.slow


FILLING_PROMPT = " ".join([PROMPT, "t3 t44 t12 t61 t7 t100 t21 t4 t66"])
"""15 tokens (the word tokenizer splits "t21" into its special "t2" and an unknown "1"): its bucket of
16 pads it by less than a fifth, so the serving loop runs its graph (a call padded more runs
eagerly: workers/serving/loop.py), and the one new token fits the 16 positions."""


def test_a_cold_cache_says_once_how_long_compiling_took(model_dir, tmp_path):  # noqa: F811
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # cold: nothing cached
    proc = subprocess.run([sys.executable, "-m", "launcher", "generate", "--model", str(model_dir), "--tp", "2",
                           "--buckets", "16", "--granularity", "model", "--max-new-tokens", "1",
                           "--ray-address", "local", "--json", FILLING_PROMPT],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=550)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1
    report = json.loads(proc.stdout)
    assert report["outputs"][0]["token_ids"] == eager_tokens(model_dir, FILLING_PROMPT, 1)
    stats = report["compile"]
    # one whole-step graph for the one shape ("layer" would give three): "model" reached the ranks
    assert stats["dynamo_graphs"] == 1
    assert [g["phase"] for g in stats["graphs"]] == ["serve-prefill-start"]
    assert [g["compiled"] for g in stats["graphs"]] == [True]  # what the summary line is worded from
    # compiled once on the host: by rank 0, or by rank 1 while rank 0 waited (workers/compile_once.py)
    assert stats["fxgraph_cache_miss"] + stats["compiled_by_peer"] == 1

    lines = proc.stderr.splitlines()
    # generate runs through the serving loop: its prefill chunk's graph is the first one built
    # (the line rank 0 prints once the graph is ready can be cut off as the driver exits: it is
    # tested in tests/test_graph_announcements.py)
    setting_up = [line for line in lines if "corelaunch: setting up the graph for serve-prefill-start batch 1 x 16" in line]
    assert len(setting_up) == 1 and "rank 0 " in setting_up[0], proc.stderr  # rank 1 builds it too, silently
    assert not any("from the compile cache in" in line for line in lines), proc.stderr
    summary = [line for line in lines if line.startswith("corelaunch: compiled 1 graph(s) in ")]
    assert len(summary) == 1, proc.stderr
    assert summary[0].endswith(" s during the requests; later runs take them from the cache")
