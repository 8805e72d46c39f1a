"""shardlib.evaluation.bench_report: percentiles, sections and throughput on known latencies."""

from __future__ import annotations

import random

import pytest

from shardlib.evaluation.bench_report import FIELDS, RunTiming, build_report, percentile, summarize


def test_percentile_interpolates_linearly_between_ranks():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]  # order does not matter
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile(values, 95) == pytest.approx(4.8)
    assert percentile(values, 99) == pytest.approx(4.96)
    assert percentile(values, 100) == 5.0
    assert percentile([2.5], 99) == 2.5
    assert percentile([1.0, 2.0], 50) == 1.5


def test_percentile_agrees_with_numpy():
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (50, 90, 95, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_percentile_refuses_bad_input():
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="within"):
        percentile([1.0], 101)


def test_summarize_gives_nxd_fields_in_ms_and_throughput_over_total_time():
    section = summarize([0.1, 0.4, 0.2, 0.3], work=40, unit="tokens/s")
    assert set(FIELDS) <= set(section)
    assert section["latency_ms_p50"] == pytest.approx(250.0)
    assert section["latency_ms_p100"] == pytest.approx(400.0)
    assert section["latency_ms_p90"] == pytest.approx(370.0)
    assert section["latency_ms_avg"] == pytest.approx(250.0)
    assert section["throughput"] == pytest.approx(40.0)  # 40 units over 1.0 s in total
    assert section["count"] == 4 and section["throughput_unit"] == "tokens/s"
    with pytest.raises(ValueError, match="no latencies"):
        summarize([], 1)
    with pytest.raises(ValueError, match="finite"):
        summarize([0.1, -0.2], 1)


def test_build_report_defines_each_section_and_its_throughput():
    runs = [RunTiming(e2e_s=1.0, time_to_first_token_s=0.2, decode_step_latencies_s=[0.1, 0.1, 0.2],
                      generated_tokens=8),
            RunTiming(e2e_s=2.0, time_to_first_token_s=0.3, decode_step_latencies_s=[0.3, 0.2, 0.1],
                      generated_tokens=8)]
    report = build_report(runs, batch_size=2, prompt_len=16)
    assert list(report) == ["e2e_model", "context_encoding_model", "token_generation_model"]
    e2e, ctx, tkg = (report[k] for k in report)
    # e2e: generated tokens of all rows and runs over the summed call times
    assert e2e["count"] == 2 and e2e["throughput"] == pytest.approx(16 / 3.0)
    assert e2e["latency_ms_p50"] == pytest.approx(1500.0) and e2e["latency_ms_p100"] == pytest.approx(2000.0)
    # context encoding: prompt tokens x batch x runs over the summed times to first token
    assert ctx["count"] == 2 and ctx["throughput"] == pytest.approx(16 * 2 * 2 / 0.5)
    assert ctx["latency_ms_avg"] == pytest.approx(250.0)
    # token generation: every step of every run; batch tokens per step over the summed step times
    assert tkg["count"] == 6 and tkg["throughput"] == pytest.approx(2 * 6 / 1.0)
    assert tkg["latency_ms_p100"] == pytest.approx(300.0) and tkg["latency_ms_avg"] == pytest.approx(1000 / 6)
    for section in report.values():
        ordered = [section[f"latency_ms_p{p}"] for p in (50, 90, 95, 99, 100)]
        assert ordered == sorted(ordered)


def test_build_report_refuses_empty_measurements():
    with pytest.raises(ValueError, match="--runs"):
        build_report([], batch_size=1, prompt_len=4)
    with pytest.raises(ValueError, match="no decode step of the whole batch was measured; generate more new tokens"):
        build_report([RunTiming(1.0, 0.5, [], 1)], batch_size=1, prompt_len=4)
