"""Decode speed and start-up time, side by side in one run; prints one JSON object.

SmolLM2-135M-Instruct, float32, batch 1, greedy, a 128-token prompt, 128 new tokens (EOS ignored
so every run decodes the same count). Decode variants, each run `--repeats` times interleaved so
machine noise hits all alike (median and best reported):
- transformers generate();
- corelaunch's worker code in this process (no Ray): eager, and compiled at the default granularity
  and at every other whole-step one ("model-decode", "model");
- corelaunch TP 1 through Ray (compiled, the default).
Alongside: the weights-over-bandwidth bound, measured in the same run (benchmarks/bandwidth.py: the
best 1 GiB read on `--threads` threads, once per round between the variants): `bound_tokens_per_s`
and each variant's `fraction_of_bound`.

Start-up, each in a fresh process with its own fresh Ray instance, until every bucket's graph is
built and a first request has its first tokens: cold (from the Hugging Face checkpoint with an
empty compile cache, so sharding and compiling are included) and warm (from a compiled-model
directory written by `corelaunch compile`). Both build the same graphs (the buckets for the
benchmark request: context 128, token 128 and 256).

    python benchmarks/decode.py [--new-tokens 128] [--prompt-tokens 128] [--repeats 3] [--threads 2]
                                [--skip-start] [--skip-model-granularity]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.arguments import check_context, smallest_buckets  # noqa: E402
from benchmarks.bandwidth import decode_bound, measure_gbps  # noqa: E402
from launcher.cli.options import int_at_least  # noqa: E402
from workers.granularities import DEFAULT_GRANULARITY  # noqa: E402

TEXT = ("The history of the city begins with a small settlement on the river, where traders met to exchange "
        "grain, salt and cloth. Over the centuries the market grew into a town, the town into a city, and ")


def prompt_ids(tokenizer, length: int) -> list[int]:
    """Exactly `length` token ids of ordinary English text."""
    ids: list[int] = []
    while len(ids) < length:
        ids += tokenizer(TEXT)["input_ids"]
    return ids[:length]


def bucket_settings(prompt_tokens: int, new_tokens: int) -> dict:
    """The smallest buckets that hold the benchmark request: one context bucket, one cache bucket."""
    return {**smallest_buckets(prompt_tokens, new_tokens), "max_batch_size": 1}


def hf_runner(model_dir: Path, ids: list[int], new_tokens: int):
    """transformers generate(), timed as corelaunch's engine times itself: one call, a clock reading as each
    token is chosen; TTFT = first - start, decode tokens/s = (n - 1) / (last - first). (Two calls, TTFT from
    a 1-token one and the total from another, mixed two runs' noise: at a few tokens the rate went negative.)"""
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteriaList

    from benchmarks.token_clock import decode_rate, token_clock

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = torch.tensor([ids])

    def run() -> dict:
        clock = token_clock()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                 stopping_criteria=StoppingCriteriaList([clock]))
        e2e = time.perf_counter() - start
        assert out.shape[1] == len(ids) + new_tokens
        return {"time_to_first_token_s": clock.times[0] - start,
                "decode_tokens_per_s": decode_rate(clock.times, new_tokens), "e2e_s": e2e}

    return run


def worker_runner(model_dir: Path, ids: list[int], new_tokens: int, threads: int, compile_: bool,
                  granularity: str | None = None):
    """The worker code corelaunch runs inside each Ray actor, driven directly (no Ray)."""
    from shardlib.buckets import Buckets
    from shardlib.model_config import load_model_config
    from shardlib.sharding import ShardLayout
    from workers.rank_worker import GenerateRequest, LoadSpec, RankWorker, WorkerSpec
    from workers.sampling import SamplingParams

    config = load_model_config(model_dir)
    settings = bucket_settings(len(ids), new_tokens)
    buckets = Buckets.build(max_context_length=settings["max_context_length"], max_seq_len=settings["seq_len"])
    worker = RankWorker(WorkerSpec(rank=0, world_size=1, backend="cpu", threads=threads))
    worker.init_backend("127.0.0.1", 0, timeout_s=60)
    worker.load_stats = worker.load(LoadSpec(
        config=config, layout=ShardLayout.for_model(config, 1), dtype="float32", model_dir=str(model_dir),
        compile=compile_ and granularity is None, buckets=buckets if compile_ else None))
    if granularity is not None:  # another granularity than the backend's default: wrap the eager model
        from workers.compiled import CompiledCausalLM

        worker._model = CompiledCausalLM(worker._model, buckets, granularity=granularity)
    request = GenerateRequest(prompts=[ids], params=[SamplingParams()], max_new_tokens=new_tokens)

    def run() -> dict:
        start = time.perf_counter()
        [out] = worker.generate(request)
        e2e = time.perf_counter() - start
        assert len(out.token_ids) == new_tokens
        return {"time_to_first_token_s": out.time_to_first_token_s,
                "decode_tokens_per_s": out.decode_tokens_per_s, "e2e_s": e2e}

    return run, worker


def ray_runner(model_dir: Path, ids: list[int], new_tokens: int, threads: int, tp: int = 1, compile_: bool = True):
    from launcher.api import Launcher

    # TP 3 on a small machine: a third of a CPU per rank's bundle, so two groups (eager and compiled)
    # can stay up side by side; one thread per rank either way. TP 1: a bundle of --threads CPUs, so
    # --threads compute threads (they follow the bundle), as the in-process variants and transformers get.
    launcher = Launcher(model=str(model_dir), tp=tp, compile=compile_, progress=False, ray_address="local",
                        cpus_per_rank=0.3 if tp > 1 else threads, prefix_caching=False,  # every run prefills its prompt whole (the same prompt again would be a prefix-cache hit)
                        **bucket_settings(len(ids), new_tokens)).start()

    def run() -> dict:
        start = time.perf_counter()
        [out] = launcher.generate([ids], max_new_tokens=new_tokens, ignore_eos=True)
        e2e = time.perf_counter() - start
        assert len(out.token_ids) == new_tokens
        return {"time_to_first_token_s": out.time_to_first_token_s,
                "decode_tokens_per_s": out.decode_tokens_per_s, "e2e_s": e2e}

    return run, launcher


def summarize(runs: list[dict]) -> dict:
    out = {key: round(statistics.median(r[key] for r in runs), 4) for key in runs[0]}
    out["best_decode_tokens_per_s"] = round(max(r["decode_tokens_per_s"] for r in runs), 2)
    return out


# ---- start-up, in fresh processes ---------------------------------------------------------------
def start_probe(args, report_to) -> None:
    """Child process: start a Launcher (cold: from the checkpoint; warm: from a compiled directory)
    with every bucket's graph built at start (warm_up), run one request of 2 new tokens (its
    prefill and one decode step), print timings and the compile-cache counters as JSON."""
    t0 = time.perf_counter()
    from launcher.api import Launcher

    ids = json.loads(args.probe_ids)
    options = ({"compiled_dir": args.compiled_dir} if args.compiled_dir else
               {"model": args.model_dir, "tp": 1, **bucket_settings(len(ids), args.new_tokens)})
    imported = time.perf_counter()
    with Launcher(progress=False, ray_address="local", warm_up=True, **options) as launcher:
        started = time.perf_counter()
        [out] = launcher.generate([ids], max_new_tokens=2, ignore_eos=True)
        done = time.perf_counter()
        stats = launcher.load_stats[0].compile
    print(json.dumps({"import_s": imported - t0, "start_s": started - imported, "first_request_s": done - started,
                      "ready_s": done - t0, "ttft_s": out.time_to_first_token_s,
                      "graphs_built": len(stats["graphs"]), "compile_s": stats["compile_s"],
                      "fxgraph_cache_hit": stats["fxgraph_cache_hit"],
                      "fxgraph_cache_miss": stats["fxgraph_cache_miss"]}), file=report_to)


def run_start_probe(ids: list[int], new_tokens: int, model_dir: Path, compiled_dir: Path | None,
                    cache_dir: Path) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir))  # cold: empty; warm: unused
    cmd = [sys.executable, __file__, "--start-probe", "--probe-ids", json.dumps(ids), "--new-tokens", str(new_tokens),
           "--model-dir", str(model_dir)] + (["--compiled-dir", str(compiled_dir)] if compiled_dir else [])
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"start probe failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"wall_s": round(wall, 3), **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in result.items()}}


def start_times(ids: list[int], new_tokens: int, model_dir: Path, repeats: int) -> dict:
    settings = bucket_settings(len(ids), new_tokens)
    with tempfile.TemporaryDirectory(prefix="corelaunch-bench-") as tmp:
        tmp = Path(tmp)
        compiled = tmp / "compiled"
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "launcher", "compile", "--model", str(model_dir), "--tp", "1",
                               "--seq-len", str(settings["seq_len"]), "--max-context-length",
                               str(settings["max_context_length"]), "--max-batch-size",
                               str(settings["max_batch_size"]), "--ray-address", "local", "--quiet",
                               "--out", str(compiled)],
                              cwd=REPO, env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp / "compile-cache")),
                              capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"corelaunch compile failed:\n{proc.stderr[-3000:]}")
        build_s = time.perf_counter() - start
        cold, warm = [], []
        for i in range(repeats):  # interleaved; each cold run gets a new empty compile cache
            cold.append(run_start_probe(ids, new_tokens, model_dir, None, tmp / f"cold-cache-{i}"))
            warm.append(run_start_probe(ids, new_tokens, model_dir, compiled, tmp / f"warm-cache-{i}"))
        manifest = json.loads((compiled / "manifest.json").read_text())
    med = lambda runs, key: round(statistics.median(r[key] for r in runs), 3)  # noqa: E731
    return {
        "compiled_dir_build_s": round(build_s, 3),
        "compiled_dir_graphs": [(g["phase"], g["batch"], g["length"], round(g["first_call_s"], 2))
                                for g in manifest["graphs"]],
        "cold": {"median_wall_s": med(cold, "wall_s"), "median_ready_s": med(cold, "ready_s"), "runs": cold},
        "warm": {"median_wall_s": med(warm, "wall_s"), "median_ready_s": med(warm, "ready_s"), "runs": warm},
        "warm_over_cold_wall": round(med(warm, "wall_s") / med(cold, "wall_s"), 4),
    }


def main(out=None) -> None:
    """out: where the JSON report goes (stdout when None)."""
    out = out or sys.stdout
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int_at_least("--new-tokens", 2), default=128)
    parser.add_argument("--prompt-tokens", type=int_at_least("--prompt-tokens", 1), default=128)
    parser.add_argument("--repeats", type=int_at_least("--repeats", 1), default=3)
    parser.add_argument("--start-repeats", type=int_at_least("--start-repeats", 1), default=2)
    parser.add_argument("--threads", type=int_at_least("--threads", 1), default=os.cpu_count())
    parser.add_argument("--skip-start", action="store_true", help="no cold/warm start-up measurement")
    parser.add_argument("--start-only", action="store_true", help="only the cold/warm start-up measurement")
    parser.add_argument("--tp3", action="store_true",
                        help="also TP 3 through Ray, eager and compiled (graphs cut at the collectives)")
    parser.add_argument("--skip-model-granularity", action="store_true",
                        help="no whole-model-graph variant (its first compile takes minutes)")
    parser.add_argument("--start-probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe-ids", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--compiled-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    check_context(parser, args.prompt_tokens, args.new_tokens, "--prompt-tokens", "--new-tokens")
    if args.start_probe:
        start_probe(args, out)
        return

    import torch
    from transformers import AutoTokenizer

    from shardlib.demo_model import ensure_demo_model

    torch.set_num_threads(args.threads)
    model_dir = Path(ensure_demo_model())
    ids = prompt_ids(AutoTokenizer.from_pretrained(model_dir), args.prompt_tokens)
    if args.start_only:
        print(json.dumps({"prompt_tokens": len(ids), "new_tokens": args.new_tokens,
                          "start": start_times(ids, args.new_tokens, model_dir, args.start_repeats)}, indent=2),
              file=out)
        return

    runners = {"transformers_generate": hf_runner(model_dir, ids, args.new_tokens)}
    workers = []
    for name, compile_, granularity in (("corelaunch_eager_in_process", False, None),
                                        ("corelaunch_compiled_in_process", True, None),
                                        ("corelaunch_compiled_layer_graphs_in_process", True, "layer"),
                                        ("corelaunch_compiled_model_decode_graph_in_process", True, "model-decode"),
                                        ("corelaunch_compiled_model_graph_in_process", True, "model")):
        if granularity in ("model", "model-decode") and args.skip_model_granularity:
            continue
        if granularity == DEFAULT_GRANULARITY:  # the default variant above already runs it
            continue
        runners[name], worker = worker_runner(model_dir, ids, args.new_tokens, args.threads, compile_, granularity)
        workers.append(worker)
    # every weight is read once per decoded token (the tied embedding once, as the LM head); the
    # load's count of them, since the CPU backend keeps packed weights as buffers, not parameters
    weight_bytes = workers[0].load_stats.decode_read_bytes
    runners["corelaunch_ray_tp1_compiled"], launcher = ray_runner(model_dir, ids, args.new_tokens, args.threads)
    launchers = [launcher]
    if args.tp3:  # the TP 1 group holds every CPU; the TP 3 groups replace it
        launcher.shutdown()
        launchers = []
        del runners["corelaunch_ray_tp1_compiled"]
        for compile_ in (False, True):
            name = f"corelaunch_ray_tp3_{'compiled' if compile_ else 'eager'}"
            runners[name], tp3 = ray_runner(model_dir, ids, args.new_tokens, args.threads, tp=3, compile_=compile_)
            launchers.append(tp3)
    try:
        for run in runners.values():  # warm-up: compiles graphs, first-call allocations, lazy inits
            run()
        samples: dict[str, list[dict]] = {name: [] for name in runners}
        bandwidths = []
        for _ in range(args.repeats):
            bandwidths.append(measure_gbps(args.threads))
            for name, run in runners.items():
                samples[name].append(run())
    finally:
        for one in reversed(launchers):  # the first one started Ray: it stops it last
            one.shutdown()
        for worker in workers:
            worker.shutdown()

    gbps = max(bandwidths)  # the least disturbed pass
    bound = decode_bound(weight_bytes, gbps)
    results = {name: summarize(runs) for name, runs in samples.items()}
    for result in results.values():
        result["fraction_of_bound"] = round(result["decode_tokens_per_s"] / bound, 4)
    hf = results["transformers_generate"]["decode_tokens_per_s"]
    compiled = results["corelaunch_compiled_in_process"]["decode_tokens_per_s"]
    ray_r = results.get("corelaunch_ray_tp1_compiled")
    report = {
        "model": "SmolLM2-135M-Instruct", "dtype": "float32", "batch": 1, "prompt_tokens": len(ids),
        "new_tokens": args.new_tokens, "threads": args.threads, "repeats": args.repeats, "results": results,
        "bound_tokens_per_s": round(bound, 2),
        "bound": {"weight_bytes": weight_bytes, "read_GBps_each_round": [round(b, 2) for b in bandwidths],
                  "read_GBps_used": round(gbps, 2)},
        "ratios": {
            "compiled_tp1_over_transformers_decode": round(compiled / hf, 4),
            "compiled_over_eager_decode": round(
                compiled / results["corelaunch_eager_in_process"]["decode_tokens_per_s"], 4),
        },
        "targets": {"fraction_of_bound (corelaunch_ray_tp1_compiled)": ">= 0.75",
                    "compiled_tp1_over_transformers_decode": ">= 1.5", "warm_over_cold_wall": "<= 0.5"},
    }
    if ray_r is not None:
        report["fraction_of_bound"] = ray_r["fraction_of_bound"]
        report["ratios"]["ray_compiled_tp1_over_transformers_decode"] = round(ray_r["decode_tokens_per_s"] / hf, 4)
        report["ratios"]["ray_over_in_process_decode"] = round(ray_r["decode_tokens_per_s"] / compiled, 4)
    if "corelaunch_ray_tp3_compiled" in results:
        report["ratios"]["tp3_compiled_over_tp3_eager_decode"] = round(
            results["corelaunch_ray_tp3_compiled"]["decode_tokens_per_s"]
            / results["corelaunch_ray_tp3_eager"]["decode_tokens_per_s"], 4)
    for name in ("layer_graphs", "model_decode_graph", "model_graph"):
        if f"corelaunch_compiled_{name}_in_process" in results:
            report["ratios"][f"{name}_over_default_decode"] = round(
                results[f"corelaunch_compiled_{name}_in_process"]["decode_tokens_per_s"] / compiled, 4)
    report["default_granularity"] = DEFAULT_GRANULARITY
    if not args.skip_start:
        report["start"] = start_times(ids, args.new_tokens, model_dir, args.start_repeats)
    print(json.dumps(report, indent=2), file=out)


if __name__ == "__main__":
    from launcher.cli.command_stdout import run_reporting

    run_reporting(main)
