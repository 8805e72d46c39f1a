"""vLLM's truncate_prompt_tokens on /v1/completions and /v1/chat/completions: the prompt cut to its last
k tokens (-1: the context's length) before its length is checked. The request bodies here; over HTTP
in tests/test_openai_server.py (test_truncate_prompt_tokens_keeps_the_prompts_last_tokens)."""

from __future__ import annotations

import pytest

from launcher.serving.openai_protocol import ChatCompletionRequest, CompletionRequest, ProtocolError, parse_request

BASES = {"completions": (CompletionRequest, {"model": "m", "prompt": "hi"}),
         "chat": (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}]})}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_an_integer_of_at_least_one_or_minus_one_is_taken(endpoint):
    model, base = BASES[endpoint]
    for value in (1, 5, 100_000, -1):
        assert parse_request(model, {**base, "truncate_prompt_tokens": value}).truncate_prompt_tokens == value
    assert parse_request(model, base).truncate_prompt_tokens is None
    assert parse_request(model, {**base, "truncate_prompt_tokens": None}).truncate_prompt_tokens is None


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("bad, shown", [(0, "0"), (-2, "-2"), (-100, "-100"), (1.5, "1.5"), (2.0, "2.0"),
                                        ("3", "'3'"), (True, "true"), ([4], "[4]")],
                         ids=["zero", "minus-two", "minus-hundred", "fraction", "float", "string", "bool", "list"])
def test_anything_else_is_a_400_naming_the_field(endpoint, bad, shown):
    model, base = BASES[endpoint]
    with pytest.raises(ProtocolError) as caught:
        parse_request(model, {**base, "truncate_prompt_tokens": bad})
    err = caught.value
    assert err.status == 400 and err.param == "truncate_prompt_tokens"
    assert err.body()["error"]["param"] == "truncate_prompt_tokens"
    assert err.message.startswith(f"truncate_prompt_tokens ({shown}) must be an integer >= 1, or -1"), err.message


def test_the_prompt_keeps_its_last_tokens_and_a_short_one_is_left_whole():
    prompt = list(range(10, 20))
    asked = {k: parse_request(CompletionRequest, {"model": "m", "prompt": prompt, "truncate_prompt_tokens": k})
             for k in (3, 10, 12, -1)}
    assert asked[3].truncated(prompt, 64) == [17, 18, 19]
    assert asked[10].truncated(prompt, 64) == prompt and asked[12].truncated(prompt, 64) == prompt
    assert asked[-1].truncated(prompt, 64) == prompt  # -1: the context's length, 64
    assert asked[-1].truncated(prompt, 4) == [16, 17, 18, 19]
    assert parse_request(CompletionRequest, {"model": "m", "prompt": prompt}).truncated(prompt, 4) == prompt


def test_more_tokens_than_the_context_holds_is_refused_whatever_the_prompt():
    """vLLM refuses a truncation past max_model_len too, even for a prompt shorter than it."""
    req = parse_request(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                "truncate_prompt_tokens": 65})
    with pytest.raises(ProtocolError) as caught:
        req.truncated([1, 2, 3], 64)
    assert caught.value.param == "truncate_prompt_tokens" and caught.value.status == 400
    assert caught.value.message == ("truncate_prompt_tokens (65) is more than the context holds (64 tokens); ask for "
                                    "at most 64, or -1 for the context's length")


def test_a_text_prompt_keeps_the_special_tokens_its_tokenizer_adds_as_vllms_truncation_does(smollm2_tokenizer):
    """vLLM truncates a text prompt inside the tokenizer (from the left), which adds its BOS (and EOS)
    after cutting: here a copy of SmolLM2's tokenizer that writes <|endoftext|> around a text, and the
    server's cut equals that tokenizer's own left truncation; a token-id prompt is cut as sent (review
    of da1fa69: the BOS was cut off)."""
    import copy

    from tokenizers import processors

    from tests.test_tokenize_routes import replica

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    marker = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A <|endoftext|>", special_tokens=[("<|endoftext|>", marker)])
    server = replica(tokenizer, context=64)
    text = " one two three four five six seven eight nine ten"
    ids = tokenizer(text)["input_ids"]
    tokenizer.truncation_side = "left"
    for k in (3, 5, 12):
        req = parse_request(CompletionRequest, {"model": "m", "prompt": text, "truncate_prompt_tokens": k})
        expected = tokenizer(text, truncation=True, max_length=k)["input_ids"]
        assert server._truncated(req, ids, text=True) == expected and expected[0] == expected[-1] == marker, k
        assert server._truncated(req, ids) == ids[-k:]  # token ids: as sent
