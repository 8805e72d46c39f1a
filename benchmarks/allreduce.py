"""all_reduce latency, side by side in one run: gloo against corelaunch's shared-memory path.

Also the logits all-gather (1 x 16000 per rank, once per generated token).

Local processes (2, then 3: TP 3 on this 2-core machine is oversubscribed), one torch thread each,
float32 tensors of a decode step's shapes (1 x 576 is SmolLM2's hidden size, 1 x 1024 the TP
benchmark model's, 4 x 1024 a small batch). Every call is timed on its own, back to back as in a
decode step; variants alternate in blocks so machine noise hits them alike. Latencies are rank 0's.

Variants: `gloo` (corelaunch's gloo path: gloo's all-reduce at 2 ranks, an all-gather and a
rank-order sum from 3), `shm` (workers/shm, as the CPU backend builds it), from 3 ranks also
`gloo_ring` (gloo's own all-reduce, whose summation order is not fixed: what the rank-order sum
costs; all-reduce only, its all-gather being gloo's), and with more ranks than cores
`shm_busy_wait` (the same code never yielding its core: why it yields).
Prints one JSON object.

    python benchmarks/allreduce.py [--calls 2000] [--blocks 3] [--world-sizes 2,3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.arguments import int_list, positive_seconds  # noqa: E402 - bad values refused before any work
from launcher.cli.options import int_at_least  # noqa: E402

SHAPES = ((1, 576), (1, 1024), (4, 1024))
GATHER_SHAPE = (1, 16000)  # one rank's logits of a 32000-token vocabulary at TP 2, gathered once per token
ALL_REDUCE_ONLY = ("gloo_ring",)
"""Variants that change only the all-reduce: their all-gather is gloo's code again, so not reported."""


def _stats(samples_s: list[float]) -> dict:
    ordered = sorted(samples_s)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1e6

    return {"median_us": round(statistics.median(ordered) * 1e6, 1),
            "mean_us": round(statistics.fmean(ordered) * 1e6, 1),
            "p90_us": round(pct(0.90), 1), "p99_us": round(pct(0.99), 1),
            "max_us": round(ordered[-1] * 1e6, 1), "calls": len(ordered)}


def _timed_variants(op: str, names) -> list[str]:
    """The variants timed for `op`: each one whose code for it differs from the others'."""
    return [name for name in names if op == "all_reduce" or name not in ALL_REDUCE_ONLY]


def _label(op: str, shape) -> str:
    dims = "x".join(str(d) for d in shape)
    return dims if op == "all_reduce" else f"{op} {dims}"


def _rank_main(rank: int, world_size: int, port: int, args, queue) -> None:
    import torch
    import torch.distributed as dist

    from workers.collectives import TorchDistributedCollectives
    from workers.shm.group import build_cpu_collectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    variants = {"gloo": TorchDistributedCollectives(),
                "shm": build_cpu_collectives(rank, world_size, [list(range(world_size))], 120.0, "shm")}
    if world_size > 2:
        class GlooRing(TorchDistributedCollectives):
            def all_reduce_sum_(self, tensor):
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
                return tensor

        variants["gloo_ring"] = GlooRing()
    oversubscribed = world_size > len(os.sched_getaffinity(0))
    if oversubscribed:
        busy = build_cpu_collectives(rank, world_size, [list(range(world_size))], 120.0, "shm")
        busy._x.spin_s = busy._x.yield_s = 1e9  # spin for ever: never yield the core
        variants["shm_busy_wait"] = busy
    cases = [("all_reduce", shape) for shape in SHAPES] + [("all_gather_last_dim", GATHER_SHAPE)]
    samples = {_label(op, shape): {name: [] for name in _timed_variants(op, variants)} for op, shape in cases}
    for op, shape in cases:
        tensor = torch.randn(shape, generator=torch.Generator().manual_seed(rank))
        for block in range(args.blocks):
            for name in _timed_variants(op, variants):
                coll = variants[name]
                # the busy-wait variant can take a scheduler time slice per call: fewer calls
                calls = args.calls if name != "shm_busy_wait" else max(20, args.calls // 20)
                call = coll.all_reduce_sum_ if op == "all_reduce" else coll.all_gather_last_dim
                dist.barrier()
                for _ in range(args.warmup if block == 0 else 0):
                    call(tensor.clone())
                times = samples[_label(op, shape)][name]
                for _ in range(calls):
                    work = tensor.clone()
                    start = time.perf_counter()
                    call(work)
                    times.append(time.perf_counter() - start)
    dist.barrier()
    for coll in variants.values():
        coll.close()
    dist.destroy_process_group()
    if rank == 0:
        queue.put({shape: {name: _stats(t) for name, t in per.items()} for shape, per in samples.items()})


def rank_reports(queue, procs, timeout_s: float, count: int = 1) -> list:
    """The first `count` reports the ranks put on `queue`; RuntimeError as soon as a rank has exited
    without its report (a crash or a failed collective), rather than after the whole timeout. Also
    used by benchmarks/sequence_parallel.py."""
    import queue as queues

    deadline = time.monotonic() + timeout_s
    reports = []
    while len(reports) < count:
        try:
            reports.append(queue.get(timeout=1.0))
        except queues.Empty:
            dead = [p for p in procs if not p.is_alive() and p.exitcode != 0]
            if dead or not any(p.is_alive() for p in procs):
                codes = ", ".join(f"rank {procs.index(p)} exit code {p.exitcode}" for p in procs if not p.is_alive())
                raise RuntimeError(f"the ranks ended without a report ({codes}); see their output above") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"no report within --timeout-s {timeout_s:g} s; raise it for a slower "
                                   f"machine") from None
    return reports


# an all-reduce needs two ranks
_world_sizes = int_list("--world-sizes", "2,3", minimum=2)


def run(world_size: int, args) -> dict:
    import torch.multiprocessing as mp

    from workers.net import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        [result] = rank_reports(queue, procs, args.timeout_s)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for per in result.values():
        if "gloo" in per and "shm" in per:
            per["gloo_over_shm"] = {k: round(per["gloo"][k] / max(per["shm"][k], 1e-3), 1)
                                    for k in ("median_us", "mean_us", "p90_us", "p99_us")}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int_at_least("--calls", 1), default=2000, help="timed calls per variant, shape and block")
    parser.add_argument("--warmup", type=int_at_least("--warmup", 0), default=100)
    parser.add_argument("--blocks", type=int_at_least("--blocks", 1), default=3)
    parser.add_argument("--world-sizes", type=_world_sizes, default="2,3")
    parser.add_argument("--timeout-s", type=positive_seconds("--timeout-s"), default=600)
    args = parser.parse_args()
    load_before = os.getloadavg()
    report = {"dtype": "float32", "threads_per_rank": 1, "cores": len(os.sched_getaffinity(0)),
              "calls": args.calls, "blocks": args.blocks, "loadavg_before": [round(x, 2) for x in load_before]}
    for ws in args.world_sizes:
        report[f"{ws}_ranks"] = run(ws, args)
    report["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
