"""IncrementalDetokenizer with tokenizers other than SmolLM2's byte-level BPE, built here from a
hand-written vocabulary (no download): SentencePiece-style byte fallback (Llama 2, Mistral) and
WordPiece with its clean-up of spaces. The stream's deltas must add up to the text generate()
reads for the same tokens, and never hold a U+FFFD for bytes that formed a whole character."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from launcher.serving.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, decode_text

BYTES = [f"<0x{b:02X}>" for b in range(256)]


@pytest.fixture(scope="module")
def byte_fallback():
    """Words with the "▁" space marker and every byte as a token: characters outside the words
    (CJK, emoji) are spelled in byte tokens, which the decoder turns back into UTF-8 (one U+FFFD
    per byte of a run that is not valid UTF-8), as Llama 2's and Mistral's tokenizers do."""
    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>", *BYTES, "▁", "▁don", "▁ok", "A", "c"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def wordpiece():
    vocab = {token: i for i, token in enumerate(["[UNK]", "[SEP]", "ß", "'", "w", ".", "ok", "##ay", "a"])}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]",
                                   clean_up_tokenization_spaces=True)


def streamed(tokenizer, ids: list[int], chunk: int = 1) -> str:
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)] + [detok.flush()]
    return "".join(deltas)


def spelled(tokenizer, *tokens: str) -> list[int]:
    return tokenizer.convert_tokens_to_ids(list(tokens))


def test_a_character_cut_by_the_end_after_whole_ones_costs_one_replacement_per_dangling_byte(byte_fallback):
    """中文 then two bytes of a third character: the byte-fallback decoder replaces the whole run of
    byte tokens, so the window's context no longer prefixed its decode and the stream read "中文"
    with four U+FFFD (a U+FFFD for every byte of 文 too)."""
    ids = spelled(byte_fallback, "<0xE4>", "<0xB8>", "<0xAD>", "<0xE6>", "<0x96>", "<0x87>", "<0xE4>", "<0xB8>")
    assert streamed(byte_fallback, ids) == "中文" + REPLACEMENT_CHAR * 2
    ids = spelled(byte_fallback, "<0xE4>", "<0xB8>", "<0xAD>", "<0xE4>")
    assert streamed(byte_fallback, ids) == "中" + REPLACEMENT_CHAR


def test_dangling_bytes_mid_stream_are_replaced_once_each_and_the_text_goes_on(byte_fallback):
    emoji = spelled(byte_fallback, "<0xF0>", "<0x9F>", "<0x98>", "<0x80>")  # 😀
    ids = emoji + spelled(byte_fallback, "<0xF0>", "<0x9F>", "▁don")
    for chunk in (1, 2):  # one token an event, as the serving loop sends them: the emoji is out first
        assert streamed(byte_fallback, ids, chunk) == "😀" + REPLACEMENT_CHAR * 2 + " don"  # it read 5 U+FFFD
    # the emoji's last byte and the dangling ones in one push: decoded as one run, as the full decode does
    assert streamed(byte_fallback, ids, 3) == decode_text(byte_fallback, ids) == REPLACEMENT_CHAR * 6 + " don"


def test_valid_byte_fallback_text_streams_as_its_full_decode(byte_fallback):
    """Whatever the push sizes, text whose bytes all form characters streams exactly as
    decode_text (generate()'s text) reads it, and no delta holds a U+FFFD."""
    rng = random.Random(5)
    pieces = [list("中文".encode()), list("😀".encode()), list("é".encode()), ["▁don"], ["▁ok"], ["A"], ["c"], ["▁"]]
    for _ in range(300):
        tokens = [t if isinstance(t, str) else f"<0x{t:02X}>" for _ in range(rng.randint(1, 8))
                  for t in rng.choice(pieces)]
        ids = spelled(byte_fallback, *tokens)
        detok = IncrementalDetokenizer(byte_fallback)
        chunk = rng.randint(1, 3)
        deltas = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)] + [detok.flush()]
        assert "".join(deltas) == decode_text(byte_fallback, ids), tokens
        assert not any(REPLACEMENT_CHAR in d for d in deltas), (tokens, deltas)


def test_a_wordpiece_stream_reads_as_generates_text_without_the_clean_up_of_spaces(wordpiece):
    """The tokenizer's clean-up joins text across tokens (" ' " to "'"), which a window cannot see
    whole: the stream read "ß ' w" where generate()'s decode read "ß'w". Both now skip it."""
    ids = spelled(wordpiece, "ß", "'", "w", ".", "ok", "##ay")
    assert streamed(wordpiece, ids) == decode_text(wordpiece, ids) == "ß ' w. okay"
    assert wordpiece.decode(ids) == "ß'w. okay"  # the clean-up the stream cannot do
