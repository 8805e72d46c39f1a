"""tool_choice "auto" with vLLM's "mistral" tool-call parser (launcher/serving/mistral_calls.py,
`corelaunch serve --tool-call-parser mistral`): whole texts in both of Mistral's forms (pre-v11
`[TOOL_CALLS] [{...}]` and v11 `[TOOL_CALLS]name[ARGS]{...}`) read as vLLM 0.32's MistralParser
reads them, the stream equal to the whole answer for any split of the text, ids of 9 letters and
digits, and a forced `Sure.[TOOL_CALLS]...` end to end through the route methods over a real
in-process Launcher, whole and streamed."""

from __future__ import annotations

import asyncio
import json
import random
import re

import pytest

from launcher.serving.mistral_calls import MARKER, JsonValueEnd, MistralCallReader, read_whole
from launcher.serving.openai_protocol import ChatCompletionRequest, ProtocolError, parse_request
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


def read(reader: MistralCallReader) -> list[tuple[str, str]]:
    return [(call["function"]["name"], call["function"]["arguments"]) for call in reader.calls()]


def is_mistral_id(call_id: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9]{9}", call_id) is not None


@pytest.mark.parametrize("text, content, calls", WHOLE_TEXTS)
def test_whole_texts_are_read_as_vllms_mistral_parser_reads_them(text, content, calls):
    message = checks.assert_read_whole_as(MistralCallReader, read_whole, text, content, calls, is_mistral_id)
    assert all("index" not in call for call in message.get("tool_calls", []))
    reader = MistralCallReader()
    reader.push(text, True)
    assert reader.calls() == reader.message().get("tool_calls", [])  # made once: ids stay


@pytest.mark.parametrize("text", UNREAD_TEXTS + [BAD_AFTER_GOOD])
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
    """The text streamed in pieces cut at `cuts`: its content, its calls, its finish reason, and every
    delta; the reader's calls() are the calls it streamed."""
    reader = reader or MistralCallReader()
    content, calls, finish, deltas = checks.streamed_with_deltas(reader, text, cuts)
    assert reader.calls() == calls
    return content, calls, finish, deltas


@pytest.mark.parametrize("text", [text for text, _, _ in WHOLE_TEXTS] + UNREAD_TEXTS)
def test_streamed_over_any_split_the_answer_is_the_whole_answer(text):
    """Content and calls, reassembled from the deltas, are the whole reading's for 300 random splits
    (every character alone included); each call comes whole, in one delta, with its own index."""
    rng = random.Random(len(text))
    for cuts in [list(range(1, len(text))), []] + [random_cuts(rng, text) for _ in range(300)]:
        checks.assert_streamed_as_whole(MistralCallReader, text, cuts, is_mistral_id)
        streamed(text, cuts)  # and its calls() are the streamed ones


FRAGMENTS = ["[TOOL_CALLS]", "[TOOL_", "[ARGS]", "[AR", " ", "\n", "f", "get_x", "{", "}", "[", "]", '"', "\\", ":",
             ",", '"name"', '"arguments"', "1", "null", "x", "{}", '{"name": "f", "arguments": {"a": "]"}}', "é",
             "Hi "]


def test_random_texts_stream_as_they_read_whole():
    """Texts made of random pieces of the format (markers and their parts, brackets, quotes,
    escapes, calls): each streamed one character at a time and in random pieces says what the whole
    answer says, but where a v11 call that cannot be read follows a good one (the one exception)."""
    rng = random.Random(7)
    read_calls = exceptions = 0
    for _ in range(3000):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 10)))
        whole = read_whole(text)
        read_calls += bool(whole.calls)
        for cuts in [list(range(1, len(text)))] + [random_cuts(rng, text, 6) for _ in range(4)]:
            content, calls, _, _ = streamed(text, cuts)
            got = [(call["function"]["name"], call["function"]["arguments"]) for call in calls]
            if not whole.calls and got:  # the exception: a bad v11 call after a good one already sent
                after = text[text.find(MARKER) + len(MARKER):].lstrip()
                assert after[:1] not in "[{" and text.count(MARKER) > len(got), (text, cuts)
                exceptions += 1
                continue
            assert (content, got) == (whole.content or "", whole.calls), (text, cuts)
    assert read_calls > 30 and exceptions  # the texts do hold calls, and the exception


def test_content_holds_back_only_a_possible_marker_and_whitespace_before_a_call():
    reader = MistralCallReader()
    assert reader.delta("Hello [TOOL", False) == {"content": "Hello "}  # "[TOOL" may start the marker
    assert reader.delta("S] ", False) == {"content": "[TOOLS] "}  # it did not
    assert reader.delta("[TOOL_CALLS]", False) == {}
    assert reader.delta("weather[ARGS]{\"city\": ", False) == {}
    [call] = reader.delta('"Paris"} and words', False)["tool_calls"]  # its JSON closed: sent at once
    assert call["index"] == 0 and (call["function"]["name"], call["function"]["arguments"]) == PARIS
    assert reader.delta(" more words", False) == {}  # text after a call is no content
    assert reader.delta("[TOOL_CALLS]set_flag[ARGS]", False) == {}
    [call] = reader.delta("", True)["tool_calls"]  # no arguments: the call goes at the end, with "{}"
    assert (call["index"], call["function"]["name"], call["function"]["arguments"]) == (1, "set_flag", "{}")
    assert reader.finish_reason("stop") == "tool_calls" and reader.finish_reason("length") == "length"
    # content that is only whitespace waits: null if a call follows, sent when words do
    blank = MistralCallReader()
    assert blank.delta("\n ", False) == {} and blank.delta("\n", False) == {}
    assert blank.delta("Hi [TOOL_CALLS]", False) == {"content": "\n \nHi "}
    before_a_call = MistralCallReader()
    assert before_a_call.delta("\n", False) == {} and before_a_call.delta(V11[:20], False) == {}
    assert before_a_call.delta(V11[20:], True)["tool_calls"][0]["function"]["name"] == "weather"
    assert MistralCallReader().delta("  ", True) == {"content": "  "}  # no call came: the text as it is


def test_pre_v11_calls_go_out_together_when_the_json_closes():
    reader = MistralCallReader()
    assert reader.delta("Let me look. " + TWO_PRE_V11[:60], False) == {"content": "Let me look. "}
    assert reader.delta(TWO_PRE_V11[60:-1], False) == {}  # the array is still open
    calls = reader.delta("] ok" + V11, False)["tool_calls"]
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (0, *PARIS), (1, *FLAGGED)]
    assert reader.delta(" anything", True) == {} and reader.finish_reason("stop") == "tool_calls"


def test_a_bad_call_after_a_good_one_streams_the_sent_call_and_the_rest_as_content():
    """The one case a stream cannot say as the whole answer does (all content): the good call is
    already out when the bad one comes, so the text from the first marker after it goes as content."""
    for cuts in ([], list(range(1, len(BAD_AFTER_GOOD)))):
        content, calls, finish, _ = streamed(BAD_AFTER_GOOD, cuts)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [PARIS]
        assert content == "Ok." + "[TOOL_CALLS] [TOOL_CALLS]bad name[ARGS]{}after" and finish == "tool_calls"


def test_without_parallel_calls_only_the_first_call_is_kept_whole_and_streamed():
    """parallel_tool_calls false: vLLM keeps the first call of an "auto" answer, in both forms."""
    for text in ("Ok." + TWO_PRE_V11, "Ok." + V11 + FLAG_V11):
        whole = MistralCallReader(parallel_tool_calls=False)
        whole.push(text, True)
        assert read(whole) == [PARIS] and whole.message()["content"] == "Ok."
        for cuts in ([], list(range(1, len(text)))):
            content, calls, finish, _ = streamed(text, cuts, MistralCallReader(parallel_tool_calls=False))
            assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "weather")]
            assert content == "Ok." and finish == "tool_calls"
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
    """Streamed, the reader keeps the text it may still need (a possible marker, the open call), not
    the whole output: each piece's work is that piece's, whatever came before."""
    reader = MistralCallReader()
    for _ in range(2000):
        reader.delta("words and more words [TOOL", False)
        assert len(reader._open) < len(MARKER)
    reader.delta("_CALLS]weather[ARGS]{\"city\": \"", False)
    for _ in range(2000):
        assert reader.delta("ab", False) == {}
    assert reader._marker_text.value_end.in_string  # the value's end is searched over new pieces only
    [call] = reader.delta("\"} after", False)["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "ab" * 2000}
    for _ in range(2000):
        assert reader.delta("words after the call [TOOL", False) == {}
        assert len(reader._open) < len(MARKER) and reader._unsent == [] and reader._marker_text.held == []
    assert reader._marker_text.stage == "after"
    pre_v11 = MistralCallReader()
    pre_v11.delta(PRE_V11, False)
    for _ in range(2000):
        assert pre_v11.delta("ignored [TOOL_CALLS] words", False) == {}
    assert pre_v11._open == "" and pre_v11._unsent == [] and read(pre_v11) == [PARIS]


# ---- end to end --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_model_with_smollm2_tokenizer(tmp_path_factory.mktemp("mistral"))


def test_auto_reads_mistral_calls_whole_and_streamed(model_dir, in_process_cluster):
    """The model's text forced (structured_outputs regex) to `Sure.[TOOL_CALLS]weather[ARGS]{...}`
    and a second v11 call: the answer is the content "Sure." and two calls with Mistral's ids,
    finished by "tool_calls", for each of n=2 choices, whole and streamed."""
    from launcher.api import Launcher
    from tests.test_skip_special_tokens import answered, replica_over
    from tests.test_tokenize_routes import post

    route = "/v1/chat/completions"
    forced = {"regex": re.escape("Sure." + V11 + FLAG_V11)}  # SmolLM2 has no [TOOL_CALLS] token: plain text here
    body = {**BASE, "tools": TOOLS, "tool_choice": "auto", "structured_outputs": forced,
            "max_tokens": 80, "temperature": 1.0, "seed": 3, "n": 2}
    assert isinstance(parse_request(ChatCompletionRequest, body, "mistral").tool_call_reader(), MistralCallReader)
    with Launcher(model=model_dir, tp=1, max_num_seqs=4, progress=False, compile=False) as llm:
        server = replica_over(llm)

        async def both():
            server.tool_call_parser = None  # as a server started without the option
            with pytest.raises(ProtocolError) as refused:
                await server.chat_completions(post(route, body))
            server.tool_call_parser = "mistral"  # as OpenAIServer's constructor sets it from the settings
            return refused.value, await answered(server, route, body), await answered(server, route,
                                                                                      {**body, "stream": True})

        refused, whole, stream = asyncio.run(both())

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
