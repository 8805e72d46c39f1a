"""LaunchConfig values that were accepted and then ignored, capped or never checked (launcher/api.py,
launcher/launch_plan.py). Each is refused (or taken) before Ray starts: Launcher.prepare() plans without it."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from launcher.api import LaunchConfig, Launcher


def test_a_max_context_length_past_the_default_seq_len_is_refused(ray_tripwire):
    """Without seq_len the buckets stopped at the plan's 4096, silently: prompts past it, which
    max_context_length 6000 promised, were refused only at the request."""
    with pytest.raises(ValueError) as refused:
        Launcher(progress=False, max_context_length=6000).prepare()
    assert str(refused.value) == ("max_context_length (6000) exceeds seq_len (4096, the plan's default: "
                                  "min(max_position_embeddings, 4096)); pass seq_len >= 6000 or lower "
                                  "max_context_length")
    taken = Launcher(progress=False, max_context_length=6000, seq_len=6000).prepare()
    assert taken.buckets.context[-1] == 6000
    assert Launcher(progress=False, max_context_length=4096).prepare().buckets.context[-1] == 4096


def test_generate_names_the_flags_for_a_max_context_length_past_the_default_seq_len(capsys, ray_tripwire):
    from launcher.cli import main

    assert main(["generate", "--max-context-length", "6000", "hi"]) == 2
    err = capsys.readouterr().err
    assert ("--max-context-length (6000) exceeds --seq-len (4096, the plan's default: "
            "min(max_position_embeddings, 4096)); pass --seq-len >= 6000 or lower --max-context-length") in err, err


def test_a_presharded_cache_dir_without_the_cache_is_refused(tmp_path):
    """It was read only with presharded_cache=True, and ignored without a word otherwise."""
    with pytest.raises(ValueError) as refused:
        LaunchConfig(presharded_cache_dir="/tmp/x")
    assert str(refused.value) == ("presharded_cache_dir ('/tmp/x') is where presharded_cache writes its copy, and "
                                  "presharded_cache is False; pass presharded_cache=True (--presharded-cache), or "
                                  "drop it")
    assert LaunchConfig(presharded_cache=True, presharded_cache_dir=str(tmp_path)).presharded_cache_dir == str(tmp_path)


@pytest.mark.parametrize("field", ["context_buckets", "token_buckets"])
@pytest.mark.parametrize("given", [[np.int64(128), np.int64(256)], np.array([128, 256]), (np.int32(128), 256)],
                         ids=["list-of-np.int64", "np.array", "tuple-of-np.int32"])
def test_bucket_lists_of_numpy_ints_are_taken(field, given):
    """Refused with "bucket 128 must be a positive integer", a rule the value met."""
    config = LaunchConfig(**{field: given})
    assert getattr(config, field) == (128, 256)
    assert all(type(length) is int for length in getattr(config, field))


@pytest.mark.parametrize("given", [[128.0], [np.float64(128.0)], [True], np.array([[128, 256]])])
def test_bucket_lists_of_other_values_are_still_refused(given):
    with pytest.raises(ValueError, match=r"^context_buckets \(.*\): context-encoding bucket .* must be a positive "
                                         r"integer"):
        LaunchConfig(context_buckets=given)


@pytest.mark.parametrize("field, value, words", [
    ("compile", "false", "compile ('false') must be True or False"),
    ("tp", "two", "tp ('two') must be a positive integer or 'auto'"),
    ("presharded_cache_dir", "/tmp/x", "presharded_cache_dir ('/tmp/x') is where presharded_cache writes its copy"),
])
def test_a_field_set_after_the_config_was_built_is_checked_by_the_launcher(field, value, words, ray_tripwire):
    """Setting a field after construction skipped every check: cfg.compile = "false" was planned."""
    config = LaunchConfig(progress=False)
    setattr(config, field, value)
    with pytest.raises(ValueError) as refused:
        Launcher(config)
    assert words in str(refused.value)


def test_the_launcher_checks_a_copy_and_a_checked_config_comes_back_unchanged(tmp_path):
    """Launcher(config) runs __post_init__ again on a copy: its own output must come back the same
    (prepare()'s dataclasses.replace relies on it too), and the caller's object is not changed."""
    configs = [LaunchConfig(progress=False),
               LaunchConfig(token_buckets=[np.int64(64), 256], context_buckets=np.array([64]), max_batch_size=0,
                            kv_cache_dtype="float8_e4m3", compile=False, dtype="bf16", tp=np.int64(2)),
               LaunchConfig(presharded_cache=True, presharded_cache_dir=str(tmp_path), replicas="auto")]
    for config in configs:
        launcher = Launcher(config)
        assert launcher.config == config and launcher.config is not config
        assert dataclasses.replace(launcher.config) == config


def test_every_thread_waiting_for_the_tokenizer_gets_it(ray_tripwire):
    """The first waiter took the load and cleared it: another (a second check_prompts, or start()'s
    own wait) returned at once without a tokenizer, and its text prompt was refused for "no
    tokenizer files". The load is held back by the lock a tokenizer load in this process holds (a
    Serve replica's, another Launcher's), so that every waiter is waiting when it finishes."""
    import launcher.api as api

    refused: list[BaseException] = []

    def check_a_text_prompt():
        try:
            launcher.check_prompts("hello")
        except BaseException as err:  # noqa: BLE001 - named by the assertion below
            refused.append(err)

    with api._TOKENIZER_LOAD_LOCK:  # the demo model's real load waits for it
        launcher = Launcher(progress=False).prepare()
        load = launcher._tokenizer_load
        waiters = [threading.Thread(target=check_a_text_prompt) for _ in range(2)]
        for waiter in waiters:
            waiter.start()
        time.sleep(0.3)  # both are waiting by now (one returned at once before)
        assert not load.done()
    launcher._await_tokenizer()  # start()'s own wait, a third
    for waiter in waiters:
        waiter.join(120)
    assert refused == [] and launcher.tokenizer is not None
    assert launcher._tokenize("hello")[1] == [launcher.tokenizer.encode("hello")]


def test_cpu_replicas_planned_for_an_instance_are_checked_against_this_host(ray_tripwire, monkeypatch):
    """--instance on the cpu backend checks the layout for that machine, and on a private cluster the
    ranks still run here: the replicas went unchecked (replicas=50 of a trn1.32xlarge plan taken where
    5 fit). Counted as this host counts them without --instance."""
    import ray

    from launcher.cluster import ray_cluster

    # a private cluster whatever this test process met before (another test's Ray session, a
    # recorded `ray start`): only there does this host's RAM bound the replicas
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_cluster, "recorded_cluster", lambda: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    shape = dict(progress=False, max_num_seqs=4, seq_len=4096)
    holds = Launcher(**shape).prepare()._host_holds
    assert holds >= 1
    with pytest.raises(ValueError) as refused:
        Launcher(instance="trn1.32xlarge", replicas=holds + 1, **shape).prepare()
    message = str(refused.value)
    assert message.startswith(f"replicas ({holds + 1}): {holds + 1} TP groups of 1 rank(s) need ") and (
        f"Ask for at most {holds}, or shrink" in message), message
    assert Launcher(instance="trn1.32xlarge", replicas=holds, **shape).prepare()._host_holds == holds


def test_per_request_options_given_to_the_launcher_name_where_they_go(ray_tripwire):
    """Launcher(max_new_tokens=5) ended in LaunchConfig's bare TypeError (an unexpected keyword)."""
    with pytest.raises(ValueError) as refused:
        Launcher(max_new_tokens=5, temperature=0.7, stop=["x"], batching="static", cache_salt="a")
    assert str(refused.value) == (
        "per-request options given to Launcher(...), which takes launch options only; give each to the request: "
        "max_new_tokens: generate() / stream() / agenerate() / astream(); temperature: SamplingParams(temperature=...); "
        "stop: stream() / astream(); batching: generate(); cache_salt: generate() / stream() / agenerate() / astream()")
    with pytest.raises(ValueError, match=r"^per-request option given .*; give it to the request: seed: "
                                         r"SamplingParams\(seed=\.\.\.\)$"):
        Launcher(seed=3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
        Launcher(no_such_option=1)  # any other unknown keyword: Python's own words, which name it


def test_shutdown_takes_a_numpy_grace_as_the_other_numbers_are_taken():
    Launcher(progress=False).shutdown(grace_s=np.float32(1.5))  # refused as "must be a number of seconds"
    with pytest.raises(ValueError, match=r"grace_s \('1'\) must be a number of seconds"):
        Launcher(progress=False).shutdown(grace_s="1")


def test_a_request_while_start_connects_on_another_thread_says_it_is_starting():
    """It said "the launcher is not running: call start()" while start() was connecting to Ray."""
    from launcher.errors import LaunchError

    llm = Launcher(progress=False)
    llm._start_thread = threading.Thread()  # as start() marks itself until its groups are placed
    with pytest.raises(LaunchError, match="the launcher is still starting on another thread .* once start\\(\\) "
                                          "returns"):
        llm.load()
    llm._start_thread = None
    with pytest.raises(LaunchError, match="not running: call start\\(\\)"):
        llm.load()
