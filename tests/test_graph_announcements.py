"""What rank 0 says about a graph set up during a request (workers/compiled.py, CompiledCausalLM._graph):
before the call, that the graph is being set up (whether the compile cache has it is known only
afterwards); after it, "built" when inductor compiled it and "took ... from the compile cache" when
the cache had it. Both lines said "building"/"built" of a graph read from the cache in well under a
second, on every launch from a compiled directory without --warm-up.

A real compile of a small function inside the announcement (the model's own graphs cost a minute
cold on 2 cores; what is tested is how the counters of that compile are read), on a fresh inductor
cache and then, after dynamo forgets it, on the same cache."""

from __future__ import annotations

import torch

from shardlib.buckets import Buckets
from tests.test_compile_once import scaled_sum
from tests.test_engine import fresh_model


def _set_up_once(lines: list[str]) -> None:
    from workers.compile_once import BACKEND
    from workers.compiled import CompiledCausalLM

    torch._dynamo.reset()  # as a fresh process: dynamo has not seen the function
    model = CompiledCausalLM(fresh_model(), Buckets.build(context=[8], token=[16], batch=[1]), announce=lines.append)
    with model._graph("serve-decode", 1, 16, "serve-decode"):
        out = torch.compile(scaled_sum, backend=BACKEND, dynamic=False)(torch.ones(4, 8))
    assert out.tolist() == [32.0] * 4
    with model._graph("serve-decode", 1, 16, "serve-decode"):  # seen: nothing more said
        pass


def test_a_compiled_graph_is_called_built_and_a_cached_one_taken_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    cold: list[str] = []
    _set_up_once(cold)
    assert len(cold) == 2, cold
    assert cold[0] == ("corelaunch: setting up the graph for serve-decode batch 1 x 16 (first use: from the "
                       "compile cache, else built and cached for later runs)")
    assert cold[1].startswith("corelaunch: built the serve-decode graph for batch 1 x 16 in ")
    assert cold[1].endswith(" s (cached for later runs)")

    warm: list[str] = []
    _set_up_once(warm)
    assert len(warm) == 2 and warm[0] == cold[0], warm
    assert warm[1].startswith("corelaunch: took the serve-decode graph for batch 1 x 16 from the compile cache in ")
