"""The line `corelaunch generate` prints about graphs built inside its requests.

Without --warm-up, each bucket's graph is built the first time a request needs it, inside that
request: on a cold compile cache that is most of the first request's time. Afterwards the driver
compares rank 0's compile stats with those it reported at load (Launcher.compile_stats) and says
once what was built and how long it took. Pure functions on the stats dicts
(workers.compiled.CompileStats.to_dict), so they are tested without Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlib.compile_counters import COMPILING_COUNTERS as CACHE_MISSES


@dataclass(frozen=True)
class BuiltSinceLoad:
    graphs: int
    seconds: float
    """Sum of the graphs' first calls (tracing plus compiling, or fetching from the cache)."""
    compiled: bool
    """True when the compile cache missed (cold), False when every graph came from it (warm)."""
    from_cache: int = 0
    """Of `graphs`, those taken from the compile cache (when the rank says per graph; else 0)."""


def built_since_load(at_load: dict | None, now: dict | None) -> BuiltSinceLoad | None:
    """What rank 0 built after load, from its stats then and now; None when nothing (or eager)."""
    if not now:
        return None
    before = len(at_load["graphs"]) if at_load else 0
    new = now["graphs"][before:]
    if not new:
        return None
    seconds = sum(g["first_call_s"] for g in new)
    if all(g.get("compiled") is not None for g in new):  # each graph says which it was
        from_cache = sum(not g["compiled"] for g in new)
        return BuiltSinceLoad(graphs=len(new), seconds=seconds, compiled=from_cache < len(new), from_cache=from_cache)
    counted = any(name in now for name in CACHE_MISSES)
    misses = sum(now.get(name, 0) - (at_load or {}).get(name, 0) for name in CACHE_MISSES)
    # A backend that keeps no cache counters compiled what it built.
    return BuiltSinceLoad(graphs=len(new), seconds=seconds, compiled=misses > 0 or not counted)


def compile_message(per_replica: list[tuple[dict | None, dict | None]]) -> str | None:
    """One line about the graphs built during the requests, or None when none was.

    per_replica: (stats at load, stats now) of each replica's rank 0. Replicas build their graphs
    in parallel, so the one that spent longest is what the requests waited for."""
    built = [b for b in (built_since_load(at_load, now) for at_load, now in per_replica) if b is not None]
    if not built:
        return None
    slowest = max(built, key=lambda b: b.seconds)  # what the requests waited for
    compiling = sum(b.compiled for b in built)
    if not slowest.compiled and compiling:  # "from the compile cache" alone hid the replicas that compiled
        return (f"set up {slowest.graphs} graph(s) in {slowest.seconds:.1f} s during the requests: {compiling} of "
                f"{len(built)} replicas compiled theirs (later runs take them from the cache), the others read "
                f"them from the compile cache")
    if not slowest.compiled:
        return f"set up {slowest.graphs} graph(s) from the compile cache in {slowest.seconds:.1f} s during the requests"
    if slowest.compiled and slowest.from_cache:  # some compiled, the rest read from the cache
        return (f"set up {slowest.graphs} graph(s) in {slowest.seconds:.1f} s during the requests: "
                f"{slowest.graphs - slowest.from_cache} compiled (later runs take them from the cache), "
                f"{slowest.from_cache} from the compile cache")
    return (f"compiled {slowest.graphs} graph(s) in {slowest.seconds:.1f} s during the requests; "
            f"later runs take them from the cache")
