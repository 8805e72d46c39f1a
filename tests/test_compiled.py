"""Compiled graphs (workers/compiled.py) against eager execution: identical greedy tokens.

TP 1 runs in this process for every bucket: each context-encoding and token-generation bucket at
two batch buckets, prompts padded on both ends, plus a batch that needs filler rows. TP 3 runs
through the Launcher (real Ray worker processes, the CPU backend's collectives as operators inside
the compiled graphs; marked slow). torch.compile is slow (the first graph of a process takes ~15 s on 2 cores, later ones
~4 s; inductor's cache makes reruns faster), so the models are tiny and the shapes few.
"""

from __future__ import annotations

import functools

import pytest
import torch

from shardlib.buckets import Buckets
from shardlib.model_config import ModelConfig
from tests.model_factory import build_random_model, save_model
from tests.tp_harness import build_rank_model, hf_state_dict
from workers.collectives import SingleRank
from workers.compiled import CompiledCausalLM
from workers.engine import generate
from workers.sampling import SamplingParams

GREEDY = SamplingParams()
NEW = 6
# context buckets 8 and 16, one cache bucket 32 (the smallest holding 16 + NEW), batch buckets 1 and 2
BUCKETS = Buckets.build(context=[8, 16], token=[32], batch=[1, 2])
SHORT, LONG = [5, 9, 33, 17, 80], [7, 100, 21, 4, 66, 8, 120, 3, 44, 12, 61]  # -> context buckets 8, 16


@functools.lru_cache(maxsize=None)
def hf_model():
    return build_random_model("llama", seed=3)


def eager_model():
    hf = hf_model()
    return build_rank_model(ModelConfig.from_dict(hf.config.to_dict()), hf_state_dict(hf), 0, 1, SingleRank())


@pytest.fixture(scope="module")
def compiled():
    # Graphs another module compiled from the same step functions would be reused and not counted.
    torch._dynamo.reset()
    return CompiledCausalLM(eager_model(), BUCKETS)


def tokens(model, prompts, **kwargs):
    return [o.token_ids for o in generate(model, prompts, [GREEDY] * len(prompts), NEW, [], **kwargs)]


@pytest.mark.parametrize("prompts", [[SHORT], [LONG], [SHORT, LONG]], ids=["context8", "context16", "batch2"])
def test_compiled_tokens_equal_eager_for_each_bucket(compiled, prompts):
    eager = eager_model()
    expected = tokens(eager, prompts)  # exact shapes, no buckets
    assert tokens(eager, prompts, buckets=BUCKETS) == expected  # eager at the bucketed shapes
    assert tokens(compiled, prompts) == expected


def test_every_bucket_shape_got_its_own_graph(compiled):
    for prompts in ([SHORT], [LONG], [SHORT, LONG], [LONG, SHORT]):
        tokens(compiled, prompts)
    stats = compiled.stats()
    seen = {(g.phase, g.batch, g.length) for g in stats.graphs}
    assert seen == {("context", 1, 8), ("context", 1, 16), ("context", 2, 16), ("token", 1, 32), ("token", 2, 32)}
    # "layer" granularity: a prologue, a layer and an epilogue graph per shape, shared by both layers
    assert stats.counters["dynamo_graphs"] == 3 * len(seen)


def test_one_prompt_in_a_batch_bucket_of_two_gets_a_filler_row():
    eager = eager_model()
    expected = tokens(eager, [SHORT])
    buckets = Buckets.build(context=[8], token=[32], batch=[2])
    caches = []  # equal tokens alone held with the bucket's batch ignored (review)
    new_cache = eager.new_cache
    eager.new_cache = lambda rows, slots: (caches.append((rows, slots)), new_cache(rows, slots))[1]
    assert tokens(eager, [SHORT], buckets=buckets) == expected
    assert caches == [(2, 32)]  # the prompt's row and a filler row, at the bucket's cache length


def test_shapes_outside_the_buckets_are_refused(compiled):
    cache = compiled.new_cache(1, 64)
    with pytest.raises(ValueError, match=r"token-generation input of batch 1 x length 64 is not a bucket shape"):
        compiled(torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64), cache,
                 torch.tensor([0]))
    with pytest.raises(ValueError, match=r"prompt length \(17\) is longer than the largest context-encoding bucket "
                                         r"\(16\)"):
        generate(compiled, [list(range(1, 18))], [GREEDY], 2, [])


@pytest.mark.slow
@pytest.mark.parametrize("granularity", ["model", "model-decode", "collective"])
def test_other_granularities_equal_eager(granularity):
    torch._dynamo.reset()  # every graph of these shapes is traced here, and counted
    model = CompiledCausalLM(eager_model(), BUCKETS, granularity=granularity)
    assert tokens(model, [SHORT, LONG]) == tokens(eager_model(), [SHORT, LONG])
    # The granularity shaped the graphs (equal tokens alone held with it ignored): one prefill and one
    # decode shape; a whole-model graph each, or a prologue, a layer and an epilogue graph each
    # ("collective": per layer, with the collectives called between graphs, not inside them).
    graphs = {"model": 1 + 1, "model-decode": 3 + 1, "collective": 3 + 3}[granularity]
    assert model.stats().counters["dynamo_graphs"] == graphs
    assert model.collectives.in_graph == (granularity != "collective")


def test_unknown_granularity_is_refused():
    with pytest.raises(ValueError, match="granularity 'graph' must be one of model, layer, model-decode, collective"):
        CompiledCausalLM(eager_model(), BUCKETS, granularity="graph")


TP = 3
TP_MODEL = dict(seed=3, hidden_size=48, num_heads=6, num_kv_heads=3, vocab_size=130, intermediate_size=100,
                tie_word_embeddings=True)  # splits at TP 3: 2 query heads and 1 KV head a rank
# One Ray group at an odd degree (3 ranks on two cores) runs both engines: each cold shape costs ~10 s
# a rank on two cores (the rank that waits for another's compile still traces it), and a second group
# at TP 2 took about a minute more to prove again compiled graphs with collectives inside them.
# Compiled TP 2 through Ray stays covered elsewhere: tests/test_check_bench_cli.py's
# test_check_passes_token_and_logit_matching_against_transformers_at_tp2[ray] (compiled logits against
# transformers), tests/test_compile_message_e2e.py (a cold compile at TP 2, tokens against eager) and
# tests/test_sequence_parallel.py's test_compiled_ray_group_with_split_prefills_gives_the_transformers_tokens.
# The continuous batch: both prompts at one context bucket, both first chunks in one prefill call
# and a decode of two rows, the prompts filling their bucket (16 and 15 of 16 tokens: a call padded
# by a fifth or more runs eagerly). The static batch adds the static engine's two graphs. Every
# bucket and batch shape, and a prompt alone, are the in-process TP 1 tests above: the bucket code
# does not depend on the degree.
FULL = [SHORT + LONG, LONG + [1, 2, 3, 4]]
CONTEXT_BUCKETS, CONTINUOUS_BATCHES, STATIC_BATCH = (16,), [FULL], [SHORT, LONG]


@pytest.mark.slow
def test_tp_compiled_equals_eager_through_ray(ray_session, tmp_path):
    """One compiled launch at TP 3, serving and static engines, against TP 1 eager at exact shapes
    computed in this process (an eager Ray launch as well would only repeat
    tests/test_launcher_generate.py's eager cases)."""
    from launcher.api import Launcher

    hf = build_random_model("llama", **TP_MODEL)
    model_dir = save_model(hf, tmp_path / "model")
    tp1 = build_rank_model(ModelConfig.from_dict(hf.config.to_dict()), hf_state_dict(hf), 0, 1, SingleRank())
    # rendezvous_timeout_s: the ranks' join is not this test's subject, and beside another test's
    # start-up (two at a time on two cores) a third rank importing torch missed the default 30 s once
    with Launcher(model=str(model_dir), tp=TP, context_buckets=CONTEXT_BUCKETS, token_buckets=(32,),
                  max_batch_size=2, rendezvous_timeout_s=120, progress=False) as launcher:
        assert launcher.config.compile  # the default
        compiled = [[r.token_ids for r in launcher.generate(batch, max_new_tokens=NEW, ignore_eos=True)]
                    for batch in CONTINUOUS_BATCHES]
        static = [r.token_ids for r in launcher.generate(STATIC_BATCH, max_new_tokens=NEW, ignore_eos=True,
                                                         batching="static")]
        stats = [s.compile for s in launcher.load_stats]
        [(_, rank0)] = launcher.compile_stats()  # rank 0's graphs as they are after the requests
    assert len(stats) == TP and None not in stats  # every rank runs compiled graphs
    # every prompt fits one chunk: prefills are first chunks, reading only their own slots
    phases = {"serve-prefill-start", "serve-decode", "context", "token"}  # both engines' graphs
    assert {g["phase"] for g in rank0["graphs"]} == phases  # the requests ran through them
    assert compiled == [tokens(tp1, batch) for batch in CONTINUOUS_BATCHES]
    assert static == tokens(tp1, STATIC_BATCH)


def test_a_warmed_up_prefill_graph_serves_every_cache_bucket():
    """A review: the prefill took the mask's first columns as a slice, whose row stride is the cache's
    slot count, and the graph's guards check strides: a request whose new tokens took the cache to
    another token bucket compiled the prefill again, unannounced and uncounted. Last in this file: it
    resets dynamo, and the module's `compiled` fixture had built the context graphs beside 32 slots."""
    buckets = Buckets.build(context=[8], token=[16, 32], batch=[1])
    torch._dynamo.reset()
    model = CompiledCausalLM(eager_model(), buckets)
    model.warm_up()
    warmed = model.stats().counters["dynamo_graphs"]
    generate(model, [SHORT], [GREEDY], 4, [])  # 5 + 4 slots: cache bucket 16, as warm_up built it beside
    generate(model, [SHORT], [GREEDY], 20, [])  # 5 + 20 slots: cache bucket 32, the same context bucket 8
    assert model.stats().counters["dynamo_graphs"] == warmed
