"""tool_choice "auto" with vLLM's "pythonic" tool-call parser (launcher/serving/pythonic_calls.py,
`corelaunch serve --tool-call-parser pythonic`): whole texts read as vLLM 0.32's PythonicToolParser
reads them (rows checked against it; but for the documented differences: text after the list
ignored, no regex pre-check, positional arguments, `**kwargs`, repeated keywords, sets, dict keys
that are no strings and numbers no double holds refused), never
evaluated and safe against deep or huge texts, the stream equal to the whole answer for any split of
the text (each call announced at its `(`, each keyword argument sent as its value closes, the pieces
making the whole answer's very arguments text) but where a list breaks after a call went out (written
out explicitly), and a forced `[weather(...), set_flag(...)]` end to end through the route methods over a
real in-process Launcher, whole and streamed."""

from __future__ import annotations

import json
import random
import time

import pytest

from launcher.serving.call_json import MAX_DEPTH
from launcher.serving.free_text_calls import CallsReading
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
    ('[f(x=(1, 2), z={"k": [1, {"n": None}]})]',
     [("f", '{"x": [1, 2], "z": {"k": [1, {"n": null}]}}')]),  # tuples: lists
    ('[f(x={"a": 1, ("b"): 2})]', [("f", '{"x": {"a": 1, "b": 2}}')]),
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
    # no JSON value: vLLM writes 1e999 as Infinity (no JSON), a set as a list, a key as JSON writes it
    ("[f(x=1e999)]", None, [("f", '{"x": Infinity}')]),
    ("[f(x={3, 3})]", None, [("f", '{"x": [3, 3]}')]),
    ('[f(x={1: "a", None: 2, True: 3, 1.5: 4})]', None, [("f", '{"x": {"1": 3, "null": 2, "1.5": 4}}')]),
    ("[f(x={(1): 2})]", None, [("f", '{"x": {"1": 2}}')]),
    ('[f(x={1: "x", "1": "y"})]', None, [("f", '{"x": {"1": "x", "1": "y"}}')]),  # the key twice
]
DEEP = ["[f(x=" + "[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5) + ")]",  # past MAX_DEPTH: no call
        "[f(x=" + "-" * 10000 + "1)]",  # ast.parse: MemoryError
        "[f(x=" + "-" * 400 + "1)]",  # ast.parse: RecursionError, or not, by the caller's stack depth
        "[f(x=" + "1+" * 100000 + "1)]",
        "[f(x=" + "1" * 5000 + ")]",  # past Python's digit limit
        "[f(x=" + "[" * 3000 + "]" * 3000 + ")]",
        "[f()()" + "()" * 50000 + "]"]
UNREAD = NO_CALLS + [text for text, calls, _ in DIFFERENCES if calls is None] + DEEP
# lists that break after a call went out (the design's exception: no stream can know in time): the
# whole answer is all content; the stream has announced the call(s), each with the arguments whole so
# far, and sends the text from the breaking call's start (the list's `[` for the first call) as content
BROKEN_AFTER_ANNOUNCED = {
    "[f(x=1)": ("", [("f", '{"x": 1}')]),  # cut after a whole call: nothing of the list is left to send
    "[f(x=1": ("[f(x=1", [("f", "{")]),  # cut before the value is known whole (`1` may go on: `1.5`)
    "[f(1, a=2)]": ("[f(1, a=2)]", [("f", "{")]),
    '[f(**{"a": 1})]': ('[f(**{"a": 1})]', [("f", "{")]),
    "[f(x=-True)]": ("[f(x=-True)]", [("f", "{")]),
    '[f(x=f"hi", y=f"{z}")]': ('[f(x=f"hi", y=f"{z}")]', [("f", '{"x": "hi"')]),
    "[f(x=g())]": ("[f(x=g())]", [("f", "{")]),
    "[f(x=0x1F, y=1_000, z=07)]": ("[f(x=0x1F, y=1_000, z=07)]", [("f", '{"x": 31, "y": 1000')]),
    "[f(x=1), 3]": (", 3]", [("f", '{"x": 1}')]),  # the first call was whole: its text is not sent again
    "[f(x=1)()]": ("()]", [("f", '{"x": 1}')]),
    "[f(x='''": ("[f(x='''", [("f", "{")]),
    "[g(x=1), f(1)]": (", f(1)]", [("g", '{"x": 1}'), ("f", "{")]),
    "[f(a=1, a=2)]": ("[f(a=1, a=2)]", [("f", '{"a": 1')]),  # the whole answer refuses a repeated keyword
    '[f(x="a", y=y)] and more': ('[f(x="a", y=y)] and more', [("f", '{"x": "a"')]),  # the rest is content too
    **{text: (text, [("f", "{")]) for text in (
        "[f(x=y)]", '[f(x=b"a")]', "[f(x=1j)]", "[f(x={-1: 2})]", '[f(x={f"a": 2})]', "[f(x='a\nb')]",
        "[f(from=1)]", "[f(x=1 + 2)]", "[f(x=[1 for i in y])]", "[f(x={**d})]", "[f(x=...)]", *DEEP[:-1],
        "[f(x=1e999)]", "[f(x={3, 3})]", '[f(x={1: "a", None: 2, True: 3, 1.5: 4})]', "[f(x={(1): 2})]",
        '[f(x={1: "x", "1": "y"})]')},
    DEEP[-1]: (DEEP[-1][len("[f()"):], [("f", "{}")]),  # `[f()()()...]`: f was whole
}


@pytest.mark.parametrize("text, calls", WHOLE_CALLS + [(text, calls) for text, calls, _ in DIFFERENCES if calls])
def test_whole_texts_are_read_as_vllms_pythonic_parser_reads_them(text, calls):
    message = checks.assert_read_whole_as(PythonicCallReader, read_whole, text, None, calls)
    for call in message["tool_calls"]:
        json.loads(call["function"]["arguments"], parse_constant=reject)  # JSON text: no NaN, no Infinity


def reject(constant: str):
    raise ValueError(f"{constant} is no JSON")


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
    """The shared check (the same content, calls holding the same JSON, finish reason), and more: the
    reassembled arguments are the whole answer's very text (json.dumps's, piece by piece)."""
    checks.assert_streamed_as_whole(PythonicCallReader, text, cuts)
    assert named(streamed(text, cuts)[1]) == read_whole(text).calls, (text, cuts)


def assert_broken_after_announced(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    """A list that broke after a call went out (the whole answer: all content): the stream's content is
    the text from the breaking call's start on, the calls before it went out whole (as the whole answer
    reads the list they make), the breaking call, if announced, with the arguments whole so far, and
    the finish reason is "tool_calls". Returns the content and the calls."""
    assert read_whole(text) == CallsReading(text)
    content, calls, finish = streamed(text, cuts)
    assert calls and finish == "tool_calls" and text.endswith(content), (text, cuts)
    before = text[:len(text) - len(content)]  # the list's text up to the last whole call's `)`
    assert content or not read_whole(text + "]").content, (text, cuts)  # no content: cut after a call
    whole = read_whole(before + "]").calls if before else []
    assert before == "" or (before.endswith(")") and whole), (text, cuts)
    sent = named(calls)
    assert sent[:len(whole)] == whole and len(sent) - len(whole) <= 1, (text, cuts)
    for _, arguments in sent[len(whole):]:  # the breaking call: its whole arguments so far, unclosed
        with pytest.raises(ValueError):
            json.loads(arguments)
        assert isinstance(json.loads(arguments + "}"), dict)
    return content, sent


def assert_stream_answers(text: str, cuts: list[int]) -> str:
    """The stream says what the whole answer says, or, for a list that broke after a call went out,
    what that case says, the same over any split. Returns which it was: "calls", "content", "broken"."""
    whole = read_whole(text)
    if whole.calls or not streamed(text, cuts)[1]:
        assert_streamed_as_whole(text, cuts)
        return "calls" if whole.calls else "content"
    assert assert_broken_after_announced(text, cuts) == assert_broken_after_announced(text, [])
    return "broken"


SHORT = [text for text, _ in WHOLE_CALLS] + [text for text, _, _ in DIFFERENCES] + NO_CALLS


@pytest.mark.parametrize("text", [text for text in SHORT if text not in BROKEN_AFTER_ANNOUNCED],
                         ids=lambda text: repr(text[:40]))
def test_streamed_over_any_split_the_answer_is_the_whole_answer(text):
    """Content and calls, reassembled from the deltas, are the whole reading's (the arguments its very
    text) for every character alone, the text in one piece, every cut in two and 200 random splits."""
    rng = random.Random(len(text))
    splits = [list(range(1, len(text))), []] + [[cut] for cut in range(1, len(text))]
    for cuts in splits + [random_cuts(rng, text) for _ in range(200)]:
        assert_streamed_as_whole(text, cuts)


@pytest.mark.parametrize("text", list(BROKEN_AFTER_ANNOUNCED), ids=lambda text: repr(text[:40]))
def test_a_list_that_breaks_after_a_call_went_out_keeps_the_call_and_sends_the_rest_as_content(text):
    """What no stream can know in time (the design's exception): the whole answer is all content, with
    no call; the stream has announced the call(s) before the list broke, and sends the text from the
    breaking call's start on as content (all the text when the first call broke), the same for any
    split."""
    content, calls = BROKEN_AFTER_ANNOUNCED[text]
    rng = random.Random(len(text))
    long = len(text) > 1000  # DEEP's: a few splits (each reading costs seconds)
    splits = [[], [len(text) // 2]] + ([] if long else [list(range(1, len(text)))])
    for cuts in splits + [random_cuts(rng, text) for _ in range(1 if long else 20)]:
        assert assert_broken_after_announced(text, cuts) == (content, calls), cuts


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
    escapes, comments, prose), each streamed over random splits, say what the whole answer says (the
    arguments its very text), or, where the list broke after a call went out, what that case says."""
    rng, compared = random.Random(11), {"calls": 0, "content": 0, "broken": 0}
    # 1200 texts: each is also streamed a character at a time (3000 took 22 s of the suite)
    for _ in range(1200):
        text = random_text(rng)
        answers = {assert_stream_answers(text, cuts)
                   for cuts in [list(range(1, len(text)))] + [random_cuts(rng, text) for _ in range(8)]}
        assert len(answers) == 1, (text, answers)  # the same kind of answer over every split
        compared[answers.pop()] += 1
    assert min(compared.values()) > 300, compared  # all kinds of answers were compared


def arguments_entry(index: int, arguments: str) -> dict:
    """A streamed entry that adds to an announced call's arguments."""
    return {"index": index, "function": {"arguments": arguments}}


def announced(delta: dict) -> tuple[int, str, str]:
    """(index, name, arguments so far) of the one call a delta announces (its form checked)."""
    [entry] = delta["tool_calls"]
    assert set(entry) == {"index", "id", "type", "function"} and entry["type"] == "function"
    assert checks.default_id(entry["id"])
    return entry["index"], entry["function"]["name"], entry["function"]["arguments"]


def test_content_goes_out_at_once_and_a_call_goes_out_as_it_is_written():
    reader = PythonicCallReader()
    assert reader.delta("", False) == {}
    assert reader.delta("Hello [", False) == {"content": "Hello ["}  # no leading `[`: content as it comes
    assert reader.delta("f(x=1)]", True) == {"content": "f(x=1)]"}
    calls = PythonicCallReader()
    assert calls.delta("[weath", False) == {}  # the name may go on
    assert announced(calls.delta('er(city="Par', False)) == (0, "weather", "{")  # name and `(`: announced
    assert calls.delta('is"', False) == {}  # `"Paris" "ian"` is one string: whole at the `,` or `)`
    assert calls.delta("), set_flag(ok=True", False) == {
        "tool_calls": [arguments_entry(0, '"city": "Paris"}'), {**calls.calls()[1], "index": 1}]}
    assert calls.calls()[1]["function"] == {"name": "set_flag", "arguments": "{"}
    assert calls.delta(', note="été")', False) == {"tool_calls": [arguments_entry(1, '"ok": true, "note": "été"}')]}
    assert calls.delta("]\nDone.", False) == {}  # the list closed: sent before the text ends
    assert calls.delta(" more words", True) == {}  # after the list: no content
    assert named(calls.calls()) == [PARIS, FLAGGED]
    assert calls.finish_reason("stop") == "tool_calls" and calls.finish_reason("length") == "length"
    cut = PythonicCallReader()  # cut inside the list (max_tokens): what follows the last whole call is content
    assert announced(cut.delta('[weather(city="Paris")', False)) == (0, "weather", '{"city": "Paris"}')
    assert cut.delta(", set", True) == {"content": ", set"} and named(cut.calls()) == [PARIS]
    bad = PythonicCallReader()  # no call before the list broke: all content, and the rest too
    assert bad.delta("[(f)", False) == {"content": "[(f)"}
    assert bad.delta("(x=1)] and", True) == {"content": "(x=1)] and"} and bad.finish_reason("stop") == "stop"


def test_a_calls_arguments_stream_one_keyword_argument_at_a_time():
    """Announced at its `(` with "{", each keyword argument goes out once the comma or `)` after its
    value has come (the value is whole then), as `"key": value` behind ", " after the first, the
    closing "}" at the `)`: the pieces are the whole answer's arguments text, json.dumps's, exactly
    (spacing, quotes and non-ASCII as json.dumps writes them, whatever the model wrote)."""
    text = "[get_weather(city='Zürich' ,days = 3,\n  units=(\"c\", 'f'), extra={'a': None}, )]"
    reader = PythonicCallReader()
    pieces = ["[get_weather(", "city='Zürich' ", ",", "days = 3", ",\n  units=(\"c\", 'f')", ", extra={'a': None}",
              ", ", ")]"]
    assert "".join(pieces) == text
    deltas = [reader.delta(piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    assert announced(deltas[0]) == (0, "get_weather", "{")
    assert deltas[1:] == [{}, {"tool_calls": [arguments_entry(0, '"city": "Zürich"')]}, {},
                          {"tool_calls": [arguments_entry(0, ', "days": 3')]},
                          {"tool_calls": [arguments_entry(0, ', "units": ["c", "f"]')]},
                          {"tool_calls": [arguments_entry(0, ', "extra": {"a": null}')]},  # at the trailing comma
                          {"tool_calls": [arguments_entry(0, "}")]}]
    [(name, arguments)] = read_whole(text).calls
    assert named(reader.calls()) == [(name, arguments)]
    assert arguments == '{"city": "Zürich", "days": 3, "units": ["c", "f"], "extra": {"a": null}}'
    no_arguments = PythonicCallReader()
    assert announced(no_arguments.delta("[get_time(", False)) == (0, "get_time", "{")
    assert no_arguments.delta(")]", True) == {"tool_calls": [arguments_entry(0, "}")]}
    assert named(no_arguments.calls()) == [("get_time", "{}")] == read_whole("[get_time()]").calls


def test_several_calls_stream_in_order_each_under_its_index():
    """Each call goes out as it is written, under its place in the list: streamed one character a
    piece, a call's announcement comes with its `(`, each argument with the sign after it, its "}"
    with its `)`, before the next call begins."""
    text = '[a.b(x=1), c(), d(y=[1, {"k": (2, 3)}], z="w")]'
    reader = PythonicCallReader()
    _, _, _, deltas = checks.streamed_with_deltas(reader, text, list(range(1, len(text))))
    sent_at = {at: [(entry["index"], entry["function"].get("name"), entry["function"]["arguments"])
                    for entry in delta["tool_calls"]] for at, delta in enumerate(deltas) if delta}
    assert sent_at == {
        text.index("a.b(") + 3: [(0, "a.b", "{")], text.index("1)") + 1: [(0, None, '"x": 1}')],
        text.index("c(") + 1: [(1, "c", "{")], text.index("c()") + 2: [(1, None, "}")],
        text.index("d(") + 1: [(2, "d", "{")], text.index(', z="w"'): [(2, None, '"y": [1, {"k": [2, 3]}]')],
        text.index('"w")') + 3: [(2, None, ', "z": "w"}')]}
    assert named(reader.calls()) == read_whole(text).calls == [
        ("a.b", '{"x": 1}'), ("c", "{}"), ("d", '{"y": [1, {"k": [2, 3]}], "z": "w"}')]
    assert len({call["id"] for call in reader.calls()}) == 3
    whole_piece = PythonicCallReader()  # in one piece: one entry a call, the same calls
    [first, second, third] = whole_piece.delta(text, True)["tool_calls"]
    assert [entry["index"] for entry in (first, second, third)] == [0, 1, 2]
    assert named(whole_piece.calls()) == read_whole(text).calls


def test_nested_literal_values_go_out_whole_once_closed():
    """Brackets, commas, quotes, `#` and escapes inside strings and nested values are the value's:
    the argument goes out once, whole, at the sign after it; every piece is json.dumps's text."""
    values = ['"a, b) ] }"', "'it\\'s (\"x\")'", '"""multi\nline, ) ]"""', "r'\\d+'", '"# no comment"',
              "[[1, [2, (3,)]], {'k': {'n': [None, True]}}]", "{'a': 'a', 'b,)': [2.5, -3]}", "'é' 'ü'", "f'{{x}}'"]
    text = "[f(" + ", ".join(f"k{i}={value}" for i, value in enumerate(values)) + ")]"
    [(_, arguments)] = read_whole(text).calls
    rng = random.Random(5)
    for cuts in [[], list(range(1, len(text)))] + [random_cuts(rng, text, most=40) for _ in range(50)]:
        reader = PythonicCallReader()
        _, _, _, deltas = checks.streamed_with_deltas(reader, text, cuts)
        pieces = [entry["function"]["arguments"] for delta in deltas for entry in delta.get("tool_calls", [])]
        assert "".join(pieces) == arguments, cuts
        if cuts and cuts[0] == 1 and len(cuts) == len(text) - 1:  # one character a piece: one entry an argument
            assert pieces == ["{"] + [("" if i == 0 else ", ") + f'"k{i}": ' + json.dumps(
                json.loads(arguments)[f"k{i}"], ensure_ascii=False) + ("}" if i == len(values) - 1 else "")
                for i in range(len(values))]
    assert json.loads(arguments)["k0"] == "a, b) ] }" and json.loads(arguments)["k8"] == "{x}"


def test_a_lone_surrogate_escapes_only_its_own_argument_when_streamed():
    """The documented exception to "exactly the whole answer's text": the whole answer writes all the
    arguments with ASCII escapes once one holds a lone surrogate (call_json.arguments_text); the
    stream has already sent the arguments before it with non-ASCII kept, and escapes only the
    argument that holds it. The same JSON value."""
    text = '[f(x="été", y="\\ud83d", z="ü")]'
    [(_, whole)] = read_whole(text).calls
    assert whole == '{"x": "\\u00e9t\\u00e9", "y": "\\ud83d", "z": "\\u00fc"}'
    content, calls, finish = streamed(text, list(range(1, len(text))))
    [(_, sent)] = named(calls)
    assert sent == '{"x": "été", "y": "\\ud83d", "z": "ü"}' and json.loads(sent) == json.loads(whole)
    sent.encode("utf-8")  # every piece stays encodable
    assert content == "" and finish == "tool_calls"


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


def kept_size(reader: PythonicCallReader) -> int:
    """Characters the reader's stream keeps."""
    return sum(map(len, reader._list._held)) + sum(map(len, reader._list._since_sign))


def test_the_stream_keeps_only_what_is_not_settled_and_costs_what_its_pieces_cost():
    """Streamed, the reader keeps only the current call's text and the text since the list's last
    sign (content, the calls already whole and the text after the list are not kept), and each
    piece's work is that piece's: thousands of pieces cost about their length."""
    prose = PythonicCallReader()
    for _ in range(5000):
        assert prose.delta("words [f(x=1)] ", False) == {"content": "words [f(x=1)] "}
    assert kept_size(prose) == 0
    after = PythonicCallReader()
    assert after.delta(WEATHER, False)["tool_calls"]
    for _ in range(5000):
        assert after.delta("more ] [ words ", False) == {}
    assert kept_size(after) == 0

    long_list = PythonicCallReader()  # a long list in many pieces: only the call being written is kept
    assert announced(long_list.delta("[f(", False)) == (0, "f", "{")
    for index in range(1, 3000):
        assert long_list.delta("x=1", False) == {}
        assert kept_size(long_list) <= 2 * len(",  f(x=1")  # the call, and its argument since the `(`
        assert long_list.delta("), ", False) == {"tool_calls": [arguments_entry(index - 1, '"x": 1}')]}
        assert announced(long_list.delta(" f(", False)) == (index, "f", "{")
    assert long_list.delta(")]", True) == {"tool_calls": [arguments_entry(2999, "}")]}
    assert kept_size(long_list) == 0 and len(long_list.calls()) == 3000

    def stream_list(pieces: int) -> float:
        reader = PythonicCallReader()
        started = time.perf_counter()
        assert announced(reader.delta('[weather(city="', False)) == (0, "weather", "{")
        for _ in range(pieces):
            assert reader.delta("a\\\"]) ", False) == {}  # escapes and brackets inside the string: open
        assert reader.delta('", days=2)]', True)["tool_calls"][0]["index"] == 0
        assert json.loads(reader.calls()[0]["function"]["arguments"]) == {"city": 'a"]) ' * pieces, "days": 2}
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
