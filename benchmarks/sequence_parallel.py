"""Sequence-parallel prefill against plain TP 2: time and peak activation memory of one long prefill.

The 254M random Llama of benchmarks/tp_scaling.py (hidden 1024, 16 layers, 16 heads, 8 KV heads,
intermediate 2816, vocab 32000, float32) with room for the prompt's positions, built once with
tests/model_factory.save_random_model and kept for later runs as $TMPDIR/corelaunch-bench-254m-N
(N: --prompt-len + 64; about 1 GB for each --prompt-len; built in a hidden sibling and renamed into
place once whole). Two ranks, spawned here with a gloo group and the production shared-memory
collectives (workers/shm), 1 thread each, each loading its own slices from the checkpoint as a
worker does. Each rank holds one model and runs both variants on it, alternating in
`--rounds` rounds (so machine noise over time hits both alike):

    plain       a prefill of `--prompt-len` tokens (batch 1), the residual stream whole on every rank
    sequence    the same with model.sequence_parallel (workers/sequence_parallel.py)

Compiled by default (inductor, one graph per decoder layer, as `corelaunch generate` runs; each
variant's graphs are built by an untimed first prefill), `--no-compile` for eager.

Measured per prefill, on each rank: wall time (the slower rank's counts) and the peak activation
memory, the rise of the process's resident set over what it held just before the prefill (the
kernel's high-water mark VmHWM, reset through /proc/self/clear_refs before each run; weights and
the KV cache held before the prefill are not counted). The ranks run with glibc's mmap threshold fixed
at 128 KiB (MALLOC_MMAP_THRESHOLD_), so every large tensor is its own mapping, returned to the
system when freed: otherwise the allocator keeps the first prefill's freed memory resident and
later prefills would show no rise at all. Also checked: both variants give bit-identical
logits. Prints one JSON object.

    python benchmarks/sequence_parallel.py [--prompt-len 2048] [--rounds 3] [--no-compile] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.allreduce import rank_reports  # noqa: E402 - stops waiting once a rank has died
from benchmarks.arguments import model_folder, positive_seconds  # noqa: E402 - bad values refused before any work
from launcher.cli.options import int_at_least  # noqa: E402

VARIANTS = ("plain", "sequence")
TP = 2


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set


def _rank_main(rank: int, port: int, args, queue) -> None:
    import torch
    import torch.distributed as dist

    from shardlib.buckets import Buckets
    from shardlib.checkpoint import load_rank_shard
    from shardlib.model_config import load_model_config
    from shardlib.sharding import ShardLayout
    from workers.compiled import CompiledCausalLM
    from workers.model import ShardedCausalLM
    from workers.shm.group import build_cpu_collectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP,
                            timeout=datetime.timedelta(seconds=600))
    collectives = build_cpu_collectives(rank, TP, [list(range(TP))], 600.0, "shm")
    config = load_model_config(args.model_dir)
    layout = ShardLayout.for_model(config, TP)
    model = ShardedCausalLM(config, layout, rank, load_rank_shard(args.model_dir, config, layout, rank),
                            collectives, "float32")
    n = args.prompt_len
    runner = model
    if args.compile:
        runner = CompiledCausalLM(model, Buckets.build(context=[n], token=[n], batch=[1]), announce=lambda _: None)
    ids = torch.randint(config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(n)[None]
    samples = {v: {"seconds": [], "peak_activation_mib": []} for v in VARIANTS}
    logits = {}

    def prefill(variant: str):
        model.sequence_parallel = variant == "sequence"
        cache = runner.new_cache(1, n)
        dist.barrier()
        _reset_peak()
        before = _status_kib("VmRSS")
        start = time.perf_counter()
        with torch.inference_mode():
            out = runner(ids, positions, cache, torch.arange(n), None, torch.tensor([n - 1]))
        seconds = time.perf_counter() - start
        peak = _status_kib("VmHWM") - before
        del cache
        return out, seconds, peak / 1024

    for variant in VARIANTS:  # untimed: builds the graphs (compiled) and touches the allocator's pages
        logits[variant], _, _ = prefill(variant)
    for _ in range(args.rounds):
        for variant in VARIANTS:
            _, seconds, peak = prefill(variant)
            samples[variant]["seconds"].append(seconds)
            samples[variant]["peak_activation_mib"].append(peak)
    same = bool(torch.equal(logits["plain"], logits["sequence"]))
    dist.barrier()
    collectives.close()
    dist.destroy_process_group()
    queue.put((rank, {"samples": samples, "identical_logits": same}))


def kept_model_path(prompt_len: int) -> Path:
    """Where the built-in model for --prompt-len is kept between runs (about 1 GB each)."""
    return Path(tempfile.gettempdir()) / f"corelaunch-bench-254m-{prompt_len + 64}"


def _model_dir(parser: argparse.ArgumentParser, args) -> str:
    """--model-dir, else the 254M random Llama kept for this --prompt-len: built once, into a hidden
    sibling renamed into place when complete; a folder there that is not a whole model (left by an
    interrupted build of an earlier version, which wrote in place) is refused before the ranks start,
    where each rank failed on its missing weights."""
    if args.model_dir:
        return args.model_dir
    from benchmarks.tp_scaling import build_random_254m_in_place, builds_here, saved_model_problem

    path = kept_model_path(args.prompt_len)
    if builds_here(path):
        build_random_254m_in_place(path, max_position_embeddings=args.prompt_len + 64)
    problem = saved_model_problem(path)
    if problem:
        parser.error(f"the benchmark's kept model is incomplete: {problem} (a build of it was interrupted); "
                     f"remove it (rm -r {path}) and run again to build it anew, or pass --model-dir")
    return str(path)


def main() -> None:
    import torch.multiprocessing as mp

    from workers.net import free_port

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # a single-token step has nothing to split over the ranks (workers/sequence_parallel.split_for)
    parser.add_argument("--prompt-len", type=int_at_least("--prompt-len", 2), default=2048)
    parser.add_argument("--rounds", type=int_at_least("--rounds", 1), default=3)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--model-dir", type=model_folder("--model-dir"), help="a saved model (default: the 254M random Llama, built once)")
    parser.add_argument("--timeout-s", type=positive_seconds("--timeout-s"), default=1800)
    args = parser.parse_args()
    args.model_dir = _model_dir(parser, args)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)  # read by the spawned ranks' C library at start
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, args, queue)) for r in range(TP)]
    for p in procs:
        p.start()
    try:
        results = dict(rank_reports(queue, procs, args.timeout_s, count=TP))
    except BaseException:
        for p in procs:  # the survivor would wait out its collectives' timeout (600 s) for the dead rank
            p.kill()
        raise
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    report = {"model": "254M random Llama fp32" if "254m" in args.model_dir else args.model_dir,
              "tp": TP, "threads_per_rank": 1, "prompt_len": args.prompt_len, "compiled": args.compile,
              "rounds": args.rounds, "cores": len(os.sched_getaffinity(0)),
              "identical_logits": all(r["identical_logits"] for r in results.values())}
    for variant in VARIANTS:
        # a prefill takes as long as its slower rank; memory is per rank, the larger reported
        seconds = [max(results[r]["samples"][variant]["seconds"][i] for r in results) for i in range(args.rounds)]
        peaks = [max(results[r]["samples"][variant]["peak_activation_mib"][i] for r in results)
                 for i in range(args.rounds)]
        report[variant] = {"median_s": round(statistics.median(seconds), 3), "runs_s": [round(s, 3) for s in seconds],
                           "peak_activation_mib": round(statistics.median(peaks), 1),
                           "peak_runs_mib": [round(p, 1) for p in peaks]}
    report["sequence_over_plain_time"] = round(report["sequence"]["median_s"] / report["plain"]["median_s"], 3)
    report["sequence_over_plain_memory"] = round(
        report["sequence"]["peak_activation_mib"] / max(report["plain"]["peak_activation_mib"], 1e-9), 3)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
