"""vLLM's reasoning parsers "deepseek_r1" and "qwen3" (launcher/serving/reasoning.py): whole texts split
into (reasoning, content) as vLLM 0.32 splits them, the stream equal to the whole answer for any split
of the text, tags held back only while they may still be completing, and a stream's kept state
bounded however long the text."""

from __future__ import annotations

import random

import pytest

from launcher.serving.reasoning import (
    REASONING_PARSERS,
    ReasoningSplitter,
    read_reasoning,
    thinking_requested,
)

CALL = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'

# (text, reasoning, content): each row was run through vLLM 0.32's Qwen3 parser (extract_reasoning, and
# the server's parse / parse_delta a token at a time, with <think>, </think>, <tool_call> one token
# each); every row is vLLM's whole answer. Its server stream differs only where marked.
QWEN3_TEXTS = [
    ("<think>abc</think>xyz", "abc", "xyz"),  # (a)
    ("abc</think>xyz", "abc", "xyz"),  # (b) no opening tag: the text starts in the reasoning
    ("abc", "abc", None),  # (c) cut short: all reasoning
    ("<think>abc", "abc", None),  # (d)
    ("pre<think>abc</think>xyz", "preabc", "xyz"),  # (e) <think> is dropped, the text before it kept
    ("<think>abc</think>x</think>y", "abc", "xy"),  # (f) vLLM's stream: "x</think>y" (module docstring)
    ("<think>abc</think>x<think>y", "abc", "x<think>y"),  # (f) <think> in the answer is text
    ("<think>ab<think>c</think>xyz", "abc", "xyz"),  # (f) a second <think> in the reasoning is dropped
    ("abc</think>x<think>y</think>z", "abc", "x<think>yz"),  # (f) vLLM's stream: "x<think>y</think>z"
    ("<think></think>xyz", None, "xyz"),  # (g) empty reasoning: null
    ("<think>\n\n</think>\n\nxyz", "\n\n", "\n\nxyz"),  # (g) nothing stripped
    ("<think>\nabc\n</think>\n\nxyz", "\nabc\n", "\n\nxyz"),
    ("<think>abc  \n</think>xyz", "abc  \n", "xyz"),
    ("<think>abc</think>", "abc", None),  # (h) empty content: null
    ("<think></think>", None, None),
    ("", None, None),
    ("abc" + CALL, "abc", CALL),  # a call ends the reasoning; it stays, for the tool-call parser
    ("<think>abc</think>\n\n" + CALL, "abc", "\n\n" + CALL),
    ("abc" + CALL + "</think>x", "abc", CALL + "x"),  # dropped after a call too; vLLM's stream keeps it
    ("a <b> c </thin", "a <b> c </thin", None),  # a tag cut short is text
]

# (text, reasoning, content) under deepseek_r1, checked against vLLM 0.32's DeepSeekR1ReasoningParser.
# Every row is what vLLM's server streams a token at a time (reasoning "" aside: a stream with none
# sends none); rows marked "whole" differ from vLLM's extract_reasoning, whose rule loses text
# (module docstring).
DEEPSEEK_R1_TEXTS = [
    ("<think>abc</think>xyz", "abc", "xyz"),  # (a)
    ("abc</think>xyz", "abc", "xyz"),  # (b) the prompt opened the thinking
    ("abc", "abc", None),  # (c) cut short, or a model that skipped the tags: all reasoning
    ("<think>abc", "abc", None),  # (d)
    ("pre<think>abc</think>xyz", "preabc", "xyz"),  # (e) whole: ("abc", "xyz")
    ("<think>abc</think>x</think>y", "abc", "x</think>y"),  # (f) the answer is kept as written
    ("<think>abc</think>x<think>y", "abc", "x<think>y"),  # (f)
    ("<think>ab<think>c</think>xyz", "abc", "xyz"),  # (f) whole: ("ab<think>c", "xyz")
    ("abc</think>x<think>y</think>z", "abc", "x<think>y</think>z"),  # (f) whole: ("y", "z")
    ("<think></think>xyz", "", "xyz"),  # (g) empty reasoning: "", as vLLM's whole answer
    ("<think>\n\n</think>\n\nxyz", "\n\n", "\n\nxyz"),  # (g) nothing stripped
    ("<think>abc</think>", "abc", None),  # (h) empty content: null
    ("<think></think>", "", None),
    ("", "", None),
    ("abc" + CALL, "abc" + CALL, None),  # no implicit end: a call before </think> is reasoning
    ("<think>abc</think>" + CALL, "abc", CALL),
]

# qwen3 with thinking off: vLLM's answer is (null, the text as it is), "" included
THINKING_OFF_TEXTS = ["<think>abc</think>xyz", "abc</think>x</think>y", "abc" + CALL, "plain", ""]

ALL_READINGS = ([("qwen3", True, text) for text, _, _ in QWEN3_TEXTS]
                + [("deepseek_r1", True, text) for text, _, _ in DEEPSEEK_R1_TEXTS]
                + [("qwen3", False, text) for text in THINKING_OFF_TEXTS])


@pytest.mark.parametrize("text, reasoning, content", QWEN3_TEXTS)
def test_qwen3_whole_texts_are_split_as_vllm_splits_them(text, reasoning, content):
    assert read_reasoning("qwen3", text) == (reasoning, content)


@pytest.mark.parametrize("text, reasoning, content", DEEPSEEK_R1_TEXTS)
def test_deepseek_r1_whole_texts_are_split_as_vllms_stream_splits_them(text, reasoning, content):
    assert read_reasoning("deepseek_r1", text) == (reasoning, content)
    assert read_reasoning("deepseek_r1", text, thinking=False) == (reasoning, content)  # it reads no flag


@pytest.mark.parametrize("text", THINKING_OFF_TEXTS)
def test_qwen3_with_thinking_off_is_all_content_as_written(text):
    assert read_reasoning("qwen3", text, thinking=False) == (None, text)


def test_thinking_is_read_from_chat_template_kwargs_as_vllm_reads_it():
    assert thinking_requested("qwen3", None) and thinking_requested("qwen3", {})
    assert thinking_requested("qwen3", {"enable_thinking": True})
    assert not thinking_requested("qwen3", {"enable_thinking": False})
    assert not thinking_requested("qwen3", {"enable_thinking": None})  # vLLM tests the value's truth
    assert thinking_requested("qwen3", {"thinking": False})  # another templates' key: not qwen3's
    assert thinking_requested("deepseek_r1", {"enable_thinking": False, "thinking": False})


def test_an_unknown_parser_is_refused_by_name():
    with pytest.raises(ValueError, match=r"'qwen2'.*deepseek_r1, qwen3"):
        read_reasoning("qwen2", "x")
    with pytest.raises(ValueError, match="'hermes'"):
        ReasoningSplitter("hermes")
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}


def streamed(parser: str, thinking: bool, pieces: list[str]) -> tuple[str, str]:
    """The reasoning and content a splitter sends for these pieces, each joined."""
    splitter = ReasoningSplitter(parser, thinking)
    sent = [splitter.feed(piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    assert splitter.held == ""
    return "".join(r for r, _ in sent), "".join(c for _, c in sent)


def as_sent(reading: tuple[str | None, str | None]) -> tuple[str, str]:
    """A whole reading as a stream sends it: null is nothing sent."""
    return reading[0] or "", reading[1] or ""


def random_cuts(rng: random.Random, text: str) -> list[str]:
    """text cut at random places, empty pieces included (a token that decodes to no text yet)."""
    cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(1, 6)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("parser, thinking, text", ALL_READINGS)
def test_streamed_over_any_split_the_answer_is_the_whole_answer(parser, thinking, text):
    """At every cut point, a character at a time, and over 200 random splits, the deltas add up to the
    whole reading."""
    whole = as_sent(read_reasoning(parser, text, thinking))
    assert streamed(parser, thinking, [text]) == whole
    assert streamed(parser, thinking, list(text) or [""]) == whole
    for cut in range(len(text) + 1):
        assert streamed(parser, thinking, [text[:cut], text[cut:]]) == whole, cut
    rng = random.Random(text)
    for _ in range(200):
        assert streamed(parser, thinking, random_cuts(rng, text)) == whole


FRAGMENTS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<", ">", "</", "<thi", "nk>", "</thin",
             "<tool_", "a", "b c", "\n", "\n\n", "é", "<function=f>"]


@pytest.mark.parametrize("parser, thinking", [("qwen3", True), ("qwen3", False), ("deepseek_r1", True)])
def test_random_texts_of_tags_and_their_pieces_stream_as_they_read_whole(parser, thinking):
    """Tags, pieces of them, and tags made when another is dropped ("<thi<think>nk>"), in random
    texts cut at random: the stream says what the whole reading says."""
    rng = random.Random(7)
    for _ in range(1500):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 10)))
        whole = as_sent(read_reasoning(parser, text, thinking))
        assert streamed(parser, thinking, random_cuts(rng, text)) == whole, text


def test_a_tag_is_held_back_only_while_it_may_still_be_completing():
    splitter = ReasoningSplitter("qwen3")
    assert splitter.feed("Let me think", False) == ("Let me think", "")  # reasoning goes out at once
    assert splitter.feed(" a <b> c </thi", False) == (" a <b> c ", "") and splitter.held == "</thi"
    assert splitter.feed("s", False) == ("</this", "") and splitter.held == ""  # not a tag after all
    assert splitter.feed(" <tool", False) == (" ", "") and splitter.held == "<tool"
    assert splitter.feed("_call>{", False) == ("", "<tool_call>{") and not splitter.in_reasoning
    assert splitter.feed("} <think> </th", False) == ("", "} <think> ")  # qwen3's answer drops </think>
    assert splitter.feed("ink", True) == ("", "</think")  # the end: what was held goes out

    splitter = ReasoningSplitter("deepseek_r1")
    assert splitter.feed("ab</thin", False) == ("ab", "") and splitter.held == "</thin"
    assert splitter.feed("k>xy</thi", False) == ("", "xy</thi")  # the answer is kept as written: no hold
    assert splitter.held == ""

    off = ReasoningSplitter("qwen3", thinking=False)
    assert off.feed("<think>a</thi", False) == ("", "<think>a</thi") and off.held == ""
    assert ReasoningSplitter("qwen3").feed("abc</thi", True) == ("abc</thi", "")


def test_the_stream_keeps_only_what_is_not_settled():
    """However long the text, a splitter keeps at most a tag's length less one: each piece's work is
    that piece's, whatever came before."""
    for parser in ("qwen3", "deepseek_r1"):
        splitter = ReasoningSplitter(parser)
        sent = []
        for _ in range(3000):
            sent.append(splitter.feed("words and a <think> and <tool", False))
            assert len(splitter.held) < len("<tool_call>") and vars(splitter).keys() == {
                "parser", "thinking", "_in_reasoning", "_held"}
        sent.append(splitter.feed("</think>", False))
        for _ in range(3000):
            sent.append(splitter.feed("answer </th", False))
            assert len(splitter.held) < len("</think>")
        sent.append(splitter.feed("", True))
        reasoning, content = "".join(r for r, _ in sent), "".join(c for _, c in sent)
        text = "words and a <think> and <tool" * 3000 + "</think>" + "answer </th" * 3000
        assert (reasoning, content) == as_sent(read_reasoning(parser, text))
        assert len(reasoning) == len("words and a  and <tool") * 3000
