"""Which prefill calls a compiled cpu serving loop runs eagerly is the group's choice, not each rank's
(workers/serving/loop.py group_eager_from_width).

A rank's own answer depends on its host: whether the prefill attention kernel is built there, its
panel width, CORELAUNCH_PREFILL_ATTENTION in its environment. Ranks that answered differently ran
one prefill call at different shapes (one rank the 1x1800 eager step, another the 1x2048 graph),
whose all-reduces then met with different sizes; and their warm-ups built different graphs, with
forwards the other ranks never joined. Here two real ranks (spawned processes, gloo between them)
differ in CORELAUNCH_PREFILL_ATTENTION: they must hold the same rule and serve a long prompt."""

from __future__ import annotations

import os

import pytest
import torch

from tests.native_kernels import skip_unless_built
from workers.kernels import prefill_attention

pytestmark = [pytest.mark.slow, skip_unless_built(prefill_attention, "the prefill attention kernel")]

PROMPT_LENGTH = 1800
"""In the 2048 chunk bucket, padded by 1.14 (under EAGER_PREFILL_WASTE): a rank with the kernel ran
it through its graph, one without it eagerly (EAGER_PREFILL_WIDTH)."""
TIMEOUT_S = 240.0


def _rank_main(rank: int, world_size: int, config_dict: dict, state: dict, prompt: list[int],
               kernel_off_rank: int) -> tuple[tuple[bool, int], list[int] | None]:
    """On each rank of run_ranks' gloo group: ((whether the kernel covers the prompt's attention here,
    the loop's eager width), the tokens served: rank 0's, None on rank 1)."""
    if rank == kernel_off_rank:  # this rank's host alone turns the kernel off, before anything asks for it
        os.environ["CORELAUNCH_PREFILL_ATTENTION"] = "0"
    else:
        os.environ.pop("CORELAUNCH_PREFILL_ATTENTION", None)
    from shardlib.buckets import Buckets
    from shardlib.model_config import ModelConfig
    from shardlib.serving_shapes import ServingShapes
    from tests.serving_driver import collect, request, run_loops, stop
    from tests.tp_harness import build_rank_model
    from workers.collectives import TorchDistributedCollectives
    from workers.compiled import CompiledCausalLM
    from workers.serving.loop import ServingConfig, ServingLoop

    collectives = TorchDistributedCollectives()
    model = build_rank_model(ModelConfig.from_dict(config_dict), state, rank, world_size, collectives)
    buckets = Buckets.build(max_seq_len=2048, context=(1024, 2048), token=(2048,))
    shapes = ServingShapes.build(buckets, max_num_seqs=1, max_prefill_tokens=2048)
    loop = ServingLoop(CompiledCausalLM(model, buckets, announce=lambda line: None),
                       ServingConfig(1, 2048, 2048, shapes))
    rule = (prefill_attention.covers(64, torch.float32), loop.eager_from_width)
    loops = [loop]
    threads = run_loops(loops)
    served = None
    if rank == 0:
        loop.submit([request("long", prompt, 1)])  # its token comes from the prefill: no decode graph
        served = collect(loop, {"long"}, timeout_s=TIMEOUT_S / 2).tokens["long"]
        stop(loops, threads)
    else:
        for thread in threads:
            thread.join(TIMEOUT_S)
        assert getattr(loop, "error", None) is None, f"rank 1 failed: {loop.error!r}"
    return rule, served


def test_ranks_that_differ_in_the_prefill_kernel_agree_and_serve_a_long_prompt():
    from tests.model_factory import build_random_model
    from tests.test_shm_collectives import run_ranks  # spawned ranks, a gloo group between them
    from tests.tp_harness import hf_state_dict
    from workers.serving.loop import EAGER_PREFILL_WIDTH

    hf = build_random_model("llama", hidden_size=128, num_heads=2, num_kv_heads=2, head_dim=64,
                            max_position_embeddings=2048, seed=5)
    assert hf.config.head_dim == 64  # a head_dim the kernel tiles on every build (16 and 32 wide)
    prompt = torch.randint(1, hf.config.vocab_size, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = int(hf(prompt[None]).logits[0, -1].argmax())
    reports = run_ranks(2, _rank_main, hf.config.to_dict(), hf_state_dict(hf), prompt.tolist(), 1, timeout_s=TIMEOUT_S)
    (covered_0, rule_0), (covered_1, rule_1) = reports[0][0], reports[1][0]
    assert covered_0 and not covered_1, "the two ranks were meant to differ in the kernel"
    # rank 1 lacks the kernel: every rank runs wide prefills eagerly (and warms up no graph for them)
    assert rule_0 == rule_1 == EAGER_PREFILL_WIDTH, (rule_0, rule_1)
    assert reports[0][1] == [expected]
