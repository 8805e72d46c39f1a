"""The load generator: N concurrent streaming clients on /v1/completions, with the official client.

Each client sends its requests one after another (a closed loop), all clients at once. A request is
a list of token ids (the completions API accepts one), so every prompt is exactly the length asked
for whatever the server's tokenizer would do with text.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from benchmarks.serving_stats import RequestRecord

PROMPT_TEXT = ("The history of the harbour begins with a few fishing boats sheltered behind a sand bar. "
               "Merchants arrived with salt, timber and wool, built warehouses along the quay, and "
               "the village grew into a busy port whose streets still follow the old shore line. ")


def build_prompt(tokenizer, index: int, length: int, run: str = "") -> list[int]:
    """Exactly `length` token ids that differ between indices, and between runs, within their first
    few tokens: the index comes first, then the run's tag. SmolLM2's tokenizer spells numbers digit by
    digit, so two prompts of one run share only their index's common leading digits: none below
    index 10, at most 1 below 100, at most 2 below 1000 (a run of benchmarks/serving.py's default
    levels sends about 110). No server can reuse a cached prefix of another request's prompt longer
    than that, and block-wise prefix caches (vLLM's 16-token blocks) none at all. (With a first word
    and the run's tag before the index, "Story 876611-12. ", a run's prompts all shared their first
    9-10 tokens.) Without the run's tag, a run's prompts began with the prompts of an earlier run
    with fewer tokens against the same server: vLLM answered 2000-token prompts in 0.76 s after a
    1056-token run, 1.30 s without one (machine R)."""
    if length < 1:
        raise ValueError(f"prompt length ({length}) must be at least 1 token")
    text = f"{index}-{run}Story. "
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


# ---- the server at --base-url, checked before any work ------------------------------------------------
def url_problem(base_url: str) -> str | None:
    """Why base_url cannot be a server's API URL (no http(s) scheme or no host: `localhost:8000`
    parses as the scheme "localhost"), or None."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return f"--base-url ({base_url!r}) must be an http(s) URL of a server's API, e.g. http://127.0.0.1:8000/v1"
    return None


def served_models(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> tuple[list[str] | None, str | None]:
    """GET base_url/models (with the key if given): (the ids it lists, None), or (None, why no OpenAI
    API answers there). The ids are None too where the server answers without a list of models (an
    error other than 404/401/403, a body that is not one): nothing to check them against then."""
    models = base_url.rstrip("/") + "/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(models, headers=headers), timeout=timeout_s) as answer:
            body = answer.read()
    except urllib.error.HTTPError as err:
        if err.code == 404:  # a server, but no API there: the likeliest slip is a URL without /v1
            slip = "is /v1 missing?" if not base_url.rstrip("/").endswith("/v1") else "is it an OpenAI-compatible API?"
            return None, f"a server answers, but {models} is not found (HTTP 404): {slip}"
        if err.code in (401, 403):
            return None, (f"the server refuses {'the key given' if api_key else 'requests without a key'} "
                          f"(HTTP {err.code}): pass its key with --api-key (or OPENAI_API_KEY)")
        return None, None
    except (urllib.error.URLError, OSError, ValueError) as err:
        return None, f"{type(err).__name__}: {getattr(err, 'reason', err)}"
    try:
        return [entry["id"] for entry in json.loads(body)["data"]], None
    except (ValueError, KeyError, TypeError):
        return None, None


def server_problem(base_url: str, api_key: str | None, model: str | None) -> str | None:
    """What would make every request to the server at base_url fail, as a message naming the flag to
    change, or None: a URL that is none, no OpenAI API answering there, or a --model it does not
    serve (each request then failed with a 404 only after the run's setup and warm-ups)."""
    problem = url_problem(base_url)
    if problem:
        return problem
    ids, why = served_models(base_url, api_key)
    if why:
        return f"--base-url {base_url}: no OpenAI API answers there ({why}); start the server first, or pass its /v1 URL"
    if model is not None and ids is not None and model not in ids:
        return (f"--model {model!r} is not served at {base_url}, which serves {', '.join(map(repr, ids)) or 'nothing'}: "
                f"pass one of those")
    return None


def exit_unless_served(script: str, base_url: str, api_key: str | None, model: str | None) -> None:
    """Exits 2 (as an argument error does) with server_problem's message, if any, before any work."""
    problem = server_problem(base_url, api_key, model)
    if problem:
        print(f"{script}: {problem}", file=sys.stderr)
        sys.exit(2)
