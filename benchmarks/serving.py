"""Serving throughput and latency over HTTP, with concurrent streaming clients; prints one JSON object.

Workload: SmolLM2-135M-Instruct's tokenizer builds distinct prompts of exactly --prompt-tokens
tokens, sent as token ids to an OpenAI-compatible /v1/completions endpoint with the official
`openai` client: --max-tokens new tokens, temperature 0, streamed, `ignore_eos` so every request
gets exactly --max-tokens tokens. At each concurrency level N (default 1, 4, 16, 32), N clients each
send --requests-per-client requests one after another (level 1 sends --level1-requests), after an
unmeasured warm-up wave at the same level (graphs for new batch shapes are built there). Per level:
aggregate output tokens/s, TTFT / inter-token / end-to-end latency p50 and p99, each stream's
decode tokens/s, and whether every request got exactly --max-tokens tokens.

Server: without --base-url it starts `corelaunch serve` on a free loopback port (TP 1, the smallest
buckets that hold the request, --max-num-seqs the highest level, --stream-interval if given), waits
for GET /health, and stops it at the end. With --base-url URL --model NAME it measures any
OpenAI-compatible server (vLLM).

--baselines: first, with no server running, the same model in this process through the driver API
(one Ray TP 1 group, static batching): (a) --baseline-prompts prompts one after another, (b) all of
them in one static batch. Ratios: level 16 against (a) and (b), level 1's per-stream decode speed
against (a)'s, and TTFT p99 at 16 against the static batch's prefill plus two decode steps.

--cpus-per-rank C: the rank (and the baselines' rank) claims C CPUs and runs that many threads. On
a 2-core host, 1 leaves one core to the HTTP path (the client, Serve's processes, Ray's daemons),
as a serving host with more cores than its ranks use would: the ratios then show what the HTTP path
costs when it does not take the rank's cores.

--baselines-after: once the server has stopped, the static batch and a few single streams are
measured again in this process. The machine's speed can drift by up to a quarter from one run to
the next, and the levels run between the two measurements, so `ratios_bracketed` compares them against the mean of
before and after; `baseline_drift` says how far the machine moved (after / before).

    python benchmarks/serving.py [--levels 1,4,16,32] [--baselines] [--base-url URL --model NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import inspect
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.arguments import check_context, finite_number, model_folder, positive_seconds, smallest_buckets  # noqa: E402 - bad values refused before any work
from benchmarks.process_cpu import cpu_by_process, snapshot  # noqa: E402
from benchmarks.serving_client import PromptSource, exit_unless_served, run_level, url_problem  # noqa: E402
from benchmarks.serving_server import corelaunch_server  # noqa: E402
from benchmarks.serving_stats import (BRACKETED, baseline_drift, bracketed_baselines, expected_ttft_s,  # noqa: E402
                                      ratio, summarize_level)

DEFAULT_SERVED_NAME = "smollm2-135m-instruct"


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown")
    return {"cpu_model": model, "cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)),
            "python": platform.python_version()}


def server_compiles(server_args: list[str]) -> bool:
    """Whether the server this benchmark starts compiles its graphs: not with --server-arg=--no-compile.
    An eager server then gets neither --warm-up (no graphs to build) nor --max-context-length (eager
    prompts run at their exact lengths): it refused both, so a --no-compile run could never start."""
    return "--no-compile" not in server_args


def serve_arguments(model_dir: str, args: argparse.Namespace) -> list[str]:
    """`corelaunch serve` arguments for the HTTP levels: TP 1, room for the highest level's clients,
    the smallest buckets that hold one request, every graph built before the first request (which
    shapes a level meets depends on when its requests arrive; not with --server-arg=--no-compile:
    server_compiles), --cpus-per-rank and --stream-interval if given, then any --server-arg."""
    compiles = server_compiles(args.server_arg)
    options = smallest_buckets(args.prompt_tokens, args.max_tokens)
    if not compiles:
        del options["max_context_length"]
    if args.cpus_per_rank is not None:
        options["cpus_per_rank"] = args.cpus_per_rank
    if args.stream_interval is not None:
        options["stream_interval"] = args.stream_interval
    return ["--model", model_dir, "--tp", "1", "--served-model-name", args.model,
            "--max-num-seqs", str(max(args.levels)), *(["--warm-up"] if compiles else []),
            *[f"--{k.replace('_', '-')}={v}" for k, v in options.items()], *args.server_arg]


# ---- baselines: the driver API in this process ------------------------------------------------------
def static_generate(launcher, prompts: list[list[int]], max_tokens: int) -> list:
    """launcher.generate(..., batching="static"): one fixed batch, no requests joining mid-way. Where
    the driver API predates the keyword, a generate() call already is exactly that, so it is left
    out (and the report says so)."""
    options = {"batching": "static"} if "batching" in inspect.signature(launcher.generate).parameters else {}
    return launcher.generate(prompts, max_new_tokens=max_tokens, ignore_eos=True, **options)


@contextlib.contextmanager
def baseline_launcher(model_dir: str, prompts: list[list[int]], max_tokens: int,
                      cpus_per_rank: float | None = None):
    """The in-process driver API the baselines run on (TP 1, one Ray group; cpus_per_rank as
    --cpus-per-rank), with the static batch's batch-1 and batch-N graphs already used once; shut
    down on leaving."""
    from launcher.api import Launcher

    count = len(prompts)
    # warm_up: every graph is built before anything is timed (continuous batching meets whichever
    # prefill and decode batch shapes the arrival times make).
    # prefix_caching off: the in-process continuous batch runs the warm-up's prompts again, which
    # would otherwise skip their prefills (the HTTP levels never repeat a prompt)
    with Launcher(model=model_dir, tp=1, max_batch_size=count, max_num_seqs=count, progress=False,
                  ray_address="local", warm_up=True, cpus_per_rank=cpus_per_rank, prefix_caching=False,
                  **smallest_buckets(len(prompts[0]), max_tokens)) as launcher:
        static_generate(launcher, prompts[:1], max_tokens)  # warm-up: builds the batch-1 graphs
        static_generate(launcher, prompts, max_tokens)  # and the batch-N ones
        yield launcher


def static_batch_summary(batch: list, static_s: float, max_tokens: int) -> dict:
    """The static batch's figures: throughput, its prefill (the batch's TTFT), its median decode step."""
    batch_ttft = max(out.time_to_first_token_s for out in batch)  # one batch: one prefill for all
    steps = list(batch[0].decode_step_latencies_s)
    return {
        "wall_s": round(static_s, 4),
        "output_tokens_per_s": round(len(batch) * max_tokens / static_s, 2),
        "time_to_first_token_s": round(batch_ttft, 4),
        "decode_step_s_median": round(statistics.median(steps), 5) if steps else None,
        "expected_ttft_s_prefill_plus_2_steps": round(expected_ttft_s(batch_ttft, steps), 4) if steps else None,
    }


def measure_baselines(model_dir: str, prompts: list[list[int]], max_tokens: int,
                      cpus_per_rank: float | None = None) -> dict:
    count = len(prompts)
    with baseline_launcher(model_dir, prompts, max_tokens, cpus_per_rank) as launcher:
        start = time.perf_counter()
        singles = [static_generate(launcher, [p], max_tokens)[0] for p in prompts]
        one_at_a_time_s = time.perf_counter() - start
        start = time.perf_counter()
        batch = static_generate(launcher, prompts, max_tokens)
        static_s = time.perf_counter() - start
        keyword = "batching" in inspect.signature(launcher.generate).parameters
        continuous = measure_continuous(launcher, prompts, max_tokens) if keyword else None
    for out in singles + batch:
        assert len(out.token_ids) == max_tokens, f"a baseline request got {len(out.token_ids)} tokens, not {max_tokens}"
    return {
        "prompts": count,
        "batching_keyword_passed": keyword,
        "one_at_a_time": {
            "wall_s": round(one_at_a_time_s, 4),
            "output_tokens_per_s": round(count * max_tokens / one_at_a_time_s, 2),
            "decode_tokens_per_s_median": round(statistics.median(o.decode_tokens_per_s for o in singles), 2),
            "ttft_s_median": round(statistics.median(o.time_to_first_token_s for o in singles), 4),
        },
        "static_batch": static_batch_summary(batch, static_s, max_tokens),
        "continuous_in_process": continuous,
    }


def measure_static_again(model_dir: str, prompts: list[list[int]], max_tokens: int, singles: int = 4,
                         cpus_per_rank: float | None = None) -> dict:
    """The static batch of `prompts` and `singles` of them one at a time (their decode speed), in a
    fresh in-process launcher: the figures --baselines-after measures again, in the shape of
    measure_baselines' report."""
    with baseline_launcher(model_dir, prompts, max_tokens, cpus_per_rank) as launcher:
        start = time.perf_counter()
        batch = static_generate(launcher, prompts, max_tokens)
        static_s = time.perf_counter() - start
        alone = [static_generate(launcher, [p], max_tokens)[0] for p in prompts[:singles]]
    return {
        "static_batch": static_batch_summary(batch, static_s, max_tokens),
        "one_at_a_time": {"decode_tokens_per_s_median": round(statistics.median(o.decode_tokens_per_s for o in alone), 2),
                          "prompts": len(alone)},
    }


def measure_continuous(launcher, prompts: list[list[int]], max_tokens: int) -> dict:
    """The same prompts through continuous batching in this process (driver API, no HTTP): all at
    once, and one at a time; plus the leader's own split of its loop time between the forwards and
    everything else (scheduling, the plan's broadcast, sampling, posting tokens)."""
    replica = launcher._pool.replicas[0]

    def counters() -> dict:
        time.sleep(0.3)  # the replica's next poll brings the leader's counters
        return dict(replica.loop_counters)

    launcher.generate(prompts, max_new_tokens=max_tokens, ignore_eos=True)  # warm-up: this load's graphs
    launcher.generate(prompts[:1], max_new_tokens=max_tokens, ignore_eos=True)
    before = counters()
    start = time.perf_counter()
    together = launcher.generate(prompts, max_new_tokens=max_tokens, ignore_eos=True)
    together_s = time.perf_counter() - start
    after = counters()
    singles = [launcher.generate([p], max_new_tokens=max_tokens, ignore_eos=True)[0] for p in prompts[:4]]
    for out in together + singles:
        assert len(out.token_ids) == max_tokens, f"a continuous request got {len(out.token_ids)} tokens"
    step_s, plan_s = (after["step_s"] - before["step_s"]), (after["plan_s"] - before["plan_s"])
    return {
        "all_at_once": {"wall_s": round(together_s, 4),
                        "output_tokens_per_s": round(len(prompts) * max_tokens / together_s, 2),
                        "steps": after["steps"] - before["steps"],
                        "leader_overhead_fraction": round(plan_s / (plan_s + step_s), 4) if step_s else None},
        "one_at_a_time_decode_tokens_per_s_median": round(statistics.median(o.decode_tokens_per_s for o in singles), 2),
    }


# ---- HTTP levels -------------------------------------------------------------------------------------
async def measure_levels(base_url: str, model: str, prompts: PromptSource, args) -> dict:
    from openai import AsyncOpenAI

    # no retries: a failed request must show as a failure, not as a slow success
    client = AsyncOpenAI(base_url=base_url, api_key=getattr(args, "api_key", None) or "unused", max_retries=0,
                         timeout=args.request_timeout)
    try:
        return {str(level): await measure_level(client, model, prompts, level, args) for level in args.levels}
    finally:
        await client.close()


def _load_average() -> list[float] | None:
    """This host's 1, 5 and 15 minute load averages (None where the system has none): a level whose
    load rose far above the server's own threads shared its cores with something else."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


async def measure_level(client, model: str, prompts: PromptSource, level: int, args) -> dict:
    """One concurrency level: its warm-up wave (unless --no-warmup), then the measured requests."""
    warmup_errors = None
    if args.warmup:
        warmup, _ = await run_level(client, model, prompts.take(level), level, args.max_tokens)
        failed = [r.error for r in warmup if r.error is not None]
        warmup_errors = len(failed)
        if failed:  # its graphs may not have been built: the measured wave then pays for them
            print(f"level {level}: {len(failed)} of {len(warmup)} warm-up requests failed (first: {failed[0]})",
                  file=sys.stderr)
    per_client = args.level1_requests if level == 1 else args.requests_per_client
    before = snapshot() if args.cpu_by_process else None
    load_before = _load_average()
    records, wall = await run_level(client, model, prompts.take(level * per_client), level, args.max_tokens)
    figures = {"clients": level, **summarize_level(records, wall, args.max_tokens),
               "warmup_errors": warmup_errors,  # null: --no-warmup
               "load_average_before": load_before, "load_average_after": _load_average()}
    if before is not None:
        figures["cpu_by_process"] = cpu_by_process(before, snapshot())
    print(f"level {level}: {figures['output_tokens_per_s']} tokens/s", file=sys.stderr)
    return figures


def ratios(levels: dict, baselines: dict | None) -> dict:
    """The issue's ratios, each where its own level ran (the lone stream's with level 1 alone too);
    None for a level that is not valid (a request failed or came back short): its figures measure
    the failures, not the server."""
    if baselines is None:
        return {}
    one, static = baselines["one_at_a_time"], baselines["static_batch"]

    def figure(level: str, *keys: str):
        value = levels[level] if levels[level].get("valid", True) else None
        for key in keys:
            value = None if value is None else value[key]
        return value

    out = {}
    if "16" in levels:
        out["level16_over_one_at_a_time"] = ratio(figure("16", "output_tokens_per_s"), one["output_tokens_per_s"])
        out["level16_over_static_batch"] = ratio(figure("16", "output_tokens_per_s"), static["output_tokens_per_s"])
        out["ttft_p99_at_16_over_prefill_16_plus_2_steps"] = ratio(figure("16", "ttft_s", "p99"),
                                                                   static["expected_ttft_s_prefill_plus_2_steps"])
    if "1" in levels:
        out["level1_stream_decode_over_single_stream"] = ratio(figure("1", "decode_tokens_per_s_per_stream_p50"),
                                                               one["decode_tokens_per_s_median"])
    return out


def not_bracketed(bracketed_ratios: dict) -> dict:
    """The ratios in ratios_bracketed whose baseline figure was measured once, before the levels (not in
    BRACKETED): there they equal the unbracketed ratio, and the report says why beside them."""
    once = {"level16_over_one_at_a_time": "one_at_a_time.output_tokens_per_s"}
    return {name: f"{figure} is measured once, before the levels (the prompts one at a time are not run again): "
                  f"this ratio is the unbracketed one"
            for name, figure in once.items()
            if name in bracketed_ratios and tuple(figure.split(".")) not in BRACKETED}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from launcher.cli.options import int_at_least

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,4,16,32", help="concurrency levels, comma-separated")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=1)
    parser.add_argument("--level1-requests", type=int, default=4, help="requests the single client sends at level 1")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="no unmeasured wave before each level")
    parser.add_argument("--base-url", help="an OpenAI-compatible server's /v1 URL; default: start corelaunch serve")
    parser.add_argument("--model", default=DEFAULT_SERVED_NAME, help="the model name the server serves")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="with --base-url: the key the server wants (default: OPENAI_API_KEY)")
    parser.add_argument("--model-dir", help="Hugging Face folder: its tokenizer builds the prompts, and "
                                            "corelaunch serve loads it (default: the built-in SmolLM2)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for corelaunch serve, written --server-arg=--flag (repeat for several)")
    parser.add_argument("--cpus-per-rank", type=finite_number("--cpus-per-rank", 0, above=True), metavar="C",
                        help="CPUs (and threads) the rank claims, in the server and the baselines alike "
                             "(default: all of them); see the module docstring")
    parser.add_argument("--stream-interval", type=int_at_least("--stream-interval"), metavar="N",
                        help="tokens per streamed chunk of the corelaunch server this benchmark starts (its "
                             "--stream-interval; default: its own, 1)")
    parser.add_argument("--server-timeout", type=positive_seconds("--server-timeout"),
                        help="seconds to wait for GET /health (default 900)")
    parser.add_argument("--request-timeout", type=positive_seconds("--request-timeout"), default=600)
    parser.add_argument("--baselines", action="store_true", help="also the in-process driver-API baselines")
    parser.add_argument("--baseline-prompts", type=int, default=16)
    parser.add_argument("--baselines-only", action="store_true", help="only the baselines: no server, no HTTP levels")
    parser.add_argument("--baselines-after", action="store_true",
                        help="with --baselines: measure the static batch and single streams again after the "
                             "levels, and compare the levels against the mean of before and after")
    parser.add_argument("--cpu-by-process", action="store_true",
                        help="per measured level, each process's CPU seconds and the most involuntary context "
                             "switches of any of its threads (from /proc: this host's processes only)")
    args = parser.parse_args(argv)
    args.baselines |= args.baselines_only
    if not args.baselines_only and importlib.util.find_spec("openai") is None:  # the levels' clients
        parser.error("the HTTP levels' clients are the official `openai` package, which is not installed: "
                     "pip install openai (or the test extra: pip install -e '.[test]'), or --baselines-only")
    if args.cpu_by_process and not Path("/proc/self/task").is_dir():
        parser.error("--cpu-by-process reads /proc, which this system does not have (Linux only)")
    if args.baselines_after and (not args.baselines or args.baselines_only):
        parser.error("--baselines-after measures the baselines again after the HTTP levels: it needs "
                     "--baselines and HTTP levels (not --baselines-only)")
    try:
        args.levels = [int(x) for x in args.levels.split(",")]
    except ValueError:
        parser.error(f"--levels ({args.levels!r}) must be comma-separated positive integers, e.g. 1,4,16,32")
    if not args.levels or min(args.levels) < 1:
        parser.error(f"--levels ({args.levels}) must be positive integers")
    repeated = sorted({level for level in args.levels if args.levels.count(level) > 1})
    if repeated:  # the report keys levels by their count: the second run overwrote the first
        parser.error(f"--levels ({','.join(map(str, args.levels))}) names {', '.join(map(str, repeated))} more than "
                     f"once: each level is reported under its count, so a repeat overwrote the one before; "
                     f"give each level once (for more samples raise --requests-per-client or --level1-requests)")
    for name in ("prompt_tokens", "max_tokens", "requests_per_client", "level1_requests", "baseline_prompts"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be at least 1")
    problem = args.base_url is not None and url_problem(args.base_url)
    if problem:
        parser.error(problem)
    if args.cpus_per_rank is not None and args.base_url:
        parser.error("--cpus-per-rank sets the rank's CPUs of the corelaunch server this benchmark starts; "
                     "with --base-url the server is someone else's")
    started_here_only = (("--baselines-after", args.baselines_after), ("--server-arg", args.server_arg),
                         ("--server-timeout", args.server_timeout is not None),
                         ("--stream-interval", args.stream_interval is not None))
    if args.base_url and any(on for _, on in started_here_only):
        given = [f for f, on in started_here_only if on]
        parser.error(f"{', '.join(given)} concern the corelaunch server this benchmark starts and stops; with "
                     f"--base-url the server is someone else's, running throughout (drop them)")
    if args.server_timeout is None:
        args.server_timeout = 900.0
    runs_corelaunch = not args.base_url or args.baselines  # its own server or the in-process baselines
    if args.model_dir is not None:  # with someone else's server only its tokenizer is read
        try:
            if runs_corelaunch:
                model_folder("--model-dir")(args.model_dir)
            # the prompts are always built with its tokenizer (a folder without one passed, and failed
            # in transformers once the server had started)
            model_folder("--model-dir", tokenizer_only=True)(args.model_dir)
        except argparse.ArgumentTypeError as err:
            parser.error(str(err))
    if runs_corelaunch:  # the buckets of the server or baselines it starts; another server has its own
        check_context(parser, args.prompt_tokens, args.max_tokens, "--prompt-tokens", "--max-tokens")
    if args.baselines and not args.baselines_only and 16 in args.levels and args.baseline_prompts != 16:
        parser.error(f"--baseline-prompts {args.baseline_prompts} with level 16: the report's ratios set 16 "
                     f"clients against a static batch of the baseline prompts, so it must be 16 too (or leave "
                     f"16 out of --levels)")
    if args.max_tokens < 2 and args.baselines:
        parser.error("--baselines needs --max-tokens >= 2 (the decode step time comes from the static batch)")
    return args


def _exit_on_termination() -> None:
    """SIGTERM and SIGHUP (`timeout`, a cancelled CI job, a closed terminal) as SystemExit, so the
    server this benchmark started, in a session of its own, is stopped by the same clean-up as
    after Ctrl-C; it was left running, with its Ray and the model loaded."""
    import signal

    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)


def main(out=None) -> None:
    """out: where the JSON report goes (stdout when None)."""
    out = out or sys.stdout
    args = parse_args()
    if args.base_url:  # before the baselines' minutes, and before any level: no server, or not --model's
        exit_unless_served("serving.py", args.base_url, args.api_key, args.model)
    _exit_on_termination()
    from transformers import AutoTokenizer

    from shardlib.demo_model import ensure_demo_model

    model_dir = str(args.model_dir or ensure_demo_model())
    prompts = PromptSource(AutoTokenizer.from_pretrained(model_dir), args.prompt_tokens)
    report = {"machine": machine(),
              "workload": {"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "temperature": 0,
                           "ignore_eos": True, "levels": args.levels, "requests_per_client": args.requests_per_client,
                           "level1_requests": args.level1_requests, "warmup": args.warmup,
                           "cpus_per_rank": args.cpus_per_rank,
                           # false with --server-arg=--no-compile (an eager server: no graphs to build
                           # before the first request); null: someone else's server
                           "server_warm_up": None if args.base_url else server_compiles(args.server_arg),
                           # as given; null: the server's own (corelaunch serve's is 1)
                           "stream_interval": args.stream_interval}}
    baselines = None
    baseline_prompts = prompts.take(args.baseline_prompts) if args.baselines else []
    if args.baselines:  # before any server starts: the two would share the cores
        baselines = measure_baselines(model_dir, baseline_prompts, args.max_tokens, args.cpus_per_rank)
        report["baselines"] = baselines
        # On stderr at once, so that a server that then fails to start does not lose minutes of figures.
        print(json.dumps({"baselines": baselines}), file=sys.stderr, flush=True)
    if args.baselines_only:
        print(json.dumps(report, indent=2), file=out)
        return
    if args.base_url:
        report["server"] = {"base_url": args.base_url, "model": args.model, "started_here": False}
        if args.baselines:  # measured while that server ran (idle or not): they shared the cores
            report["baselines"]["measured_beside_the_server"] = args.base_url
        levels = asyncio.run(measure_levels(args.base_url, args.model, prompts, args))
    else:
        with corelaunch_server(serve_arguments(model_dir, args), args.server_timeout) as (base_url, command):
            report["server"] = {"base_url": base_url, "model": args.model, "started_here": True,
                                "command": command}
            levels = asyncio.run(measure_levels(base_url, args.model, prompts, args))
    report["levels"] = levels
    report["ratios"] = ratios(levels, baselines)
    if args.baselines_after:  # the server has stopped: the same prompts, again in this process
        after = measure_static_again(model_dir, baseline_prompts, args.max_tokens, cpus_per_rank=args.cpus_per_rank)
        report["baselines_after"] = after
        report["baseline_drift"] = baseline_drift(baselines, after)
        report["ratios_bracketed"] = ratios(levels, bracketed_baselines(baselines, after))
        report["ratios_bracketed_measured_once"] = not_bracketed(report["ratios_bracketed"])
    report["targets"] = {"level1_stream_decode_over_single_stream": ">= 0.95"}
    print(json.dumps(report, indent=2), file=out)
    invalid = [level for level, figures in levels.items() if not figures["valid"]]
    if invalid:  # the report stands, but these levels' figures measure failures
        print(f"levels {', '.join(invalid)}: a request failed or came back short (see short_or_failed); their "
              f"ratios are null", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    from launcher.cli.command_stdout import run_reporting

    run_reporting(main)
