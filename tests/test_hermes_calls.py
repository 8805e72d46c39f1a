"""tool_choice "auto" with vLLM's "hermes" tool-call parser (launcher/serving/hermes_calls.py,
`corelaunch serve --tool-call-parser hermes`): whole texts read as vLLM 0.32's Hermes2ProToolParser
reads them, the stream equal to the whole answer for any split of the text (each call's arguments
streamed as they are written; what a stream cannot know yet, a block that breaks after its call
went out, written down), the option on the
command line and as a builder argument, and a forced `Sure.<tool_call>...</tool_call>` end to end
through the route methods over a real in-process Launcher, whole and streamed."""

from __future__ import annotations

import json
import random
import re

import pytest

from launcher.serving.hermes_calls import HermesCallReader, blocks, read_whole
from launcher.serving.openai_protocol import ChatCompletionRequest, ProtocolError, parse_request
from tests import call_reader_checks as checks
from tests.call_reader_checks import random_cuts
from tests.model_factory import random_model_with_smollm2_tokenizer
from tests.test_tool_calls import BASE, TOOLS, streamed_calls

WEATHER = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
FLAG_CALL = '<tool_call>{"name":"set_flag","arguments":{"ok":true,"note":"été"}}</tool_call>'
PARIS = ("weather", '{"city": "Paris"}')
FLAGGED = ("set_flag", '{"ok": true, "note": "été"}')  # written back as json.dumps writes it, non-ASCII kept

# (text, content, calls) as vLLM's whole reading gives them
WHOLE_TEXTS = [
    ("Sure." + WEATHER, "Sure.", [PARIS]),
    (WEATHER, None, [PARIS]),  # nothing before the call: content null
    (WEATHER + "\n" + FLAG_CALL, None, [PARIS, FLAGGED]),
    ("Let me look.\n" + WEATHER + " and then " + FLAG_CALL + " done", "Let me look.\n", [PARIS, FLAGGED]),
    ("a <tool" + WEATHER, "a <tool", [PARIS]),  # a partial tag before the real one is content
    ('x<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n', "x", [PARIS]),  # unterminated, whole
    (WEATHER + '<tool_call> {"name": "set_flag", "arguments": {"ok": true, "note": "été"}} ', None, [PARIS, FLAGGED]),
    ('<tool_call>{"name": "weather", "arguments": "Paris"}</tool_call>', None, [("weather", '"Paris"')]),  # any JSON value
    ('<tool_call>{"name": "weather", "arguments": null}</tool_call>', None, [("weather", "null")]),
    ("Just text.", "Just text.", []),
    ("ends with <tool_ca", "ends with <tool_ca", []),
    ("", "", []),
]
# a block that holds no call: the whole text is content, no call (vLLM's fallback)
UNREAD_TEXTS = [
    'Hi<tool_call>{"name": "weather", "arguments": {</tool_call>',  # invalid JSON
    '<tool_call>{"name": "weather"}</tool_call>',  # no arguments
    '<tool_call>{"name": "f", "arguments": {"x": ' + "1" * 5000 + '}}</tool_call>',  # past Python's digit limit
    '<tool_call>{"name": 7, "arguments": {}}</tool_call>',  # name not a string
    '<tool_call>["weather", {}]</tool_call>',
    "<tool_call></tool_call>",
    'So<tool_call>\n{"name": "weather", "argu',  # cut short inside the JSON
    '<tool_call>{"name": "weather", "arguments": {}}</tool_',  # cut inside the closing tag (vLLM's regex takes it)
    "tail <tool_call>",
    "Hm<tool_call>" + WEATHER,  # the first block runs to the first closing tag: two openings in one block
]
BAD_AFTER_GOOD = "Ok." + WEATHER + '<tool_call>{"name": "x"}</tool_call>after'
# blocks the whole reading refuses once their call has gone out (its name closed, its arguments
# begun): the names of the calls a stream has sent by then
BROKEN_AFTER_ANNOUNCED = {
    UNREAD_TEXTS[0]: ["weather"],  # the JSON breaks inside the arguments
    UNREAD_TEXTS[2]: ["f"],  # a number Python's decoder refuses
    UNREAD_TEXTS[7]: ["weather"],  # cut inside the closing tag: the block's text is no JSON
}


@pytest.mark.parametrize("text, content, calls", WHOLE_TEXTS)
def test_whole_texts_are_read_as_vllms_hermes_parser_reads_them(text, content, calls):
    checks.assert_read_whole_as(HermesCallReader, read_whole, text, content, calls)


@pytest.mark.parametrize("text", UNREAD_TEXTS + [BAD_AFTER_GOOD])
def test_a_block_without_a_call_makes_the_whole_text_content(text):
    checks.assert_all_content(HermesCallReader, read_whole, text)


def test_blocks_are_found_as_vllms_pattern_finds_them():
    """blocks() against the pattern vLLM's parser uses, over random texts made of tags and pieces of them."""
    pattern = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
    parts = ["<tool_call>", "</tool_call>", "<tool_", "</tool", "call>", "a", "\n", "{}", " "]
    rng = random.Random(3)
    for _ in range(3000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 9)))
        expected = [first if first else second for first, second in pattern.findall(text)]
        assert blocks(text) == expected, text


def streamed(text: str, cuts: list[int]) -> tuple[str, list[dict], str, list[dict]]:
    """The text streamed in pieces cut at `cuts`: its content, its calls, its finish reason, and every delta."""
    return checks.streamed_with_deltas(HermesCallReader(), text, cuts)


@pytest.mark.parametrize("text", [text for text, _, _ in WHOLE_TEXTS]
                         + [text for text in UNREAD_TEXTS if text not in BROKEN_AFTER_ANNOUNCED])
def test_streamed_over_any_split_the_answer_is_the_whole_answer(text):
    """Content and calls, reassembled from the deltas (names, and arguments holding the same JSON),
    are the whole reading's for 300 random splits (every character alone included)."""
    rng = random.Random(len(text))
    for cuts in [list(range(1, len(text))), []] + [random_cuts(rng, text) for _ in range(300)]:
        checks.assert_streamed_as_whole(HermesCallReader, text, cuts)


@pytest.mark.parametrize("text", list(BROKEN_AFTER_ANNOUNCED))
def test_a_block_that_breaks_after_its_call_went_out_keeps_the_call_and_sends_its_text(text):
    """What no stream can know in time: the whole answer is all content; a stream that has announced
    the call sends the text from the block on as content, so its content is the whole answer's. A
    piece in which the call would be announced and its block breaks announces nothing (a gathered
    delta, stream_interval's, told the call and its text as content in one chunk): in one piece,
    the stream is the whole answer."""
    rng = random.Random(len(text))
    assert read_whole(text).calls == []
    announced = 0
    for cuts in [list(range(1, len(text))), []] + [random_cuts(rng, text) for _ in range(100)]:
        content, calls, finish, _ = streamed(text, cuts)
        assert content == text
        names = [call["function"]["name"] for call in calls]
        assert names in ([], BROKEN_AFTER_ANNOUNCED[text]), cuts
        assert finish == ("tool_calls" if names else "stop"), cuts  # "tool_calls" where a call went out
        announced += bool(names)
    assert streamed(text, [])[1] == [] and announced > 0  # one piece: nothing announced; a character a piece: it is


def test_a_long_argument_streams_piece_by_piece():
    """The call goes out once its name has closed and its arguments have begun; each later piece of
    the arguments follows at once, as written (the whole answer: the same JSON)."""
    reader = HermesCallReader()
    assert reader.delta('Sure.<tool_call>\n{"name": "weather", ', False) == {"content": "Sure."}
    [first] = reader.delta('"arguments": {"ci', False)["tool_calls"]
    assert set(first) == {"index", "id", "type", "function"} and first["index"] == 0
    assert first["function"] == {"name": "weather", "arguments": '{"ci'}
    assert reader.delta('ty": "Pa', False) == {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Pa'}}]}
    assert reader.delta('ris"}}\n</tool', False) == {"tool_calls": [{"index": 0, "function": {"arguments": 'ris"}'}}]}
    assert reader.delta('_call>', True) == {}
    assert reader.calls()[0]["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    assert reader.finish_reason("stop") == "tool_calls"


def test_arguments_written_before_the_name_go_out_once_the_name_has_closed():
    reader = HermesCallReader()
    assert reader.delta('<tool_call>{"arguments": {"city": "Paris"}, ', False) == {}
    [call] = reader.delta('"name": "weather"', False)["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    assert reader.delta("}</tool_call>", True) == {}


def test_content_holds_back_only_a_possible_tag_and_a_call_goes_out_as_it_is_written():
    reader = HermesCallReader()
    assert reader.delta("Hello <tool", False) == {"content": "Hello "}  # "<tool" may open a call
    assert reader.delta("kit> ", False) == {"content": "<toolkit> "}  # it did not
    assert reader.delta("<tool_call>\n{\"name\": \"weather\", ", False) == {}
    [call] = reader.delta('"arguments": {"city": "Paris"}}\n</tool_', False)["tool_calls"]  # before it closes
    assert call["index"] == 0 and (call["function"]["name"], call["function"]["arguments"]) == PARIS
    assert reader.delta("call> trailing words", False) == {}
    assert reader.delta(" more", True) == {}  # text after a call is no content
    assert reader.finish_reason("stop") == "tool_calls" and reader.finish_reason("length") == "length"
    # an unterminated last block goes out at the end, when its JSON is whole
    tail = HermesCallReader()
    assert tail.delta('<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}', False)["tool_calls"]
    assert tail.delta("", True) == {}
    assert checks.named(tail.calls()) == [PARIS] and tail.finish_reason("stop") == "tool_calls"


def test_a_bad_block_after_a_good_one_streams_the_sent_call_and_the_rest_as_content():
    """The one case a stream cannot say as the whole answer does (all content): the good call is
    already out when the bad block comes, so the text from the bad block on follows as content."""
    for cuts in ([], list(range(1, len(BAD_AFTER_GOOD)))):
        content, calls, finish, _ = streamed(BAD_AFTER_GOOD, cuts)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [PARIS]
        assert content == "Ok." + '<tool_call>{"name": "x"}</tool_call>after' and finish == "tool_calls"


# ---- the request and the server's option ---------------------------------------------------------
def chat(parser: str | None = None, **fields) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {**BASE, **fields}, parser)


def test_auto_is_refused_without_a_parser_naming_the_option():
    for fields in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        with pytest.raises(ProtocolError) as refused:
            chat(**fields)
        assert refused.value.status == 400 and refused.value.param == "tool_choice"
        message = refused.value.message
        assert "--tool-call-parser NAME" in message and "tool_choice \"auto\"" in message
        assert all(f"{name}, " in message for name in ("hermes", "llama3_json", "mistral", "pythonic",
                                                       "qwen3_coder"))  # with formats


def test_with_the_hermes_parser_auto_is_taken_and_decodes_special_tokens():
    for fields in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"},
                   {"tools": TOOLS, "tool_choice": "auto", "skip_special_tokens": True},
                   {"tools": TOOLS, "structured_outputs": {"regex": "a+"}},  # vLLM allows both
                   {"tools": TOOLS, "response_format": {"type": "json_object"}}):
        request = chat("hermes", **fields)
        assert isinstance(request.tool_call_reader(), HermesCallReader) and request.template_tools() == TOOLS
        assert request.skip_special_tokens is False  # vLLM's rule: a <tool_call> special token must survive
    assert chat("hermes", tools=TOOLS, structured_outputs={"regex": "a+"}).sampling().structured_output.regex == "a+"
    # the rest as before: text, or forced calls, special tokens skipped unless asked
    for fields in ({}, {"tools": TOOLS, "tool_choice": "none"}, {"tools": TOOLS, "tool_choice": "required"}):
        request = chat("hermes", **fields)
        assert request.skip_special_tokens is True and not isinstance(request.tool_call_reader(), HermesCallReader)
    assert chat("hermes", skip_special_tokens=False).skip_special_tokens is False
    with pytest.raises(ProtocolError, match="needs tools"):
        chat("hermes", tool_choice="auto")


def test_the_tool_call_parser_option_and_builder_argument():
    from launcher.cli import build_parser
    from launcher.cli.serve_command import server_args
    from launcher.serving.server_settings import SERVER_ARGS, settings_from_args

    assert settings_from_args({}).tool_call_parser is None
    assert settings_from_args({"tool_call_parser": "hermes"}).tool_call_parser == "hermes"  # `serve run` text
    assert settings_from_args({"tool_call_parser": "null"}).tool_call_parser is None  # YAML's null: the default
    assert settings_from_args({"tool_call_parser": "mistral"}).tool_call_parser == "mistral"
    with pytest.raises(ValueError, match=r"tool_call_parser \('granite'\) must be one of hermes, llama3_json, "
                                         r"mistral, pythonic, qwen3_coder \(the format .*: hermes, <tool_call>"):
        settings_from_args({"tool_call_parser": "granite"})
    flags = {k: "--" + k.replace("_", "-") for k in SERVER_ARGS}
    serve = lambda *argv: settings_from_args(server_args(build_parser().parse_args(["serve", *argv])), flags)
    assert serve("--tool-call-parser", "hermes").tool_call_parser == "hermes" and serve().tool_call_parser is None
    with pytest.raises(ValueError, match=r"--tool-call-parser \('x'\) must be one of hermes"):
        settings_from_args({"tool_call_parser": "x"}, flags)
    with pytest.raises(SystemExit):  # argparse's choices
        build_parser().parse_args(["serve", "--tool-call-parser", "granite"])


# ---- end to end --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_model_with_smollm2_tokenizer(tmp_path_factory.mktemp("hermes"))


def test_auto_reads_a_hermes_call_whole_and_streamed(model_dir, in_process_cluster):
    """The model's text forced (structured_outputs regex) to `Sure.<tool_call>...</tool_call>`: the
    answer is the content "Sure." and one call, finished by "tool_calls", for each of n=2 choices."""
    forced = {"regex": re.escape("Sure." + WEATHER)}  # SmolLM2 has no <tool_call> token: plain text here
    body = {**BASE, "tools": TOOLS, "tool_choice": "auto", "structured_outputs": forced,
            "max_tokens": 80, "temperature": 1.0, "seed": 3, "n": 2}
    refused, whole, stream = checks.answered_with_parser(model_dir, "hermes", body, refused_without=True)

    assert refused.param == "tool_choice" and "--tool-call-parser NAME" in refused.message
    assert len(whole["choices"]) == 2
    for choice in whole["choices"]:
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
        [call] = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        assert call["function"]["name"] == "weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    calls, finishes, contents = streamed_calls(stream, 2)
    assert finishes == ["tool_calls", "tool_calls"] and contents == ["Sure.", "Sure."]
    assert [[call["function"] for call in choice_calls] for choice_calls in calls] == [
        [call["function"] for call in choice["message"]["tool_calls"]] for choice in whole["choices"]]
    assert not any("<tool_call>" in (c["delta"].get("content") or "") for chunk in stream for c in chunk["choices"])


def test_without_parallel_calls_only_the_first_call_is_kept_whole_and_streamed():
    """parallel_tool_calls false: vLLM keeps the first call of an "auto" answer."""
    text = "Ok." + WEATHER + FLAG_CALL
    whole = HermesCallReader(parallel_tool_calls=False)
    whole.push(text, True)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole.message()["tool_calls"]] == [PARIS]
    streamed_reader = HermesCallReader(parallel_tool_calls=False)
    deltas = [streamed_reader.delta(text[i:i + 7], i + 7 >= len(text)) for i in range(0, len(text), 7)]
    calls = checks.reassembled([call for delta in deltas for call in delta.get("tool_calls", [])])
    assert checks.named(calls) == [PARIS] and calls[0]["index"] == 0
    assert "".join(d.get("content", "") for d in deltas) == "Ok." and streamed_reader.finish_reason("stop") == "tool_calls"
    assert parse_request(ChatCompletionRequest, {**BASE, "tools": TOOLS, "tool_choice": "auto",
                                                 "parallel_tool_calls": False},
                         "hermes").tool_call_reader().parallel_tool_calls is False


def test_the_stream_keeps_only_what_is_not_settled():
    """Streamed, the reader keeps the text it may still need (a possible tag, the open block), not
    the whole output: each piece's work is that piece's, whatever came before."""
    reader = HermesCallReader()
    for _ in range(2000):
        reader.delta("words and more words <tool", False)
        assert len(reader._open) < len("<tool_call>")
    reader.delta("_call>{\"name\": \"weather\", \"arguments\": {\"city\": \"", False)
    for _ in range(2000):
        reader.delta("ab", False)
        assert len(reader._open) < len("</tool_call>")  # the block's read text is kept apart, in pieces
    assert len(reader._block_read) > 2000 and "".join(reader._block_read).endswith("ab" * 2000)
    assert reader.delta("\"}}</tool_call> after", True) == {"tool_calls": [{"index": 0, "function": {"arguments": '"}'}}]}
    assert json.loads(reader.calls()[0]["function"]["arguments"]) == {"city": "ab" * 2000}
    assert len(reader._block_stream._kept) < 10  # the scan of the block keeps no argument text it sent
    assert len(reader._open) < len("<tool_call>")
