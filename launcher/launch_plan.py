"""From a LaunchConfig to a proven layout, before any process starts or any file is written.

Shared by the driver API (Launcher.start) and `corelaunch compile`: both resolve the model, pick the
backend and planner target, plan, and refuse layouts the planner rejects or checkpoints the workers
cannot run, with every reason listed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from launcher.compile_folders import check_compile_folders
from launcher.errors import PlanRejected
from launcher.progress import Progress
from shardlib.model_config import ModelConfig, load_model_config
from shardlib.planner import RANK_PROCESS_BYTES
from shardlib.serving_shapes import serving_cache_rows


@dataclass(frozen=True)
class PlannedLaunch:
    model_dir: Path
    model_config: ModelConfig
    backend: str
    instance: str
    """The planner target's name (an instance type, "cpu", or a description of the GPUs)."""
    plan: object
    """shardlib.planner's plan, valid."""
    host_holds: int | None = None
    """groups_this_host_holds() as it was before Ray started (it asks whether the cluster will be
    private, which a Ray session of our own would hide): replicas="auto" is capped by it."""


def resolve_model_dir(model: str | None) -> Path:
    """The given model directory, or the built-in demo model (converted on first use)."""
    if model is not None:
        return Path(model)
    from shardlib.demo_model import ensure_demo_model

    return Path(ensure_demo_model())


def with_artifact_settings(config):
    """config with what its --compiled directory (its model, layout, settings and buckets) or its
    --presharded copy (the layout it was cut for) brings; ValueError naming an option that
    contradicts it. Every planner of a launch (the Launcher, `corelaunch serve`, a Serve replica's
    CPU share) plans from this, so all of them plan the same TP degree."""
    if config.compiled_dir is not None:
        from launcher.artifacts.compiled_dir import apply_compiled_dir

        return apply_compiled_dir(config)
    if config.presharded_dir is not None:
        from launcher.artifacts.presharded_dir import apply_presharded_dir

        return apply_presharded_dir(config)
    return config


def plan_launch(config, progress: Progress, nothing_done: str = "nothing was started",
                into_out: bool = False) -> PlannedLaunch:
    """Plan config (a LaunchConfig); PlanRejected naming every failed rule (or every part of the
    checkpoint the workers cannot run), ending with `nothing_done`. into_out: planned for `corelaunch
    compile`, whose ranks compile into its output directory (launcher/compile_folders.py)."""
    from launcher.cluster.ray_cluster import on_this_host
    from shardlib.planner import plan as make_plan
    from workers.backends import TargetRequest, backend_entry, default_backend_name, planner_target

    from shardlib.env_settings import check_environment

    check_environment()  # what the ranks will read (a private Ray passes this environment on): before any start
    backend = config.backend or default_backend_name()
    entry = backend_entry(backend)
    if config.compile_granularity is not None and config.compile_granularity not in entry.granularities:
        raise ValueError(f"compile_granularity ({config.compile_granularity!r}): the {backend} backend offers "
                         f"{', '.join(entry.granularities) or 'no choice of granularity'}; drop --granularity")
    if config.kv_cache_dtype is not None and config.compile and not entry.compiled_fp8_kv_cache:
        raise ValueError(f"kv_cache_dtype ({config.kv_cache_dtype!r}): the {backend} backend's compiled graphs keep "
                         f"the KV cache in the compute dtype, so the plan would count an fp8 cache the device never "
                         f"holds; drop --kv-cache-dtype, or run eager (--no-compile)")
    if config.compile and not entry.compiled_serving:
        raise ValueError(compiled_serving_missing(config, backend, into_out))
    if config.cpus_per_rank is not None and entry.ray_resource is not None:  # it was ignored without a word
        raise ValueError(f"cpus_per_rank ({config.cpus_per_rank:g}) sizes the cpu backend's ranks; a {backend} rank "
                         f"takes one {entry.ray_resource} and one CPU. Leave it out")
    refuse_nodes_on_a_private_cluster(config)
    check_compile_folders(config, backend, into_out)
    # Before the model is resolved: a backend this host cannot run is refused first, and cheaply.
    target = planner_target(backend, TargetRequest(instance=config.instance, device_memory_gib=config.device_memory_gib,
                                                   cluster_on_this_host=on_this_host(config.ray_address)))
    with progress.step("resolving model"):
        model_dir = resolve_model_dir(config.model)
        model_config = load_model_config(model_dir)
    if config.fused_projections and model_config.quantization is not None:
        raise ValueError(f"fused_projections: {model_dir} holds quantized weights, which are not fused (each keeps "
                         f"its own scale); drop --fused-projections")
    if config.token_buckets is not None:  # they set seq_len: named as given, not as a --seq-len nobody passed
        from shardlib.buckets import normalize_buckets

        try:
            normalize_buckets(config.token_buckets, "token-generation", model_config.max_position_embeddings,
                              "the model's max_position_embeddings")
        except ValueError as err:  # led by the field, which the commands name as their --token-buckets
            raise ValueError(f"token_buckets ({','.join(map(str, config.token_buckets))}): {err}") from None
    plan = make_plan(model_config, instance=target, tp=config.tp, nodes=config.nodes, lnc=config.lnc,
                     batch_size=config.max_batch_size, serving_rows=serving_cache_rows(config.max_num_seqs), seq_len=config.seq_len, dtype=config.dtype,
                     kv_strategy=config.kv_strategy, pad_q_heads=config.pad_q_heads,
                     kv_cache_dtype=config.kv_cache_dtype, moe_sharding=config.moe_sharding)
    if not plan.valid:
        errors = [dict(e) for e in plan.to_dict()["errors"]]
        lines = "\n".join(f"  [{e['code']}] {e['message']}" for e in errors)
        raise PlanRejected(f"the layout is impossible; {nothing_done}:\n{lines}", errors)
    refuse_context_past_seq_len(config, plan)
    for text in layout_notes(config, plan):
        progress.note(text)
    gaps = model_config.executor_gaps(config.seq_len)
    if gaps:  # refuse now, not after every rank has read its shard
        errors = [{"code": "not_runnable", "message": gap} for gap in gaps]
        lines = "\n".join(f"  [not_runnable] {gap}" for gap in gaps)
        raise PlanRejected(f"{model_dir} cannot run on corelaunch's workers; {nothing_done}:\n{lines}", errors)
    check_replicas_fit_this_host(config, plan, backend)
    refuse_what_a_private_start_cannot_hold(config, plan, backend, nothing_done)
    host_holds = groups_this_host_holds(config, plan, backend)
    if config.presharded_dir is None:  # the ranks will read this checkpoint: its headers are checked now
        from shardlib.checkpoint_files import check_checkpoint

        with progress.step("checking checkpoint"):
            check_checkpoint(model_dir, model_config)
    else:
        with progress.step("checking the pre-sharded weights' source"):
            check_presharded_source(config, model_dir, model_config)
            from shardlib.presharded import check_presharded_dir

            check_presharded_dir(config.presharded_dir, model_config, plan.layout(), plan.dtype)
    return PlannedLaunch(model_dir, model_config, backend, plan.instance, plan, host_holds)


def compiled_serving_missing(config, backend: str, into_out: bool) -> str:
    """The refusal of compiling on a backend whose compiled model lacks the serving engine's steps."""
    why = (f"the {backend} backend's compiled graphs cover the static batch's shapes only, and every command "
           f"runs the serving engine, whose steps they lack (the launch failed after compiling every graph)")
    if into_out:
        return f"{why}; a {backend} compiled directory cannot be built yet. Run eager: `--no-compile` on " \
               f"generate, serve, check or bench"
    if config.compiled_dir is not None:  # its graphs cannot run, and --no-compile beside it is refused
        from launcher.artifacts.compiled_dir import compiled_from

        source = compiled_from(config.compiled_dir) or "<the checkpoint it was compiled from>"
        return (f"{why}; compiled-model directory {config.compiled_dir} cannot run. Launch its model eagerly "
                f"instead: --model {source} --no-compile, without --compiled")
    return f"{why}; pass --no-compile (eager)"


def refuse_context_past_seq_len(config, plan) -> None:
    """ValueError for a max_context_length past the plan's default seq_len (LaunchConfig refuses one
    past a seq_len given): the buckets stopped at seq_len, and the longer prompts it promised were
    refused at the request."""
    from shardlib.planner import DEFAULT_MAX_SEQ_LEN

    if config.max_context_length is not None and config.seq_len is None and config.max_context_length > plan.seq_len:
        raise ValueError(f"max_context_length ({config.max_context_length}) exceeds seq_len ({plan.seq_len}, the "
                         f"plan's default: min(max_position_embeddings, {DEFAULT_MAX_SEQ_LEN})); pass seq_len >= "
                         f"{config.max_context_length} or lower max_context_length")


def layout_notes(config, plan) -> list[str]:
    """Layout options this launch takes that change nothing at its degree: said once at start-up, so
    a user who asked for padding or sequence parallelism does not measure a layout they never got."""
    from shardlib.planner import pads_nothing

    notes = []
    if config.pad_q_heads and plan.padded_q_heads == plan.config.num_attention_heads:
        notes.append(pads_nothing(plan.config.num_attention_heads, plan.tp_degree))
    if config.sequence_parallel and plan.tp_degree == 1:
        given = ", a compiled directory's setting" if config.compiled_dir else ""
        notes.append(f"sequence_parallel (--sequence-parallel{given}) does nothing at tp_degree 1: there is no other "
                     f"rank to split the sequence with")
    return notes


def check_presharded_source(config, model_dir: Path, model_config: ModelConfig) -> None:
    """ValueError when config's pre-sharded weights (its own, or its compiled directory's) were cut
    from other weights of the same model config than `model_dir` holds. The manifest's other
    fields (config hash, layout, dtype) are checked by each rank's load (shardlib.presharded), with
    every difference listed; this is the one a rank cannot see."""
    import json

    from shardlib.manifest import MANIFEST
    from shardlib.weights_fingerprint import FIELD, check_same_weights

    path = Path(config.presharded_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # no manifest or a broken one: check_presharded_dir (next) refuses it with the full story
    if config.compiled_dir is None and isinstance(manifest, dict) and "buckets" in manifest and "files" not in manifest:
        # a compiled-model directory (its weights are in weights/): it failed only at the ranks' load
        raise ValueError(f"--presharded {config.presharded_dir} is a compiled-model directory, not a pre-sharded "
                         f"checkpoint; start from it with --compiled {config.presharded_dir} (its pre-sharded "
                         f"weights are its weights/ folder)")
    if not isinstance(manifest, dict) or manifest.get("config_hash") != model_config.config_hash():
        return  # not even the same config: check_presharded_dir says so, naming every field that differs
    recorded = manifest.get(FIELD)
    if config.compiled_dir is not None:  # pinned to its version by now: named by the link given, if any
        from shardlib.atomic_dir import linking_out_dir

        given = linking_out_dir(config.compiled_dir) or config.compiled_dir
        copy, fix = (f"compiled-model directory {given}",
                     f"Run `corelaunch compile --model {model_dir} --out DIR` for this model")
    else:
        copy, fix = (f"pre-sharded checkpoint {config.presharded_dir}",
                     f"Write it again from {model_dir} (shardlib.presharded.save_presharded)")
    check_same_weights(recorded if isinstance(recorded, str) else None, model_dir, copy=copy,
                       source=manifest.get("source") if isinstance(manifest.get("source"), str) else None, fix=fix)


STARTED_HERE = "the private Ray cluster started here"
"""How the after-start refusals name a private cluster (Launcher._refuse_unplaceable)."""

TO_BE_STARTED = "the private Ray cluster this launch would start (this host alone)"
"""How the refusal before the start names it (refuse_what_a_private_start_cannot_hold)."""


def refuse_unplaceable_groups(cluster: str, bundle: dict, tp: int, nodes: int, totals: list, names: list,
                              replicas: int | None = None, cpus_per_rank_given: bool = False,
                              after: str = "", how: str = "", **wording) -> None:
    """PlacementImpossible when a cluster with no autoscaler (a private one: `cluster` names it, its
    nodes' `totals` and `names`) could never hold one TP group of `tp` ranks of `bundle` over
    `nodes` nodes, or not the `replicas` groups at once (None: not asked); `how` follows "cannot
    place a TP group", `after` ends the message, `wording` names the replicas' option
    (fewer_groups_why). What such a cluster cannot hold now it never will: refused at once, not
    after --placement-timeout."""
    from launcher.cluster.resources import fewer_groups_why, never_placeable_why
    from launcher.errors import PlacementImpossible

    why = never_placeable_why(bundle, tp, nodes, totals, names)
    if why is not None:
        raise PlacementImpossible(f"{cluster} cannot place a TP group{how}: {why}{after}")
    why = replicas and fewer_groups_why(bundle, tp, nodes, totals, replicas, cpus_per_rank_given, **wording)
    if why:
        raise PlacementImpossible(f"{cluster} {why}{after}")


def refuse_what_a_private_start_cannot_hold(config, plan, backend: str, nothing_done: str,
                                            serve_replicas: tuple[int, str, int | None] | None = None) -> None:
    """PlacementImpossible before Ray starts, with Launcher._refuse_unplaceable's rules, when the
    launch would start a private cluster (this host alone, ray_cluster.private_cluster_cpus() CPUs,
    no autoscaler) that could never hold its cpu TP groups (--cpus-per-rank past the host's CPUs,
    or --replicas groups of it): the launch started Ray and loaded the tokenizer (about 8 s on 2
    cores) to refuse the same afterwards. A private cluster an earlier launch of this process
    started (and a device backend's, whose resource Ray counts only once it runs) is checked after
    the connection, as a shared cluster is. serve_replicas: `corelaunch serve`'s (count, option,
    autoscaling minimum or None), its Serve replicas each one TP group of `config` (whose own
    replicas is 1): the last ones waited for placement until --ready-timeout."""
    import ray

    from launcher.cluster.ray_cluster import private_cluster, private_cluster_cpus
    from launcher.cluster.resources import rank_resources
    from workers.backends import backend_entry

    cpus = private_cluster_cpus()
    if (backend_entry(backend).ray_resource is not None or cpus is None or ray.is_initialized()
            or not private_cluster(config.ray_address)):
        return
    tp, totals, names = plan.tp_degree, [{"CPU": float(cpus)}], ["this host"]
    after = f"; {nothing_done}"
    if config.replicas == "auto":  # as Launcher._size_replicas sizes them: one CPU a rank unless given
        if config.cpus_per_rank is None:
            return  # fractional CPUs where whole ones do not fit: always one group
        bundle = rank_resources(None, tp, [cpus], nodes=config.nodes, cpus_per_rank=config.cpus_per_rank).bundle
        refuse_unplaceable_groups(TO_BE_STARTED, bundle, tp, config.nodes, totals, names, after=after,
                                  how=" (replicas=auto would find room for none)")
        return
    replicas, option, least = serve_replicas or (config.replicas, "--replicas", None)
    bundle = rank_resources(None, tp, [cpus], nodes=config.nodes, replicas=replicas,
                            cpus_per_rank=config.cpus_per_rank).bundle
    refuse_unplaceable_groups(TO_BE_STARTED, bundle, tp, config.nodes, totals, names, replicas=replicas,
                              cpus_per_rank_given=config.cpus_per_rank is not None, after=after,
                              option=option, auto_offered=serve_replicas is None, least=least)


def refuse_nodes_on_a_private_cluster(config) -> None:
    """ValueError for nodes > 1 where the launch starts a private Ray, this host alone: the plan
    counted that many nodes' memory (RAM / ceil(TP / nodes) per rank) for ranks that all land here,
    and several replicas went unchecked against this host's RAM."""
    from launcher.cluster.ray_cluster import private_cluster

    if config.nodes > 1 and private_cluster(config.ray_address):
        raise nodes_on_one_host(config.nodes, "with no cluster to join, the launch starts",
                                f"join a cluster of {config.nodes} or more nodes with --ray-address HOST:PORT (or "
                                f"RAY_ADDRESS, or `ray start` on this host), or drop --nodes")


def nodes_on_one_host(nodes: int, starter: str, fix: str) -> ValueError:
    return ValueError(f"nodes ({nodes}): {starter} a private Ray of this host alone, one node, whose memory the "
                      f"plan would count {nodes} times; {fix}")


SERVER_REPLICA_BYTES = 448 * 2**20
"""The Serve replica in front of each group of `corelaunch serve` (its Launcher, the HTTP app,
Serve's replica machinery): measured 400-430 MiB."""


def _process_bytes(plan, server: bool) -> int:
    """The allowance for one group's processes: its ranks' (the cpu plan's "rank process" part,
    RANK_PROCESS_BYTES each) and, for a server, its Serve replica's."""
    return plan.tp_degree * plan.memory.process_bytes_per_rank + (SERVER_REPLICA_BYTES if server else 0)


def _host_usable_bytes(plan) -> int:
    """This host's RAM less the planner's reserve (the cpu plan's capacity is this host's)."""
    return plan.memory.usable_bytes_per_rank * plan.tp_degree


def host_bytes_per_group(plan, server: bool = False) -> int:
    """This host's RAM one TP group of `plan` (a cpu plan: planned_on_this_host) holds at most on the
    cpu backend: the plan's total, whose parts are each rank's weights, KV cache, packing scratch and
    process (RANK_PROCESS_BYTES), and, for a server, the Serve replica in front of it
    (SERVER_REPLICA_BYTES), which the plan does not know of. A server never runs static batches, so
    its groups hold the serving rows alone: its own plan (max_batch_size 0) counts no others, and one
    made with static rows (the driver API's) has them taken out here."""
    kv_bytes = plan.memory.kv_cache_bytes_per_rank
    if server and plan.serving_rows:
        kv_bytes = kv_bytes * plan.serving_rows // (plan.batch_size + plan.serving_rows)
    return _bytes_without_kv_cache(plan, server) + kv_bytes * plan.tp_degree


def groups_this_host_holds(config, plan, backend: str, server: bool = False) -> int | None:
    """How many TP groups of `plan` this host's RAM holds at once, where every group would share it
    (cpu replicas on a private cluster: nodes 1); None elsewhere (another machine's memory, or
    several). A plan for --instance is counted as its ranks run here (planned_on_this_host): they
    were left unchecked, and replicas=50 of a trn1.32xlarge plan was taken on a small host. server:
    each group has a Serve replica in front of it (host_bytes_per_group)."""
    from launcher.cluster.ray_cluster import private_cluster

    if backend != "cpu" or config.nodes != 1 or not private_cluster(config.ray_address):
        return None
    here = planned_on_this_host(plan)
    return _host_usable_bytes(here) // host_bytes_per_group(here, server)


def planned_on_this_host(plan):
    """`plan` as the cpu target (this host's RAM) counts it: the same layout, dtype, rows and
    seq_len, for ranks that run here whatever --instance the layout was checked for (the plan's
    memory was that instance's). A plan for this host is returned as it is."""
    from shardlib.instances import CPU_TARGET
    from shardlib.planner import plan as make_plan
    from shardlib.quantized_sizes import KV_CACHE_DTYPES

    if plan.instance == CPU_TARGET:
        return plan
    # an fp8 cache asked for stays fp8; otherwise the cpu target's own default for the compute dtype
    fp8 = plan.memory.kv_cache_dtype if plan.memory.kv_cache_dtype in KV_CACHE_DTYPES else None
    return make_plan(plan.config, instance=CPU_TARGET, tp=plan.tp_degree, batch_size=plan.batch_size,
                     serving_rows=plan.serving_rows, seq_len=plan.seq_len, dtype=plan.dtype,
                     kv_strategy=plan.kv_strategy, pad_q_heads=plan.padded_q_heads is not None,
                     kv_cache_dtype=fp8, moe_sharding=plan.moe_sharding)


def check_replicas_fit_this_host(config, plan, backend: str) -> None:
    """cpu replicas on a private cluster (this host alone) share its RAM, which the plan checked for
    one TP group (its ranks' processes included): ValueError when `replicas` groups (one for "auto", at
    least) cannot all fit, before they start and exhaust it. replicas="auto" is capped by the same
    count (PlannedLaunch.host_holds, Launcher._size_replicas)."""
    replicas = config.replicas if isinstance(config.replicas, int) else 1
    check_groups_fit(replicas, "replicas", plan, groups_this_host_holds(config, plan, backend))


def check_groups_fit(count: int, name: str, plan, holds: int | None, server: bool = False,
                     least: int | None = None) -> None:
    """ValueError naming `name` (the option that asked for `count` TP groups of `plan`) when this
    host's RAM holds fewer (`holds`, from groups_this_host_holds; None: not this host's to check).
    holds 0 is refused whatever the count: the plan's own check leaves out a server's Serve replica,
    and a plan for another --instance was never checked against this host's RAM, so one group alone
    can be past it. least: the
    autoscaling minimum (`corelaunch serve --min-replicas`) when `name` is its --max-replicas."""
    from shardlib.planner import format_bytes

    if holds is None or count <= holds:
        return
    plan = planned_on_this_host(plan)  # as groups_this_host_holds counted it: the message's figures are this host's
    if holds == 0:  # a server's replica (which the plan leaves out), or a plan made for another --instance
        raise ValueError(_no_group_fits(plan, server))
    per_group = host_bytes_per_group(plan, server)
    # autoscaling needs a maximum above its minimum: "at most 2" from --min-replicas 2 was refused next
    fewer = (f"Use --replicas {holds} in place of --min-replicas/--max-replicas (a fixed count: autoscaling "
             f"needs --max-replicas above --min-replicas {least})" if least is not None and holds <= least
             else f"Ask for at most {holds}")
    raise ValueError(f"{name} ({count}): {count} TP groups of {plan.tp_degree} rank(s) need "
                     f"{format_bytes(count * per_group)} ({format_bytes(per_group)} each, of which "
                     f"{format_bytes(_process_bytes(plan, server))} for the "
                     f"{'rank and Serve replica' if server else 'rank'} processes) "
                     f"but this host has {format_bytes(_host_usable_bytes(plan))} usable; nothing was started. "
                     f"{fewer}, or shrink each group's KV cache (--max-num-seqs, --seq-len)")


def _no_group_fits(plan, server: bool) -> str:
    """Why not even one TP group of `plan` fits this host's RAM once its processes are counted."""
    from shardlib.planner import format_bytes

    processes = "rank processes and its Serve replica" if server else "rank processes"
    # a server holds no static batch (host_bytes_per_group): only its serving rows shrink
    rows = "--max-num-seqs" if server else "--max-num-seqs, or --max-batch-size for static batches"
    # at TP 1 there is no lower degree: "Lower --tp" was advice that changed nothing
    lower_tp = "Lower --tp (fewer rank processes), or shrink" if plan.tp_degree > 1 else "Shrink"
    usable, needs = _host_usable_bytes(plan), host_bytes_per_group(plan, server)
    said = (f"one TP group of {plan.tp_degree} rank(s) needs {format_bytes(needs)} of this host's RAM "
            f"({format_bytes(_process_bytes(plan, server))} of it for its {processes}, about "
            f"{format_bytes(RANK_PROCESS_BYTES)} a rank, beside its weights, KV cache and scratch) "
            f"but this host has {format_bytes(usable)} usable; nothing was started. ")
    without_kv = _bytes_without_kv_cache(plan, server)
    if without_kv > usable:  # no smaller cache can help: it told to shrink a cache of a MiB
        return (said + f"Even without its KV cache ({format_bytes(needs - without_kv)}) it needs "
                f"{format_bytes(without_kv)}: run it on a host with more RAM, or with a smaller --dtype "
                f"(the weights)" + (", or a lower --tp (fewer rank processes)" if plan.tp_degree > 1 else ""))
    return said + f"{lower_tp} the KV cache: a smaller --seq-len, or fewer rows ({rows})"


def _bytes_without_kv_cache(plan, server: bool) -> int:
    """host_bytes_per_group less the KV cache: what no --seq-len or row count shrinks."""
    return plan.memory.fixed_bytes_per_rank * plan.tp_degree + (SERVER_REPLICA_BYTES if server else 0)
