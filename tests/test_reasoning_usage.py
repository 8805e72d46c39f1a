"""The usage's reasoning tokens on a server with --reasoning-parser (`completion_tokens_details:
{"reasoning_tokens": N}`, launcher/serving/reasoning.py's ReasoningTokenCount): the whole answer's,
the streamed last chunk's (include_usage) and each chunk's (continuous_usage_stats), n = 2 summed,
thinking off, include_reasoning false, and no field without a parser or on /v1/completions. The
route runs in-process over SmolLM2's tokenizer (with `<think>`, `</think>` and `<tool_call>` added
as tokens, or without them: the count then reads the text) and a stub engine that streams a
scripted text one token a delta."""

from __future__ import annotations

import asyncio
import copy

import pytest

from tests.test_skip_special_tokens import answered

MODEL = "smollm2-135m-instruct"
THOUGHT, ANSWER = "The sky is clear today", "\n\nBlue."
TEMPLATE = ("{% for m in messages %}{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}"
            "{{ opening | default('') }}{% endif %}")
"""The prompt's end is the request's to choose (chat_template_kwargs opening): deepseek_r1's template
writes `<think>`; one that writes `<think></think>` has closed the thinking already."""


@pytest.fixture(scope="module")
def tagged(smollm2_tokenizer):
    """SmolLM2's tokenizer with the tags as one token each, as Qwen3's and DeepSeek-R1's have them."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_tokens(["<think>", "</think>", "<tool_call>"])
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def untagged(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def server_over(tokenizer, reasoning_parser: str | None, scripts: list[str]):
    """The scripted server (tests/test_tokenize_routes.py) streaming scripts[i] as request i's text."""
    from tests.test_tokenize_routes import scripted_server

    return scripted_server(tokenizer, scripts, reasoning_parser=reasoning_parser)


def asked(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "What colour is the sky?"}],
            "chat_template_kwargs": {"opening": "<think>\n"}, **fields}


def answer(server, body: dict, route: str = "/v1/chat/completions"):
    return asyncio.run(answered(server, route, body))


def tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def details(usage: dict) -> dict | None:
    return usage.get("completion_tokens_details")


def test_a_whole_answer_counts_the_thinking_the_prompt_opened(tagged):
    """deepseek_r1, whose template opens the thinking: every token before `</think>` is reasoning
    (vLLM counts 0 here, having seen no generated `<think>`), the tag and the answer are not."""
    text = f"{THOUGHT}</think>{ANSWER}"
    out = answer(server_over(tagged, "deepseek_r1", [text]), asked())
    assert out["choices"][0]["message"]["reasoning"] == THOUGHT
    usage = out["usage"]
    assert usage["completion_tokens"] == tokens(tagged, text)
    assert details(usage) == {"reasoning_tokens": tokens(tagged, THOUGHT)} and tokens(tagged, THOUGHT) > 3


def test_the_streams_last_chunk_and_each_chunk_carry_the_count(tagged):
    text = f"{THOUGHT}</think>{ANSWER}"
    thought = tokens(tagged, THOUGHT)
    streamed = answer(server_over(tagged, "deepseek_r1", [text]),
                      asked(stream=True, stream_options={"include_usage": True}))
    assert all(chunk["usage"] is None for chunk in streamed[:-1])
    assert details(streamed[-1]["usage"]) == {"reasoning_tokens": thought}
    continuous = answer(server_over(tagged, "deepseek_r1", [text]),
                        asked(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [details(chunk["usage"])["reasoning_tokens"] for chunk in continuous[:-1]]
    # the role chunk 0, one more a thinking token, then still `thought` through the tag and the answer
    assert counts == [0, *range(1, thought + 1), *[thought] * (len(counts) - thought - 1)]
    made = [chunk["usage"]["completion_tokens"] for chunk in continuous[:-1]]
    assert made[:thought + 1] == list(range(thought + 1))  # `</think>`'s delta sends no chunk: one fewer after
    assert details(continuous[-1]["usage"]) == {"reasoning_tokens": thought}


def test_two_choices_are_summed_in_the_totals_and_counted_apart_per_chunk(tagged):
    short, long = "Blue, surely", f"{THOUGHT}, and the air is dry"
    scripts = [f"{short}</think>Blue.", f"{long}</think>Blue."]
    counts = [tokens(tagged, short), tokens(tagged, long)]
    assert counts[0] != counts[1]
    whole = answer(server_over(tagged, "deepseek_r1", scripts), asked(n=2))
    assert details(whole["usage"]) == {"reasoning_tokens": sum(counts)}
    streamed = answer(server_over(tagged, "deepseek_r1", scripts),
                      asked(n=2, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    for index, count in enumerate(counts):
        mine = [details(c["usage"])["reasoning_tokens"] for c in streamed[:-1] if c["choices"][0]["index"] == index]
        assert mine[-1] == count and mine == sorted(mine)  # per choice, as completion_tokens is
    assert details(streamed[-1]["usage"]) == {"reasoning_tokens": sum(counts)}


def test_qwen3s_own_think_tag_and_a_tool_call_bound_the_count(tagged):
    """Qwen3 writes `<think>` itself: the tag is not counted; a `<tool_call>` ends the thinking as
    `</think>` does (the split puts it in the content)."""
    written = answer(server_over(tagged, "qwen3", [f"<think>{THOUGHT}</think>{ANSWER}"]), asked())
    assert details(written["usage"]) == {"reasoning_tokens": tokens(tagged, THOUGHT)}
    call = '<tool_call>{"name": "weather", "arguments": {}}'
    called = answer(server_over(tagged, "qwen3", [f"<think>{THOUGHT}{call}"]), asked())
    assert called["choices"][0]["message"]["reasoning"] == THOUGHT
    assert details(called["usage"]) == {"reasoning_tokens": tokens(tagged, THOUGHT)}


def test_thinking_off_counts_none(tagged):
    """qwen3 with enable_thinking false, or a prompt that closed the thinking: all content, 0."""
    text = f"<think>{THOUGHT}</think>{ANSWER}"
    off = answer(server_over(tagged, "qwen3", [text]), asked(chat_template_kwargs={"enable_thinking": False}))
    assert off["choices"][0]["message"]["content"] == text
    assert details(off["usage"]) == {"reasoning_tokens": 0}
    closed = asked(chat_template_kwargs={"opening": "<think>\n</think>\n"}, stream=True,
                   stream_options={"include_usage": True, "continuous_usage_stats": True})
    streamed = answer(server_over(tagged, "deepseek_r1", [f"{THOUGHT}</think>{ANSWER}"]), closed)
    assert {details(chunk["usage"])["reasoning_tokens"] for chunk in streamed} == {0}
    sent = "".join(c["delta"].get("content") or "" for chunk in streamed for c in chunk["choices"])
    assert sent == f"{THOUGHT}</think>{ANSWER}"  # the prompt's `</think>` made it all content


def test_hidden_reasoning_is_still_counted(tagged):
    text = f"{THOUGHT}</think>{ANSWER}"
    hidden = answer(server_over(tagged, "deepseek_r1", [text]), asked(include_reasoning=False))
    assert "reasoning" not in hidden["choices"][0]["message"]
    assert details(hidden["usage"]) == {"reasoning_tokens": tokens(tagged, THOUGHT)}


def test_no_field_without_a_parser_nor_on_completions(tagged):
    text = f"{THOUGHT}</think>{ANSWER}"
    plain = answer(server_over(tagged, None, [text]), asked())
    assert "completion_tokens_details" not in plain["usage"]
    streamed = answer(server_over(tagged, None, [text]),
                      asked(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert not any("completion_tokens_details" in chunk["usage"] for chunk in streamed)
    completed = answer(server_over(tagged, "deepseek_r1", [text]), {"model": MODEL, "prompt": "Hi"}, "/v1/completions")
    assert "completion_tokens_details" not in completed["usage"]


def test_without_tag_tokens_the_count_reads_the_text(untagged):
    """SmolLM2 spells `</think>` in several tokens: the tokens whose text is wholly reasoning count,
    those of the tag (held as a possible tag, then found to be one) and after it do not; the same
    whole and streamed."""
    text = f"{THOUGHT}</think>{ANSWER}"
    ids = untagged.encode(text, add_special_tokens=False)
    assert ids[:tokens(untagged, THOUGHT)] == untagged.encode(THOUGHT, add_special_tokens=False)
    assert tokens(untagged, "</think>") > 1  # the case under test: the tag is no token of its own
    whole = answer(server_over(untagged, "deepseek_r1", [text]), asked())
    assert details(whole["usage"]) == {"reasoning_tokens": tokens(untagged, THOUGHT)}
    streamed = answer(server_over(untagged, "deepseek_r1", [text]),
                      asked(stream=True, stream_options={"include_usage": True}))
    assert details(streamed[-1]["usage"]) == {"reasoning_tokens": tokens(untagged, THOUGHT)}
    cut = answer(server_over(untagged, "deepseek_r1", [THOUGHT]), asked())  # no </think>: all reasoning
    assert details(cut["usage"]) == {"reasoning_tokens": cut["usage"]["completion_tokens"]}


def test_the_count_by_ids_and_by_text_in_any_delta_split():
    from launcher.serving.reasoning import ReasoningTokenCount, ThinkTokens

    ids = ThinkTokens(start=1, end=2, call=3)
    for parser, thinking, deltas, expected in (
            ("deepseek_r1", True, [[5, 6], [2, 7, 8]], 2),
            ("deepseek_r1", True, [[1, 5], [1], [6, 2], [1, 9]], 2),  # <think> tags inside: not counted
            ("deepseek_r1", True, [[5, 3, 6], [2]], 3),  # <tool_call> ends only qwen3's thinking
            ("qwen3", True, [[1, 5, 3, 6], [2]], 1),
            ("qwen3", False, [[1, 5, 2]], 0)):
        count = ReasoningTokenCount(parser, thinking, ids)
        for part in deltas:
            count.push(part, "", False)
        assert count.count == expected, (parser, deltas)
    by_text = ReasoningTokenCount("deepseek_r1", True, ThinkTokens())
    for token, text in ((10, "abc"), (11, "</"), (12, "think"), (13, ">"), (14, "xyz")):
        by_text.push([token], text, token == 14)
    assert by_text.count == 1
    held = ReasoningTokenCount("deepseek_r1", True, ThinkTokens())
    for token, text in ((10, "a"), (11, "<"), (12, "b")):  # "<" held, then no tag: all reasoning
        held.push([token], text, token == 12)
    assert held.count == 3


def test_the_count_by_text_leaves_out_tokens_whose_text_is_held_or_spells_a_dropped_tag():
    """By text (no tag tokens), a token counts once its text went wholly to the reasoning: one whose
    text the engine still holds ("": a stop string's possible start) waits for it, and the tokens
    spelling a `<think>` the split drops are no reasoning (they were counted)."""
    from launcher.serving.reasoning import ReasoningTokenCount, ThinkTokens

    held_by_engine = ReasoningTokenCount("deepseek_r1", True, ThinkTokens())
    for token, text in ((10, "sky"), (11, ""), (12, "</think"), (13, ">"), (14, "Blue")):  # "</" held, then released
        held_by_engine.push([token], text, token == 14)
    assert held_by_engine.count == 1
    for parser in ("deepseek_r1", "qwen3"):
        spelled = ReasoningTokenCount(parser, True, ThinkTokens())
        for token, text in ((10, "<"), (11, "think"), (12, ">"), (13, "sky"), (14, " is"), (15, "</"),
                            (16, "think>"), (17, "Blue")):
            spelled.push([token], text, token == 17)
        assert spelled.count == 2, parser
    # qwen3 whose tokenizer has `</think>` but no `<tool_call>` token: the text says where a call ends it
    no_call_token = ReasoningTokenCount("qwen3", True, ThinkTokens(start=1, end=2))
    for token, text in ((10, "sky"), (11, "<tool_call>"), (12, '{"name"'), (13, "}")):
        no_call_token.push([token], text, token == 13)
    assert no_call_token.count == 1
