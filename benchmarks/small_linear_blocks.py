"""The small-batch kernel's register blocks side by side, one JSON report.

For M rows of x (a decode step of M sequences), times the products of one SmolLM2-135M decode step
(30 layers' q/k/v/o/gate/up/down shapes plus the 49152-row LM head, float32) through:
- the host's build of workers/kernels/small_linear.py (the 16-accumulator blocks where AVX-512 is
  there, else the 8-accumulator ones);
- the same source built without AVX-512 (the 8-accumulator blocks; the same build on an AVX2 host);
- F.linear (MKL's GEMM), which products of more than max_rows() rows take.
Best of --repeats passes per variant, variants interleaved in one process.

    python benchmarks/small_linear_blocks.py [--rows 2,4,8,16,24,32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from workers.kernels import small_linear as small  # noqa: E402

HIDDEN, INTERMEDIATE, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152
"""SmolLM2-135M's shapes: q and o are hidden x hidden, k and v kv x hidden (3 KV heads of 64)."""


def step_weights() -> list[torch.Tensor]:
    layer = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
             (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, k, generator=g) for n, k in layer * LAYERS + [(VOCAB, HIDDEN)]]


def best_pass_s(product, weights: list[torch.Tensor], rows: int, repeats: int) -> float:
    inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            product(inputs[w.shape[1]], w)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="2,4,8,16,24,32", help="rows of x, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if min(rows) < 1 or args.repeats < 1:
        parser.error(f"--rows ({args.rows}) and --repeats ({args.repeats}) must be positive")
    torch.set_num_threads(args.threads)
    host = small._library()
    if host is None:
        sys.exit(f"the kernel is unavailable: {small.unavailable_reason}")
    narrow = small.build_and_load(small.NARROW_SPEC)
    variants = {"host_build": lambda x, w: small.run_kernel(host, x, w, None, None),
                "narrow_blocks": lambda x, w: small.run_kernel(narrow, x, w, None, None),
                "f_linear": F.linear}
    weights = step_weights()
    weight_bytes = sum(w.numel() * 4 for w in weights)
    report = {"host_build_is_wide": bool(host.cl_small_linear_wide()), "max_rows": small.max_rows(),
              "threads": args.threads, "weight_bytes": weight_bytes, "rows": {}}
    for m in rows:
        seconds = {name: best_pass_s(fn, weights, m, args.repeats) for name, fn in variants.items()}
        report["rows"][str(m)] = {
            "ms": {name: round(s * 1e3, 2) for name, s in seconds.items()},
            "gflops": {name: round(2 * m * weight_bytes / 4 / s / 1e9, 1) for name, s in seconds.items()},
            "narrow_over_host": round(seconds["narrow_blocks"] / seconds["host_build"], 3),
            "f_linear_over_host": round(seconds["f_linear"] / seconds["host_build"], 3),
        }
        print(f"rows {m}: {report['rows'][str(m)]['ms']}", file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
