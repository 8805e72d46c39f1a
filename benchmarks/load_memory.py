"""Peak memory and time of loading one rank's shard of SmolLM2-135M (float32), printed as one JSON object.

Each load runs in a fresh Python process, so nothing cached by an earlier load is counted. A process
reports its added peak resident memory (VmHWM after loading minus VmHWM after its imports), the load
time, and the bytes it read through read calls (rchar of /proc/self/io; pages reached through a
memory map are not counted there). Cases: TP 1 rank 0, TP 3 rank 0, and the TP 3 rank with the
largest shard when that is not rank 0; each from the Hugging Face checkpoint and from a pre-sharded
copy written once into a temporary directory (whose first load, which also checks each file's sha256
and leaves a marker later loads trust, runs once untimed before the timed runs and is reported apart
as verifying_load_*). Then a TP 1 rank's whole load through the worker
(workers.rank_worker.RankWorker, eager): reading the shard, building the model and the cpu
backend's preparation, with its float32 weights packed as column panels (as it runs) and with
CORELAUNCH_PACKED_WEIGHTS=0, to show what packing adds to the peak (the largest matrix at most),
next to what the planner counts for that rank (its shard plus the largest matrix it packs).

    python benchmarks/load_memory.py [--repeats 5] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.arguments import model_folder  # noqa: E402 - bad values refused before any work
from launcher.cli.options import int_at_least  # noqa: E402

TARGET_TP3_OVER_TP1 = 0.45


def _proc_field(path: str, key: str) -> int:
    with open(path) as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1])
    raise KeyError(key)


def _child_worker(spec: dict) -> dict:
    """A TP 1 rank's load through RankWorker (eager), packing as the spec says."""
    import os

    os.environ["CORELAUNCH_PACKED_WEIGHTS"] = "1" if spec["packed"] else "0"
    from shardlib.model_config import load_model_config
    from shardlib.sharding import ShardLayout
    from workers.kernels import packed_linear
    from workers.rank_worker import LoadSpec, RankWorker, WorkerSpec

    config = load_model_config(spec["model_dir"])
    worker = RankWorker(WorkerSpec(rank=0, world_size=1, backend="cpu", threads=2))
    worker.init_backend("127.0.0.1", 0, timeout_s=60)
    packed_linear.available()  # the kernel's build and load are not the model's memory
    hwm_before = _proc_field("/proc/self/status", "VmHWM:") * 1024
    read_before = _proc_field("/proc/self/io", "rchar:")
    start = time.perf_counter()
    stats = worker.load(LoadSpec(config=config, layout=ShardLayout.for_model(config, 1), dtype=config.torch_dtype,
                                 model_dir=spec["model_dir"], compile=False))
    return {"added_peak_bytes": _proc_field("/proc/self/status", "VmHWM:") * 1024 - hwm_before,
            "load_time_s": time.perf_counter() - start,
            "bytes_read": _proc_field("/proc/self/io", "rchar:") - read_before, "shard_bytes": stats.shard_bytes}


def _child(spec: dict) -> dict:
    """Runs in the fresh process: import, take the baseline, load, measure."""
    if spec["source"] == "worker":
        return _child_worker(spec)
    from shardlib.checkpoint import load_rank_shard
    from shardlib.model_config import load_model_config
    from shardlib.presharded import load_presharded
    from shardlib.sharding import ShardLayout

    config = load_model_config(spec["model_dir"])
    layout = ShardLayout.for_model(config, spec["tp"])
    hwm_before = _proc_field("/proc/self/status", "VmHWM:") * 1024
    read_before = _proc_field("/proc/self/io", "rchar:")
    start = time.perf_counter()
    if spec["source"] == "presharded":
        shard = load_presharded(spec["presharded_dir"], config, layout, spec["rank"])
    else:
        shard = load_rank_shard(spec["model_dir"], config, layout, spec["rank"])
    elapsed = time.perf_counter() - start
    return {
        "added_peak_bytes": _proc_field("/proc/self/status", "VmHWM:") * 1024 - hwm_before,
        "load_time_s": elapsed,
        "bytes_read": _proc_field("/proc/self/io", "rchar:") - read_before,
        "shard_bytes": sum(t.numel() * t.element_size() for t in shard.values()),
    }


def _run_child(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"child load failed for {spec}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _summary(spec: dict, runs: list[dict], verifying: dict | None = None) -> dict:
    """One case over its timed runs; `verifying`, a pre-sharded case's first load (the one that
    hashes the files), is reported apart under verifying_load_*."""
    shard = runs[0]["shard_bytes"]
    peak = max(r["added_peak_bytes"] for r in runs)  # the worst run: memory is a limit, not an average
    read = runs[0]["bytes_read"]
    times = [r["load_time_s"] for r in runs]
    return {
        "tp": spec["tp"], "rank": spec["rank"], "source": spec["source"],
        **({"packed": spec["packed"]} if "packed" in spec else {}),
        "shard_bytes": shard,
        "added_peak_bytes": peak,
        "added_peak_over_shard": round(peak / shard, 3),
        # On a shared machine the fastest run is the cost of the load itself; the median shows the noise.
        "load_time_s_min": round(min(times), 3),
        "load_time_s_median": round(statistics.median(times), 3),
        "bytes_read": read,
        "bytes_read_over_shard": round(read / shard, 3),
        "repeats": len(runs),
        **({"verifying_load_time_s": round(verifying["load_time_s"], 3),
            "verifying_load_bytes_read": verifying["bytes_read"],
            "verifying_load_bytes_read_over_shard": round(verifying["bytes_read"] / shard, 3)} if verifying else {}),
    }


def _shard_bytes_by_rank(config, tp: int) -> list[int]:
    """Each rank's shard size from the sharding plan alone (nothing loaded)."""
    import math

    from shardlib.checkpoint import shard_shapes
    from shardlib.sharding import ShardLayout

    layout = ShardLayout.for_model(config, tp)
    element = 4 if config.torch_dtype == "float32" else 2
    return [element * sum(math.prod(s) for s in shard_shapes(config, layout, r).values()) for r in range(tp)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int_at_least("--repeats", 1), default=5,
                        help="fresh processes per case (default 5)")
    parser.add_argument("--model-dir", type=model_folder("--model-dir"), help="a Hugging Face checkpoint (default: the SmolLM2 demo model)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return {}

    from shardlib.demo_model import ensure_demo_model
    from shardlib.model_config import load_model_config
    from shardlib.presharded import save_presharded
    from shardlib.sharding import ShardLayout

    model_dir = Path(args.model_dir) if args.model_dir else ensure_demo_model()
    config = load_model_config(model_dir)
    tp3_sizes = _shard_bytes_by_rank(config, 3)
    worst = max(range(3), key=lambda r: (tp3_sizes[r], -r))  # rank 0 on ties
    cases = [(1, 0), (3, 0)] + ([(3, worst)] if worst != 0 else [])
    with tempfile.TemporaryDirectory(prefix="corelaunch-bench-") as tmp:
        pre_dirs = {}
        for tp in sorted({tp for tp, _ in cases}):
            start = time.perf_counter()
            pre_dirs[tp] = str(save_presharded(Path(tmp) / f"tp{tp}", model_dir, config,
                                               ShardLayout.for_model(config, tp)))
            print(f"pre-sharded TP {tp} written in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        specs = [{"model_dir": str(model_dir), "tp": tp, "rank": rank, "source": source,
                  "presharded_dir": pre_dirs[tp]} for tp, rank in cases for source in ("checkpoint", "presharded")]
        specs += [{"model_dir": str(model_dir), "tp": 1, "rank": 0, "source": "worker", "packed": packed}
                  for packed in (True, False)]
        # A pre-sharded file's first load also hashes it against its manifest (and leaves a marker that
        # later loads trust): run once, untimed, so the timed runs are all the load a restart does and
        # bytes_read_over_shard is the load's own; its figures are reported as verifying_load_*.
        verifying = [_run_child(spec) if spec["source"] == "presharded" else None for spec in specs]
        runs: list[list[dict]] = [[] for _ in specs]
        for _ in range(args.repeats):  # interleaved, so a burst of load on the machine hits every case
            for spec, spec_runs in zip(specs, runs):
                spec_runs.append(_run_child(spec))
        results = [_summary(*case) for case in zip(specs, runs, verifying)]

    def pick(tp, source, rank=None):
        rows = [r for r in results if r["tp"] == tp and r["source"] == source and rank in (None, r["rank"])]
        return max(rows, key=lambda r: r["added_peak_bytes"])

    tp1, tp3 = pick(1, "checkpoint"), pick(3, "checkpoint")
    ratio = tp3["added_peak_bytes"] / tp1["added_peak_bytes"]
    pre_vs_orig = {
        f"tp{tp}_rank{rank}": {
            "added_peak_ratio": round(pick(tp, "presharded", rank)["added_peak_bytes"]
                                      / pick(tp, "checkpoint", rank)["added_peak_bytes"], 3),
            "speedup": round(pick(tp, "checkpoint", rank)["load_time_s_min"]
                             / pick(tp, "presharded", rank)["load_time_s_min"], 2),
        } for tp, rank in cases
    }
    report = {
        "model": str(model_dir),
        "dtype": config.torch_dtype,
        "checkpoint_bytes": sum(p.stat().st_size for p in model_dir.glob("*.safetensors")),
        "tp3_shard_bytes_by_rank": tp3_sizes,
        "tp3_ranks_measured": sorted({rank for tp, rank in cases if tp == 3}),
        "results": results,
        "tp3_over_tp1_added_peak": round(ratio, 3),
        "tp3_over_tp1_target": TARGET_TP3_OVER_TP1,
        "tp3_over_tp1_ok": ratio <= TARGET_TP3_OVER_TP1,
        "presharded_vs_original": pre_vs_orig,
        "presharded_ok": all(v["added_peak_ratio"] <= 1.02 and v["speedup"] >= 1.0 for v in pre_vs_orig.values()),
        "worker_load_added_peak_over_shard": {("packed" if r["packed"] else "unpacked"): r["added_peak_over_shard"]
                                              for r in results if r["source"] == "worker"},
    }
    # What the planner counts for the same TP 1 rank: its shard plus the largest matrix it packs.
    from shardlib.planner import plan

    memory = plan(config, instance="cpu", tp=1, dtype=config.torch_dtype, batch_size=1, seq_len=2).memory
    planned = memory.weight_bytes_per_rank + memory.packing_scratch_bytes_per_rank
    packed = next(r for r in results if r["source"] == "worker" and r["packed"])
    report["planner_tp1_load_bytes"] = planned
    report["planner_tp1_load_over_shard"] = round(planned / packed["shard_bytes"], 3)
    report["packed_load_peak_over_planner"] = round(packed["added_peak_bytes"] / planned, 3)
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
