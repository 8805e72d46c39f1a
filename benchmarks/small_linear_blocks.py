"""The linear kernels side by side on one decode step's products, one JSON report.

For M rows of x (a decode step of M sequences), times the products of one SmolLM2-135M decode step
(30 layers' q/k/v/o/gate/up/down shapes plus the 49152-row LM head, float32) through:
- packed: workers/kernels/packed_linear.py on weights packed as column panels (what the cpu
  backend runs for float32 weights), the host's build;
- packed_narrow: the same source built without AVX-512 (8-float vectors, 6-row blocks);
- host_build: the row-layout small-batch kernel, workers/kernels/small_linear.py (the
  16-accumulator blocks where AVX-512 is there, else the 8-accumulator ones; what float32 weights
  take with CORELAUNCH_PACKED_WEIGHTS=0, and 8-bit weights always);
- narrow_blocks: that source built without AVX-512;
- f_linear: F.linear (MKL's GEMM) on the checkpoint layout;
- packed_from: with --packed-from DIR, the packed kernel's C source as another checkout has it
  (a `git worktree` of an earlier commit), built for this host: the same products before and after
  a change to the kernel, interleaved in one process.
Best of --repeats passes per variant, one pass of each variant in turn, in one process. Every row count runs
each kernel itself, prefill sizes too (--rows 128,512); in a model, packed products of
UNPACK_MIN_ROWS rows or more take the prefill GEMM (workers/kernels/prefill_gemm.py) on the unpacked
weight instead.

    python benchmarks/small_linear_blocks.py [--rows 1,2,4,8,16,24,32] [--repeats 5] [--packed-from DIR]
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

from benchmarks.arguments import int_list  # noqa: E402 - bad values refused before any work
from benchmarks.kernel_sources import c_source_in, checkout_with  # noqa: E402
from launcher.cli.options import int_at_least  # noqa: E402
from workers.kernels import packed_linear as packed  # noqa: E402
from workers.kernels import small_linear as small  # noqa: E402

HIDDEN, INTERMEDIATE, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152
"""SmolLM2-135M's shapes: q and o are hidden x hidden, k and v kv x hidden (3 KV heads of 64)."""


def step_weights() -> list[torch.Tensor]:
    layer = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
             (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, k, generator=g) for n, k in layer * LAYERS + [(VOCAB, HIDDEN)]]


def other_packed_spec(checkout: str):
    """The packed kernel's C source (no operator) from another checkout, built for this host."""
    from workers.kernels.small_linear import _cpu_identity
    from workers.native_build import LibrarySpec

    source = c_source_in(checkout, "workers/kernels/packed_linear.py")
    return LibrarySpec("corelaunch_packed_linear_from", source, ("-O3", "-march=native", "-fopenmp"),
                       f"the packed kernel of {checkout}", _cpu_identity())


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
    parser.add_argument("--rows", type=int_list("--rows", "1,2,4,8,16,24,32"), default="1,2,4,8,16,24,32",
                        help="rows of x, comma-separated")
    parser.add_argument("--repeats", type=int_at_least("--repeats", 1), default=5)
    parser.add_argument("--threads", type=int_at_least("--threads", 1), default=os.cpu_count())
    parser.add_argument("--packed-from", type=checkout_with("--packed-from", "workers/kernels/packed_linear.py"),
                        help="another checkout whose packed kernel source to time beside this one's")
    args = parser.parse_args()
    rows = args.rows
    torch.set_num_threads(args.threads)
    host = small._library()
    if host is None:
        sys.exit(f"the kernel is unavailable: {small.unavailable_reason}")
    narrow = small.build_and_load(small.NARROW_SPEC)
    packed_host, packed_narrow = packed._library(), packed.build_and_load(packed.NARROW_SPEC)
    if packed_host is None:
        sys.exit(f"the packed kernel is unavailable: {packed.unavailable_reason}")
    weights = step_weights()

    def run_packed(lib):  # each weight's panels for this build, made once, looked up by the weight
        panels = {id(w): packed.pack(w, lib) for w in weights}
        return lambda x, w: packed.run_kernel(lib, x, panels[id(w)], w.shape[0], None)

    variants = {"packed": run_packed(packed_host), "packed_narrow": run_packed(packed_narrow),
                "host_build": lambda x, w: small.run_kernel(host, x, w, None, None),
                "narrow_blocks": lambda x, w: small.run_kernel(narrow, x, w, None, None),
                "f_linear": F.linear}
    if args.packed_from:
        variants["packed_from"] = run_packed(packed.build_and_load(other_packed_spec(args.packed_from)))
    weight_bytes = sum(w.numel() * 4 for w in weights)
    report = {"host_build_is_wide": bool(host.cl_small_linear_wide()), "max_rows": small.max_rows(),
              "packed_panel_width": packed_host.cl_packed_panel_width(), "unpack_min_rows": packed.UNPACK_MIN_ROWS,
              "threads": args.threads, "weight_bytes": weight_bytes, "rows": {}}
    for m in rows:
        seconds = {name: float("inf") for name in variants}
        for _ in range(args.repeats):  # one pass of each variant in turn: drift reaches all alike
            for name, fn in variants.items():
                seconds[name] = min(seconds[name], best_pass_s(fn, weights, m, 1))
        report["rows"][str(m)] = {
            "ms": {name: round(s * 1e3, 2) for name, s in seconds.items()},
            "gflops": {name: round(2 * m * weight_bytes / 4 / s / 1e9, 1) for name, s in seconds.items()},
            "weight_gb_per_s": {name: round(weight_bytes / s / 1e9, 1) for name, s in seconds.items()},
            "narrow_over_host": round(seconds["narrow_blocks"] / seconds["host_build"], 3),
            "f_linear_over_host": round(seconds["f_linear"] / seconds["host_build"], 3),
            "host_build_over_packed": round(seconds["host_build"] / seconds["packed"], 3),
            "f_linear_over_packed": round(seconds["f_linear"] / seconds["packed"], 3),
        }
        if "packed_from" in seconds:
            report["rows"][str(m)]["packed_from_over_packed"] = round(seconds["packed_from"] / seconds["packed"], 3)
        print(f"rows {m}: {report['rows'][str(m)]['ms']}", file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
