"""tool_choice "required"'s calls streamed as they are written (launcher/serving/required_calls_stream.py,
vLLM 0.32's rule): each call out once its name has closed and its parameters have begun, then its
arguments as they grow; for every split of a text the streamed calls reassemble to the same names and
the same JSON as the whole answer; only the text a call may still need is kept."""

from __future__ import annotations

import json
import random

import pytest

from launcher.serving.required_calls_stream import RequiredCallsStream
from launcher.serving.tool_calls import ToolCallReader, required_calls

TWO_CALLS = ('[{"name": "weather", "parameters": {"city": "Oslo", "note": "a}]\\"[{ ünï"}}, '
             '{"name": "set_flag", "parameters": {"ok": true, "tags": [1, {"x": []}]}}]')
TEXTS = [
    TWO_CALLS,
    '[{"name":"weather","parameters":{"city":"Paris"}}]',  # no spaces
    ' [ {"name" : "f" , "parameters" : 12 } , {"name": "g", "parameters": "s,t"} ] ',  # scalars
    '[{"name": "f", "parameters": null}]',
    '[{"parameters": {"a": [1, 2]}, "name": "f"}]',  # the name after the parameters
    '[{"name": "f", "parameters": {}}, {"name": "g", "parameters": {"deep": {"er": {"est": "}"}}}}]',
]


def reassembled(entries: list[dict]) -> list[dict]:
    """The calls the entries make: a call's first entry has its id, type and name, the later ones only
    arguments (checked), which are appended."""
    calls: dict[int, dict] = {}
    for entry in entries:
        if entry["index"] not in calls:
            assert set(entry) == {"index", "id", "type", "function"} and entry["type"] == "function", entry
            assert entry["index"] == len(calls)  # calls go out in the array's order
            calls[entry["index"]] = {"name": entry["function"]["name"], "arguments": entry["function"]["arguments"]}
        else:
            assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}, entry
            calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


def streamed(pieces: list[str]) -> tuple[list[dict], list[list[dict]]]:
    stream = RequiredCallsStream()
    per_piece = [stream.feed(piece) for piece in pieces]
    return reassembled([entry for entries in per_piece for entry in entries]), per_piece


def whole(text: str) -> list[dict]:
    return [call["function"] for call in required_calls(text)]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_over_any_split_the_calls_are_the_whole_answers(text):
    expected = whole(text)
    assert expected  # every text here is an array of calls
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    splits.append(list(text))  # a character at a time
    rng = random.Random(7)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), 6))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for pieces in splits:
        calls, _ = streamed(pieces)
        assert [c["name"] for c in calls] == [c["name"] for c in expected], pieces
        # the arguments as written; the whole answer writes the same JSON back with json.dumps (vLLM's two forms)
        assert [json.loads(c["arguments"]) for c in calls] == [json.loads(c["arguments"]) for c in expected], pieces


def test_a_call_goes_out_once_its_name_is_whole_and_its_parameters_began_then_its_arguments_grow():
    stream = RequiredCallsStream()
    assert stream.feed('[{"name": "wea') == []  # the name is not whole yet
    assert stream.feed('ther", ') == []  # no parameters yet
    [first] = stream.feed('"parameters": {"ci')
    assert first["index"] == 0 and first["id"].startswith("chatcmpl-tool-") and first["type"] == "function"
    assert first["function"] == {"name": "weather", "arguments": '{"ci'}
    assert stream.feed('ty": "Oslo"}') == [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]
    assert stream.feed('}, {"name": "set_flag"') == []  # the value is closed: "}" closes the element, no argument
    assert stream.feed(", ") == []
    [second] = stream.feed('"parameters": {"ok": true}}]')
    assert second["index"] == 1 and second["function"] == {"name": "set_flag", "arguments": '{"ok": true}'}
    assert second["id"] != first["id"]
    assert stream.feed(" and more [{") == []  # after the array: nothing
    assert [c["function"] for c in stream.sent] == [{"name": "weather", "arguments": '{"city": "Oslo"}'},
                                                    {"name": "set_flag", "arguments": '{"ok": true}'}]


def test_a_name_written_after_the_parameters_sends_them_all_at_once():
    stream = RequiredCallsStream()
    assert stream.feed('[{"parameters": {"a": [1, ') == [] and stream.feed('2]}, "name": "f') == []
    [entry] = stream.feed('"}]')
    assert entry["function"] == {"name": "f", "arguments": '{"a": [1, 2]}'}


@pytest.mark.parametrize("text", [
    '{"name": "f", "parameters": {}}',  # an object, not an array of them
    'Sure: [{"name": "f", "parameters": {}}]',  # text before the array
    '[["f", {}]]',  # elements that are not objects
    '[{"name": 7, "parameters": {}}]',  # a name that is no string
    '[{"name": "f"}]',  # no parameters
    '[{"name": "f\\q", "parameters": {}}]',  # a name that is no valid JSON string
])
def test_what_holds_no_call_sends_none(text):
    calls, _ = streamed(list(text))
    assert calls == []


def test_a_call_whose_name_is_not_known_holds_back_the_calls_after_it():
    calls, per_piece = streamed(['[{"name": 7, "parameters": {}}, ', '{"name": "g", "parameters": {}}]'])
    assert calls == [] and per_piece == [[], []]


def test_the_stream_keeps_only_what_a_call_still_needs():
    stream = RequiredCallsStream()
    stream.feed('[{"name": "f", "parameters": {"text": "')
    for _ in range(3000):
        assert stream.feed("words ") == [{"index": 0, "function": {"arguments": "words "}}]
        assert len(stream._kept) < 10
    stream.feed('"}}, {"name": "g", "parameters": [')  # not sent before its name... it is: kept from its start
    for _ in range(3000):
        stream.feed("1, ")
    assert len(stream._kept) < 10
    [entry] = stream.feed("2]}]")
    assert entry == {"index": 1, "function": {"arguments": "2]"}}
    assert json.loads(stream.sent[1]["function"]["arguments"]) == [1] * 3000 + [2]
    held = RequiredCallsStream()  # parameters before the name: kept until the name comes
    held.feed('[{"parameters": "')
    for _ in range(1000):
        assert held.feed("ab") == []
    assert len(held._kept) > 2000
    [entry] = held.feed('", "name": "f"}]')
    assert entry["function"]["arguments"] == '"' + "ab" * 1000 + '"' and len(held._kept) < 10


def test_the_reader_streams_required_calls_and_reports_what_it_sent():
    reader = ToolCallReader("required")
    deltas = [reader.delta(piece, finished) for piece, finished in (
        ('[{"name": "set_flag", "parameters": {"ok"', False), (": false}}", False), ("]", True))]
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "set_flag", "arguments": '{"ok"'}
    assert deltas[1] == {"tool_calls": [{"index": 0, "function": {"arguments": ": false}"}}]} and deltas[2] == {}
    [call] = reader.calls()  # the call the client was given: its id, the arguments as sent
    assert call == {"id": deltas[0]["tool_calls"][0]["id"], "type": "function",
                    "function": {"name": "set_flag", "arguments": '{"ok": false}'}}
    assert reader.finish_reason("stop") == "tool_calls" and reader.finish_reason("length") == "length"
    cut = ToolCallReader("required")  # a stop string ended it before any call: no call, "stop" stays
    cut.delta('[{"name": "set_fl', True)
    assert cut.calls() == [] and cut.finish_reason("stop") == "stop"


def test_a_long_array_costs_its_length_and_a_repeated_key_is_no_arguments():
    """Calls sent whole are not visited again (every piece went over every call: 2000 calls fed 3
    characters at a time took 3.4 s); a second "parameters" key in one element (which the output's
    schema never allows) neither moves nor garbles the arguments sent."""
    call = '{"name": "f", "parameters": {"a": 1}}'
    text = "[" + ", ".join([call] * 3000) + "]"
    stream = RequiredCallsStream()
    for i in range(0, len(text), 3):
        stream.feed(text[i:i + 3])
    assert len(stream.sent) == 3000 and stream._first_open >= 2999
    repeated = RequiredCallsStream()
    pieces = ['[{"name": "f", "parameters": {"a": 1},    "x": 0, ', '"parameters": {"b": 2}}]']
    assert reassembled([e for piece in pieces for e in repeated.feed(piece)]) == [{"name": "f", "arguments": '{"a": 1}'}]


def test_a_parser_name_that_is_no_string_is_refused_by_name():
    from launcher.serving.server_settings import settings_from_args

    for value in (["hermes"], {"name": "hermes"}, 5):
        with pytest.raises(ValueError, match=r"tool_call_parser \(.*\) must be one of hermes"):
            settings_from_args({"tool_call_parser": value})


# ---- the same scan over one call object, as the "auto" readers of the JSON formats use it -------
def one_object_stream(pieces: list[str], keys=("arguments",)) -> tuple[list[dict], RequiredCallsStream]:
    stream = RequiredCallsStream(keys, one_object=True, make_id=lambda: "call-1")
    return reassembled([entry for piece in pieces for entry in stream.feed(piece)]), stream


def test_one_object_streams_its_call_under_the_formats_key_with_the_formats_ids():
    text = ' \n{"name": "weather", "arguments": {"city": "Oslo"}}\n'
    for cut in range(len(text) + 1):
        calls, stream = one_object_stream([text[:cut], text[cut:]])
        assert calls == [{"name": "weather", "arguments": '{"city": "Oslo"}'}], cut
        assert stream.sent[0]["id"] == "call-1"
    # the key the format names: another key's value is no arguments
    calls, _ = one_object_stream(['{"name": "f", "parameters": {"a": 1}}'])
    assert calls == []
    calls, _ = one_object_stream(['{"name": "f", "parameters": {"a": 1}, "arguments": [2]}'], ("arguments", "parameters"))
    assert calls == [{"name": "f", "arguments": '{"a": 1}'}]  # the first of the keys that comes


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "f", "arguments": {}}',  # text before the object
    'x {"name": "f", "arguments": {}}',
    '[{"name": "f", "arguments": {}}]',  # an array is no call object
])
def test_one_object_reads_nothing_after_other_text_before_it(text):
    assert one_object_stream([text])[0] == []


def test_one_object_reads_nothing_after_the_object():
    calls, stream = one_object_stream(['{"name": "f", "arguments": {"a": 1}} {"name": "g", "arguments": {}}'])
    assert calls == [{"name": "f", "arguments": '{"a": 1}'}] and len(stream.sent) == 1
    calls, _ = one_object_stream(['{"name": "f", "arguments": {"a": 1}}', ', "more": 1}'])
    assert calls == [{"name": "f", "arguments": '{"a": 1}'}]


def test_a_long_string_argument_is_not_kept_once_sent():
    """Arguments written as one long JSON string: each piece goes out as it comes and is not kept
    (the open string was kept whole, so every piece copied all of it: quadratic)."""
    stream = RequiredCallsStream(("arguments",), one_object=True)
    [first] = stream.feed('{"name": "f", "arguments": "')
    assert first["function"]["arguments"] == '"'
    for _ in range(3000):
        assert stream.feed("ab") == [{"index": 0, "function": {"arguments": "ab"}}]
        assert len(stream._kept) < 10
    assert stream.feed('"}') == [{"index": 0, "function": {"arguments": '"'}}]
    # an array's calls alike, and a name still read whole however it is cut
    array = RequiredCallsStream()
    entries = [entry for piece in ['[{"na', 'me": "f', 'g", "parameters": "x', "y" * 50, '"}]'] for entry in array.feed(piece)]
    assert reassembled(entries) == [{"name": "fg", "arguments": '"x' + "y" * 50 + '"'}] and len(array._kept) < 10


@pytest.mark.parametrize("text", [
    '{"name": "f",, "arguments": {"a": 1}}',  # a second comma
    '{"name": "f" , : "arguments": {"a": 1}}',  # a colon where a key belongs
    '{"name": "f" "arguments": {"a": 1}}',  # no comma between members
    '{"name":\xa0"f", "arguments": {"a": 1}}',  # whitespace JSON does not take
    '\xa0{"name": "f", "arguments": {"a": 1}}',
    '{"name": "f", x "arguments": {"a": 1}}',
    '{"name": "f"], "arguments": {"a": 1}}',  # a bracket that closes nothing
])
def test_text_out_of_place_at_the_objects_level_announces_nothing(text):
    """The whole reading finds no call in such a text (no JSON); the scan stops where the JSON
    breaks, before the call goes out, whatever the split."""
    assert json_fails(text)
    for cut in range(len(text) + 1):
        assert one_object_stream([text[:cut], text[cut:]])[0] == [], cut


def json_fails(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return True
    return False


@pytest.mark.parametrize("text", [
    '[{"name": "f", "parameters": {}},, {"name": "g", "parameters": {}}]',
    '[{"name": "f", "parameters": {}} {"name": "g", "parameters": {}}]',
    '[{"name": "f", "parameters": {}}, ]',
    '[, {"name": "g", "parameters": {}}]',
])
def test_text_out_of_place_at_the_arrays_level_sends_nothing_after_it(text):
    assert json_fails(text) and required_calls(text) == []
    calls, _ = streamed(list(text))
    assert [call["name"] for call in calls] in ([], ["f"])  # "f" went out before the array broke
    assert "g" not in [call["name"] for call in calls]


def test_a_long_string_under_another_key_is_not_kept():
    stream = RequiredCallsStream(("arguments",), one_object=True)
    stream.feed('{"name": "f", "arguments": {}, "note": "')
    for _ in range(3000):
        assert stream.feed("ab") == []
    assert len(stream._kept) < 10
    assert stream.feed('"}') == [] and reassembled([]) == [] and stream.sent[0]["function"]["arguments"] == "{}"


def test_arguments_waiting_for_their_name_are_kept_as_pieces():
    """Arguments written before the name wait, kept whole; the pieces are not joined at every piece
    (one string grown by each copied it all: quadratic), only when the name lets them out."""
    stream = RequiredCallsStream(("arguments",), one_object=True)
    stream.feed('{"arguments": {"s": "')
    for _ in range(3000):
        assert stream.feed("abcdefghij") == []
    assert len(stream._kept_pieces) > 3000  # not joined while waiting
    stream.feed('"}, ')
    [entry] = stream.feed('"name": "f"')
    assert entry["function"] == {"name": "f", "arguments": '{"s": "' + "abcdefghij" * 3000 + '"}'}
    assert len(stream._kept) < 20
