"""Benchmark inputs that could never work, refused before the expensive start-up (a server's minutes,
a model's build, the ranks' spawn) with a message naming the flag and the fix; a request the server
refuses said in one line; reports that name what ran. Each case failed before its fix."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import sys
from pathlib import Path

import pytest

from tests.local_http import QuietHandler, serving

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_CONFIG = ROOT / "tests/data/configs/smollm2-135m-instruct.json"


class PastTheCheck(Exception):
    """Raised where a script's expensive work would begin: its checks let the run through."""


def stop(*args, **kwargs):
    raise PastTheCheck


def run_main(module, argv: list[str], monkeypatch) -> int | str:
    """The script's main with the real argv: its exit code, "past the check" where it reached its
    work, or "ended"."""
    monkeypatch.setattr(sys, "argv", [f"{module.__name__.rsplit('.', 1)[-1]}.py", *argv])
    try:
        module.main()
    except SystemExit as exit_:
        return exit_.code
    except PastTheCheck:
        return "past the check"
    return "ended"


# ---- prefix_caching.py: the longest request against the servers' context --------------------------------
def _prefix_caching(monkeypatch):
    """The module, with a tripwire where either server would start (minutes of start-up)."""
    import benchmarks.serving_server
    from benchmarks import prefix_caching

    monkeypatch.setattr(benchmarks.serving_server, "corelaunch_server", stop)
    return prefix_caching


def test_prefix_caching_refuses_a_document_past_the_servers_context_before_any_server(monkeypatch, capsys):
    """The reviewer's command: a server started (about 3 minutes), every request drew a 400, and the
    run ended in the openai client's BadRequestError traceback with no report."""
    prefix_caching = _prefix_caching(monkeypatch)
    argv = ["--serve-args", "--tp 1 --max-num-seqs 4 --no-compile", "--prefix-tokens", "4100", "--requests", "2",
            "--turns", "2", "--burst", "2", "--max-tokens", "2"]
    assert run_main(prefix_caching, argv, monkeypatch) == 2
    err = capsys.readouterr().err
    assert ("the shared-prefix and burst prompts (--prefix-tokens 4100 plus --suffix-tokens 32) with --max-tokens 2 "
            "new tokens need 4134 positions, past the 4096 each request to the servers may hold (serve's default "
            "--seq-len: min(the model's 8192 positions, 4096)); lower --prefix-tokens, --suffix-tokens or "
            "--max-tokens, or add --seq-len 4134 to --serve-args") in err
    # a --seq-len in --serve-args is the servers' context: the same run then goes on to start them
    assert run_main(prefix_caching, [*argv, "--serve-args", "--tp 1 --no-compile --seq-len=8192"],
                    monkeypatch) == "past the check"


def test_prefix_caching_counts_the_chat_history_that_grows_each_turn(monkeypatch, capsys):
    """Each turn sends the whole conversation: 40 turns after a 3000-token document pass the
    context though one document and question (3032 tokens) fit."""
    prefix_caching = _prefix_caching(monkeypatch)
    argv = ["--prefix-tokens", "3000", "--turns", "40", "--requests", "2", "--burst", "2"]
    assert run_main(prefix_caching, argv, monkeypatch) == 2
    err = capsys.readouterr().err
    assert "the chat workload's last prompt (about " in err
    assert "--turns 40 questions of --suffix-tokens" in err
    assert "lower --turns, --prefix-tokens, --suffix-tokens or --max-tokens, or add --seq-len" in err
    assert run_main(prefix_caching, argv[:2] + ["--turns", "4"] + argv[4:], monkeypatch) == "past the check"
    # a --chat-template (or another --model) renders the messages to another length: not counted here
    # (the count refused runs each request of which fitted), left to the server's 400
    templated = ["--serve-args", "--tp 1 --no-compile --chat-template '{{ messages[0].content }}'", *argv]
    assert run_main(prefix_caching, templated, monkeypatch) == "past the check"


def test_prefix_caching_says_to_raise_a_seq_len_it_was_given(monkeypatch, capsys):
    """"add --seq-len N to --serve-args" read as a second --seq-len beside the one given."""
    prefix_caching = _prefix_caching(monkeypatch)
    argv = ["--serve-args", "--tp 1 --no-compile --seq-len 1000", "--prefix-tokens", "1024", "--turns", "2"]
    assert run_main(prefix_caching, argv, monkeypatch) == 2
    assert "or raise --seq-len in --serve-args to 1072" in capsys.readouterr().err


def test_prefix_caching_refuses_a_prompt_past_a_compiled_servers_longest_prefill(monkeypatch, capsys):
    prefix_caching = _prefix_caching(monkeypatch)
    argv = ["--serve-args", "--tp 1 --max-context-length 512", "--prefix-tokens", "1024", "--turns", "2"]
    assert run_main(prefix_caching, argv, monkeypatch) == 2
    assert ("(--prefix-tokens 1024 plus --suffix-tokens 32) are 1056 tokens, past --max-context-length (512) in "
            "--serve-args") in capsys.readouterr().err
    # eager servers run prompts at their own lengths: --max-context-length bounds compiled graphs only
    assert run_main(prefix_caching, argv[:1] + ["--tp 1 --max-context-length 512 --no-compile"] + argv[2:],
                    monkeypatch) == "past the check"


CONTEXT_REFUSAL = {"message": "the prompt has 4132 tokens and the context holds 4096, leaving no room for a generated "
                              "token; shorten the prompt", "type": "BadRequestError", "param": "prompt",
                   "code": "context_length_exceeded"}


@contextlib.contextmanager
def refusing_server(refused_path: str, refusal: dict = CONTEXT_REFUSAL):
    """A tiny OpenAI-compatible server in this process: GET /v1/models lists "m"; a POST to
    refused_path draws the 400 a corelaunch server sends for a prompt past its context, any other
    POST streams `max_tokens` one-token chunks and the usage. Yields its /v1 URL."""
    class Handler(QuietHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_body(200, json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode())

        def do_POST(self):  # noqa: N802
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == refused_path:
                self.send_body(400, json.dumps({"error": refusal}).encode())
                return
            chat = self.path.endswith("/chat/completions")
            head = {"id": "x", "created": 0, "model": "m",
                    "object": "chat.completion.chunk" if chat else "text_completion"}
            piece = {"index": 0, "finish_reason": None,
                     **({"delta": {"content": "a"}} if chat else {"text": "a"})}
            events = [{**head, "choices": [piece]} for _ in range(request["max_tokens"])]
            tokens = request["max_tokens"]
            events.append({**head, "choices": [],
                           "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": 1 + tokens}})
            body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            self.send_body(200, body.encode(), "text/event-stream")

    with serving(Handler) as url:
        yield url


@pytest.mark.parametrize("refused_path, workload, advice", [
    ("/v1/completions", "shared-prefix",
     "its prompt is --prefix-tokens (16) plus --suffix-tokens (1) tokens, with --max-tokens (2) new ones: lower them"),
    ("/v1/chat/completions", "chat", "lower --turns (or the others) to fit the server's context"),
])
def test_prefix_caching_says_in_one_line_which_flags_to_lower_when_another_server_refuses(
        refused_path, workload, advice, monkeypatch, capsys):
    """With --base-url the server's context is unknown beforehand: its first 400 was the openai
    client's BadRequestError traceback."""
    from benchmarks import prefix_caching

    argv = ["--model", "m", "--prefix-tokens", "16", "--suffix-tokens", "1", "--requests", "2", "--turns", "2",
            "--burst", "2", "--max-tokens", "2"]
    with refusing_server(refused_path) as url:
        assert run_main(prefix_caching, ["--base-url", url, *argv], monkeypatch) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    [line] = [line for line in err.splitlines() if line.startswith("prefix_caching.py: ")]
    assert line.startswith(f"prefix_caching.py: the server refused a {workload} request (HTTP 400: the prompt has "
                           f"4132 tokens and the context holds 4096, leaving no room for a generated token; shorten "
                           f"the prompt); ")
    assert advice in line


def test_prefix_caching_gives_no_context_advice_for_another_refusal(monkeypatch, capsys):
    """A model without a chat template drew "lower --turns (or the others) to fit the server's
    context"; the server's own message is the way out."""
    from benchmarks import prefix_caching

    refusal = {"message": "model 'm' has no chat template; send a text as prompt instead", "type": "BadRequestError",
               "param": "messages", "code": None}
    argv = ["--model", "m", "--prefix-tokens", "16", "--suffix-tokens", "1", "--requests", "2", "--turns", "2",
            "--burst", "2", "--max-tokens", "2"]
    with refusing_server("/v1/chat/completions", refusal) as url:
        assert run_main(prefix_caching, ["--base-url", url, *argv], monkeypatch) == 2
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("prefix_caching.py: ")]
    assert line == ("prefix_caching.py: the server refused a chat request (HTTP 400: model 'm' has no chat template; "
                    "send a text as prompt instead)")


# ---- fused_projections.py: its token bucket and its per-token time ---------------------------------------
@pytest.mark.parametrize("new_tokens, message", [
    ("1", "--new-tokens (1) must be at least 2"),  # the time "per token" was the prefill's
    ("505", "--new-tokens (505) plus the 8-token prompt is past the random model's 512 positions; lower "
            "--new-tokens to at most 504"),  # refused by the engine once both models were built
])
def test_fused_projections_refuses_new_tokens_it_cannot_time(new_tokens, message, monkeypatch, capsys):
    from benchmarks import fused_projections

    argv = ["--new-tokens", new_tokens, "--hidden", "32", "--layers", "1", "--blocks", "1", "--no-compile"]
    assert run_main(fused_projections, argv, monkeypatch) == 2
    assert message in capsys.readouterr().err


def test_fused_projections_token_bucket_holds_the_prompt_and_the_new_tokens():
    """A fixed bucket of 64 failed --new-tokens past 56 after the models were built, advising a
    --seq-len the script does not have."""
    from benchmarks.fused_projections import token_bucket

    assert token_bucket(48) == 64  # the default run's graphs, as before
    assert token_bucket(56) == 64 and token_bucket(57) == 128 and token_bucket(504) == 512


@pytest.mark.slow
def test_fused_projections_compiles_buckets_for_more_new_tokens(monkeypatch, capsys):
    from benchmarks import fused_projections

    argv = ["--new-tokens", "60", "--hidden", "32", "--layers", "1", "--blocks", "1"]
    assert run_main(fused_projections, argv, monkeypatch) == "ended"
    report = json.loads(capsys.readouterr().out)
    assert set(report["ms_per_token"]) == {"separate_eager", "fused_eager", "separate_compiled", "fused_compiled"}


# ---- sequence_parallel.py / tp_scaling.py: the kept 254M model built whole or not at all ------------------
def _half_built(folder: Path, weights: bytes | None = None) -> Path:
    """What an interrupted save_pretrained leaves: config.json, and at most part of the weights."""
    folder.mkdir(parents=True)
    shutil.copy(SMOLLM2_CONFIG, folder / "config.json")
    if weights is not None:
        (folder / "model.safetensors").write_bytes(weights)
    return folder


@pytest.mark.parametrize("weights, problem", [
    (None, "holds a config.json but no weights"),
    (b"\x40\x00\x00\x00\x00\x00\x00\x00{", "is not a valid safetensors file"),  # cut short while written
])
def test_sequence_parallel_refuses_a_half_built_kept_model_before_the_ranks_start(
        weights, problem, tmp_path, monkeypatch, capsys):
    """save_pretrained writes config.json before the weights, and the kept model was reused whenever
    config.json existed: after one interrupted build every run's ranks failed on the missing weights
    ("the ranks ended without a report")."""
    from benchmarks import sequence_parallel

    monkeypatch.setattr(sequence_parallel.tempfile, "gettempdir", lambda: str(tmp_path))
    kept = _half_built(tmp_path / "corelaunch-bench-254m-194", weights)  # --prompt-len 130, plus 64
    argv = ["--prompt-len", "130", "--rounds", "1", "--no-compile", "--timeout-s", "60"]
    assert run_main(sequence_parallel, argv, monkeypatch) == 2
    err = capsys.readouterr().err
    assert f"the benchmark's kept model is incomplete: {kept}" in err and problem in err
    assert f"remove it (rm -r {kept}) and run again to build it anew, or pass --model-dir" in err


def test_a_build_interrupted_part_way_leaves_nothing_at_the_models_path(tmp_path):
    from benchmarks.tp_scaling import build_in_place, builds_here, saved_model_problem
    from tests.model_factory import save_random_model

    target = tmp_path / "model"

    def interrupted(folder: Path):
        _half_built(folder)  # config.json written, then Ctrl-C before the weights
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_in_place(target, interrupted)
    assert sorted(tmp_path.iterdir()) == [] and builds_here(target)  # the next run builds it anew
    target.mkdir()  # an empty folder (tp_scaling's temporary one) is taken over
    build_in_place(target, save_random_model)
    assert saved_model_problem(target) is None and sorted(tmp_path.iterdir()) == [target]


def test_a_model_another_run_finished_first_is_read_as_theirs_where_rename_replaces_empty_folders_only(tmp_path):
    """rename(2), the fall-back where no rename-without-replacing exists, fails onto a folder another
    run filled meanwhile with ENOTEMPTY, which the losing build raised instead of taking that model."""
    from benchmarks.tp_scaling import _rename_onto_empty

    built, theirs = tmp_path / "built", tmp_path / "model"
    built.mkdir()
    theirs.mkdir()
    (theirs / "config.json").write_text("{}")
    with pytest.raises(FileExistsError):
        _rename_onto_empty(built, theirs)
    (theirs / "config.json").unlink()  # an empty folder is replaced
    _rename_onto_empty(built, theirs)
    assert not built.exists() and theirs.is_dir()


def test_tp_scaling_refuses_a_half_built_model_dir_before_any_variant(tmp_path, monkeypatch, capsys):
    """--model-dir was reused whenever it held a config.json: each variant then failed to load it,
    after the bandwidth pass."""
    from benchmarks import tp_scaling

    monkeypatch.setattr(tp_scaling, "measure_gbps", stop)  # the run's first measurement
    half = _half_built(tmp_path / "model")
    argv = ["--variants", "transformers", "--new-tokens", "2", "--rounds", "1", "--runs", "1", "--model-dir", str(half)]
    assert run_main(tp_scaling, argv, monkeypatch) == 2
    assert f"--model-dir: {half} holds a config.json but no weights; pass a complete model folder" in \
        capsys.readouterr().err


def test_tp_scaling_reports_the_shape_of_the_model_it_ran(tmp_path):
    """A --model-dir's model was reported with the built-in model's shape and 254M parameters."""
    from benchmarks.tp_scaling import model_description
    from shardlib.checkpoint_files import safetensors_header
    from tests.model_factory import save_random_model

    model = save_random_model(tmp_path / "model", hidden_size=64, num_layers=2, vocab_size=1000)
    config = json.loads((model / "config.json").read_text())
    params = sum(math.prod(entry.shape) for entry in safetensors_header(model / "model.safetensors").values())
    description = model_description(str(model))
    assert description["hidden_size"] == 64 and description["num_layers"] == 2 and description["vocab_size"] == 1000
    assert description["num_heads"] == config["num_attention_heads"]
    assert description["params_millions"] == round(params / 1e6, 1)


# ---- tp_scaling.py / decode_batch.py: a variant named twice ---------------------------------------------
def test_tp_scaling_refuses_a_variant_named_twice(tmp_path, monkeypatch, capsys):
    """tp1,tp1 ran tp1 twice a round and pooled both into one median."""
    from benchmarks import tp_scaling
    from tests.model_factory import save_random_model

    monkeypatch.setattr(tp_scaling, "measure_gbps", stop)
    model = save_random_model(tmp_path / "model")
    argv = ["--variants", "tp1,tp2,tp1", "--new-tokens", "2", "--model-dir", str(model)]
    assert run_main(tp_scaling, argv, monkeypatch) == 2
    assert "--variants (tp1,tp2,tp1) names tp1 more than once" in capsys.readouterr().err
    assert run_main(tp_scaling, ["--variants", "tp1,tp2", *argv[2:]], monkeypatch) == "past the check"


def test_decode_batch_refuses_a_variant_named_twice(monkeypatch, capsys):
    import shardlib.demo_model
    from benchmarks import decode_batch

    monkeypatch.setattr(shardlib.demo_model, "ensure_demo_model", stop)  # the run's first work
    assert run_main(decode_batch, ["--variants", "packed,packed"], monkeypatch) == 2
    assert "--variants (packed,packed) names packed more than once" in capsys.readouterr().err
    assert run_main(decode_batch, ["--variants", "packed,kernel"], monkeypatch) == "past the check"


# ---- moe_dense_routing.py: ratios far from 1 -----------------------------------------------------------
def test_moe_dense_routing_keeps_small_ratios_readable():
    """Rounded to 2 decimals, 0.508 ms over 119.6 ms was reported as 0.0."""
    from benchmarks.moe_dense_routing import over_sparse

    assert over_sparse({"dense": 0.508, "sparse": 119.6, "dense_compiled": 0.3}) == {
        "dense_over_sparse": 0.0042, "dense_compiled_over_sparse": 0.0025}
    assert over_sparse({"dense": 2.5, "sparse": 1.0}) == {"dense_over_sparse": 2.5}
