"""`corelaunch generate`: start a TP group, generate for the prompts, print the text (or JSON)."""

from __future__ import annotations

import argparse
import json
import sys

from launcher.cli.options import (add_backend_arguments, add_bucket_lists, add_granularity, add_no_compile,
                                  backend_options, bucket_lists)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="generate text with a tensor-parallel group of Ray workers",
        description="Plan, start one Ray worker per rank, load each rank's shard, and generate. "
                    "Greedy unless sampling flags are given.")
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (or use --prompt)")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt; repeatable (added after the positional prompts)")
    p.add_argument("--model", help="Hugging Face model directory (default: built-in SmolLM2-135M-Instruct)")
    p.add_argument("--tp", default="auto", help="tensor-parallel degree, or auto (default)")
    add_backend_arguments(p)
    p.add_argument("--nodes", type=int, default=1,
                   help="nodes one TP group may span when one node lacks cores (default 1)")
    p.add_argument("--replicas", default="1", metavar="N|auto",
                   help="independent TP groups; prompts are spread over them; auto: as many as fit (default 1)")
    p.add_argument("--max-restarts", type=int, default=3, metavar="N",
                   help="restarts of a failed replica within --restart-window; 0 disables them (default 3)")
    p.add_argument("--restart-window", type=float, default=600.0, metavar="S",
                   help="seconds over which --max-restarts is counted (default 600)")
    p.add_argument("--cpus-per-rank", type=float, metavar="C",
                   help="cpu backend: CPUs per rank (default: the cluster's CPUs divided over every rank)")
    p.add_argument("--presharded-cache", action="store_true",
                   help="write a pre-sharded copy after the first load and restart groups from it")
    p.add_argument("--lnc", type=int, choices=[1, 2], help="logical NeuronCore config (default: per instance)")
    p.add_argument("--kv-strategy", choices=["shard", "replicate_to_tp", "convert_to_mha"])
    p.add_argument("--seq-len", type=int, help="maximum sequence length, the largest KV-cache (token-generation) "
                                                "bucket (default: min(max_position_embeddings, 4096); with "
                                                "--no-compile: longest prompt + new tokens)")
    p.add_argument("--max-batch-size", type=int, default=8,
                   help="prompts per worker call; more prompts run as several batches (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's")
    p.add_argument("--temperature", type=float, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--seed", type=int, help="seed for reproducible sampling")
    p.add_argument("--presharded", metavar="DIR", help="pre-sharded weights for this exact layout")
    p.add_argument("--compiled", metavar="CDIR",
                   help="start from a directory written by `corelaunch compile` (its weights, graphs, settings)")
    add_no_compile(p)
    add_granularity(p)
    p.add_argument("--warm-up", action="store_true", help="build every bucket's graph while starting")
    add_bucket_lists(p)
    p.add_argument("--ray-address", help="Ray cluster address (default: a running cluster, else local)")
    p.add_argument("--placement-timeout", type=float, default=60.0, metavar="S",
                   help="seconds to wait for Ray to reserve the workers (default 60)")
    p.add_argument("--startup-timeout", type=float, default=120.0, metavar="S",
                   help="seconds for the worker processes to start (default 120)")
    p.add_argument("--rendezvous-timeout", type=float, default=30.0, metavar="S",
                   help="seconds for started workers to join their process group (default 30)")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(run=run)


def _sampling(args):
    from workers.sampling import SamplingParams

    given = {k: v for k, v in (("temperature", args.temperature), ("top_k", args.top_k),
                               ("top_p", args.top_p), ("seed", args.seed)) if v is not None}
    if given and "temperature" not in given and ("top_k" in given or "top_p" in given):
        given["temperature"] = 1.0  # top-k/top-p alone means: sample at temperature 1
    return SamplingParams(**given)


def launch_config(args: argparse.Namespace):
    """The LaunchConfig the options ask for (ValueError or FileNotFoundError naming a bad one)."""
    from launcher.api import LaunchConfig

    return LaunchConfig(
        model=args.model, tp=args.tp, **backend_options(args), nodes=args.nodes,
        replicas=args.replicas, max_restarts=args.max_restarts, restart_window_s=args.restart_window,
        cpus_per_rank=args.cpus_per_rank, presharded_cache=args.presharded_cache,
        startup_timeout_s=args.startup_timeout, rendezvous_timeout_s=args.rendezvous_timeout,
        lnc=args.lnc, dtype=args.dtype,
        kv_strategy=args.kv_strategy, seq_len=args.seq_len,
        max_batch_size=args.max_batch_size, presharded_dir=args.presharded,
        compile=args.compile, compile_granularity=args.granularity, compiled_dir=args.compiled,
        warm_up=args.warm_up, **bucket_lists(args),
        ray_address=args.ray_address, placement_timeout_s=args.placement_timeout,
        request_timeout_s=args.request_timeout, progress=not args.quiet)


def run(args: argparse.Namespace) -> int:
    from launcher.api import Launcher
    from launcher.compile_report import compile_message
    from launcher.errors import LaunchError

    prompts = list(args.prompts) + list(args.prompt)
    if not prompts:
        print("corelaunch generate: give at least one PROMPT (or --prompt TEXT)", file=sys.stderr)
        return 2
    try:
        sampling = _sampling(args)
        with Launcher(launch_config(args)) as launcher:
            results = launcher.generate(prompts, sampling, max_new_tokens=args.max_new_tokens)
            compiled = launcher.compile_stats()  # graphs built inside the requests show up here
            report = {
                "model": str(launcher.model_dir),
                "tp_degree": launcher.plan.tp_degree,
                "kv_strategy": str(launcher.plan.kv_strategy),
                "backend": launcher.backend,
                "replicas": launcher.replicas,
                "outputs": [{"prompt": r.prompt, "text": r.text, "token_ids": r.token_ids,
                             "finish_reason": r.finish_reason, "replica": r.replica,
                             "time_to_first_token_s": round(r.time_to_first_token_s, 4),
                             "decode_tokens_per_s": round(r.decode_tokens_per_s, 2)} for r in results],
                "startup_s": round(launcher.timings["startup_s"], 3),
                "compile": compiled[0][1] if compiled else None,
            }
    except (ValueError, FileNotFoundError, LaunchError) as err:
        print(f"corelaunch generate: {err}", file=sys.stderr)
        return 2
    message = compile_message(compiled)
    if message and not args.quiet:
        print(f"corelaunch: {message}", file=sys.stderr)
    if args.json:
        print(json.dumps(report))
    else:
        for out in report["outputs"]:
            print(f"{out['prompt']}{out['text']}")
            print(f"  [{out['finish_reason']}, {len(out['token_ids'])} tokens, "
                  f"first token {out['time_to_first_token_s'] * 1000:.0f} ms, "
                  f"{out['decode_tokens_per_s']:.1f} tokens/s]", file=sys.stderr)
    return 0
