"""Which prefill calls a compiled cpu serving loop runs eagerly is the group's choice, not each rank's
(workers/serving/loop.py group_eager_from_width).

A rank's own answer depends on its host: whether the prefill attention kernel is built there, its
panel width, CORELAUNCH_PREFILL_ATTENTION in its environment. Ranks that answered differently ran
one prefill call at different shapes (one rank the 1x1800 eager step, another the 1x2048 graph),
whose all-reduces then met with different sizes; and their warm-ups built different graphs, with
forwards the other ranks never joined. Here two real ranks (spawned processes, gloo between them)
differ in CORELAUNCH_PREFILL_ATTENTION: they must hold the same rule and serve a long prompt."""

from __future__ import annotations

import datetime
import os
import time
import traceback
from queue import Empty

import pytest
import torch

from tests.native_kernels import skip_unless_built
from workers.kernels import prefill_attention

pytestmark = [pytest.mark.slow, skip_unless_built(prefill_attention, "the prefill attention kernel")]

PROMPT_LENGTH = 1800
"""In the 2048 chunk bucket, padded by 1.14 (under EAGER_PREFILL_WASTE): a rank with the kernel ran
it through its graph, one without it eagerly (EAGER_PREFILL_WIDTH)."""
TIMEOUT_S = 240.0


def _rank_main(rank: int, port: int, config_dict: dict, state: dict, prompt: list[int], kernel_off: bool,
               queue) -> None:
    import torch.distributed as dist

    if kernel_off:  # this rank's host alone turns the kernel off, before anything asks for it
        os.environ["CORELAUNCH_PREFILL_ATTENTION"] = "0"
    else:
        os.environ.pop("CORELAUNCH_PREFILL_ATTENTION", None)
    torch.set_num_threads(1)  # the ranks share two cores
    try:
        from shardlib.buckets import Buckets
        from shardlib.model_config import ModelConfig
        from shardlib.serving_shapes import ServingShapes
        from tests.serving_driver import collect, request, run_loops, stop
        from tests.tp_harness import build_rank_model
        from workers.collectives import TorchDistributedCollectives
        from workers.compiled import CompiledCausalLM
        from workers.serving.loop import ServingConfig, ServingLoop

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        collectives = TorchDistributedCollectives()
        model = build_rank_model(ModelConfig.from_dict(config_dict), state, rank, 2, collectives)
        buckets = Buckets.build(max_seq_len=2048, context=(1024, 2048), token=(2048,))
        shapes = ServingShapes.build(buckets, max_num_seqs=1, max_prefill_tokens=2048)
        loop = ServingLoop(CompiledCausalLM(model, buckets, announce=lambda line: None),
                           ServingConfig(1, 2048, 2048, shapes))
        queue.put((rank, "rule", (prefill_attention.covers(64, torch.float32), loop.eager_from_width)))
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
        queue.put((rank, "served", served))
    except BaseException:  # reported to the parent instead of leaving it waiting
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _next(queue, deadline: float, procs) -> tuple[int, str, object]:
    try:
        rank, kind, payload = queue.get(timeout=max(deadline - time.monotonic(), 0.1))
    except Empty:
        raise TimeoutError(f"the ranks did not report in time (alive: {[p.pid for p in procs if p.is_alive()]})") from None
    if kind == "error":
        raise RuntimeError(f"rank {rank} failed:\n{payload}")
    return rank, kind, payload


def test_ranks_that_differ_in_the_prefill_kernel_agree_and_serve_a_long_prompt():
    from tests.model_factory import build_random_model
    from tests.tp_harness import hf_state_dict
    from workers.net import free_port_for_a_late_bind
    from workers.serving.loop import EAGER_PREFILL_WIDTH

    hf = build_random_model("llama", hidden_size=128, num_heads=2, num_kv_heads=2, head_dim=64,
                            max_position_embeddings=2048, seed=5)
    assert hf.config.head_dim == 64  # a head_dim the kernel tiles on every build (16 and 32 wide)
    prompt = torch.randint(1, hf.config.vocab_size, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = int(hf(prompt[None]).logits[0, -1].argmax())
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port_for_a_late_bind()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(rank, port, hf.config.to_dict(), hf_state_dict(hf), prompt.tolist(), rank == 1, queue))
             for rank in range(2)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + TIMEOUT_S
    try:
        reports: dict[tuple[int, str], object] = {}
        while not {(0, "rule"), (1, "rule")} <= reports.keys():
            rank, kind, payload = _next(queue, deadline, procs)
            reports[rank, kind] = payload
        (covered_0, rule_0), (covered_1, rule_1) = reports[0, "rule"], reports[1, "rule"]
        assert covered_0 and not covered_1, "the two ranks were meant to differ in the kernel"
        # rank 1 lacks the kernel: every rank runs wide prefills eagerly (and warms up no graph for them)
        assert rule_0 == rule_1 == EAGER_PREFILL_WIDTH, (rule_0, rule_1)
        while not {(0, "served"), (1, "served")} <= reports.keys():
            rank, kind, payload = _next(queue, deadline, procs)
            reports[rank, kind] = payload
        assert reports[0, "served"] == [expected]
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
