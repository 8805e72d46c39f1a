"""Structured output: the request's shape checks, llguidance's grammar checks, the leader's token
masks, and the serving loop matching JSON schemas, regular expressions, choices and Lark grammars on
a random model with SmolLM2's vocabulary and tokenizer (in-process), then the driver API and the
CLI flags. Over HTTP with the real model: tests/test_openai_server.py."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time

import jsonschema
import numpy as np
import pytest
import torch

from shardlib.model_config import ModelConfig
from shardlib.sampling_params import SamplingParams
from shardlib.structured_output import StructuredOutput
from tests.model_factory import build_random_model, save_model
from tests.serving_driver import collect, request, run_loops, stop
from tests.tp_harness import build_rank_model, hf_state_dict
from workers.collectives import SingleRank
from workers.serving.loop import ServingConfig, ServingLoop
from workers.structured.grammars import check_structured_output, grammar_problem
from workers.structured.matchers import GrammarTokenizer
from workers.structured.token_masks import allowed_tokens, mask_rows

VOCAB = 49152  # SmolLM2's: the random model's logits are as wide as the real tokenizer
EOS = 2
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
KINDS = {
    "json": StructuredOutput(json=SCHEMA),
    "choice": StructuredOutput(choice=["yes", "no", "maybe so"]),
    "regex": StructuredOutput(regex=r"[0-9]{3}-[a-z]{2}"),
    "grammar": StructuredOutput(grammar='start: "(" NUMBER ")"\nNUMBER: /[1-9][0-9]?/'),
}


def matches(kind: str, text: str) -> bool:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "choice":
        return text in KINDS["choice"].choice
    if kind == "regex":
        return re.fullmatch(KINDS["regex"].regex, text) is not None
    return re.fullmatch(r"\([1-9][0-9]?\)", text) is not None


# ---- the request's shape and llguidance's checks ----------------------------------------------
@pytest.mark.parametrize("fields, words", [
    ({}, "names nothing"),
    ({"regex": "a", "choice": ["a"]}, "names regex and choice"),
    ({"json": "{not json"}, "is not valid JSON"),
    ({"json": [1, 2]}, "must be a JSON object"),
    ({"json": {"x": float("nan")}}, "cannot be written as JSON"),
    ({"regex": ""}, "regex='' must be a non-empty string"),
    ({"grammar": 5}, "grammar=5 must be a non-empty string"),
    ({"choice": "yes"}, "must be a non-empty list of strings"),
    ({"choice": []}, "must be a non-empty list of strings"),
    ({"choice": ["a", ""]}, "choice[1]='' must be a non-empty string"),
    ({"json_object": 1}, "json_object=1 must be True or False"),
], ids=["none", "two", "bad-json-text", "schema-not-object", "nan", "empty-regex", "grammar-not-text",
        "choice-string", "choice-empty", "choice-empty-item", "json-object-number"])
def test_a_structured_output_names_exactly_one_well_formed_thing(fields, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        StructuredOutput(**fields)


def test_a_schema_is_kept_as_json_text_in_its_own_order_and_params_stay_hashable():
    spec = StructuredOutput(json={"z": 1, "a": {"é": True}})
    assert spec.json == '{"z": 1, "a": {"é": true}}' and spec.kind == "json"
    assert StructuredOutput(json=spec.json) == spec  # the text form is the same request
    params = SamplingParams(structured_output=StructuredOutput(choice=["a", "b"]))
    assert params.structured_output.choice == ("a", "b") and hash(params) == hash(
        SamplingParams(structured_output=StructuredOutput(choice=("a", "b"))))
    with pytest.raises(ValueError, match=r"structured_output=\{'regex': 'a'\} must be a StructuredOutput"):
        SamplingParams(structured_output={"regex": "a"})


@pytest.mark.parametrize("spec, words", [
    (StructuredOutput(regex="(a"), "unclosed group"),
    (StructuredOutput(json={"type": "nonsense"}), "Invalid type: nonsense"),
    (StructuredOutput(json={"properties": {"a": {"$ref": "#/nowhere"}}}), "'/nowhere' does not exist"),
    (StructuredOutput(grammar="start: undefined_rule"), "unknown name"),
], ids=["regex", "schema-type", "schema-ref", "lark-rule"])
def test_a_grammar_llguidance_cannot_compile_is_refused_with_its_reason(spec, words):
    assert words in grammar_problem(spec)
    with pytest.raises(ValueError, match=re.escape(f"structured_output ({spec.describe()}) cannot be used:")):
        check_structured_output(spec)


def test_grammars_that_compile_have_no_problem():
    for spec in [*KINDS.values(), StructuredOutput(json_object=True)]:
        assert grammar_problem(spec) is None
        check_structured_output(spec)


# ---- the leader's masks ------------------------------------------------------------------------
class FixedGrammar:
    """A RequestGrammar stand-in that allows a fixed set of tokens (the bit layout is llguidance's)."""

    def __init__(self, allowed: list[int], vocab: int, accepting: bool = False) -> None:
        self.allowed, self.vocab_size, self.words, self._accepting = allowed, vocab, (vocab + 31) // 32, accepting

    def write_mask(self, words) -> None:
        for t in self.allowed:
            words[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))

    def accepting(self) -> bool:
        return self._accepting


def test_allowed_tokens_read_llguidances_bits_token_by_token():
    grammars = [FixedGrammar([0, 31, 32, 63, 99], 100), FixedGrammar([5], 100, accepting=True)]
    allowed = allowed_tokens(grammars, 100, [(7,), (7, 8, 500)])
    assert allowed.shape == (2, 100) and allowed.dtype == torch.bool
    assert torch.nonzero(allowed[0]).flatten().tolist() == [0, 31, 32, 63, 99]  # not accepting: no ending id
    assert torch.nonzero(allowed[1]).flatten().tolist() == [5, 7, 8]  # accepting: the row's ending ids too


def test_logits_wider_than_the_tokenizer_never_allow_the_extra_columns():
    allowed = allowed_tokens([FixedGrammar([3, 40], 41)], 64, [()])
    assert torch.nonzero(allowed[0]).flatten().tolist() == [3, 40]


def test_masking_copies_the_scores_and_refuses_a_row_left_with_nothing():
    scores = torch.zeros(3, 8)
    allowed = torch.tensor([[True, False] * 4, [False] * 7 + [True]])
    masked = mask_rows(scores, [0, 2], allowed)
    assert torch.equal(scores, torch.zeros(3, 8))  # the raw logits stay for the log-probabilities
    assert torch.isinf(masked[0, 1::2]).all() and (masked[0, ::2] == 0).all()
    assert (masked[1] == 0).all() and torch.isinf(masked[2, :7]).all() and masked[2, 7] == 0
    dead = torch.tensor([[False] * 8])
    with pytest.raises(ValueError, match="no token is left that continues the structured output"):
        mask_rows(scores, [1], dead)


# ---- the serving loop, on the leader -----------------------------------------------------------
@pytest.fixture(scope="module")
def wide_model():
    hf = build_random_model("llama", seed=3, vocab_size=VOCAB)
    return hf


def fresh_loop(hf, tokenizer, max_num_seqs: int = 4, grammar_tokenizer="default") -> ServingLoop:
    model = build_rank_model(ModelConfig.from_dict(hf.config.to_dict()), hf_state_dict(hf), 0, 1, SingleRank())
    if grammar_tokenizer == "default":
        grammar_tokenizer = GrammarTokenizer(lambda: tokenizer, VOCAB)
    return ServingLoop(model, ServingConfig(max_num_seqs, 64, 256), grammar_tokenizer=grammar_tokenizer)


def run(loop: ServingLoop, requests) -> object:
    threads = run_loops([loop])
    try:
        loop.submit(requests)
        return collect(loop, {r.request_id for r in requests})
    finally:
        stop([loop], threads)


def structured(rid, prompt, spec, max_tokens=40, **sampling):
    return request(rid, prompt, max_tokens, sampling=SamplingParams(structured_output=spec, **sampling),
                   stop_token_ids=(EOS,))


def test_each_kind_is_matched_and_ends_the_request_beside_a_plain_one(wide_model, smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt = tok.encode("Answer:")
    [plain_alone] = run(fresh_loop(wide_model, tok), [request("plain", prompt, 12)]).tokens.values()
    requests = [structured(f"{kind}-{how}", prompt, spec, **params) for kind, spec in KINDS.items()
                for how, params in (("greedy", {}), ("sampled", {"temperature": 1.0, "seed": 11}))]
    out = run(fresh_loop(wide_model, tok), requests[:4] + [request("plain", prompt, 12)])
    out2 = run(fresh_loop(wide_model, tok), requests[4:])
    out.tokens.update(out2.tokens)
    out.finish.update(out2.finish)
    for r in requests:
        kind = r.request_id.split("-")[0]
        text = tok.decode(out.tokens[r.request_id])
        assert out.finish[r.request_id] == "stop" and len(out.tokens[r.request_id]) < 40, (r.request_id, text)
        assert matches(kind, text), (r.request_id, text)
        assert EOS not in out.tokens[r.request_id]  # a whole match that cannot go on ends without one
    assert out.tokens["plain"] == plain_alone  # another row's mask never reaches it


def test_a_schema_with_an_annotation_format_generates_output_valid_by_the_schema_as_sent(wide_model,
                                                                                        smollm2_tokenizer):
    # format "password" (pydantic's SecretStr) is not one llguidance enforces: it refused the schema
    # ("Unknown format: password"); it is left out as the annotation it is (test_unenforced_schema_formats.py)
    schema = {"type": "object", "properties": {"key": {"type": "string", "format": "password", "maxLength": 3},
                                               "ok": {"type": "boolean"}},
              "required": ["key", "ok"], "additionalProperties": False}
    tok = smollm2_tokenizer
    requests = [structured(f"secret-{seed}", tok.encode("Answer:"), StructuredOutput(json=schema), temperature=1.0,
                           seed=seed) for seed in (3, 4)]
    out = run(fresh_loop(wide_model, tok), requests)
    for r in requests:
        text = tok.decode(out.tokens[r.request_id])
        assert out.finish[r.request_id] == "stop", (r.request_id, text)
        jsonschema.validate(json.loads(text), schema)


def test_a_resumed_request_goes_on_matching_from_its_delivered_tokens(wide_model, smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt = tok.encode("JSON please:")
    whole = run(fresh_loop(wide_model, tok), [structured("a", prompt, KINDS["json"])]).tokens["a"]
    k = 4
    resumed = request("a", prompt + whole[:k], 40 - k, draws_before=k, stop_token_ids=(EOS,),
                      sampling=SamplingParams(structured_output=KINDS["json"]))
    out = run(fresh_loop(wide_model, tok), [resumed])
    assert whole[:k] + out.tokens["a"] == whole and out.finish["a"] == "stop"


class PanicException(BaseException):
    """As PyO3 raises a Rust panic of llguidance's: a BaseException, which `except Exception` misses."""


@pytest.mark.parametrize("raised", [RuntimeError, PanicException])
def test_a_matcher_that_raises_fails_its_request_alone(wide_model, smollm2_tokenizer, monkeypatch, raised):
    """A review: only a ValueError of the matcher's was the request's alone; any other error left the
    step, failing the group, whose restart replayed the request until the replica was given up. A
    Rust panic too (a BaseException)."""
    from workers.structured.matchers import RequestGrammar

    real_advance = RequestGrammar.advance
    fed = []

    def advance(self, token):
        fed.append(token)
        if len(fed) == 3:
            raise raised("matcher state corrupted")
        return real_advance(self, token)

    monkeypatch.setattr(RequestGrammar, "advance", advance)
    prompt = smollm2_tokenizer.encode("JSON please:")
    loop = fresh_loop(wide_model, smollm2_tokenizer)
    threads = run_loops([loop])
    try:
        loop.submit([structured("s", prompt, KINDS["json"]), request("plain", prompt, 6)])
        out = collect(loop, {"s", "plain"}, timeout_s=30)
        assert out.finish == {"s": "error", "plain": "length"} and len(out.tokens["s"]) == 2
        [error] = [e.error for e in out.events if e.request_id == "s" and e.finish_reason == "error"]
        assert error == f"its structured output's matcher failed: {raised.__name__}: matcher state corrupted"
        loop.submit([request("after", prompt, 3)])  # the loop serves on
        assert collect(loop, {"after"}, timeout_s=30).finish == {"after": "length"}
    finally:
        stop([loop], threads)


def test_a_panic_while_checking_a_grammar_is_its_problem_and_an_interrupt_is_not(monkeypatch):
    """llguidance's validation panicking (PyO3's PanicException, a BaseException) is the spec's
    problem, named with the library's words, not an escape that fails the server's parse; Ctrl-C
    inside the call is still Ctrl-C."""
    from llguidance import LLMatcher

    from workers.structured import grammars

    def panics(grammar):
        raise PanicException("called `Option::unwrap()` on a `None` value")

    monkeypatch.setattr(LLMatcher, "validate_grammar", staticmethod(panics))
    assert grammar_problem(KINDS["regex"]) == "PanicException: called `Option::unwrap()` on a `None` value"
    with pytest.raises(ValueError, match="PanicException: called `Option::unwrap"):
        check_structured_output(KINDS["regex"])

    def interrupted(grammar):
        raise KeyboardInterrupt

    monkeypatch.setattr(LLMatcher, "validate_grammar", staticmethod(interrupted))
    with pytest.raises(KeyboardInterrupt):
        grammars.grammar_problem(KINDS["regex"])


def test_without_a_grammar_tokenizer_a_structured_request_fails_alone(wide_model, smollm2_tokenizer):
    prompt = smollm2_tokenizer.encode("Hi")
    out = run(fresh_loop(wide_model, smollm2_tokenizer, grammar_tokenizer=None),
              [structured("s", prompt, KINDS["regex"]), request("plain", prompt, 3)])
    assert out.finish == {"s": "error", "plain": "length"} and len(out.tokens["plain"]) == 3
    [error] = [e.error for e in out.events if e.request_id == "s"]
    assert "needs the model's tokenizer" in error


def test_a_tokenizer_that_fails_to_load_is_named_to_each_structured_request(wide_model, smollm2_tokenizer):
    def broken():
        raise OSError("no tokenizer.json in /models/x")
    prompt = smollm2_tokenizer.encode("Hi")
    out = run(fresh_loop(wide_model, smollm2_tokenizer, grammar_tokenizer=GrammarTokenizer(broken, VOCAB)),
              [structured("s", prompt, KINDS["choice"]), request("plain", prompt, 3)])
    assert out.finish == {"s": "error", "plain": "length"}
    [error] = [e.error for e in out.events if e.request_id == "s"]
    assert "loading it for llguidance failed: OSError: no tokenizer.json in /models/x" in error


def test_structured_requests_wait_for_the_tokenizer_while_the_others_run(wide_model, smollm2_tokenizer):
    """The tokenizer is built on a thread at the first structured request; the plain request running
    meanwhile goes on step by step, a waiting one can be cancelled, and the rest start once it is built."""
    release = threading.Event()

    def slow():
        assert release.wait(60)
        return smollm2_tokenizer
    loop = fresh_loop(wide_model, smollm2_tokenizer, grammar_tokenizer=GrammarTokenizer(slow, VOCAB))
    prompt = smollm2_tokenizer.encode("Hi")
    threads = run_loops([loop])
    try:
        loop.submit([request("plain", prompt, 6), structured("s", prompt, KINDS["choice"]),
                     structured("gone", prompt, KINDS["choice"])])
        plain = collect(loop, {"plain"})
        assert plain.finish == {"plain": "length"} and len(plain.tokens["plain"]) == 6
        loop.cancel(["gone"])
        cancelled = collect(loop, {"gone"})
        assert cancelled.finish == {"gone": "abort"} and not cancelled.tokens["gone"]
        release.set()
        out = collect(loop, {"s"})
    finally:
        release.set()
        stop([loop], threads)
    assert out.finish == {"s": "stop"} and smollm2_tokenizer.decode(out.tokens["s"]) in KINDS["choice"].choice


def test_a_matcher_slow_to_build_holds_up_no_other_request(wide_model, smollm2_tokenizer):
    """A grammar llguidance takes a second or more to compile (10,000 required properties: 0.9 s) is
    built off the loop's thread: plain requests and a cheap structured one run to their ends
    meanwhile, a request whose build is still running can be cancelled, and the slow one starts
    once its matcher is built. (Its build is held here on an event, standing in for the compile.)"""
    release, started = threading.Event(), threading.Event()
    loop = fresh_loop(wide_model, smollm2_tokenizer)
    build = loop._grammar

    def slow_for_some(request):
        if request.request_id in ("slow", "gone"):
            started.set()
            assert release.wait(60)
        return build(request)
    loop._grammar = slow_for_some
    prompt = smollm2_tokenizer.encode("Hi")
    threads = run_loops([loop])
    try:
        loop.submit([structured("slow", prompt, KINDS["choice"]), structured("gone", prompt, KINDS["choice"])])
        assert started.wait(30)
        loop.submit([request("plain", prompt, 6), structured("quick", prompt, KINDS["choice"])])
        others = collect(loop, {"plain", "quick"}, timeout_s=30)
        assert others.finish == {"plain": "length", "quick": "stop"} and len(others.tokens["plain"]) == 6
        loop.cancel(["gone"])
        cancelled = collect(loop, {"gone"})
        assert cancelled.finish == {"gone": "abort"} and not cancelled.tokens["gone"]
        release.set()
        out = collect(loop, {"slow"})
    finally:
        release.set()
        stop([loop], threads)
    assert out.finish == {"slow": "stop"} and smollm2_tokenizer.decode(out.tokens["slow"]) in KINDS["choice"].choice


def test_min_tokens_holds_the_end_back_inside_what_the_grammar_allows(wide_model, smollm2_tokenizer):
    """A regex that may end or go on: min_tokens holds EOS back, so it goes on to at least that many."""
    tok = smollm2_tokenizer
    spec = StructuredOutput(regex=r"[a-z]+")
    out = run(fresh_loop(wide_model, tok), [structured("m", tok.encode("Word:"), spec, max_tokens=12, min_tokens=5)])
    assert len(out.tokens["m"]) >= 5
    text = tok.decode([t for t in out.tokens["m"] if t != EOS])
    assert re.fullmatch(r"[a-z]+", text), text


# ---- the driver API ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir_with_tokenizer(tmp_path_factory, wide_model):
    from shardlib.demo_model import ensure_demo_model

    path = save_model(wide_model, tmp_path_factory.mktemp("structured"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_demo_model() / name, path / name)
    return str(path)


def test_the_driver_api_matches_and_refuses_before_submitting(model_dir_with_tokenizer, in_process_cluster):
    from launcher.api import Launcher

    choice = SamplingParams(structured_output=KINDS["choice"])
    with Launcher(model=model_dir_with_tokenizer, tp=1, max_num_seqs=2, progress=False, compile=False) as llm:
        streamed = "".join(d.text for d in llm.stream("Pick:", choice, max_new_tokens=20))
        results = llm.generate(["Pick:", "Number:"], [choice, SamplingParams(structured_output=KINDS["regex"])],
                               max_new_tokens=20)
        with pytest.raises(ValueError, match=r"structured_output \(regex '\(a'\) cannot be used: .*unclosed group"):
            llm.stream("x", SamplingParams(structured_output=StructuredOutput(regex="(a")))
        with pytest.raises(ValueError, match=r"structured_output \(regex '\[\^\\\\s\\\\S\]'\) cannot be used: no output"):
            llm.stream("x", SamplingParams(structured_output=StructuredOutput(regex=r"[^\s\S]")))
        with pytest.raises(ValueError, match="needs batching='continuous'"):
            llm.generate(["x"], choice, batching="static")
        # the request's own limits leave nothing the first step allows (it failed at that step)
        digits, letter = StructuredOutput(regex="[0-9]+"), llm.tokenizer.convert_tokens_to_ids("a")
        with pytest.raises(ValueError, match=rf"^allowed_token_ids \(\[{letter}\]\) hold no token the structured "
                                             rf"output \(regex '\[0-9\]\+'\) allows first"):
            llm.stream("x", SamplingParams(structured_output=digits, allowed_token_ids=[letter]))
        with pytest.raises(ValueError, match=r"^min_tokens \(2\) holds back the end, and the structured output"):
            llm.stream("x", SamplingParams(structured_output=StructuredOutput(regex="(a){0}"), min_tokens=2))
        eos, b = llm.tokenizer.eos_token_id, llm.tokenizer.convert_tokens_to_ids("b")
        with pytest.raises(ValueError, match=r"^min_tokens \(2\) holds back the end, and the structured output "
                                             r"\(regex 'a\*'\) allows nothing else first among allowed_token_ids"):
            llm.stream("x", SamplingParams(structured_output=StructuredOutput(regex="a*"), min_tokens=2,
                                           allowed_token_ids=[eos, b]))  # the grammar's end, and a token it refuses
        one = llm.tokenizer.convert_tokens_to_ids("1")
        allowed = "".join(d.text for d in llm.stream("x", SamplingParams(structured_output=digits, min_tokens=2,
                                                                          allowed_token_ids=[one, letter]), 4))
        assert allowed == "1111"  # one allowed token the step allows is enough; min_tokens with digits to write
        assert llm.load() == {"running": 0, "waiting": 0}  # nothing refused was submitted
    assert streamed in KINDS["choice"].choice
    assert results[0].text in KINDS["choice"].choice and matches("regex", results[1].text)
    assert [r.finish_reason for r in results] == ["stop", "stop"]


def test_asyncio_callers_check_grammars_off_the_event_loop(model_dir_with_tokenizer, in_process_cluster):
    """llguidance compiles a grammar to check it, seconds for a large schema: acheck_structured and
    agenerate make that check on a worker thread, and the stream call after it reads the verdict
    remembered, so the event loop (every other stream the server runs) never waits on a compile.
    The check is slowed here by 1 s for each grammar not yet checked, standing in for the compile,
    and counts the event loop's ticks meanwhile: a loop that waited on it would tick not once (a
    count, not a timed gap, so a loaded machine cannot fail it)."""
    import asyncio

    from launcher.api import STRUCTURES_REMEMBERED, Launcher

    fresh = [StructuredOutput(regex="[0-9]{4}"), StructuredOutput(regex="[a-z]{3}"), StructuredOutput(regex="(a")]
    with Launcher(model=model_dir_with_tokenizer, tp=1, max_num_seqs=2, progress=False, compile=False) as llm:
        check, loop_thread, ticks, ticks_while_checking = llm._check_structured, [], [0], []

        def slow_check(params, batching="continuous"):
            if any(p.structured_output not in llm._structures_checked for p in params):
                ticks_before = ticks[0]
                time.sleep(1.0)
                ticks_while_checking.append(ticks[0] - ticks_before)
                loop_thread.append(threading.current_thread() is threading.main_thread())
            return check(params, batching)
        llm._check_structured = slow_check

        async def main():
            async def tick():
                while True:
                    await asyncio.sleep(0.01)
                    ticks[0] += 1
            ticker = asyncio.create_task(tick())
            try:
                await llm.acheck_structured(SamplingParams(structured_output=fresh[0]))
                deltas = [d.text async for d in llm.astream("Year:", SamplingParams(structured_output=fresh[0]),
                                                            max_new_tokens=8)]
                [word] = await llm.agenerate(["Word:"], (SamplingParams(structured_output=s) for s in fresh[1:2]),
                                             max_new_tokens=8)  # a generator: read once, for the check and the run
                with pytest.raises(ValueError, match=r"structured_output \(regex '\(a'\) cannot be used"):
                    await llm.acheck_structured([SamplingParams(), SamplingParams(structured_output=fresh[2])])
            finally:
                ticker.cancel()
            return "".join(deltas), word
        year, word = asyncio.run(main())
    assert loop_thread == [False, False, False]  # each grammar checked once, never on the loop's thread
    assert all(count > 0 for count in ticks_while_checking), ticks_while_checking  # the loop ran meanwhile
    # a full cache is cleared as a call stores its verdicts: the call still reads its own
    digits, letters = StructuredOutput(regex="[0-9]{2}"), StructuredOutput(regex="[a-c]{2}")
    llm._structures_checked = {StructuredOutput(regex=f"x{i}"): (None, None) for i in range(STRUCTURES_REMEMBERED - 1)}
    llm._check_structured([SamplingParams(structured_output=digits), SamplingParams(structured_output=letters)])
    assert re.fullmatch("[0-9]{4}", year) and re.fullmatch("[a-z]{3}", word.text), (year, word.text)


# ---- the CLI's flags -----------------------------------------------------------------------------
def generate_args(*flags):
    import argparse

    from launcher.cli.structured_flags import add_structured_flags

    parser = argparse.ArgumentParser()
    add_structured_flags(parser)
    return parser.parse_args(list(flags))


def test_the_generate_flags_make_each_kind_and_name_themselves_when_wrong(tmp_path):
    from launcher.cli.structured_flags import structured_output

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    assert structured_output(generate_args("--json-schema", str(schema_file))) == KINDS["json"]
    assert structured_output(generate_args("--json-schema", json.dumps(SCHEMA))) == KINDS["json"]
    assert structured_output(generate_args("--choice", "yes", "--choice", "no")).choice == ("yes", "no")
    assert structured_output(generate_args("--json-object")) == StructuredOutput(json_object=True)
    assert structured_output(generate_args()) is None
    with pytest.raises(ValueError, match=r"^--regex \(regex '\(a'\) cannot be used: .*unclosed group"):
        structured_output(generate_args("--regex", "(a"))
    with pytest.raises(ValueError, match=r"^--json-schema 'missing.json' must be a file holding a JSON schema"):
        structured_output(generate_args("--json-schema", "missing.json"))
    with pytest.raises(ValueError, match=r"^--json-schema: json schema \[1\] must be a JSON object"):
        structured_output(generate_args("--json-schema", "[1]"))
    with pytest.raises(SystemExit):
        generate_args("--regex", "a", "--choice", "b")


# ---- review follow-ups ----------------------------------------------------------------------------
def test_thousands_of_choices_are_one_terminal_not_a_parser_row_each(wide_model, smollm2_tokenizer):
    """llguidance's parser holds at most 2000 items a row: 2000 choices as rules failed at the first
    token (a 500 over HTTP). As one lexer terminal they are matched like any other."""
    tok = smollm2_tokenizer
    many = StructuredOutput(choice=[f"option {i}" for i in range(2500)])
    assert grammar_problem(many) is None
    out = run(fresh_loop(wide_model, tok), [structured("c", tok.encode("Pick:"), many, max_tokens=10)])
    assert out.finish == {"c": "stop"} and tok.decode(out.tokens["c"]) in many.choice


def test_a_pattern_no_text_matches_is_refused_at_its_first_step(wide_model, smollm2_tokenizer):
    """`[^\\s\\S]` compiles, and fails only when the first mask is computed: the driver's check
    computes it (a ValueError before anything runs); the leader, given one anyway, fails the request
    alone with one line, not llguidance's dump of its parser's state."""
    impossible = StructuredOutput(regex=r"[^\s\S]")
    assert grammar_problem(impossible) is None
    grammar_tokenizer = GrammarTokenizer(lambda: smollm2_tokenizer, VOCAB)
    with pytest.raises(ValueError, match=r"cannot be used: no output can match it"):
        check_structured_output(impossible, tokenizer=grammar_tokenizer)
    check_structured_output(KINDS["json"], tokenizer=grammar_tokenizer)  # a fine one passes
    prompt = smollm2_tokenizer.encode("Hi")
    out = run(fresh_loop(wide_model, smollm2_tokenizer), [structured("x", prompt, impossible),
                                                          request("plain", prompt, 3)])
    assert out.finish == {"x": "error", "plain": "length"}
    [error] = [e.error for e in out.events if e.request_id == "x"]
    assert "matcher failed" in error and "<state>" not in error and "\n" not in error, error


def test_a_grammar_that_fails_after_its_first_token_is_refused_before_it_runs(wide_model, smollm2_tokenizer):
    """llguidance compiles these and takes their first step, then cannot go on: an object of 501
    optional properties (its parser's 2,000 items a row, passed after the opening brace) and a
    required property referring back to its own object (50,000 items a step). The driver's check
    follows one path a token further and refuses them, with llguidance's reason; 500 properties,
    and grammars whose lowest first token is the end (`a*`), pass."""
    grammar_tokenizer = GrammarTokenizer(lambda: smollm2_tokenizer, VOCAB)

    def optional(count):
        return StructuredOutput(json={"type": "object", "additionalProperties": False,
                                      "properties": {f"f{i}": {"type": "string"} for i in range(count)}})
    looping = StructuredOutput(json={"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]})
    for spec, reason in ((optional(501), "Current row has 2003 items; max is 2000"), (looping, "Too many items")):
        assert grammar_problem(spec) is None
        with pytest.raises(ValueError, match=rf"cannot be used: its matcher fails after its first token \(.*{reason}"):
            check_structured_output(spec, tokenizer=grammar_tokenizer)
    for spec in (optional(500), StructuredOutput(regex="a*"), StructuredOutput(regex="[0-9]", after_token=7)):
        check_structured_output(spec, tokenizer=grammar_tokenizer)


def test_structured_requests_stop_waiting_for_a_tokenizer_that_never_comes(wide_model, smollm2_tokenizer):
    never = threading.Event()
    loop = fresh_loop(wide_model, smollm2_tokenizer,
                      grammar_tokenizer=GrammarTokenizer(lambda: never.wait(60) and smollm2_tokenizer, VOCAB))
    loop.grammar_wait_s = 0.5
    prompt = smollm2_tokenizer.encode("Hi")
    started = time.monotonic()
    try:
        out = run(loop, [structured("s", prompt, KINDS["choice"]), request("plain", prompt, 3)])
    finally:
        never.set()
    assert out.finish == {"s": "error", "plain": "length"} and time.monotonic() - started < 30
    [error] = [e.error for e in out.events if e.request_id == "s"]
    assert "was not ready after" in error


# ---- a constraint that starts after a token (a thinking model's answer) --------------------------
def test_a_constraint_after_a_token_leaves_the_text_before_it_free(wide_model, smollm2_tokenizer):
    """StructuredOutput.after_token: no mask until that token is generated (words the regex would
    refuse come first), then the rest of the output is the match, which ends the request; a request
    resumed after a group fault with the token among its delivered ones is constrained at once."""
    tok = smollm2_tokenizer
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    words, [after] = tok.encode(" cat dog bird"), tok.encode(" then")
    spec = StructuredOutput(regex="[0-9]{3}", after_token=after)
    prompt = tok.encode("Go:")
    asked = dict(temperature=1.0, seed=2, allowed_token_ids=[*words, *digits, after])
    out = run(fresh_loop(wide_model, tok), [structured("r", prompt, spec, 60, **asked),
                                            structured("plain", prompt, None, 60, **asked)])
    tokens = out.tokens["r"]
    cut = tokens.index(after)
    assert any(t in words for t in tokens[:cut])  # free before it: words the regex refuses
    assert re.fullmatch("[0-9]{3}", tok.decode(tokens[cut + 1:])) and out.finish["r"] == "stop"
    assert out.tokens["plain"][:cut + 1] == tokens[:cut + 1]  # the same draws as no constraint, up to it
    resumed = request("r", prompt + tokens[:cut + 1], 60 - cut - 1, draws_before=cut + 1, stop_token_ids=(EOS,),
                      sampling=SamplingParams(structured_output=spec, **asked))
    again = run(fresh_loop(wide_model, tok), [resumed])
    assert tokens[:cut + 1] + again.tokens["r"] == tokens and again.finish["r"] == "stop"


def test_a_waiting_grammar_is_inactive_until_its_token_and_after_token_is_checked(smollm2_tokenizer):
    from workers.structured.matchers import start_matcher

    grammars = GrammarTokenizer(lambda: smollm2_tokenizer, VOCAB)
    waiting = start_matcher(grammars, StructuredOutput(regex="[0-9]", after_token=7))
    assert not waiting.active and waiting.advance(5) is False and waiting.advance(99) is False  # anything goes
    assert waiting.advance(7) is False and waiting.active  # the token itself is free text too
    assert start_matcher(grammars, StructuredOutput(regex="[0-9]", after_token=7), delivered=[3, 7]).active
    for bad in (-1, "7", True, 1.5):
        with pytest.raises(ValueError, match="after_token=.* must be a token id"):
            StructuredOutput(regex="a", after_token=bad)
    assert len({StructuredOutput(regex="a", after_token=7), StructuredOutput(regex="a")}) == 2  # hashed, part of it


def test_a_schema_nested_past_pythons_recursion_limit_is_refused_as_bad_input():
    """A request body parses a schema nested ~990 deep a few frames shallower than the schema's own
    JSON check reached: json.dumps raised a RecursionError there, which the server answered with a
    500, not a 400 naming the field."""
    import sys

    depth = sys.getrecursionlimit()
    schema = {}
    for _ in range(depth):
        schema = {"a": schema}
    with pytest.raises(ValueError, match="nested too deeply"):
        StructuredOutput(json=schema)
