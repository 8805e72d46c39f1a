"""Benchmark scripts whose sides were measured unlike each other, or whose figures came from the
wrong clock: each case here failed before its fix. Light: no model is served and nothing is timed."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("requests, replicas, rows_each", [(16, 2, 8), (5, 2, 3), (16, 3, 6), (1, 4, 1)])
def test_replicas_gives_each_side_rows_for_its_share_of_the_requests(requests, replicas, rows_each):
    """Both sides ran with the default 8 rows a group: at --requests 16 the one replica decoded two
    batches of 8 in turn while two replicas ran 8 each at once, and the ratio favoured the replicas."""
    from benchmarks.replicas import side_settings

    sides = side_settings("model-dir", requests, replicas, threads=replicas * 2)
    assert sides["one"]["replicas"] == 1 and sides["one"]["max_num_seqs"] == requests
    assert sides["many"]["replicas"] == replicas and sides["many"]["max_num_seqs"] == rows_each
    # the same cores on both sides, split evenly
    assert sides["one"]["cpus_per_rank"] == replicas * sides["many"]["cpus_per_rank"] == replicas * 2
    # everything else alike: the rows, replicas and threads are the only differences
    differ = {"replicas", "cpus_per_rank", "max_num_seqs"}
    assert {k: v for k, v in sides["one"].items() if k not in differ} == \
        {k: v for k, v in sides["many"].items() if k not in differ}


def test_tp_scaling_decode_rate_is_one_calls_last_token_time_minus_its_first():
    from benchmarks.token_clock import decode_rate

    assert decode_rate([10.0, 10.5, 11.0, 11.5], 4) == pytest.approx(3 / 1.5)
    with pytest.raises(ValueError, match="3 clock readings for 4 new tokens"):
        decode_rate([10.0, 10.5, 11.0], 4)


def test_tp_scaling_times_transformers_from_one_generate_call(tmp_path, monkeypatch):
    """The first token's time came from a 1-token generate() and the total from a second call: two
    runs' noise in one rate, which came out negative (-1.3, -7.4, -63.2 tokens/s on a loaded host)."""
    import torch

    from benchmarks.tp_scaling import _hf
    from tests.model_factory import save_random_model
    from tests.test_benchmark_fixes import generate_calls

    model = save_random_model(tmp_path / "model", vocab_size=32000)  # the benchmark's prompt ids fit
    calls = generate_calls(monkeypatch)
    threads = torch.get_num_threads()
    try:
        run, info, _ = _hf(str(model), 3)
        for _ in range(2):
            calls.clear()
            timed = run()
            assert calls == [3]
            assert timed["decode_tokens_per_s"] > 0 and len(timed["token_ids"]) == 3
    finally:
        torch.set_num_threads(threads)  # _hf sets the benchmark's 2 for the whole process


def _longest_shared_start(prompts: list[list[int]]) -> int:
    """The most leading tokens any two of the prompts share (sorted, the closest pairs are neighbours)."""
    ordered = sorted(tuple(p) for p in prompts)
    shared = 0
    for a, b in zip(ordered, ordered[1:]):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shared = max(shared, same)
    return shared


def test_serving_prompts_of_one_run_part_within_their_first_tokens(smollm2_tokenizer):
    """The run's tag came before the index ("Story 876611-12. "): with SmolLM2's tokenizer every prompt of
    a run shared its first 9-10 tokens, where the docstring (and the README) said at most 2 (3)."""
    from benchmarks.serving_client import PromptSource

    source = PromptSource(smollm2_tokenizer, 48)
    prompts = source.take(120)  # a run of serving.py's default levels sends about 110
    assert len({tuple(p) for p in prompts}) == 120 and all(len(p) == 48 for p in prompts)
    assert _longest_shared_start(prompts[:10]) == 0  # different from the first token
    assert _longest_shared_start(prompts[:100]) <= 1
    assert _longest_shared_start(prompts) <= 2


def test_serving_stream_decode_speed_ends_at_the_last_token_not_the_streams_end():
    """It was (tokens - 1) / (e2e_s - ttft_s): e2e_s ends after the usage chunk and [DONE], so a server
    slow to close its streams read as a slower decoder."""
    from benchmarks.serving_stats import RequestRecord, summarize_level

    tokens = [1.0 + 0.1 * i for i in range(5)]  # 5 tokens, 0.1 s apart: 10 tokens/s
    closed_late = RequestRecord(sent_s=0.5, chunk_times_s=tokens, finished_s=tokens[-1] + 0.4, completion_tokens=5)
    summary = summarize_level([closed_late], wall_s=2.0, max_tokens=5)
    assert summary["decode_tokens_per_s_per_stream_p50"] == pytest.approx(10.0)  # was 4 / 0.8 = 5.0
    assert closed_late.decode_tokens_per_s == pytest.approx(10.0)
    # --stream-interval 2: the first token alone, then two a chunk; usage counts the tokens
    gathered = RequestRecord(sent_s=0.0, chunk_times_s=[1.0, 1.2, 1.4], finished_s=2.0, completion_tokens=5)
    assert gathered.decode_tokens_per_s == pytest.approx(4 / 0.4)
    assert RequestRecord(sent_s=0.0, chunk_times_s=[1.0], finished_s=1.5, completion_tokens=1).decode_tokens_per_s is None


def test_decode_batch_variants_stay_apart_whatever_the_shell_exports():
    """traced_attention alone set CORELAUNCH_DECODE_ATTENTION: with 0 exported, packed ran the same code
    as traced_attention and attention_kernel_over_traced compared it with itself."""
    from benchmarks.decode_batch import VARIANTS
    from shardlib.env_settings import KERNEL_SWITCHES, switched_off

    for exported in ("0", "1"):
        shell = {name: exported for name in KERNEL_SWITCHES}
        runs = {v: {name: switched_off(name, shell | settings) for name in KERNEL_SWITCHES}
                for v, settings in VARIANTS.items()}
        assert runs["packed"]["CORELAUNCH_DECODE_ATTENTION"] is False
        assert runs["traced_attention"]["CORELAUNCH_DECODE_ATTENTION"] is True
        assert runs["packed"]["CORELAUNCH_PACKED_WEIGHTS"] is False and runs["kernel"]["CORELAUNCH_PACKED_WEIGHTS"] is True
        assert runs["torch"]["CORELAUNCH_SMALL_LINEAR"] is True and runs["kernel"]["CORELAUNCH_SMALL_LINEAR"] is False
        assert len({tuple(sorted(r.items())) for r in runs.values()}) == len(VARIANTS)


def test_decode_batch_reverses_the_order_of_its_variants_every_other_round():
    """Every round ran the variants in the same order, though the docstring said alternating."""
    from benchmarks.decode_batch import round_order

    runs = [("float32", "packed"), ("float32", "torch"), ("int8", "packed")]
    assert round_order(runs, 0) == runs
    assert round_order(runs, 1) == runs[::-1]
    assert round_order(runs, 2) == runs


def test_startup_comparison_runs_an_even_number_of_rounds(capsys):
    """With the default --rounds 3 and --compare, this checkout ran first in two rounds of three."""
    import argparse

    from benchmarks.startup import checked_rounds, sides_in_round

    parser = argparse.ArgumentParser(prog="startup.py")
    rounds = checked_rounds(parser, None, comparing=True)
    firsts = [sides_in_round({"this": "/a", "compare": "/b"}, r)[0][0] for r in range(rounds)]
    assert firsts.count("this") == firsts.count("compare")
    assert checked_rounds(parser, 3, comparing=False) == 3 and checked_rounds(parser, 2, comparing=True) == 2
    with pytest.raises(SystemExit):
        checked_rounds(parser, 3, comparing=True)
    assert "--rounds (3) must be even with --compare" in capsys.readouterr().err


class _PastTheCheck(Exception):
    """Raised where prefix_caching.py's work begins (its tokenizer's load): the arguments passed."""


def _prefix_caching_exit(argv: list[str], monkeypatch) -> int | str:
    import sys

    from benchmarks import prefix_caching

    def stop(*args, **kwargs):
        raise _PastTheCheck

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", stop)
    monkeypatch.setattr(sys, "argv", ["prefix_caching.py", *argv])
    try:
        prefix_caching.main()
    except SystemExit as exit_:
        return exit_.code
    except _PastTheCheck:
        return "past the check"
    return "ended"


def test_prefix_caching_checks_the_model_dir_it_serves_as_a_whole_model(tmp_path, monkeypatch, capsys):
    """--model-dir was checked as a tokenizer's folder and then passed to `corelaunch serve --model`: a
    folder with a tokenizer and no config.json started the first server, which failed."""
    tokenizer_only = tmp_path / "tokenizer"
    tokenizer_only.mkdir()
    (tokenizer_only / "tokenizer.json").write_text("{}")
    assert _prefix_caching_exit(["--model-dir", str(tokenizer_only)], monkeypatch) == 2
    assert f"--model-dir ({tokenizer_only}) has no config.json" in capsys.readouterr().err
    # a --model of the servers' own: --model-dir only builds the prompts, so a tokenizer is enough
    assert _prefix_caching_exit(["--model-dir", str(tokenizer_only), "--serve-args", "--model elsewhere"],
                                monkeypatch) == "past the check"
    config_only = tmp_path / "config"
    config_only.mkdir()
    (config_only / "config.json").write_text("{}")
    assert _prefix_caching_exit(["--model-dir", str(config_only)], monkeypatch) == 2
    assert f"--model-dir ({config_only}) has no tokenizer.json or tokenizer_config.json" in capsys.readouterr().err
