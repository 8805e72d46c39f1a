"""`corelaunch bench`: latency percentiles and throughput in NxD Inference's report format.

Starts one TP group, runs `--warmup` generate calls that are not recorded, then `--runs` measured
calls of `--batch-size` random prompts of `--prompt-len` tokens, each generating exactly
`--max-new-tokens` tokens greedily (EOS ignored). Per measured call:
- e2e_model: the driver-side wall time of Launcher.generate (Ray round trip included);
- context_encoding_model: the time from the call's submission at the driver until every prompt had
  its first token;
- token_generation_model: each decode step's latency, the time between two consecutive tokens on
  rank 0's clock (planning, the forward and token choice).
The sections and their throughput definitions are in shardlib/evaluation/bench_report.py.
"""

from __future__ import annotations

import argparse
import json
import sys

from launcher.cli.options import (add_backend_arguments, add_cpus_per_rank, add_kv_cache_dtype, add_layout_choices,
                                  add_no_compile, add_pad_q_heads, add_sequence_parallel, add_timeout_arguments,
                                  backend_options, in_tp_flag, int_at_least, layout_choices, timeout_options,
                                  with_flag_name, without_nodes_ways)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="benchmark latency and throughput (NxD Inference's report: e2e, context encoding, "
                      "token generation)",
        description="Measure corelaunch end to end, its context encoding (time to first token) and its "
                    "token generation (each decode step) over several runs after a warm-up, and report "
                    "p50/p90/p95/p99/p100/avg latency in ms and throughput (tokens/s; for context "
                    "encoding, prompt tokens/s) per part, as NxD Inference does.")
    p.add_argument("--model", help="Hugging Face model directory (default: built-in SmolLM2-135M-Instruct)")
    p.add_argument("--tp", default="auto", help="tensor-parallel degree, or auto (default)")
    p.add_argument("--batch-size", type=int_at_least("--batch-size"), default=1, metavar="N",
                   help="prompts per generate call (default 1)")
    p.add_argument("--prompt-len", type=int_at_least("--prompt-len"), default=128, metavar="N",
                   help="tokens per prompt (default 128)")
    p.add_argument("--max-new-tokens", type=int_at_least("--max-new-tokens", 2), default=64, metavar="N",
                   help="tokens generated per prompt, EOS ignored (default 64; at least 2)")
    p.add_argument("--seq-len", type=int_at_least("--seq-len", 2), metavar="N",
                   help="positions per sequence: the KV cache's slots, prompt plus new tokens at most "
                        "(default: min(max_position_embeddings, 4096))")
    p.add_argument("--warmup", type=int_at_least("--warmup", 0), default=1, metavar="N",
                   help="unrecorded calls before measuring (default 1)")
    p.add_argument("--runs", type=int_at_least("--runs"), default=10, metavar="N", help="measured calls (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt token ids (default 0)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's")
    add_kv_cache_dtype(p)
    add_backend_arguments(p)
    add_cpus_per_rank(p)
    add_timeout_arguments(p)
    add_pad_q_heads(p)
    add_sequence_parallel(p)
    add_layout_choices(p)
    add_no_compile(p)
    p.add_argument("--ray-address", help="Ray cluster host:port, or local for a private one (default: RAY_ADDRESS, else the cluster `ray start` recorded on this host, else a private one)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(run=run)


def full_batch_decode_steps(results) -> list[float]:
    """The decode steps (seconds) in which every row of a batch prefilled over several steps (its
    prompts past the prefill budget) decoded: the gaps between the first row's tokens that began
    once the last row had its first token, on the leader's clock (each result's token_times_s, all
    from the one replica bench starts). The steps that prefilled later rows (and decoded the earlier
    ones) are left out, and so are the last row's steps after the first row has finished.
    Each attempt apart (resumed_at: a TP group restarted mid-run): the gap into a resumed attempt's
    first token spans the restart, from one rank 0's clock to another's (another host's: negative,
    or hours), and the resumed rows are prefilled again, staggered as before, on the new clock."""
    per_row = [_attempt_times(r) for r in results]
    # the first token chosen: clocks compare within an attempt only
    first_row = min(per_row, key=lambda attempts: next((k, times[0]) for k, times in enumerate(attempts) if times))
    steps = []
    for attempt, times in enumerate(first_row):
        running = [attempts[attempt] for attempts in per_row if attempt < len(attempts)]  # not finished before it
        if not times or not all(running):  # a row without a token yet in this attempt: none of its steps is whole
            continue
        last_first_token = max(row_times[0] for row_times in running)
        steps += [after - before for before, after in zip(times, times[1:]) if before >= last_first_token]
    return steps


def _attempt_times(result) -> list[list[float]]:
    """A result's token times split at its resumed attempts: one list per attempt, each on its own
    rank 0's clock (empty where a restart came before the attempt chose a token)."""
    bounds = [0, *result.resumed_at, len(result.token_times_s)]
    return [result.token_times_s[start:end] for start, end in zip(bounds, bounds[1:])]


def context_encoding_s(results) -> float:
    """One call's context encoding: from its earliest submission at the driver to its latest first
    token there. Each result's time_to_first_token_s counts from its own submission, stamped as its
    request is built, one row after another, so the largest of them left out the time before the
    latest row's stamp."""
    first_tokens = [r.submitted_at_s + r.time_to_first_token_s for r in results]
    return max(first_tokens) - min(r.submitted_at_s for r in results)


def check_a_whole_batch_decodes(args: argparse.Namespace, budget: int) -> None:
    """ValueError naming --max-new-tokens when no step would decode the whole batch: a batch whose
    prompts exceed the prefill budget is prefilled over several steps, its first rows generating
    meanwhile, and with too few new tokens they ended before the last row's first decode. Every run
    ran, and the report was then refused for want of a decode step to time."""
    import math

    tokens = args.batch_size * args.prompt_len
    steps = math.ceil(tokens / budget)  # the last row's first token comes at this step
    first_row = math.ceil(args.prompt_len / budget)  # the first row's at this one; its last at + max_new_tokens - 1
    least = steps - first_row + 2  # so that the first row still decodes at the step after the last row's first
    if args.max_new_tokens < least:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} leaves no step that decodes the whole batch: its "
                         f"{tokens} prompt tokens (--batch-size {args.batch_size} x --prompt-len {args.prompt_len}) "
                         f"are prefilled over {steps} steps of at most {budget}, and the first rows end before the "
                         f"last starts decoding; pass --max-new-tokens {least} or more, or a smaller --batch-size or "
                         f"--prompt-len")


def random_prompts(batch_size: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(prompt_len)] for _ in range(batch_size)]


def check_prompt_len(args: argparse.Namespace, launcher) -> None:
    """ValueError naming --prompt-len when a prompt plus --max-new-tokens exceeds the positions a
    sequence may hold (the limit Launcher.check_prompts applies, from the lengths alone)."""
    needed = args.prompt_len + args.max_new_tokens
    limit, seq_len = launcher.model_config.max_position_embeddings, launcher.serving_seq_len
    if seq_len < limit and needed <= limit:  # a longer --seq-len holds it; past the model's limit, none does
        limit, name, fix = seq_len, "seq_len", (f"lower --prompt-len or --max-new-tokens, or raise seq_len "
                                                f"(--seq-len {needed}, at most {limit} for this model)")
    else:
        name, fix = "the model's max_position_embeddings", "lower --prompt-len or --max-new-tokens"
    if needed > limit:
        raise ValueError(f"--prompt-len {args.prompt_len} with --max-new-tokens {args.max_new_tokens} needs {needed} "
                         f"positions but {name} is {limit}: {fix}")


PREFILL_BUDGET_CAP = 16384
"""The most prompt tokens bench prefills in one step: a larger batch x prompt length is encoded over
several steps (one call's activations grow with its tokens, and the planner does not count them)."""


def run(args: argparse.Namespace) -> int:
    from launcher.cli.exit_codes import exit_code_for
    from launcher.errors import LaunchError

    try:
        report = _bench(args)
    except BrokenPipeError:
        raise  # stdout's reader went away: 141 (launcher/cli/__init__.py)
    except (ValueError, OSError, LaunchError) as err:  # OSError: a file or directory it could not use, a lock
        needed = args.prompt_len + args.max_new_tokens
        message = in_tp_flag(in_bench_terms(with_flag_name(err), needed))
        print(f"corelaunch bench: {without_nodes_ways(message, 'bench')}", file=sys.stderr)
        return exit_code_for(err)
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(report)
    return 0


def in_bench_terms(message: str, needed: int | None = None) -> str:
    """A launch refusal in bench's own options: its batch is the serving rows (max_num_seqs, plus
    the scratch row), which it sets from --batch-size, with no static rows (max_batch_size 0): the
    planner's "N serving rows" and "--max-num-seqs" are said as bench's --batch-size. needed: the positions a
    run takes (--prompt-len + --max-new-tokens): a shorter sequence length offered as a way out
    ("at most 4") would be refused when followed, so it is left out; a longer one names --seq-len."""
    import re

    def seq_len_way(way: re.Match) -> str:
        return "" if needed is not None and int(way[1]) < needed else way[0].replace("seq_len", "--seq-len", 1)

    message = re.sub(r"a smaller seq_len \(at most (\d+) at [^()]*\)(; )?", seq_len_way, message)
    message = re.sub(r"fewer serving rows \(--max-num-seqs at most (\d+)\)", r"a smaller --batch-size (at most \1)",
                     message)
    message = re.sub(r"(?<!the )\b(\d+) serving rows",
                     lambda rows: f"--batch-size {int(rows[1]) - 1}: {rows[1]} serving rows with the scratch row",
                     message)
    return message.replace("--max-num-seqs", "--batch-size")


def _bench(args: argparse.Namespace) -> dict:
    import time

    from launcher.api import LaunchConfig, Launcher
    from launcher.cli.command_stdout import ray_output_on_stderr
    from launcher.progress import Progress
    from shardlib.evaluation.bench_report import RunTiming, build_report
    from shardlib.serving_shapes import DEFAULT_MAX_PREFILL_TOKENS

    config = LaunchConfig(model=args.model, tp=args.tp, **backend_options(args), **timeout_options(args), pad_q_heads=args.pad_q_heads,
                          sequence_parallel=args.sequence_parallel, **layout_choices(args),
                          dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                          seq_len=args.seq_len, ray_address=args.ray_address, cpus_per_rank=args.cpus_per_rank,
                          compile=args.compile, progress=not args.quiet,
                          # The whole batch runs at once in the serving engine (generate's default path;
                          # no static batch, so no static rows are planned) and is prefilled in one
                          # step where its prompts fit PREFILL_BUDGET_CAP tokens.
                          max_batch_size=0, max_num_seqs=args.batch_size,
                          # every run prefills the same prompts whole: a prefix-cache hit would time
                          # the warm-up's prefill away
                          prefix_caching=False,
                          max_prefill_tokens=max(DEFAULT_MAX_PREFILL_TOKENS,
                                                 min(args.batch_size * args.prompt_len, PREFILL_BUDGET_CAP)))
    timings: list[RunTiming] = []
    launcher = Launcher(config).prepare()
    check_prompt_len(args, launcher)  # before the prompts are built: 10**9 random ids would fill host memory
    prompts = random_prompts(args.batch_size, args.prompt_len, launcher.model_config.vocab_size, args.seed)
    launcher.check_prompts(prompts, max_new_tokens=args.max_new_tokens)  # a prompt too long: before Ray starts
    check_a_whole_batch_decodes(args, config.max_prefill_tokens)  # before the model loads and every run runs
    with ray_output_on_stderr(), launcher:  # the report goes to stdout once Ray has stopped
        progress = Progress(not args.quiet)
        for phase, count in (("warm-up", args.warmup), ("measured", args.runs)):
            if count == 0:
                continue
            restarts_before = _group_restarts(launcher)
            with progress.step(f"{count} {phase} run(s): batch {args.batch_size} x {args.prompt_len} prompt "
                               f"tokens, {args.max_new_tokens} new tokens"):
                for _ in range(count):
                    start = time.perf_counter()
                    results = launcher.generate(prompts, max_new_tokens=args.max_new_tokens, ignore_eos=True)
                    e2e = time.perf_counter() - start
                    if phase == "measured":
                        timings.append(RunTiming(
                            # every prompt encoded: the last first token (several steps past the cap)
                            e2e_s=e2e, time_to_first_token_s=context_encoding_s(results),
                            # a resumed batch is prefilled again, prompts and tokens so far, past the budget
                            # its first prefill fitted: row 0's steps then held the staggered prefill
                            decode_step_latencies_s=(list(results[0].decode_step_latencies_s)
                                                     if args.batch_size * args.prompt_len <= config.max_prefill_tokens
                                                     and not any(r.resumed_at for r in results)
                                                     else full_batch_decode_steps(results)),
                            generated_tokens=sum(len(r.token_ids) for r in results)))
        # a group that failed and was restarted during the measured runs: its requests waited for the
        # restart, and the latencies carry it without a word (a p100 25 times the p50)
        restarts = _group_restarts(launcher) - restarts_before if args.runs else 0
        try:
            report = build_report(timings, args.batch_size, args.prompt_len)
        except ValueError:  # a restart can leave a run no step the whole batch decoded: a failed run, not bad input
            if restarts:
                from launcher.errors import GroupFault

                raise GroupFault(f"no decode step of the whole batch was measured: the TP group failed and was "
                                 f"restarted {restarts} time(s) during the measured runs, which prefilled the batch "
                                 f"again; run the benchmark again") from None
            raise
        report["group_restarts"] = restarts
        if restarts:
            print(f"corelaunch bench: warning: the TP group failed and was restarted {restarts} time(s) during the "
                  f"measured runs, so the end-to-end and context-encoding latencies include the restart (token "
                  f"generation leaves its gap out); run the benchmark again", file=sys.stderr)
        report["config"] = {
            "model": str(launcher.model_dir), "tp_degree": launcher.plan.tp_degree,
            "kv_strategy": str(launcher.plan.kv_strategy), "moe_sharding": launcher.plan.moe_sharding,
            "fused_projections": launcher.config.fused_projections, "backend": launcher.backend,
            "dtype": str(launcher.plan.dtype), "compile": launcher.config.compile, "batch_size": args.batch_size, "prompt_len": args.prompt_len,
            "seq_len": launcher.serving_seq_len, "max_new_tokens": args.max_new_tokens, "warmup": args.warmup, "runs": args.runs,
            # as check's report has them: two runs differing only in these read alike without them
            "kv_cache_dtype": args.kv_cache_dtype,
            "quantization": (None if launcher.plan.config.quantization is None
                             else launcher.plan.config.quantization.to_json()),
        }
    return report


def _group_restarts(launcher) -> int:
    return sum(replica["restarts"] for replica in launcher.replica_status())


def table_title(cfg: dict) -> str:
    """What was measured, as the JSON's config has it: the weights' quantization, the KV cache's
    dtype and eager steps too (tables of an int8 and a float32 run, or of eager and compiled steps,
    had the same title)."""
    from launcher.cli.run_words import run_choices

    how = [cfg["backend"], cfg["dtype"], *run_choices(cfg)]
    return (f"corelaunch bench: tp {cfg['tp_degree']} ({', '.join(how)}), batch {cfg['batch_size']} x "
            f"{cfg['prompt_len']} prompt tokens, {cfg['max_new_tokens']} new tokens, {cfg['runs']} runs after "
            f"{cfg['warmup']} warm-up")


def throughput_text(section: dict) -> str:
    """A section's throughput for the table: n/a where it is None (no time measured: bench_report)."""
    if section["throughput"] is None:
        return f"n/a {section['throughput_unit']}"
    return f"{section['throughput']:.1f} {section['throughput_unit']}"


def _print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from shardlib.evaluation.bench_report import PERCENTILES, SECTIONS

    table = Table(title=table_title(report["config"]), title_justify="left")
    table.add_column("model")
    for p in PERCENTILES:
        table.add_column(f"p{p} ms", justify="right")
    table.add_column("avg ms", justify="right")
    table.add_column("throughput", justify="right")
    table.add_column("samples", justify="right")
    for name in SECTIONS:
        s = report[name]
        table.add_row(name, *(f"{s[f'latency_ms_p{p}']:.2f}" for p in PERCENTILES), f"{s['latency_ms_avg']:.2f}",
                      throughput_text(s), str(s["count"]))
    class _PipeAwareConsole(Console):
        def on_broken_pipe(self) -> None:  # rich exits 1 itself; the command exits 141 as every other does
            raise BrokenPipeError

    console = _PipeAwareConsole(width=max(Console().width, 140), highlight=False)
    console.print(table)
    console.print("throughput: e2e = generated tokens / call time; context encoding = prompt tokens x batch / "
                  "time to first token; token generation = batch / decode step latency", soft_wrap=True)
