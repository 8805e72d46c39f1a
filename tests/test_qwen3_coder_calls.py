"""tool_choice "auto" with vLLM's "qwen3_coder" tool-call parser (launcher/serving/qwen3_coder_calls.py,
`corelaunch serve --tool-call-parser qwen3_coder`): whole texts read as vLLM 0.32's parser reads
well-formed blocks (the expected answers below were its own, from extract_tool_calls, but where the
module's doc says otherwise), values typed by the request's tool schemas as vLLM's
coerce_to_schema_type types them, the stream's argument pieces joining into the whole answer's
arguments text exactly for any split, what a stream cannot know yet (a block that breaks after its
call went out) written down, a stream that costs what its pieces cost, and a forced call end to end
through the route methods over a real in-process Launcher, whole and streamed."""

from __future__ import annotations

import functools
import json
import random
import time

import pytest

from launcher.serving.openai_protocol import ChatCompletionRequest, parse_request
from launcher.serving.qwen3_coder_calls import Qwen3CoderCallReader, read_whole
from launcher.serving.qwen3_coder_types import ToolSchemas, coerced, schema_types
from tests import call_reader_checks as checks
from tests.model_factory import random_model_with_smollm2_tokenizer
from tests.test_tool_calls import BASE, TOOLS

TYPED = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"}, "ok": {"type": "boolean"},
    "none": {"type": "null"}, "obj": {"type": "object"}, "arr": {"type": "array"}, "opt": {"type": ["integer", "null"]},
    "any": {}}}}},
         {"type": "function", "function": {"name": "no_schema"}}]
Reader = functools.partial(Qwen3CoderCallReader, tools=TYPED)


def whole(text: str):
    return read_whole(text, TYPED)


def block(name: str, *params: tuple[str, str]) -> str:
    """A call as Qwen3-Coder's chat template writes one."""
    written = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<tool_call>\n<function={name}>\n{written}</function>\n</tool_call>"


PARIS = block("get_weather", ("city", "Paris"), ("days", "3"))
PARIS_CALL = ("get_weather", '{"city": "Paris", "days": 3}')
OSLO = block("get_weather", ("city", "Oslo"))
OSLO_CALL = ("get_weather", '{"city": "Oslo"}')

# (text, content, calls): vLLM 0.32's Qwen3EngineToolParser gave these calls for each text
WHOLE_TEXTS = [
    ("Sure.\n" + PARIS, "Sure.\n", [PARIS_CALL]),  # vLLM strips the content ("Sure.")
    (PARIS, None, [PARIS_CALL]),
    (PARIS + "\n" + OSLO + " after", None, [PARIS_CALL, OSLO_CALL]),  # text between and after: none
    (block("get_weather", ("city", " Paris "), ("days", "3.5"), ("temp", "3.0"), ("ok", "1"), ("none", "NULL"),
           ("obj", '{"a": 1}'), ("arr", "[1, 2"), ("opt", "null"), ("any", "7"), ("extra", "5")), None,
     [("get_weather", '{"city": " Paris ", "days": 3.5, "temp": 3, "ok": true, "none": null, "obj": {"a": 1}, '
                      '"arr": "[1, 2", "opt": null, "any": "7", "extra": "5"}')]),
    (block("get_weather", ("temp", "2.5"), ("ok", "yes"), ("days", "abc"), ("obj", "[1]"), ("arr", '{"x":1}'),
           ("temp2", "x")), None,
     [("get_weather", '{"temp": 2.5, "ok": "yes", "days": "abc", "obj": [1], "arr": {"x": 1}, "temp2": "x"}')]),
    (block("get_weather", ("temp", "1e999"), ("arr", "[1e999]"), ("days", "1_000"), ("opt", "NaN")), None,
     [("get_weather", '{"temp": "1e999", "arr": "[1e999]", "days": 1000, "opt": "NaN"}')]),
    (block("no_schema", ("a", "1"), ("b", "true")), None, [("no_schema", '{"a": "1", "b": "true"}')]),
    (block("not_a_tool", ("x", "1")), None, [("not_a_tool", '{"x": "1"}')]),  # vLLM checks no name
    (block("get_weather", ("city", "\n\nTwo\n\n")), None, [("get_weather", '{"city": "\\n\\nTwo\\n\\n"}')]),
    (block("get_weather", ("city", "a<b>c </para")), None, [("get_weather", '{"city": "a<b>c </para"}')]),
    ("<tool_call><function=get_weather><parameter=city>Paris</parameter></function></tool_call>", None,
     [("get_weather", '{"city": "Paris"}')]),
    ("<tool_call>\n<function=get_weather>\n</function>\n</tool_call>", None, [("get_weather", "{}")]),
    (block("get_weather", ("city", "été ☀"), ("obj", '{"q": "\\"x\\""}')), None,
     [("get_weather", '{"city": "été ☀", "obj": {"q": "\\"x\\""}}')]),
    # cut inside a block (max_tokens, a stop string): the call is kept once its name is whole
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n", None,
     [("get_weather", '{"city": "Paris"}')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n<parameter=temp>\n2", None,
     [("get_weather", '{"days": 3}')]),  # a typed value cut short is dropped, as vLLM drops it
    ("<tool_call>\n<function=get_weather>\n</function>\n</tool_", None, [("get_weather", "{}")]),
    ("<tool_call>\n<function=get_weather>\n<parameter=ci", None, [("get_weather", "{}")]),
    # tags a model left out: a value ends at the next parameter or the call's end, a block at the next
    # block or other text after </function>, and whitespace before a key is none (vLLM's \s*)
    ("<tool_call>\n<function=get_weather>\n</function>\nstray</tool_call>", None, [("get_weather", "{}")]),
    ("<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n<parameter=city>\nx\n</parameter>\n</function>\n"
     "</tool_call>", None, [("get_weather", '{"days": 3, "city": "x"}')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nx\n</function>\n</tool_call>\n" + OSLO, None,
     [("get_weather", '{"city": "x"}'), OSLO_CALL]),  # vLLM drops the value cut by </function>: {}
    (PARIS.removesuffix("</tool_call>") + OSLO, None, [PARIS_CALL, OSLO_CALL]),
    (PARIS.removesuffix("</tool_call>") + "Done", None, [PARIS_CALL]),
    ("<tool_call>\n<function=get_weather>\n<parameter= days>\n3\n</parameter>\n</function>\n</tool_call>", None,
     [("get_weather", '{"days": 3}')]),
    ("Just text.", "Just text.", []),
    ("ends with <tool_ca", "ends with <tool_ca", []),
    ("", "", []),
]
# where this reader differs from vLLM's on purpose (the module's doc): a string value cut short is
# kept as written so far (vLLM's whole reading drops it, its stream has sent it)
CUT_STRING = ("<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n<parameter=city>\nPar",
              None, [("get_weather", '{"days": 3, "city": "Par"}')])
# a block that is not a call in this form: the whole text is content (vLLM skips such text, or reads
# a call out of it)
UNREAD_TEXTS = [
    "text <tool_call> not a call </tool_call> more",
    "<function=get_weather>\n<parameter=city>\nA\n</parameter>\n</function>",  # no <tool_call>
    "<tool_call>\n<function=>\n</function>\n</tool_call>",  # no name
    "<tool_call>\n<function=get<weather>\n</function>\n</tool_call>",
    "So <tool_call>\n<function=get_wea",  # cut before the name closed
    "tail <tool_call>",
    "<tool_call></tool_call>",
]
# blocks that break after their call went out (the whole answer: all content): the calls a stream has
# sent by then, with their arguments closed as sent
BROKEN_AFTER_ANNOUNCED = {
    "Ok.<tool_call>\n<function=get_weather>\nstray\n</function>\n</tool_call>": [("get_weather", "{}")],
    "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\nstray": [("get_weather", '{"days": 3}')],
    PARIS + "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>x</function></tool_call>":
        [PARIS_CALL, OSLO_CALL],
    "Hi " + PARIS + "<tool_call>\n<function=get_weather": [PARIS_CALL],  # a later block cut before its name closed
}


@pytest.mark.parametrize("text, content, calls", WHOLE_TEXTS + [CUT_STRING])
def test_whole_texts_are_read_as_vllms_qwen3_coder_parser_reads_them(text, content, calls):
    checks.assert_read_whole_as(Reader, whole, text, content, calls)


@pytest.mark.parametrize("text", UNREAD_TEXTS + list(BROKEN_AFTER_ANNOUNCED))
def test_a_block_without_a_call_makes_the_whole_text_content(text):
    checks.assert_all_content(Reader, whole, text)


def test_values_take_the_types_vllm_gives_them():
    """coerce_to_schema_type's order (null, integer, number, boolean, object/array, string), its
    fallback (the JSON the text is, else the text) and extract_types_from_schema's reading."""
    assert schema_types({}) == {"string"} and schema_types({"type": "Int"}) == {"integer"}
    assert schema_types({"enum": [1, "a", None, True]}) == {"integer", "string", "null", "boolean"}
    assert schema_types({"anyOf": [{"type": "integer"}, {}]}) == {"integer", "string"}  # a bare branch: string
    assert schema_types({"oneOf": [{"type": "array"}, {"allOf": [{"type": "object"}]}]}) == {"array", "object"}
    deep = {"type": "integer"}
    for _ in range(5000):  # no recursion: nested branches past Python's limit
        deep = {"anyOf": [deep]}
    assert schema_types(deep) == {"integer"}
    table = [("3", {"integer"}, 3), (" 3 ", {"integer"}, 3), ("3.5", {"integer"}, 3.5), ("3.0", {"number"}, 3),
             ("x", {"number"}, "x"), ("inf", {"number"}, "inf"), ("TRUE", {"boolean"}, True), ("0", {"boolean"}, False),
             ("Null", {"null", "integer"}, None), ("7", {"null", "integer"}, 7), ("null", {"string"}, "null"),
             ("[1,2]", {"array"}, [1, 2]), ('{"a": [1, ', {"object"}, '{"a": [1, '), ("5", {"object"}, 5),
             ("1", {"string", "integer"}, 1), ('"q"', {"anything"}, "q"), ("word", {"anything"}, "word"),
             ("[" * 200 + "]" * 200, {"array"}, "[" * 200 + "]" * 200), ("1" * 5000, {"integer"}, "1" * 5000)]
    for text, types, value in table:
        assert coerced(text, types) == value and type(coerced(text, types)) is type(value), (text, types)
    schemas = ToolSchemas(TYPED)
    assert schemas.stays_text({"type": "string"}) and schemas.stays_text(None) and schemas.stays_text({})
    assert not schemas.stays_text({"type": ["string", "null"]}) and not schemas.stays_text({"type": "integer"})
    assert schemas.properties("no_schema") == {} and schemas.properties("other") == {}


def assert_streamed_exactly_as_whole(text: str, cuts: list[int]) -> None:
    """Content, calls (names, and arguments the very text of the whole answer's) and finish reason."""
    reading = whole(text)
    content, calls, finish = checks.streamed(Reader, text, cuts)
    assert content == (reading.content or ""), (text, cuts)
    assert [call["index"] for call in calls] == list(range(len(calls)))
    assert checks.named(calls) == reading.calls, (text, cuts)
    assert finish == ("tool_calls" if reading.calls else "stop")


@pytest.mark.parametrize("text", [text for text, _, _ in WHOLE_TEXTS + [CUT_STRING]] + UNREAD_TEXTS)
def test_streamed_over_any_split_the_answer_is_the_whole_answer(text):
    """For 300 random splits (every character alone included): the arguments' pieces join into the
    whole answer's arguments text, not only the same JSON."""
    rng = random.Random(len(text))
    for cuts in [list(range(1, len(text))), []] + [checks.random_cuts(rng, text) for _ in range(300)]:
        assert_streamed_exactly_as_whole(text, cuts)
    checks.assert_streamed_as_whole(Reader, text, checks.random_cuts(rng, text))


def test_random_texts_stream_as_they_read_whole():
    """Texts made of the format's tags, pieces of them and values, split at random: the stream says
    what the whole answer says, but where a block broke after its call went out (the whole answer all
    content): then the stream's content is the text before the first block and from the bad one on."""
    parts = ["<tool_call>", "</tool_call>", "<function=get_weather>", "<function=", "</function>", "<parameter=days>",
             "<parameter=city>", "<parameter=obj>", "</parameter>", "</param", "<tool_", "\n", "3", "Paris", " ",
             '{"a":', "1}", ">", "<"]
    rng = random.Random(7)
    broke = 0
    for _ in range(3000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 14)))
        content, calls, finish = checks.streamed(Reader, text, checks.random_cuts(rng, text))
        reading = whole(text)
        if calls and not reading.calls:
            broke += 1
            before = text[:text.find("<tool_call>")]
            assert content.startswith(before) and text.endswith(content[len(before):]), text
        else:
            assert content == (reading.content or "") and checks.named(calls) == reading.calls, text
    assert broke  # the texts reach that case too


@pytest.mark.parametrize("text", list(BROKEN_AFTER_ANNOUNCED))
def test_a_block_that_breaks_after_its_call_went_out_keeps_the_call_and_sends_its_text(text):
    """What no stream can know in time: the whole answer is all content; a stream that has announced
    the call (its arguments closed as sent) sends the text from the bad block on as content. A piece
    in which the call would be announced and its block breaks announces nothing (a gathered delta,
    stream_interval's, told the call and its text as content in one chunk)."""
    rng = random.Random(len(text))
    assert whole(text).calls == []
    announced = 0
    for cuts in [list(range(1, len(text))), []] + [checks.random_cuts(rng, text) for _ in range(100)]:
        content, calls, finish = checks.streamed(Reader, text, cuts)
        named = checks.named(calls)  # all, or all but the bad block's (announced in the piece it broke in)
        assert named in (BROKEN_AFTER_ANNOUNCED[text], BROKEN_AFTER_ANNOUNCED[text][:-1]), cuts
        before = text[:text.find("<tool_call>")] if named else ""  # then the text from the bad block on
        assert content.startswith(before) and text.endswith(content[len(before):]) and content != before
        assert finish == ("tool_calls" if named else "stop"), cuts
        announced += named == BROKEN_AFTER_ANNOUNCED[text]
    assert announced > 0  # a character a piece, every call went out before its block broke


def test_a_call_streams_one_parameter_at_a_time_and_text_as_it_comes():
    """The call at its name; a typed value once its parameter closes; a string-typed one as it comes,
    its last newline held until the next character says it is not the trimmed one."""
    reader = Reader()
    assert reader.delta("Sure.\n<tool_call>\n<function=get_wea", False) == {"content": "Sure.\n"}
    [first] = reader.delta("ther>\n<parameter=days>\n", False)["tool_calls"]
    assert set(first) == {"index", "id", "type", "function"} and first["function"] == {"name": "get_weather",
                                                                                       "arguments": ""}
    more = lambda piece, finished=False: [entry["function"]["arguments"]
                                          for entry in reader.delta(piece, finished).get("tool_calls", [])]
    assert more("3\n</param") == []  # a typed value goes out whole
    assert more("eter>\n<parameter=city>") == ['{"days": 3, "city": "']  # one entry per call and delta
    assert more("\nPa") == ["Pa"]
    assert more('ris "x"\n') == ['ris \\"x\\"']  # the newline may be the trimmed last one
    assert more("\nend\n</para") == ["\\n\\nend"]
    assert more("meter>\n</function>\n</tool_call>", True) == ['"}']
    assert checks.named(reader.calls()) == [("get_weather", '{"days": 3, "city": "Paris \\"x\\"\\n\\nend"}')]
    assert checks.named(reader.calls()) == whole(reader.text).calls and reader.finish_reason("stop") == "tool_calls"


def test_content_holds_back_only_a_possible_tag():
    reader = Reader()
    assert reader.delta("Hello <tool", False) == {"content": "Hello "}
    assert reader.delta("kit> ", False) == {"content": "<toolkit> "}
    assert reader.delta("done", True) == {"content": "done"} and reader.finish_reason("stop") == "stop"


def test_without_parallel_calls_only_the_first_call_is_kept_whole_and_streamed():
    text = "Ok." + PARIS + OSLO
    reader = Reader(parallel_tool_calls=False)
    reader.push(text, True)
    assert checks.named(reader.message()["tool_calls"]) == [PARIS_CALL]
    content, calls, finish = checks.streamed(Reader, text, list(range(1, len(text), 3)), parallel=False)
    assert checks.named(calls) == [PARIS_CALL] and calls[0]["index"] == 0 and content == "Ok."
    assert finish == "tool_calls"


def test_the_request_picks_the_reader_with_its_tools():
    """ToolUse.reader hands the request's tools to this reader (the other readers take none)."""
    body = {**BASE, "tools": TYPED, "tool_choice": "auto", "parallel_tool_calls": False}
    reader = parse_request(ChatCompletionRequest, body, "qwen3_coder").tool_call_reader()
    assert isinstance(reader, Qwen3CoderCallReader) and reader.parallel_tool_calls is False
    assert reader.tools == TYPED
    reader.push(block("get_weather", ("days", "2")), True)
    assert checks.named(reader.message()["tool_calls"]) == [("get_weather", '{"days": 2}')]
    hermes = parse_request(ChatCompletionRequest, {**BASE, "tools": TYPED}, "hermes").tool_call_reader()
    assert not hasattr(hermes, "tools")


def test_the_stream_keeps_only_what_is_not_settled():
    """A long content and a long string value in 2-character pieces: after every piece the reader
    holds at most a tag's length of unsettled text (each search covers the new piece and that tail:
    the work per piece is the piece's, where a whole-text search per piece was quadratic). The speed
    itself is in README's Measured table."""
    reader = Reader()
    for _ in range(5000):
        reader.delta("ab", False)
        assert len(reader._open) < len("<tool_call>")
    reader.delta("<tool_call>\n<function=get_weather>\n<parameter=city>\n", False)
    for _ in range(5000):
        reader.delta("a\n", False)
        assert len(reader._open) < len("</parameter>") and len(reader._run) == 0
    reader.delta("</parameter>\n</function>\n</tool_call>", True)
    assert json.loads(reader.calls()[0]["function"]["arguments"]) == {"city": "a\n" * 4999 + "a"}


def test_the_whole_reading_grows_with_the_text():
    """One piece of many parameters: 10x the parameters take about 10x the time (a search to the
    text's end per parameter made it ~100x); best of three, the collector off, and a margin of 3x
    for a loaded machine."""
    import gc

    def read(parameters: int) -> float:
        text = block("f", *[(f"p{i}", str(i)) for i in range(parameters)])
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            assert len(json.loads(whole(text).calls[0][1])) == parameters
            best = min(best, time.perf_counter() - started)
        return best

    gc.disable()
    try:
        small, large = read(2000), read(20000)
    finally:
        gc.enable()
    assert large < small * 10 * 3, (small, large)


# ---- end to end --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_model_with_smollm2_tokenizer(tmp_path_factory.mktemp("qwen3_coder"))


def test_auto_reads_qwen3_coder_calls_whole_and_streamed(model_dir, in_process_cluster):
    """The model's text forced to two blocks, the request's own tools typing the values (set_flag's
    ok a boolean): no content and two calls, "tool_calls", whole and streamed, n=2."""
    assert TOOLS[0]["function"]["parameters"]["properties"]["ok"] == {"type": "boolean"}  # the fixture's typing
    text = block("weather", ("city", "Paris")) + "\n" + block("set_flag", ("ok", "true"))
    checks.assert_forced_calls_end_to_end(model_dir, "qwen3_coder", Qwen3CoderCallReader, text,
                                          [("weather", '{"city": "Paris"}'), ("set_flag", '{"ok": true}')])
