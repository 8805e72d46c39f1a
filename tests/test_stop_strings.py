"""StopStringMatcher: stop strings split across pushes, overlapping prefixes, passthrough."""

from __future__ import annotations

import random

import pytest

from launcher.serving.stop_strings import StopStringMatcher
from tests.test_replicas import model_and_expected  # noqa: F401 - fixture


def run(stops, pieces, include_stop=False):
    """Pushes every piece; returns (everything emitted including the flush, whether it stopped)."""
    matcher = StopStringMatcher(stops, include_stop=include_stop)
    out, stopped = [], False
    for piece in pieces:
        text, stopped = matcher.push(piece)
        out.append(text)
    out.append(matcher.flush())
    return "".join(out), stopped


def first_stop(stops, text):
    """(start, end) of the stop string the text completes first when it arrives a character at a
    time (of those ending at one character, the earliest start), or None."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if text.endswith(s, 0, end)]
        if starts:
            return min(starts), end
    return None


def reference(stops, text):
    """What the text gives a character at a time: everything before the stop string it completes first."""
    found = first_stop(stops, text)
    return (text[:found[0]], True) if found else (text, False)


def test_no_stops_is_a_passthrough_that_holds_nothing():
    matcher = StopStringMatcher([])
    for piece in ["Hello", ", ", "wor", "ld"]:
        assert matcher.push(piece) == (piece, False)
        assert matcher.held == ""
    assert matcher.flush() == ""


def test_a_stop_split_across_many_pushes_is_never_emitted():
    matcher = StopStringMatcher(["<|end|>"])
    pushes = [matcher.push(p) for p in ["Answer: 42", "<", "|", "e", "n", "d", "|", ">", " more"]]
    assert pushes[0] == ("Answer: 42", False)
    assert all(p == ("", False) for p in pushes[1:7])  # each one still a prefix of the stop
    assert pushes[7] == ("", True)
    assert pushes[8] == ("", True)  # after a stop, nothing more
    assert matcher.flush() == ""


def test_a_false_start_is_released_once_it_cannot_be_a_stop():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("a ST") == ("a ", False)
    assert matcher.held == "ST"
    assert matcher.push("ART") == ("START", False)
    assert matcher.push("S") == ("", False)
    assert matcher.flush() == "S"


def test_text_after_the_stop_in_the_same_push_is_dropped():
    assert StopStringMatcher(["\n\n"]).push("one\n\ntwo") == ("one", True)


def test_overlapping_prefixes_hold_the_longest_possible_start():
    # "ab" is a prefix of "abc"; "bca" overlaps "abc" by "bc"
    matcher = StopStringMatcher(["abcd", "bcx"])
    assert matcher.push("zab") == ("z", False)
    assert matcher.held == "ab"
    assert matcher.push("c") == ("", False)  # "abc" could still be "abcd", "bc" could be "bcx"
    assert matcher.push("x") == ("a", True)  # "bcx" found: "a" came before it
    assert run(["aab"], ["a", "a", "a", "b"]) == ("a", True)  # "aaa" -> held "aa", then "aab"


def test_the_earliest_stop_wins_not_the_first_listed():
    assert run(["later", "early"], ["an early and later"]) == ("an ", True)


def test_holds_at_most_the_longest_stop_minus_one():
    matcher = StopStringMatcher(["x", "<stop>"])
    # what could still begin a stop is held, the rest emitted at once (a held length alone let a
    # matcher that dropped the text it did not hold pass)
    assert matcher.push("<stop" * 3) == ("<stop<stop", False)
    assert matcher.held == "<stop" and len(matcher.held) <= len("<stop>") - 1


@pytest.mark.parametrize("stops", [["ab", "ba"], ["aaa"], ["abab", "b", "bb"], ["\n\n", "User:"], [" world", "or"], []])
def test_random_splits_match_the_whole_text(stops):
    for text, pieces in random_splits(random.Random(0), words=stops):
        assert run(stops, pieces) == reference(stops, text), (stops, pieces)


def test_a_stop_inside_another_cuts_the_same_text_however_it_is_split():
    """" world" holds "or": a character at a time "or" completes first, so the text is " Hello w"
    whether " world" came in one piece or as " wor" + "ld" (the earliest start cut the first
    before " world", the second before "or"); include_stop ends with "or" both ways."""
    for pieces in ([" Hello", " world"], [" Hello", " wor", "ld"], [" Hello world"]):
        assert run([" world", "or"], pieces) == (" Hello w", True), pieces
        assert run_including([" world", "or"], pieces) == (" Hello wor", True), pieces
    assert run(["abab", "b"], ["abab"]) == run(["abab", "b"], list("abab")) == ("a", True)
    assert run(["ab", "b"], ["xab"]) == ("x", True)  # both end at "b": the earlier start


def random_splits(rng: random.Random, texts: int = 300, words=()):
    """(text, pieces): random texts over a few characters and `words` (so stop strings that hold
    one another occur whole), each cut into up to 9 random pieces."""
    for _ in range(texts):
        text = "".join(rng.choice(list("ab\nUser: ") + list(words)) for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 8))))
        yield text, [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("stops, message", [
    (["a", "b", "c", "d", "e"], "at most 4 stop strings"),
    ([""], "non-empty str, got ''"),
    (["ok", 3], "non-empty str, got 3"),
    ("STOP", "single string 'STOP'"),
])
def test_bad_stops_are_refused_naming_the_value(stops, message):
    with pytest.raises(ValueError, match=message):
        StopStringMatcher(stops)


def test_a_stop_string_no_text_can_hold_is_refused():
    """A lone surrogate ("\\ud800") was taken by the driver API and never matched (the server refused it)."""
    from launcher.serving.stop_strings import validate_stops

    with pytest.raises(ValueError, match=r"stop string 1 is not valid UTF-8 text \('\\ud800x': surrogates not "
                                         r"allowed at position 0\); pass UTF-8 text"):
        validate_stops(["ok", "\ud800x"])
    assert validate_stops(["é", "🙂", "\u0000"]) == ("é", "🙂", "\u0000")


@pytest.mark.parametrize("min_tokens, stopped_after", [(0, 2), (1, 2), (2, 5), (4, 5), (5, None)])
def test_min_tokens_holds_stop_strings_back_as_vllm_does(smollm2_tokenizer, min_tokens, stopped_after):
    """A stop string ends the text only in the text of the tokens after the first min_tokens: " one"
    is tokens 2 and 5, so min_tokens 2 to 4 run on to the second, and 5 to no stop at all (vLLM's
    min_tokens holds stop strings back as it holds stop tokens; here they ended the text regardless)."""
    from launcher.serving.text_stream import TextStream
    from workers.serving.requests import TokenEvent

    ids = smollm2_tokenizer(" zero one two three one", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5 and smollm2_tokenizer.decode(ids[1:2]) == " one"
    stream = TextStream("r", smollm2_tokenizer, (" one",), prompt_tokens=1, min_tokens=min_tokens)
    deltas = [stream.delta(TokenEvent("r", [token], "length" if i == len(ids) - 1 else None))
              for i, token in enumerate(ids)]
    ended = next((i + 1 for i, d in enumerate(deltas) if d.stopped_by_string), None)
    assert ended == stopped_after
    text = "".join(d.text for d in deltas)
    assert text == {2: " zero", 5: " zero one two three", None: " zero one two three one"}[stopped_after]


@pytest.mark.parametrize("stop, min_tokens, stopped_after", [(" one two", 2, 3), (" one two", 3, None),
                                                            (" zero one", 1, 2), (" zero one", 2, None),
                                                            (" two three one", 4, 5)])
def test_a_stop_string_may_begin_within_min_tokens_and_end_after_them(smollm2_tokenizer, stop, min_tokens,
                                                                     stopped_after):
    """vLLM's rule: a stop string counts where it ends in the text of the tokens after the first
    min_tokens, wherever it begins (" one two" ends in token 3, so min_tokens 2 stops there and 3 does
    not; before, the text of the tokens within min_tokens went out unmatched and such a stop string
    was never found)."""
    from launcher.serving.text_stream import TextStream
    from workers.serving.requests import TokenEvent

    ids = smollm2_tokenizer(" zero one two three one", add_special_tokens=False)["input_ids"]
    stream = TextStream("r", smollm2_tokenizer, (stop,), prompt_tokens=1, min_tokens=min_tokens)
    deltas = [stream.delta(TokenEvent("r", [token], "length" if i == len(ids) - 1 else None))
              for i, token in enumerate(ids)]
    ended = next((i + 1 for i, d in enumerate(deltas) if d.stopped_by_string), None)
    assert ended == stopped_after
    whole = " zero one two three one"
    assert "".join(d.text for d in deltas) == (whole if stopped_after is None else whole[:whole.index(stop)])


@pytest.mark.parametrize("stop, min_tokens, stopped", [(" zero", 2, False), (" one two", 2, True),
                                                       (" one two", 3, False), (" three", 0, True)])
def test_an_event_of_several_tokens_splits_at_min_tokens(smollm2_tokenizer, stop, min_tokens, stopped):
    """All five tokens in one event (as a resumed stream could deliver them) stop where one event per
    token stops: a stop string must end in the text of the tokens after the first min_tokens, not merely
    arrive in an event that reaches past them (review of 88de158: " zero" with min_tokens 2 stopped)."""
    from launcher.serving.text_stream import TextStream
    from workers.serving.requests import TokenEvent

    ids = smollm2_tokenizer(" zero one two three one", add_special_tokens=False)["input_ids"]
    stream = TextStream("r", smollm2_tokenizer, (stop,), prompt_tokens=1, min_tokens=min_tokens)
    delta = stream.delta(TokenEvent("r", list(ids), "length"))
    whole = " zero one two three one"
    assert delta.stopped_by_string == stopped
    assert delta.text == (whole[:whole.index(stop)] if stopped else whole)


# ---- include_stop_str_in_output (vLLM's): the text ends with the stop string -------------------------------
def test_include_stop_keeps_a_stop_split_across_pushes_and_drops_what_follows():
    """Nothing is held back (vLLM's rule with include_stop_str_in_output): text sent before the stop
    string completes is in the output either way, so each push goes out whole, and the stop string
    that began in earlier pushes still ends the text where it completes."""
    matcher = StopStringMatcher(["<|end|>"], include_stop=True)
    pushes = [matcher.push(p) for p in ["Answer: 42", "<|e", "nd", "|> more", " and more"]]
    assert pushes == [("Answer: 42", False), ("<|e", False), ("nd", False), ("|>", True), ("", True)]
    assert matcher.flush() == ""
    assert matcher.held == ""


def test_include_stop_finds_a_stop_that_began_in_earlier_pushes():
    """Only the last len(longest stop) - 1 characters sent are kept for matching, enough for a stop
    string that began a whole push or more before the one that completes it."""
    matcher = StopStringMatcher(["xyz", "ab"], include_stop=True)
    assert [matcher.push(p) for p in ["x", "y", "z!"]] == [("x", False), ("y", False), ("z", True)]
    matcher = StopStringMatcher(["wxyz"], include_stop=True)
    assert [matcher.push(p) for p in ["aw", "x", "y", "z tail"]] == [
        ("aw", False), ("x", False), ("y", False), ("z", True)]


def test_include_stop_keeps_the_earliest_stop_and_of_two_at_one_place_the_shorter():
    assert run_including(["later", "early"], ["an early and later"]) == ("an early", True)
    assert run_including(["abc", "ab"], ["xabcd"]) == ("xab", True)
    assert run_including(["abc", "ab"], ["xa", "bcd"]) == ("xab", True)


def test_include_stop_cuts_at_the_stop_that_ends_first_however_the_text_is_pushed():
    """A stop that starts earlier but ends later ("w; X") does not carry the text past one the model
    completed before it ("; "): text pushed several tokens at once (a character held back across
    tokens) gave "now; X", where a token at a time gave "now; "."""
    for pieces in (["now; X"], ["now; ", "X"], ["no", "w; X"]):
        assert run_including(["; ", "w; X"], pieces) == ("now; ", True), pieces


def run_including(stops, pieces):
    """run() with include_stop."""
    return run(stops, pieces, include_stop=True)


@pytest.mark.parametrize("stops", [["ab", "ba"], ["aaa"], ["\n\n", "User:"], [" world", "or"], ["abab", "b", "bb"], []],
                         ids=["ab-ba", "aaa", "blank-line-or-user", "one-inside-another", "abab-b-bb", "none"])
def test_include_stop_random_splits_match_the_whole_text(stops):
    """Whatever the split, the text is the whole text up to the end of the stop string it completes first."""
    for text, pieces in random_splits(random.Random(1), words=stops):
        found = first_stop(stops, text)
        expected = (text[:found[1]], True) if found else (text, False)
        assert run_including(stops, pieces) == expected, (stops, pieces)


@pytest.mark.parametrize("stops", [["ab", "ba"], ["aaa"], ["\n\n", "User:"]], ids=["ab-ba", "aaa", "blank-line-or-user"])
def test_include_stop_sends_each_push_whole_until_the_stop(stops):
    """With include_stop nothing waits: after every push before the stop string completes, all the
    text pushed so far has been sent."""
    for _, pieces in random_splits(random.Random(2)):
        matcher = StopStringMatcher(stops, include_stop=True)
        sent = ""
        for k, piece in enumerate(pieces, 1):
            text, stopped = matcher.push(piece)
            sent += text
            if stopped:
                break
            assert sent == "".join(pieces[:k]), (stops, pieces)


def _stream_text(tokenizer, stop, min_tokens=0, include=True, one_event=False):
    """The TextStream's text and whether a stop string ended it, for " zero one two three one" (5 SmolLM2
    tokens: " zero", " one", " two", " three", " one"), one event per token or all in one (as a
    stream_interval gathers them); read as a reader reads, up to the delta that ends the request.
    All in one event, the request ends at the token that completed the stop string, as it does with
    an event per token: the tokens after it are neither reported nor counted."""
    ids = tokenizer(" zero one two three one", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5
    deltas = _deltas_to_the_end(tokenizer, stop, min_tokens, include, [list(ids)] if one_event else [[t] for t in ids])
    reported = [t for d in deltas for t in d.token_ids]
    assert reported == ids[:len(reported)] and deltas[-1].completion_tokens == len(reported)
    if one_event:
        one_each = _deltas_to_the_end(tokenizer, stop, min_tokens, include, [[t] for t in ids])
        assert reported == [t for d in one_each for t in d.token_ids]
    return "".join(d.text for d in deltas), any(d.stopped_by_string for d in deltas)


def _deltas_to_the_end(tokenizer, stop, min_tokens, include, events):
    """A TextStream's deltas of `events` (each a list of token ids, the last one ending the request
    at "length"), up to the one that ends the request."""
    from launcher.serving.text_stream import TextStream
    from workers.serving.requests import TokenEvent

    from tests.test_held_tokens import read_to_the_end

    stream = TextStream("r", tokenizer, (stop,), prompt_tokens=1, min_tokens=min_tokens,
                        include_stop_str_in_output=include)
    return read_to_the_end(stream, [TokenEvent("r", tokens, "length" if i == len(events) - 1 else None)
                                    for i, tokens in enumerate(events)])


@pytest.mark.parametrize("stop, expected", [
    (" one", " zero one"),
    ("ne tw", " zero one tw"),  # spans tokens " one" and " two", ends inside " two": nothing after it
    (" three one", " zero one two three one"),  # ends with the last token
], ids=["one-token", "across-two-tokens", "ends-at-the-last-token"])
def test_text_stream_includes_the_stop_string_at_the_end(smollm2_tokenizer, stop, expected):
    assert _stream_text(smollm2_tokenizer, stop) == (expected, True)
    whole = " zero one two three one"
    assert _stream_text(smollm2_tokenizer, stop, include=False) == (whole[:whole.index(stop)], True)


@pytest.mark.parametrize("one_event", [False, True], ids=["event-per-token", "one-event"])
@pytest.mark.parametrize("stop, min_tokens, expected", [
    (" one two", 2, (" zero one two", True)),  # begins within the first 2 tokens, ends after them
    (" one two", 3, (" zero one two three one", False)),  # ends within the first 3: no stop
    (" one", 2, (" zero one two three one", True)),  # the first " one" is within min_tokens; the second ends it
], ids=["begins-within-ends-after", "ends-within", "second-occurrence"])
def test_include_stop_across_the_min_tokens_boundary(smollm2_tokenizer, stop, min_tokens, expected, one_event):
    """A stop string counts where it ends after the first min_tokens tokens (88de158, 4da01a3), and
    the text it ends keeps it whole, the part within min_tokens included."""
    assert _stream_text(smollm2_tokenizer, stop, min_tokens, one_event=one_event) == expected


def test_the_driver_api_keeps_the_stop_string_when_asked_and_refuses_a_non_bool_first(model_and_expected,
                                                                                       in_process_cluster, tmp_path):
    """stream() and astream() with include_stop_str_in_output: the text ends with the stop string, the
    request ends there as without it; a flag that is not a bool is a ValueError naming it, before
    anything is submitted."""
    import asyncio
    import shutil
    from pathlib import Path

    from launcher.api import Launcher
    from tests.test_compile_cli import save_word_tokenizer
    from tests.test_replicas import EAGER, NEW_TOKENS, PROMPTS

    model_dir, expected = model_and_expected
    with_words = Path(shutil.copytree(model_dir, tmp_path / "with-words"))
    save_word_tokenizer(with_words)  # "t0" .. "t127": the model's 128 ids
    # decoded after the prompt's last words (launcher/serving/detokenizer.py): the first word too
    # comes with the space the word decoder puts between words
    words = "".join(f" t{t}" for t in expected[0])
    stop = f" t{expected[0][2]} "  # the third token, surrounded: no other word contains it
    end = (words + " ").find(stop) + len(stop)
    assert 0 < end < len(words)

    async def astreamed(llm):
        return [d async for d in llm.astream(PROMPTS[0], max_new_tokens=NEW_TOKENS, stop=[stop], ignore_eos=True,
                                             include_stop_str_in_output=True)]

    with Launcher(model=str(with_words), tp=1, max_num_seqs=1, progress=False, **EAGER) as llm:
        for bad in ("yes", 1, None):
            with pytest.raises(ValueError, match=rf"include_stop_str_in_output \({bad!r}\) must be True or False"):
                llm.stream(PROMPTS[0], stop=[stop], include_stop_str_in_output=bad)
        assert llm.load() == {"running": 0, "waiting": 0}  # nothing was submitted
        deltas = list(llm.stream(PROMPTS[0], max_new_tokens=NEW_TOKENS, stop=[stop], ignore_eos=True,
                                 include_stop_str_in_output=True))
        async_deltas = asyncio.run(astreamed(llm))
        plain = list(llm.stream(PROMPTS[0], max_new_tokens=NEW_TOKENS, stop=[stop], ignore_eos=True))
    for got in (deltas, async_deltas):
        assert "".join(d.text for d in got) == words[:end] and got[-1].finish_reason == "stop"
        assert got[-1].stopped_by_string and got[-1].completion_tokens < NEW_TOKENS
    assert "".join(d.text for d in plain) == words[:end - len(stop)]
    # the tokens are those of the request without the flag: it changes the text only
    assert [t for d in deltas for t in d.token_ids] == [t for d in plain for t in d.token_ids]


def test_events_of_several_tokens_leave_the_text_of_early_tokens_early(smollm2_tokenizer):
    """A push whose text ends inside a character holds all of its text back: with several tokens
    within min_tokens in one event, whole early tokens came out with the next one's late text and a
    stop string in them ended the request (review of da1fa69). Any split into events now stops, or
    not, where one event per token does."""
    from launcher.serving.text_stream import TextStream
    from workers.serving.requests import TokenEvent

    ids = smollm2_tokenizer("naïve café — 東京都 は", add_special_tokens=False)["input_ids"]

    def run(sizes, include):
        stream = TextStream("r", smollm2_tokenizer, ("café",), prompt_tokens=1, min_tokens=6,
                            include_stop_str_in_output=include)
        out, start = [], 0
        for size in sizes:
            part = ids[start:start + size]
            start += size
            out.append(stream.delta(TokenEvent("r", part, "length" if start >= len(ids) else None)))
            if out[-1].finish_reason is not None:
                break
        return "".join(d.text for d in out), out[-1].stopped_by_string

    one_each = [1] * len(ids)
    for include in (False, True):
        expected = run(one_each, include)
        for sizes in ([1, 1, 3, 3, 1] + [1] * len(ids), [2] * len(ids), [6] + [1] * len(ids), [len(ids)]):
            assert run(sizes, include) == expected, (sizes, include)
