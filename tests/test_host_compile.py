"""Ranks on one host compile each graph once (workers/host_compile.py): the graph lock, the names
graphs get, rank-agnostic graphs for the layers whose numbers differ by rank, and two real
processes compiling the same graph at the same moment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from workers.collectives import SingleRank
from workers.host_compile import LOCK_DIR, graph_key, graph_lock
from workers.kernels import small_linear
from workers.layers import VocabParallelEmbedding
from workers.moe import MoEBlock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def traced_keys(module: torch.nn.Module, *inputs: torch.Tensor) -> list[str]:
    """graph_key of each graph dynamo traces for module(*inputs) (nothing compiled)."""
    keys = []

    def record(gm, example_inputs):
        keys.append(graph_key(gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    small_linear.mark_constants_for_tracing()  # as workers/compiled.py does before compiling
    torch.compile(module, backend=record, fullgraph=True, dynamic=False)(*inputs)
    return keys


def test_a_held_graph_lock_makes_the_same_graph_wait_and_no_other(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with graph_lock("a" * 40) as held:
        assert held and (tmp_path / LOCK_DIR / f"{'a' * 40}.lock").is_file()
        start = time.monotonic()
        with graph_lock("a" * 40, wait_s=0.3) as second:  # another open file: flock makes it wait
            assert second is False and time.monotonic() - start >= 0.3
        assert "another process has been compiling graph aaaaaaaaaaaa for over 0 s" in capsys.readouterr().err
        with graph_lock("b" * 40, wait_s=0.3) as other:
            assert other is True
    with graph_lock("a" * 40, wait_s=0.3) as again:  # released on leaving the block
        assert again is True


class Step(torch.nn.Module):
    def forward(self, x, w):
        return torch.nn.functional.silu(x @ w)


def test_graphs_are_named_by_code_and_input_shapes_not_values():
    same, other_values, other_shape = (traced_keys(Step(), x, w) for x, w in [
        (torch.randn(2, 8), torch.randn(8, 8)), (torch.ones(2, 8), torch.zeros(8, 8)),
        (torch.randn(3, 8), torch.randn(8, 8))])
    assert same == other_values and same != other_shape and len(same) == 1 and len(same[0]) == 40


def test_ranks_embeddings_and_experts_trace_the_same_graph():
    ids = torch.tensor([[3, 70, 127, 64]])
    collectives = SingleRank()
    table = torch.randn(64, 16)
    embeds = [VocabParallelEmbedding(table, (start, start + 64), torch.float32, collectives) for start in (0, 64)]
    keys = [traced_keys(embed, ids) for embed in embeds]
    assert len(keys[0]) == 1 and keys[0] == keys[1]
    # and each still owns its own rows: ids 3 on rank 0, 70 and 127 and 64 on rank 1
    out0, out1 = (embed(ids) for embed in embeds)
    assert torch.equal(out0[0, 0], table[3]) and not out0[0, 1:].any()
    assert torch.equal(out1[0, 1:], table[[6, 63, 0]]) and not out1[0, 0].any()

    hidden, inter = 16, 8
    experts = [(torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter)) for _ in range(4)]
    router = torch.randn(4, hidden)
    blocks = [MoEBlock(router, experts[first:first + 2], first, 2, 1.0, False, torch.float32, collectives)
              for first in (0, 2)]
    x = torch.randn(1, 3, hidden)
    keys = [traced_keys(block, x) for block in blocks]
    assert len(keys[0]) == 1 and keys[0] == keys[1]
    # the two ranks' partial sums add up to the block over all four experts on one rank
    whole = MoEBlock(router, experts, 0, 2, 1.0, False, torch.float32, collectives)
    torch.testing.assert_close(blocks[0](x) + blocks[1](x), whole(x))


COMPILE_AT_ONCE = """
import json, sys, time
from pathlib import Path
import torch
import torch._inductor.compile_fx  # imported before the meeting point: both compile at the same moment
from torch._dynamo.utils import counters
from workers.kernels import small_linear
from workers.host_compile import inductor_once_per_host

meeting, me = Path(sys.argv[1]), sys.argv[2]
(meeting / me).touch()
deadline = time.monotonic() + 120
while len(list(meeting.iterdir())) < 2 and time.monotonic() < deadline:
    time.sleep(0.005)
step = torch.compile(lambda x, w: torch.nn.functional.silu(x @ w).sum(-1), backend=inductor_once_per_host,
                     dynamic=False)
step(torch.randn(4, 32), torch.randn(32, 32))
print(json.dumps({name: counters["inductor"][name] for name in ("fxgraph_cache_miss", "fxgraph_cache_hit")}))
"""


@pytest.mark.slow
def test_two_processes_compiling_the_same_graph_at_once_compile_it_once(tmp_path):
    meeting = tmp_path / "meeting"
    meeting.mkdir()
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "PYTHONPATH": REPO}
    procs = [subprocess.Popen([sys.executable, "-c", COMPILE_AT_ONCE, str(meeting), str(i)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    counts = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        counts.append(json.loads(out.strip().splitlines()[-1]))
    # one process compiled, the other waited and took the graph from the cache (without the lock
    # both miss: they meet before compiling)
    assert sorted((c["fxgraph_cache_miss"], c["fxgraph_cache_hit"]) for c in counts) == [(0, 1), (1, 0)]
