"""Log-probabilities' view of single tokens (launcher/serving/token_pieces.py): a token that is part
of a character has its own bytes and a text of its own, and text offsets count whole characters."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from launcher.serving.token_pieces import TextOffsets, TokenPieces


def test_the_byte_level_alphabet_is_gpt2s():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from launcher.serving.token_pieces import _BYTE_LEVEL

    assert _BYTE_LEVEL == {char: byte for byte, char in bytes_to_unicode().items()}


def test_tokens_inside_emoji_carry_their_own_bytes_and_offsets(smollm2_tokenizer):
    text = " 🎉🔥\n\nThis"
    ids = smollm2_tokenizer(text)["input_ids"]
    pieces, offsets = TokenPieces(smollm2_tokenizer), TextOffsets(smollm2_tokenizer)
    partial = [i for i in ids if "\ufffd" in smollm2_tokenizer.decode([i])]
    assert len(partial) >= 4  # the two emoji are split into tokens of one to three bytes
    assert b"".join(pieces.bytes(i) for i in ids) == text.encode()
    assert all(pieces.text(i).startswith("bytes:\\x") for i in partial)
    assert len({pieces.text(i) for i in partial}) == len(set(partial))  # distinct keys for top_logprobs
    # an offset is the length of the text emitted before the token: the tokens of " 🎉" are held
    # back until the emoji is whole, so all three sit at 0; those of "🔥" at 2, after " 🎉"
    assert [offsets.place(i)[0] for i in ids] == [0, 0, 0, 2, 2, 2, 3, 4, 5]
    assert pieces.text(ids[-1]) == "This" and pieces.bytes(ids[-1]) == b"This"


def test_a_whole_word_token_is_its_decoded_text(smollm2_tokenizer):
    [token] = smollm2_tokenizer(" Paris")["input_ids"]
    pieces = TokenPieces(smollm2_tokenizer)
    assert pieces.text(token) == " Paris" and pieces.bytes(token) == b" Paris"


def test_special_tokens_take_no_characters_of_the_text(smollm2_tokenizer):
    eos = smollm2_tokenizer.eos_token_id
    offsets = TextOffsets(smollm2_tokenizer)
    [hi] = smollm2_tokenizer("Hi")["input_ids"]
    assert [offsets.place(t)[0] for t in (hi, eos, hi)] == [0, 2, 2]


def test_a_sentencepiece_byte_fallback_piece_is_its_byte():
    tokenizer = SimpleNamespace(decode=lambda ids, **options: "\ufffd", convert_ids_to_tokens=lambda i: "<0xE2>")
    pieces = TokenPieces(tokenizer)
    assert pieces.bytes(7) == b"\xe2" and pieces.text(7) == "bytes:\\xe2"


def llama_style_tokenizer():
    """A SentencePiece-style tokenizer as Llama 2 and Mistral ship it: ▁ for spaces, byte fallback,
    and a decoder that strips the first space of a text."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for word in ["\u2581Paris", "\u2581is", "\u2581nice", "\u2581", "."]:
        vocab[word] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"), vocab


def test_sentencepiece_word_pieces_keep_their_space_and_offsets_follow_the_text():
    from launcher.serving.detokenizer import IncrementalDetokenizer

    tokenizer, vocab = llama_style_tokenizer()
    ids = [vocab[w] for w in ("\u2581Paris", "\u2581is", "\u2581nice", ".")]
    ids += [vocab[f"<0x{b:02X}>"] for b in "🎉".encode()] + [vocab["\u2581is"]]
    text = IncrementalDetokenizer(tokenizer)
    for i in ids:
        text.push([i])
    text.flush()
    assert text.text == "Paris is nice.🎉 is"  # what the response says
    pieces, offsets = TokenPieces(tokenizer), TextOffsets(tokenizer)
    assert tokenizer.decode([vocab["\u2581is"]]) == "is"  # alone, the decoder strips the space
    assert pieces.text(vocab["\u2581is"]) == " is" and pieces.bytes(vocab["\u2581is"]) == b" is"
    assert [pieces.text(i) for i in ids[4:8]] == ["bytes:\\xf0", "bytes:\\x9f", "bytes:\\x8e", "bytes:\\x89"]
    assert b"".join(pieces.bytes(i) for i in ids[1:]) == " is nice.🎉 is".encode()
    # the first token's space is the one the text strips; the others start where the text has them
    assert [offsets.place(i)[0] for i in ids] == [0, 5, 8, 13, 14, 14, 14, 14, 15]


def test_a_sentencepiece_byte_token_is_its_byte_even_where_decoding_it_alone_strips_it():
    """<0x20> decoded alone is "" (the decoder strips a leading space): its text and bytes were
    empty, so a client joining the tokens' bytes lost the space."""
    tokenizer, vocab = llama_style_tokenizer()
    pieces = TokenPieces(tokenizer)
    space, letter, high = vocab["<0x20>"], vocab["<0x41>"], vocab["<0xE2>"]
    assert tokenizer.decode([space]) == ""
    assert pieces.text(space) == " " and pieces.bytes(space) == b" "
    assert pieces.text(letter) == "A" and pieces.bytes(letter) == b"A"
    assert pieces.text(high) == "bytes:\\xe2" and pieces.bytes(high) == b"\xe2" and pieces.part_of_a_character(high)
    ids = [vocab["\u2581Paris"], space, letter]
    assert b"".join(pieces.bytes(i) for i in ids) == " Paris A".encode()


def test_a_run_of_sentencepiece_spaces_keeps_every_space():
    """Llama's decoder strips one leading space, so "▁▁▁▁" decodes alone to three."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "\u2581\u2581\u2581\u2581": 1, "\u2581\u2581": 2}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    assert tokenizer.decode([1]) == "   "
    pieces = TokenPieces(tokenizer)
    assert pieces.text(1) == "    " and pieces.bytes(2) == b"  "


def test_a_whole_token_after_bytes_no_token_completes_is_placed_after_their_replacement(smollm2_tokenizer):
    """Bytes that no later token completes come out as U+FFFD together with the next token; that
    token's text_offset was the U+FFFD's, so text[offset:] read the U+FFFD and not the token."""
    from launcher.serving.detokenizer import IncrementalDetokenizer
    from launcher.serving.logprob_alignment import AlignedLogprobs
    from workers.serving.requests import TokenLogprob

    pieces = TokenPieces(smollm2_tokenizer)
    dead, word, more = 37992, 30949, smollm2_tokenizer(" more")["input_ids"][0]  # b"\xe5\x89", " Hale"
    assert pieces.part_of_a_character(dead) and pieces.text(word) == " Hale"
    ids = [word, dead, word, more]
    text = smollm2_tokenizer.decode(ids)
    assert text == " Hale\ufffd Hale more"
    detokenizer, aligned, placed = IncrementalDetokenizer(smollm2_tokenizer), AlignedLogprobs(pieces), []
    for token in ids:
        delta = detokenizer.push([token])
        placed += aligned.push(SimpleNamespace(logprobs=[TokenLogprob(token, -1.0)], text=delta, finish_reason=None,
                                               stopped_by_string=False))
    offsets = [offset for _, offset in placed]
    assert offsets == [0, 5, 6, 11]  # the dead bytes at their U+FFFD, each word at its own start
    for token, offset in zip(ids, offsets):
        if token != dead:
            assert text[offset:].startswith(pieces.text(token)), (token, offset, text)
