"""tool_choice "auto" with vLLM's "mistral" tool-call parser (launcher/serving/mistral_calls.py,
`corelaunch serve --tool-call-parser mistral`): whole texts in both of Mistral's forms (pre-v11
`[TOOL_CALLS] [{...}]` and v11 `[TOOL_CALLS]name[ARGS]{...}`) read as vLLM 0.32's MistralParser
reads them, the stream equal to the whole answer for any split of the text (each call's arguments
streamed piece by piece: pre-v11 as written, the same JSON; v11 the very text the whole answer
takes; what a stream cannot know in time, an array that breaks after its call went out, written
down), ids of 9 letters and digits, and a forced `Sure.[TOOL_CALLS]...` end to end through the
route methods over a real in-process Launcher, whole and streamed."""

from __future__ import annotations

import json
import random
import re

import pytest

from launcher.serving.mistral_calls import MARKER, JsonValueEnd, MistralCallReader, read_whole
from launcher.serving.openai_protocol import ChatCompletionRequest, parse_request
from tests import call_reader_checks as checks
from tests.call_reader_checks import random_cuts
from tests.model_factory import random_model_with_smollm2_tokenizer
from tests.test_tool_calls import BASE, TOOLS, streamed_calls

PRE_V11 = '[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Paris"}}]'
TWO_PRE_V11 = ('[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Paris"}}, '
               '{"name":"set_flag","arguments":{"ok":true,"note":"été"}}]')
V11 = '[TOOL_CALLS]weather[ARGS]{"city": "Paris"}'
FLAG_V11 = '[TOOL_CALLS]set_flag[ARGS]{"ok":true,"note":"été"}'
PARIS = ("weather", '{"city": "Paris"}')
FLAGGED = ("set_flag", '{"ok": true, "note": "été"}')  # pre-v11: written back by json.dumps, non-ASCII kept
FLAGGED_AS_WRITTEN = ("set_flag", '{"ok":true,"note":"été"}')  # v11: the JSON value as the model wrote it

# (text, content, calls) as vLLM's whole reading gives them
WHOLE_TEXTS = [
    # pre-v11: one JSON array (or a bare object) of calls
    ("Sure." + PRE_V11, "Sure.", [PARIS]),
    (PRE_V11, None, [PARIS]),  # nothing before the calls: content null
    ("\n " + PRE_V11, None, [PARIS]),  # only whitespace before them: null too
    ("Let me look. " + TWO_PRE_V11, "Let me look. ", [PARIS, FLAGGED]),  # kept as written, not stripped
    ('[TOOL_CALLS] {"name": "weather", "arguments": {"city": "Paris"}}', None, [PARIS]),  # a bare object: one call
    (PRE_V11 + " and some words" + V11, None, [PARIS]),  # after the JSON value, all is ignored
    ('[TOOL_CALLS]  [TOOL_CALLS]\n[{"name": "weather", "arguments": {"city": "Paris"}}]', None,
     [PARIS]),  # markers with only whitespace between them count as one
    ('[TOOL_CALLS][{"name": "weather", "arguments": "{\\"city\\": \\"Par"}]', None, [("weather", '{"city": "Par')]),
    ('[TOOL_CALLS][{"name": "weather", "arguments": null}, {"name": "set_flag"}]', None,
     [("weather", "{}"), ("set_flag", "{}")]),  # null or missing arguments: "{}"
    ('[TOOL_CALLS][{"name": 7, "arguments": {}}, 3, {"other": 1}, {"arguments": [1]}]', None,
     [("", "{}"), ("", "[1]")]),  # a name that is no string is ""; items that are no calls are skipped
    ('a [TOOL[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Paris"}}]', "a [TOOL", [PARIS]),
    ('[TOOL_CALLS][{"name": "weather", "arguments": {"q": "a]}\\"[TOOL"}}]', None,
     [("weather", '{"q": "a]}\\"[TOOL"}')]),  # brackets, quotes and a marker's start inside a string
    # v11: name[ARGS]arguments after each marker
    ("Sure." + V11, "Sure.", [PARIS]),
    (V11, None, [PARIS]),
    ("Ok, " + V11 + FLAG_V11, "Ok, ", [PARIS, FLAGGED_AS_WRITTEN]),
    (V11 + " then words\n" + FLAG_V11 + " trailing", None, [PARIS, FLAGGED_AS_WRITTEN]),  # after a value: dropped
    ('[TOOL_CALLS] weather [ARGS] {"city": "Paris"}', None, [PARIS]),  # whitespace around the name
    ('[TOOL_CALLS]weather{"city": "Paris"}', None, [PARIS]),  # `name{`: vLLM's engine takes it too
    ("[TOOL_CALLS]get-time_2[ARGS]", None, [("get-time_2", "{}")]),  # no arguments: "{}"
    ("[TOOL_CALLS]get-time_2[ARGS]  \n", None, [("get-time_2", "{}")]),
    ('[TOOL_CALLS]weather[ARGS]"Paris" and more', None, [("weather", '"Paris"')]),  # any JSON value
    ("[TOOL_CALLS]weather[ARGS]city=Paris ", None, [("weather", "city=Paris")]),  # no JSON: the text, stripped
    ("[TOOL_CALLS]weather[ARGS]42", None, [("weather", "42")]),
    ('[TOOL_CALLS]weather[ARGS]{"city": "Par', None, [("weather", '{"city": "Par')]),  # cut short: the text as is
    ('[TOOL_CALLS]weather[ARGS]{"city": "Par"x}[TOOL_CALLS]set_flag[ARGS]{}', None,
     [("weather", '{"city": "Par"x}'), ("set_flag", "{}")]),  # closed, but no JSON: the text up to the marker
    (V11 + "[TOOL_CALLS] \n", None, [PARIS]),  # a last marker with nothing after it
    # no marker: plain text
    ("Just text.", "Just text.", []),
    ("ends with [TOOL_CA", "ends with [TOOL_CA", []),
    ("  ", "  ", []),
    ("", "", []),
]
# no call can be read: the whole text is content, with no call
UNREAD_TEXTS = [
    "Hi [TOOL_CALLS]",  # nothing after the marker
    "[TOOL_CALLS]  \n[TOOL_CALLS] ",
    'Hi [TOOL_CALLS][{"name": "weather", "arguments": {',  # cut inside the JSON
    '[TOOL_CALLS][{"name": "weather", "arguments": {}}, bad]',  # not JSON
    '[TOOL_CALLS][{"name": "weather", "arguments": {"x": ' + "1" * 5000 + '}}]',  # past Python's digit limit
    "[TOOL_CALLS][1, 2, {}]",  # JSON, but no call in it
    "[TOOL_CALLS][]",
    '[TOOL_CALLS][{"name": "f", "arguments": "[TOOL_CALLS]"}]',  # a marker cuts the JSON value
    "[TOOL_CALLS]weather",  # a v11 name with no [ARGS]
    "[TOOL_CALLS]get weather[ARGS]{}",  # not a name
    "  [TOOL_CALLS]I will call it now.",
    "[TOOL_CALLS]weather[ARG",
    "[TOOL_CALLS]weather[ARGs]{}",
    "[TOOL_CALLS][ARGS]{}",  # no name
    "[TOOL_CALLS]" + "é" * 3,
]
BAD_AFTER_GOOD = "Ok." + V11 + " x[TOOL_CALLS] [TOOL_CALLS]bad name[ARGS]{}after"
# pre-v11 arrays the whole reading refuses once a call of theirs has gone out (its name closed, its
# arguments begun, in an earlier piece): the names of the calls a stream has sent by then
BROKEN_AFTER_ANNOUNCED = {
    UNREAD_TEXTS[3]: ["weather"],  # the JSON breaks after the call
    UNREAD_TEXTS[4]: ["weather"],  # a number Python's decoder refuses, in the arguments
    'Hi [TOOL_CALLS][{"name": "f", "arguments": {"a": "[TOOL_CALLS]"}}]': ["f"],  # a marker cuts the arguments
    '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": ' + "[" * 200 + "]" * 200 + "}]": [
        "f", "g"],  # nested past call_json.MAX_DEPTH
}
# a v11 call's arguments (the text after `[ARGS]`) and what the whole reading takes of them: the first
# JSON value as written, or the text (stripped) when it starts with none
V11_ARGUMENTS = [
    ('{"city": "Paris"}', '{"city": "Paris"}'),
    (' \n{"city":  "Paris" } then words ', '{"city":  "Paris" }'),  # spacing as written, the rest dropped
    ("[1, 2] [3]", "[1, 2]"),
    ('"Paris" "Rome"', '"Paris"'),
    ('{"city": "Par', '{"city": "Par'),  # cut short: the text
    ('{"city": "Par  \n', '{"city": "Par'),  # stripped
    ('{"city": "Par"x} and more  ', '{"city": "Par"x} and more'),  # closes, but is no JSON: all the text
    ("[" * 200 + "]" * 200 + " x", "[" * 200 + "]" * 200 + " x"),  # nested past MAX_DEPTH: no JSON
    ("city = Paris \n ", "city = Paris"),
    ("42", "42"), ("42 and more", "42"), ("-1.5e+3x", "-1.5e+3"), ("0123", "0"),
    ("1.x", "1"), ("1.", "1"), ("2e", "2"), ("2e-", "2"), ("2E+ 1", "2"), ("-", "-"), ("- 1", "- 1"),
    ("1" * 5000 + ".x ", "1" * 5000 + ".x"),  # an integer past Python's digit limit: no JSON
    ("1" * 5000 + ".5 x", "1" * 5000 + ".5 x"),  # a float of as many digits is beyond a double: no JSON
    ("null", "null"), ("nullx", "null"), ("nu", "nu"), ("nux y", "nux y"), ("true]", "true"),
    ("falsey", "false"), ("NaN!", "NaN!"), ("-Infinity1", "-Infinity1"), ("-Inf", "-Inf"), ("Info", "Info"),
    ("  ", "{}"), ("", "{}"),
]


def read(reader: MistralCallReader) -> list[tuple[str, str]]:
    return [(call["function"]["name"], call["function"]["arguments"]) for call in reader.calls()]


def is_mistral_id(call_id: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9]{9}", call_id) is not None


def is_pre_v11(text: str) -> bool:
    """The text's calls are in the pre-v11 form (markers with only whitespace between count as one)."""
    return text[text.find(MARKER) + len(MARKER):].replace(MARKER, " ").lstrip()[:1] in ("[", "{")


@pytest.mark.parametrize("text, content, calls", WHOLE_TEXTS)
def test_whole_texts_are_read_as_vllms_mistral_parser_reads_them(text, content, calls):
    message = checks.assert_read_whole_as(MistralCallReader, read_whole, text, content, calls, is_mistral_id)
    assert all("index" not in call for call in message.get("tool_calls", []))
    reader = MistralCallReader()
    reader.push(text, True)
    assert reader.calls() == reader.message().get("tool_calls", [])  # made once: ids stay


@pytest.mark.parametrize("text", UNREAD_TEXTS + [BAD_AFTER_GOOD] + list(BROKEN_AFTER_ANNOUNCED))
def test_a_text_without_a_readable_call_is_all_content(text):
    checks.assert_all_content(MistralCallReader, read_whole, text)


def test_ids_are_nine_letters_and_digits_and_differ():
    """Mistral's chat templates refuse any other id when the calls come back in the conversation."""
    ids = []
    for _ in range(50):
        reader = MistralCallReader()
        reader.push("Ok." + V11 + FLAG_V11, True)
        ids += [call["id"] for call in reader.message()["tool_calls"]]
        streamed = MistralCallReader()
        ids += [call["id"] for call in streamed.delta(TWO_PRE_V11, True)["tool_calls"]]
    assert all(is_mistral_id(call_id) for call_id in ids) and len(set(ids)) == len(ids) == 200


def streamed(text: str, cuts: list[int], reader: MistralCallReader | None = None):
    """The text streamed in pieces cut at `cuts`: its content, its calls (reassembled from the
    entries), its finish reason, and every delta; the reader's calls() are the calls it streamed."""
    reader = reader or MistralCallReader()
    content, calls, finish, deltas = checks.streamed_with_deltas(reader, text, cuts)
    assert reader.calls() == calls
    return content, calls, finish, deltas


def entries(deltas: list[dict]) -> list[dict]:
    return [entry for delta in deltas for entry in delta.get("tool_calls", [])]


@pytest.mark.parametrize("text", [text for text, _, _ in WHOLE_TEXTS]
                         + [text for text in UNREAD_TEXTS if text not in BROKEN_AFTER_ANNOUNCED])
def test_streamed_over_any_split_the_answer_is_the_whole_answer(text):
    """Content and calls, reassembled from the deltas (names, and arguments holding the same JSON),
    are the whole reading's for 300 random splits (every character alone included)."""
    rng = random.Random(len(text))
    for cuts in [list(range(1, len(text))), []] + [random_cuts(rng, text) for _ in range(300)]:
        checks.assert_streamed_as_whole(MistralCallReader, text, cuts, is_mistral_id)
        streamed(text, cuts)  # and its calls() are the streamed ones


@pytest.mark.parametrize("text", list(BROKEN_AFTER_ANNOUNCED))
def test_a_pre_v11_array_that_breaks_after_its_call_went_out_keeps_the_call_and_sends_its_text(text):
    """What no stream can know in time: the whole answer is all content; a stream that has announced
    a call keeps it, and sends the text from the start as content, so its content is the whole
    answer's. Where the break comes in the same piece as the call, nothing was announced: the
    stream says what the whole answer says."""
    rng = random.Random(len(text))
    assert read_whole(text).calls == []
    for cuts in [list(range(1, len(text))), []] + [random_cuts(rng, text) for _ in range(100)]:
        content, calls, finish, _ = streamed(text, cuts)
        assert content == text
        names = [call["function"]["name"] for call in calls]
        assert names == BROKEN_AFTER_ANNOUNCED[text][:len(names)], cuts
        assert finish == ("tool_calls" if calls else "stop")  # calls went out
        if cuts == list(range(1, len(text))):
            assert names == BROKEN_AFTER_ANNOUNCED[text]
        if not cuts:
            assert names == []


FRAGMENTS = ["[TOOL_CALLS]", "[TOOL_", "[ARGS]", "[AR", " ", "\n", "f", "get_x", "{", "}", "[", "]", '"', "\\", ":",
             ",", '"name"', '"arguments"', "1", "null", "x", "{}", '{"name": "f", "arguments": {"a": "]"}}', "é",
             "Hi ", "-", ".", "e", "nu", "true", "[TOOL_CALLS]f[ARGS]", '[{"name": "g", "arguments": [']


def test_random_texts_stream_as_they_read_whole():
    """Texts made of random pieces of the format (markers and their parts, brackets, quotes,
    escapes, numbers, calls): each streamed one character at a time and in random pieces says what
    the whole answer says (v11 arguments the same text, pre-v11 the same JSON), but where a v11 call
    that cannot be read follows a good one, or a pre-v11 array breaks after a call of it went out."""
    rng = random.Random(7)
    read_calls, exceptions = 0, {"pre-v11": 0, "v11": 0}
    for _ in range(3000):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 10)))
        whole = read_whole(text)
        read_calls += bool(whole.calls)
        for cuts in [list(range(1, len(text)))] + [random_cuts(rng, text, 6) for _ in range(4)]:
            content, calls, _, _ = streamed(text, cuts)
            got = checks.named(calls)
            if not whole.calls and got:
                if is_pre_v11(text):  # the array broke after a call went out: all the text as content
                    assert content == text, (text, cuts)
                    exceptions["pre-v11"] += 1
                else:  # a bad v11 call after a good one already sent
                    assert text.count(MARKER) > len(got), (text, cuts)
                    exceptions["v11"] += 1
                continue
            assert content == (whole.content or "") and [name for name, _ in got] == [
                name for name, _ in whole.calls], (text, cuts)
            if is_pre_v11(text):
                assert all(checks.same_json(ours, theirs) for (_, ours), (_, theirs) in zip(got, whole.calls))
            else:
                assert got == whole.calls, (text, cuts)
    assert read_calls > 30 and all(exceptions.values())  # the texts do hold calls, and both exceptions


@pytest.mark.parametrize("arguments, taken", V11_ARGUMENTS)
def test_v11_arguments_stream_as_the_very_text_the_whole_answer_takes(arguments, taken):
    """Whatever the text after `[ARGS]` (a JSON value and text after it, text that is no JSON, a
    number whose end the next character decides), the streamed pieces add up to exactly the text the
    whole reading takes as the arguments, over any split: no piece that the whole would drop (a
    trailing space, the `.` of `1.x`) is ever sent."""
    text = "Ok." + MARKER + "weather[ARGS]" + arguments + MARKER + "f[ARGS]{}"
    assert read_whole(text).calls == [("weather", taken), ("f", "{}")]
    rng = random.Random(len(text))
    for cuts in [list(range(1, len(text))), []] + [random_cuts(rng, text) for _ in range(50)]:
        content, calls, finish, _ = streamed(text, cuts)
        assert (content, checks.named(calls), finish) == ("Ok.", [("weather", taken), ("f", "{}")], "tool_calls")
    ends_the_text = "Ok." + MARKER + "weather[ARGS]" + arguments
    for cuts in [list(range(1, len(ends_the_text))), []]:
        assert checks.named(streamed(ends_the_text, cuts)[1]) == [("weather", taken)]


def test_random_v11_arguments_stream_as_the_very_text_the_whole_answer_takes():
    rng = random.Random(5)
    pieces = ["1", "0", "-", ".", "e", "E", "+", "5", " ", "\n", "n", "u", "l", "t", "N", "a", "I", "nfinity", "null",
              "-Infinity", "{", "}", "[", "]", '"', "\\", ":", ",", "x", "[TO", '"a"', MARKER + "g[ARGS]"]
    for _ in range(2000):
        text = MARKER + "f[ARGS]" + "".join(rng.choice(pieces) for _ in range(rng.randint(0, 7)))
        whole = read_whole(text)
        for cuts in [list(range(1, len(text))), []] + [random_cuts(rng, text, 6) for _ in range(2)]:
            content, calls, _, _ = streamed(text, cuts)
            assert (content, checks.named(calls)) == (whole.content or "", whole.calls), (text, cuts)


def test_v11_arguments_stream_piece_by_piece():
    """The call goes out with its id and name at the first character of its arguments, then each
    piece of them as it comes (no id, no name), as written: trailing whitespace waits for more."""
    reader = MistralCallReader()
    assert reader.delta("Sure.[TOOL_CALLS]weath", False) == {"content": "Sure."}
    assert reader.delta("er[ARGS] \n", False) == {}
    [first] = reader.delta('{"ci', False)["tool_calls"]
    assert set(first) == {"index", "id", "type", "function"} and is_mistral_id(first["id"]) and first["index"] == 0
    assert first["type"] == "function" and first["function"] == {"name": "weather", "arguments": '{"ci'}
    assert reader.delta('ty": ', False) == {"tool_calls": [{"index": 0, "function": {"arguments": 'ty":'}}]}
    assert reader.delta('"Pa', False) == {"tool_calls": [{"index": 0, "function": {"arguments": ' "Pa'}}]}
    assert reader.delta('ris"} then words [TOOL', False) == {"tool_calls": [
        {"index": 0, "function": {"arguments": 'ris"}'}}]}
    assert reader.delta("_CALLS]set_flag[ARGS]{", False) == {"tool_calls": [
        {"index": 1, "id": reader.calls()[1]["id"], "type": "function",
         "function": {"name": "set_flag", "arguments": "{"}}]}
    assert reader.delta('"ok":true,"note":"été"}', True) == {"tool_calls": [
        {"index": 1, "function": {"arguments": '"ok":true,"note":"été"}'}}]}
    assert checks.named(reader.calls()) == [PARIS, FLAGGED_AS_WRITTEN] and reader.finish_reason("stop") == "tool_calls"
    assert is_mistral_id(reader.calls()[1]["id"]) and reader.calls()[0]["id"] != reader.calls()[1]["id"]


def test_pre_v11_arguments_stream_piece_by_piece():
    """Each call of the array goes out once its name has closed and its arguments have begun, then
    its arguments piece by piece, as written (the whole answer writes them as json.dumps does: the
    same JSON); the next call's index is its place in the array."""
    reader = MistralCallReader()
    assert reader.delta('Let me look. [TOOL_CALLS][{"name": "weather", "arguments": ', False) == {
        "content": "Let me look. "}
    [first] = reader.delta('{"city"', False)["tool_calls"]
    assert is_mistral_id(first["id"]) and first["function"] == {"name": "weather", "arguments": '{"city"'}
    assert reader.delta(': "Paris"}}, {"name":"set_flag","arguments":{"ok"', False)["tool_calls"] == [
        {"index": 0, "function": {"arguments": ': "Paris"}'}},
        {"index": 1, "id": reader.calls()[1]["id"], "type": "function",
         "function": {"name": "set_flag", "arguments": '{"ok"'}}]
    assert reader.delta(':true,"note":"été"}', False) == {"tool_calls": [
        {"index": 1, "function": {"arguments": ':true,"note":"été"}'}}]}
    assert reader.delta("}] ok" + V11, False) == {}  # the array closed: read whole, the rest ignored
    assert reader.delta(" anything", True) == {} and reader.finish_reason("stop") == "tool_calls"
    assert [(name, json.loads(arguments)) for name, arguments in read(reader)] == [
        (name, json.loads(arguments)) for name, arguments in [PARIS, FLAGGED]]


def test_pre_v11_arguments_written_before_the_name_go_out_once_the_name_has_closed():
    reader = MistralCallReader()
    assert reader.delta('[TOOL_CALLS][{"arguments": {"city": "Paris"}, ', False) == {}
    [call] = reader.delta('"name": "weather"', False)["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    assert reader.delta("}]", True) == {} and checks.named(reader.calls()) == [PARIS]


def test_pre_v11_calls_whose_arguments_are_no_object_go_out_whole_when_the_array_closes():
    """Arguments written as a JSON string (taken as the string's text) or null (taken as "{}") are not
    what was written: that call, and those after it, go out whole, as the whole reading takes them,
    when the array closes; the calls before stream as usual."""
    text = ('[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Paris"}}, '
            '{"name": "f", "arguments": "{\\"a\\": 1}"}, {"name": "g", "arguments": null}, '
            '{"name": "h", "arguments": {"b": 2}}]')
    expected = [PARIS, ("f", '{"a": 1}'), ("g", "{}"), ("h", '{"b": 2}')]
    assert read_whole(text).calls == expected
    for cuts in [list(range(1, len(text))), []] + [random_cuts(random.Random(3), text) for _ in range(50)]:
        content, calls, finish, deltas = streamed(text, cuts)
        assert (content, checks.named(calls), finish) == ("", expected, "tool_calls")
        later = [entry for entry in entries(deltas) if entry["index"] > 0]
        assert all("id" in entry for entry in later) and len(later) == 3  # each whole, in one entry
    reader = MistralCallReader()
    first = reader.delta(text[:-1], False)["tool_calls"]  # all but the closing bracket
    assert [entry["index"] for entry in first] == [0]
    assert [entry["function"]["name"] for entry in reader.delta("]", True)["tool_calls"]] == ["f", "g", "h"]


def test_content_holds_back_only_a_possible_marker_and_whitespace_before_a_call():
    reader = MistralCallReader()
    assert reader.delta("Hello [TOOL", False) == {"content": "Hello "}  # "[TOOL" may start the marker
    assert reader.delta("S] ", False) == {"content": "[TOOLS] "}  # it did not
    assert reader.delta("[TOOL_CALLS]", False) == {}
    [call] = reader.delta("weather[ARGS]{\"city\": ", False)["tool_calls"]  # its arguments have begun
    assert call["index"] == 0 and call["function"] == {"name": "weather", "arguments": '{"city":'}
    assert reader.delta('"Paris"} and words [TOOL_', False)["tool_calls"] == [
        {"index": 0, "function": {"arguments": ' "Paris"}'}}]
    assert reader.delta(" more words", False) == {}  # text after a call is no content
    assert reader.delta("[TOOL_CALLS]set_flag[ARGS]", False) == {}
    [call] = reader.delta("", True)["tool_calls"]  # no arguments: the call goes at the end, with "{}"
    assert (call["index"], call["function"]["name"], call["function"]["arguments"]) == (1, "set_flag", "{}")
    assert reader.finish_reason("stop") == "tool_calls" and reader.finish_reason("length") == "length"
    assert checks.named(reader.calls()) == [PARIS, ("set_flag", "{}")]
    # content that is only whitespace waits: null if a call follows, sent when words do
    blank = MistralCallReader()
    assert blank.delta("\n ", False) == {} and blank.delta("\n", False) == {}
    assert blank.delta("Hi [TOOL_CALLS]", False) == {"content": "\n \nHi "}
    before_a_call = MistralCallReader()
    assert before_a_call.delta("\n", False) == {} and before_a_call.delta(V11[:20], False) == {}
    assert before_a_call.delta(V11[20:], True)["tool_calls"][0]["function"]["name"] == "weather"
    assert MistralCallReader().delta("  ", True) == {"content": "  "}  # no call came: the text as it is


def test_a_bad_call_after_a_good_one_streams_the_sent_call_and_the_rest_as_content():
    """The one v11 case a stream cannot say as the whole answer does (all content): the good call is
    already out when the bad one comes, so the text from the first marker after it goes as content."""
    for cuts in ([], list(range(1, len(BAD_AFTER_GOOD)))):
        content, calls, finish, _ = streamed(BAD_AFTER_GOOD, cuts)
        assert checks.named(calls) == [PARIS]
        assert content == "Ok." + "[TOOL_CALLS] [TOOL_CALLS]bad name[ARGS]{}after" and finish == "tool_calls"


def test_without_parallel_calls_only_the_first_call_is_kept_whole_and_streamed():
    """parallel_tool_calls false: vLLM keeps the first call of an "auto" answer, in both forms; its
    arguments still stream piece by piece."""
    for text in ("Ok." + TWO_PRE_V11, "Ok." + V11 + FLAG_V11):
        whole = MistralCallReader(parallel_tool_calls=False)
        whole.push(text, True)
        assert read(whole) == [PARIS] and whole.message()["content"] == "Ok."
        for cuts in ([], list(range(1, len(text))), list(range(3, len(text), 7))):
            content, calls, finish, deltas = streamed(text, cuts, MistralCallReader(parallel_tool_calls=False))
            assert checks.named(calls) == [PARIS] and calls[0]["index"] == 0
            assert content == "Ok." and finish == "tool_calls"
            assert {entry["index"] for entry in entries(deltas)} == {0}
            assert len(entries(deltas)) > (1 if cuts else 0)  # in pieces, when the text came in pieces
    assert parse_request(ChatCompletionRequest, {**BASE, "tools": TOOLS, "tool_choice": "auto",
                                                 "parallel_tool_calls": False},
                         "mistral").tool_call_reader().parallel_tool_calls is False


def test_json_value_end_is_found_over_any_split():
    """JsonValueEnd, fed a JSON object, array or string in random pieces, finds where json's
    raw_decode ends it: strings, escapes (a backslash at a piece's end included) and nesting."""
    rng = random.Random(11)
    values = [{"a": "x]}\"\\", "b": [1, {"c": "\\\\"}]}, ["[", "]", "{", "\""], "plain \\\" quote", {"é": "\n\t"},
              [[[[]]]], {}, "", {"k": "\\"}]
    for value in values:
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5) + ' {"after": 1}]'
        end = json.JSONDecoder().raw_decode(text)[1]
        for cuts in [list(range(1, len(text)))] + [random_cuts(rng, text) for _ in range(100)]:
            closer, found, edges = JsonValueEnd(), None, [0, *cuts, len(text)]
            for start, stop in zip(edges, edges[1:]):
                closed = closer.feed(text[start:stop])
                if closed is not None:
                    found = start + closed
                    break
            assert found == end, (text, cuts)


def test_the_stream_keeps_only_what_is_not_settled():
    """Streamed, the reader keeps the text it may still need (a possible marker, the value whose
    reading is not settled), not the whole output; a long argument goes out as it comes, each
    piece's work that piece's, whatever came before."""
    reader = MistralCallReader()
    for _ in range(2000):
        reader.delta("words and more words [TOOL", False)
        assert len(reader._open) < len(MARKER)
    reader.delta("_CALLS]weather[ARGS]{\"city\": \"", False)
    for _ in range(2000):
        assert reader.delta("a b", False) == {"tool_calls": [{"index": 0, "function": {"arguments": "a b"}}]}
        assert reader._unsent == [] and reader._marker_text.arguments._blank == []
    assert reader._marker_text.arguments._value_end.in_string  # the value's end is searched over new pieces only
    assert reader.delta("\"} after", False) == {"tool_calls": [{"index": 0, "function": {"arguments": '"}'}}]}
    assert json.loads(read(reader)[0][1]) == {"city": "a b" * 2000}
    assert reader._marker_text.arguments._value == [] and reader._marker_text.stage == "after"
    for _ in range(2000):
        assert reader.delta("words after the call [TOOL", False) == {}
        assert len(reader._open) < len(MARKER) and reader._unsent == []
    pre_v11 = MistralCallReader()
    pre_v11.delta('[TOOL_CALLS][{"name": "weather", "arguments": {"city": "', False)
    for _ in range(2000):
        assert pre_v11.delta("a b", False) == {"tool_calls": [{"index": 0, "function": {"arguments": "a b"}}]}
        assert len(pre_v11._marker_text.scan._kept) < 10  # the scan keeps no argument text it sent
    pre_v11.delta('"}}]', False)
    for _ in range(2000):
        assert pre_v11.delta("ignored [TOOL_CALLS] words", False) == {}
    assert pre_v11._open == "" and pre_v11._unsent == [] and pre_v11._marker_text.held == []
    assert json.loads(read(pre_v11)[0][1]) == {"city": "a b" * 2000}


# ---- end to end --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_model_with_smollm2_tokenizer(tmp_path_factory.mktemp("mistral"))


def test_auto_reads_mistral_calls_whole_and_streamed(model_dir, in_process_cluster):
    """The model's text forced (structured_outputs regex) to `Sure.[TOOL_CALLS]weather[ARGS]{...}`
    and a second v11 call: the answer is the content "Sure." and two calls with Mistral's ids,
    finished by "tool_calls", for each of n=2 choices, whole and streamed."""
    forced = {"regex": re.escape("Sure." + V11 + FLAG_V11)}  # SmolLM2 has no [TOOL_CALLS] token: plain text here
    body = {**BASE, "tools": TOOLS, "tool_choice": "auto", "structured_outputs": forced,
            "max_tokens": 80, "temperature": 1.0, "seed": 3, "n": 2}
    assert isinstance(parse_request(ChatCompletionRequest, body, "mistral").tool_call_reader(), MistralCallReader)
    refused, whole, stream = checks.answered_with_parser(model_dir, "mistral", body, refused_without=True)

    assert refused.param == "tool_choice"
    assert len(whole["choices"]) == 2
    for choice in whole["choices"]:
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
        calls = choice["message"]["tool_calls"]
        assert [(call["function"]["name"], call["function"]["arguments"]) for call in calls] == [
            PARIS, FLAGGED_AS_WRITTEN]
        assert all(call["type"] == "function" and is_mistral_id(call["id"]) for call in calls)
    calls, finishes, contents = streamed_calls(stream, 2)
    assert finishes == ["tool_calls", "tool_calls"] and contents == ["Sure.", "Sure."]
    assert [[call["function"] for call in choice_calls] for choice_calls in calls] == [
        [call["function"] for call in choice["message"]["tool_calls"]] for choice in whole["choices"]]
    assert all(is_mistral_id(call["id"]) for choice_calls in calls for call in choice_calls)
    assert not any(MARKER in (c["delta"].get("content") or "") for chunk in stream for c in chunk["choices"])


def test_a_long_whitespace_start_is_held_in_pieces_and_sent_with_what_follows():
    """Whitespace before a marker is held (no content if a call follows) in the pieces it came in: one
    growing string copied it all at every piece (quadratic past some hundred kilobytes)."""
    reader = MistralCallReader()
    for _ in range(2000):
        assert reader.delta("\n" * 30, False) == {}
    assert len(reader._open) < len(MARKER) and len(reader._blank) == 2000
    assert reader.delta('[TOOL_CALLS][{"name": "f", "arguments": {}}]', True)["tool_calls"][0]["function"]["name"] == "f"
    assert reader.message()["content"] is None
    text = MistralCallReader()
    for _ in range(100):
        text.delta("  ", False)
    assert text.delta("hi", True) == {"content": "  " * 100 + "hi"}  # not a call: the whitespace goes out with it
