"""The completion's text decoded after the prompt's last tokens (launcher/serving/detokenizer.py,
as vLLM's FastIncrementalDetokenizer): a SentencePiece decoder (Llama 2, Mistral) strips the space
of the first token of a text, so decoded alone the first generated "▁Paris" was "Paris", the
echoed prompt and the completion ran together, and a stop string " Paris" never matched it.
Byte-level BPE (SmolLM2) reads the same text either way, except where the prompt ends inside a
character."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from launcher.serving.detokenizer import decode_text
from launcher.serving.echoed_prompt import echoed_prompt
from launcher.serving.logprob_alignment import AlignedLogprobs
from launcher.serving.openai_render import CompletionRender
from launcher.serving.text_stream import TextStream
from launcher.serving.token_pieces import TokenPieces
from workers.serving.requests import TokenEvent, TokenLogprob

BYTES = [f"<0x{b:02X}>" for b in range(256)]
WORDS = ["▁The", "▁capital", "▁is", "▁Paris", ".", "▁of"]


@pytest.fixture(scope="module")
def llama_style():
    """Llama 2's / Mistral's fast decoder (Replace, ByteFallback, Fuse, Strip one leading space)."""
    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>", *BYTES, *WORDS])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def read(stream: TextStream, ids: list[int]) -> list:
    """The deltas of `ids` generated one a step, the last ending the request, each with its logprob."""
    return [stream.delta(TokenEvent("r", [token], "length" if i == len(ids) - 1 else None, [TokenLogprob(token, -1.0)]))
            for i, token in enumerate(ids)]


def placed(pieces: TokenPieces, deltas: list, prompt_ids) -> list[int]:
    aligned = AlignedLogprobs(pieces, prompt_ids=prompt_ids)
    return [offset for d in deltas for _, offset in aligned.push(d)]


def test_the_first_generated_sentencepiece_token_keeps_its_space_after_the_prompt(llama_style):
    prompt = llama_style.convert_tokens_to_ids(["<s>", "▁The", "▁capital", "▁is"])
    generated = llama_style.convert_tokens_to_ids(["▁Paris", "."])
    whole = decode_text(llama_style, prompt + generated)
    assert whole == "The capital is Paris."
    stream = TextStream("r", llama_style, (), len(prompt), prompt_ids=prompt)
    deltas = read(stream, generated)
    text = "".join(d.text for d in deltas)
    assert text == " Paris."  # decoded alone it read "Paris."
    from launcher.serving.detokenizer import decode_after_prompt  # new with the fix

    assert decode_after_prompt(llama_style, generated, prompt) == text  # generate()'s text reads the same
    # the logprobs' offsets count the same text: each token's text is where its offset says
    pieces = TokenPieces(llama_style)
    offsets = placed(pieces, deltas, stream.prompt_context)
    assert offsets == [0, 6]
    assert [text[o:o + len(pieces.text(t))] for o, t in zip(offsets, generated)] == [" Paris", "."]
    # echoed: the prompt and the completion read as the whole decode, not "The capital isParis."
    echo = echoed_prompt(pieces, "The capital is", prompt, with_logprobs=True)
    render = CompletionRender(pieces, logprobs=True, echo=echo, prompt_ids=stream.prompt_context)
    for d in read(TextStream("r", llama_style, (), len(prompt), prompt_ids=prompt), generated):
        render.collect(d)
    choice = render.choice("length")
    assert choice["text"] == whole
    lp = choice["logprobs"]
    assert lp["tokens"][-2:] == [" Paris", "."]
    for token, offset in zip(lp["tokens"][1:], lp["text_offset"][1:]):  # the BOS stands before the text, at 0
        assert choice["text"][offset:offset + len(token)] == token, (token, offset)


def test_a_stop_string_that_begins_with_the_first_tokens_space_ends_the_request(llama_style):
    prompt = llama_style.convert_tokens_to_ids(["▁The", "▁capital", "▁is"])
    stream = TextStream("r", llama_style, (" Paris",), len(prompt), prompt_ids=prompt)
    deltas = read(stream, llama_style.convert_tokens_to_ids(["▁Paris", "."]))
    assert deltas[0].finish_reason == "stop" and deltas[0].stopped_by_string and deltas[0].text == ""


def test_byte_level_text_and_offsets_are_the_same_with_the_prompt_before_them(smollm2_tokenizer):
    """SmolLM2 decodes a token the same whatever precedes it: priming changes nothing where the
    prompt ends on a whole character (every split of real text below does)."""
    rng = random.Random(7)
    text = "The café 🦜 said: «Ça va?» — 中文 and\n\n  spaces, <|im_end|> done. 🎉🔥 ok"
    ids = smollm2_tokenizer(text)["input_ids"]
    pieces = TokenPieces(smollm2_tokenizer)
    checked = 0
    for _ in range(60):
        cut = rng.randint(1, len(ids) - 1)
        prompt, generated = ids[:cut], ids[cut:]
        if "\ufffd" in smollm2_tokenizer.decode(prompt):
            continue  # ends inside a character: the next test's case
        alone, primed = (read(TextStream("r", smollm2_tokenizer, (), cut, **kw), generated)
                         for kw in ({}, {"prompt_ids": prompt}))
        assert [d.text for d in primed] == [d.text for d in alone], cut
        assert placed(pieces, primed, prompt) == placed(pieces, alone, ()), cut
        checked += 1
    assert checked > 20


def test_a_prompt_that_ends_inside_a_character_lets_the_completion_bring_it_whole(smollm2_tokenizer):
    """vLLM's rule: the prompt's bytes of an unfinished character are held like any, and the
    generated tokens that complete it bring the whole character out first in the completion's text
    (decoded alone they were U+FFFD, one per stray byte)."""
    ids = smollm2_tokenizer("a🦜 world")["input_ids"]
    pieces = TokenPieces(smollm2_tokenizer)
    assert [pieces.text(i) for i in ids] == ["a", "bytes:\\xf0\\x9f", "bytes:\\xa6", "bytes:\\x9c", " world"]
    prompt, generated = ids[:2], ids[2:]
    stream = TextStream("r", smollm2_tokenizer, (), 2, prompt_ids=prompt)
    deltas = read(stream, generated)
    assert [d.text for d in deltas] == ["", "🦜", " world"]
    from launcher.serving.detokenizer import decode_after_prompt  # new with the fix

    assert decode_after_prompt(smollm2_tokenizer, generated, prompt) == "🦜 world"
    # the tokens of the character sit before it, the word after it
    assert placed(pieces, deltas, stream.prompt_context) == [0, 0, 1]
    # bytes no generated token completes: the prompt's dangling bytes are one U+FFFD before the word
    stream = TextStream("r", smollm2_tokenizer, (), 2, prompt_ids=prompt)
    deltas = read(stream, ids[4:])
    assert "".join(d.text for d in deltas) == "\ufffd world" == decode_text(smollm2_tokenizer, ids[1:2] + ids[4:])
    assert placed(pieces, deltas, stream.prompt_context) == [1]
    # a request that ends before any generated token: the prompt's bytes are no completion text
    stream = TextStream("r", smollm2_tokenizer, (), 2, prompt_ids=prompt)
    assert stream.held_delta() is None


def test_a_choices_render_finds_the_prompt_its_text_was_primed_with(llama_style):
    """The server builds each choice's render with ChoiceStreams.prompt_context(i): the context its
    engine stream's TextStream was primed with, so the logprobs count the same text."""
    import asyncio

    from launcher.cluster.stream_handle import StreamHandle
    from launcher.serving.choice_streams import ChoiceStreams
    from launcher.serving.request_streams import AsyncRequestStream
    from shardlib.sampling_params import SamplingParams
    from workers.serving.requests import StreamRequest

    prompt = llama_style.convert_tokens_to_ids(["<s>", "▁The", "▁capital", "▁of", "▁Paris", "▁is"])

    async def context() -> list[int]:
        items = asyncio.Queue()
        handle = StreamHandle(StreamRequest("r", tuple(prompt), SamplingParams(), 4), items.put_nowait, 5.0)
        text = TextStream("r", llama_style, (), len(prompt), prompt_ids=prompt)
        stream = AsyncRequestStream(lambda *args, **kwargs: None, handle, text, items, asyncio.get_running_loop())
        return ChoiceStreams([stream], [len(prompt)]).prompt_context(0)

    assert asyncio.run(context()) == prompt[-4:]  # the fewest (4) whose decode is whole characters
