"""Prefill-sized float32 products three ways, at SmolLM2's shapes, alternated round by round:
- onednn: the weight unpacked from its panels and the corelaunch::prefill_linear operator called
  with CORELAUNCH_PREFILL_GEMM=onednn (workers/kernels/prefill_gemm.py): what a model runs for
  products of UNPACK_MIN_ROWS rows or more by default on a CPU not made by Intel without AVX-512;
- mkl: the same with CORELAUNCH_PREFILL_GEMM=mkl: F.linear, MKL's sgemm (the default on Intel's);
- packed: the packed-panel kernel on the panels themselves (what products of fewer rows take, and
  every product by default on the other CPUs with AVX-512: CORELAUNCH_PREFILL_GEMM=packed).
A timing is the mean of --calls calls; each way keeps its fastest timing over --rounds rounds.
Prints JSON: per (rows, out, in) those times (ms) and each way's over mkl's, then their sums over
one layer's four products (fused QKV, output, fused gate and up, down).

    python benchmarks/prefill_gemm.py [--rows 1024,2048] [--rounds 5] [--calls 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.arguments import int_list  # noqa: E402
from benchmarks.serving import machine  # noqa: E402
from launcher.cli.options import int_at_least  # noqa: E402
from workers.kernels import packed_linear as kernel  # noqa: E402
from workers.kernels.prefill_gemm import prefill_linear  # noqa: E402

# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, MLP 1536. (out, in) per product.
LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def mean_seconds(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int_list("--rows", "1024,2048"), default="1024,2048")
    parser.add_argument("--rounds", type=int_at_least("--rounds", 1), default=5)
    parser.add_argument("--calls", type=int_at_least("--calls", 1), default=5, help="calls per timing")
    parser.add_argument("--threads", type=int_at_least("--threads", 1), default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not kernel.available():
        sys.exit(f"the packed-panel kernel is unavailable: {kernel.unavailable_reason}")
    def through(gemm: str):
        def product(x, panels, n):
            os.environ["CORELAUNCH_PREFILL_GEMM"] = gemm  # read by the operator at each call
            return prefill_linear(x, kernel.unpack(panels, n), None)
        return product

    ways = {"onednn": through("onednn"), "mkl": through("mkl"),
            "packed": lambda x, p, n: torch.ops.corelaunch.packed_linear_kernel(x, p, n, None)}
    results, layers = [], {}
    g = torch.Generator().manual_seed(0)
    for rows in args.rows:
        for name, (n, k) in LAYER_SHAPES.items():
            x, panels = torch.randn(rows, k, generator=g), kernel.pack(torch.randn(n, k, generator=g))
            best = {way: float("inf") for way in ways}
            for _ in range(args.rounds):  # alternated: a drift in the host's speed hits every way alike
                for way, fn in ways.items():
                    best[way] = min(best[way], mean_seconds(lambda: fn(x, panels, n), args.calls))
            results.append({"rows": rows, "product": name, "out": n, "in": k,
                            "ms": {w: round(s * 1e3, 3) for w, s in best.items()},
                            "over_mkl": {w: round(s / best["mkl"], 3) for w, s in best.items()}})
            layer = layers.setdefault(rows, dict.fromkeys(ways, 0.0))
            for way, s in best.items():
                layer[way] += s
    print(json.dumps({
        "machine": machine(), "threads": args.threads, "rounds": args.rounds, "products": results,
        "layer": {rows: {"ms": {w: round(s * 1e3, 3) for w, s in t.items()},
                         "over_mkl": {w: round(s / t["mkl"], 3) for w, s in t.items()}} for rows, t in layers.items()},
    }, indent=1))


if __name__ == "__main__":
    main()
