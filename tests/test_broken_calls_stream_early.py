"""The "auto" readers send the text after a call that has already broken as content right away, not
at the end of the text or at a sign prose may never write: hermes (a `<tool_call>` whose object's
own level is no JSON, launcher/serving/hermes_calls.py), mistral before v11 (`[TOOL_CALLS]` then an
array or object that is no JSON at its own level, mistral_calls.py with call_json.ArrayLevelCheck)
and pythonic (a list whose text can no longer be a call's name, keyword or separator,
pythonic_calls_stream.py HeadCheck). The text so sent is what the whole answer has (the README's
rule for a broken call: the text from it on is content), and the stream still says what the whole
answer says over any split."""

from __future__ import annotations

import random

import pytest

from launcher.serving.call_json import ArrayLevelCheck, decode_at
from launcher.serving.hermes_calls import HermesCallReader
from launcher.serving.mistral_calls import MistralCallReader
from launcher.serving.pythonic_calls import PythonicCallReader
from tests import call_reader_checks as checks
from tests.call_reader_checks import random_cuts

PROSE = " and the answer goes on in plain words" * 40


def content_by_piece(reader, text: str, size: int) -> list[str]:
    starts = range(0, len(text), size)
    return [reader.delta(text[start:start + size], start + size >= len(text)).get("content", "") for start in starts]


@pytest.mark.parametrize("reader_class, text", [
    (HermesCallReader, "The <tool_call> tag wraps calls." + PROSE),
    (HermesCallReader, '<tool_call>{"name": "f" x' + PROSE),
    (MistralCallReader, "[TOOL_CALLS] [1, 2, " + PROSE),
    (MistralCallReader, '[TOOL_CALLS] {"name" is' + PROSE),
    (MistralCallReader, "Use [TOOL_CALLS] [1] x" + PROSE),  # no comma after a value
    (PythonicCallReader, "[f(a=1), " + PROSE),
    (PythonicCallReader, "[f(a=1) and" + PROSE),
    (PythonicCallReader, "[f(then I" + PROSE),
])
def test_text_after_a_call_that_broke_streams_as_it_comes(reader_class, text):
    whole = reader_class()
    whole.push(text, True)
    pieces = content_by_piece(reader_class(), text, 8)
    broke_by = 6  # the pieces by which each text is broken (its first 48 characters)
    assert all(pieces[broke_by:-1]), pieces[:broke_by + 2]  # each later piece goes out as it comes
    content = "".join(pieces)
    # the whole answer is all content; the stream sends the same, or (pythonic: the call before the
    # break went out) the text from the breaking call's start
    assert whole.message()["content"] == text and text.endswith(content)
    for cuts in [list(range(1, len(text), 3))] + [random_cuts(random.Random(1), text) for _ in range(20)]:
        stream_content, _, _ = checks.streamed(reader_class, text, cuts)
        assert stream_content == content, cuts


def test_a_call_still_written_is_held_until_it_closes():
    """What may still be a call is not sent as content: a hermes block's object being written, a
    pre-v11 array whose own level is JSON so far (its elements are not judged until it closes), a
    pythonic call's keyword whose value is being written."""
    hermes = HermesCallReader()
    assert hermes.delta('Hi <tool_call>{"name": "f", "arguments": {"a": "x y z', False) == {
        "content": "Hi ", "tool_calls": [{"index": 0, "id": hermes.calls()[0]["id"], "type": "function",
                                          "function": {"name": "f", "arguments": '{"a": "x y z'}}]}
    mistral = MistralCallReader()
    assert mistral.delta('[TOOL_CALLS] [1, "two", {"x": y z', False) == {}
    pythonic = PythonicCallReader()
    assert "content" not in pythonic.delta("[f(a='x y z", False)


def test_the_array_check_is_sure_and_never_early():
    """ArrayLevelCheck says broken only for a text no JSON decoder takes, whatever follows, and never
    for a whole array, whatever its split."""
    # "1" * 400: an integer past a double's range is exact, and the whole reading keeps it (the check
    # once called it broken, turning a mistral stream to content where the whole answer found calls)
    parts = ["[", "]", "{", "}", '"', "\\", ",", " ", "1", "1e400", "true", "tru", "x", "NaN", ":", '"a"', "[1, 2]",
             '{"k": [1]}', "\n", "-", "0.5", "-0", '"\\""', "1" * 400]
    rng, broken, whole = random.Random(3), 0, 0
    for _ in range(20000):
        text = "[" + "".join(rng.choice(parts) for _ in range(rng.randint(0, 8)))
        check, size = ArrayLevelCheck(), rng.randint(1, 4)
        sure = all(check.feed(text[at:at + size]) for at in range(0, len(text), size))
        decoded = decode_at(text)
        if decoded is not None and decoded[1] == len(text):
            assert sure, text
            whole += 1
        if not sure:
            broken += 1
            for ending in ("", "]", "]]", "}]", '"]', '"}]', "0]", " 1]", "1}]"):
                assert decode_at(text + ending) is None, (text, ending)
    assert broken > 1000 and whole > 50, (broken, whole)


@pytest.mark.parametrize("reader_class, parts", [
    (HermesCallReader, ['<tool_call>{"name": "f", "arguments": {"a": [1]}}</tool_call>', "<tool_call>", "</tool_call>", '{"name": "f", "arguments": ', "{", "}", '"', ":", ",", "1",
                        "NaN", " ", "\n", "x", "prose ", "[", "]"]),
    (MistralCallReader, ['[TOOL_CALLS] [{"name": "f", "arguments": {}}, 1]', '[TOOL_CALLS]{"name": "f"}', "1" * 400,
                         "[TOOL_CALLS]", "[ARGS]", "f", '[{"name": "f", "arguments": ', "{", "}", "[", "]", '"',
                         '"a"', ":", ",", "1", "1e400", "true", "tru", " ", "x", "prose ", "null"]),
    (PythonicCallReader, ["[f(a=1)]", "[f(a='x y'), g.h() ", "[", "f(", "g.h(", ")", "]", "a=", "b=", ", ", ",", '"x"', "1", "True", " ", "\n", "#",
                          "\\", "and ", "then I ", ".", "=", "é"]),
])
def test_broken_texts_stream_as_they_read_whole(reader_class, parts):
    """Random texts over random splits say what the whole answer says (but for the documented
    exception: a call sent before the text turned out no call, checked in each reader's tests)."""
    rng, compared = random.Random(5), {"calls": 0, "content": 0}
    for _ in range(1500):
        text = "".join(rng.choice(parts[:3] if rng.random() < 0.5 else parts) for _ in range(rng.randint(1, 10)))
        whole = reader_class()
        whole.push(text, True)
        for cuts in [list(range(1, len(text)))] + [random_cuts(rng, text) for _ in range(6)]:
            if not whole.calls() and checks.streamed(reader_class, text, cuts)[1]:
                continue  # the exception: a call went out before the text broke
            checks.assert_streamed_as_whole(reader_class, text, cuts, id_ok=lambda call_id: True)
            compared["calls" if whole.calls() else "content"] += 1
    assert compared["calls"] > 100 and compared["content"] > 1000, compared
