"""What a launch joins, binds and refuses before anything starts (issue 12's launcher side): the Ray
join rule, the rendezvous store's listening address, and bad requests and options refused before
Ray, the workers or the load have started."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from launcher.api import LaunchConfig, Launcher
from launcher.errors import LaunchError
from tests.model_factory import save_random_model


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return str(save_random_model(tmp_path_factory.mktemp("m"), "llama", num_heads=4, num_kv_heads=2))


@pytest.mark.parametrize("field, value", [("request_timeout_s", float("nan")), ("placement_timeout_s", float("inf")),
                                          ("health_check_interval_s", float("nan")), ("load_timeout_s", True)])
def test_timeouts_must_be_finite_positive_seconds(field, value):
    with pytest.raises(ValueError, match=rf"{field} \({value!r}\) must be a finite positive number"):
        LaunchConfig(**{field: value})


def test_ray_address_auto_is_refused_naming_the_alternatives():
    from launcher.cluster import ray_cluster

    with pytest.raises(ValueError, match="ray_address 'auto'.*RAY_ADDRESS.*ray start --head.*'local'"):
        LaunchConfig(ray_address="auto")
    with pytest.raises(ValueError, match="'auto'"):
        ray_cluster.connect("auto")


def test_ray_address_auto_from_the_environment_is_refused_too(monkeypatch):
    """ray.init reads RAY_ADDRESS=auto as "join whatever runs on this host": it was passed through."""
    from launcher.cluster import ray_cluster

    monkeypatch.setenv("RAY_ADDRESS", "auto")
    monkeypatch.setattr("ray.is_initialized", lambda: False)  # as in a fresh process (this one may hold a session)
    monkeypatch.setattr("ray.init", lambda *a, **k: pytest.fail("ray.init was called with RAY_ADDRESS=auto"))
    with pytest.raises(LaunchError, match="RAY_ADDRESS 'auto' joins any Ray .*host:port.*--ray-address local"):
        ray_cluster.connect(None)


@pytest.mark.parametrize("address", ["garbage", ":6379", "head:", "head:70000", "head:port"])
def test_a_malformed_ray_address_is_refused_naming_the_forms(address, monkeypatch):
    """Ray answered these with a logged traceback and "Malformed host" / "Invalid address format"."""
    from launcher.cluster import ray_cluster

    with pytest.raises(ValueError, match=rf"ray_address \('{address}'\) must be the head's host:port .*'local'"):
        LaunchConfig(ray_address=address)
    monkeypatch.setenv("RAY_ADDRESS", address)  # the environment's address, checked where it is read
    monkeypatch.setattr("ray.is_initialized", lambda: False)  # as in a fresh process (this one may hold a session)
    with pytest.raises(LaunchError, match=rf"ray_address \('{address}'\) .*\(from RAY_ADDRESS\)"):
        ray_cluster.connect(None)
    for good in ("10.0.0.5:6379", "[::1]:6379", "ray://head:10001", "local"):
        assert ray_cluster.malformed_address(good) is None


def test_a_url_is_refused_as_a_ray_address_naming_the_dashboard(monkeypatch):
    """http://host:8265 passed the host:port check (its host read as "http://host"), and Ray then
    said RAY_ADDRESS was set to an HTTP address, where the user had passed --ray-address."""
    from launcher.cluster import ray_cluster

    for url in ("http://127.0.0.1:8265", "https://head:8265", "grpc://head:6379"):
        with pytest.raises(ValueError, match=r"is a URL; corelaunch joins the head's GCS at host:port .*dashboard's"):
            LaunchConfig(ray_address=url)
    monkeypatch.setattr("ray.is_initialized", lambda: False)
    with pytest.raises(LaunchError, match=r"is a URL.*\(from --ray-address\)"):
        ray_cluster.connect("http://127.0.0.1:8265")


def test_a_refused_address_says_nothing_listens_and_gives_no_ray_stop_advice(monkeypatch):
    """Refused at once, it read "nothing accepts connections there within 10 s"; and `ray stop`
    (which stops every Ray of the user on the host) was advised for an address given outright."""
    import socket

    from launcher.cluster import ray_cluster

    with socket.socket() as sock:  # a port nobody listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        monkeypatch.setattr("ray.is_initialized", lambda: False)
        with pytest.raises(LaunchError) as refused:
            ray_cluster.connect(f"127.0.0.1:{port}")
    message = str(refused.value)
    assert "nothing listens there" in message and "within" not in message, message
    assert "ray stop" not in message, message
    monkeypatch.setenv("RAY_ADDRESS", "")
    monkeypatch.setattr(ray_cluster, "recorded_cluster", lambda: f"127.0.0.1:{port}")
    with pytest.raises(LaunchError, match=r"run `ray stop` \(it also stops every Ray process"):
        ray_cluster.connect(None)


def test_a_queue_limit_beyond_serves_field_is_refused_before_start():
    """10**12 passed, and Serve refused the replica's in-flight cap only after Ray and Serve started."""
    LaunchConfig(max_queued_requests=1_000_000)
    with pytest.raises(ValueError, match=r"max_queued_requests \(1000000000000\) must be an integer from 0 to 1000000"):
        LaunchConfig(max_queued_requests=10**12)


def test_a_missing_presharded_directory_is_refused_at_once(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"pre-sharded directory {tmp_path / 'nope'} does not exist"):
        LaunchConfig(presharded_dir=str(tmp_path / "nope"))


def test_requests_are_checked_before_ray_starts(small_model, ray_tripwire):
    launcher = Launcher(model=small_model, tp=1, progress=False, seq_len=64)
    with pytest.raises(ValueError, match="max_new_tokens"):
        launcher.check_prompts([[1, 2, 3]], max_new_tokens=0)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        launcher.check_prompts([[]])
    with pytest.raises(ValueError, match="seq_len"):
        launcher.check_prompts([[1] * 60], max_new_tokens=10)
    launcher.check_prompts([[1] * 50], max_new_tokens=10)  # fits: no error
    assert launcher._ray is None and launcher._pool is None


def test_streamed_requests_are_held_to_the_serving_cache_not_the_model_maximum(ray_tripwire):
    """SmolLM2 allows 8192 positions, but without --seq-len the serving engine's cache rows hold the
    plan's 4096: a longer request was let through and overran its row in the leader's step (the
    group failed, and failed again on the replayed request). A static batch sizes its own cache, but
    within the positions the plan counted for each of its rows too (it grew past them)."""
    from shardlib.demo_model import ensure_demo_model

    launcher = Launcher(model=str(ensure_demo_model()), progress=False, compile=False)
    assert launcher.serving_seq_len == 4096 < launcher.model_config.max_position_embeddings
    with pytest.raises(ValueError, match=r"needs 5010 positions but seq_len is 4096.*raise seq_len \(--seq-len\)"):
        launcher.check_prompts([[1] * 10], max_new_tokens=5000)
    launcher.check_prompts([[1] * 10], max_new_tokens=4086)
    with pytest.raises(ValueError, match=r"needs 5010 positions but seq_len is 4096"):
        launcher.check_prompts([[1] * 10], max_new_tokens=5000, batching="static")
    launcher.check_prompts([[1] * 10], max_new_tokens=4086, batching="static")
    assert Launcher(model=str(ensure_demo_model()), progress=False, seq_len=512).serving_seq_len == 512


def test_a_prompt_that_is_not_utf8_is_named_before_ray_starts(ray_tripwire):
    from shardlib.demo_model import ensure_demo_model

    launcher = Launcher(model=str(ensure_demo_model()), progress=False)
    with pytest.raises(ValueError, match="prompt 1 is not valid UTF-8 text"):
        launcher.check_prompts(["fine", "bad \udcff byte"])  # what Python makes of a non-UTF-8 argv byte
    assert launcher._ray is None


def test_the_cli_refuses_a_bad_request_without_starting_ray(capsys, ray_tripwire):
    from launcher.cli import main

    assert main(["generate", "--quiet", ""]) == 2  # tokenized and checked by the driver, before Ray
    assert "prompt 0 is empty" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # refused by the parser, before the tokenizer loads
        main(["generate", "--max-new-tokens", "0", "--quiet", "hello"])
    assert exit_.value.code == 2 and "--max-new-tokens (0) must be at least 1" in capsys.readouterr().err


STORE_PROBE = textwrap.dedent("""
    import psutil, sys
    from workers.backends.base import RendezvousInfo, join_torch_distributed
    from workers.net import free_port
    join_torch_distributed("gloo", RendezvousInfo("127.0.0.1", free_port()), 0, 1, 30)
    listening = {c.laddr.ip for c in psutil.Process().net_connections(kind="tcp") if c.status == "LISTEN"}
    print(sorted(listening))
""")


def test_the_rendezvous_store_listens_on_the_rendezvous_address_only():
    out = subprocess.run([sys.executable, "-c", STORE_PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['127.0.0.1']"


def test_gloo_is_pinned_to_the_interface_toward_rank_0_or_left_alone_without_a_route(monkeypatch):
    import workers.net as net
    from workers.backends.base import _pin_gloo_to_the_route_to

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "restored-after-the-test")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    _pin_gloo_to_the_route_to("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == net.interface_with_address("127.0.0.1") is not None
    del os.environ["GLOO_SOCKET_IFNAME"]

    def no_route(host):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(net, "address_toward", no_route)
    _pin_gloo_to_the_route_to("10.255.0.1")  # joining the store then fails, naming the address
    assert "GLOO_SOCKET_IFNAME" not in os.environ


def test_a_port_for_a_late_bind_is_free_and_outside_the_ephemeral_range():
    import socket

    from workers.net import free_port_for_a_late_bind

    ephemeral_low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = {free_port_for_a_late_bind() for _ in range(5)}
    assert all(20000 <= port < min(30000, ephemeral_low) for port in ports), ports
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free indeed


def _probe_with_host_name(host_name: str, env: dict) -> subprocess.CompletedProcess:
    """STORE_PROBE in a UTS namespace of its own whose host name is `host_name` (needs root)."""
    return subprocess.run(["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$1" -c "$2"', host_name,
                           sys.executable, STORE_PROBE], capture_output=True, text=True, timeout=120, env=env)


def test_gloo_listens_on_loopback_even_where_the_host_name_resolves_to_another_address():
    """gloo, left to itself, listens on the address the host's name resolves to (on a cloud host,
    the one its whole network reaches): here the name is that address itself. A GLOO_SOCKET_IFNAME
    the user set is kept."""
    import shutil

    from workers.net import interface_addresses

    outside = [(name, address) for name, address in interface_addresses().items() if not address.startswith("127.")]
    if not outside or shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root, unshare and a network interface other than loopback")
    interface, address = outside[0]
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    out = _probe_with_host_name(address, env)
    if out.returncode != 0 and "unshare" in out.stderr:
        pytest.skip(f"this host refuses a UTS namespace: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['127.0.0.1']"
    out = _probe_with_host_name(address, {**env, "GLOO_SOCKET_IFNAME": interface})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(sorted(["127.0.0.1", address]))  # the store, then gloo where the user said


def test_a_stream_whose_replica_reports_nothing_ends_in_a_request_timeout(small_model, in_process_cluster,
                                                                           monkeypatch):
    """The reader's own deadline (the replica's thread silent, as while it restarts a group) raised a
    plain TimeoutError, which `corelaunch generate` printed as a traceback; now a LaunchError."""
    import time

    import launcher.serving.request_streams as request_streams
    from launcher.errors import RequestTimeout

    monkeypatch.setattr(request_streams, "_GRACE_S", 0.2)
    with Launcher(model=small_model, tp=1, seq_len=32, compile=False, progress=False,
                  request_timeout_s=0.2) as launcher:
        replica = launcher._pool.replicas[0]
        monkeypatch.setattr(replica, "_poll_streams", lambda: time.sleep(0.05))  # reports nothing, fails nothing
        time.sleep(0.3)  # a poll already under way (up to POLL_WAIT_S) would still deliver the stream's tokens
        with pytest.raises(RequestTimeout, match=r"got no answer within 0.4 s, .*--request-timeout"):
            list(launcher.stream([1, 2, 3], max_new_tokens=2))


def test_a_static_generate_gives_up_when_no_replica_ever_answers(small_model, in_process_cluster, monkeypatch):
    from concurrent.futures import Future

    import launcher.api as api
    from launcher.errors import RequestTimeout

    monkeypatch.setattr(api, "WATCHDOG_GRACE_S", 0.0)
    with Launcher(model=small_model, tp=1, seq_len=32, compile=False, progress=False, request_timeout_s=0.2,
                  load_timeout_s=0.2, max_restarts=0) as launcher:
        monkeypatch.setattr(launcher._pool, "submit", lambda request: Future())  # a replica that never answers
        with pytest.raises(RequestTimeout, match=r"no replica answered a batch of 1 prompts within 0.4 s"):
            launcher.generate([[1, 2, 3]], max_new_tokens=2, batching="static")


def test_generate_prints_its_result_before_the_shutdown(in_process_cluster, capsys, monkeypatch):
    """The result went to stdout after the shutdown, which waits for a --presharded-cache copy still
    being written (minutes for a large model): the answer waited, and Ctrl-C during the wait lost it."""
    from launcher.cli import main
    from shardlib.demo_model import ensure_demo_model

    printed_by_then = []
    shutdown = Launcher.shutdown

    def recording_shutdown(self, grace_s=10.0):
        printed_by_then.append(capsys.readouterr().out)
        shutdown(self, grace_s)

    monkeypatch.setattr(Launcher, "shutdown", recording_shutdown)
    assert main(["generate", "--model", str(ensure_demo_model()), "--tp", "1", "--no-compile", "--json", "--quiet",
                 "--max-new-tokens", "2", "--prompt", "hello"]) == 0
    assert printed_by_then and '"outputs"' in printed_by_then[0], printed_by_then


def test_a_shutdown_failing_after_the_answer_says_so_and_is_no_refusal(in_process_cluster, capsys, monkeypatch):
    """With the answer printed before the shutdown, a shutdown error read as a refusal of the input
    (exit 2, which promises an empty stdout): a script discarded a complete answer."""
    from launcher.cli import main
    from shardlib.demo_model import ensure_demo_model

    def failing_close(self):
        raise LaunchError("Ray could not be closed")

    monkeypatch.setattr(Launcher, "_close_ray", failing_close)
    code = main(["generate", "--model", str(ensure_demo_model()), "--tp", "1", "--no-compile", "--json", "--quiet",
                 "--max-new-tokens", "2", "--prompt", "hello"])
    out, err = capsys.readouterr()
    assert code == 3 and '"outputs"' in out, (code, out)
    assert "the answer above is complete; shutting down failed: Ray could not be closed" in err, err


def test_generate_quiet_prints_the_answers_alone(capsys):
    from launcher.cli.generate_command import print_report

    report = {"outputs": [{"prompt": "The capital of France is", "text": " Paris.", "token_ids": [7042, 30],
                           "finish_reason": "length", "time_to_first_token_s": 0.25, "decode_tokens_per_s": 30.0}]}
    print_report(report, as_json=False, quiet=True)
    out, err = capsys.readouterr()
    assert (out, err) == ("The capital of France is Paris.\n", "")
    print_report(report, as_json=False, quiet=False)
    out, err = capsys.readouterr()
    assert out == "The capital of France is Paris.\n"
    assert err == "  [length, 2 tokens, first token 250 ms, 30.0 tokens/s]\n"
    # graphs built during the request (a first run): its times are not the model's speed, and say so
    print_report(report, as_json=False, quiet=False, with_builds=True)
    assert capsys.readouterr().err == ("  [length, 2 tokens, first token 250 ms, 30.0 tokens/s; these times include "
                                       "the graphs built during the request]\n")


def test_a_one_token_answer_reports_no_decode_rate(capsys):
    """One token has no decode step: the report said 0.0 tokens/s, a rate that was never measured."""
    from launcher.api import GenerationResult
    from launcher.cli.generate_command import output_entry, print_report

    fields = {f.name: None for f in dataclasses.fields(GenerationResult)}
    one = GenerationResult(**{**fields, "prompt": "Hi", "text": "!", "token_ids": [17], "finish_reason": "length",
                              "replica": 0, "time_to_first_token_s": 0.25, "decode_tokens_per_s": 0.0})
    entry = output_entry(one)
    assert entry["decode_tokens_per_s"] is None and json.loads(json.dumps(entry))["decode_tokens_per_s"] is None
    print_report({"outputs": [entry]}, as_json=False, quiet=False)
    assert capsys.readouterr().err == "  [length, 1 tokens, first token 250 ms]\n"
    two = dataclasses.replace(one, token_ids=[17, 18], decode_tokens_per_s=12.345)
    assert output_entry(two)["decode_tokens_per_s"] == 12.35


def test_a_prompt_logprob_of_minus_infinity_is_written_as_json_reads_it():
    """json.dumps wrote -Infinity, which no JSON parser reads (the server reports vLLM's floor)."""
    from launcher.api import GenerationResult
    from launcher.cli.generate_command import output_entry
    from workers.serving.requests import TokenLogprob

    fields = {f.name: None for f in dataclasses.fields(GenerationResult)}
    scored = GenerationResult(**{**fields, "prompt": "Hi", "text": "!", "token_ids": [17], "finish_reason": "length",
                                 "replica": 0, "time_to_first_token_s": 0.25,
                                 "prompt_logprobs": [TokenLogprob(5, float("-inf"), [(6, -0.5), (5, float("-inf"))])]})
    text = json.dumps(output_entry(scored), allow_nan=False)  # raises on an infinity
    assert json.loads(text)["prompt_logprobs"][0]["logprob"] == -9999.0


def test_a_private_ray_that_does_not_start_is_a_launch_error_naming_the_fix(monkeypatch):
    """Ray's own start-up timeout (its raylet not registered within 30 s, on a host too busy) came
    out of Launcher.start() as a bare Exception and a traceback."""
    import ray

    from launcher.cluster import ray_cluster
    from launcher.errors import RayStartFailed

    shut = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: shut.append(True))
    monkeypatch.setattr(ray_cluster, "open_files_limits", lambda: (65536, 65536))  # as most hosts (below: low)

    def late_raylet(**options):
        raise Exception("The current node timed out during startup. This could happen because some of the raylet "
                        "failed to startup or the GCS has become overloaded.")

    monkeypatch.setattr(ray, "init", late_raylet)
    with pytest.raises(LaunchError, match=r"the private Ray cluster did not start: The current node timed out .* "
                                          r"Ray waits 30 s for it, .* retry when the host is quieter"):
        ray_cluster.connect("local")
    assert shut == [True]  # whatever the failed start left is shut down

    def no_permission(**options):
        raise PermissionError(13, "Permission denied", "/tmp/ray/session_x")

    monkeypatch.setattr(ray, "init", no_permission)  # not Ray's wait (a retry cannot help): the settings named
    with pytest.raises(ValueError, match=r"did not start: PermissionError: \[Errno 13\] Permission denied: "
                                         r"'/tmp/ray/session_x'; Ray writes its session under its temporary folder "
                                         r"\(TMPDIR, or RAY_TMPDIR; /tmp by default\) and its token under ~/.ray"):
        ray_cluster.connect("local")
    assert shut == [True, True]

    def late_gcs(**options):  # Ray's other start-up wait: a traceback (exit 1)
        raise RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_1.")

    monkeypatch.setattr(ray, "init", late_gcs)
    with pytest.raises(RayStartFailed, match=r"did not start: Timed out waiting for file .* retry when the host"):
        ray_cluster.connect("local")
    # under `ulimit -n 48` Ray's raylet never registered, and the message blamed a busy host
    monkeypatch.setattr(ray, "init", late_raylet)
    monkeypatch.setattr(ray_cluster, "open_files_limits", lambda: (48, 48))
    with pytest.raises(ValueError, match=r"did not start \(Exception: The current node timed out .*\), and this "
                                         r"process may open only 48 files \(`ulimit -n`\), below the 4096 under which Ray"
                                         r".*the hard limit is 48 too \(`ulimit -Hn`\): raising it needs root"):
        ray_cluster.connect("local")
    monkeypatch.setattr(ray_cluster, "open_files_limits", lambda: (48, 1024))  # Ray stops at 65536, else the hard
    with pytest.raises(ValueError, match=r"may open only 48 files .* raise the limit \(`ulimit -n 65536`\)"):
        ray_cluster.connect("local")

    def long_socket_path(**options):
        raise OSError("validate_socket_filename failed: AF_UNIX path length cannot exceed 107 bytes: /x/sockets/p")

    monkeypatch.setattr(ray, "init", long_socket_path)
    monkeypatch.setattr(ray_cluster, "open_files_limits", lambda: (64, 1024))  # low: the path is still named
    with pytest.raises(ValueError, match=r"AF_UNIX path length .* \(TMPDIR, or RAY_TMPDIR\): point it at a shorter"):
        ray_cluster.connect("local")
    from launcher.cli.exit_codes import EXIT_RUN_FAILED, exit_code_for

    assert exit_code_for(RayStartFailed("x")) == EXIT_RUN_FAILED  # the machine's state: a retry may work


@pytest.fixture
def default_sigint():
    """Ctrl-C as a program starts with it, whatever an earlier test of this worker process left (the
    test below failed three times under xdist, its KeyboardInterrupt never raised)."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_second_ctrl_c_during_the_shutdown_after_the_first_does_not_cut_it_short(monkeypatch, default_sigint):
    """The shutdown after Ctrl-C (the groups' second of grace, then Ray's) was itself interrupted by
    a second Ctrl-C: the command exited, and Ray's agents (once a rank) outlived it by minutes."""
    import signal

    launcher = Launcher(LaunchConfig(progress=False))
    done = []

    def shutdown(grace_s):
        os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C, in the middle of it
        _run_bytecode_for(0.1)  # where Python would run the handler
        done.append(grace_s)

    monkeypatch.setattr(launcher, "shutdown", shutdown)
    before = signal.getsignal(signal.SIGINT)
    try:
        launcher.__exit__(KeyboardInterrupt, KeyboardInterrupt(), None)
    except KeyboardInterrupt:
        pytest.fail("the second Ctrl-C cut the shutdown short")
    from launcher.api import INTERRUPT_GRACE_S

    assert done == [INTERRUPT_GRACE_S] and signal.getsignal(signal.SIGINT) is before
    with pytest.raises(KeyboardInterrupt):  # outside the shutdown, Ctrl-C works as before
        os.kill(os.getpid(), signal.SIGINT)
        _run_bytecode_for(0.1)


def _run_bytecode_for(seconds: float) -> None:
    """Short sleeps for `seconds`: a signal that another thread of the process took (a test worker
    has threads left by earlier tests) runs its Python handler at the main thread's next bytecode,
    which one long sleep left until after the `with` block (seen twice under xdist)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.001)


def test_ctrl_c_while_the_commands_are_imported_and_parsed_ends_as_an_interrupt(monkeypatch, capsys):
    """The first half second of every command imports each subcommand and parses the line: Ctrl-C
    there was a traceback from inside importlib, not "corelaunch: interrupted" and 130."""
    from launcher import cli
    from launcher.cli import plan_command

    def interrupted(subparsers):
        raise KeyboardInterrupt  # as a Ctrl-C arriving during the imports

    monkeypatch.setattr(plan_command, "add_parser", interrupted)
    assert cli.main(["plan"]) == cli.INTERRUPTED
    assert capsys.readouterr().err == "corelaunch: interrupted\n"


def test_a_second_shutdown_returns_only_once_the_first_has_stopped_everything():
    """Two threads shutting down at once: the second found the pool taken and returned at once while
    the first was still stopping the groups (and then Ray), so a caller trusting its own return
    went on with them still running. A stand-in pool whose shutdown takes a while shows the order."""
    import threading

    launcher = Launcher(LaunchConfig(progress=False))
    stopped = threading.Event()

    class SlowPool:  # as ReplicaPool: a second shutdown finds the groups stopping and returns at once
        stopping = False

        def shutdown(self, grace_s):
            if self.stopping:
                return
            self.stopping = True
            time.sleep(0.5)
            stopped.set()

    launcher._pool = SlowPool()
    returned = []

    def shut(grace_s):
        launcher.shutdown(grace_s)
        returned.append(stopped.is_set())

    threads = [threading.Thread(target=shut, args=(grace,)) for grace in (10.0, 0.0)]
    for thread in threads:
        thread.start()
        time.sleep(0.1)  # the first is inside the pool's shutdown when the second calls
    for thread in threads:
        thread.join(10)
    assert returned == [True, True]
    assert launcher._pool is None
