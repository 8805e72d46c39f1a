"""What a request with a large JSON schema costs the other requests: llguidance compiles a large
schema for a second or more, once on the driver (its check) and once on the group's leader (the
request's matcher), and neither may hold up the streams already running.

Through the driver API on one TP group (the built-in model by default, eager), in one asyncio event
loop as the OpenAI server runs it: plain requests of --tokens tokens (ignore_eos) stream one after
another while, a moment after the first starts, a request constrained to a schema of --properties
required string properties is checked (acheck_structured) and streamed, until its first delta has
come. Reported: the plain streams' longest gap between two deltas of one stream, with the
large-schema request and, in a run of one plain request before it, without; the event loop's
longest lateness (a 10 ms ticker); how long the driver's check and then the structured request's
first delta took. Prints JSON.

    python benchmarks/large_schema.py [--properties 10000] [--tokens 64] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.arguments import model_folder  # noqa: E402
from launcher.cli.options import int_at_least  # noqa: E402


def schema(properties: int) -> dict:
    """An object of `properties` required strings and no other keys (10,000: 478 KB, which llguidance
    compiled in 0.9 s and checked in 1.6 s on one 2-core host). Optional ones cost more to compile,
    but past 500 of them its parser cannot go on after the opening brace (README, Limits today)."""
    names = [f"field_{i}" for i in range(properties)]
    return {"type": "object", "properties": {name: {"type": "string"} for name in names}, "required": names,
            "additionalProperties": False}


async def longest_gaps(llm, tokens: int, structured=None) -> dict:
    """Stream a plain request; with `structured` (SamplingParams), plain ones until that one, started
    0.2 s after the first, has its first delta."""
    from shardlib.sampling_params import SamplingParams

    loop_gaps, plain_gaps, plain_streams = [0.0], [0.0], [0]
    structured_started = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.01)
            loop_gaps.append(time.perf_counter() - last - 0.01)
            last = time.perf_counter()

    async def plain() -> None:
        while True:
            last = None
            async for _ in llm.astream("Once upon a time", SamplingParams(), max_new_tokens=tokens, ignore_eos=True):
                now = time.perf_counter()
                if last is not None:
                    plain_gaps.append(now - last)
                last = now
            plain_streams[0] += 1
            if structured is None or structured_started.is_set():
                return

    async def constrained() -> dict:
        await asyncio.sleep(0.2)
        start = time.perf_counter()
        await llm.acheck_structured(structured)
        checked = time.perf_counter()
        first = None
        async for _ in llm.astream("A record:", structured, max_new_tokens=8):
            first = first or time.perf_counter()
            structured_started.set()
        return {"driver_check_s": round(checked - start, 3),
                "first_delta_after_check_s": round((first or checked) - checked, 3)}

    ticker = asyncio.create_task(tick())
    try:
        jobs = [plain()] + ([constrained()] if structured is not None else [])
        outcome = (await asyncio.gather(*jobs))[1:]
    finally:
        ticker.cancel()
    return {"plain_streams": plain_streams[0], "plain_longest_gap_s": round(max(plain_gaps), 3),
            "event_loop_longest_lateness_s": round(max(loop_gaps), 3),
            **(outcome[0] if outcome else {})}


def main(out: TextIO) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--properties", type=int_at_least("--properties", 1), default=10_000)
    parser.add_argument("--tokens", type=int_at_least("--tokens", 2), default=64)
    parser.add_argument("--model-dir", type=model_folder("--model-dir"), default=None)
    args = parser.parse_args()

    from launcher.api import Launcher
    from shardlib.demo_model import ensure_demo_model
    from shardlib.sampling_params import SamplingParams
    from shardlib.structured_output import StructuredOutput

    big = schema(args.properties)
    structured = SamplingParams(structured_output=StructuredOutput(json=big))
    with Launcher(model=str(args.model_dir or ensure_demo_model()), tp=1, max_num_seqs=4, compile=False,
                  progress=False) as llm:
        asyncio.run(longest_gaps(llm, 16))  # warms the stream path up
        alone = asyncio.run(longest_gaps(llm, args.tokens))
        beside = asyncio.run(longest_gaps(llm, args.tokens, structured))
    print(json.dumps({"properties": args.properties, "schema_bytes": len(json.dumps(big)), "tokens": args.tokens,
                      "without_it": alone, "with_it": beside}, indent=2), file=out)


if __name__ == "__main__":
    from launcher.cli.command_stdout import run_reporting

    run_reporting(main)
