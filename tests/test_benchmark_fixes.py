"""Benchmark scripts whose reports said something other than their names: each case here failed
before its fix. Light: no real model is loaded and no benchmark is timed."""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_sequence_parallel_stops_as_soon_as_a_rank_has_died(tmp_path):
    """A rank that crashed (here: a model folder with a config and no weights) left the driver
    waiting the whole --timeout-s (1800 s by default), then a bare queue.Empty."""
    shutil.copy(ROOT / "tests/data/configs/smollm2-135m-instruct.json", tmp_path / "config.json")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/sequence_parallel.py"), "--model-dir", str(tmp_path),
                           "--rounds", "1", "--no-compile", "--timeout-s", "40"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    # each ended rank's own exit: 1 from its error, or a signal's (-6: a rank torn down as its peer
    # died); the first to end is reported at once, its peer too if it has ended by then
    assert re.search(r"the ranks ended without a report \(rank [01] exit code -?\d+(, rank 1 exit code -?\d+)?\)",
                     proc.stderr), proc.stderr[-2000:]
    assert time.monotonic() - start < 40


def test_rank_reports_wait_for_every_rank_and_name_the_timeout_flag():
    import multiprocessing

    from benchmarks.allreduce import rank_reports

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    queue.put("rank 0's report")
    alive = ctx.Process(target=time.sleep, args=(30,))
    alive.start()
    try:
        with pytest.raises(RuntimeError, match="no report within --timeout-s 0.5 s"):
            rank_reports(queue, [alive], timeout_s=0.5, count=2)
    finally:
        alive.kill()
        alive.join()


def test_load_memory_reports_the_presharded_load_apart_from_its_first_verifying_load(tmp_path, monkeypatch, capsys):
    """The first load of a pre-sharded file also hashes it (2x the shard read): it was the run
    bytes_read came from (and, with --repeats 1, the time too)."""
    from benchmarks import load_memory
    from tests.model_factory import save_random_model

    model = save_random_model(tmp_path / "model", num_heads=6, num_kv_heads=3, hidden_size=48, num_layers=1)
    verified: set[str] = set()

    def fake_child(spec: dict) -> dict:  # what a fresh process measures, as the sha256 marker makes it
        shard = 1000
        first = spec["source"] == "presharded" and spec["presharded_dir"] not in verified
        if spec["source"] == "presharded":
            verified.add(spec["presharded_dir"])
        return {"added_peak_bytes": shard, "load_time_s": 2.0 if first else 1.0,
                "bytes_read": 2 * shard if first else shard, "shard_bytes": shard}

    monkeypatch.setattr(load_memory, "_run_child", fake_child)
    report = load_memory.main(["--repeats", "1", "--model-dir", str(model)])
    presharded = [r for r in report["results"] if r["source"] == "presharded"]
    assert presharded and all(r["bytes_read_over_shard"] == 1.0 and r["load_time_s_min"] == 1.0 for r in presharded)
    assert all(r["verifying_load_bytes_read_over_shard"] == 2.0 for r in presharded)
    assert all("verifying_load_bytes_read" not in r for r in report["results"] if r["source"] != "presharded")
    json.loads(capsys.readouterr().out)


def test_tp_scaling_compares_the_tokens_of_every_variant_that_ran():
    """Without tp1 among --variants, tokens_identical was {}: nothing compared."""
    from benchmarks.tp_scaling import compare_tokens

    ran = {"tp2": [1, 2, 3], "tp2_gloo": [1, 2, 3], "transformers": [1, 2, 4]}
    assert compare_tokens(ran) == {"tokens_reference": "tp2",
                                   "tokens_identical": {"tp2_gloo_vs_tp2": True, "transformers_vs_tp2": False}}
    # tp1, when it ran, stays the reference (the keys the reports have always had)
    assert compare_tokens({"tp2": [1], "tp1": [1]}) == {"tokens_reference": "tp1",
                                                         "tokens_identical": {"tp2_vs_tp1": True}}


def test_tp_scaling_reads_each_variants_replies_from_its_own_process(tmp_path):
    """The variant's process wrote its replies to stderr (run_reporting made sys.stdout stderr for
    the whole process, the --serve child included) and the driver waited for them without end."""
    from tests.model_factory import save_random_model

    model = save_random_model(tmp_path / "model", vocab_size=32000)  # the benchmark's prompt ids fit
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tp_scaling.py"), "--variants", "transformers",
                           "--new-tokens", "2", "--rounds", "1", "--runs", "1", "--model-dir", str(model)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["results"]["transformers"]["all_runs"] and report["tokens_reference"] == "transformers"
    # the model it ran, not the built-in one's shape (hidden 1024, 254M parameters)
    assert report["model"]["hidden_size"] == 64 and report["model"]["vocab_size"] == 32000


def test_tokenizer_lock_reports_a_run_whose_bulk_call_ended_before_any_wait(monkeypatch):
    """One prompt is tokenized within the waiter's first 50 ms sleep: no wait was recorded and the
    summary ended in KeyError: 'wait_ms_mean'. And bulk_s, timed from the main thread, included that
    sleep: any call under 50 ms reported 0.05 s. The waiter's sleeps are made 10x longer here, so a
    bulk_s that holds one is far above the one-prompt call's own time."""
    import io
    import types

    from benchmarks import tokenizer_lock

    monkeypatch.setattr(tokenizer_lock, "time", types.SimpleNamespace(
        perf_counter=time.perf_counter, sleep=lambda seconds: time.sleep(10 * seconds)))
    monkeypatch.setattr(sys, "argv", ["tokenizer_lock.py", "--prompts", "1", "--rounds", "1"])
    out = io.StringIO()
    tokenizer_lock.main(out)
    report = json.loads(out.getvalue())
    assert report["median"]["handover_with_waiter"]["waits"] == 0
    assert report["median"]["handover_with_waiter"]["wait_ms_mean"] is None
    assert report["ratios"]["wait_mean_handover_over_plain"] is None and "raise --prompts" in report["note"]
    assert report["ratios"]["bulk_alone_handover_over_plain"] > 0
    for run in report["median"].values():  # one prompt: milliseconds, not the waiter's 0.5 s sleep
        assert 0 < run["bulk_s"] < 0.25, report
    assert tokenizer_lock.median_of([None, 2.0, 4.0]) == 3.0 and tokenizer_lock.median_of([None]) is None


def test_decode_batch_compares_the_first_tokens_at_every_batch_size():
    """Only the first batch size's tokens were compared across variants."""
    from benchmarks.decode_batch import first_tokens_equal

    same_at_1 = {"packed": {1: [5, 6], 2: [5, 6]}, "torch": {1: [5, 6], 2: [5, 7]}}
    assert first_tokens_equal(same_at_1) == {1: True, 2: False}


def test_decode_batch_reuses_only_a_complete_int8_copy(tmp_path, monkeypatch):
    """A folder at the int8 copy's path was reused whatever it held (an empty one, a partial one)."""
    from benchmarks import decode_batch

    monkeypatch.setattr(decode_batch.tempfile, "gettempdir", lambda: str(tmp_path))
    copy = tmp_path / "corelaunch-bench-smollm2-int8"
    copy.mkdir()
    with pytest.raises(RuntimeError, match=f"{copy} .*not a complete int8 copy.*remove it"):
        decode_batch.int8_copy("unused")
    (copy / "model.safetensors").write_bytes(b"")
    (copy / "config.json").write_text(json.dumps({"quantization_config": {"format": "int8"}}))
    assert decode_batch.int8_copy("unused") == str(copy)


def test_allreduce_reports_gloo_ring_only_for_the_all_reduce():
    """gloo_ring's all-gather is gloo's code: it was timed and reported as if it were another way."""
    from benchmarks.allreduce import _timed_variants

    names = ["gloo", "shm", "gloo_ring", "shm_busy_wait"]
    assert _timed_variants("all_reduce", names) == names
    assert _timed_variants("all_gather_last_dim", names) == ["gloo", "shm", "shm_busy_wait"]


def test_expected_ttft_uses_the_same_median_step_as_the_report():
    """With an even number of steps it took the upper middle one, not statistics.median."""
    from benchmarks.serving_stats import expected_ttft_s

    steps = [0.1, 0.2, 0.3, 0.4]
    assert expected_ttft_s(1.0, steps) == pytest.approx(1.0 + 2 * statistics.median(steps))


class _StandInReplicas:
    """Stands in for the N-replica Launcher in measure_recovery's bookkeeping (not the engine): replica 0
    is busy at once and serving again after one restart, its "rank" a sleeping child that the
    benchmark's SIGKILL really ends; prompt "p3" fails, "p2" waits until released."""

    def __init__(self, rank_pid: int):
        import threading

        self.rank_pid = rank_pid
        self.released = threading.Event()

    def replica_status(self):
        return [{"busy": True, "workers": [{"pid": self.rank_pid}], "restarts": 1, "state": "serving",
                 "last_recovery_s": 1.0, "load_source": "presharded cache"}]

    def generate(self, prompts, max_new_tokens, ignore_eos):
        import types

        if prompts[0] == "p3":
            raise RuntimeError("request lost in the restart")
        if prompts[0] == "p2":
            self.released.wait(30)
        return [types.SimpleNamespace(token_ids=[1, 2], attempts=1)]


def test_replicas_recovery_counts_a_failed_request_as_not_equal():
    """A request that raised never reached the answers, and all_answers_equal_fault_free, checking only
    the answers present, said True."""
    from benchmarks.replicas import measure_recovery

    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    launcher = _StandInReplicas(rank.pid)
    launcher.released.set()
    try:
        report = measure_recovery(launcher, [f"p{i}" for i in range(4)], 2, [[1, 2]] * 4)
        assert rank.wait(5) == -9  # the stand-in rank was SIGKILLed, as a real one is
    finally:
        rank.kill()
        rank.wait()
    assert report["all_answers_equal_fault_free"] is False
    assert report["requests_failed"] == 1
    assert report["request_errors"] == {"3": "RuntimeError: request lost in the restart"}
    assert report["requests_unfinished"] == []


def test_replicas_recovery_reports_a_request_that_never_returned_instead_of_waiting_for_it():
    """The joins had no timeout: one request that never returned hung the run with no report."""
    from benchmarks.replicas import measure_recovery

    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    launcher = _StandInReplicas(rank.pid)
    try:
        start = time.monotonic()
        report = measure_recovery(launcher, ["p0", "p1", "p2"], 2, [[1, 2]] * 3, join_timeout_s=1.0)
        assert time.monotonic() - start < 10
    finally:
        launcher.released.set()
        rank.kill()
        rank.wait()
    assert report["requests_unfinished"] == [2] and report["join_timeout_s"] == 1.0
    assert report["all_answers_equal_fault_free"] is False and report["requests_failed"] == 0


def test_replicas_recovery_with_every_answer_equal_says_so():
    from benchmarks.replicas import measure_recovery

    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    launcher = _StandInReplicas(rank.pid)
    launcher.released.set()
    try:
        report = measure_recovery(launcher, ["p0", "p1", "p2"], 2, [[1, 2]] * 3, join_timeout_s=5.0)
    finally:
        rank.kill()
        rank.wait()
    assert report["all_answers_equal_fault_free"] is True
    assert report["requests_failed"] == 0 and report["requests_unfinished"] == [] and report["request_errors"] == {}


def generate_calls(monkeypatch) -> list:
    """Each transformers generate() call's max_new_tokens from now on (the real generate() runs)."""
    import transformers

    calls = []
    generate = transformers.GenerationMixin.generate

    def counted(self, *args, **kwargs):
        calls.append(kwargs.get("max_new_tokens"))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(transformers.GenerationMixin, "generate", counted)
    return calls


def test_decode_times_transformers_from_one_generate_call(monkeypatch):
    """TTFT came from a 1-token generate() and the total from a second one: two runs' noise in one
    rate, which at a few new tokens came out negative. Now one call, timed at each chosen token."""
    import torch
    from transformers import AutoTokenizer

    from benchmarks.decode import hf_runner, prompt_ids
    from shardlib.demo_model import ensure_demo_model

    calls = generate_calls(monkeypatch)
    torch.set_num_threads(1)
    model = ensure_demo_model()
    run = hf_runner(model, prompt_ids(AutoTokenizer.from_pretrained(model), 16), 3)
    for _ in range(2):
        calls.clear()
        timed = run()
        assert calls == [3]
        assert timed["decode_tokens_per_s"] > 0
        assert 0 < timed["time_to_first_token_s"] < timed["e2e_s"]


def test_decode_batch_stops_a_variant_that_runs_past_its_timeout(tmp_path, monkeypatch):
    """subprocess.run had no timeout: a variant's child that hung held the whole run, without end. The
    child here hangs for real at start-up (a sitecustomize that sleeps, on its PYTHONPATH)."""
    import types

    from benchmarks.decode_batch import run_variant

    (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(40)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    args = types.SimpleNamespace(batches=[1], new_tokens=2, timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"packed ran past --timeout-s \(1 s\) and was stopped: raise --timeout-s"):
        run_variant("packed", "/proc/no-such-model", args)
    assert time.monotonic() - start < 20
