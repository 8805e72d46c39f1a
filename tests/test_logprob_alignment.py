"""Log-probabilities in step with the response's text (launcher/serving/logprob_alignment.py): a
token's entry goes out with the text that holds it, and a stop string's tokens get none. With
SmolLM2's real tokenizer, detokenizer and stop-string matcher (launcher/serving/text_stream.py)
feeding the OpenAI renderers, streamed and whole."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from launcher.serving import openai_protocol as proto
from launcher.serving.openai_render import ChatRender, CompletionRender
from launcher.serving.stream_types import StreamDelta
from launcher.serving.text_stream import TextStream
from launcher.serving.token_pieces import TokenPieces
from workers.serving.requests import TokenEvent, TokenLogprob

META = proto.ResponseMeta("x", 1, "m")
WORDS = {1: "Hel", 2: "lo", 3: " EN", 4: "D", 5: " more", 6: "", 7: "lo E"}
WORD_PIECES = TokenPieces(SimpleNamespace(decode=lambda ids, skip_special_tokens=False, **options: "".join(WORDS[i] for i in ids)))


def entry(token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id, -0.1 * token_id, [(token_id, -0.1 * token_id)])


def delta(text: str, ids: list[int], finish: str | None = None, stopped: bool = False) -> StreamDelta:
    return StreamDelta("r", text, ids, finish, 1, 0, [entry(i) for i in ids], stopped_by_string=stopped)


def streamed(render, deltas) -> list[dict]:
    return [chunk for chunk in (render.chunk(META, d) for d in deltas) if chunk is not None]


def test_a_token_whose_text_is_held_waits_for_it():
    # "lo" arrives while its text is held (it may start a stop string), then goes out with it
    deltas = [delta("Hel", [1]), delta("", [2]), delta("lo", [5], None)]
    chunks = streamed(CompletionRender(WORD_PIECES, logprobs=True), deltas)
    assert [c["choices"][0]["text"] for c in chunks] == ["Hel", "lo"]  # no chunk of logprobs alone
    assert [c["choices"][0]["logprobs"]["tokens"] for c in chunks] == [["Hel"], ["lo"]]
    assert chunks[1]["choices"][0]["logprobs"]["text_offset"] == [3]
    # " more" (offset 5) is not in the text sent so far: it waits for the next delta or the end
    render = CompletionRender(WORD_PIECES, logprobs=True)
    for d in deltas + [delta("", [], "length")]:
        render.collect(d)
    body = render.response(META, "length", proto.usage(1, 3))
    assert body["choices"][0]["logprobs"]["tokens"] == ["Hel", "lo", " more"]
    assert body["choices"][0]["logprobs"]["text_offset"] == [0, 3, 5]


def test_a_stop_strings_tokens_get_no_logprobs_and_a_straddling_token_keeps_its_own():
    # stop string " END": " EN" and "D" spell it and are dropped; in the second response "lo E"
    # begins before the cut ("Hello| E...") and part of it was sent, so it stays
    for ids, text, kept in (([1, 2, 3, 4], ["Hel", "lo", "", ""], ["Hel", "lo"]),
                            ([1, 7, 4], ["Hel", "lo", ""], ["Hel", "lo E"])):
        deltas = [delta(t, [i], "stop" if k == len(ids) - 1 else None, stopped=k == len(ids) - 1)
                  for k, (i, t) in enumerate(zip(ids, text))]
        completion, chat = CompletionRender(WORD_PIECES, logprobs=True), ChatRender(WORD_PIECES, logprobs=True)
        for d in deltas:
            completion.collect(d)
            chat.collect(d)
        body = completion.response(META, "stop", proto.usage(1, len(ids)))
        assert body["choices"][0]["text"] == "Hello"
        assert body["choices"][0]["logprobs"]["tokens"] == kept
        assert [c["token"] for c in chat.response(META, "stop", proto.usage(1, len(ids)))["choices"][0]["logprobs"][
            "content"]] == kept
        chunks = streamed(CompletionRender(WORD_PIECES, logprobs=True), deltas)
        assert [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])] == kept
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_stop_string_at_the_start_leaves_empty_logprobs_not_none():
    render = CompletionRender(WORD_PIECES, logprobs=True)
    render.collect(delta("", [3, 4], "stop", stopped=True))
    logprobs = render.response(META, "stop", proto.usage(1, 2))["choices"][0]["logprobs"]
    assert logprobs == {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def test_an_ending_that_is_not_a_stop_string_keeps_every_token():
    # a special token that decodes to nothing, last: the text ends where it starts, and it stays
    render = CompletionRender(WORD_PIECES, logprobs=True)
    for d in (delta("Hel", [1]), delta("", [6], "stop")):
        render.collect(d)
    assert render.response(META, "stop", proto.usage(1, 2))["choices"][0]["logprobs"]["tokens"] == ["Hel", ""]


@pytest.mark.parametrize("stop", [". It is", "al", "🔥 "], ids=["whole-tokens", "inside-a-token", "inside-emoji"])
def test_smollm2_streams_logprobs_that_spell_the_returned_text(smollm2_tokenizer, stop):
    """The text's tokens one event at a time through the real detokenizer and stop matcher: the
    logprob tokens sent, joined, are the returned text (or run past it by the straddling token's
    tail), streamed and whole, for completions and chat."""
    generated = " Paris. It is the capital 🎉🔥 of France. It is big"
    ids = smollm2_tokenizer(generated, add_special_tokens=False)["input_ids"]
    pieces = TokenPieces(smollm2_tokenizer)
    stream = TextStream("r", smollm2_tokenizer, (stop,), prompt_tokens=3)
    deltas = []
    for k, token in enumerate(ids):
        deltas.append(stream.delta(TokenEvent("r", [token], "length" if k == len(ids) - 1 else None,
                                              [TokenLogprob(token, -1.0, [])])))
        if deltas[-1].finish_reason is not None:
            break
    text = "".join(d.text for d in deltas)
    assert deltas[-1].stopped_by_string and text == generated[:generated.index(stop)]
    completion, chat = CompletionRender(pieces, logprobs=True), ChatRender(pieces, logprobs=True)
    chunks = streamed(CompletionRender(pieces, logprobs=True), deltas)
    for d in deltas:
        completion.collect(d)
        chat.collect(d)
    whole = completion.response(META, "stop", proto.usage(3, len(deltas)))["choices"][0]["logprobs"]
    sent = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert sent == whole["tokens"]
    kept = ids[:len(whole["tokens"])]
    assert whole["tokens"] == [pieces.text(i) for i in kept]  # the first tokens, in order
    spelled = b"".join(pieces.bytes(i) for i in kept)
    # they spell the text, the last one at most running past the cut: it starts before it
    assert spelled.startswith(text.encode()) and len(spelled) - len(pieces.bytes(kept[-1])) < len(text.encode())
    assert all(text[offset:offset + len(token)] == token[:len(text) - offset]
               for token, offset in zip(whole["tokens"], whole["text_offset"]) if not token.startswith("bytes:"))
    content = chat.response(META, "stop", proto.usage(3, len(deltas)))["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == whole["tokens"]
    # without the stop string every generated token is listed
    render = CompletionRender(pieces, logprobs=True)
    plain = TextStream("r", smollm2_tokenizer, (), prompt_tokens=3)
    for k, token in enumerate(ids):
        render.collect(plain.delta(TokenEvent("r", [token], "length" if k == len(ids) - 1 else None,
                                              [TokenLogprob(token, -1.0, [])])))
    assert len(render.response(META, "length", proto.usage(3, len(ids)))["choices"][0]["logprobs"]["tokens"]) == len(ids)


def stop_run(tokenizer, ids: list[int], stop: str) -> dict:
    """The tokens one event each through TextStream with `stop`, collected: the completions body."""
    stream, render = TextStream("r", tokenizer, (stop,), 1), CompletionRender(TokenPieces(tokenizer), True)
    for token in ids:
        d = stream.delta(TokenEvent("r", [token], None, [TokenLogprob(token, -1.0, [])]))
        render.collect(d)
        if d.finish_reason:
            break
    assert d.stopped_by_string
    return render.response(META, "stop", proto.usage(1, len(ids)))["choices"][0]


@pytest.mark.parametrize("text, stop, cut, kept", [
    # " 🔥" is ' \xf0\x9f', '\x94', '\xa5': the first token carries the space that was sent, the
    # other two only the stop string's bytes, though all three share the text offset of "Hi"'s end
    ("Hi 🔥 there", "🔥", "Hi ", ["Hi", "bytes:\\x20\\xf0\\x9f"]),
    ("Tokyo 日本 is", "日本", "Tokyo ", ["To", "kyo", "bytes:\\x20\\xe6"]),
], ids=["emoji", "cjk"])
def test_a_stop_string_starting_inside_a_split_character_drops_only_its_own_tokens(smollm2_tokenizer, text,
                                                                                   stop, cut, kept):
    body = stop_run(smollm2_tokenizer, smollm2_tokenizer(text, add_special_tokens=False)["input_ids"], stop)
    assert body["text"] == cut and body["logprobs"]["tokens"] == kept


def test_a_special_token_just_before_a_stop_string_is_kept(smollm2_tokenizer):
    encode = lambda s: smollm2_tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = smollm2_tokenizer.eos_token_id
    body = stop_run(smollm2_tokenizer, encode("Hello") + [eos] + encode(" END more"), " END")
    assert body["text"] == "Hello"
    assert body["logprobs"]["tokens"] == ["Hello", smollm2_tokenizer.decode([eos])]


def test_a_stop_string_right_after_bytes_no_token_completed_gets_no_logprobs(smollm2_tokenizer):
    """Byte 0xE2 alone (token 173 in SmolLM2) starts a character no later token completes: the text
    shows it as U+FFFD, three bytes for one, and the stop string's token right after it is dropped,
    as anywhere else."""
    encode = lambda s: smollm2_tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    broken = smollm2_tokenizer.convert_tokens_to_ids("\u00e2")  # the byte-level stand-in for 0xE2
    body = stop_run(smollm2_tokenizer, encode("Hi") + [broken] + encode(" END more"), " END")
    assert body["text"] == "Hi\ufffd"
    assert body["logprobs"]["tokens"] == ["Hi", "bytes:\\xe2"]
    # the token after such bytes starts where its own text does: a stop string one byte into it
    # leaves it straddling the cut, so it is kept
    body = stop_run(smollm2_tokenizer, encode("Hi") + [broken] + encode(" END more"), "END")
    assert body["text"] == "Hi\ufffd " and body["logprobs"]["tokens"] == ["Hi", "bytes:\\xe2", " END"]
    # a split character's first token right after them: placed after the U+FFFD, so a stop string
    # that starts with it drops it, and one that starts one byte later keeps it
    body = stop_run(smollm2_tokenizer, encode("Hi") + [broken] + encode(" 🔥 there"), " 🔥")
    assert body["text"] == "Hi\ufffd" and body["logprobs"]["tokens"] == ["Hi", "bytes:\\xe2"]
    body = stop_run(smollm2_tokenizer, encode("Hi") + [broken] + encode(" 🔥 there"), "🔥")
    assert body["logprobs"]["tokens"] == ["Hi", "bytes:\\xe2", "bytes:\\x20\\xf0\\x9f"]


def _text_byte_of_each_byte(raw: bytes) -> list[int]:
    """Where each byte of `raw` lands in its UTF-8 decoding with replacement: bytes of whole
    characters at their own place, every byte of a run the decoder replaces at its U+FFFD."""
    import codecs

    runs = []

    def record(err):
        runs.append((err.start, err.end))
        return "\ufffd", err.end

    codecs.register_error("test-record-replaced", record)
    raw.decode("utf-8", "test-record-replaced")
    where, at, k = [], 0, 0
    for start, end in runs + [(len(raw), len(raw))]:
        where += range(at, at + start - k)
        at, k = at + start - k, start
        if start < end:
            where += [at] * (end - start)
            at, k = at + 3, end
    return where


def test_random_token_runs_keep_exactly_the_tokens_that_start_before_a_stop_string(smollm2_tokenizer):
    """Seeded runs of text pieces and lone bytes that start characters (some never completed): every
    token that brings bytes, whole or part of a character, keeps its entry exactly when its first
    byte lands before the cut in the decoded text, and the stream sends the same entries."""
    import random

    encode = lambda s: smollm2_tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    pieces, rng = TokenPieces(smollm2_tokenizer), random.Random(0)
    texts = ["Hi 🔥 there, 日本 is big. END", "naïve café — ok", "plain words here", "x😀y😀z"]
    lone_bytes = [smollm2_tokenizer.convert_tokens_to_ids(c) for c in "\u00e2\u00f0\u0141\u0142"]
    checked = 0
    while checked < 200:
        ids = []
        for _ in range(rng.randint(2, 6)):
            if rng.random() < 0.3:
                ids.append(rng.choice(lone_bytes))
            else:
                text = rng.choice(texts)
                start = rng.randrange(len(text))
                ids += encode(text[start:start + rng.randint(1, 8)])
        full = smollm2_tokenizer.decode(ids)
        start = rng.randrange(1, max(len(full), 2))
        stop = full[start:start + rng.randint(1, 3)]
        if not stop or "\ufffd" in stop or full.index(stop) == 0:
            continue
        body = stop_run(smollm2_tokenizer, ids + encode(" tail"), stop)
        cut, kept = len(body["text"].encode()), len(body["logprobs"]["tokens"])
        raw = b"".join(pieces.bytes(i) for i in ids)
        lands = _text_byte_of_each_byte(raw)
        before = 0
        for i, token in enumerate(ids):
            if pieces.bytes(token):
                assert (i < kept) == (lands[before] < cut), (ids, stop, body["logprobs"]["tokens"])
                before += len(pieces.bytes(token))
        stream, render = TextStream("r", smollm2_tokenizer, (stop,), 1), CompletionRender(pieces, True)
        sent = []
        for token in ids + encode(" tail"):
            chunk = render.chunk(META, stream.delta(TokenEvent("r", [token], None, [TokenLogprob(token, -1.0, [])])))
            sent += (chunk["choices"][0]["logprobs"] or {}).get("tokens", []) if chunk else []
            if chunk and chunk["choices"][0]["finish_reason"]:
                break
        assert sent == body["logprobs"]["tokens"]
        checked += 1


def test_a_split_character_after_bytes_no_token_completed_is_offset_past_their_u_fffd(smollm2_tokenizer):
    """A stray byte (the last of another emoji) shows as U+FFFD; the tokens of the character after
    it had the text offset of the text before the U+FFFD (0 where it is 1), and with two stray
    bytes two characters too few."""
    encode = lambda s: smollm2_tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    stray = encode("😌")[-1]  # 0x8C, a continuation byte alone
    emoji = encode("😍")
    assert len(emoji) > 1  # a split character: the case at hand
    for strays, text in (([stray], "\ufffd😍 hello"), ([encode("😌")[-2], stray], "\ufffd\ufffd😍 hello")):
        ids = strays + emoji + encode(" hello")
        stream, render = TextStream("r", smollm2_tokenizer, (), 1), CompletionRender(TokenPieces(smollm2_tokenizer), True)
        for k, token in enumerate(ids):
            render.collect(stream.delta(TokenEvent("r", [token], "length" if k == len(ids) - 1 else None,
                                                   [TokenLogprob(token, -1.0, [])])))
        body = render.response(META, "length", proto.usage(1, len(ids)))["choices"][0]
        assert body["text"] == text
        before = len(strays)  # each stray byte is one U+FFFD
        assert body["logprobs"]["text_offset"] == list(range(before)) + [before] * len(emoji) + [before + 1]
