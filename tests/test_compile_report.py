"""The line `corelaunch generate` prints about graphs built during its requests (launcher/compile_report.py)."""

from __future__ import annotations

from launcher.compile_report import built_since_load, compile_message


def stats(*seconds: float, misses: int = 0, hits: int = 0) -> dict:
    """A rank's compile stats (workers.compiled.CompileStats.to_dict) with one graph per entry."""
    return {"graphs": [{"phase": "token", "batch": 1, "length": 16, "first_call_s": s} for s in seconds],
            "compile_s": sum(seconds), "fxgraph_cache_miss": misses, "fxgraph_cache_hit": hits,
            "autograd_cache_miss": 0}


def test_graphs_built_after_load_on_a_cold_cache():
    built = built_since_load(stats(), stats(30.0, 11.2, misses=6))
    assert (built.graphs, round(built.seconds, 1), built.compiled) == (2, 41.2, True)
    assert compile_message([(stats(), stats(30.0, 11.2, misses=6))]) == (
        "compiled 2 graph(s) in 41.2 s during the requests; later runs take them from the cache")


def test_graphs_taken_from_a_warm_cache():
    message = compile_message([(stats(), stats(2.0, 1.5, hits=6))])
    assert message == "set up 2 graph(s) from the compile cache in 3.5 s during the requests"


def test_only_graphs_after_load_count():
    at_load = stats(20.0, misses=3)  # built by --warm-up
    assert built_since_load(at_load, stats(20.0, misses=3)) is None
    built = built_since_load(at_load, stats(20.0, 5.0, misses=4))
    assert (built.graphs, built.seconds, built.compiled) == (1, 5.0, True)


def test_nothing_to_say_when_eager_or_nothing_was_built():
    assert compile_message([]) is None
    assert compile_message([(None, None)]) is None
    assert compile_message([(stats(1.0), stats(1.0))]) is None


def test_several_replicas_report_the_slowest():
    per_replica = [(stats(), stats(10.0, misses=3)), (stats(), stats(12.0, 3.0, misses=6)), (None, None)]
    assert compile_message(per_replica).startswith("compiled 2 graph(s) in 15.0 s")


def test_graphs_a_warm_up_built_while_serving_was_prepared_are_not_the_requests():
    """--warm-up builds the serving loop's graphs after the load's stats were taken: `generate
    --warm-up` said "compiled 12 graph(s) ... during the requests" of graphs built at start."""
    from types import SimpleNamespace

    from launcher.cluster.replica_pool import ReplicaPool, StartedGroup

    at_load, warmed = stats(20.0, misses=3), stats(20.0, 4.0, 3.0, misses=9)

    def replica(now: dict, serving_compile: dict | None):
        group = SimpleNamespace(compile_stats=lambda: now)
        started = StartedGroup(group=group, load_stats=[SimpleNamespace(compile=at_load)],
                               serving_compile=serving_compile)
        return SimpleNamespace(state="serving", started=started)

    pool = SimpleNamespace(replicas=[replica(warmed, warmed)])
    assert compile_message(ReplicaPool.compile_stats(pool)) is None
    pool = SimpleNamespace(replicas=[replica(stats(20.0, 4.0, 3.0, 6.0, misses=10), warmed)])
    assert compile_message(ReplicaPool.compile_stats(pool)) == (
        "compiled 1 graph(s) in 6.0 s during the requests; later runs take them from the cache")
    pool = SimpleNamespace(replicas=[replica(warmed, None)])  # eager serving, or a group that reported none
    assert compile_message(ReplicaPool.compile_stats(pool)).startswith("compiled 2 graph(s) in 7.0 s")


def graphs(*compiled: bool, seconds: float = 2.0) -> dict:
    """Stats whose graphs each say whether they were compiled (workers.compiled.GraphStats.compiled)."""
    return {"graphs": [{"phase": "token", "batch": 1, "length": 16, "first_call_s": seconds, "compiled": c}
                       for c in compiled], "fxgraph_cache_miss": sum(compiled), "fxgraph_cache_hit": 0}


def test_some_graphs_compiled_and_some_from_the_cache_are_told_apart():
    """A request that compiled one graph and read two from the cache was told "compiled 3 graph(s)"."""
    built = built_since_load(graphs(), graphs(True, False, False))
    assert (built.graphs, built.from_cache, built.compiled) == (3, 2, True)
    assert compile_message([(graphs(), graphs(True, False, False))]) == (
        "set up 3 graph(s) in 6.0 s during the requests: 1 compiled (later runs take them from the cache), "
        "2 from the compile cache")
    assert compile_message([(graphs(), graphs(True, True))]).startswith("compiled 2 graph(s) in 4.0 s")
    assert compile_message([(graphs(), graphs(False, False))]) == (
        "set up 2 graph(s) from the compile cache in 4.0 s during the requests")


def test_the_slowest_replica_is_the_one_described():
    read, compiled = graphs(False, seconds=1.0), graphs(True, seconds=9.0)
    assert compile_message([(graphs(), read), (graphs(), compiled)]).startswith("compiled 1 graph(s) in 9.0 s")
    # the slowest read the cache, and the other replica compiled: said (it was "from the compile cache" alone)
    assert compile_message([(graphs(), graphs(False, seconds=9.0)), (graphs(), graphs(True, seconds=1.0))]) == (
        "set up 1 graph(s) in 9.0 s during the requests: 1 of 2 replicas compiled theirs (later runs take them "
        "from the cache), the others read them from the compile cache")
    assert compile_message([(graphs(), graphs(False, seconds=9.0)), (graphs(), graphs(False, seconds=1.0))]) == (
        "set up 1 graph(s) from the compile cache in 9.0 s during the requests")


def test_a_replica_that_compiled_is_said_when_the_slowest_read_the_cache():
    # one replica compiled its graph (0.9 s), another read it from the cache (1.0 s, the slowest):
    # "from the compile cache" alone said nothing was compiled
    def graph(compiled: bool, seconds: float) -> dict:
        return {"graphs": [{"first_call_s": seconds, "compiled": compiled}]}

    message = compile_message([({"graphs": []}, graph(True, 0.9)), ({"graphs": []}, graph(False, 1.0))])
    assert message == ("set up 1 graph(s) in 1.0 s during the requests: 1 of 2 replicas compiled theirs (later runs "
                       "take them from the cache), the others read them from the compile cache")
