"""Replicas and recovery, side by side in one run; prints one JSON object.

Throughput: SmolLM2-135M-Instruct, float32, `--requests` concurrent greedy requests (one prompt each,
one thread per caller) of `--new-tokens` tokens (EOS ignored, so every request decodes the same
count), served by
  - one replica:  TP 1, one rank with `--threads` torch threads (the whole machine), against
  - N replicas:   TP 1 each, threads / N torch threads per rank (the same cores, split).
Each side's groups hold rows for their share of the requests (max_num_seqs: --requests for the one
replica, --requests / N rounded up for each of the N), so both decode every request at once: with
the default 8 rows the one replica decoded 16 requests as two batches one after the other while two
replicas ran 8 each side by side, and the ratio favoured the replicas.
Both launchers stay up for the whole run and their rounds alternate (A B A B ...), so machine noise
hits both alike; each configuration's best round is reported (on a shared machine the least
disturbed one), with every round's figure beside it. Ray is started here with logical CPUs for both
launchers at once; the real split of the cores is each rank's thread count.

Recovery: with the N-replica launcher serving a wave of requests, one replica's rank is SIGKILLed;
reported are the times from the kill until the coordinator noticed (restart begun) and until the
group served again, where the restarted group loaded its weights from, and whether the interrupted
request's tokens equal the fault-free ones.

    python benchmarks/replicas.py [--requests 16] [--new-tokens 64] [--rounds 2] [--replicas 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.cli.options import int_at_least  # noqa: E402 - bad values refused before any work

PROMPTS = ["The capital of France is", "Once upon a time", "The best way to learn", "In the year 2050,",
           "My favourite food is", "The ocean is", "A good friend", "Water boils at"]


PROMPT_TOKENS_AT_MOST = 16
"""More tokens than any prompt above has (each is under 8 tokens, " really" adds one)."""


def serving_context(launch: dict) -> int:
    """The KV-cache length a Launcher of these settings serves with, from its plan (no Ray)."""
    from launcher.api import LaunchConfig
    from launcher.launch_plan import plan_launch
    from launcher.progress import Progress

    return plan_launch(LaunchConfig(**launch), Progress(False)).plan.seq_len


def concurrent_round(launcher, prompts: list[str], new_tokens: int) -> dict:
    """Every prompt as its own generate() call from its own thread, all at once."""
    results: dict[int, object] = {}
    latencies: dict[int, float] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(prompts) + 1)

    def ask(i: int) -> None:
        barrier.wait()
        start = time.perf_counter()
        try:
            results[i] = launcher.generate([prompts[i]], max_new_tokens=new_tokens, ignore_eos=True)[0]
        except BaseException as err:  # noqa: BLE001 - raised again in the calling thread below
            errors.append(err)
        latencies[i] = time.perf_counter() - start

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:  # a thread's traceback alone, then a KeyError here, and no report
        raise errors[0]
    tokens = sum(len(results[i].token_ids) for i in results)
    lat = sorted(latencies.values())
    return {"elapsed_s": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed,
            "latency_s_p50": statistics.median(lat), "latency_s_max": lat[-1],
            "replicas_used": sorted({results[i].replica for i in results}),
            "token_ids": [results[i].token_ids for i in range(len(prompts))]}


def measure_recovery(launcher, prompts: list[str], new_tokens: int, expected: list[list[int]],
                     join_timeout_s: float = 300.0) -> dict:
    """SIGKILL replica 0's rank while the replicas serve a wave of requests; time the way back.

    join_timeout_s: how long, once the group serves again (or the wait for it ended), the requests
    may take to finish; one still running then is reported, not waited on without end."""
    answers: dict[int, object] = {}
    failures: dict[int, str] = {}

    def ask(i: int) -> None:
        try:
            answers[i] = launcher.generate([prompts[i]], max_new_tokens=new_tokens, ignore_eos=True)[0]
        except BaseException as err:  # noqa: BLE001 - a request lost in the restart is what this reports
            failures[i] = f"{type(err).__name__}: {err}"

    # daemon: a request that never returns must not keep the benchmark's process alive after its report
    threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not launcher.replica_status()[0]["busy"]:
        assert time.monotonic() < deadline, "replica 0 never took a request"
        time.sleep(0.01)
    time.sleep(0.5)
    victim = launcher.replica_status()[0]["workers"][0]
    os.kill(victim["pid"], signal.SIGKILL)
    killed = time.monotonic()
    noticed = serving = None
    while serving is None and time.monotonic() - killed < 300:
        status = launcher.replica_status()[0]
        if noticed is None and status["restarts"] >= 1:
            noticed = time.monotonic() - killed
        if status["restarts"] >= 1 and status["state"] == "serving":
            serving = time.monotonic() - killed
        time.sleep(0.02)
    join_deadline = time.monotonic() + join_timeout_s
    for t in threads:
        t.join(max(0.0, join_deadline - time.monotonic()))
    unfinished = [i for i, t in enumerate(threads) if t.is_alive()]
    status = launcher.replica_status()[0]
    rerun = [i for i in answers if answers[i].attempts > 1]
    # every prompt counts: a request that failed or never returned has no answer equal to the fault-free one
    equal = all(i in answers and answers[i].token_ids == expected[i] for i in range(len(prompts)))
    return {"kill_to_noticed_s": noticed, "kill_to_serving_again_s": serving,
            "restart_s": status["last_recovery_s"], "restarted_group_loaded_from": status["load_source"],
            "requests_rerun": len(rerun), "requests_failed": len(failures),
            "request_errors": {str(i): failures[i] for i in sorted(failures)},
            "requests_unfinished": unfinished, "join_timeout_s": join_timeout_s,
            "all_answers_equal_fault_free": equal, "state_after": status["state"]}


def side_settings(model: str, requests: int, replicas: int, threads: int) -> dict[str, dict]:
    """The Launcher settings of each side ("one": one replica; "many": `replicas` of them) on the same
    `threads`. Every group gets a serving row for each request it may hold at once: with fewer rows the
    extra requests wait for one and that side decodes in turns while the other does not."""
    common = dict(model=model, tp=1, dtype="float32", progress=False, max_batch_size=8,
                  prefix_caching=False)  # every round prefills its prompts whole, as the first does
    return {"one": common | dict(replicas=1, cpus_per_rank=threads, max_num_seqs=requests),
            "many": common | dict(replicas=replicas, cpus_per_rank=threads // replicas,
                                  max_num_seqs=math.ceil(requests / replicas))}


def threads_in_all(parser: argparse.ArgumentParser, threads: int | None, replicas: int) -> int:
    """The torch threads both configurations share out: --threads, which must split evenly over the
    replicas (3 over 2 gave the single replica 3 threads against 2 x 1, and the ratio compared
    different core counts), or by default this host's cores rounded down to a multiple of replicas."""
    cores = os.cpu_count() or 2
    given = threads is not None
    if not given:  # fewer cores than replicas stay as they are: refused below, naming them
        threads = cores if cores < replicas else cores - cores % replicas
    if replicas > threads:
        parser.error(f"--replicas ({replicas}) above --threads ({threads}): each replica's rank needs "
                     f"a thread of its own, or the split runs more threads than the single replica and the "
                     f"ratio compares different cores; raise --threads or lower --replicas")
    if given and threads % replicas:
        fits = threads - threads % replicas
        parser.error(f"--threads ({threads}) must split evenly over --replicas ({replicas}): the single replica "
                     f"would run {threads} threads against {replicas} x {threads // replicas}, and the ratio "
                     f"compare different core counts; pass --threads {fits} or {fits + replicas}")
    return threads


def main(out=None) -> None:
    """out: where the JSON report goes (stdout when None)."""
    out = out or sys.stdout
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int_at_least("--requests", 1), default=16)
    parser.add_argument("--new-tokens", type=int_at_least("--new-tokens", 2), default=64)
    parser.add_argument("--rounds", type=int_at_least("--rounds", 1), default=2, help="alternating rounds per configuration")
    parser.add_argument("--replicas", type=int_at_least("--replicas", 1), default=2)
    parser.add_argument("--threads", type=int_at_least("--threads", 1),
                        help="torch threads in all, a multiple of --replicas (default: this host's cores, rounded "
                             "down to a multiple of --replicas)")
    args = parser.parse_args()
    if args.replicas == 1:  # the one-replica side is the same launcher: the ratio would compare it with itself
        parser.error("--replicas (1) must be at least 2: the benchmark compares one replica with --replicas "
                     "replicas on the same cores, and with 1 both sides are the same setup; pass --replicas 2 or more")
    args.threads = threads_in_all(parser, args.threads, args.replicas)

    import ray

    from launcher.api import Launcher
    from shardlib.demo_model import ensure_demo_model

    model = str(ensure_demo_model())
    prompts = [PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else " really") for i in range(args.requests)]
    sides = side_settings(model, args.requests, args.replicas, args.threads)
    # each side's group plan (its rows included; replicas and threads are not part of it): the shorter context binds
    context = min(serving_context({k: v for k, v in side.items() if k not in ("replicas", "cpus_per_rank")})
                  for side in sides.values())
    if PROMPT_TOKENS_AT_MOST + args.new_tokens > context:  # refused by generate() only once Ray and both ran
        parser.error(f"--new-tokens ({args.new_tokens}) plus the prompts (at most {PROMPT_TOKENS_AT_MOST} tokens) "
                     f"is past the {context}-token context the launchers serve; lower --new-tokens to at most "
                     f"{context - PROMPT_TOKENS_AT_MOST}")
    per_rank = sides["many"]["cpus_per_rank"]
    # address="local": a private Ray of this host, never one `ray start` recorded (ray.init would join
    # it and then refuse num_cpus)
    ray.init(address="local", num_cpus=args.threads + per_rank * args.replicas, include_dashboard=False,
             log_to_driver=False, logging_level="ERROR")
    cache = tempfile.mkdtemp(prefix="corelaunch-bench-cache-")
    try:
        one = Launcher(**sides["one"]).start()
        many = Launcher(presharded_cache=True, presharded_cache_dir=cache, **sides["many"]).start()
        for launcher in (one, many):  # warm-up: a whole round, so every batch and length bucket the
            concurrent_round(launcher, prompts, args.new_tokens)  # timed rounds use is compiled
        rounds: dict[str, list[dict]] = {"one": [], "many": []}
        for _ in range(args.rounds):
            rounds["one"].append(concurrent_round(one, prompts, args.new_tokens))
            rounds["many"].append(concurrent_round(many, prompts, args.new_tokens))
        one.shutdown()
        expected = rounds["one"][0]["token_ids"]
        deadline = time.monotonic() + 120
        while not many.presharded_cache_ready and time.monotonic() < deadline:
            time.sleep(0.2)
        recovery = measure_recovery(many, prompts, args.new_tokens, expected)
        many.shutdown()
    finally:
        ray.shutdown()
        import shutil

        shutil.rmtree(cache, ignore_errors=True)

    def summary(runs: list[dict]) -> dict:
        best = max(runs, key=lambda r: r["tokens_per_s"])
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in best.items() if k != "token_ids"} | {
            "tokens_per_s_all_rounds": [round(r["tokens_per_s"], 2) for r in runs]}

    report = {
        "model": "SmolLM2-135M-Instruct", "dtype": "float32", "requests": args.requests,
        "new_tokens": args.new_tokens, "rounds": args.rounds, "cpu_count": os.cpu_count(),
        "one_replica": {"replicas": 1, "threads_per_rank": args.threads,
                        "rows_per_replica": sides["one"]["max_num_seqs"]} | summary(rounds["one"]),
        "replicas": {"replicas": args.replicas, "threads_per_rank": per_rank,
                     "rows_per_replica": sides["many"]["max_num_seqs"]} | summary(rounds["many"]),
        "same_tokens": all(r["token_ids"] == expected for r in rounds["one"] + rounds["many"]),
        "recovery": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in recovery.items()},
    }
    report["throughput_ratio"] = round(report["replicas"]["tokens_per_s"] / report["one_replica"]["tokens_per_s"], 3)
    report["throughput_target"] = 1.5
    print(json.dumps(report, indent=1), file=out)


if __name__ == "__main__":
    from launcher.cli.command_stdout import run_reporting

    run_reporting(main)
