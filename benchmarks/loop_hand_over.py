"""CPU a process spends handing streamed tokens from a replica's thread to asyncio readers, per step.

A thread puts one item for each of --streams readers, then sleeps for --step-ms (the decode step);
each reader is a task on the event loop that awaits its next item with a timeout, as a Serve
replica's readers do. Two ways, alternated round by round in one process:
- batched: what the server runs (launcher/serving/loop_hand_over.py and the readers' bounded get
  in launcher/serving/request_streams.py): one call scheduled on the loop per step;
- per_item: one call_soon_threadsafe per item and asyncio.wait_for around each get.
Prints JSON: the median process CPU per step (microseconds) of each, over --rounds rounds.

    python benchmarks/loop_hand_over.py [--streams 16] [--steps 400] [--step-ms 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.arguments import finite_number  # noqa: E402
from launcher.serving.loop_hand_over import loop_sink  # noqa: E402
from launcher.serving.request_streams import next_item  # noqa: E402


def per_item_sink(items: asyncio.Queue, loop: asyncio.AbstractEventLoop):
    return lambda item: loop.call_soon_threadsafe(items.put_nowait, item)


async def batched_get(items: asyncio.Queue):
    return await next_item(items, 60.0)


async def per_item_get(items: asyncio.Queue):
    return await asyncio.wait_for(items.get(), 60.0)


async def one_round(way: str, streams: int, steps: int, step_s: float) -> float:
    loop = asyncio.get_running_loop()
    queues = [asyncio.Queue() for _ in range(streams)]
    make_sink, get = (loop_sink, batched_get) if way == "batched" else (per_item_sink, per_item_get)
    sinks = [make_sink(q, loop) for q in queues]

    async def reader(items: asyncio.Queue) -> None:
        for _ in range(steps):
            await get(items)

    def producer() -> None:
        for step in range(steps):
            for sink in sinks:
                sink(step)
            time.sleep(step_s)

    start = time.process_time()
    thread = threading.Thread(target=producer)
    thread.start()
    await asyncio.gather(*(reader(q) for q in queues))
    thread.join()
    return (time.process_time() - start) / steps * 1e6


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--step-ms", type=finite_number("--step-ms", 0), default=2.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    for name in ("streams", "steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be >= 1")
    cpu_us: dict[str, list[float]] = {"batched": [], "per_item": []}
    for _ in range(args.rounds):
        for way in cpu_us:
            cpu_us[way].append(asyncio.run(one_round(way, args.streams, args.steps, args.step_ms / 1000)))
    medians = {way: statistics.median(values) for way, values in cpu_us.items()}
    report = {
        "workload": {"streams": args.streams, "steps": args.steps, "step_ms": args.step_ms, "rounds": args.rounds},
        "cpu_us_per_step_median": {way: round(v, 1) for way, v in medians.items()},
        "cpu_us_per_step": {way: [round(v, 1) for v in values] for way, values in cpu_us.items()},
        "batched_over_per_item": round(medians["batched"] / medians["per_item"], 3),
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
