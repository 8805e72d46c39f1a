"""A stream_interval's gathered deltas through the chat and Responses renderers
(launcher/serving/openai_render.py): what needs each token by itself (which tokens' log-probabilities
a thinking answer's Responses stream carries, the usage's reasoning tokens counted by text) comes out
as with one token a delta."""

from __future__ import annotations

import random

import pytest

from launcher.serving.openai_protocol import ResponseMeta
from launcher.serving.openai_render import ChatRender
from launcher.serving.reasoning import ThinkTokens
from launcher.serving.text_stream import TextStream
from launcher.serving.token_pieces import TokenPieces
from tests.test_held_tokens import gathered
from workers.serving.requests import TokenEvent, TokenLogprob

THOUGHTS = ["I think", " so.", "\n", " Let me see", " 日本", "<think>", " hm"]
ANSWERS = ["Hello", " world", "!", " é", "\n\nBlue."]


def events_of(ids: list[int]) -> list[TokenEvent]:
    return [TokenEvent("r", [t], "stop" if i == len(ids) - 1 else None, [TokenLogprob(t, -0.01 * i, [(t, -0.01 * i)])])
            for i, t in enumerate(ids)]


def rendered(tokenizer, events: list[TokenEvent], parser: str):
    """(the Responses stream's logprob tokens, its message deltas' reasoning and content, the chat
    stream's reasoning and content, and both renders' reasoning token counts)."""
    pieces = TokenPieces(tokenizer)
    text = TextStream("r", tokenizer, (), 1)
    responses = ChatRender(pieces, True, 0, None, True, None, (parser, True), True, ThinkTokens())
    chat = ChatRender(pieces, True, 0, None, True, None, (parser, True), True, ThinkTokens())
    meta = ResponseMeta("chatcmpl-x", 0, "m")
    logprob_tokens, said, chunks = [], {"reasoning": "", "content": ""}, {"reasoning": "", "content": ""}
    for event in events:
        delta = text.delta(event)
        logprob_tokens += [entry["token"] for entry in responses.message_logprobs(delta)]
        for key, value in responses.message(delta).items():
            said[key] += value
        chunk = chat.chunk(meta, delta)
        for key, value in (chunk["choices"][0]["delta"].items() if chunk else ()):
            chunks[key] = chunks.get(key, "") + (value if isinstance(value, str) else "")
    return logprob_tokens, said, chunks, responses.reasoning_tokens(), chat.reasoning_tokens()


@pytest.mark.parametrize("seed", range(10))
def test_gathered_deltas_render_as_one_token_a_delta(smollm2_tokenizer, seed):
    rng = random.Random(seed)
    parser = rng.choice(["deepseek_r1", "qwen3"])
    thought = "".join(rng.choice(THOUGHTS) for _ in range(rng.randint(1, 5)))
    answer = "".join(rng.choice(ANSWERS) for _ in range(rng.randint(1, 5)))
    ids = smollm2_tokenizer(f"{thought}</think>{answer}", add_special_tokens=False)["input_ids"]
    alone = rendered(smollm2_tokenizer, events_of(ids), parser)
    interval = rng.choice([2, 3, 4, 7])
    assert rendered(smollm2_tokenizer, gathered(events_of(ids), interval), parser) == alone
    logprob_tokens, said, _, counted, _ = alone
    assert said["content"] == answer and "".join(logprob_tokens) == answer  # only the answer's tokens
    assert counted > 0  # by text: SmolLM2's tokenizer has no </think> token
