"""A Rust panic of llguidance's (PyO3's PanicException, a BaseException that `except Exception` misses)
in any call into a matcher fails its one request, never the serving loop or the driver's check
(guidance-ai/llguidance#149); the ends min_tokens holds back include the grammar tokenizer's own EOS; the
driver's first-step check uses the request's own ending ids and bad words; vLLM's structured_outputs
options are answered by name."""

from __future__ import annotations

import json

import pytest

from shardlib.structured_output import StructuredOutput
from tests.serving_driver import collect, request, run_loops, stop
from tests.test_structured_output import (KINDS, VOCAB, PanicException, fresh_loop,  # noqa: F401 - fixtures
                                          model_dir_with_tokenizer, structured, wide_model)
from workers.structured import grammars
from workers.structured.grammars import check_structured_output
from workers.structured.matchers import GrammarTokenizer, RequestGrammar


class PanickingMatcher:
    """An LLMatcher whose `method` panics from its `at`-th call on (the real one's other methods as they are)."""

    def __init__(self, real, method: str, at: int) -> None:
        self.real, self.method, self.at, self.calls = real, method, at, 0

    def __getattr__(self, name):
        real = getattr(self.real, name)
        if name != self.method:
            return real

        def call(*args):
            self.calls += 1
            if self.calls >= self.at:
                raise PanicException(f"panicked at {name}")
            return real(*args)

        return call


def panic_in(monkeypatch, method: str, at: int) -> None:
    """Every RequestGrammar made from now on wraps its matcher in a PanickingMatcher."""
    real_init = RequestGrammar.__init__

    def init(self, matcher, *args, **kwargs):
        real_init(self, PanickingMatcher(matcher, method, at), *args, **kwargs)

    monkeypatch.setattr(RequestGrammar, "__init__", init)


def serve_one_structured_beside_a_plain_one(model, tokenizer) -> object:
    """The structured request's and the plain one's output; then the same loop serves another request."""
    prompt = tokenizer.encode("JSON please:")
    loop = fresh_loop(model, tokenizer)
    threads = run_loops([loop])
    try:
        loop.submit([structured("s", prompt, KINDS["json"]), request("plain", prompt, 6)])
        out = collect(loop, {"s", "plain"}, timeout_s=30)
        loop.submit([request("after", prompt, 3)])  # the loop serves on
        assert collect(loop, {"after"}, timeout_s=30).finish == {"after": "length"}
        return out
    finally:
        stop([loop], threads)


def error_of_request(out, rid: str) -> str:
    [error] = [e.error for e in out.events if e.request_id == rid and e.finish_reason == "error"]
    return error


@pytest.mark.parametrize("method", ["unsafe_compute_mask_ptr", "is_accepting"])
def test_a_panic_writing_a_mask_fails_its_request_alone(wide_model, smollm2_tokenizer, monkeypatch, method):
    """A review: a panic in the mask's call left _choose (`except Exception`) and stopped the loop,
    failing every request on it."""
    panic_in(monkeypatch, method, at=3)
    out = serve_one_structured_beside_a_plain_one(wide_model, smollm2_tokenizer)
    assert out.finish == {"s": "error", "plain": "length"}
    assert error_of_request(out, "s") == f"its structured output's matcher failed: PanicException: panicked at {method}"


def test_a_panic_building_a_matcher_fails_its_request_alone(wide_model, smollm2_tokenizer, monkeypatch):
    """A review: a build's panic came out of future.result() in _admit_built past `except Exception`."""
    def panics(spec):
        raise PanicException("panicked building the grammar")

    monkeypatch.setattr(grammars, "grammar_text", panics)
    out = serve_one_structured_beside_a_plain_one(wide_model, smollm2_tokenizer)
    assert out.finish == {"s": "error", "plain": "length"} and out.tokens["s"] == []
    assert error_of_request(out, "s") == ("its structured output's matcher failed: PanicException: panicked "
                                          "building the grammar")


@pytest.mark.parametrize("where", ["build", "unsafe_compute_mask_ptr", "consume_token"])
def test_a_panic_in_the_drivers_first_step_is_the_grammars_problem(smollm2_tokenizer, monkeypatch, where):
    """The driver's check (api._check_structured catches ValueError) gets a ValueError naming the panic,
    a 400 for that request, not an escape out of the server's handler; Ctrl-C there is still Ctrl-C."""
    tokenizer = GrammarTokenizer(lambda: smollm2_tokenizer, VOCAB)
    spec = StructuredOutput(regex="[a-z]+")
    if where == "build":
        def panics(spec):
            raise PanicException("panicked building the grammar")

        monkeypatch.setattr(grammars, "grammar_text", panics)
    else:
        panic_in(monkeypatch, where, at=1)
    reason, mask = grammars.first_step(spec, tokenizer)
    assert reason.startswith("its structured output's matcher failed: PanicException: panicked") and mask is None
    if where != "build":  # (a panicking grammar_text fails its compile check first, with its own words)
        with pytest.raises(ValueError, match=r"^structured_output \(regex '\[a-z\]\+'\) cannot be used: its "
                                             r"structured output's matcher failed: PanicException: panicked"):
            check_structured_output(spec, tokenizer=tokenizer)

    def interrupted(spec):
        raise KeyboardInterrupt

    monkeypatch.setattr(grammars, "grammar_text", interrupted)
    with pytest.raises(KeyboardInterrupt):
        grammars.first_step(spec, tokenizer)


# ---- min_tokens and the grammar tokenizer's own EOS ------------------------------------------------
def test_min_tokens_holds_back_the_grammars_eos_under_ignore_eos(wide_model, smollm2_tokenizer):
    """A review: min_tokens held back only the request's stop ids, which under ignore_eos leave EOS
    out, while the mask allows the tokenizer's EOS wherever the grammar accepts: with EOS favoured the
    request ended after 2 tokens of its 6."""
    from shardlib.sampling_params import SamplingParams
    from tests.test_structured_output import EOS, run

    tok = smollm2_tokenizer
    spec = StructuredOutput(regex=r"[a-z]+")
    ignoring = request("ignore_eos", tok.encode("Word:"), 12, stop_token_ids=(),  # ignore_eos: no ending ids
                       sampling=SamplingParams(structured_output=spec, min_tokens=6, logit_bias={EOS: 30.0}))
    out = run(fresh_loop(wide_model, tok), [ignoring])
    tokens = out.tokens["ignore_eos"]
    assert len(tokens) >= 6 and EOS not in tokens[:5], (out.finish, tokens)


def test_held_ends_are_cleared_only_where_the_grammar_can_go_on():
    from tests.test_structured_output import FixedGrammar
    from workers.structured.token_masks import allowed_tokens

    grammars = [FixedGrammar([2, 5], 100, accepting=True), FixedGrammar([2], 100, accepting=True),
                FixedGrammar([2, 5], 100, accepting=True)]
    allowed = allowed_tokens(grammars, 100, [(), (), ()], [(2,), (2,), ()])
    rows = [row.nonzero().flatten().tolist() for row in allowed]
    assert rows == [[5], [2], [2, 5]]  # held back; the only way on, so kept; not held


# ---- the request's own ending ids and bad words, checked before submitting ---------------------------
def test_the_first_step_is_checked_against_the_requests_own_stop_tokens_and_bad_words(model_dir_with_tokenizer):
    """A review: the driver's first-step check compared min_tokens against the model's EOS ids only, not
    the request's stop_token_ids, and left out bad_words' one-token bans: a grammar whose only first
    token was one of them passed, and the leader failed the request at its first step (a 500)."""
    from launcher.api import Launcher
    from shardlib.sampling_params import SamplingParams

    llm = Launcher(model=model_dir_with_tokenizer, tp=1, progress=False, compile=False)
    llm.check_prompts(["x"])  # loads the tokenizer
    a = llm.tokenizer.convert_tokens_to_ids("a")
    only_a = StructuredOutput(regex="a")  # its first step allows the token "a" alone
    llm.check_prompts(["x"], SamplingParams(structured_output=only_a, min_tokens=2))  # the end is not "a": fine
    with pytest.raises(ValueError, match=rf"^min_tokens \(2\) holds back the end, and the structured output "
                                         rf"\(regex 'a'\) allows nothing else first \(the end: its ending ids "
                                         rf"\[.*{a}.*\], stop_token_ids"):
        llm.check_prompts(["x"], SamplingParams(structured_output=only_a, min_tokens=2), stop_token_ids=[a])
    with pytest.raises(ValueError, match=rf"^bad_words ban every token the structured output \(regex 'a'\) allows "
                                         rf"first \(token ids \[.*{a}.*\]\); remove those bad words"):
        llm.check_prompts(["x"], SamplingParams(structured_output=only_a, bad_words=["a"]))
    assert llm._ray is None and llm._pool is None  # refused before anything started


def test_a_row_left_with_nothing_names_every_field_that_removes_tokens():
    import torch

    from workers.structured.token_masks import mask_rows

    with pytest.raises(ValueError, match=r"allowed_token_ids .* bad_words .* stop_token_ids"):
        mask_rows(torch.zeros(1, 8), [0], torch.tensor([[False] * 8]))


# ---- vLLM's structured_outputs options -------------------------------------------------------------
def parsed_completion(**fields):
    from launcher.serving.openai_protocol import CompletionRequest, parse_request

    return parse_request(CompletionRequest, {"model": "m", "prompt": "hi", **fields})


@pytest.mark.parametrize("option, value", [("disable_any_whitespace", False), ("disable_additional_properties", False)])
def test_vllms_structured_output_options_that_ask_for_what_happens_here_are_taken(option, value):
    """A review: each was a bare "unknown parameter". false asks for nothing this server does not do
    (JSON with one space after `:` and `,` is among what vLLM's flexible whitespace allows)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = parsed_completion(structured_outputs={"json": schema, option: value})
    assert json.loads(request.sampling().structured_output.json) == schema


@pytest.mark.parametrize("option, value, words", [
    ("disable_any_whitespace", True, "JSON without any whitespace"),
    ("whitespace_pattern", r"[ ]?", "JSON is generated without free whitespace"),
    ("structural_tag", '{"type": "structural_tag"}', "constrain the whole output with json, regex, choice or grammar"),
    ("disable_additional_properties", True, '"additionalProperties": false; write that into the schema'),
])
def test_vllms_structured_output_options_not_implemented_are_refused_by_name(option, value, words):
    from launcher.serving.openai_protocol import ProtocolError

    with pytest.raises(ProtocolError) as caught:
        parsed_completion(structured_outputs={"json": {"type": "object"}, option: value})
    assert caught.value.param == f"structured_outputs.{option}"
    message = caught.value.body()["error"]["message"]
    assert message.startswith(f"structured_outputs.{option}") and "is not supported here" in message, message
    assert words in message, message


def test_a_grammar_that_can_only_end_still_ends_under_ignore_eos_and_min_tokens():
    """A review of the fix above: EOS held back alone left an accepting grammar that allows only the
    end with just the request's stop ids, which the min_tokens penalties had put at -inf, and the row
    failed ("no token is left") where the request used to end. Held back and let through together."""
    from types import SimpleNamespace

    import torch

    from shardlib.sampling_params import SamplingParams
    from tests.test_structured_output import FixedGrammar
    from workers.serving.token_choice import _grammar_ends_held
    from workers.structured.token_masks import allowed_tokens, mask_rows

    eos, stop, width = 2, 5, 100
    grammar = FixedGrammar([eos], width, accepting=True)
    grammar.ends = (eos,)
    sequence = SimpleNamespace(grammar=grammar, generated=0, request=SimpleNamespace(
        sampling=SamplingParams(min_tokens=3), draws_before=0, stop_token_ids=(stop,)))  # ignore_eos: EOS not a stop id
    allowed = allowed_tokens([grammar], width, [(stop,)], [_grammar_ends_held(sequence)])
    scores = torch.zeros(1, width)
    scores[0, stop] = float("-inf")  # min_tokens' penalty on the request's stop id
    masked = mask_rows(scores, [0], allowed)
    assert masked[0].argmax().item() == eos  # the grammar's only way on: the end, as before the hold-back
