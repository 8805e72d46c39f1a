"""Benchmark scripts that fail early and clearly: argument checks before any work, and a rank that
dies ends the wait at once."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import multiprocessing
import os
import sys
import time

import pytest


def test_allreduce_world_sizes_are_checked_before_any_rank_starts():
    from benchmarks.allreduce import _world_sizes

    assert _world_sizes("2,3") == [2, 3]
    for text in ("0", "1,2", "two", ""):  # --world-sizes 0 ended in a bare queue.Empty traceback
        with pytest.raises(argparse.ArgumentTypeError, match="must be comma-separated integers of at least 2"):
            _world_sizes(text)


def test_allreduce_stops_waiting_when_a_rank_has_died():
    """A dead rank left the driver waiting the whole --timeout-s (600 s by default)."""
    from benchmarks.allreduce import rank_reports

    ctx = multiprocessing.get_context("spawn")
    dead = ctx.Process(target=exit, args=(3,))
    dead.start()
    dead.join()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the ranks ended without a report \\(rank 0 exit code 3\\)"):
        rank_reports(ctx.Queue(), [dead], timeout_s=600)
    assert time.monotonic() - start < 10



# Each argv also carries values that make the unfixed script fail fast after accepting the bad one
# (a tiny size, a missing folder), so that this list could be checked against it.
REFUSED = [
    ("prefill_gemm", ["--rounds", "0", "--rows", "1"], "--rounds (0) must be at least 1"),  # printed Infinity
    ("prefill_gemm", ["--calls", "0", "--rows", "1", "--rounds", "1"], "--calls (0) must be at least 1"),
    ("prefill_gemm", ["--rows", "1,x"], "--rows ('1,x') must be comma-separated integers of at least 1"),
    ("bandwidth", ["--repeats", "0"], "--repeats (0) must be at least 1"),  # reported 0.0 GB/s
    ("bandwidth", ["--threads", "0"], "--threads (0) must be at least 1"),
    ("token_choice", ["--repeats", "0", "--rows", "1", "--vocab", "64"], "--repeats (0) must be at least 1"),
    ("moe_dense_routing", ["--calls", "0", "--no-compile", "--tokens", "1", "--hidden", "8", "--intermediate", "8"],
     "--calls (0) must be at least 1"),
    ("moe_dense_routing", ["--top-k", "9", "--no-compile", "--tokens", "1", "--hidden", "8", "--intermediate", "8"],
     "--top-k (9) must be at most --experts (8)"),
    ("moe_dense_routing", ["--tokens", "1,x", "--no-compile", "--hidden", "8", "--intermediate", "8"],
     "--tokens ('1,x') must be comma-separated integers of at least 1"),
    ("load_memory", ["--repeats", "0", "--model-dir", "/proc/no-such-model"], "--repeats (0) must be at least 1"),
    ("allreduce", ["--timeout-s", "-5", "--world-sizes", "2", "--calls", "1", "--blocks", "1", "--warmup", "0"],
     "--timeout-s (-5) must be a finite number of seconds above 0"),
    ("sequence_parallel", ["--rounds", "0", "--model-dir", "/proc/no-such-model", "--timeout-s", "5"],
     "--rounds (0) must be at least 1"),
    ("sequence_parallel", ["--prompt-len", "1", "--model-dir", "/proc/no-such-model", "--timeout-s", "5"],
     "--prompt-len (1) must be at least 2"),
    ("sequence_parallel", ["--timeout-s", "0", "--model-dir", "/proc/no-such-model"],
     "--timeout-s (0) must be a finite number of seconds above 0"),
    ("fused_projections", ["--new-tokens", "0", "--hidden", "32", "--layers", "1", "--blocks", "1", "--no-compile"],
     "--new-tokens (0) must be at least 2"),
    ("fused_projections", ["--hidden", "48", "--layers", "1", "--new-tokens", "2", "--blocks", "1", "--no-compile"],
     "--hidden (48) must be a multiple of 32"),
    ("decode_attention", ["--threads", "0"], "--threads (0) must be at least 1"),
    ("small_linear_blocks", ["--threads", "0"], "--threads (0) must be at least 1"),
    ("small_linear_blocks", ["--rows", "1,x"], "--rows ('1,x') must be comma-separated integers of at least 1"),
    ("startup", ["--timeout", "0", "--compare", "/proc/no-such-checkout"],
     "--timeout (0) must be a finite number of seconds above 0"),
    ("serving", ["--request-timeout", "0"], "--request-timeout (0) must be a finite number of seconds above 0"),
    ("decode_batch", ["--batches", "0", "--variants", "no-such-variant"],
     "--batches ('0') must be comma-separated integers of at least 1"),
    ("tp_scaling", ["--variants", ",", "--model-dir", "/proc/no-such-model"],
     "--variants (','): unknown variants [] or none"),
    ("loop_hand_over", ["--streams", "0"], "--streams (0) must be >= 1"),  # refused already, kept as a check
    # a bare StopIteration once the tokenizer or the model had loaded
    ("serving", ["--prompt-tokens", "9000", "--levels", "1"],
     "--prompt-tokens (9000) plus --max-tokens (64) is 9064: the benchmark's buckets hold at most 8192"),
    ("decode", ["--start-only", "--prompt-tokens", "9000"], "--prompt-tokens (9000) plus --new-tokens (128)"),
    ("quantized", ["--prompt-tokens", "8190", "--random-254m", "--skip-decode"],
     "--prompt-tokens (8190) plus --new-tokens (64)"),
    # the producer thread died and the readers waited 60 s with no report
    ("loop_hand_over", ["--step-ms", "nan", "--streams", "1", "--steps", "1", "--rounds", "1"],
     "--step-ms (nan) must be a finite number of at least 0"),
    ("loop_hand_over", ["--step-ms", "inf", "--streams", "1", "--steps", "1", "--rounds", "1"],
     "--step-ms (inf) must be a finite number of at least 0"),
    # refused in the quantizing child, after the model had been read and earlier formats quantized
    ("quantized", ["--formats", "int8,junk", "--model-dir", "/proc/no-such-model"],
     "--formats ('int8,junk') must be distinct comma-separated formats of int8, f8e4m3, f8e5m2"),
    # a missing model folder: tracebacks, one of them transformers' wording about Hub repository ids
    ("serving", ["--model-dir", "/proc/no-such-model"], "--model-dir (/proc/no-such-model) does not exist: pass a"),
    ("load_memory", ["--model-dir", "/proc/no-such-model"], "--model-dir (/proc/no-such-model) does not exist"),
    ("quantized", ["--model-dir", "/proc", "--skip-decode"], "--model-dir (/proc) has no config.json"),
    ("sequence_parallel", ["--model-dir", "/proc/no-such-model", "--rounds", "1", "--timeout-s", "30"],
     "--model-dir (/proc/no-such-model) does not exist"),
    # a FileNotFoundError after this host's kernels were built
    ("decode_attention", ["--from", "/proc/no-such-checkout", "--repeats", "1", "--cases", "smollm2_16"],
     "--from (/proc/no-such-checkout) is not a corelaunch checkout with a kernel source"),
    ("small_linear_blocks", ["--packed-from", "/proc", "--rows", "1", "--repeats", "1"],
     "--packed-from (/proc) is not a corelaunch checkout with a kernel source"),
    # nan passed `<= 0` and failed in the server it had started
    ("serving", ["--cpus-per-rank", "nan"], "--cpus-per-rank (nan) must be a finite number above 0"),
    ("plan_speed", ["--bogus"], "unrecognized arguments: --bogus"),  # ran the benchmark
    # three one-thread ranks on two threads, reported as the same cores split
    ("replicas", ["--replicas", "3", "--threads", "2"], "--replicas (3) above --threads (2)"),
    # one replica against one replica: the throughput ratio compared a setup with itself
    ("replicas", ["--replicas", "1"], "--replicas (1) must be at least 2: the benchmark compares one replica"),
    # the single replica ran 3 threads against 2 x 1: the throughput ratio compared different core counts
    ("replicas", ["--threads", "3", "--replicas", "2", "--new-tokens", "9000"],
     "--threads (3) must split evenly over --replicas (2): the single replica would run 3 threads against 2 x 1"),
    ("gpu_rank", ["--repeats", "0", "--backend", "cpu"], "--repeats (0) must be at least 1"),
    ("gpu_rank", ["--shapes", "tiny,llama-70b", "--backend", "cpu"],
     "--shapes: unknown ['llama-70b']; known: tiny, smollm2-135m, llama-1b, llama-8b"),
    # a traceback naming neither flag, after the bandwidth pass, a checkpoint written and transformers loaded
    ("gpu_rank", ["--prompt-tokens", "5000", "--shapes", "tiny", "--backend", "cpu", "--accuracy-only", "--budget-s", "1"],
     "--prompt-tokens (5000) plus --new-tokens (128) needs a cache of 8192 positions (the next power of two), "
     "past the 2048 of tiny; lower one of them"),
    # a FileNotFoundError traceback at the end of the first phase
    ("gpu_rank", ["--out", "/proc/no-such-dir/r.json", "--shapes", "tiny", "--backend", "cpu", "--budget-s", "1"],
     "--out (/proc/no-such-dir/r.json) is not a file this run can write"),
    # the driver built its model first (and, with the protocol broken then, waited without end)
    ("tp_scaling", ["--new-tokens", "1009", "--model-dir", "/proc/no-such-model"],
     "--new-tokens (1009) plus the 16-token prompt needs 1025 positions, but the model has 1024; lower --new-tokens "
     "to at most 1008"),
    # generate() refused it in each caller's thread, once Ray and both launchers had started: no report
    ("serving", ["--model-dir", "/proc/self"],  # a config-less folder: the first check names config.json
     "--model-dir (/proc/self) has no config.json"),
    ("prompt_scoring", ["--rounds", "0"], "--rounds (0) must be at least 1"),
    ("prompt_scoring", ["--prompt-tokens", "1"], "--prompt-tokens ('1') must be comma-separated integers of at least 2"),
    ("prompt_scoring", ["--top-n", "21"], "--top-n (21) must be at most 20"),
    ("prompt_scoring", ["--model-dir", "/proc/no-such-model"], "--model-dir (/proc/no-such-model) does not exist"),
    ("prompt_scoring", ["--prompt-tokens", "9000"],  # Launcher refused it once Ray had started
     "--prompt-tokens (9000) plus the one new token is past the model's 8192 positions; lower it to at most 8191"),
    ("replicas", ["--new-tokens", "9000"], "--new-tokens (9000) plus the prompts (at most 16 tokens) is past the "
     "4096-token context the launchers serve; lower --new-tokens to at most 4080"),
    # a bare StopIteration from the variant's child, once the model had loaded
    ("decode_batch", ["--new-tokens", "9000"], "the prompt (128) plus --new-tokens (9000) is 9128: the benchmark's "
     "buckets hold at most 8192 tokens"),
    ("decode_batch", ["--timeout-s", "0"], "--timeout-s (0) must be a finite number of seconds above 0"),
    ("prefix_caching", ["--requests", "1"], "--requests (1) must be at least 2"),
    ("prefix_caching", ["--serve-args", "--tp 1 --no-prefix-caching"], "--serve-args: leave --no-prefix-caching out"),
    ("prefix_caching", ["--base-url", "http://127.0.0.1:9/v1"], "--base-url needs --model"),
    ("prefill_paths", ["--starts", "4000", "--lengths", "200"], "start + length past --seq-len (4096): [(4000, 200)]"),
    ("prefill_paths", ["--batches", "16", "--lengths", "200"], "batch x length past --max-prefill-tokens (2048)"),
    ("prefill_paths", ["--rounds", "0"], "--rounds (0) must be at least 1"),
]


@pytest.mark.parametrize("script, argv, message", REFUSED, ids=[f"{s} {' '.join(a[:2])}" for s, a, _ in REFUSED])
def test_bad_values_are_refused_by_the_parser_naming_them(script, argv, message, monkeypatch, capsys):
    """Counts of 0 and the like ended in Infinity in the JSON, a ZeroDivisionError, an empty median,
    a torch error or a run that waited on nothing, instead of an argument error."""
    module = importlib.import_module(f"benchmarks.{script}")
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    entry = module.parse_args if script == "serving" else module.main  # serving's main starts a server after
    with pytest.raises(SystemExit) as exit_:
        entry()
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, code, message", [
    (["--properties", "5", "--tokens", "2", "--help"], 0, ""),  # each value parsed before --help exits
    (["--properties", "0"], 2, "--properties (0) must be at least 1"),
    (["--tokens", "1"], 2, "--tokens (1) must be at least 2"),
    (["--tokens", "x"], 2, "--tokens must be an integer, not 'x'"),
])
def test_the_large_schema_benchmark_parses_its_counts(argv, code, message, monkeypatch, capsys):
    """Its two count flags took their name and minimum the wrong way round: every value given was
    refused as an "invalid parse value", so only the defaults could run."""
    from benchmarks.large_schema import main

    monkeypatch.setattr(sys, "argv", ["large_schema.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        main(sys.stdout)
    assert exit_.value.code == code
    assert message in capsys.readouterr().err


def test_the_structured_output_benchmarks_p90_is_at_least_its_median(smollm2_tokenizer):
    """Its p90 took the rank rounded down, so with two steps it was the faster one, below the median."""
    from benchmarks.structured_output import mask_step_times

    report = mask_step_times(smollm2_tokenizer, len(smollm2_tokenizer), rows=2, steps=2)
    assert report["p90_ms"] >= report["median_ms"], report


def test_the_quantized_benchmark_measures_tp_1_alone_for_heads_no_second_degree_divides(tmp_path, monkeypatch):
    """A --model-dir of 5 heads (none of 2, 3, 4 divides it) ended the weights section in a bare
    StopIteration. The children that load each shard are this script's own, recorded here."""
    import benchmarks.quantized as quantized
    from tests.model_factory import build_random_model, save_model

    model_dir = save_model(build_random_model("llama", hidden_size=40, num_heads=5, num_kv_heads=5), tmp_path / "m")
    degrees = []

    def child(spec):
        degrees.append(spec["tp"])
        return {"shard_bytes": 100, "added_peak_bytes": 0}
    monkeypatch.setattr(quantized, "_run_child", child)
    assert list(quantized.weights_section({"float32": model_dir})) == ["tp1_rank0"]
    assert degrees == [1]


def test_the_serving_benchmark_needs_a_tokenizer_in_the_model_folder_it_serves(tmp_path, capsys):
    """A folder with config.json and no tokenizer passed, and failed in transformers' AutoTokenizer
    once the server had started."""
    from benchmarks.serving import parse_args

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        parse_args(["--model-dir", str(tmp_path), "--levels", "1"])
    assert f"--model-dir ({tmp_path}) has no tokenizer.json or tokenizer_config.json" in capsys.readouterr().err


def test_startup_names_its_timeout_and_reports_the_runs_it_measured(tmp_path):
    """A command past --timeout was a TimeoutExpired traceback quoting the whole command, and the
    rounds already measured were lost."""
    import json
    import subprocess
    from pathlib import Path

    from benchmarks.startup import run_bounded

    with pytest.raises(RuntimeError, match=r"sleeping in .* did not finish within --timeout 0.5 s; raise --timeout"):
        run_bounded([sys.executable, "-c", "import time; time.sleep(30)"], "sleeping", tmp_path, 0.5)
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "startup.py"), "--commands", "convert",
                           "--timeout", "0.01"], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "startup.py: converting the demo model" in done.stderr, done.stderr[-2000:]
    assert "raise --timeout" in json.loads(done.stdout)["stopped"]


def test_someone_elses_server_takes_prompts_past_the_benchmarks_buckets_and_a_tokenizer_folder(tmp_path):
    """The 8192-token buckets are those of the server and baselines the benchmark starts: with
    --base-url alone the other server's context is the limit, and --model-dir only gives the
    tokenizer (both were refused once the checks came in)."""
    from benchmarks.serving import parse_args

    (tmp_path / "tokenizer.json").write_text("{}")
    args = parse_args(["--base-url", "http://h:1/v1", "--prompt-tokens", "9000", "--levels", "1",
                       "--model-dir", str(tmp_path)])
    assert (args.prompt_tokens, args.model_dir) == (9000, str(tmp_path))
    with pytest.raises(SystemExit):  # with --baselines the benchmark's own buckets apply again
        parse_args(["--base-url", "http://h:1/v1", "--baselines", "--prompt-tokens", "9000", "--levels", "1"])


def test_the_serving_benchmark_without_the_openai_package_is_refused_before_any_server(monkeypatch, capsys):
    """It started `corelaunch serve` (about 90 s) and then failed with an ImportError traceback."""
    import importlib.util

    from benchmarks.serving import parse_args

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openai" else real(name, *a))
    with pytest.raises(SystemExit):
        parse_args(["--levels", "1"])
    assert "pip install openai" in capsys.readouterr().err
    assert parse_args(["--baselines-only"]).baselines_only  # the in-process baselines need no client


def test_startup_comparison_alternates_the_sides_order_by_round():
    """`startup.py --compare` ran this checkout first in every round: an order effect (a warm page
    cache) fell on one side only, while the README says the rounds alternate."""
    from benchmarks.startup import sides_in_round

    sides = {"this": "/a", "compare": "/b"}
    assert [[side for side, _ in sides_in_round(sides, r)] for r in range(3)] == [
        ["this", "compare"], ["compare", "this"], ["this", "compare"]]


# ---- --base-url checked before any work: a server there, and one serving --model -------------------------
@contextlib.contextmanager
def models_server(ids: list[str]):
    """A tiny OpenAI stand-in in this process whose GET /v1/models lists `ids` (and nothing else
    answers): yields its /v1 URL."""
    import json

    from tests.local_http import QuietHandler, serving

    class Models(QuietHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            found = self.path == "/v1/models"
            body = json.dumps({"object": "list", "data": [{"id": i, "object": "model"} for i in ids]}).encode() \
                if found else b""
            self.send_body(200 if found else 404, body)

    with serving(Models) as url:
        yield url


class PastTheCheck(Exception):
    """Raised where a script's work would begin: the --base-url check let the run through."""


def _refused_port_url() -> str:
    from workers.net import free_port

    return f"http://127.0.0.1:{free_port()}/v1"


def _run_main(module, argv: list[str], monkeypatch) -> int | str:
    """The script's main with argv: its exit code, or "past the check" where it reached its work."""
    monkeypatch.setattr(sys, "argv", [f"{module.__name__.rsplit('.', 1)[-1]}.py", *argv])
    try:
        module.main()
    except SystemExit as exit_:
        return exit_.code
    except PastTheCheck:
        return "past the check"
    return "ended"


def _stop_at_work(module, monkeypatch) -> None:
    """Where each script's work over HTTP begins (after a tokenizer's seconds, for the first two)."""
    def stop(*args, **kwargs):
        raise PastTheCheck

    name = module.__name__.rsplit(".", 1)[-1]
    if name == "structured_output":
        monkeypatch.setattr(module, "over_http", stop)
    elif name == "prefix_caching":
        monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", stop)
    else:  # serving: the first thing after its check
        monkeypatch.setattr(module, "_exit_on_termination", stop)


HTTP_SCRIPTS = ["structured_output", "prefix_caching", "serving"]


@pytest.mark.parametrize("script", HTTP_SCRIPTS)
def test_a_base_url_with_no_api_or_another_model_is_refused_before_any_work(script, monkeypatch, capsys):
    """structured_output.py and prefix_caching.py ended in openai.APIConnectionError after about 13 s
    of setup for a refused port or a URL without a scheme (`localhost:8000`); all three, serving.py
    after all its waves, in a NotFoundError per request for a --model the server does not serve."""
    module = importlib.import_module(f"benchmarks.{script}")
    _stop_at_work(module, monkeypatch)
    nowhere = _refused_port_url()
    assert _run_main(module, ["--base-url", nowhere, "--model", "smollm2"], monkeypatch) == 2
    assert f"--base-url {nowhere}: no OpenAI API answers there (" in capsys.readouterr().err
    assert _run_main(module, ["--base-url", "localhost:8000", "--model", "smollm2"], monkeypatch) == 2
    assert "--base-url ('localhost:8000') must be an http(s) URL of a server's API" in capsys.readouterr().err
    with models_server(["smollm2"]) as url:
        assert _run_main(module, ["--base-url", url, "--model", "smollm2-135m"], monkeypatch) == 2
        assert f"--model 'smollm2-135m' is not served at {url}, which serves 'smollm2'" in capsys.readouterr().err
        assert _run_main(module, ["--base-url", url, "--model", "smollm2"], monkeypatch) == "past the check"


@pytest.mark.parametrize("flag, value", [("--serve-args", "--tp 1"), ("--server-timeout", "5")])
def test_prefix_caching_refuses_flags_of_its_own_servers_with_someone_elses(flag, value, monkeypatch, capsys):
    """They were ignored: the other server was measured as if they had been applied."""
    from benchmarks import prefix_caching

    _stop_at_work(prefix_caching, monkeypatch)
    with models_server(["smollm2"]) as url:
        assert _run_main(prefix_caching, ["--base-url", url, "--model", "smollm2", flag, value], monkeypatch) == 2
    assert f"{flag} concern the corelaunch servers this benchmark starts" in capsys.readouterr().err


def test_prefix_caching_asks_the_server_it_started_for_the_model_name(monkeypatch, capsys):
    """The model folder's name was sent whatever --serve-args said: with --served-model-name every
    request drew a 404, once the server had started."""
    import benchmarks.serving_server
    from benchmarks import prefix_caching

    asked = []

    async def measure(base_url, model, api_key, tokenizer, args):
        asked.append(model)
        return {"shared_prefix": {"later_ttft_s_median": 1.0}, "chat_turns": {"later_ttft_s_median": 1.0},
                "burst": {"last_ttft_s": 1.0}}

    with models_server(["custom-name"]) as url:
        @contextlib.contextmanager
        def started(command, timeout_s):  # stands in for `corelaunch serve`, which lists that name
            yield url, command

        monkeypatch.setattr(benchmarks.serving_server, "corelaunch_server", started)
        monkeypatch.setattr(prefix_caching, "measure", measure)
        assert _run_main(prefix_caching, ["--serve-args", "--tp 1 --served-model-name custom-name"],
                         monkeypatch) == "ended"
    assert asked == ["custom-name", "custom-name"]
    assert '"model": "custom-name"' in capsys.readouterr().out


def test_replicas_default_threads_are_the_cores_rounded_down_to_a_multiple_of_the_replicas(monkeypatch, capsys):
    """The default, os.cpu_count(), split 3 cores as 3 threads against 2 x 1."""
    from benchmarks.replicas import threads_in_all

    parser = argparse.ArgumentParser()
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert [threads_in_all(parser, None, replicas) for replicas in (1, 2, 3)] == [3, 2, 3]
    assert threads_in_all(parser, 4, 2) == 4
    monkeypatch.setattr(os, "cpu_count", lambda: 1)  # fewer cores than replicas: refused, as before
    with pytest.raises(SystemExit):
        threads_in_all(parser, None, 2)
    assert "--replicas (2) above --threads (1)" in capsys.readouterr().err
