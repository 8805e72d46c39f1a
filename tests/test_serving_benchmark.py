"""The serving benchmark's statistics and client loop, without a server: percentiles, the per-level
summary, the expected TTFT, prompt building, and the concurrent client loop against a fake client."""

from __future__ import annotations

import asyncio
import random
import sys
import types
from pathlib import Path

import pytest

from benchmarks.serving_client import PromptSource, build_prompt, run_level
from benchmarks.serving_stats import (RequestRecord, baseline_drift, bracketed_baselines, expected_ttft_s, percentile,
                                      ratio, summarize_level)


def test_percentile_interpolates_like_numpy_linear():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_percentile_agrees_with_numpy_on_random_samples():
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    for _ in range(50):
        values = [rng.random() for _ in range(rng.randint(1, 40))]
        for q in (1, 50, 90, 99):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_refuses_q_out_of_range():
    with pytest.raises(ValueError, match=r"q \(101\)"):
        percentile([1.0], 101)


def record(sent: float, first: float, gap: float, tokens: int, usage: bool = True) -> RequestRecord:
    times = [first + i * gap for i in range(tokens)]
    return RequestRecord(sent_s=sent, chunk_times_s=times, finished_s=times[-1] + 0.001,
                         completion_tokens=tokens if usage else None)


def test_summary_of_a_level():
    records = [record(0.0, 0.5, 0.1, 4), record(0.0, 1.0, 0.1, 4)]
    summary = summarize_level(records, wall_s=2.0, max_tokens=4)
    assert summary["output_tokens"] == 8 and summary["output_tokens_per_s"] == 4.0
    assert summary["ttft_s"] == {"p50": 0.75, "p99": pytest.approx(0.995), "samples": 2}
    assert summary["itl_s"]["samples"] == 6 and summary["e2e_s"]["samples"] == 2 and summary["tokens_per_gap"] == 1.0
    assert summary["itl_s"]["p50"] == pytest.approx(0.1) and summary["itl_s"]["p99"] == pytest.approx(0.1)
    assert summary["e2e_s"]["p50"] == pytest.approx(1.051)
    # first to last token chunk (3 gaps of 0.1 s), not to the end of the stream after them
    assert summary["decode_tokens_per_s_per_stream_p50"] == pytest.approx(3 / 0.3, abs=0.01)
    assert summary["all_got_max_tokens"] and summary["tokens_counted_from"] == "usage"


def test_summary_flags_short_and_failed_requests():
    failed = RequestRecord(sent_s=0.0, error="APIConnectionError: refused")
    summary = summarize_level([record(0.0, 0.5, 0.1, 3), record(0.0, 0.5, 0.1, 4), failed], wall_s=1.0, max_tokens=4)
    assert not summary["all_got_max_tokens"]
    assert summary["errors"] == 1 and summary["output_tokens"] == 7
    assert summary["short_or_failed"] == [{"tokens": 3, "error": None},
                                          {"tokens": 0, "error": "APIConnectionError: refused"}]


def test_without_usage_the_chunks_are_counted():
    summary = summarize_level([record(0.0, 0.5, 0.1, 4, usage=False)], wall_s=1.0, max_tokens=4)
    assert summary["output_tokens"] == 4 and summary["tokens_counted_from"] == "chunks"


def test_expected_ttft_is_the_prefill_plus_two_median_steps():
    assert expected_ttft_s(1.0, [0.1, 0.3, 0.2]) == pytest.approx(1.4)
    with pytest.raises(ValueError, match="decode_step_latencies_s is empty"):
        expected_ttft_s(1.0, [])


def test_ratio_handles_missing_values():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(1.0, 0) is None


def test_bracketed_baselines_average_what_was_measured_again_and_keep_the_rest():
    before = {"prompts": 16,
              "one_at_a_time": {"output_tokens_per_s": 24.0, "decode_tokens_per_s_median": 26.0},
              "static_batch": {"output_tokens_per_s": 150.0, "expected_ttft_s_prefill_plus_2_steps": 2.0,
                               "wall_s": 6.8},
              "continuous_in_process": {"all_at_once": {"output_tokens_per_s": 160.0}}}
    after = {"one_at_a_time": {"decode_tokens_per_s_median": 30.0, "prompts": 4},
             "static_batch": {"output_tokens_per_s": 170.0, "expected_ttft_s_prefill_plus_2_steps": 1.8,
                              "wall_s": 6.0}}
    mean = bracketed_baselines(before, after)
    assert mean["static_batch"] == {"output_tokens_per_s": 160.0, "expected_ttft_s_prefill_plus_2_steps": 1.9,
                                    "wall_s": 6.8}
    assert mean["one_at_a_time"] == {"output_tokens_per_s": 24.0, "decode_tokens_per_s_median": 28.0}
    assert mean["continuous_in_process"] == before["continuous_in_process"] and mean["prompts"] == 16
    assert before["static_batch"]["output_tokens_per_s"] == 150.0  # the measurement itself is not changed
    assert baseline_drift(before, after) == {"static_batch.output_tokens_per_s": 1.1333,
                                             "static_batch.expected_ttft_s_prefill_plus_2_steps": 0.9,
                                             "one_at_a_time.decode_tokens_per_s_median": 1.1538}


# ---- prompts and the client loop -------------------------------------------------------------------
class WordTokenizer:
    """One token id per character: enough to check lengths and distinctness."""

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}


def test_prompts_have_the_exact_length_and_differ_within_their_first_tokens():
    source = PromptSource(WordTokenizer(), 128)
    prompts = source.take(3) + source.take(2)
    assert all(len(p) == 128 for p in prompts)
    assert len({tuple(p[:16]) for p in prompts}) == 5
    # another run's prompts, longer or not, begin otherwise: a server's prefix cache of the first run
    # holds nothing the second can reuse
    longer = PromptSource(WordTokenizer(), 300)
    longer.run = "654321-" if source.run != "654321-" else "123456-"
    assert all(p[:16] != q[:16] for p in prompts for q in longer.take(5))
    with pytest.raises(ValueError, match=r"prompt length \(0\)"):
        build_prompt(WordTokenizer(), 0, 0)


class FakeCompletions:
    """Streams `max_tokens` chunks, then a usage chunk, like an OpenAI-compatible server."""

    def __init__(self):
        self.in_flight = 0
        self.most_in_flight = 0
        self.prompts = []

    async def create(self, *, model, prompt, max_tokens, stream, stream_options, extra_body, **_):
        assert stream and stream_options == {"include_usage": True} and extra_body == {"ignore_eos": True}
        self.prompts.append(prompt)

        async def chunks():
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            for _ in range(max_tokens):
                await asyncio.sleep(0.001)
                yield types.SimpleNamespace(choices=[types.SimpleNamespace(text="x")], usage=None)
            yield types.SimpleNamespace(choices=[], usage=types.SimpleNamespace(completion_tokens=max_tokens))
            self.in_flight -= 1

        return chunks()


def test_run_level_keeps_n_clients_in_flight_and_records_every_request():
    client = types.SimpleNamespace(completions=FakeCompletions())
    prompts = [[i] for i in range(8)]
    records, wall = asyncio.run(run_level(client, "m", prompts, clients=4, max_tokens=5))
    assert len(records) == 8 and wall > 0
    assert client.completions.most_in_flight == 4
    assert sorted(client.completions.prompts) == prompts
    assert all(r.error is None and r.tokens == 5 and len(r.chunk_times_s) == 5 for r in records)
    assert summarize_level(records, wall, 5)["all_got_max_tokens"]


def test_a_failing_request_is_recorded_not_raised():
    class Broken:
        async def create(self, **_):
            raise ConnectionError("refused")

    records, _ = asyncio.run(run_level(types.SimpleNamespace(completions=Broken()), "m", [[1], [2]], 2, 4))
    assert [r.error for r in records] == ["ConnectionError: refused"] * 2


def test_run_level_refuses_prompts_that_do_not_split_over_the_clients():
    with pytest.raises(ValueError, match=r"prompts \(3\) must split evenly over the clients \(2\)"):
        asyncio.run(run_level(None, "m", [[1], [2], [3]], 2, 4))


# ---- the server subprocess -------------------------------------------------------------------------
# The stand-in servers take SIGINT as a real server run from a shell does, even when the suite was
# started with SIGINT ignored (a background job hands that on to its children, and server_process
# would then wait 30 s before its SIGKILL).
DEFAULT_SIGINT = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
HEALTH_SERVER = DEFAULT_SIGINT + """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_server_process_waits_for_health_and_stops_the_server():
    from benchmarks.serving_server import free_port, healthy, server_process

    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    with server_process([sys.executable, "-c", HEALTH_SERVER, str(port)], url, timeout_s=30) as base_url:
        assert base_url == url and healthy(url)
    assert not healthy(url)


def test_a_server_that_exits_early_fails_with_its_output():
    from benchmarks.serving_server import free_port, server_process

    command = [sys.executable, "-c", "import sys; print('no such subcommand: serve'); sys.exit(2)"]
    with pytest.raises(RuntimeError, match=r"exited with code 2 before it was healthy(.|\n)*no such subcommand"):
        with server_process(command, f"http://127.0.0.1:{free_port()}/v1", timeout_s=30):
            pass


def test_a_server_that_never_gets_healthy_times_out_naming_the_flag():
    from benchmarks.serving_server import free_port, server_process

    command = [sys.executable, "-c", DEFAULT_SIGINT + "import time; time.sleep(60)"]
    with pytest.raises(TimeoutError, match="not healthy after 1 s.*--server-timeout"):
        with server_process(command, f"http://127.0.0.1:{free_port()}/v1", timeout_s=1):
            pass


def test_the_server_command_parses_with_corelaunch_serve():
    from benchmarks.serving import parse_args, serve_arguments
    from launcher.cli import build_parser

    args = parse_args(["--levels", "1,16", "--prompt-tokens", "128", "--max-tokens", "64",
                       "--server-arg=--max-queued-requests=64"])
    served = build_parser().parse_args(["serve", *serve_arguments("/models/m", args)])
    assert served.model == "/models/m" and served.tp == "1" and served.max_num_seqs == 16
    assert served.seq_len == 256 and served.warm_up and served.max_queued_requests == 64


def test_cpus_per_rank_reaches_the_server_and_is_refused_for_someone_elses_server(capsys):
    from benchmarks.serving import parse_args, serve_arguments
    from launcher.cli import build_parser

    args = parse_args(["--levels", "1,16", "--cpus-per-rank", "1"])
    served = build_parser().parse_args(["serve", *serve_arguments("/models/m", args)])
    assert served.cpus_per_rank == 1.0
    assert build_parser().parse_args(["serve", *serve_arguments("/models/m", parse_args([]))]).cpus_per_rank is None
    for argv, named in ((["--cpus-per-rank", "1", "--base-url", "http://h:1/v1"], "--base-url"),
                        (["--cpus-per-rank", "0"], "--cpus-per-rank (0) must be a finite number above 0")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert named in capsys.readouterr().err


def test_the_baselines_must_be_a_batch_of_16_when_level_16_is_compared_with_them(capsys):
    """The report sets 16 clients against the static batch of --baseline-prompts: other sizes are refused."""
    from benchmarks.serving import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--baselines", "--baseline-prompts", "8", "--levels", "1,16"])
    assert "--baseline-prompts 8 with level 16" in capsys.readouterr().err
    assert parse_args(["--baselines", "--baseline-prompts", "8", "--levels", "1,4"]).baseline_prompts == 8
    assert parse_args(["--baselines-only", "--baseline-prompts", "8"]).baseline_prompts == 8


def _cpu_s_of(pid: int) -> float:
    """The process's utime + stime from /proc, as process_cpu reads them."""
    from benchmarks.process_cpu import _TICKS, _stat_fields

    _, fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _child_between_snapshots(code: str, burn_s: float = 0.25) -> tuple[int, list[dict], tuple[float, float]]:
    """Runs `code` (which must burn CPU) in a child process and snapshots /proc twice, the second
    time once the child has used `burn_s` CPU seconds since the first, however busy the host is.
    Returns (its pid, cpu_by_process's rows for that stretch, the bounds the child's row must lie
    in: its own CPU read just inside and just outside the two snapshots)."""
    import subprocess
    import time

    from benchmarks.process_cpu import cpu_by_process, snapshot

    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60

        def wait_for(cpu_s: float) -> None:
            while _cpu_s_of(child.pid) < cpu_s:
                assert time.monotonic() < deadline, "the child never burned its CPU"
                time.sleep(0.02)

        wait_for(0.05)  # running, past its start-up
        before_first = _cpu_s_of(child.pid)
        before = snapshot()
        after_first = _cpu_s_of(child.pid)
        wait_for(after_first + burn_s)
        before_second = _cpu_s_of(child.pid)
        after = snapshot()
        after_second = _cpu_s_of(child.pid)
        return child.pid, cpu_by_process(before, after, top=50), (before_second - after_first,
                                                                  after_second - before_first)
    finally:
        child.kill()
        child.wait()


def test_cpu_by_process_finds_a_child_that_burns_cpu_and_its_switches():
    """A child process spinning between two snapshots: it is listed, with its command line and the
    CPU it used in between; processes idle meanwhile are left out."""
    pid, rows, (least, most) = _child_between_snapshots(
        "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < 60: pass")
    mine = [row for row in rows if row["pid"] == pid]
    assert len(mine) == 1 and "while time.perf_counter()" in mine[0]["process"]
    assert least >= 0.249 and least - 0.001 <= mine[0]["cpu_s"] <= most + 0.001 and mine[0]["threads"] >= 1
    assert all(row["cpu_s"] >= 0.01 for row in rows) and rows == sorted(rows, key=lambda row: -row["cpu_s"])


def test_cpu_by_process_keeps_the_time_of_threads_that_ended():
    """A child whose CPU is all spent in short-lived threads, each started and ended between the
    snapshots: its CPU is still counted (the process's own counters keep it)."""
    pid, rows, (least, most) = _child_between_snapshots(
        "import threading, time\n"
        "def burn():\n    t = time.perf_counter()\n    while time.perf_counter() - t < 0.05: pass\n"
        "while True:\n    th = threading.Thread(target=burn); th.start(); th.join()")
    mine = [row for row in rows if row["pid"] == pid]
    assert len(mine) == 1 and least >= 0.249 and least - 0.001 <= mine[0]["cpu_s"] <= most + 0.001


def _fake_process(proc: Path, pid: int, comm: str, command: bytes, ticks: int, started: str = "777") -> None:
    """/proc/PID as the kernel writes it: stat (comm in parentheses, then fields from state on;
    utime and stime are fields 14 and 15, starttime 22), cmdline, and one task's status."""
    entry = proc / str(pid)
    (entry / "task" / str(pid)).mkdir(parents=True)
    after_comm = ["S"] + ["0"] * 10 + [str(ticks), "0"] + ["0"] * 6 + [started] + ["0"] * 30
    (entry / "stat").write_text(f"{pid} ({comm}) " + " ".join(after_comm) + "\n")
    (entry / "cmdline").write_bytes(command)
    (entry / "task" / str(pid) / "status").write_text("voluntary_ctxt_switches:\t3\nnonvoluntary_ctxt_switches:\t5\n")


def test_cpu_by_process_names_a_process_by_its_command_line_or_a_kernel_thread_by_its_comm(tmp_path):
    # A fixed /proc: a kernel worker's comm on a live host changes with the work it does
    # ([kworker/1:1-events], then [kworker/1:1-mm_percpu_wq]) between two reads.
    from benchmarks.process_cpu import _TICKS, snapshot

    _fake_process(tmp_path, 40, "kworker/1:1-events", b"", ticks=_TICKS)
    _fake_process(tmp_path, 41, "python", b"ray::RayRankWorker\0--flag\0", ticks=3 * _TICKS)
    (tmp_path / "self").mkdir()  # not a pid: skipped
    samples = snapshot(tmp_path)
    assert samples[(40, "777")].name == "[kworker/1:1-events]"
    assert samples[(41, "777")].name == "ray::RayRankWorker --flag"
    assert samples[(41, "777")].cpu_s == 3.0 and samples[(41, "777")].switches_by_thread == {41: 5}
    assert len(samples) == 2


def test_cpu_by_process_is_refused_where_there_is_no_proc(monkeypatch, capsys):
    import benchmarks.serving as serving

    monkeypatch.setattr(serving, "Path", lambda *_: types.SimpleNamespace(is_dir=lambda: False))
    with pytest.raises(SystemExit):
        serving.parse_args(["--cpu-by-process"])
    assert "reads /proc" in capsys.readouterr().err


def test_a_closing_chunk_without_text_is_not_a_token():
    """A server that ends its stream with an empty chunk carrying finish_reason, and sends no usage:
    that chunk was counted as a 17th token of 16, and every request listed as short."""
    class Closing(FakeCompletions):
        async def create(self, *, max_tokens, **_):
            async def chunks():
                for _ in range(max_tokens):
                    yield types.SimpleNamespace(choices=[types.SimpleNamespace(text="x", finish_reason=None)],
                                                usage=None)
                yield types.SimpleNamespace(choices=[types.SimpleNamespace(text="", finish_reason="length")],
                                            usage=None)
            return chunks()

    records, wall = asyncio.run(run_level(types.SimpleNamespace(completions=Closing()), "m", [[1], [2]], 2, 16))
    summary = summarize_level(records, wall, 16)
    assert [r.tokens for r in records] == [16, 16] and summary["all_got_max_tokens"] and summary["valid"]
    assert summary["tokens_counted_from"] == "chunks"


def test_ratios_come_from_the_levels_that_ran_and_not_from_failed_ones():
    """--levels 1 lost the lone-stream ratio (ratios needed level 16); a level whose requests failed
    gave ratios of its failures (0.0 when all failed) with nothing to say so."""
    from benchmarks.serving import ratios

    baselines = {"one_at_a_time": {"output_tokens_per_s": 20.0, "decode_tokens_per_s_median": 25.0},
                 "static_batch": {"output_tokens_per_s": 100.0, "expected_ttft_s_prefill_plus_2_steps": 4.0}}
    ok = summarize_level([record(0.0, 0.5, 0.1, 4)], wall_s=1.0, max_tokens=4)
    assert set(ratios({"1": ok}, baselines)) == {"level1_stream_decode_over_single_stream"}
    failed = summarize_level([RequestRecord(sent_s=0.0, error="APIConnectionError: refused")], 1.0, 4)
    assert not failed["valid"] and failed["tokens_counted_from"] == "none"
    got = ratios({"1": ok, "16": failed}, baselines)
    assert got["level16_over_static_batch"] is None and got["level16_over_one_at_a_time"] is None
    assert got["level1_stream_decode_over_single_stream"] is not None


def test_options_for_a_server_of_its_own_are_refused_with_someone_elses(capsys):
    from benchmarks.serving import parse_args

    for extra in (["--baselines", "--baselines-after"], ["--server-arg=--max-num-seqs=4"], ["--server-timeout", "5"]):
        with pytest.raises(SystemExit):
            parse_args(["--base-url", "http://h:1/v1", "--levels", "1", *extra])
        assert "with --base-url the server is someone else's" in capsys.readouterr().err
    assert parse_args(["--levels", "1"]).server_timeout == 900.0


def test_sigterm_runs_the_clean_up_that_stops_the_server():
    """`timeout` or a cancelled job sends SIGTERM: the server the benchmark started (its own
    session) and its Ray were left running, the model loaded."""
    import subprocess

    script = ("import os, signal, time\n"
              "from benchmarks.serving import _exit_on_termination\n"
              "_exit_on_termination()\n"
              "try:\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    time.sleep(30)\n"
              "finally:\n"
              "    print('stopped the server', flush=True)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 128 + 15 and out.stdout.strip() == "stopped the server", out.stderr


def test_a_base_url_that_is_no_url_or_where_nothing_answers_is_refused_before_any_level(capsys, monkeypatch):
    """Every level's requests failed one by one with "Connection error", then a report of failures (exit 1)."""
    import http.server
    import threading

    from benchmarks import serving
    from workers.net import free_port

    with pytest.raises(SystemExit):
        serving.parse_args(["--base-url", "0"])
    assert "--base-url ('0') must be an http(s) URL of a server's API" in capsys.readouterr().err
    nowhere = f"http://127.0.0.1:{free_port()}/v1"
    assert "Connection refused" in server_unreachable(nowhere)
    monkeypatch.setattr(sys, "argv", ["serving.py", "--base-url", nowhere])
    monkeypatch.setattr(serving, "measure_levels", lambda *a: pytest.fail("a level ran"))
    with pytest.raises(SystemExit) as exit_:
        serving.main()
    assert exit_.value.code == 2
    assert f"--base-url {nowhere}: no OpenAI API answers there" in capsys.readouterr().err

    class NoModelsHere(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            keyed = 200 if self.headers.get("Authorization") == "Bearer k" else 401
            self.send_response(404 if self.path != "/v1/models" else keyed)  # a keyed API at /v1 only
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NoModelsHere)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert server_unreachable(base + "/v1", "k") is None
        assert "is /v1 missing?" in server_unreachable(base)  # the slip the last review found
        # every request would fail 401 (the client sent the key "unused"): refused, naming --api-key
        assert "refuses requests without a key (HTTP 401): pass its key with --api-key" in \
            server_unreachable(base + "/v1")
        assert "refuses the key given" in server_unreachable(base + "/v1", "wrong")
        assert serving.parse_args(["--base-url", base + "/v1", "--api-key", "k"]).api_key == "k"
    finally:
        server.shutdown()


def server_unreachable(base_url: str, api_key: str | None = None) -> str | None:
    """Why no OpenAI API answers at base_url (benchmarks.serving_client.served_models), or None."""
    from benchmarks.serving_client import served_models

    return served_models(base_url, api_key)[1]


def test_an_eager_server_is_started_without_the_options_it_refuses():
    """--server-arg=--no-compile could never run: the benchmark always passed --warm-up (and
    --max-context-length), and corelaunch serve exited 2 refusing them beside --no-compile."""
    from benchmarks.serving import parse_args, serve_arguments
    from launcher.api import LaunchConfig
    from launcher.cli import build_parser
    from launcher.cli.options import model_and_placement_options
    from shardlib.demo_model import ensure_demo_model

    model = str(ensure_demo_model())
    args = parse_args(["--levels", "1,4", "--server-arg=--no-compile"])
    served = build_parser().parse_args(["serve", *serve_arguments(model, args)])
    assert not served.compile and not served.warm_up and served.seq_len == 256
    LaunchConfig(**model_and_placement_options(served))  # the server's own checks: no ValueError
    compiled = build_parser().parse_args(["serve", *serve_arguments(model, parse_args(["--levels", "1"]))])
    assert compiled.compile and compiled.warm_up and compiled.max_context_length == 128


def test_a_level_named_twice_is_refused_naming_it(capsys):
    """--levels 4,4 ran level 4 twice and the second overwrote the first in the report."""
    from benchmarks.serving import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--levels", "1,4,16,4"])
    err = capsys.readouterr().err
    assert "--levels (1,4,16,4) names 4 more than once" in err and "give each level once" in err
    assert parse_args(["--levels", "16,1"]).levels == [16, 1]


class FailingFirst(FakeCompletions):
    """A server whose first `failures` requests fail (here: the warm-up wave's)."""

    def __init__(self, failures: int):
        super().__init__()
        self.failures = failures

    async def create(self, **kwargs):
        if self.failures:
            self.failures -= 1
            raise ConnectionError("refused")
        return await super().create(**kwargs)


def test_failed_warm_up_requests_are_reported_and_the_host_load_beside_each_level(capsys):
    """The warm-up wave's results were dropped unread: a warm-up that failed (its graphs unbuilt, the
    measured wave paying for them) left no trace in the report."""
    from benchmarks.serving import measure_level

    args = types.SimpleNamespace(warmup=True, level1_requests=2, requests_per_client=1, max_tokens=3,
                                 cpu_by_process=False)
    client = types.SimpleNamespace(completions=FailingFirst(failures=2))
    level = asyncio.run(measure_level(client, "m", PromptSource(WordTokenizer(), 8), 2, args))
    assert level["warmup_errors"] == 2 and level["valid"] and level["output_tokens"] == 6
    assert "level 2: 2 of 2 warm-up requests failed (first: ConnectionError: refused)" in capsys.readouterr().err
    assert len(level["load_average_before"]) == 3 and len(level["load_average_after"]) == 3
    args.warmup = False
    level = asyncio.run(measure_level(types.SimpleNamespace(completions=FakeCompletions()), "m",
                                      PromptSource(WordTokenizer(), 8), 1, args))
    assert level["warmup_errors"] is None and "warm-up" not in capsys.readouterr().err


def test_a_gap_between_chunks_of_several_tokens_is_readable_per_token():
    """At --stream-interval 4 the inter-token percentiles are gaps between chunks of 4 tokens, and the
    report said nothing of how many tokens a gap spanned, nor from how many samples a p99 came."""
    stream = RequestRecord(sent_s=0.0, chunk_times_s=[0.5, 0.9, 1.3], finished_s=1.31, completion_tokens=8)
    summary = summarize_level([stream], wall_s=1.31, max_tokens=8)
    assert summary["tokens_per_gap"] == 3.5  # 7 tokens after the first, over 2 gaps (1 + 4 + 3)
    assert summary["itl_s"] == {"p50": pytest.approx(0.4), "p99": pytest.approx(0.4), "samples": 2}
    assert summary["ttft_s"]["samples"] == 1
    lone = RequestRecord(sent_s=0.0, chunk_times_s=[0.5], finished_s=0.6, completion_tokens=1)
    assert summarize_level([lone], wall_s=1.0, max_tokens=1)["tokens_per_gap"] is None


def test_the_bracketed_ratio_of_a_figure_measured_once_says_so():
    """ratios_bracketed.level16_over_one_at_a_time compared with a figure measured only before the
    levels: the same as the unbracketed ratio, under a name that said otherwise."""
    from benchmarks.serving import not_bracketed, ratios

    before = {"one_at_a_time": {"output_tokens_per_s": 20.0, "decode_tokens_per_s_median": 25.0},
              "static_batch": {"output_tokens_per_s": 100.0, "expected_ttft_s_prefill_plus_2_steps": 4.0}}
    after = {"one_at_a_time": {"decode_tokens_per_s_median": 35.0},
             "static_batch": {"output_tokens_per_s": 120.0, "expected_ttft_s_prefill_plus_2_steps": 4.0}}
    levels = {"16": summarize_level([record(0.0, 0.5, 0.1, 4)], wall_s=0.1, max_tokens=4)}
    bracketed = ratios(levels, bracketed_baselines(before, after))
    assert bracketed["level16_over_one_at_a_time"] == ratios(levels, before)["level16_over_one_at_a_time"]
    assert list(not_bracketed(bracketed)) == ["level16_over_one_at_a_time"]
    assert "measured once" in not_bracketed(bracketed)["level16_over_one_at_a_time"]
    assert not_bracketed({"level1_stream_decode_over_single_stream": 1.0}) == {}


def test_a_port_that_answers_with_something_other_than_http_is_not_healthy():
    """http.client's BadStatusLine is neither a URLError nor a ConnectionError: healthy() raised it
    out of the wait for the server instead of asking again."""
    import socket
    import threading

    from benchmarks.serving_server import healthy

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer_garbage():
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b"not http at all\r\n\r\n")

    answering = threading.Thread(target=answer_garbage, daemon=True)
    answering.start()
    try:
        assert healthy(f"http://127.0.0.1:{port}/v1") is False
    finally:
        answering.join(5)
        listener.close()
