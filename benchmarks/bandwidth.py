"""The host's memory bandwidth, measured in the run that compares decode speed against it.

Decode at batch 1 reads every weight once per token, so weight bytes / bandwidth bounds tokens/s.
Development machines differ from one session to the next (AVX2 or AVX-512, other memory), so the
bound is measured beside the figures it judges, never taken from notes.

The measurement streams a 1 GiB float32 buffer with torch's sum on `threads` threads (the threads a
rank decodes with) and keeps the best of `repeats` passes: the fastest pass is the one the least
disturbed by other work, which is what the bound should be. Run alone it prints one JSON object:

    python benchmarks/bandwidth.py [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.cli.options import int_at_least  # noqa: E402 - bad values refused before any work

BUFFER_BYTES = 1 << 30


def measure_gbps(threads: int, repeats: int = 5) -> float:
    """Best-of-`repeats` read bandwidth in GB/s (1e9 bytes) of a 1 GiB sum on `threads` threads."""
    import torch

    if repeats < 1:  # no pass: the best time stays infinite and the bandwidth 0, a denominator elsewhere
        raise ValueError(f"repeats ({repeats}) must be at least 1")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(BUFFER_BYTES // 4, dtype=torch.float32)
        buffer.sum()  # first touch and thread-pool start-up are not bandwidth
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - start)
        return BUFFER_BYTES / best / 1e9
    finally:
        torch.set_num_threads(before)


def decode_bound(weight_bytes: int, gbps: float) -> float:
    """Tokens/s if every decode step did nothing but stream `weight_bytes` at `gbps`."""
    return gbps * 1e9 / weight_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int_at_least("--threads", 1), default=2)
    parser.add_argument("--repeats", type=int_at_least("--repeats", 1), default=5)
    args = parser.parse_args()
    print(json.dumps({"threads": args.threads, "read_GBps": round(measure_gbps(args.threads, args.repeats), 2)}))


if __name__ == "__main__":
    main()
