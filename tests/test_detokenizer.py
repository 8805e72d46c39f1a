"""IncrementalDetokenizer against SmolLM2's own tokenizer (byte-level BPE): the deltas never end
inside a character, and together they are exactly the full decode.

Only the tokenizer is loaded (no weights, no Ray). The built-in model folder is converted once per
cache (about 15 s on a fresh machine), then reused.
"""

from __future__ import annotations

import random

import pytest

from launcher.serving.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

TEXTS = [
    "The capital of France is Paris.",
    "Emoji: 😀👍🏽🇫🇷 and a family 👨‍👩‍👧‍👦 in one grapheme.",
    "中文字符和日本語のテキスト、한국어도.",
    "Accents: café, naïve, Ærøskøbing, Ångström, façade, Dvořák.",
    "Mixed 🙂 text 東京 with ünïcödé and 🤖🤖🤖 repeated",
    "   leading spaces and\ttabs\nand new lines\n\n",
    "Math: ∑ᵢ xᵢ² ≤ ∞, arrows → ⇒, box drawing ┌─┐",
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from shardlib.demo_model import ensure_demo_model

    return AutoTokenizer.from_pretrained(ensure_demo_model())


def stream(tokenizer, ids: list[int], chunks: list[int], skip_special_tokens: bool = True):
    """Pushes `ids` in pieces of the given sizes; returns (every delta including the flush, detok)."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas, start = [], 0
    for size in chunks:
        deltas.append(detok.push(ids[start:start + size]))
        start += size
    assert start == len(ids)
    deltas.append(detok.flush())
    return deltas, detok


def one_by_one(ids: list[int]) -> list[int]:
    return [1] * len(ids)


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_matches_the_full_decode(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    deltas, detok = stream(tokenizer, ids, one_by_one(ids))
    assert "".join(deltas) == detok.text == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)


def test_an_emoji_split_across_tokens_is_held_until_complete(tokenizer):
    ids = tokenizer("A😀")["input_ids"]
    assert len(ids) >= 3, "the test needs an emoji that byte-level BPE splits into several tokens"
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids[:1]) == "A"
    assert [detok.push([i]) for i in ids[1:-1]] == [""] * (len(ids) - 2)  # held: half an emoji
    assert detok.push(ids[-1:]) == "😀"
    assert detok.text == "A😀" and detok.flush() == ""


def test_flush_releases_a_character_cut_off_by_the_end_of_the_generation(tokenizer):
    ids = tokenizer("ok 😀")["input_ids"][:-1]  # the emoji's last byte never comes
    deltas, detok = stream(tokenizer, ids, one_by_one(ids))
    full = tokenizer.decode(ids)
    assert full.endswith(REPLACEMENT_CHAR)
    assert "".join(deltas) == full and deltas[-1].endswith(REPLACEMENT_CHAR)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_skipped_or_kept_like_decode(tokenizer, skip):
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = [im_start] + tokenizer("assistant\nHi 👋 there")["input_ids"] + [im_end, im_end]
    deltas, detok = stream(tokenizer, ids, one_by_one(ids), skip_special_tokens=skip)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in detok.text) is not skip


def test_empty_push_and_empty_stream(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push([]) == "" and detok.flush() == "" and detok.text == ""


def test_each_push_decodes_a_window_of_the_last_few_tokens_not_the_whole_text(tokenizer):
    decoded_lengths: list[int] = []

    class CountingTokenizer:
        def decode(self, ids, skip_special_tokens=True, **options):
            decoded_lengths.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tokenizer(" ".join(TEXTS) * 8)["input_ids"]
    assert len(ids) > 500
    deltas, _ = stream(CountingTokenizer(), ids, one_by_one(ids))
    assert "".join(deltas) == tokenizer.decode(ids)
    assert max(decoded_lengths) <= 8  # a character is at most 4 byte tokens, plus the context


# ---- property-style: many random sequences --------------------------------------------------------
def random_chunks(rng: random.Random, n: int) -> list[int]:
    chunks = []
    while n:
        chunks.append(min(n, rng.choice([1, 1, 1, 2, 3, 5])))
        n -= chunks[-1]
    return chunks


def check_stream(tokenizer, ids: list[int], rng: random.Random, skip: bool) -> None:
    deltas, detok = stream(tokenizer, ids, random_chunks(rng, len(ids)), skip_special_tokens=skip)
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == detok.text == full, ids
    # a push never ends inside a character: where the whole text has no U+FFFD, no delta has one
    if REPLACEMENT_CHAR not in full:
        assert not any(REPLACEMENT_CHAR in d for d in deltas), ids


def test_random_token_id_sequences(tokenizer):
    rng = random.Random(0)
    vocab = len(tokenizer)
    # byte tokens (ids whose decode is a lone U+FFFD: part of a character) make split characters
    # common; whole random ids make the rest
    partial = [i for i in range(vocab) if tokenizer.decode([i]) == REPLACEMENT_CHAR]
    assert len(partial) > 50
    for _ in range(300):
        n = rng.randint(1, 40)
        ids = [rng.choice(partial) if rng.random() < 0.4 else rng.randrange(vocab) for _ in range(n)]
        check_stream(tokenizer, ids, rng, skip=rng.random() < 0.7)


def test_random_texts(tokenizer):
    rng = random.Random(1)
    alphabet = list("abcdefghij XYZ.,!?\n") + list("éüñøßçÅ") + list("中文日本語한국어") + list("😀👍🔥🤖🇫🇷∑→")
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        ids = tokenizer(text)["input_ids"]
        check_stream(tokenizer, ids, rng, skip=True)
        assert tokenizer.decode(ids) == text
