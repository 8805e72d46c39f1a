"""`corelaunch compile`: pre-shard the weights and build every bucket's graphs into a directory.

    corelaunch compile --model DIR --tp 2 --seq-len 1024 --out CDIR
    corelaunch generate --compiled CDIR "The capital of France is"

Steps, each shown on stderr: plan the layout (refused before anything is written), write each rank's
pre-sharded weights (shardlib.presharded), copy the model's config and tokenizer files, start the TP
group from that directory with warm-up on, so every rank builds (and the backend persists) the graph
of every bucket shape, then record what was built in the manifest (launcher/artifacts/compiled_dir.py). The
directory is written next to its destination and renamed into place only when complete.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from launcher.cli.options import (add_backend_arguments, add_bucket_lists, add_fused_projections, add_granularity,
                                  add_kv_cache_dtype, add_kv_strategy, add_max_num_seqs, add_max_prefill_tokens, add_moe_sharding,
                                  add_pad_q_heads, add_sequence_parallel, add_timeout_arguments, backend_options, bucket_lists, max_num_seqs_option,
                                  in_generate_flags, int_at_least, non_empty_path, timeout_options, with_flag_name,
                                  without_nodes_ways)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "compile", help="pre-shard a model and build its per-bucket graphs into a directory",
        description="Write a compiled-model directory: each rank's pre-sharded weights, the compiled graph "
                    "of every bucket shape, and a manifest; `corelaunch generate --compiled DIR` starts from it "
                    "without re-sharding or recompiling.")
    p.add_argument("--out", required=True, type=non_empty_path("--out"), metavar="CDIR", help="the directory to write (replaced if it is one)")
    p.add_argument("--model", help="Hugging Face model directory (default: built-in SmolLM2-135M-Instruct)")
    p.add_argument("--tp", default="auto", help="tensor-parallel degree, or auto (default)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's")
    add_backend_arguments(p)
    add_timeout_arguments(p)
    p.add_argument("--lnc", type=int, choices=[1, 2], help="logical NeuronCore config (default: per instance)")
    add_kv_strategy(p)
    add_pad_q_heads(p)
    add_moe_sharding(p)
    add_sequence_parallel(p)
    add_kv_cache_dtype(p)
    p.add_argument("--seq-len", type=int,
                   help="maximum sequence length: the largest token-generation bucket (default: the plan's, "
                        "min(max_position_embeddings, 4096))")
    # at least 1: a compiled directory holds static graphs from batch 1 up (LaunchConfig's 0, no static
    # batches, built batch 1's graphs here all the same)
    p.add_argument("--max-batch-size", type=int_at_least("--max-batch-size", 1), default=1,
                   help="largest static batch; batch buckets are 1, 2, 4, ... up to it (default 1)")
    add_bucket_lists(p)
    add_granularity(p)
    add_max_num_seqs(p, compiled=False)
    add_max_prefill_tokens(p, compiled=False)
    add_fused_projections(p, compiled=False)
    p.add_argument("--cpus-per-rank", type=float, metavar="C",
                   help="cpu backend: CPUs per rank while compiling (default: the cluster's CPUs divided over the "
                        "ranks); inductor builds its kernels for the ranks' thread count (C, whole), so compile "
                        "with the share the launches from the directory give each rank")
    p.add_argument("--ray-address", help="Ray cluster host:port, or local for a private one (default: RAY_ADDRESS, else the cluster `ray start` recorded on this host, else a private one)")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(run=run)


def bucket_options(args: argparse.Namespace) -> dict:
    """LaunchConfig's bucket fields, sequence length and batch size included."""
    return {"seq_len": args.seq_len, "max_batch_size": args.max_batch_size, **bucket_lists(args)}


def run(args: argparse.Namespace) -> int:
    from launcher.cli.exit_codes import exit_code_for
    from launcher.cluster.tp_group import RankWriteRefused
    from launcher.errors import LaunchError
    from shardlib.atomic_dir import out_dir_failure, write_refusal_fix

    try:
        manifest = compile_model(args)
    except OSError as err:
        # --out itself, inside it, the version written beside it or a missing parent folder of it
        # (shardlib/atomic_dir.py): a place the up-front look passed but the filesystem refused
        # (/proc, /sys, read-only mounts, a full disk)
        failure = out_dir_failure(args.out, err)
        if failure is not None:
            print(f"corelaunch compile: could not write --out {args.out} ({failure}); {write_refusal_fix(err.errno)}",
                  file=sys.stderr)
            return 2
        if isinstance(err, BrokenPipeError):
            raise  # stdout's reader went away: 141 (launcher/cli/__init__.py)
        print(f"corelaunch compile: {with_flag_name(err, args)}", file=sys.stderr)
        return exit_code_for(err)
    except RankWriteRefused as err:
        # the ranks write nothing but the compile cache, which lives inside --out's version
        # (compiled_dir.cache_dir): a full disk there said "rank 0 failed to ...", exit 3
        what = "building the graphs into its cache" if err.building_graphs else "writing into it"
        # the compiler also writes its intermediate files to the temporary folder: full, it reads the same
        temporary = (f"; if --out's disk has room, the full one may be the C++ compiler's temporary folder "
                     f"({tempfile.gettempdir()}): free space there, or set TMPDIR to a folder with room"
                     if err.building_graphs and err.write_errno in (errno.ENOSPC, errno.EDQUOT) else "")
        print(f"corelaunch compile: could not write --out {args.out} ({os.strerror(err.write_errno)} while {what}); "
              f"{write_refusal_fix(err.write_errno)}{temporary}", file=sys.stderr)
        return 2
    except (ValueError, LaunchError) as err:  # a plan refusal in compile's options, as generate says it
        print(f"corelaunch compile: {without_nodes_ways(in_generate_flags(with_flag_name(err, args)), 'compile')}",
              file=sys.stderr)
        return exit_code_for(err)
    if args.json:
        print(json.dumps(manifest))
    return 0


def compile_model(args: argparse.Namespace) -> dict:
    """Write the compiled-model directory args.out; returns its manifest."""
    import torch

    from launcher.api import LaunchConfig, Launcher
    from launcher.artifacts import compiled_dir
    from launcher.cli.command_stdout import ray_output_on_stderr
    from launcher.compile_report import built_since_load
    from launcher.launch_plan import plan_launch
    from launcher.progress import Progress
    from shardlib.atomic_dir import atomic_dir
    from shardlib.manifest import write_manifest_json
    from shardlib.presharded import save_presharded
    from shardlib.serving_shapes import ServingShapes
    from workers.backends import backend_entry
    from workers.compiled import library_versions
    from workers.granularities import DEFAULT_GRANULARITY
    from workers.serving.loop import warm_up_shapes

    progress = Progress(not args.quiet)
    out = Path(args.out)
    check_out(out)
    # Every option is checked (and the layout planned) before anything is written.
    config = LaunchConfig(model=args.model, tp=args.tp, dtype=args.dtype, **backend_options(args), **timeout_options(args), lnc=args.lnc,
                          kv_strategy=args.kv_strategy, pad_q_heads=args.pad_q_heads, moe_sharding=args.moe_sharding,
                          sequence_parallel=args.sequence_parallel, kv_cache_dtype=args.kv_cache_dtype,
                          fused_projections=args.fused_projections, max_prefill_tokens=args.max_prefill_tokens,
                          ray_address=args.ray_address, cpus_per_rank=args.cpus_per_rank,
                          progress=not args.quiet, compile=True,
                          compile_granularity=args.granularity, **bucket_options(args), **max_num_seqs_option(args))
    planned = plan_launch(config, progress, nothing_done="nothing was written", into_out=True)
    model_dir, model_config, plan = planned.model_dir, planned.model_config, planned.plan
    buckets = compiled_dir.launch_buckets(config, plan, model_config)
    # Every granularity works at every TP degree (the collectives are operators inside the graphs);
    # a backend without the choice records none.
    offered = backend_entry(planned.backend).granularities
    granularity = args.granularity or (DEFAULT_GRANULARITY if offered else None)

    # the version folder first: an --out that cannot be written is refused before Ray starts (missing
    # parent folders it made stay when Ray then refuses; the version folder itself is removed)
    with atomic_dir(out, compiled_dir.KIND, read_kind=compiled_dir.read_manifest) as tmp, \
            _ray_checked_before_the_weights(config, planned, progress):
        started = time.perf_counter()
        layout = plan.layout()
        with progress.step(f"writing {plan.tp_degree} rank(s)' pre-sharded weights ({plan.dtype})"):
            save_presharded(compiled_dir.weights_dir(tmp), model_dir, model_config, layout, plan.dtype)
        _copy_model_files(model_dir, compiled_dir.model_dir(tmp))
        manifest = {
            "format_version": compiled_dir.FORMAT_VERSION, "config_hash": model_config.config_hash(),
            "model_type": model_config.model_type, "source": str(model_dir.resolve()),
            "tp_degree": plan.tp_degree, "kv_strategy": str(plan.kv_strategy), "moe_sharding": plan.moe_sharding,
            "pad_q_heads": layout.pad_q_heads, "sequence_parallel": config.sequence_parallel,
            "kv_cache_dtype": config.kv_cache_dtype, "lnc": plan.lnc,
            "instance": planned.instance, "backend": planned.backend, "dtype": plan.dtype,
            # a Neuron graph runs only on the instance family it was compiled for: checked at load
            **compiled_dir.instance_family_field(planned.backend, planned.instance),
            "buckets": buckets.to_dict(),
            "granularity": granularity,
            "versions": library_versions(), "graphs": [], "max_num_seqs": config.max_num_seqs,
            "max_prefill_tokens": config.max_prefill_tokens, "fused_projections": config.fused_projections,
        }
        write_manifest_json(tmp, manifest)
        shapes = buckets.shapes()
        # the shapes a rank's warm-up builds (none for the prefill calls the cpu backend runs eagerly)
        serving = warm_up_shapes(ServingShapes.build(buckets, config.max_num_seqs, config.max_prefill_tokens),
                                 planned.backend == "cpu", model_config.head_dim, getattr(torch, plan.dtype))
        progress.note(f"building {len(shapes)} graph(s) per rank: context-encoding buckets "
                      f"{list(buckets.context)}, token-generation buckets {list(buckets.token)}, "
                      f"batch buckets {list(buckets.batch)}; then {len(serving)} serving graph(s) "
                      f"(continuous batching, batch buckets up to --max-num-seqs {config.max_num_seqs})")
        # The planner target's options too: the directory records the backend, not what it plans against.
        launch = LaunchConfig(compiled_dir=str(tmp), compile=True, warm_up=True, ray_address=config.ray_address,
                              cpus_per_rank=config.cpus_per_rank,
                              **timeout_options(args),
                              instance=config.instance, device_memory_gib=config.device_memory_gib, lnc=config.lnc,
                              progress=not args.quiet, max_batch_size=buckets.max_batch_size,
                              max_num_seqs=config.max_num_seqs, max_prefill_tokens=config.max_prefill_tokens,
                              fused_projections=config.fused_projections)
        # the manifest goes to stdout once Ray has stopped (--json)
        with ray_output_on_stderr(), _GraphProgress(tmp / compiled_dir.COMPILE_LOG, progress), \
                Launcher(launch) as launcher:
            at_load = launcher.load_stats[0].compile if launcher.load_stats else None
            # rank 0's stats once the serving warm-up has built its graphs too (with compile's
            # default --max-batch-size 1, most of the graphs)
            at_start = next((start for start, _ in launcher.compile_stats()), None) or at_load
        serving_built = built_since_load(at_load, at_start)
        if serving_built is not None:
            progress.note(f"  {serving_built.graphs} serving graph(s) ({serving_built.seconds:.1f} s)")
        rank0 = dict(at_start) if at_start else {}
        manifest["graphs"] = rank0.pop("graphs", [])
        manifest["compile_stats"] = rank0  # rank 0's compile time and inductor cache counters
        manifest["compile_s"] = round(time.perf_counter() - started, 3)
        # what inductor built the CPU kernels for (part of their cache key): a launch at another count builds them again
        manifest["threads_per_rank"] = launcher.threads_per_rank if planned.backend == "cpu" else None
        write_manifest_json(tmp, manifest)
    progress.note(f"compiled-model directory written: {out} (start from it with `corelaunch generate "
                  f"--compiled {out}`)")
    return manifest


@contextlib.contextmanager
def _ray_checked_before_the_weights(config, planned, progress):
    """Ray connected (the Launcher below shares the session) before the weights are written, and a
    --cpus-per-rank the private cluster started here can never hold refused: a --ray-address that
    does not answer, or too many CPUs a rank, were found only after every rank's weights were
    written (minutes for a large model), and the work thrown away."""
    from launcher.cli.command_stdout import ray_output_on_stderr
    from launcher.cluster import ray_cluster

    with ray_output_on_stderr():  # Ray's messages while it runs (the manifest alone goes to stdout: --json)
        with progress.step("connecting to Ray"):
            connection = ray_cluster.connect(config.ray_address, worker_logs=config.progress)
        try:
            _refuse_what_a_private_cluster_cannot_hold(connection, config, planned)
            yield connection
        finally:
            connection.close()


def _refuse_what_a_private_cluster_cannot_hold(connection, config, planned) -> None:
    """PlacementImpossible, as the Launcher says it once started, when the private cluster started
    here could never hold one TP group (no autoscaler grows it: --cpus-per-rank over its CPUs)."""
    from launcher.cluster.placement import alive_nodes
    from launcher.cluster.resources import rank_resources
    from launcher.launch_plan import STARTED_HERE, refuse_unplaceable_groups
    from workers.backends import backend_entry

    if not connection.started_here:
        return
    nodes, tp = alive_nodes(), planned.plan.tp_degree
    bundle = rank_resources(ray_resource=backend_entry(planned.backend).ray_resource, tp=tp,
                            node_cpus=[n.total.get("CPU", 0.0) for n in nodes], nodes=config.nodes,
                            cpus_per_rank=config.cpus_per_rank).bundle
    refuse_unplaceable_groups(STARTED_HERE, bundle, tp, config.nodes, [n.total for n in nodes], [n.name for n in nodes],
                              after="; no weights were written")


def check_out(out: Path) -> None:
    """ValueError naming --out and the fix when a look (no write) shows it cannot be written: run
    before the plan, the model's files and Ray, so a typo costs nothing."""
    from launcher.artifacts import compiled_dir
    from shardlib.atomic_dir import refuse_foreign_dir, sibling_name_too_long, unwritable_reason

    from shardlib.model_path_hints import refuse_unexpanded_home

    refuse_unexpanded_home("--out", out)
    if out.name in ("", ".", ".."):  # the swap renames a link over it: a name is needed (found after the compile)
        raise ValueError(f"--out {out} names no directory of its own; pass a new path such as {out / 'compiled'}")
    if compiled_dir.compiler_unsafe_path(out):  # the compile cache lives inside it
        raise ValueError(f"--out {out} has whitespace, a quote or a backslash in its path ({out.absolute()}), which "
                         f"the C++ compiler's command line cannot take; pass a path without them")
    linked = _through_its_links(out)
    if compiled_dir.compiler_unsafe_path(linked):
        raise ValueError(f"--out {out} is written through a link to a path with whitespace, a quote or a backslash "
                         f"({linked}), which the C++ compiler's command line cannot take; pass a path without them")
    too_long = sibling_name_too_long(out, "lnk")  # the longest of the siblings atomic_dir writes ("v", "lnk")
    if too_long is not None:
        raise ValueError(f"--out {out} cannot be written: {too_long}")
    try:
        refuse_foreign_dir(out, compiled_dir.KIND, read_kind=compiled_dir.read_manifest)  # a file, someone's directory
    except FileExistsError as err:
        raise ValueError(f"--out {err}") from None
    except OSError as err:  # e.g. a directory this user may not list
        raise ValueError(f"--out {out} cannot be read ({err.strerror}); pass a new path in a directory you can "
                         f"write to") from None
    reason = unwritable_reason(out)
    if reason is not None:
        raise ValueError(f"--out {out} cannot be written: {reason}; pass a new path in a directory you can "
                         f"write to")


def _through_its_links(out: Path) -> Path:
    """Where --out's version is written, its parent's links followed (the compiler is given that
    path, `a b/c` for `lnk/c` with lnk -> `a b`); out as it is when a link loops."""
    try:
        return out.absolute().parent.resolve() / out.name
    except (OSError, RuntimeError):  # a link loop (RuntimeError before Python 3.13): refused later, as before
        return out.absolute()


def _copy_model_files(model_dir: Path, dest: Path) -> None:
    from launcher.artifacts.compiled_dir import MODEL_FILES

    dest.mkdir(parents=True)
    for name in MODEL_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, dest / name)


PHASE_NAMES = {"context": "context-encoding", "token": "token-generation",
               "serve-prefill-start": "prefill chunk (starting a sequence)",
               "serve-prefill": "prefill chunk (continuing one)", "serve-decode": "decode step"}
"""How the progress names each kind of graph (shardlib/serving_shapes.py's phases for the serving loop's)."""


class _GraphProgress:
    """Shows rank 0's warm-up lines (written to compile.log by the worker) on stderr as they appear."""

    def __init__(self, path: Path, progress) -> None:
        self.path, self.progress = path, progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def __enter__(self) -> "_GraphProgress":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _follow(self) -> None:
        shown = 0
        while True:
            stopping = self._stop.wait(0.5)
            text = self.path.read_text() if self.path.is_file() else ""
            lines = text[:text.rfind("\n") + 1].splitlines()  # whole lines: the rank may be writing the last
            for line in lines[shown:]:
                fields = line.split()
                if len(fields) != 6:
                    continue
                done, total, phase, batch, length, seconds = fields
                kind = "graph" if phase in ("context", "token") else "serving graph"
                self.progress.note(f"  {kind} {done}/{total}: {PHASE_NAMES.get(phase, phase)} batch {batch} x "
                                   f"{length} ({float(seconds):.1f} s)")
            shown = len(lines)
            if stopping:
                return
