"""tool_choice "auto" with vLLM's "llama3_json" tool-call parser (launcher/serving/llama_calls.py,
`corelaunch serve --tool-call-parser llama3_json`): whole texts read as vLLM 0.32's
Llama3JsonToolParser reads them (but for the documented differences: the text before the calls kept
as content, a leading <|python_tag|> never content, objects with nothing between them each read),
the stream equal to the whole answer for any split of the text (each call's arguments streamed as
they are written; what a stream cannot know yet, an object that turns out no call after its call
went out, written down), and a forced
`<|python_tag|>{...}; {...}` end to end through the route methods over a real in-process Launcher,
whole and streamed."""

from __future__ import annotations

import json
import random

import pytest

from launcher.serving.llama_calls import PYTHON_TAG, Llama3JsonCallReader, read_whole
from launcher.serving.openai_protocol import ChatCompletionRequest, parse_request
from tests import call_reader_checks as checks
from tests.call_reader_checks import named, random_cuts
from tests.model_factory import random_model_with_smollm2_tokenizer
from tests.test_tool_calls import BASE, TOOLS

WEATHER = '{"name": "weather", "parameters": {"city": "Paris"}}'
FLAG_CALL = '{"name":"set_flag","arguments":{"ok":true,"note":"été"}}'
PARIS = ("weather", '{"city": "Paris"}')
FLAGGED = ("set_flag", '{"ok": true, "note": "été"}')  # written back as json.dumps writes it, non-ASCII kept

# (text, content, calls) as the whole reading gives them
WHOLE_TEXTS = [
    (WEATHER, None, [PARIS]),  # nothing before the call: content null
    (PYTHON_TAG + WEATHER, None, [PARIS]),
    (PYTHON_TAG + WEATHER + "; " + FLAG_CALL, None, [PARIS, FLAGGED]),  # the models' separator
    (" \n" + PYTHON_TAG + "  " + WEATHER + ";" + FLAG_CALL + "\n", None, [PARIS, FLAGGED]),  # whitespace only: null
    ('{"name": "weather", "arguments": {"city": "Paris"}, "parameters": {"city": "Oslo"}}', None, [PARIS]),
    ('{"name": "weather", "parameters": "Paris"}', None, [("weather", '"Paris"')]),  # any JSON value
    ('{"name": "weather", "arguments": null}', None, [("weather", "null")]),
    ('{"name": "f", "parameters": [1, 2.5, {"k": "é"}]}', None, [("f", '[1, 2.5, {"k": "é"}]')]),
    # braces, a quote and a backslash in a string
    ('{"name": "f", "arguments": {"s": "a } { \\" \\\\"}}', None, [("f", '{"s": "a } { \\" \\\\"}')]),
    ("Let me check. " + WEATHER + " then " + FLAG_CALL + " done", "Let me check. ", [PARIS, FLAGGED]),  # text kept
    (PYTHON_TAG + "Sure: " + WEATHER, "Sure: ", [PARIS]),  # the leading tag is no content, the text is
    ("I call " + PYTHON_TAG + WEATHER, "I call " + PYTHON_TAG, [PARIS]),  # a tag elsewhere is text
    ("<|pyth" + WEATHER, "<|pyth", [PARIS]),
    (PYTHON_TAG + PYTHON_TAG + WEATHER, PYTHON_TAG, [PARIS]),  # one leading tag is the marker
    (WEATHER + "; " + PYTHON_TAG + FLAG_CALL, None, [PARIS, FLAGGED]),  # between objects: ignored
    (WEATHER + FLAG_CALL, None, [PARIS, FLAGGED]),  # nothing between: each read (vLLM skips the second)
    (WEATHER + "}}", None, [PARIS]),
    ("Just text.", "Just text.", []),
    (PYTHON_TAG + "no call", "no call", []),  # no call: the leading tag is still no content
    (PYTHON_TAG, "", []),
    ("<|pyth", "<|pyth", []),
    ("  ", "  ", []),
    ("", "", []),
]
# an object that holds no call: the whole text (less a leading tag) is content, no call (vLLM's fallback)
UNREAD_TEXTS = [
    'Hi {"name": "weather", "arguments": {"city": }}',  # invalid JSON
    '{"name": "weather"}',  # no arguments
    '{"arguments": {}}',  # no name
    '{"name": 7, "arguments": {}}',  # name not a string
    '{"name": "f", "arguments": {"x": ' + "1" * 5000 + '}}',  # past Python's digit limit: ValueError
    '{"name": "f", "arguments": ' + "[" * 3000 + "]" * 3000 + "}",  # too deep for json: RecursionError
    PYTHON_TAG + '{"name": "weather", "parameters": {"city": "Par',  # cut short inside the object
    ' {"name": "f", "arguments": {"s": "a\\',  # cut right after a backslash in a string
    "Use {braces} like this",
    "{}",
    PYTHON_TAG + " {",
    '{"name": "weather", "parameters": {"city": "Paris"}; ',  # a brace short
]
BAD_AFTER_GOOD = "Ok. " + WEATHER + '; {"name": "x"} after'
# objects the whole reading refuses once their call has gone out (its name closed, its arguments
# begun): the names of the calls a stream has sent by then, whatever the split
BROKEN_AFTER_ANNOUNCED = {
    UNREAD_TEXTS[0]: ["weather"],  # the JSON breaks inside the arguments
    UNREAD_TEXTS[4]: ["f"],  # a number Python's decoder refuses
    UNREAD_TEXTS[5]: ["f"],  # nesting past call_json.MAX_DEPTH
    UNREAD_TEXTS[6]: ["weather"],  # cut short inside the arguments
    UNREAD_TEXTS[7]: ["f"],
    UNREAD_TEXTS[11]: ["weather"],  # never closes
    WEATHER + '; {"name": "f", "arguments": {"x": 1': ["weather", "f"],  # a good call, then one cut short
    "Ok " + WEATHER + '{"name": "x", "arguments": [}': ["weather", "x"],  # a good call, then one that breaks
}


@pytest.mark.parametrize("text, content, calls", WHOLE_TEXTS)
def test_whole_texts_are_read_as_vllms_llama3_json_parser_reads_them(text, content, calls):
    checks.assert_read_whole_as(Llama3JsonCallReader, read_whole, text, content, calls)


@pytest.mark.parametrize("text", UNREAD_TEXTS + [BAD_AFTER_GOOD])
def test_an_object_without_a_call_makes_the_whole_text_content(text):
    checks.assert_all_content(Llama3JsonCallReader, read_whole, text, text.removeprefix(PYTHON_TAG))


def streamed(text: str, cuts: list[int], parallel: bool = True) -> tuple[str, list[dict], str]:
    return checks.streamed(Llama3JsonCallReader, text, cuts, parallel)


def assert_streamed_as_whole(text: str, cuts: list[int]) -> None:
    checks.assert_streamed_as_whole(Llama3JsonCallReader, text, cuts)


@pytest.mark.parametrize("text", [text for text, _, _ in WHOLE_TEXTS]
                         + [text for text in UNREAD_TEXTS if text not in BROKEN_AFTER_ANNOUNCED])
def test_streamed_over_any_split_the_answer_is_the_whole_answer(text):
    """Content and calls, reassembled from the deltas (names, and arguments holding the same JSON),
    are the whole reading's for every character alone, the text in one piece and 300 random splits;
    each call has its own index."""
    rng = random.Random(len(text))
    for cuts in [list(range(1, len(text))), []] + [random_cuts(rng, text) for _ in range(300)]:
        assert_streamed_as_whole(text, cuts)


def test_random_texts_stream_as_they_read_whole():
    """Texts made of calls, objects that are none, tags, separators and words, each streamed over
    random splits, say what the whole answer says, but for the one exception (a call sent before an
    object that is no call), which is checked apart below."""
    parts = [WEATHER, FLAG_CALL, '{"name": "x"}', "{", "}", '"', "\\", PYTHON_TAG, "<|py", "; ", " ", "\n", "ok",
             '{"name": "s", "arguments": "}{\\""}']
    rng, compared = random.Random(7), {"calls": 0, "content": 0}
    for _ in range(1500):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 8)))
        if not read_whole(text).calls and streamed(text, [])[1]:
            continue  # a call sent, then an object without one (or its own object broke)
        for cuts in [random_cuts(rng, text) for _ in range(10)]:
            assert_streamed_as_whole(text, cuts)
        compared["calls" if read_whole(text).calls else "content"] += 1
    assert min(compared.values()) > 100, compared  # both kinds of answers were compared


def test_content_holds_back_only_a_possible_leading_tag_and_a_call_goes_out_as_it_is_written():
    reader = Llama3JsonCallReader()
    assert reader.delta(" <|pyth", False) == {}  # whitespace and a tag's start: no content if a call follows
    assert reader.delta("on_tag|>", False) == {}  # the tag: never content
    assert reader.delta("Sure", False) == {"content": " Sure"}
    assert reader.delta(" <|python_tag|> {", False) == {"content": " <|python_tag|> "}  # not at the start: text
    [call] = reader.delta('"name": "weather", "parameters": {"city": "Paris"', False)["tool_calls"]  # still open
    assert call["index"] == 0 and call["function"] == {"name": "weather", "arguments": '{"city": "Paris"'}
    assert reader.delta("}}; ", False) == {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}
    [flag] = reader.delta(FLAG_CALL + " and more", False)["tool_calls"]  # written in one piece: one entry
    assert flag["index"] == 1 and flag["function"] == {"name": "set_flag", "arguments": '{"ok":true,"note":"été"}'}
    assert reader.delta(" words", True) == {}  # text after the calls is no content
    assert checks.named(reader.calls()) == [PARIS, ("set_flag", '{"ok":true,"note":"été"}')]  # as written
    assert reader.finish_reason("stop") == "tool_calls" and reader.finish_reason("length") == "length"
    partial = Llama3JsonCallReader()
    assert partial.delta("<|py", False) == {}
    assert partial.delta("thon", False) == {}
    assert partial.delta(" tag", False) == {"content": "<|python tag"}  # it was no tag
    assert partial.delta(" <|python_tag|>", False) == {"content": " <|python_tag|>"}  # no longer the start
    spaces = Llama3JsonCallReader()
    assert spaces.delta("\n ", False) == {} and spaces.delta("", True) == {"content": "\n "}  # no call came
    cut = Llama3JsonCallReader()  # cut inside an object (max_tokens): the text from its `{` is content
    assert cut.delta(PYTHON_TAG + ' {"name": "weather", "par', False) == {}
    assert cut.delta("ameters", True) == {"content": ' {"name": "weather", "parameters'}


def test_an_object_without_a_call_after_a_good_one_streams_the_sent_call_and_the_rest_as_content():
    """The one case a stream cannot say as the whole answer does (all content): the good call is
    already out when the bad object comes, so the text from the bad object on follows as content."""
    for cuts in ([], list(range(1, len(BAD_AFTER_GOOD)))):
        content, calls, finish = streamed(BAD_AFTER_GOOD, cuts)
        assert named(calls) == [PARIS]
        assert content == 'Ok. {"name": "x"} after' and finish == "tool_calls"


def test_without_parallel_calls_only_the_first_call_is_kept_whole_and_streamed():
    """parallel_tool_calls false: vLLM keeps the first call of an "auto" answer; streamed, only the
    first object's call is sent, piece by piece, and the later calls send nothing."""
    text = PYTHON_TAG + WEATHER + "; " + FLAG_CALL + "; " + WEATHER
    whole = Llama3JsonCallReader(parallel_tool_calls=False)
    whole.push(text, True)
    assert named(whole.message()["tool_calls"]) == [PARIS] and whole.message()["content"] is None
    for cuts in ([], list(range(1, len(text))), list(range(7, len(text), 7))):
        reader = Llama3JsonCallReader(parallel_tool_calls=False)
        content, calls, finish, deltas = checks.streamed_with_deltas(reader, text, cuts)
        assert [(call["index"], call["function"]["name"]) for call in calls] == [(0, "weather")]
        assert named(calls) == [PARIS] and content == "" and finish == "tool_calls"
        entries = [entry for delta in deltas for entry in delta.get("tool_calls", [])]
        assert {entry["index"] for entry in entries} == {0}
        assert not reader._object_sendable  # the later objects are only scanned (for where they break)
        if not cuts:
            assert len(entries) == 1  # the text in one piece: the call in one entry
    pieces = Llama3JsonCallReader(parallel_tool_calls=False)  # the first call over several deltas
    assert pieces.delta('{"name": "weather", "parameters": {"ci', False)["tool_calls"][0]["function"] == {
        "name": "weather", "arguments": '{"ci'}
    assert pieces.delta('ty": "Paris"}}; {"name": "f", "arguments": {"x": 1', False) == {
        "tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]}
    assert pieces.delta("}}", True) == {} and named(pieces.calls()) == [PARIS]
    request = parse_request(ChatCompletionRequest, {**BASE, "tools": TOOLS, "tool_choice": "auto",
                                                    "parallel_tool_calls": False}, "llama3_json")
    assert request.tool_call_reader().parallel_tool_calls is False


def test_the_stream_keeps_only_what_is_not_settled():
    """Streamed, the reader keeps the text it may still need (a start that may be whitespace and the
    tag, the object being written), not the whole output: each piece's work is that piece's."""
    reader = Llama3JsonCallReader()
    reader.delta("Sure", False)
    for _ in range(2000):
        assert reader.delta("words <|python_tag|> and more ", False) == {"content": "words <|python_tag|> and more "}
        assert reader._held == "" and reader._object == []
    [call] = reader.delta('{"name": "weather", "parameters": {"city": "', False)["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": '{"city": "'}
    for _ in range(2000):  # escapes and braces inside the string: it stays open, each piece goes out alone
        assert reader.delta('a\\"{', False) == {"tool_calls": [{"index": 0, "function": {"arguments": 'a\\"{'}}]}
        assert len(reader._object_scan._kept) < 10 and reader._scanned == []  # the scan keeps no sent text
    assert reader._object_end.depth == 2 and reader._object_end.in_string
    assert reader.delta('"}}', False) == {"tool_calls": [{"index": 0, "function": {"arguments": '"}'}}]}
    assert json.loads(reader.calls()[0]["function"]["arguments"]) == {"city": 'a"{' * 2000}
    assert reader._object == [] and reader._object_end is None
    for _ in range(2000):
        assert reader.delta("; } words ", False) == {}  # between objects: dropped, nothing kept
        assert reader._object == [] and reader._object_end is None


def test_a_long_argument_streams_piece_by_piece():
    """The call goes out once its name has closed and its arguments have begun (id, name and the
    arguments so far), then each piece of the arguments alone, as written; reassembled, the same
    JSON as the whole answer's. Llama's own key, "parameters", and "arguments" alike."""
    city = "Paris, " * 300
    text = (PYTHON_TAG + '{"name": "weather", "parameters": {"city": "' + city + '", "days": [1, 2]}}; '
            '{"name": "set_flag", "arguments": {"note": "' + city + '"}}')
    whole = Llama3JsonCallReader()
    whole.push(text, True)
    reader = Llama3JsonCallReader()
    cuts = list(range(40, len(text), 40))
    content, calls, finish, deltas = checks.streamed_with_deltas(reader, text, cuts)
    entries = [entry for delta in deltas for entry in delta.get("tool_calls", [])]
    firsts = [entry for entry in entries if "id" in entry]
    assert [(entry["index"], entry["function"]["name"]) for entry in firsts] == [(0, "weather"), (1, "set_flag")]
    assert firsts[0]["function"]["arguments"] == text[text.find('{"city"'):80]  # the arguments written so far
    assert len(entries) > 2 * len(city) // 40  # over many deltas, each at most one piece long
    assert all(len(entry["function"]["arguments"]) <= 40 for entry in entries)
    assert content == "" and finish == "tool_calls" and len(calls) == 2
    for call, whole_call in zip(calls, whole.message()["tool_calls"]):
        assert call["function"]["name"] == whole_call["function"]["name"]
        assert json.loads(call["function"]["arguments"]) == json.loads(whole_call["function"]["arguments"])
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": city, "days": [1, 2]}


def test_arguments_written_before_the_name_go_out_once_the_name_has_closed():
    reader = Llama3JsonCallReader()
    assert reader.delta('{"parameters": {"city": "Paris"}, ', False) == {}
    [call] = reader.delta('"name": "weather"', False)["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    assert reader.delta("}", True) == {} and named(reader.calls()) == [PARIS]


def test_an_object_with_both_keys_streams_the_first_written():
    """The documented difference: the whole answer takes "arguments" (vLLM's order); the stream has
    sent whichever of the two came first before it can see the other."""
    text = '{"name": "f", "parameters": {"a": 1}, "arguments": {"b": 2}}'
    assert read_whole(text).calls == [("f", '{"b": 2}')]
    for cuts in ([], list(range(1, len(text)))):
        content, calls, finish = streamed(text, cuts)
        assert named(calls) == [("f", '{"a": 1}')] and content == "" and finish == "tool_calls"
    checks.assert_streamed_as_whole(Llama3JsonCallReader, text.replace('"parameters"', '"other"'), [])


@pytest.mark.parametrize("text", list(BROKEN_AFTER_ANNOUNCED))
def test_an_object_that_breaks_after_its_call_went_out_keeps_the_call_and_sends_its_text(text):
    """What no stream can know in time: the whole answer is all content; the stream has announced the
    call (its arguments as written so far), and sends the text from the bad object on as content, so
    its content is the whole answer's from that object on (all of it when it was the first)."""
    whole = read_whole(text)
    assert whole.calls == [] and whole.content == text.removeprefix(PYTHON_TAG)
    bad_object = text.rfind("{", 0, text.find('"name": "' + BROKEN_AFTER_ANNOUNCED[text][-1]))
    after_a_good_call = len(BROKEN_AFTER_ANNOUNCED[text]) > 1
    rng = random.Random(len(text))
    for cuts in [list(range(1, len(text))), []] + [random_cuts(rng, text) for _ in range(100)]:
        content, calls, finish = streamed(text, cuts)
        assert [call["function"]["name"] for call in calls] == BROKEN_AFTER_ANNOUNCED[text], cuts
        assert [call["index"] for call in calls] == list(range(len(calls)))
        announced = calls[-1]["function"]["arguments"]
        assert announced and text[bad_object:].find(announced) != -1  # the arguments' text as written so far
        if after_a_good_call:  # the content before the calls, then the text from the bad object on
            assert content == text[:text.find("{")] + text[bad_object:], cuts
        else:
            assert content == whole.content, cuts
        assert finish == "tool_calls"  # a call went out


# ---- end to end --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_model_with_smollm2_tokenizer(tmp_path_factory.mktemp("llama3_json"))


def test_auto_reads_llama3_json_calls_whole_and_streamed(model_dir, in_process_cluster):
    """The model's text forced to `<|python_tag|>{...}; {...}` (SmolLM2 has no such token: plain
    text): no content and two calls, "tool_calls", whole and streamed, n=2."""
    checks.assert_forced_calls_end_to_end(model_dir, "llama3_json", Llama3JsonCallReader,
                                          PYTHON_TAG + WEATHER + "; " + FLAG_CALL, [PARIS, FLAGGED])
