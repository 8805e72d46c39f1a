"""The coordinator refuses bad input clearly, never hangs, and reports a dead rank by rank and node.

Request checks and a dead rank's report run twice: with the Launcher's groups in-process
(tests/in_process_cluster.py, fast) and on real Ray workers (slow).
"""

from __future__ import annotations

import os
import signal
import re
import socket
import threading
import time
from pathlib import Path

import pytest

from launcher.api import LaunchConfig, Launcher
from tests.test_compile_cli import save_word_tokenizer
from launcher.errors import LaunchError, NoReplicaAvailable, PlacementTimeout, PlanRejected, ReplicaFailed, WorkerDied
from tests.model_factory import save_random_model
from workers.sampling import SamplingParams


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return str(save_random_model(tmp_path_factory.mktemp("m"), "llama", num_heads=4, num_kv_heads=2))


def test_impossible_layout_is_refused_before_any_process(small_model, ray_tripwire):
    with pytest.raises(PlanRejected) as info:
        Launcher(model=small_model, tp=3, progress=False).start()
    assert "heads_not_divisible" in [e["code"] for e in info.value.errors]
    assert "num_attention_heads (4)" in str(info.value)
    # nothing was started: the refused launch never reached for Ray (ray_tripwire)


def test_missing_model_path_is_named():
    with pytest.raises(FileNotFoundError, match="/no/such/model"):
        LaunchConfig(model="/no/such/model")


@pytest.mark.parametrize("field, value", [("tp", 0), ("tp", "two"), ("max_batch_size", -1), ("nodes", 0),
                                          ("request_timeout_s", -1), ("backend", "tpu"), ("replicas", 0),
                                          ("replicas", "many"), ("max_restarts", -1), ("restart_window_s", 0)])
def test_bad_launch_options_name_the_value(field, value):
    named = f"unknown backend {value!r}" if field == "backend" else f"{field} ({value!r}) must be"
    with pytest.raises(ValueError, match=re.escape(named)):
        LaunchConfig(**{field: value})


def test_unsatisfiable_placement_fails_within_its_timeout(small_model, ray_session):
    start = time.monotonic()
    with pytest.raises(PlacementTimeout, match="could not reserve 2 bundles") as info:
        Launcher(model=small_model, tp=2, cpus_per_rank=64, placement_timeout_s=2, progress=False).start()
    assert time.monotonic() - start < 20
    # no node holds one rank's 64 CPUs: the way out is --cpus-per-rank alone (not a lower --tp or more nodes)
    assert "Lower --cpus-per-rank (at most" in str(info.value) and "--tp" not in str(info.value)
    assert str(info.value).count("--cpus-per-rank") == 1  # said once
    # nothing of the failed start holds CPUs; earlier tests' actors on this shared Ray free theirs
    # asynchronously, so wait for them (a leak never frees)
    deadline = time.monotonic() + 60
    while ray_session.available_resources().get("CPU") != ray_session.cluster_resources().get("CPU"):
        assert time.monotonic() < deadline, (ray_session.available_resources(), ray_session.cluster_resources())
        time.sleep(0.1)


@pytest.mark.slow
def test_bad_requests_get_clear_errors_and_batches_split(small_model, ray_session):
    # Eager: the refusals and the batch split are the subject, not the graphs (compiled static and
    # continuous batches through Ray are tests/test_compiled.py's and test_launcher_generate.py's).
    check_bad_requests_and_batch_split(small_model, compile_=False)


def test_bad_requests_get_clear_errors_and_batches_split_in_process(small_model, in_process_cluster):
    check_bad_requests_and_batch_split(small_model, compile_=False)
    [group] = in_process_cluster.groups
    assert group.calls == 3 + 5  # the bad requests never reached the ranks; 3 parts, then 5 one by one


def check_bad_requests_and_batch_split(small_model, compile_: bool) -> None:
    with Launcher(model=small_model, tp=2, max_batch_size=2, seq_len=32, compile=compile_,
                  progress=False) as launcher:
        with pytest.raises(ValueError, match="30 tokens.*seq_len is 32"):
            launcher.generate([list(range(3, 33))], max_new_tokens=4)
        with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 128\)"):
            launcher.generate([[1, 500]], max_new_tokens=2)
        # the fix named is one the caller can take (it said "pass prompts as token ids", which
        # `corelaunch generate` cannot)
        with pytest.raises(ValueError, match=r"no tokenizer files .*: copy the model's tokenizer into it, or pass "
                                             r"prompts as token-id lists through the Python API \(`corelaunch "
                                             r"generate` takes text only\)"):
            launcher.generate("hello", max_new_tokens=2)
        with pytest.raises(ValueError, match="max_new_tokens"):
            launcher.generate([[1, 2]], max_new_tokens=0)
        with pytest.raises(ValueError, match="top_p"):
            launcher.generate([[1, 2]], SamplingParams(temperature=1.0, top_p=1.5))
        # five prompts with max_batch_size 2 run as three static worker calls, results in prompt order
        prompts = [[3 + i, 40 + i, 7] for i in range(5)]
        together = launcher.generate(prompts, max_new_tokens=4, batching="static")
        one_by_one = [launcher.generate([p], max_new_tokens=4, batching="static")[0] for p in prompts]
        streamed = launcher.generate(prompts, max_new_tokens=4)  # continuous batching: the same tokens
        assert [r.token_ids for r in together] == [r.token_ids for r in one_by_one] == [r.token_ids for r in streamed]
        assert len(together) == 5
        with pytest.raises(ValueError, match="batching"):
            launcher.generate(prompts, batching="dynamic")


def test_an_unreadable_tokenizer_is_named_and_leaves_no_group_running(small_model, in_process_cluster, tmp_path):
    """The tokenizer loads on a thread while the group starts: its error still ends start(), and the
    group it started is shut down; check_prompts() meets the error before any group starts."""
    import shutil

    model = Path(shutil.copytree(small_model, tmp_path / "model"))
    (model / "tokenizer.json").write_text("{ not json")
    named = rf"the tokenizer in {model} cannot be loaded \(JSONDecodeError: .*\); repair or replace"
    with pytest.raises(ValueError, match=named):
        Launcher(model=str(model), tp=2, compile=False, progress=False).check_prompts("hello")
    assert in_process_cluster.groups == []
    launcher = Launcher(model=str(model), tp=2, compile=False, progress=False).prepare()
    deadline = time.monotonic() + 60
    while not launcher._tokenizer_load.failed():  # it fails in a moment, while Ray would be starting
        assert time.monotonic() < deadline, "the tokenizer's load never failed"
        time.sleep(0.05)
    with pytest.raises(ValueError, match=named):
        launcher.start()
    assert in_process_cluster.groups == []  # named before any group was placed, not after every rank loaded
    with pytest.raises(ValueError, match=named):  # again: a second start() ran on token ids alone
        launcher.start()
    for group in in_process_cluster.groups:
        assert group.actors == []  # any group it started is shut down
    save_word_tokenizer(model)  # repaired: the next start() loads it
    with launcher.start():
        assert launcher.tokenizer is not None and launcher.generate("t3 t9", max_new_tokens=2)[0].text


@pytest.mark.parametrize("edit, raised", [(lambda tokenizer: {}, "KeyError"),  # JSON, but not a tokenizer's
                                           (lambda tokenizer: {**tokenizer, "model": {"type": tokenizer["model"]["type"]}},
                                            "Exception")])  # its model's vocabulary gone: tokenizers' own plain Exception
def test_a_tokenizer_file_that_is_json_but_not_a_tokenizer_is_named(small_model, tmp_path, edit, raised):
    """A tokenizer.json of the wrong shape raised KeyError, or tokenizers' plain Exception, through
    every caller: a traceback and exit 1 from `corelaunch generate`."""
    import json
    import shutil

    from launcher.api import load_tokenizer

    model = Path(shutil.copytree(small_model, tmp_path / "model"))
    save_word_tokenizer(model)  # a real tokenizer.json, then spoiled
    load_tokenizer(model)
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    (model / "tokenizer.json").write_text(json.dumps(edit(tokenizer)))
    with pytest.raises(ValueError, match=rf"the tokenizer in {model} cannot be loaded \({raised}: .*\); repair or replace"):
        load_tokenizer(model)


def test_a_dead_rank_with_restarts_disabled_fails_the_call_naming_it(small_model, in_process_cluster):
    # No health check comes between the death and the request (it would give the replica up first).
    with Launcher(model=small_model, tp=2, max_restarts=0, compile=False, health_check_interval_s=600,
                  progress=False) as launcher:
        launcher._group.kill_rank(1)
        with pytest.raises(ReplicaFailed) as info:
            launcher.generate([[5, 6, 7]], max_new_tokens=4)
        message = str(info.value)
        assert isinstance(info.value.__cause__, WorkerDied), repr(info.value.__cause__)
        assert "rank 1" in message and "max_restarts=0" in message, message
        assert launcher.replica_status()[0]["state"] == "failed"
        with pytest.raises(NoReplicaAvailable, match="no replica is left"):
            launcher.generate([[5, 6, 7]], max_new_tokens=4)


@pytest.mark.slow
def test_worker_killed_mid_request_is_reported_within_seconds(tmp_path, ray_session):
    """With restarts disabled, the death itself reaches the caller: rank, node and pid named.
    (With restarts, the group is restarted and the request re-run: tests/test_fault_tolerance.py.)"""
    # A request of 900 tokens: a second or more even with fast co-located collectives.
    model_dir = save_random_model(tmp_path, "llama", hidden_size=256, intermediate_size=512, num_layers=4,
                                  num_heads=4, num_kv_heads=2, vocab_size=512, max_position_embeddings=1024)
    launcher = Launcher(model=str(model_dir), tp=2, progress=False, request_timeout_s=120, max_restarts=0)
    launcher.start()
    try:
        [replica] = launcher.replica_status()
        victim = replica["workers"][1]

        def kill_once_running() -> None:  # the kill must land while the request runs
            deadline = time.monotonic() + 30
            while not launcher.replica_status()[0]["busy"] and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.1)
            os.kill(victim["pid"], signal.SIGKILL)

        killer = threading.Thread(target=kill_once_running)
        killer.start()
        start = time.monotonic()
        with pytest.raises(ReplicaFailed) as info:
            launcher.generate([[5, 6, 7]], max_new_tokens=900, ignore_eos=True)
        elapsed = time.monotonic() - start
        killer.join(30)
        message = str(info.value)
        assert isinstance(info.value.__cause__, WorkerDied), repr(info.value.__cause__)
        assert "rank 1" in message and victim["node_ip"] in message and str(victim["pid"]) in message, message
        assert "max_restarts=0" in message, message
        assert elapsed < 30, f"death noticed after {elapsed:.1f} s"
        assert launcher.replica_status()[0]["state"] == "failed"
    finally:
        launcher.shutdown()


def test_a_model_the_workers_cannot_run_is_refused_before_any_process(tmp_path, ray_tripwire):
    import json

    model_dir = save_random_model(tmp_path, "llama", num_heads=4, num_kv_heads=2)
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "mrope", "factor": 2.0}  # a rope type the workers lack
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(PlanRejected, match=r"rope scaling type 'mrope'") as info:
        Launcher(model=str(model_dir), tp=2, progress=False).start()
    assert [e["code"] for e in info.value.errors] == ["not_runnable"]  # and Ray was never reached (ray_tripwire)


def test_a_burst_wait_past_the_followers_collective_timeout_is_refused():
    """An idle leader gathering a burst holds its followers in a collective up to BURST_WAIT_CAP
    waits; past the rendezvous timeout they gave up and the group broke (then restarted, again)."""
    from launcher.api import LaunchConfig

    with pytest.raises(ValueError, match=r"burst_wait_s \(1\) gathers a burst for up to 10 s .*rendezvous_timeout_s \(3\)"):
        LaunchConfig(burst_wait_s=1.0, rendezvous_timeout_s=3)
    LaunchConfig(burst_wait_s=1.0, rendezvous_timeout_s=30)  # the defaults' room


def test_ray_client_to_another_machine_is_refused_before_ray_is_asked(monkeypatch):
    """Through Ray Client the driver runs here and rank 0 streams tokens to a socket it opens here,
    which a cluster elsewhere cannot reach: every launch failed after its start-up timeout."""
    import ray

    from launcher.cluster import ray_cluster
    from launcher.errors import LaunchError

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init was called"))
    with pytest.raises(LaunchError, match=r"'ray://192.0.2.55:10001' \(--ray-address\) is Ray Client to another "
                                          r"machine \(192.0.2.55\).*ray job submit"):
        ray_cluster.connect("ray://192.0.2.55:10001")
    assert ray_cluster.remote_ray_client("ray://127.0.0.1:10001") is None  # this machine: it works
    if socket.has_ipv6 and _ipv6_loopback():
        assert ray_cluster.remote_ray_client("ray://[::1]:10001") is None  # IPv6 loopback too
    assert ray_cluster.remote_ray_client("10.0.0.5:6379") is None  # not Ray Client


def test_a_second_launch_shares_a_joined_session_only_where_it_asks_for_that_cluster(monkeypatch):
    """The session an earlier launch of this process joined (and still runs on) is shared by a launch
    asking for the same GCS however its address is written (the same machine's port under another
    host name: Ray's servers listen on every interface), and refused for another cluster."""
    import socket

    from launcher.cluster import ray_cluster

    monkeypatch.setitem(ray_cluster._OWN_SESSION, "users", 1)
    monkeypatch.setitem(ray_cluster._OWN_SESSION, "started_here", False)
    monkeypatch.setitem(ray_cluster._OWN_SESSION, "address", "127.0.0.1:6379")
    try:  # the host's own name, where it resolves (a container's /etc/hosts may lack it)
        socket.getaddrinfo(socket.gethostname(), None)
        names = ["localhost", socket.gethostname()]
    except OSError:
        names = ["localhost"]
    for same in ("127.0.0.1:6379", *(f"{name}:6379" for name in names)):
        assert ray_cluster._another_cluster_asked(same) is None, same
    for other in ("127.0.0.1:6380", "192.0.2.55:6379", "local"):
        said = ray_cluster._another_cluster_asked(other)
        assert said is not None and "already connected to the Ray cluster at '127.0.0.1:6379'" in said, other
        assert "one process holds one Ray session" in said and "shut that one down first" in said, said


def test_a_refused_connection_names_token_authentication(monkeypatch):
    """Ray reports a missing token as a failed connection: the refusal said only "no Ray cluster
    answered ... run `ray stop`", for a cluster that was there and wanted a token."""
    import ray

    from launcher.cluster import ray_cluster
    from launcher.errors import LaunchError

    def refused(*args, **kwargs):
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.5:6379")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_cluster, "_unreachable", lambda address, **probe: None)
    monkeypatch.setattr(ray, "init", refused)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(LaunchError, match="token authentication.*set RAY_AUTH_MODE=token"):
        ray_cluster.connect("10.0.0.5:6379")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # set already: not the advice
    with pytest.raises(LaunchError) as refused_with_token:
        ray_cluster.connect("10.0.0.5:6379")
    assert "RAY_AUTH_MODE" not in str(refused_with_token.value)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_a_rank_error_whose_type_takes_more_arguments_still_names_the_rank():
    """A rank's ValueError subclass is rebuilt with the rank in its message; one whose constructor
    takes more than a message (JSONDecodeError) raised TypeError, losing the rank and the error."""
    import json

    from launcher.cluster.tp_group import _rank_failure

    failure = _rank_failure("rank 1 (node n1, pid 7)", "load its shard", json.JSONDecodeError("Expecting value", "", 0))
    assert type(failure) is ValueError
    assert str(failure).startswith("rank 1 (node n1, pid 7) failed to load its shard: Expecting value")


NO_NEW_RAY_SCRIPT = """
import threading, time
import ray
from launcher.cluster import ray_cluster
from launcher.cluster.tp_group import TPGroup

connection = ray_cluster.connect("local", num_cpus=1)


@ray.remote(num_cpus=0)
class SlowLoad:
    def load(self):
        time.sleep(60)


group = TPGroup.__new__(TPGroup)  # the fields waiting and killing use: a group whose ranks still load
group.actors, group.workers = [SlowLoad.remote()], [{"rank": 0, "node_ip": "127.0.0.1", "pid": 0}]
group._pg, group._serve_refs, group._events = None, [], None
group.__post_init__()  # its call sender, which kill() closes
outcome = []


def restart():  # Launcher._new_group: on any error the group is killed, then the error raised
    try:
        try:
            group._wait_all([a.load.remote() for a in group.actors], 30, "load its shard")
        except BaseException:
            group.kill()
            raise
    except BaseException as err:
        outcome.append(type(err).__name__ + ": " + str(err))


waiting = threading.Thread(target=restart)
waiting.start()
time.sleep(2)
connection.close()  # Launcher.shutdown, once the pool's join gave up on this restart
waiting.join(30)
print("OUTCOME", outcome)
print("RAY_UP", ray.is_initialized())
"""


@pytest.mark.slow
def test_a_restart_still_waiting_when_the_launcher_closes_ray_starts_no_new_ray(tmp_path):
    """Ray's calls start a local Ray when none is connected: a restart whose ranks were still loading
    past the shutdown's grace called ray.wait, then ray.kill, after the launcher closed its private
    Ray, and so started a new one (with a dashboard) that nothing stopped."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", NO_NEW_RAY_SCRIPT], cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RAY_UP False" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "LaunchError: Ray was shut down while this group was working" in proc.stdout, proc.stdout
    assert "Started a local Ray instance" not in proc.stderr, proc.stderr[-3000:]


def test_prompts_without_an_order_and_values_past_float_range_are_refused_by_name(small_model, in_process_cluster):
    """A set or dict of prompts came back in its own iteration order (a dict's keys taken as the
    prompts), and a set of sampling settings went to them in hash order; numbers past float range raised OverflowError naming nothing; stop=5 a bare TypeError."""
    from launcher.cluster.restart_policy import MAX_RESTARTS
    from launcher.serving.stop_strings import validate_stops

    launcher = Launcher(model=small_model, tp=1, compile=False, progress=False)
    for prompts in ({(5, 6), (7, 8)}, {"a": 1}):
        with pytest.raises(ValueError, match=f"a {type(prompts).__name__} has no order"):
            launcher.check_prompts(prompts)
    # a set of per-prompt sampling settings went to the prompts in hash order (equal ones merged)
    cold, hot = SamplingParams(temperature=0.1, seed=1), SamplingParams(temperature=1.5, seed=2)
    for sets in ({cold, hot}, frozenset({cold, hot})):
        with pytest.raises(ValueError, match=f"a {type(sets).__name__} has no order to match them to the prompts"):
            launcher.check_prompts([[5, 6], [7, 8]], sets)
    with pytest.raises(ValueError, match="temperature=.* must be a finite number"):
        SamplingParams(temperature=10**400)
    with pytest.raises(ValueError, match="request_timeout_s .* must be a finite positive number"):
        LaunchConfig(model=small_model, request_timeout_s=10**400)
    with pytest.raises(ValueError, match=f"max_restarts .* must be at most {MAX_RESTARTS}"):
        LaunchConfig(model=small_model, max_restarts=10**30)
    with pytest.raises(ValueError, match="stop strings must be a list of strings, got 5"):
        validate_stops(5)


def test_two_threads_starting_one_launcher_start_one_set_of_groups(small_model, in_process_cluster):
    """start() checked for a running pool without a lock: two threads each placed a replica's group,
    and shutdown() stopped only the one it kept."""
    launcher = Launcher(model=small_model, tp=1, compile=False, progress=False)
    errors = []
    starters = [threading.Thread(target=lambda: _record(errors, launcher.start)) for _ in range(2)]
    for starter in starters:
        starter.start()
    for starter in starters:
        starter.join(120)
    try:
        assert not errors, errors
        assert len(in_process_cluster.groups) == 1, in_process_cluster.groups
    finally:
        launcher.shutdown()


def _record(errors: list, fn) -> None:
    try:
        fn()
    except BaseException as err:  # noqa: BLE001 - collected for the assertion
        errors.append(err)


def test_a_shutdown_while_start_connects_to_ray_stops_the_start(small_model, in_process_cluster, monkeypatch):
    """shutdown() found no pool and no connection yet and returned at once; start() then brought
    the groups up anyway, serving after the shutdown until a second one."""
    from launcher.cluster import ray_cluster

    launcher = Launcher(model=small_model, tp=1, compile=False, progress=False)
    connect = ray_cluster.connect  # the in-process cluster's (no Ray session)

    stoppers = []

    def connect_while_shut_down(*args, **kwargs):
        stopper = threading.Thread(target=launcher.shutdown)  # another thread, as Ctrl-C handling or a server's
        stoppers.append(stopper)
        stopper.start()
        deadline = time.monotonic() + 60
        while launcher._stops == 0 and time.monotonic() < deadline:  # the shutdown has been asked
            time.sleep(0.01)
        return connect(*args, **kwargs)

    monkeypatch.setattr(ray_cluster, "connect", connect_while_shut_down)
    with pytest.raises(LaunchError, match="shut down while it started"):
        launcher.start()
    stoppers[0].join(60)
    assert not stoppers[0].is_alive()
    assert in_process_cluster.groups == [] and launcher._pool is None and launcher._ray is None
    monkeypatch.setattr(ray_cluster, "connect", connect)
    try:  # and the launcher starts afresh afterwards
        assert launcher.start().generate([[5, 6, 7]], max_new_tokens=2)[0].finish_reason == "length"
    finally:
        launcher.shutdown()


def test_a_shutdown_from_another_thread_leaves_ray_open_until_the_start_has_stopped(small_model, in_process_cluster,
                                                                                    monkeypatch):
    """shutdown() closed Ray while start() was still calling it (sizing the replicas, placing them):
    a loop of such shutdowns on a private Ray crashed the process inside Ray, twice with a segfault."""
    from launcher.cluster import placement

    launcher = Launcher(model=small_model, tp=1, compile=False, progress=False)
    nodes, inside, seen = placement.alive_nodes, threading.Event(), {}

    def nodes_while_shut_down():
        inside.set()
        deadline = time.monotonic() + 60
        while launcher._stops == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # what shutdown() does meanwhile, it has done
        seen["ray_open"] = launcher._ray is not None  # this thread still makes Ray calls
        return nodes()

    monkeypatch.setattr(placement, "alive_nodes", nodes_while_shut_down)
    errors: list = []
    starter = threading.Thread(target=lambda: _record(errors, launcher.start))
    starter.start()
    assert inside.wait(60)
    launcher.shutdown()
    starter.join(5)  # only its last lines: shutdown() returned once the start had stopped
    assert not starter.is_alive()
    assert seen == {"ray_open": True}
    assert len(errors) == 1 and "shut down while it started" in str(errors[0]), errors
    assert in_process_cluster.groups == [] and launcher._pool is None and launcher._ray is None


def test_a_group_made_after_a_shutdown_began_sees_it(small_model, in_process_cluster, monkeypatch):
    """Each group compared the shutdown count with the count when it was made: a shutdown from
    another thread landing between the start's last check and the group's making went unseen, and
    shutdown() waited out the group's whole load."""
    from tests.in_process_cluster import ThreadTPGroup

    seen = []
    start = ThreadTPGroup.start

    def start_seeing(group):
        seen.append(group.stop_asked())
        start(group)

    with Launcher(model=small_model, tp=1, compile=False, progress=False) as launcher:
        monkeypatch.setattr(ThreadTPGroup, "start", start_seeing)
        launcher._stops += 1  # a shutdown begun on another thread, not yet at the pool
        try:
            launcher._new_group(0, restart=True).group.kill()
        finally:
            launcher._stops -= 1
    assert seen == [True]


def test_a_shutdown_also_stops_a_start_still_waiting_for_another(small_model, in_process_cluster, monkeypatch):
    """A start() waiting on the lock while another connected reset the shutdown's mark once it got
    the lock, and brought the groups up after shutdown() had returned."""
    from launcher.cluster import ray_cluster

    launcher = Launcher(model=small_model, tp=1, compile=False, progress=False)
    connect, connecting, go_on = ray_cluster.connect, threading.Event(), threading.Event()

    def slow_connect(*args, **kwargs):
        connecting.set()
        go_on.wait(60)
        return connect(*args, **kwargs)

    monkeypatch.setattr(ray_cluster, "connect", slow_connect)
    errors: list = []
    first = threading.Thread(target=lambda: _record(errors, launcher.start))
    first.start()
    assert connecting.wait(60)
    second = threading.Thread(target=lambda: _record(errors, launcher.start))
    second.start()
    time.sleep(0.2)  # the second start waits for the first's lock
    # shutdown() returns once the start it stopped has stopped, so the connect is let go meanwhile
    # (set after shutdown() returned, the test waited out go_on's 60 s)
    threading.Timer(0.5, go_on.set).start()
    launcher.shutdown()
    first.join(60)
    second.join(60)
    try:
        assert len(errors) == 2 and all("shut down while it started" in str(e) for e in errors), errors
        assert in_process_cluster.groups == [] and launcher._pool is None
    finally:
        launcher.shutdown()


def test_check_prompts_refuses_what_generate_refuses_of_stop_ids_and_flags(small_model, ray_tripwire):
    """check_prompts was said to run every check generate makes, but took no stop_token_ids,
    ignore_eos or return_logits: an id outside the vocabulary was refused only by generate."""
    launcher = Launcher(model=small_model, tp=1, compile=False, progress=False)
    prompts = [[5, 6]]
    for options, words in (({"stop_token_ids": [10**6]}, "stop_token_ids"), ({"ignore_eos": "no"}, "ignore_eos"),
                            ({"return_logits": 1}, "return_logits")):
        with pytest.raises(ValueError, match=words):
            launcher.check_prompts(prompts, **options)
        with pytest.raises(ValueError, match=words):  # with batching="static" too
            launcher.check_prompts(prompts, batching="static", **options)
    launcher.check_prompts(prompts, stop_token_ids=[3], ignore_eos=True, return_logits=True)
    # vLLM's default for stop_token_ids: none (it was refused as "must be a list of token ids")
    launcher.check_prompts(prompts, stop_token_ids=None)


def test_check_prompts_refuses_allowed_ids_that_min_tokens_holds_back_as_generate_does(small_model, ray_tripwire):
    """Every allowed token a stop id while min_tokens holds the stop ids back: generate refuses it,
    but check_prompts let it through, so the refusal came only after the cluster started and loaded."""
    launcher = Launcher(model=small_model, tp=1, compile=False, progress=False)
    held = SamplingParams(allowed_token_ids=[7], min_tokens=1)
    with pytest.raises(ValueError, match=r"allowed_token_ids \[7\] are all stop tokens"):
        launcher.check_prompts([[5, 6]], held, stop_token_ids=[7])
    launcher.check_prompts([[5, 6]], held, stop_token_ids=[8])  # another stop id: 7 can be generated
