"""Command-line options several subcommands share (their arguments and how they map to LaunchConfig)."""

from __future__ import annotations

import argparse
import re


def add_backend_arguments(p: argparse.ArgumentParser) -> None:
    """--backend (every backend in the workers.backends registry), --instance and --device-memory-gib:
    what the ranks run on and what the planner plans against (generate, serve, compile, check, bench)."""
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
    """--granularity (generate, serve, compile): what one compiled graph covers."""
    from workers.granularities import DEFAULT_GRANULARITY, GRANULARITIES

    p.add_argument("--granularity", choices=GRANULARITIES,
                   help=f"what one compiled graph covers (default {DEFAULT_GRANULARITY}): layer, one graph per "
                        f"decoder layer; model, the whole step (decodes faster, compiles several times slower); "
                        f"model-decode, whole-step decode graphs and per-layer prefill graphs; "
                        f"collective, the layer cut at its collectives (for comparison)")


def add_pad_q_heads(p: argparse.ArgumentParser) -> None:
    """--pad-q-heads (plan, generate, compile, check, bench, serve)."""
    p.add_argument("--pad-q-heads", action="store_true",
                   help="pad Q heads to a multiple of TP with zero heads (NxD Inference's layout), so a degree "
                        "that does not divide the heads runs; outputs equal the unpadded model's")


def add_sequence_parallel(p: argparse.ArgumentParser) -> None:
    """--sequence-parallel (generate, compile, check, bench, serve)."""
    p.add_argument("--sequence-parallel", action="store_true",
                   help="prefills keep the residual stream split along the sequence between blocks (all-gather "
                        "before attention and MLP, reduce-scatter after); same tokens, measured in the README")


def add_no_compile(p: argparse.ArgumentParser) -> None:
    """--no-compile (generate, serve, check, bench): args.compile False runs eagerly."""
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

    def parsed(flag: str, text: str):
        try:
            return parse_buckets(text)
        except ValueError as err:  # "bucket list '1,a' must be ..." named no option
            raise ValueError(f"{flag}: {err}") from None

    both = parsed("--buckets", args.buckets) if args.buckets else None
    context = parsed("--context-buckets", args.context_buckets) if args.context_buckets else both
    token = parsed("--token-buckets", args.token_buckets) if args.token_buckets else both
    if both is not None and args.max_context_length is not None and not args.context_buckets:
        context = tuple(b for b in both if b <= args.max_context_length) or (args.max_context_length,)
    return {"max_context_length": args.max_context_length, "context_buckets": context, "token_buckets": token}


FLAG_OF_FIELD = {
    "model": "--model", "tp": "--tp", "nodes": "--nodes", "replicas": "--replicas", "backend": "--backend",
    "instance": "--instance", "device_memory_gib": "--device-memory-gib", "max_restarts": "--max-restarts",
    "restart_window_s": "--restart-window", "cpus_per_rank": "--cpus-per-rank", "lnc": "--lnc",
    "startup_timeout_s": "--startup-timeout", "rendezvous_timeout_s": "--rendezvous-timeout",
    "placement_timeout_s": "--placement-timeout", "request_timeout_s": "--request-timeout", "dtype": "--dtype",
    "load_timeout_s": "--load-timeout",
    "kv_cache_dtype": "--kv-cache-dtype", "kv_strategy": "--kv-strategy", "moe_sharding": "--moe-sharding",
    "seq_len": "--seq-len", "max_context_length": "--max-context-length", "max_batch_size": "--max-batch-size",
    "max_num_seqs": "--max-num-seqs", "max_queued_requests": "--max-queued-requests",
    "presharded_dir": "--presharded", "compiled_dir": "--compiled",
    "compile_granularity": "--granularity", "max_prefill_tokens": "--max-prefill-tokens",
    "ray_address": "--ray-address", "context_buckets": "--context-buckets", "token_buckets": "--token-buckets",
    "warm_up": "--warm-up", "presharded_cache": "--presharded-cache",
}
"""LaunchConfig's fields and the command-line options that set them."""
FLAG_IN_OTHER_UNITS = {"burst_wait_s": ("--burst-wait-ms", 1000)}
"""Fields whose option takes another unit: (the option, its units per the field's unit)."""


def with_flag_name(error: BaseException, args: argparse.Namespace | None = None) -> str:
    """The message of a LaunchConfig error that starts with a field's name ("restart_window_s (0.0)
    must be ...") with the options that set them instead ("--restart-window (0.0) must be ...").
    A message that does not start with a field is left as it is, but for one thing: with the
    command's parsed `args`, a bucket list is named by the option the user gave, in any message
    (--buckets sets both phases' lists)."""
    given = _bucket_flags_given(args)
    # an error that names several fields mid-message says them by their options itself
    # (a compiled directory's mismatch: launcher/artifacts/compiled_dir.py)
    message = getattr(error, "flag_message", None) or str(error)
    for field in given:  # "--token-buckets: expected [16] (compiled), ..." of a --compiled directory
        message = message.replace(f"{FLAG_OF_FIELD[field]}:", f"--buckets ({_PHASE_OF_LIST[field]} list):")
    field, sep, rest = message.partition(" (")
    if not sep or (field not in FLAG_OF_FIELD and field not in FLAG_IN_OTHER_UNITS):
        return message
    flags = {**FLAG_OF_FIELD, **given}
    # A launch option's message: the other options it names (the burst check names two) by their
    # options too, values in the option's unit, and Python's None as the option left out. Plain
    # words ("tp", "model") only where they lead: elsewhere they are words of the message.
    if "_" not in field:
        message = flags[field] + sep + rest
    message = _NAMED_FIELD.sub(lambda match: _as_flag(match, flags), message)
    return message.replace("or None (left out)", "or left out").replace("or None", "or left out")


_NAMED_FIELD = re.compile(r"(?<![\w/.-])(" + "|".join(sorted(
    (f for f in (*FLAG_OF_FIELD, *FLAG_IN_OTHER_UNITS) if "_" in f), key=len, reverse=True)) + r")\b( \(([^)]*)\))?")
"""A field with an underscore named in a message, with its value in parentheses if given."""


# The planner's word for the TP degree (`corelaunch plan` has --tp); not in a path (/runs/tp_degree/m),
# a Python call (save_presharded(tp_degree=2), for_model(config, tp_degree, kv_strategy)), nor a
# file's key: quoted ("field 'tp_degree' must be ...") or listed ("manifest.json lacks config_hash,
# tp_degree; ..."), which a compiled directory's refusals named as '--tp', a key no file has.
_TP_DEGREE = re.compile(r"(?<![\w/.'\"-])(?<!, )(?<!lacks )tp_degree(?![\w/.=,'\"-])")


def _word(name: str) -> re.Pattern:
    """A field's name as a word of a message, not a quoted key ('seq_len' of a file)."""
    return re.compile(r"(?<![\w'\"])" + name + r"(?![\w'\"])")


_GENERATE_WORDS = ((re.compile(r"\bseq_len \(--seq-len\)"), "--seq-len"), (_word("seq_len"), "--seq-len"),
                   (_word("max_new_tokens"), "--max-new-tokens"),
                   (re.compile(r"^logit_bias names token ids"), "--logit-bias names token ids"),
                   # the planner's words for the layout (`corelaunch plan` has --tp and --batch-size), as above;
                   # batch_size is compile's --max-batch-size (generate plans no static batch: none in its messages)
                   (_TP_DEGREE, "--tp"),
                   (re.compile(r"(?<![\w/.'\"-])batch_size(?![\w/.='\"-])"), "--max-batch-size"),
                   # structured output's advice to an API caller (shardlib/structured_output.py)
                   (re.compile(r"\bjson_object=True\b"), "--json-object"))

_QUOTED = re.compile(r"(?<!\w)'[^'\n]*'(?!\w)|(?<!\w)\"[^\"\n]*\"(?!\w)")
"""A quoted span of a message: the user's own value as repr() or a message quotes it ('...' or "...").
A quote inside a word (the model's, can't) opens none."""


def in_generate_flags(message: str) -> str:
    """A driver-API message as `corelaunch generate` says it: the request's max_new_tokens and the
    launch's seq_len named by their flags ("with max_new_tokens 9000 that needs 9005 positions but
    seq_len is 4096" read as the Python API's fields to a command-line user). Quoted spans are the
    user's own values, quoted back exactly (`--regex 'the seq_len is (['` read "the --seq-len is")."""
    for pattern, flag in _GENERATE_WORDS:
        quoted = [match.span() for match in _QUOTED.finditer(message)]  # per pattern: a substitution shifts them
        message = pattern.sub(lambda match: match.group(0) if _in_any_span(match.start(), quoted) else flag, message)
    return message


def _in_any_span(position: int, spans: list[tuple[int, int]]) -> bool:
    """Whether position falls in one of the (start, end) spans."""
    return any(start <= position < end for start, end in spans)


_NODES_WAY = re.compile(r"(?:; )?(?:more|fewer) nodes: --nodes \d+ fits at tp \d+(?:, \d+)*")


def without_nodes_ways(message: str, command: str) -> str:
    """A plan refusal as a command without --nodes (compile, check, bench) says it: the planner's
    "more nodes: --nodes 2 fits at tp 3" is left out (following it met "unrecognized arguments"),
    and said in words where it was the only way out."""
    if not _NODES_WAY.search(message):
        return message
    message = _NODES_WAY.sub("", message).replace("ways out: ; ", "ways out: ")
    return re.sub(r"ways out: ?(?=\n|$)", f"ways out: only more nodes, which `corelaunch {command}` does not take "
                                           f"(`corelaunch generate` does: --nodes)", message)


def in_tp_flag(message: str) -> str:
    """The planner's tp_degree named as --tp, which every command that plans a launch takes."""
    return _TP_DEGREE.sub("--tp", message)


_PHASE_OF_LIST = {"context_buckets": "its context-encoding", "token_buckets": "its token-generation"}


def _bucket_flags_given(args: argparse.Namespace | None) -> dict:
    """The bucket-list fields that --buckets set (their own option left out): a refusal of
    `--buckets 64,9000` named --token-buckets, an option the user never typed."""
    if args is None or not getattr(args, "buckets", None):
        return {}
    return {field: "--buckets" for field in ("context_buckets", "token_buckets") if not getattr(args, field)}


def _as_flag(match: re.Match, flags: dict) -> str:
    """A field named in a message (with its value in parentheses, if given) as its option."""
    field, shown, value = match.group(1), match.group(2), match.group(3)
    if field not in FLAG_IN_OTHER_UNITS:
        return flags[field] + (shown or "")
    flag, scale = FLAG_IN_OTHER_UNITS[field]
    if shown is None:
        return flag
    try:
        return f"{flag} ({float(value) * scale:g})"
    except ValueError:
        return f"{flag}{shown}"


def non_empty_path(name: str):
    """An argparse type: a path that is not empty ("" is the current directory, which the command
    then wrote into or read from under a confusing name)."""
    def parse(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError(f"{name} must be a path, not an empty string")
        return text
    return parse


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


def add_max_num_seqs(p: argparse.ArgumentParser, default: int | None = None, compiled: bool = True) -> None:
    """--max-num-seqs (generate, compile, serve): rows of a TP group's serving KV cache, so also its
    largest decode batch bucket: the serving graphs a warm-up builds are those up to it. Left out,
    it is None (see max_num_seqs_option): a --compiled directory's own value, else `default`."""
    from shardlib.serving_shapes import DEFAULT_MAX_NUM_SEQS

    from_compiled = ", or the --compiled directory's" if compiled else ""
    p.add_argument("--max-num-seqs", type=int_at_least("--max-num-seqs"), metavar="N",
                   help=f"requests generating at once in one TP group; warm-up builds the serving graphs "
                        f"of batch buckets up to it (default {default or DEFAULT_MAX_NUM_SEQS}{from_compiled})")


def max_num_seqs_option(args: argparse.Namespace, default: int | None = None) -> dict:
    """LaunchConfig's max_num_seqs: --max-num-seqs when given; else the value a --compiled directory
    was compiled with (its serving graphs are shaped by it: any other value builds them all again),
    else `default`. Without a default of its own the command leaves it to LaunchConfig, which takes
    the directory's value, else DEFAULT_MAX_NUM_SEQS."""
    if args.max_num_seqs is not None:
        return {"max_num_seqs": args.max_num_seqs}
    if default is None:
        return {}
    from launcher.artifacts.compiled_dir import recorded_settings

    return {"max_num_seqs": recorded_settings(getattr(args, "compiled", None)).get("max_num_seqs", default)}


def add_kv_strategy(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-strategy", choices=["shard", "replicate_to_tp", "convert_to_mha"],
                   help="force a KV-head layout (default: the planner's)")


def add_moe_sharding(p: argparse.ArgumentParser) -> None:
    """--moe-sharding: how a mixture-of-experts model's experts are split (plan, generate, serve, compile)."""
    p.add_argument("--moe-sharding", choices=["tensor_parallel", "expert_parallel"],
                   help="mixture-of-experts models: split every expert's intermediate dimension over the ranks "
                        "(tensor_parallel) or give each rank whole experts (expert_parallel); default: the planner's choice")


def add_fused_projections(p: argparse.ArgumentParser, compiled: bool = True) -> None:
    """--fused-projections (generate, serve, compile). Left out, it is None: a --compiled directory's
    own setting, else off (LaunchConfig resolves it)."""
    from_compiled = " (default: the --compiled directory's setting, else off)" if compiled else ""
    p.add_argument("--fused-projections", action="store_true", default=None if compiled else False,
                   help=f"fuse each rank's q/k/v and gate/up matrices after loading (measured: see the "
                        f"README){from_compiled}")


def add_layout_choices(p: argparse.ArgumentParser) -> None:
    """--kv-strategy, --moe-sharding and --fused-projections on check and bench, so every layout
    generate and serve can run can be checked and measured as it runs (check had none of them)."""
    add_kv_strategy(p)
    add_moe_sharding(p)
    add_fused_projections(p, compiled=False)


def layout_choices(args: argparse.Namespace) -> dict:
    """LaunchConfig's fields from add_layout_choices' flags."""
    return {"kv_strategy": args.kv_strategy, "moe_sharding": args.moe_sharding,
            "fused_projections": args.fused_projections}


def add_prefix_caching(p: argparse.ArgumentParser) -> None:
    """--no-prefix-caching (generate, serve): LaunchConfig.prefix_caching off."""
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="prefill every prompt whole (default: a prompt whose first 16 or more tokens are still "
                        "in the cache, as an earlier or a running request's, is prefilled only from where they part)")


def add_max_prefill_tokens(p: argparse.ArgumentParser, compiled: bool = True) -> None:
    """--max-prefill-tokens (serve, compile): the prefill chunks' largest width, so also their graphs'."""
    from shardlib.serving_shapes import DEFAULT_MAX_PREFILL_TOKENS

    from_compiled = ", or the --compiled directory's" if compiled else ""
    p.add_argument("--max-prefill-tokens", type=int_at_least("--max-prefill-tokens"), metavar="N",
                   help=f"prompt tokens prefilled between two decode steps (default {DEFAULT_MAX_PREFILL_TOKENS}"
                        f"{from_compiled})")


def add_model_and_placement_arguments(p: argparse.ArgumentParser) -> None:
    """What model to serve and how to place and run its TP group (generate and serve): --model, --tp,
    the backend options, restarts, CPU shares, dtype and layout, weights sources, compilation, buckets,
    timeouts and --quiet."""
    p.add_argument("--model", help="Hugging Face model directory (default: built-in SmolLM2-135M-Instruct)")
    p.add_argument("--tp", default="auto", help="tensor-parallel degree, or auto (default)")
    add_backend_arguments(p)
    p.add_argument("--nodes", type=int, default=1,
                   help="nodes one TP group is split over when one node lacks cores: 1 (default) keeps it on one "
                        "node; N splits it over N different nodes (fewer only where fewer keep to ceil(TP / N) ranks "
                        "a node: TP 4 over 3 uses 2, TP of them where N exceeds TP), ceil or floor of TP / N ranks on "
                        "each, even where one node has room for all (a device backend: exactly N, TP / N each). A "
                        "cluster without that many nodes with room waits out --placement-timeout. Above 1 it needs a "
                        "cluster to join (serve, whose Ray is private, takes 1 only)")
    p.add_argument("--max-restarts", type=int, default=3, metavar="N",
                   help="restarts of a failed replica within --restart-window; 0 disables them (default 3)")
    p.add_argument("--restart-window", type=float, default=600.0, metavar="S",
                   help="seconds over which --max-restarts is counted (default 600)")
    add_cpus_per_rank(p)
    p.add_argument("--presharded-cache", action="store_true",
                   help="write a pre-sharded copy after the first load and restart groups from it")
    p.add_argument("--lnc", type=int, choices=[1, 2], help="logical NeuronCore config (default: per instance)")
    add_kv_strategy(p)
    add_pad_q_heads(p)
    add_moe_sharding(p)
    add_fused_projections(p)
    add_sequence_parallel(p)
    p.add_argument("--seq-len", type=int, help="maximum sequence length: the serving engine's KV-cache rows and "
                                                "the largest KV-cache (token-generation) bucket (default: "
                                                "min(max_position_embeddings, 4096))")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's")
    add_kv_cache_dtype(p)
    p.add_argument("--presharded", metavar="DIR", help="pre-sharded weights for this exact layout")
    p.add_argument("--compiled", metavar="CDIR",
                   help="start from a directory written by `corelaunch compile` (its weights, graphs, settings)")
    add_no_compile(p)
    add_granularity(p)
    p.add_argument("--warm-up", action="store_true", help="build every bucket's graph while starting")
    add_bucket_lists(p)
    add_timeout_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def add_cpus_per_rank(p: argparse.ArgumentParser) -> None:
    """--cpus-per-rank (generate, serve, check, bench; compile words its own help): a cpu rank's CPU
    share, checked by LaunchConfig. check and bench lacked it, so inside a Ray job whose entrypoint
    holds a CPU of the node (--entrypoint-num-cpus) their ranks, each asking its node's CPUs / TP,
    could never be placed."""
    p.add_argument("--cpus-per-rank", type=float, metavar="C",
                   help="cpu backend: CPUs per rank (default: the cluster's CPUs divided over every rank)")


def add_timeout_arguments(p: argparse.ArgumentParser) -> None:
    """--placement-timeout, --startup-timeout, --rendezvous-timeout, --load-timeout and
    --request-timeout: every command that starts a TP group (generate, serve, compile, check,
    bench), so each can wait for a cluster that autoscales (or a large model's load)."""
    p.add_argument("--placement-timeout", type=float, default=60.0, metavar="S",
                   help="seconds to wait for Ray to reserve the workers (default 60)")
    p.add_argument("--startup-timeout", type=float, default=120.0, metavar="S",
                   help="seconds for the worker processes to start and import their backend (default 120)")
    p.add_argument("--rendezvous-timeout", type=float, default=30.0, metavar="S",
                   help="seconds for started workers to join their process group (default 30)")
    p.add_argument("--load-timeout", type=float, default=900.0, metavar="S",
                   help="seconds for every rank to load its shard, and to build its serving cache and any "
                        "graphs built at start (default 900)")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="seconds one request may take from submission to its last token (default 600)")


def timeout_options(args: argparse.Namespace) -> dict:
    """LaunchConfig's timeouts from add_timeout_arguments' options."""
    return {"placement_timeout_s": args.placement_timeout, "startup_timeout_s": args.startup_timeout,
            "rendezvous_timeout_s": args.rendezvous_timeout, "load_timeout_s": args.load_timeout,
            "request_timeout_s": args.request_timeout}


def model_and_placement_options(args: argparse.Namespace) -> dict:
    """LaunchConfig keyword arguments from add_model_and_placement_arguments' options (ValueError for
    a malformed bucket list)."""
    return dict(
        model=args.model, tp=args.tp, **backend_options(args), nodes=args.nodes,
        max_restarts=args.max_restarts, restart_window_s=args.restart_window,
        cpus_per_rank=args.cpus_per_rank, presharded_cache=args.presharded_cache, **timeout_options(args),
        lnc=args.lnc, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, kv_strategy=args.kv_strategy,
        moe_sharding=args.moe_sharding, fused_projections=args.fused_projections, seq_len=args.seq_len,
        pad_q_heads=args.pad_q_heads, sequence_parallel=args.sequence_parallel,
        presharded_dir=args.presharded, compile=args.compile, compile_granularity=args.granularity,
        compiled_dir=args.compiled, warm_up=args.warm_up, **bucket_lists(args), progress=not args.quiet)


def add_kv_cache_dtype(p: argparse.ArgumentParser) -> None:
    """--kv-cache-dtype (generate, serve, compile, check, bench, plan): an fp8 KV cache."""
    p.add_argument("--kv-cache-dtype", choices=["f8e4m3"],
                   help="store the KV cache in fp8 e4m3, dequantized on read: a direct cast (scale 1.0) clamped to "
                        "+-240 (a quarter of float32's bytes per token; default: the compute dtype)")
