"""How much of the cluster each rank asks Ray for, how many groups fit, and what is missing when
none does. Pure arithmetic on resource dicts: no Ray here, so every rule is unit-tested.

CPU backend: the cluster's CPUs are divided evenly over every rank of every replica, never more
than one node can give the ranks it hosts. With more ranks than cores (a development and test use)
each rank's bundle gets a fraction of a CPU (Ray accepts fractional CPU bundles) and one thread, so
the group still fits; such a run is slower, not wrong.
Device backends (those whose workers.backends entry names a ray_resource: `neuron_cores`, `GPU`):
a bundle of one unit of that resource (Ray knows no fractions of them): one GPU, or one NeuronCore as
the Neuron runtime counts them, a logical core whatever the LNC (device_rank_resources says why),
plus one CPU for the driving process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from shardlib.planner import ranks_per_node

_EPS = 1e-9


@dataclass(frozen=True)
class RankResources:
    bundle: dict[str, float]
    """One placement-group bundle, as Ray takes it."""
    num_cpus: float
    """CPUs the actor itself claims inside its bundle."""
    threads: int
    """torch threads the rank runs."""


def cpu_rank_resources(tp: int, node_cpus: Sequence[float] | float, nodes: int = 1, replicas: int = 1,
                       cpus_per_rank: float | None = None) -> RankResources:
    """A CPU rank's bundle: `cpus_per_rank`, or an even share of the CPUs of the alive nodes
    (`node_cpus`, one entry per node; a single number means one node) over tp x replicas ranks,
    capped by what one node gives the ceil(tp / nodes) ranks it hosts."""
    if cpus_per_rank is None:
        per_node = [float(node_cpus)] if isinstance(node_cpus, (int, float)) else [float(c) for c in node_cpus]
        per_node = [c for c in per_node if c > 0] or [1.0]
        share = min(sum(per_node) / (tp * max(replicas, 1)), max(per_node) / ranks_per_node(tp, nodes))
        cpus_per_rank = _packed(_ray_granular(share), per_node, tp, nodes, replicas)
    if cpus_per_rank <= 0:
        raise ValueError(f"cpus_per_rank ({cpus_per_rank}) must be positive")
    threads = max(1, math.floor(cpus_per_rank + _EPS))
    return RankResources(bundle={"CPU": cpus_per_rank}, num_cpus=cpus_per_rank, threads=threads)


def _ray_granular(share: float) -> float:
    """Whole CPUs when there are enough, else a fraction rounded down to Ray's 1e-4 granularity."""
    return math.floor(share + _EPS) if share >= 1 else math.floor(share * 1e4 + _EPS) / 1e4


def _packed(share: float, per_node: list[float], tp: int, nodes: int, replicas: int) -> float:
    """The largest CPU share up to `share` at which `replicas` groups fit the nodes at once as the
    launcher reserves them (place_group: one node, or each node's share of the ranks): the even split alone left a node's
    remainder too small for another group (TP 3 x 3 replicas on two 2-CPU nodes: 0.4444 each, one
    group a node, the third never placed). `share` itself where none fits (the placement says why)."""
    totals = [{"CPU": c} for c in per_node]

    def fits(s: float) -> bool:
        return s > 0 and groups_that_fit(totals, {"CPU": s}, tp, max(nodes, 1), limit=max(replicas, 1)) >= replicas

    if fits(share):
        return share
    low, high = 0, int(math.floor(share * 1e4 + _EPS))  # in Ray's 1e-4 steps: low fits (or is 0), high does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle / 1e4) else (low, middle)
    return _ray_granular(low / 1e4) if low else share


def device_rank_resources(resource: str) -> RankResources:
    """A device rank's bundle: one of `resource` plus one CPU, one torch thread. One GPU; or one
    NeuronCore as the Neuron runtime counts them, a logical core at the node's LNC (Ray's
    `neuron_cores` come from neuron-ls, and the IDs Ray writes into NEURON_RT_VISIBLE_CORES are
    read by the runtime as logical cores: two per rank at LNC 2 would claim four physical cores,
    and TP 64 would name cores 64-127, which do not exist)."""
    return RankResources(bundle={resource: 1, "CPU": 1}, num_cpus=1, threads=1)


def rank_resources(ray_resource: str | None, tp: int, node_cpus: Sequence[float] | float,
                   nodes: int = 1, replicas: int = 1, cpus_per_rank: float | None = None) -> RankResources:
    """One rank's resources for a backend whose registry entry asks for `ray_resource`
    (workers.backends.BackendEntry): device_rank_resources, or for None a CPU share
    (cpu_rank_resources, which the remaining arguments are for)."""
    if ray_resource is not None:
        return device_rank_resources(ray_resource)
    return cpu_rank_resources(tp, node_cpus, nodes=nodes, replicas=replicas, cpus_per_rank=cpus_per_rank)


def actor_options(resources: RankResources) -> dict:
    """The actor options that claim a rank's bundle: Ray takes CPUs and GPUs as num_cpus and
    num_gpus and refuses them inside `resources`, which holds every other resource."""
    bundle = resources.bundle
    return {"num_cpus": resources.num_cpus, "num_gpus": bundle.get("GPU", 0),
            "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}}


def missing_resource(resource: str, node_total: Sequence[Mapping[str, float]],
                     node_names: Sequence[str]) -> str | None:
    """Why no rank asking for `resource` can ever be placed (no alive node declares any), or None."""
    if any(total.get(resource, 0.0) > 0 for total in node_total):
        return None
    held = "; ".join(f"{n} has {_resources(t)}" for n, t in zip(node_names, node_total)) or "no alive node"
    return (f"no alive node of the Ray cluster declares {resource} ({held}); start Ray on nodes that have "
            f"them (Ray counts GPUs itself; other resources are declared with `ray start --resources`), "
            f"connect to such a cluster with --ray-address, or choose another --backend")


def even_split(bundle: Mapping[str, float], tp: int, nodes: int) -> int | None:
    """Ranks per node when a group over several nodes must be split evenly (None: it need not, or
    `nodes` does not divide `tp`). The planner checks each node's share of the ranks (TP / nodes):
    for a device group a degree NxD Inference supports on one node, within its cores; for a cpu
    group each node's RAM given to that many ranks. PACK would put them on as few nodes as hold
    them: 4 ranks on one trn1 node for a plan of 2 x 2, a degree trn1 does not support, or a cpu
    group's 4 ranks on one node whose RAM the plan gave to 2."""
    if nodes > 1 and tp % nodes == 0:
        return tp // nodes
    return None


def bundles_that_fit(free: Mapping[str, float], bundle: Mapping[str, float]) -> int:
    """How many copies of `bundle` fit in one node's `free` resources."""
    counts = [math.floor((free.get(name, 0.0) + _EPS) / amount) for name, amount in bundle.items() if amount > 0]
    return min(counts) if counts else 0


def node_split(tp: int, nodes: int) -> list[int] | None:
    """Ranks on each node for a group over several nodes, fullest first, or None for one node (it
    holds all TP): the fewest nodes that keep to the ceil(TP / nodes) ranks the plan gave one
    node's memory to, ceil or floor of TP over them on each (TP 3 over 2: [2, 1]; TP 7 over 3:
    [3, 2, 2]; TP 4 over 3: [2, 2], as --nodes is at most that many; one rank a node where --nodes
    exceeds TP). Each share is one bundle, and Ray puts each bundle on a different node
    (STRICT_SPREAD): PACK filled the roomiest node first, all of TP 3 on one node of two, which the
    launcher refused until --placement-timeout ran out."""
    if nodes <= 1:
        return None
    planned = -(-tp // nodes)  # ceil(TP / nodes): what the plan counted a node's memory for
    used = -(-tp // planned)
    if used <= 1:
        return None
    base, extra = divmod(tp, used)
    return [base + 1] * extra + [base] * (used - extra)


def place_group(free: list[dict[str, float]], bundle: Mapping[str, float], tp: int,
                max_nodes: int) -> list[int] | None:
    """Ranks per node (indexes into `free`) for one group of `tp` bundles over at most `max_nodes`
    nodes, as the launcher reserves it: on one node (STRICT_PACK), or split over several
    (node_split), the fullest share on the roomiest node, each share on a different node
    (STRICT_SPREAD). None when it does not fit."""
    room = sorted(range(len(free)), key=lambda i: -bundles_that_fit(free[i], bundle))
    shares = node_split(tp, max_nodes) or [tp]
    if len(room) < len(shares) or any(bundles_that_fit(free[i], bundle) < n for i, n in zip(room, shares)):
        return None
    chosen = [0] * len(free)
    for i, n in zip(room, shares):
        chosen[i] = n
    return chosen


def groups_that_fit(free: Sequence[Mapping[str, float]], bundle: Mapping[str, float], tp: int,
                    max_nodes: int, limit: int = 1024) -> int:
    """How many TP groups of `tp` bundles, each over at most `max_nodes` nodes, the nodes' `free`
    resources hold at once (greedy, as Ray would place them one after the other)."""
    free = [dict(f) for f in free]
    count = 0
    while count < limit:
        ranks = place_group(free, bundle, tp, max_nodes)
        if ranks is None:
            break
        for node, n in zip(free, ranks):
            for name, amount in bundle.items():
                node[name] = node.get(name, 0.0) - n * amount
        count += 1
    return count


def held_resources(bundle: Mapping[str, float], node_total: Sequence[Mapping[str, float]],
                   node_free: Sequence[Mapping[str, float]], node_names: Sequence[str]) -> str:
    """What of the resources a rank's `bundle` takes others hold now, node by node ("node a: CPU 3
    of 4"), or "" where nothing is held."""
    held = []
    for name, total, free in zip(node_names, node_total, node_free):
        taken = [f"{resource} {_fmt(total.get(resource, 0.0) - free.get(resource, 0.0))} of {_fmt(total[resource])}"
                 for resource in bundle if total.get(resource, 0.0) - free.get(resource, 0.0) > _EPS]
        if taken:
            held.append(f"{name}: {', '.join(taken)}")
    return "; ".join(held)


def never_placeable(bundle: Mapping[str, float], tp: int, max_nodes: int,
                    node_total: Sequence[Mapping[str, float]]) -> bool:
    """Whether the nodes, even with nothing else on them, could not hold one group."""
    return place_group([dict(t) for t in node_total], bundle, tp, max_nodes) is None


def never_placeable_why(bundle: Mapping[str, float], tp: int, max_nodes: int,
                        node_total: Sequence[Mapping[str, float]], node_names: Sequence[str]) -> str | None:
    """Why the nodes, even with nothing else on them, could never hold one group (explain_unplaceable's
    account, with the way out); None where they can."""
    if not never_placeable(bundle, tp, max_nodes, node_total):
        return None
    return explain_unplaceable(bundle, tp, max_nodes, node_total, None, node_names)


def fewer_groups_why(bundle: Mapping[str, float], tp: int, max_nodes: int,
                     node_total: Sequence[Mapping[str, float]], replicas: int, cpus_per_rank_given: bool,
                     option: str = "--replicas", auto_offered: bool = True,
                     least: int | None = None) -> str | None:
    """Why the nodes, even with nothing else on them, hold fewer than `replicas` groups at once (the
    first groups would start and the rest wait out the placement timeout), worded to follow the
    cluster's name; None where they hold them all. cpus_per_rank_given: the share is the user's
    --cpus-per-rank, which the way out names; `option` asked for the count (`corelaunch serve`'s
    --max-replicas when it autoscales, from `least`, its --min-replicas), and auto_offered says
    whether it takes `auto`."""
    holds = groups_that_fit(node_total, bundle, tp, max_nodes, limit=replicas)
    if holds >= replicas:
        return None
    share = f"{_fmt(bundle.get('CPU', 0))} CPU a rank" + (" (--cpus-per-rank)" if cpus_per_rank_given else "")
    # autoscaling needs a maximum above its minimum: "lower --max-replicas to 1" from 1 was refused too
    lower = (f"use --replicas {holds} (a fixed count: autoscaling needs --max-replicas above --min-replicas "
             f"{least})" if least is not None and holds <= least else f"lower {option} to {holds}")
    return (f"holds {holds} TP group(s) of {tp} rank(s) at {share}, not the {replicas} replicas asked ({option}); "
            + lower + (" or --cpus-per-rank" if cpus_per_rank_given else "")
            + (f", or use {option} auto" if auto_offered else ""))


def explain_unplaceable(bundle: Mapping[str, float], tp: int, max_nodes: int,
                        node_total: Sequence[Mapping[str, float]],
                        node_free: Sequence[Mapping[str, float]] | None = None,
                        node_names: Sequence[str] | None = None, groups: int = 1) -> str:
    """Why a group of `tp` x `bundle` over at most `max_nodes` nodes cannot be placed: whether the
    cluster could never hold it (and what is missing), whether it could never hold the `groups`
    replicas asked at once, or whether its resources are held by others."""
    names = list(node_names) if node_names else [f"node {i}" for i in range(len(node_total))]
    want = ", ".join(f"{name}: {_fmt(amount)}" for name, amount in bundle.items())
    per_node = even_split(bundle, tp, max_nodes)
    shares = node_split(tp, max_nodes)
    split = " + ".join(str(n) for n in shares or [])
    need = (f"{per_node} bundle(s) of {{{want}}} on each of {max_nodes} nodes" if per_node is not None
            else f"{tp} bundle(s) of {{{want}}}, {split} on {len(shares)} different nodes" if shares
            else f"{tp} bundle(s) of {{{want}}} on at most {max_nodes} node(s)")
    if not node_total:
        return f"it needs {need}, and the cluster has no alive node"
    held = "; ".join(f"{n} has {_resources(t)}" for n, t in zip(names, node_total))
    if never_placeable(bundle, tp, max_nodes, node_total):
        best = sorted((bundles_that_fit(t, bundle) for t in node_total), reverse=True)[:max_nodes]
        short = [f"{name} (it needs {_fmt(amount * tp)} in all, the alive nodes have "
                 f"{_fmt(sum(t.get(name, 0.0) for t in node_total))})" for name, amount in bundle.items()
                 if sum(t.get(name, 0.0) for t in node_total) + _EPS < amount * tp]
        holding = sum(bundles_that_fit(t, bundle) >= (per_node or 0) for t in node_total)
        missing = (f"the cluster lacks {', '.join(short)}" if short else
                   f"only {holding} node(s) can hold {per_node} such bundles, where it needs {max_nodes} (a "
                   f"group over several nodes takes the same share of its ranks on each)" if per_node is not None else
                   f"{_roomiest(len(shares), len(node_total))} {' + '.join(str(n) for n in best[:len(shares)])} "
                   f"such bundles, where it needs {split} (a group over several nodes takes at most ceil(TP / "
                   f"--nodes) ranks on each)" if shares else
                   f"its {min(max_nodes, len(node_total))} roomiest node(s) hold only {sum(best)} such bundle(s)")
        needed = max_nodes if per_node is not None else len(shares or [])
        usable = sum(bundles_that_fit(t, bundle) >= 1 for t in node_total)
        if not short and usable < needed:  # one roomy node is no way out: say so
            missing += (f"; --nodes {max_nodes} puts the group's shares on {needed} different nodes, even where one "
                        f"node has room for them all, and {usable} node(s) can hold a rank")
        # --cpus-per-rank sizes only a cpu rank's bundle (CPU alone); a device bundle is fixed. Named
        # only where some share fits: where the group needs more nodes than are alive (TP 2 over
        # --nodes 2 on one node), no share can help.
        cpus = (" or --cpus-per-rank (each rank's CPUs)"
                if set(bundle) == {"CPU"} and largest_cpu_share(tp, max_nodes, node_total) is not None else "")
        if not any(bundles_that_fit(t, bundle) for t in node_total):
            # not one rank fits anywhere: more nodes per group, or fewer ranks, cannot help
            way = _no_rank_fits_way(bundle, tp, max_nodes, node_total)
            return (f"it needs {need} and the cluster can never hold that: {missing}; no node holds even one "
                    f"rank's bundle (alive nodes: {held}). {way}")
        # the same share on each node (per_node): more nodes per group need more nodes still
        spread = next((n for n in range(max_nodes + 1, len(node_total) + 1)
                       if place_group([dict(t) for t in node_total], bundle, tp, n) is not None), None)
        # the whole cluster is short: spreading the group over more nodes, or fewer, cannot help
        # --nodes above 1 was the user's, so their command takes it; at 1, more nodes per group is a
        # way out only of the commands that have --nodes
        elsewhere = _WHERE_NODES_IS_TAKEN if max_nodes <= 1 else ""
        ways = ("Add nodes with these resources" if short else
                f"Add nodes that hold {per_node} such bundles each, pass fewer --nodes (more ranks on each node)"
                if per_node is not None else
                f"Add nodes that hold {shares[0]} such bundles each, pass fewer --nodes (more ranks on each node)"
                if shares and spread is None else
                f"Add nodes with these resources, allow more nodes per group (--nodes {spread} holds it){elsewhere}"
                if spread is not None else
                f"Add nodes with these resources, allow more nodes per group (--nodes){elsewhere}")
        return (f"it needs {need} and the cluster can never hold that: {missing} (alive nodes: {held}). "
                f"{ways}, or lower --tp{cpus}")
    ever = groups_that_fit(node_total, bundle, tp, max_nodes, limit=groups) if groups > 1 else groups
    if ever < groups:  # its own earlier replicas hold the rest: waiting for "other groups" never ends
        return (f"it needs {need}; the alive nodes hold at most {ever} such group(s) even with nothing else on "
                f"them, not the {groups} replicas asked (alive nodes: {held}). Lower --replicas to {ever} (or use "
                f"--replicas auto), or add nodes" + (" or give each rank fewer CPUs with --cpus-per-rank"
                                                     if set(bundle) == {"CPU"} else ""))
    free_txt = ""
    if node_free is not None:
        free_txt = "; free now: " + "; ".join(f"{n} {_resources(f)}" for n, f in zip(names, node_free))
    ways = ["Free them", "add nodes"]
    if groups > 1:  # one group cannot be fewer, and check, bench and compile have no --replicas to lower
        ways.append("lower --replicas")
    # A cpu rank's default share is its node's whole CPU count / TP: a Ray job's entrypoint holding
    # one CPU (--entrypoint-num-cpus) kept such a group from ever being placed, and the advice named
    # only --replicas, already 1.
    if set(bundle) == {"CPU"}:
        ways.append("give each rank fewer CPUs with --cpus-per-rank (by default a rank takes its node's CPUs / "
                    "TP; inside a Ray job, the job's own --entrypoint-num-cpus holds some)")
    return (f"it needs {need}; the cluster could hold it but other groups or jobs hold those resources "
            f"(alive nodes: {held}{free_txt}). {_one_of(ways)}")


_WHERE_NODES_IS_TAKEN = " where the command takes --nodes (check, bench and compile keep a group on one node)"
"""After a --nodes way out offered where --nodes was left at 1: not every command takes it."""


def _one_of(ways: list[str]) -> str:
    """"a or b", "a, b, or c"."""
    return f"{ways[0]} or {ways[1]}" if len(ways) == 2 else f"{', '.join(ways[:-1])}, or {ways[-1]}"


def _roomiest(count: int, alive: int) -> str:
    """"its 2 roomiest nodes hold" (no more than are alive), or "its only node holds"."""
    return "its only node holds" if alive == 1 else f"its {min(count, alive)} roomiest nodes hold"


def _no_rank_fits_way(bundle: Mapping[str, float], tp: int, max_nodes: int,
                      node_total: Sequence[Mapping[str, float]]) -> str:
    """The way out when no node holds even one rank's bundle: a CPU share at which the alive nodes
    hold the group (named only where one exists), or a node sized for the ranks it must hold
    (ceil(TP / max_nodes) of them), not for one rank."""
    ranks = ranks_per_node(tp, max_nodes)
    sized = "{" + ", ".join(f"{name}: {_fmt(amount * ranks)}" for name, amount in bundle.items()) + "}"
    held = f"{ranks} ranks' bundles" if ranks > 1 else "one rank's bundle"
    cpu = set(bundle) == {"CPU"}
    if max_nodes > 1 and ranks < tp:  # the group needs that many such nodes
        node = f"add {-(-tp // ranks)} nodes with {sized} each ({held} each)"
    else:
        node = f"add a node with {sized}" + (f" (the {held})" if ranks > 1 else "")
    if not cpu:  # a device bundle is fixed: only nodes that have it can help
        return node[0].upper() + node[1:]
    share = largest_cpu_share(tp, max_nodes, node_total)
    if share is None:
        return f"No CPU share lets the alive nodes hold the group's {tp} ranks; {node}"
    most = max(t.get("CPU", 0.0) for t in node_total)
    why = ("the most CPUs a node has" if ranks == 1 and share == most else
           f"the most at which the alive nodes hold the group's {tp} ranks on at most {max_nodes} node(s)")
    return f"Lower --cpus-per-rank (at most {_fmt(share)}, {why}), or {node}"


def largest_cpu_share(tp: int, max_nodes: int, node_total: Sequence[Mapping[str, float]]) -> float | None:
    """The largest CPU share a cpu rank may ask for (in Ray's 1e-4 steps) at which `node_total`
    holds one group of `tp` ranks over at most `max_nodes` nodes, as place_group places it; None
    where no share does (too few nodes for an even split)."""
    totals = [dict(t) for t in node_total]

    def fits(steps: int) -> bool:
        return place_group([dict(t) for t in totals], {"CPU": steps / 1e4}, tp, max_nodes) is not None

    high = int(math.floor(max((t.get("CPU", 0.0) for t in totals), default=0.0) * 1e4 + _EPS))
    if high < 1 or not fits(1):
        return None
    low = 1  # fits; find the largest step that does (fitting only shrinks as the share grows)
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low / 1e4  # a fraction above one CPU too: --cpus-per-rank takes it as given


def _fmt(amount: float) -> str:
    return str(int(amount)) if float(amount).is_integer() else f"{amount:g}"


def _resources(res: Mapping[str, float]) -> str:
    # Ray's bookkeeping resources say nothing about what a rank can use (bundle_group_*: a placement
    # group's own); CPU is shown even at 0, which Ray's free resources leave out.
    shown = {k: v for k, v in res.items() if not (
        k.startswith(("node:", "accelerator_type", "bundle_group_")) or k in ("memory", "object_store_memory"))}
    return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in sorted({"CPU": 0.0, **shown}.items())) + "}"
