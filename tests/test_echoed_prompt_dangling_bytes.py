"""An echoed prompt's text_offsets are placed as the completion's are (one placer,
launcher/serving/token_pieces.py TokenPlacer): bytes no token completes come out as U+FFFD with
the next whole token, each at its U+FFFD; counting only the text emitted before each token put
them all at 0 (SmolLM2's [116, 246, 905]: "��" then " world" echoed at 0, 0, 0)."""

from __future__ import annotations

from launcher.serving.echoed_prompt import echoed_prompt
from launcher.serving.logprob_alignment import AlignedLogprobs
from launcher.serving.text_stream import TextStream
from launcher.serving.token_pieces import TokenPieces
from workers.serving.requests import TokenEvent, TokenLogprob


def test_an_echoed_prompt_starting_with_stray_bytes_places_them_as_the_completion_does(smollm2_tokenizer):
    pieces = TokenPieces(smollm2_tokenizer)
    ids = smollm2_tokenizer("a🦜 world")["input_ids"][2:]  # a prompt kept from the emoji's third byte on
    assert [pieces.text(i) for i in ids] == ["bytes:\\xa6", "bytes:\\x9c", " world"]
    echo = echoed_prompt(pieces, ids, ids, with_logprobs=True)
    assert echo.text == "\ufffd\ufffd world"
    assert echo.offsets == (0, 1, 2)  # each stray byte at its own U+FFFD, the word after them
    assert echo.text[echo.offsets[2]:] == " world"
    # the same tokens generated: the completion's offsets agree
    stream = TextStream("r", smollm2_tokenizer, (), 1)
    delta = stream.delta(TokenEvent("r", ids, "length", [TokenLogprob(i, -1.0) for i in ids]))
    assert delta.text == echo.text
    assert tuple(offset for _, offset in AlignedLogprobs(pieces).push(delta)) == echo.offsets
