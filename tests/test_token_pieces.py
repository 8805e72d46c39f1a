"""Log-probabilities' view of single tokens (launcher/serving/token_pieces.py): a token that is part
of a character has its own bytes and a text of its own, and text offsets count whole characters."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from launcher.serving.token_pieces import TextOffsets, TokenPieces


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from shardlib.demo_model import ensure_demo_model

    return AutoTokenizer.from_pretrained(ensure_demo_model())


def test_the_byte_level_alphabet_is_gpt2s():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from launcher.serving.token_pieces import _BYTE_LEVEL

    assert _BYTE_LEVEL == {char: byte for byte, char in bytes_to_unicode().items()}


def test_tokens_inside_emoji_carry_their_own_bytes_and_offsets(smollm2_tokenizer):
    text = " 🎉🔥\n\nThis"
    ids = smollm2_tokenizer(text)["input_ids"]
    pieces, offsets = TokenPieces(smollm2_tokenizer), TextOffsets(TokenPieces(smollm2_tokenizer))
    partial = [i for i in ids if "\ufffd" in smollm2_tokenizer.decode([i])]
    assert len(partial) >= 4  # the two emoji are split into tokens of one to three bytes
    assert b"".join(pieces.bytes(i) for i in ids) == text.encode()
    assert all(pieces.text(i).startswith("bytes:\\x") for i in partial)
    assert len({pieces.text(i) for i in partial}) == len(set(partial))  # distinct keys for top_logprobs
    got = [offsets.next(i) for i in ids]
    # each token starts at the character it is (part of): the text's own index of that character
    starts, at = [], 0
    for i in ids:
        starts.append(len(text.encode()[:at].decode("utf-8", errors="ignore")))
        at += len(pieces.bytes(i))
    assert got == starts and got[-3:] == [3, 4, 5]
    assert pieces.text(ids[-1]) == "This" and pieces.bytes(ids[-1]) == b"This"


def test_a_whole_word_token_is_its_decoded_text(smollm2_tokenizer):
    [token] = smollm2_tokenizer(" Paris")["input_ids"]
    pieces = TokenPieces(smollm2_tokenizer)
    assert pieces.text(token) == " Paris" and pieces.bytes(token) == b" Paris"


def test_special_tokens_take_no_characters_of_the_text(smollm2_tokenizer):
    eos = smollm2_tokenizer.eos_token_id
    offsets = TextOffsets(TokenPieces(smollm2_tokenizer))
    [hi] = smollm2_tokenizer("Hi")["input_ids"]
    assert [offsets.next(t) for t in (hi, eos, hi)] == [0, 2, 2]


def test_a_sentencepiece_byte_fallback_piece_is_its_byte():
    tokenizer = SimpleNamespace(decode=lambda ids: "\ufffd", convert_ids_to_tokens=lambda i: "<0xE2>")
    pieces = TokenPieces(tokenizer)
    assert pieces.bytes(7) == b"\xe2" and pieces.text(7) == "bytes:\\xe2"
