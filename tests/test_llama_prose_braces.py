"""llama3_json "auto" streaming of prose and code with braces (launcher/serving/llama_calls.py): a `{`
whose text soon stops being JSON a call could be read from (`x { y`, a Java class's body) turns the
stream to content right there, not at its matching `}` or the end of the text (a Java class answer
once streamed nothing from its first brace to its last character); the stream still says what the
whole answer says, over any split."""

from __future__ import annotations

import random

from launcher.serving.llama_calls import Llama3JsonCallReader, read_whole
from tests import call_reader_checks as checks
from tests.call_reader_checks import random_cuts

JAVA = ("Here is the class you asked for:\n```java\npublic class Counter {\n    private int count;\n\n"
        "    public void add() {\n        count++;\n    }\n}\n```\n" + "It counts how often add is called. " * 60)


def content_by_piece(text: str, size: int) -> list[str]:
    """The content each delta carries, the text streamed in pieces of `size` characters."""
    reader = Llama3JsonCallReader()
    starts = range(0, len(text), size)
    return [reader.delta(text[start:start + size], start + size >= len(text)).get("content", "") for start in starts]


def test_prose_with_a_brace_streams_its_content_before_the_text_ends():
    text = "x { y" + " and the prose goes on" * 100
    pieces = content_by_piece(text, 10)
    assert "".join(pieces) == text == read_whole(text).content
    # the piece that brings `y` (no JSON key can start so) sends the held `{` with it
    assert "".join(pieces[:1]) == "x { y" + text[5:10]
    assert all(pieces[:-1])  # every piece goes out as it comes, not held for the last


def test_a_code_block_with_braces_streams_as_it_is_written():
    pieces = content_by_piece(JAVA, 7)
    assert "".join(pieces) == JAVA == read_whole(JAVA).content
    brace = JAVA.index("{")
    assert sum(len(piece) for piece in pieces[:brace // 7 + 2]) > brace + 1  # past the brace at once
    assert all(pieces[:-1])


def test_an_object_still_json_is_held_until_it_closes_or_breaks():
    """What may still be a call is held: `{"a": 1` may yet close as an object (no call: content), and
    `{"name": "f", ` is a call being written."""
    reader = Llama3JsonCallReader()
    assert reader.delta('Use {"a": 1', False) == {"content": "Use "}
    assert reader.delta(', "b": [1, {"c": 2}]', False) == {}
    assert reader.delta(" oops", False) == {"content": '{"a": 1, "b": [1, {"c": 2}] oops'}  # broken: out now
    assert reader.delta(" more", True) == {"content": " more"}


def test_texts_with_braces_in_prose_stream_as_they_read_whole():
    """Random texts of calls, broken objects and prose around braces, each over random splits, say
    what the whole answer says (but for the documented exception: a call sent, then an object that is
    no call, checked in tests/test_llama_calls.py)."""
    parts = ['{"name": "weather", "parameters": {"city": "Paris"}}', "{", "}", " y", "class A ", '"k"', ":", ",",
             " ", "\n", "1", "NaN", "1e400", "[", "]", '{"name": "f", ', '"arguments": {"a": 1}', "\u00a0", "\\", '"',
             "; ", "<|python_tag|>"]
    rng, compared = random.Random(11), {"calls": 0, "content": 0}
    for _ in range(2000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(1, 10)))
        if not read_whole(text).calls and checks.streamed(Llama3JsonCallReader, text, [])[1]:
            continue
        for cuts in [list(range(1, len(text)))] + [random_cuts(rng, text) for _ in range(8)]:
            checks.assert_streamed_as_whole(Llama3JsonCallReader, text, cuts)
        compared["calls" if read_whole(text).calls else "content"] += 1
    assert min(compared.values()) > 100, compared
