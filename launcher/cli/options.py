"""Command-line options several subcommands share (their arguments and how they map to LaunchConfig)."""

from __future__ import annotations

import argparse


def add_backend_arguments(p: argparse.ArgumentParser) -> None:
    """--backend (every backend in the workers.backends registry), --instance and --device-memory-gib:
    what the ranks run on and what the planner plans against (generate, compile, check, bench)."""
    from workers.backends import backend_help, backend_names

    p.add_argument("--backend", choices=backend_names(), help=backend_help())
    p.add_argument("--instance", help="planner target of the cpu and neuron backends, e.g. trn1.32xlarge "
                                      "(default: this host on the cpu backend)")
    p.add_argument("--device-memory-gib", type=float, metavar="GIB",
                   help="cuda backend: the memory of one GPU, for planning (default: measured on this host)")


def backend_options(args: argparse.Namespace) -> dict:
    """LaunchConfig's backend, instance and device_memory_gib from add_backend_arguments' options."""
    return {"backend": args.backend, "instance": args.instance, "device_memory_gib": args.device_memory_gib}


def add_granularity(p: argparse.ArgumentParser) -> None:
    """--granularity (compile and generate): what one compiled graph covers."""
    from workers.granularities import DEFAULT_GRANULARITY, GRANULARITIES

    p.add_argument("--granularity", choices=GRANULARITIES,
                   help=f"what one compiled graph covers (default {DEFAULT_GRANULARITY}): layer, one graph per "
                        f"decoder layer; model, the whole step (decodes faster, compiles several times slower); "
                        f"model-decode, whole-step decode graphs and per-layer prefill graphs; "
                        f"collective, the layer cut at its collectives (for comparison)")


def add_no_compile(p: argparse.ArgumentParser) -> None:
    """--no-compile (generate, check, bench): args.compile False runs eagerly."""
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="run eagerly at exact shapes, without compiled graphs (debugging: a check that "
                        "fails compiled but passes eager points at the compiler, not the sharding)")


def add_bucket_lists(p: argparse.ArgumentParser) -> None:
    """Custom bucket options (compile and generate)."""
    p.add_argument("--max-context-length", type=int, metavar="N",
                   help="longest prompt: the largest context-encoding bucket (default: --seq-len)")
    p.add_argument("--buckets", metavar="L1,L2,..",
                   help="custom buckets for both phases (context buckets stop at --max-context-length)")
    p.add_argument("--context-buckets", metavar="L1,L2,..", help="custom context-encoding (prefill) buckets")
    p.add_argument("--token-buckets", metavar="L1,L2,..", help="custom token-generation (KV-cache) buckets")


def bucket_lists(args: argparse.Namespace) -> dict:
    """LaunchConfig's max_context_length, context_buckets and token_buckets from the options
    (ValueError for a malformed list)."""
    from shardlib.buckets import parse_buckets

    both = parse_buckets(args.buckets) if args.buckets else None
    context = parse_buckets(args.context_buckets) if args.context_buckets else both
    token = parse_buckets(args.token_buckets) if args.token_buckets else both
    if both is not None and args.max_context_length is not None and not args.context_buckets:
        context = tuple(b for b in both if b <= args.max_context_length) or (args.max_context_length,)
    return {"max_context_length": args.max_context_length, "context_buckets": context, "token_buckets": token}


def int_at_least(name: str, minimum: int = 1):
    """An argparse type: an integer >= minimum, refused with a message naming the option."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, not {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} ({value}) must be at least {minimum}")
        return value
    return parse
