"""The decode attention kernel alone, side by side: this checkout's host build, its portable path,
and optionally another checkout's kernel. One JSON report.

Each case is one decode step's attention over every layer (one call per layer, each layer its own
KV cache, so the cache streams from memory as in a model): a batch of rows, one query each, over a
serving cache (a row per sequence plus one, each batch row on its own cache row), the mask a
prefix of each row's slots as a running sequence has. Cases (float32):

    smollm2_16     SmolLM2-135M (9 query heads over 3 KV heads of 64 lanes, 30 layers), 16 rows,
                   160 of 192 slots read (the issue's workload: 128-token prompts, mid-decode)
    smollm2_1_long the same model, 1 row at 1900 of 2048 slots
    llama8b_4_long Llama-3-8B's heads at TP 4 (8 query heads over 2 KV heads of 128 lanes), 4 rows at
                   1800 of 2048 slots, 8 layers (the cache of all 32 would not leave the weights room)

Variants: `host` (this checkout, built for this CPU: the vector path where AVX2 and FMA are there),
`portable` (the same source's portable C path, slot by slot with expf), and with --from DIR
`from` (DIR's workers/kernels/decode_attention.py source, built for this CPU; e.g. a `git worktree`
of an earlier commit). Each repeat times one pass of every variant in turn, so drift reaches all
alike; the report gives each variant's best and median pass, the cache bytes read per second at
the median, and the other variants' median over the host's.

    python benchmarks/decode_attention.py [--repeats 30] [--from DIR] [--cases smollm2_16,...]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.kernel_sources import c_source_in, checkout_with  # noqa: E402
from launcher.cli.options import int_at_least  # noqa: E402 - bad values refused before any work
from workers import native_build  # noqa: E402
from workers.kernels import decode_attention as kernel  # noqa: E402

CASES = {  # batch, q_heads, kv_heads, head_dim, slots, read_slots, allowed, layers
    "smollm2_16": (16, 9, 3, 64, 256, 192, 160, 30),
    "smollm2_1_long": (1, 9, 3, 64, 2048, 2048, 1900, 30),
    "llama8b_4_long": (4, 8, 2, 128, 2048, 2048, 1800, 8),
}


def case_inputs(batch, q_heads, kv_heads, head_dim, slots, read_slots, allowed, layers):
    g = torch.Generator().manual_seed(0)
    caches = [(torch.randn(batch + 1, kv_heads, slots, head_dim, generator=g),
               torch.randn(batch + 1, kv_heads, slots, head_dim, generator=g)) for _ in range(layers)]
    q = torch.randn(batch, q_heads, 1, head_dim, generator=g)
    rows = torch.arange(1, batch + 1)  # row 0 left free, as a serving cache's scratch row
    mask = (torch.arange(read_slots) < allowed).expand(batch, 1, 1, read_slots).contiguous()
    cache_bytes = layers * batch * kv_heads * allowed * head_dim * 4 * 2  # keys and values read once
    return caches, q, rows, mask, cache_bytes


def build_other(spec) -> ctypes.CDLL:
    """Another checkout's kernel. Sources from before the parts (5b770ea and older) export only
    cl_decode_attention_scratch_floats(group, read_slots, threads), the per-thread scratch: sized
    through it here, the library is called as this checkout's is."""
    lib = native_build.build_and_load(spec)
    if not hasattr(lib, "cl_decode_attention_workspace_floats"):
        scratch = lib.cl_decode_attention_scratch_floats
        scratch.argtypes, scratch.restype = [ctypes.c_long, ctypes.c_long, ctypes.c_int], ctypes.c_long
        lib.cl_decode_attention_workspace_floats = lambda batch, kv_heads, group, head_dim, read_slots, threads: (
            scratch(group, read_slots, threads))
    return kernel.declare(lib)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int_at_least("--repeats", 1), default=30)
    parser.add_argument("--threads", type=int_at_least("--threads", 1), default=os.cpu_count())
    parser.add_argument("--from", dest="other", type=checkout_with("--from", "workers/kernels/decode_attention.py"),
                        help="another checkout whose kernel source to time beside this one's")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, of " + ", ".join(CASES))
    args = parser.parse_args()
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown --cases {unknown} (known: {', '.join(CASES)})")
    torch.set_num_threads(args.threads)
    builds = {"host": kernel.build_kernel(kernel.kernel_spec()),
              "portable": kernel.build_kernel(kernel.kernel_spec(portable=True))}
    if args.other:
        source = c_source_in(args.other, "workers/kernels/decode_attention.py")
        builds["from"] = build_other(kernel.kernel_spec(
            source, stem="corelaunch_decode_attention_from", what=f"the kernel of {args.other}"))
    report = {"threads": args.threads, "repeats": args.repeats,
              "host_takes_vector_path": bool(builds["host"].cl_decode_attention_vector_path()), "cases": {}}
    for name in cases:
        caches, q, rows, mask, cache_bytes = case_inputs(*CASES[name])
        read_slots, scale = mask.shape[-1], q.shape[-1] ** -0.5
        outs = {v: kernel.run_kernel(lib, q, *caches[0], rows, mask, read_slots, scale) for v, lib in builds.items()}
        seconds = {v: [] for v in builds}
        for _ in range(args.repeats):
            for variant, lib in builds.items():
                start = time.perf_counter()
                for k_cache, v_cache in caches:
                    kernel.run_kernel(lib, q, k_cache, v_cache, rows, mask, read_slots, scale)
                seconds[variant].append(time.perf_counter() - start)
        medians = {v: statistics.median(s) for v, s in seconds.items()}
        report["cases"][name] = {
            "shape": dict(zip(("batch", "q_heads", "kv_heads", "head_dim", "slots", "read_slots", "allowed", "layers"),
                              CASES[name])),
            "ms_best": {v: round(min(s) * 1e3, 3) for v, s in seconds.items()},
            "ms_median": {v: round(m * 1e3, 3) for v, m in medians.items()},
            "cache_gb_per_s_at_median": {v: round(cache_bytes / m / 1e9, 2) for v, m in medians.items()},
            "median_over_host": {v: round(m / medians["host"], 3) for v, m in medians.items() if v != "host"},
            "max_abs_difference_from_host": {v: float((o - outs["host"]).abs().max()) for v, o in outs.items()
                                             if v != "host"},
        }
        print(f"{name}: {report['cases'][name]['ms_median']}", file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
