"""The load generator: N concurrent streaming clients on /v1/completions, with the official client.

Each client sends its requests one after another (a closed loop), all clients at once. A request is
a list of token ids (the completions API accepts one), so every prompt is exactly the length asked
for whatever the server's tokenizer would do with text.
"""

from __future__ import annotations

import asyncio
import secrets
import time

from benchmarks.serving_stats import RequestRecord

PROMPT_TEXT = ("The history of the harbour begins with a few fishing boats sheltered behind a sand bar. "
               "Merchants arrived with salt, timber and wool, built warehouses along the quay, and "
               "the village grew into a busy port whose streets still follow the old shore line. ")


def build_prompt(tokenizer, index: int, length: int, run: str = "") -> list[int]:
    """Exactly `length` token ids that differ between indices, and between runs, within their first
    few tokens (the run's tag and the index are spelled after the first word, so with SmolLM2's
    tokenizer prompts share up to 2 leading tokens): no server can reuse a cached prefix of another
    request's prompt longer than that, and block-wise prefix caches (vLLM's 16-token blocks) none at
    all. Without the run's tag, a run's prompts began with the prompts of an earlier run with fewer
    tokens against the same server: vLLM answered 2000-token prompts in 0.76 s after a 1056-token
    run, 1.30 s without one (machine R)."""
    if length < 1:
        raise ValueError(f"prompt length ({length}) must be at least 1 token")
    text = f"Story {run}{index}. "
    ids: list[int] = []
    while len(ids) < length:
        text += PROMPT_TEXT
        ids = tokenizer(text)["input_ids"]
    return ids[:length]


class PromptSource:
    """Hands out fresh prompts: no two requests of a run share a prompt (warm-up waves included), nor
    a prompt of another run (a random tag of the run's in each)."""

    def __init__(self, tokenizer, length: int):
        self._tokenizer = tokenizer
        self._length = length
        self._next = 0
        self.run = f"{secrets.randbelow(10 ** 6):06d}-"

    def take(self, count: int) -> list[list[int]]:
        prompts = [build_prompt(self._tokenizer, self._next + i, self._length, self.run) for i in range(count)]
        self._next += count
        return prompts


async def stream_one(client, model: str, prompt: list[int], max_tokens: int) -> RequestRecord:
    """One streamed greedy completion of exactly max_tokens tokens (EOS ignored); errors are
    recorded, not raised, so one failure does not hide the level's other figures."""
    record = RequestRecord(sent_s=time.perf_counter())
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and not _closing(chunk.choices[0]):
                record.chunk_times_s.append(time.perf_counter())
            if chunk.usage is not None:
                record.completion_tokens = chunk.usage.completion_tokens
        record.finished_s = time.perf_counter()
    except Exception as err:  # noqa: BLE001 - reported in the level's figures
        record.error = f"{type(err).__name__}: {err}"[:300]
    return record


def _closing(choice) -> bool:
    """A chunk that only ends the stream (no text, a finish_reason), which some servers send after
    the last token's: neither a token nor a gap between tokens (it was counted as a token when the
    server sent no usage)."""
    return not getattr(choice, "text", None) and getattr(choice, "finish_reason", None) is not None


async def run_level(client, model: str, prompts: list[list[int]], clients: int,
                    max_tokens: int) -> tuple[list[RequestRecord], float]:
    """`clients` concurrent clients share out the prompts (client c sends prompts c, c + clients,
    ...); returns every record and the wall time from the first send to the last end."""
    if clients < 1 or len(prompts) % clients:
        raise ValueError(f"the prompts ({len(prompts)}) must split evenly over the clients ({clients})")

    async def client_loop(first: int) -> list[RequestRecord]:
        return [await stream_one(client, model, prompt, max_tokens) for prompt in prompts[first::clients]]

    start = time.perf_counter()
    per_client = await asyncio.gather(*(client_loop(c) for c in range(clients)))
    wall = time.perf_counter() - start
    return [record for records in per_client for record in records], wall
