"""tool_choice "auto" with vLLM's "pythonic" tool-call parser (launcher/serving/pythonic_calls.py,
`corelaunch serve --tool-call-parser pythonic`): whole texts read as vLLM 0.32's PythonicToolParser
reads them (rows checked against it; but for the documented differences: text after the list
ignored, no regex pre-check, positional arguments, `**kwargs` and repeated keywords refused), never
evaluated and safe against deep or huge texts, the stream equal to the whole answer for any split of
the text, and a forced `[weather(...), set_flag(...)]` end to end through the route methods over a
real in-process Launcher, whole and streamed."""

from __future__ import annotations

import json
import random
import time

import pytest

from launcher.serving.call_json import MAX_DEPTH
from launcher.serving.openai_protocol import ChatCompletionRequest, parse_request
from launcher.serving.pythonic_calls import PythonicCallReader, read_whole
from tests import call_reader_checks as checks
from tests.call_reader_checks import named, random_cuts
from tests.model_factory import random_model_with_smollm2_tokenizer
from tests.test_tool_calls import BASE, TOOLS

WEATHER = '[weather(city="Paris")]'
TWO = '[weather(city="Paris"), set_flag(ok=True, note="été")]'
PARIS = ("weather", '{"city": "Paris"}')
FLAGGED = ("set_flag", '{"ok": true, "note": "été"}')  # json.dumps writes it back, non-ASCII kept

# (text, calls) as vLLM 0.32's PythonicToolParser reads the whole text (run from /work/peers/vllm with a
# stub tokenizer): content null beside the calls
WHOLE_CALLS = [
    (WEATHER, [PARIS]),
    (TWO, [PARIS, FLAGGED]),
    ('[get_weather(city="Paris", unit="c"), get_time()]',
     [("get_weather", '{"city": "Paris", "unit": "c"}'), ("get_time", "{}")]),
    ("[f()]", [("f", "{}")]),
    (WEATHER + "\n", [PARIS]),
    (WEATHER + "\nprint(2)", [PARIS]),  # vLLM reads the first statement
    (WEATHER + "; x = 1", [PARIS]),
    (WEATHER + "\n[g(y=2)]", [PARIS]),
    ('[f(x=1), a.b()]', [("f", '{"x": 1}'), ("a.b", "{}")]),  # dotted names kept whole
    ("[f(x=True, y=None, z=false, w=null)]", [("f", '{"x": true, "y": null, "z": false, "w": null}')]),
    ("[f(x=-1, y=+2.5, z=--3, w=-(4))]", [("f", '{"x": -1, "y": 2.5, "z": 3, "w": -4}')]),
    ('[f(x=(1, 2), y={3, 3}, z={"k": [1, {"n": None}]})]',
     [("f", '{"x": [1, 2], "y": [3, 3], "z": {"k": [1, {"n": null}]}}')]),  # tuples and sets: lists
    ('[f(x={1: "a", None: 2, True: 3, 1.5: 4})]', [("f", '{"x": {"1": 3, "null": 2, "1.5": 4}}')]),
    ("[f(x={(1): 2})]", [("f", '{"x": {"1": 2}}')]),
    ("[f(x=1e999)]", [("f", '{"x": Infinity}')]),  # as json.dumps writes it
    ('[f(x="a" "b", y=f"hi", z=())]', [("f", '{"x": "ab", "y": "hi", "z": []}')]),
    ('[f(x="""a\nb""")]', [("f", '{"x": "a\\nb"}')]),
    ('[f(x="])}\\"")]  # c', [("f", '{"x": "])}\\""}')]),  # brackets and a quote inside a string
    ("[f(x=\"\", y='', z='''a''b''')]", [("f", '{"x": "", "y": "", "z": "a\'\'b"}')]),  # empty; triple-quoted
    ("[f(x=1), g(y=[1,2,])]", [("f", '{"x": 1}'), ("g", '{"y": [1, 2]}')]),
    ('[météo(ville="Paris")]', [("météo", '{"ville": "Paris"}')]),
    ('[f(x="\\x00", y=r"\\d\'")]', [("f", '{"x": "\\u0000", "y": "\\\\d\'"}')]),
]
# no list of calls, as vLLM reads them too: the whole text is content
NO_CALLS = [
    "[]", " [f()]", "\n[f()]", "Sure: [f(x=1)]", "[f(x=1)", "[f(1, a=2)]", '[f(**{"a": 1})]', "[(f)(x=1)]",
    "[f(x=-True)]", '[f(x=f"hi", y=f"{z}")]', "[f(x=g())]", "[f(x=y)]", '[f(x=b"a")]', "[f(x=1j)]",
    "[f(x={-1: 2})]", '[f(x={f"a": 2})]', "[f(x=0x1F, y=1_000, z=07)]", "[f(x='a\nb')]", "[f(from=1)]",
    "<|python_start|>[f(x=1)]<|python_end|>", "[f(x=1 + 2)]", "[f(x=[1 for i in y])]", "[f(x=1), 3]",
    "[f(x=1)()]", "[f(x={**d})]", "[f(x=...)]", "Just text.", "", "[", "['", "[f(x='''", "f(x=1)]",
]
# where this reading differs from vLLM's whole answer (the module doc): (text, calls here, vLLM's)
DIFFERENCES = [
    (WEATHER + " then prose", [PARIS], None),  # text after the list ignored (vLLM: a syntax error)
    (WEATHER + " + [g()]", [PARIS], None),
    (WEATHER + "[0]", [PARIS], None),
    ("[f(a = 1)]", [("f", '{"a": 1}')], None),  # vLLM's regex wants the first call written tightly
    ("[f( a=1)]", [("f", '{"a": 1}')], None),
    ("[_f()]", [("_f", "{}")], None),
    ("[f(),]", [("f", "{}")], None),
    ("[a.b.c(x=1)]", [("a.b.c", '{"x": 1}')], None),
    ("[f(x=1) # note\n]", [("f", '{"x": 1}')], None),
    ("[g(x=1), f(1)]", None, [("g", '{"x": 1}'), ("f", "{}")]),  # vLLM drops the positional argument
    ("[f(a=1, a=2)]", None, [("f", '{"a": 2}')]),  # vLLM keeps the last
]
DEEP = ["[f(x=" + "[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5) + ")]",  # past MAX_DEPTH: no call
        "[f(x=" + "-" * 10000 + "1)]",  # ast.parse: MemoryError
        "[f(x=" + "-" * 400 + "1)]",  # ast.parse: RecursionError, or not, by the caller's stack depth
        "[f(x=" + "1+" * 100000 + "1)]",
        "[f(x=" + "1" * 5000 + ")]",  # past Python's digit limit
        "[f(x=" + "[" * 3000 + "]" * 3000 + ")]",
        "[f()()" + "()" * 50000 + "]"]
UNREAD = NO_CALLS + [text for text, calls, _ in DIFFERENCES if calls is None] + DEEP


@pytest.mark.parametrize("text, calls", WHOLE_CALLS + [(text, calls) for text, calls, _ in DIFFERENCES if calls])
def test_whole_texts_are_read_as_vllms_pythonic_parser_reads_them(text, calls):
    message = checks.assert_read_whole_as(PythonicCallReader, read_whole, text, None, calls)
    for call in message["tool_calls"]:
        json.loads(call["function"]["arguments"])  # JSON text (Infinity as Python's json reads it)


@pytest.mark.parametrize("text", UNREAD, ids=lambda text: repr(text[:40]))
def test_a_text_without_a_list_of_calls_is_all_content(text):
    checks.assert_all_content(PythonicCallReader, read_whole, text)


def test_deep_and_long_texts_are_refused_the_same_at_any_stack_depth():
    """ast.parse of the same text raised RecursionError at one stack depth and not at another; this
    reading never builds a deep tree, so the answer is the same however deep the caller is."""
    def at_depth(depth, text):
        return read_whole(text) if depth == 0 else at_depth(depth - 1, text)

    long_name = "[" + "a." * 100000 + "f()]"  # ast.parse: RecursionError; a (long) dotted name here
    assert at_depth(600, long_name).calls == [("a." * 100000 + "f", "{}")]
    for text in DEEP + [text for text, _ in WHOLE_CALLS]:
        assert at_depth(0, text) == at_depth(600, text)
    nested = "[f(x=" + "[" * (MAX_DEPTH - 2) + "]" * (MAX_DEPTH - 2) + ")]"  # just under the limit: taken
    assert at_depth(600, nested).calls == read_whole(nested).calls != []


def test_a_lone_surrogate_is_written_with_ascii_escapes():
    """A string escape may make a lone surrogate: the arguments stay encodable (call_json's rule)."""
    [(name, arguments)] = read_whole('[f(x="été", y="\\ud83d")]').calls
    arguments.encode("utf-8")
    assert json.loads(arguments) == {"x": "été", "y": "\ud83d"}


def streamed(text: str, cuts: list[int], parallel: bool = True) -> tuple[str, list[dict], str]:
    return checks.streamed(PythonicCallReader, text, cuts, parallel)


def assert_streamed_as_whole(text: str, cuts: list[int]) -> None:
    checks.assert_streamed_as_whole(PythonicCallReader, text, cuts)


SHORT = [text for text, _ in WHOLE_CALLS] + [text for text, _, _ in DIFFERENCES] + NO_CALLS


@pytest.mark.parametrize("text", SHORT, ids=lambda text: repr(text[:40]))
def test_streamed_over_any_split_the_answer_is_the_whole_answer(text):
    """Content and calls, reassembled from the deltas, are the whole reading's for every character
    alone, the text in one piece, every cut in two and 200 random splits; each call comes whole."""
    rng = random.Random(len(text))
    splits = [list(range(1, len(text))), []] + [[cut] for cut in range(1, len(text))]
    for cuts in splits + [random_cuts(rng, text) for _ in range(200)]:
        assert_streamed_as_whole(text, cuts)


def test_deep_texts_stream_as_they_read_whole():
    rng = random.Random(3)
    for text in DEEP:
        for cuts in [[], [len(text) // 2]] + [random_cuts(rng, text) for _ in range(5)]:
            assert_streamed_as_whole(text, cuts)


PARTS = ["[", "]", "(", ")", "{", "}", "weather", "a.b", "x=", "y = ", ",", " ", "\n", "'", '"', "'''", '"""', "\\",
         "#", "1", "-2.5", "True", "null", '"s]"', "'t)'", ": ", "f", "ok", WEATHER, TWO[1:-1]]
VALUES = ['""', "''", "'''a''b'''", "1",
          "-2.5", "True", "None", "null", '"s]"', "'t)\\''", '"""a\n"b"""', "f'x'", "1e3", "-(4)"]


def random_value(rng: random.Random, depth: int = 0) -> str:
    kind = rng.randrange(9 if depth < 3 else 5)
    if kind < 5:
        return rng.choice(VALUES)
    items = [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == 5:
        return "[" + ", ".join(items) + "]"
    if kind == 6:
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if kind == 7:
        return "{" + ", ".join(f'"k{i}": {item}' for i, item in enumerate(items)) + "}"
    return "{" + ", ".join(items or ["0"]) + "}"


def random_list(rng: random.Random) -> str:
    calls = [rng.choice(["f", "weather", "a.b"]) + "(" + ", ".join(
        f"k{i}={random_value(rng)}" for i in range(rng.randint(0, 3))) + ")" for _ in range(rng.randint(1, 3))]
    return "[" + ", ".join(calls) + "]"


def random_text(rng: random.Random) -> str:
    """A list of calls, maybe spoiled by a part put in, maybe with parts after it; or parts alone."""
    if rng.random() < 0.3:
        return rng.choice(["", "["]) + "".join(rng.choice(PARTS) for _ in range(rng.randint(0, 12)))
    text = random_list(rng)
    if rng.random() < 0.3:
        at = rng.randrange(len(text) + 1)
        text = text[:at] + rng.choice(PARTS) + text[at:]
    return text + "".join(rng.choice(PARTS) for _ in range(rng.choice([0, 0, 1, 3])))


def test_random_texts_stream_as_they_read_whole():
    """Texts made of the format's parts (names, values nested, brackets, quotes of one and three,
    escapes, comments, prose), each streamed over random splits, say what the whole answer says."""
    rng, compared = random.Random(11), {"calls": 0, "content": 0}
    for _ in range(3000):
        text = random_text(rng)
        for cuts in [list(range(1, len(text)))] + [random_cuts(rng, text) for _ in range(8)]:
            assert_streamed_as_whole(text, cuts)
        compared["calls" if read_whole(text).calls else "content"] += 1
    assert min(compared.values()) > 500, compared  # both kinds of answers were compared


def test_content_goes_out_at_once_and_calls_when_the_list_closes():
    reader = PythonicCallReader()
    assert reader.delta("", False) == {}
    assert reader.delta("Hello [", False) == {"content": "Hello ["}  # no leading `[`: content as it comes
    assert reader.delta("f(x=1)]", True) == {"content": "f(x=1)]"}
    calls = PythonicCallReader()
    assert calls.delta('[weather(city="Par', False) == {}  # held: content only if no call
    assert calls.delta('is"), set_flag(ok=True, note="été")', False) == {}
    [first, second] = calls.delta("]\nDone.", False)["tool_calls"]  # closed: sent before the text ends
    assert (first["index"], second["index"]) == (0, 1) and named([first, second]) == [PARIS, FLAGGED]
    assert calls.delta(" more words", True) == {}  # after the list: no content
    assert calls.finish_reason("stop") == "tool_calls" and calls.finish_reason("length") == "length"
    cut = PythonicCallReader()  # cut inside the list (max_tokens): the held text is content
    assert cut.delta('[weather(city="Paris")', False) == {}
    assert cut.delta(", set", True) == {"content": '[weather(city="Paris"), set'}
    bad = PythonicCallReader()  # closed, but no list of calls: all content, and the rest too
    assert bad.delta("[f(1)", False) == {}
    assert bad.delta("] and", False) == {"content": "[f(1)] and"}
    assert bad.delta(" more", True) == {"content": " more"} and bad.finish_reason("stop") == "stop"


def test_without_parallel_calls_only_the_first_call_is_kept_whole_and_streamed():
    """parallel_tool_calls false: vLLM keeps the first call of an "auto" answer."""
    text = TWO[:-1] + ", " + WEATHER[1:]
    whole = PythonicCallReader(parallel_tool_calls=False)
    whole.push(text, True)
    assert named(whole.message()["tool_calls"]) == [PARIS] and whole.message()["content"] is None
    for cuts in ([], list(range(1, len(text))), list(range(7, len(text), 7))):
        content, calls, finish = streamed(text, cuts, parallel=False)
        assert [(call["index"], call["function"]["name"]) for call in calls] == [(0, "weather")]
        assert content == "" and finish == "tool_calls"


def test_the_stream_keeps_only_what_is_not_settled_and_costs_what_its_pieces_cost():
    """Streamed, the reader keeps the open list only (content, or the text after the list, is not
    kept), and each piece's work is that piece's: thousands of pieces cost about their length."""
    prose = PythonicCallReader()
    for _ in range(5000):
        assert prose.delta("words [f(x=1)] ", False) == {"content": "words [f(x=1)] "}
    assert prose._held == []
    after = PythonicCallReader()
    assert after.delta(WEATHER, False)["tool_calls"]
    for _ in range(5000):
        assert after.delta("more ] [ words ", False) == {}
    assert after._held == []

    def stream_list(pieces: int) -> float:
        reader = PythonicCallReader()
        started = time.perf_counter()
        reader.delta('[weather(city="', False)
        for _ in range(pieces):
            assert reader.delta("a\\\"]) ", False) == {}  # escapes and brackets inside the string: open
        [call] = reader.delta('")]', True)["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == {"city": 'a"]) ' * pieces}
        return time.perf_counter() - started

    stream_list(2000)  # warm
    small, large = stream_list(5000), stream_list(50000)
    assert large < small * 10 * 3, (small, large)  # linear (a quadratic reading is ~100x), noise allowed


def test_the_request_picks_the_reader_and_its_parallel_calls():
    """Needs the lead's plumbing: the parser name "pythonic" in server_settings.TOOL_CALL_PARSERS and
    tool_calls.PARSER_READERS."""
    body = {**BASE, "tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": False}
    reader = parse_request(ChatCompletionRequest, body, "pythonic").tool_call_reader()
    assert isinstance(reader, PythonicCallReader) and reader.parallel_tool_calls is False


# ---- end to end --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_model_with_smollm2_tokenizer(tmp_path_factory.mktemp("pythonic"))


def test_auto_reads_pythonic_calls_whole_and_streamed(model_dir, in_process_cluster):
    """The model's text forced to `[weather(...), set_flag(...)]`: no content and two calls,
    "tool_calls", whole and streamed, n=2."""
    checks.assert_forced_calls_end_to_end(model_dir, "pythonic", PythonicCallReader, TWO, [PARIS, FLAGGED])


def test_names_are_pythons_and_a_bare_carriage_return_ends_a_line():
    """Review finds: tokenize's \\w+ took `a²` (NFKC made it `a2`, another tool's name); a bare \\r
    between tokens was an error token (vLLM reads the calls)."""
    for text in ("[f(a²=1)]", "[f²()]"):
        assert read_whole(text).calls == [] and read_whole(text).content == text
    assert read_whole("[f(a=1,\rb=2)]").calls == [("f", '{"a": 1, "b": 2}')]
    assert read_whole("[ｆ(x=1)]").calls == [("f", '{"x": 1}')]  # a name Python takes, read as Python reads it
