"""The OpenAI wire format, with no server in it: request models and their validation, the response
and streaming-chunk objects, usage, server-sent events, and the error object.

Everything here is pure (dicts and pydantic models in, dicts and strings out), so the whole format is
tested without starting Ray or a model; launcher/serving/openai_app.py only wires it to the engine.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from launcher.serving import tool_calls as function_calling  # not `tool_calls`: a message's field
from launcher.serving.call_json import MAX_DEPTH
from launcher.serving.null_means_default import NullMeansDefault
from launcher.serving.reasoning import thinking_requested
from launcher.serving.response_formats import ResponseFormat, StructuredOutputs, requested_structure

from shardlib.sampling_params import (MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_PENALTY, MAX_SEED,
                                     MAX_TEMPERATURE, MIN_REPETITION_PENALTY, MIN_SEED)
from workers.serving.held_tokens import MOST_HELD

MAX_STOP_STRINGS = 4
"""OpenAI's bound on `stop`."""
MAX_STOP_TOKEN_IDS = 1024
"""corelaunch's bound on `stop_token_ids` (a vLLM extension, unbounded there): far past any model's
special tokens; millions of ids took seconds of the replica's event loop to check."""
MAX_ALLOWED_TOKEN_IDS = 262144
"""corelaunch's bound on `allowed_token_ids` (a vLLM extension, unbounded there): as many ids as the
largest vocabularies hold (Gemma 3's 262144); more could only repeat ids, and take the replica's event
loop longer to check."""
UNSEEDED = -1
"""The seed a request sends to mean "no seed" (read as None: a fresh random seed per choice), as
clients ported from vLLM, which reads it so, send it."""
MAX_CHOICES = 128
"""OpenAI's bound on `n` (a server also refuses more than its max_num_seqs: openai_app.py)."""
WHOLE_ANSWER_INTERVAL = MOST_HELD
"""Tokens the engine gathers into each event of a whole answer (no stream), after the first: the
events between wake nothing on their way, and the leader holds no more than this for any request
(workers/serving/held_tokens.py MOST_HELD: what a fault makes a resumed request generate again)."""
MAX_LOGIT_BIAS_ENTRIES = 1024
"""corelaunch's bound on logit_bias's entries (unbounded in OpenAI's reference): each is added to its
row's logits every step."""
MAX_LOGPROBS = 20
"""OpenAI's bound on chat's `top_logprobs`, taken for completions' `logprobs` too, where OpenAI's
legacy API stopped at 5 (workers.serving.requests has the same)."""
DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default max_tokens for /v1/completions; chat's default is the rest of the context."""
MAX_TOOLS = 128
"""OpenAI's bound on chat's `tools` (each tool's schema is rendered into the prompt, and a "required"
call's schema holds them all)."""

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
"""OpenAI's reasoning_effort values and vLLM 0.32's ("max", DeepSeek V4's)."""

# What each field accepts, as the error for a bad value says it. Pydantic's own messages name its
# types ("Input should be a valid number"), not the API's rule, so every field error is rewritten
# from this table: "temperature (3.0) must be a number in [0, 2] (0 is greedy)".
FIELD_RULES = {
    "model": "the name of the served model (a string; GET /v1/models lists it)",
    "prompt": "a string, a list of token ids, or a non-empty list of strings or of token-id lists (several "
              "prompts: choice index i * n + j is prompt i's choice j)",
    "messages": "a non-empty list of {role, content} messages",
    "max_tokens": "an integer >= 1 (on /v1/completions 0 too, with echo: true)",
    "max_completion_tokens": "an integer >= 1",
    "temperature": f"a number in [0, {MAX_TEMPERATURE:.7g}] (0 is greedy; the higher, the flatter the draw, "
                   f"past OpenAI's 2 too; the bound is float32's largest value, in which the logits are scaled)",
    "top_p": "a number in [0, 1] (1 turns top-p off; 0 keeps only the most likely token)",
    "top_k": "an integer >= 0, or -1 (0 and -1 turn top-k off; a whole number written 5.0 is taken as 5)",
    "min_p": "a number in [0, 1] (0 turns min-p off)",
    "min_tokens": "an integer >= 0, at most max_tokens (no stop token, EOS included, ends the request before "
                  "that many tokens)",
    "logit_bias": f"an object of at most {MAX_LOGIT_BIAS_ENTRIES} token ids (as strings, e.g. \"50256\") mapped to "
                  f"finite numbers (a bias past [-100, 100] is taken as -100 or 100)",
    "seed": "an integer in [-2**63, 2**63 - 1] (-1: unseeded, as leaving it out)",
    "stop": f"a string or a list of at most {MAX_STOP_STRINGS} strings",
    "stop_token_ids": "a list of token ids (integers >= 0)",
    "allowed_token_ids": f"a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} token ids (integers >= 0, in the "
                         f"model's vocabulary; vLLM's extension: only these tokens are generated)",
    "bad_words": f"a list of at most {MAX_BAD_WORDS} non-empty strings of at most {MAX_BAD_WORD_CHARS} characters "
                 f"each (vLLM's extension: words never generated, at the text's start or after a space)",
    "ignore_eos": "true or false",
    "include_stop_str_in_output": "true or false (vLLM's extension; true: a stop string or stop token that ends the "
                                  "text stays at its end)",
    "skip_special_tokens": "true or false (vLLM's extension; false: special tokens the model generates, an end of "
                           "turn say, stay in the text)",
    "spaces_between_special_tokens": "true or false (vLLM's extension; accepted and ignored: special tokens kept in "
                                     "the text are never spaced apart, as vLLM's fast detokenizer writes them)",
    "logprobs": f"an integer in [0, {MAX_LOGPROBS}] on /v1/completions; true or false on /v1/chat/completions",
    "top_logprobs": f"an integer in [0, {MAX_LOGPROBS}]; above 0 only with logprobs: true",
    "prompt_logprobs": f"an integer in [0, {MAX_LOGPROBS}] (vLLM's extension: each prompt token's log-probability, "
                       f"rank and that many most likely; not with stream: true)",
    "truncate_prompt_tokens": "an integer >= 1, or -1 (vLLM's extension: the prompt is cut to its last that many "
                              "tokens, -1 meaning as many as the context holds; at most the context's length)",
    "cache_salt": "a non-empty string (vLLM's extension: the request shares cached prompt prefixes only with "
                  "requests that sent the same salt; leave it out to share with every request that sent none)",
    "stream": "true or false",
    "echo": "true or false (true: the choice's text starts with the prompt, and with logprobs so does its logprobs "
            "object)",
    "stream_options": "an object {include_usage: bool, continuous_usage_stats: bool}, only with stream: true",
    "stream_options.include_usage": "true or false",
    "stream_options.continuous_usage_stats": "true or false (vLLM's extension; with include_usage: true, every "
                                             "chunk also carries the usage so far: its prompt's tokens and its "
                                             "choice's completion tokens; without include_usage it does nothing, "
                                             "as in vLLM)",
    "stream_interval": "an integer >= 1, or null (vLLM's extension: a stream's tokens per chunk, raising the "
                       "server's --stream-interval for this request; a value below the server's is taken as the "
                       "server's, and a request without stream: true ignores it)",
    "n": f"an integer in [1, {MAX_CHOICES}] (choices per request; each takes a sequence slot)",
    "presence_penalty": "a number in [-2, 2] (0 turns it off)",
    "frequency_penalty": "a number in [-2, 2] (0 turns it off)",
    "repetition_penalty": "a number > 0 in float32's normal range [1.175494e-38, 3.402823e+38] (1 turns it off; "
                          "above 1 discourages repeating the prompt's and the output's tokens)",
    "user": "a string (it is accepted and ignored)",
    "prompt_cache_key": "a string (it is accepted and ignored: prefix caching needs no key)",
    "safety_identifier": "a string (it is accepted and ignored)",
    "service_tier": "\"auto\" or \"default\" (this server has one tier)",
    "stream_options.include_obfuscation": "true or false (accepted and ignored: no obfuscation is added)",
    # Parameters this server does not implement, accepted at the value that asks for nothing (clients
    # that send every parameter send these), refused otherwise
    "best_of": "1 (best_of is not supported; only 1 is accepted)",
    "suffix": "an empty string (suffix is not supported)",
    "response_format": "an object {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
                       "\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
    "response_format.type": "\"text\", \"json_object\" or \"json_schema\"",
    "response_format.json_schema": "an object {\"name\": ..., \"schema\": {...}, \"description\": ..., \"strict\": ...}",
    "response_format.json_schema.name": "a string of 1 to 64 letters, digits, _ or -",
    "response_format.json_schema.schema": "a JSON schema (an object)",
    "response_format.json_schema.description": "a string",
    "response_format.json_schema.strict": "true or false (true: the schema's objects take no keys but those they "
                                          "name, unless they say additionalProperties)",
    "structured_outputs": "an object with one of json (a JSON schema), regex, choice (a list of strings), grammar "
                          "(Lark) or json_object: true",
    "structured_outputs.json": "a JSON schema (an object, or its JSON text)",
    "structured_outputs.regex": "a regular expression (a string)",
    "structured_outputs.choice": "a non-empty list of non-empty strings",
    "structured_outputs.grammar": "a Lark grammar (a string)",
    "structured_outputs.json_object": "true or false",
    "tools": f"a non-empty list of at most {MAX_TOOLS} tools {{\"type\": \"function\", \"function\": {{\"name\", "
             f"\"description\", \"parameters\" (a JSON schema), \"strict\"}}}}, each of its own name",
    "functions": "an empty list (the deprecated functions are not supported; send tools)",
    "tool_choice": "\"none\", \"required\", or {\"type\": \"function\", \"function\": {\"name\": ...}} naming one of "
                   "tools (\"auto\", the default with tools, only on a server started with --tool-call-parser)",
    "function_call": "\"none\" or \"auto\" (the deprecated function_call is not supported; send tool_choice)",
    "parallel_tool_calls": "true or false (false: tool_choice \"required\" makes exactly one call, and \"auto\" "
                           "keeps the first call it reads)",
    "store": "false (stored completions are not supported)",
    "metadata": "an empty object (metadata tags stored completions, which are not supported)",
    "modalities": "[\"text\"] (this server writes text only)",
    "verbosity": "\"medium\" (the default; other verbosities are not supported)",
    # vLLM's /tokenize and /detokenize (not OpenAI's API)
    "add_special_tokens": "true or false (true: the tokenizer's own special tokens, a BOS say, are added around "
                          "the text; /tokenize's default is true with prompt, false with messages)",
    "add_generation_prompt": "true or false (true, the default: the chat ends with the template's opening of an "
                             "assistant turn)",
    "include_reasoning": "true or false (false: a server with a reasoning parser leaves the answer's thinking out)",
    "reasoning_effort": f"one of {', '.join(REASONING_EFFORTS)}, or null (handed to the chat template as "
                        f"reasoning_effort, and enable_thinking false for none, true otherwise)",
    "chat_template": "a Jinja chat template, as text, for this request alone (vLLM's; taken only where the "
                     "server trusts request templates: --trust-request-chat-template)",
    "chat_template_kwargs": "an object of extra variables for the model's chat template, by name (vLLM's; "
                            "{\"enable_thinking\": false} for Qwen3, say); a template ignores names it does "
                            "not use",
    "continue_final_message": "true or false (true: the last message is left open for the model to continue; "
                              "only with add_generation_prompt: false)",
    "return_token_strs": "true or false (true: the answer lists each token's string too, as token_strs)",
    "tokens": "a list of token ids (integers >= 0, in the model's vocabulary)",
}


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""The error code of a prompt (or prompt plus max_tokens) that does not fit the context, as OpenAI's
API says it: clients check it to shorten a conversation and retry."""


class ProtocolError(ValueError):
    """A request the API refuses; rendered as OpenAI's error object with this HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        message, param = encodable(message), encodable(param)
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code
        self.headers = headers
        """Extra response headers (Retry-After on 503)."""

    def body(self) -> dict:
        return error_body(self.message, self.param, self.type, self.code)


def error_body(message: str, param: str | None = None, type: str = "invalid_request_error",
               code: str | None = None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": encodable(message), "type": type, "param": encodable(param), "code": code}}


def encodable(text: str | None) -> str | None:
    """`text` with any lone surrogate ("\\ud800", which JSON can carry and UTF-8 cannot) written as
    its escape: an error quoting a client's key or value must still encode. Starlette's JSONResponse
    and the SSE error event encode to UTF-8, and a surrogate in the 400's own message or param made
    that write fail: a plain-text 500 and a traceback where the client's mistake should be named."""
    if not isinstance(text, str):  # None: no param
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# ---- requests ---------------------------------------------------------------------------------
# strict: a value of the wrong JSON type is refused, not converted ("2" or 2.0 for max_tokens, true
# for a token id, 1 for chat's logprobs), as OpenAI refuses it; an integer still passes for a number.
class StreamOptions(NullMeansDefault):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    """Send one more chunk before [DONE] with the request's usage and no choices."""
    continuous_usage_stats: bool = False
    """Extension (vLLM's): with include_usage, every chunk also carries the usage so far (chunk_usage);
    alone it does nothing, as vLLM ignores it without include_usage."""
    include_obfuscation: bool = True
    """OpenAI's: pads each chunk with random characters against length side channels; taken and
    ignored (no padding is added), as vLLM ignores it."""


class _GenerationRequest(NullMeansDefault):
    """Fields both endpoints share. Unknown fields are refused (a misspelt parameter would otherwise
    be silently ignored)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    temperature: float = Field(1.0, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    """OpenAI's default is 1 (sampling); send 0 for greedy. Any finite temperature is taken (OpenAI's
    API stops at 2; vLLM's takes any): up to float32's largest, in which the ranks scale the logits."""
    top_p: float = Field(1.0, ge=0, le=1)
    """0 (OpenAI allows it) keeps only the most likely token, the limit of a shrinking nucleus."""
    top_k: int = Field(0, ge=-1)
    """Extension (as vLLM's): sample among the k most likely tokens."""
    min_p: float = Field(0.0, ge=0, le=1)
    """Extension (as vLLM's): keep tokens at least min_p times as likely as the most likely."""
    min_tokens: int = Field(0, ge=0)
    """Extension (vLLM's name): stop tokens (EOS included) are held back until this many tokens are
    generated, as transformers' min_new_tokens does; a stop string counts only where it ends after them
    (vLLM's rule, launcher/serving/text_stream.py)."""
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    """-1 is read as no seed (_unseeded): clients send it to mean "no seed", and as a fixed seed it
    gave every such request the same draws."""
    stop: str | list[str] | None = Field(None)
    stop_token_ids: list[int] = Field(default_factory=list)
    """Extension: generation also ends after any of these token ids."""
    ignore_eos: bool = False
    """Extension: keep generating past the model's end-of-sequence tokens (fixed-length benchmarks)."""
    include_stop_str_in_output: bool = False
    """Extension (vLLM's): the text ends with the stop string (`stop`) that ended it, instead of just
    before it; nothing after it. Likewise a stop token that ended it (a stop token id, an EOS) keeps
    its text, which is left out otherwise."""
    spaces_between_special_tokens: bool = True
    """Extension (vLLM's), accepted and ignored: the text is decoded by the tokenizer's fast decoder
    (launcher/serving/detokenizer.py), which writes special tokens kept in the text
    (skip_special_tokens false) side by side whatever this says, as vLLM's fast detokenizer does."""
    skip_special_tokens: bool = True
    """Extension (vLLM's): false keeps the special tokens the model generates (SmolLM2's `<|im_end|>`) in
    the text, where stop strings are matched too; token ids, usage, logprobs' token strings and an
    echoed prompt are the same either way (launcher/serving/text_stream.py)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    stream_interval: int | None = Field(None, ge=1)
    """Extension (vLLM's): a stream sends its tokens this many at a time (the first at once, then n at
    a time, and what is left when it ends), where this is more than the server's --stream-interval
    (engine_stream_interval); a request with stop strings has its stream, not the leader, gather them
    (Launcher._new_stream)."""
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    """Choices: n engine requests of the same prompt, choice i seeded with choice_seed(seed, i)."""
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_TEMPERATURE)
    """Extension (as vLLM's and transformers'): divides the logits of tokens already in the prompt or
    the output (workers/penalties.py)."""
    user: str | None = None
    # OpenAI's, which its SDK sends: taken and ignored (no other tier; prefix caching needs no key)
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    allowed_token_ids: list[int] | None = None
    """Extension (vLLM's): only these token ids are generated, greedy included (every other logit is
    -inf); a stop token or EOS left out of them cannot end the request, which runs to its max tokens.
    _check_combinations refuses an empty list and negative ids; the app checks them against the
    vocabulary."""
    bad_words: list[str] | None = None
    """Extension (vLLM's): words never generated (SamplingParams.bad_words: the driver tokenizes each,
    alone and after a space, and the last token of each sequence is -inf right after the rest of it).
    _check_combinations checks the count, each word's length and its text."""
    logit_bias: dict[str, float] = Field(default_factory=dict)
    """Token id (a string of digits, as JSON object keys are) -> a bias in [-100, 100] added to its
    logit (_check_combinations checks both; the app checks the ids against the vocabulary)."""
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """Extension (vLLM's): the prompt's tokens scored, in vLLM's shape (vllm_prompt_logprobs), on
    completions per choice, on chat for the response; not streamed."""
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    """Extension (vLLM's): each prompt (completions), or the rendered chat prompt, is cut to its last k
    tokens before its length is checked, as vLLM's left truncation does; -1 is the context's length.
    0 is refused by _check_combinations (it would leave no prompt); None leaves the prompt whole."""
    cache_salt: str | None = Field(None, min_length=1)
    """Extension (vLLM's): prefix caching shares cached prompt prefixes only between requests that
    sent the same salt (those that sent none form a group of their own), so clients that each send
    their own secret salt cannot time each other's prompts. An empty string is refused, as vLLM does."""
    response_format: ResponseFormat | None = None
    """OpenAI's structured output: {"type": "json_object"} or {"type": "json_schema", "json_schema":
    {"name", "schema", ...}} (on /v1/completions too, as vLLM takes it); "text" asks for none."""
    structured_outputs: StructuredOutputs | None = None
    """Extension (vLLM's): {"json": schema} or {"regex"}, {"choice"}, {"grammar"} (Lark), {"json_object": true}."""

    @field_validator("seed")
    @classmethod
    def _unseeded(cls, value):
        return None if value == UNSEEDED else value

    @field_validator("top_k", mode="before")
    @classmethod
    def _whole_top_k(cls, value):
        return whole_number_as_int(value)

    _structure = PrivateAttr(None)
    """The StructuredOutput both ask for, made and checked once by _check_combinations."""
    _sampling = PrivateAttr(None)
    """sampling()'s SamplingParams, made once: every choice of a request shares it (checking a long
    allowed_token_ids list again for each of n choices held the event loop for 65 ms each)."""

    def structure_param(self) -> str:
        """The field that asked for structured output, as a refusal of it names it."""
        if self.structured_outputs is not None:
            return "structured_outputs"
        if getattr(self, "_tool_use", None) is not None and self._tool_use.structure is not None:
            return "tool_choice"
        return "response_format.json_schema.schema" if self.response_format.type == "json_schema" else "response_format"

    def engine_prompt_logprobs(self) -> int | None:
        """The most likely tokens the engine lists at each prompt position (None: the prompt is not
        scored): as many as prompt_logprobs asks, or completions' logprobs with echo."""
        wanted = [self.prompt_logprobs, self.logprobs if getattr(self, "echo", False) else None]
        wanted = [n for n in wanted if n is not None]
        return max(wanted) if wanted else None

    def engine_stream_interval(self, server_interval: int, max_tokens: int) -> int:
        """Tokens the engine gathers into each of this request's deltas (of at most max_tokens): a
        stream's are the server's, raised by its own stream_interval (vLLM's rule: a value below the
        server's is clamped up to it). A whole answer is read at its end, so it takes all of its
        tokens WHOLE_ANSWER_INTERVAL at a time, the first excepted (the metrics time it): the ones
        between wake nothing on their way (vLLM's whole answers ignore the field too). With stop
        strings the stream gathers them instead of the leader (Launcher._new_stream)."""
        if not self.stream:
            return max(server_interval, min(max(max_tokens, 1), WHOLE_ANSWER_INTERVAL))
        return server_interval if self.stream_interval is None else max(server_interval, self.stream_interval)

    def choice_sampling(self, index: int):
        """Choice `index`'s SamplingParams: the request's, its seed (if any) moved on by the index so
        that seeded choices differ from each other and each reproduces (choice 0 keeps the seed)."""
        sampling = self.sampling()
        if index == 0 or sampling.seed is None:
            return sampling
        # not dataclasses.replace, which checked every field again per choice (n=8 seeded choices of
        # 262144 allowed_token_ids: 560 ms on the event loop); choice_seed stays in the seed's range
        return sampling.with_derived(seed=choice_seed(sampling.seed, index))

    def limit_sent(self) -> str | None:
        """The name of the length limit the request sent (chat's max_completion_tokens wins over
        max_tokens), None when it sent none."""
        if getattr(self, "max_completion_tokens", None) is not None:
            return "max_completion_tokens"
        return "max_tokens" if self.max_tokens is not None else None

    def sampling(self):
        """The engine's SamplingParams: top_k -1 is 0 (off), as vLLM spells it; top_p 0 keeps the one
        most likely token, which is greedy (the engine's top_p must be above 0; top_k 1 kept every
        token tied at the top and drew among them). Made once per request."""
        if self._sampling is None:
            self._sampling = self._new_sampling()
        return self._sampling

    def _new_sampling(self):
        from shardlib.sampling_params import SamplingParams

        penalties = dict(presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                         repetition_penalty=self.repetition_penalty,
                         logit_bias={int(token): clamped_bias(bias) for token, bias in self.logit_bias.items()},
                         min_tokens=self.min_tokens, allowed_token_ids=self.allowed_token_ids,
                         bad_words=tuple(self.bad_words or ()),
                         structured_output=self._structure)
        if self.top_p == 0:
            return SamplingParams(temperature=0.0, seed=self.seed, **penalties)
        return SamplingParams(temperature=self.temperature, top_k=max(self.top_k, 0), top_p=self.top_p,
                              min_p=self.min_p, seed=self.seed, **penalties)

    def truncated(self, prompt: list[int], context_tokens: int, reserved: int = 0) -> list[int]:
        """The prompt's last truncate_prompt_tokens tokens (-1: as many as the context holds), less
        `reserved` (special tokens the caller puts around them), or the whole prompt when it is shorter
        or truncation was not asked. ProtocolError 400 for more tokens than the context holds (vLLM
        refuses them too: the prompt could never fit)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return prompt
        if keep > context_tokens:
            raise ProtocolError(f"truncate_prompt_tokens ({keep}) is more than the context holds ({context_tokens} "
                                f"tokens); ask for at most {context_tokens}, or -1 for the context's length",
                                param="truncate_prompt_tokens")
        keep = max((context_tokens if keep == -1 else keep) - reserved, 0)
        return prompt[len(prompt) - keep:] if len(prompt) > keep else prompt

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far: vLLM's continuous_usage_stats, which counts only with
        include_usage (vLLM's rule: alone it is accepted and does nothing)."""
        return self.include_usage() and self.stream_options.continuous_usage_stats


def clamped_bias(bias: float) -> float:
    """A logit bias within [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]: past -100 a token is as good as banned
    and past 100 as good as forced already, so a client's -1000 means what -100 does (refusing it
    failed requests that clients written for vLLM's server send)."""
    return max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, bias))


def whole_number_as_int(value):
    """A float that is a whole number (5.0) as its int, for integer fields a client's JSON may write
    so (some clients serialise every number as a float); anything else as it came, for the field's
    own check (5.5 is refused by name)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded with `seed`: seed + index, wrapping within the
    signed 64-bit range seeds take."""
    return (seed - MIN_SEED + index) % 2**64 + MIN_SEED


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)
    """0 only with echo (_check_combinations): the prompt scored, nothing generated."""
    best_of: int = Field(1, ge=1, le=1)
    echo: bool = False
    """The prompt comes back before the completion (launcher/serving/echoed_prompt.py)."""
    suffix: Literal[""] = ""
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """The chosen token's log-probability plus this many most likely alternatives."""

    def prompt_inputs(self) -> list[str | list[int]]:
        """The prompts as the engine takes them: each text, or token ids (one, or the list's several)."""
        if isinstance(self.prompt, list) and self.prompt and all(isinstance(p, (str, list)) for p in self.prompt):
            return list(self.prompt)
        return [self.prompt]


_TEXT_PART_KEYS = {(False, "text"): "text", (True, "text"): "text", (True, "refusal"): "refusal"}
"""(an assistant's message?, a content part's type): the key holding the part's text; a refusal
part only in an assistant's message, as OpenAI's message types have it."""


class ChatMessage(NullMeansDefault):
    # Unknown keys refused, as the request's own are: ignored, a misspelt `content` made an assistant
    # message an empty turn, and OpenAI's `audio` was dropped without a word. A null key is left
    # out, as OpenAI takes it.
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    """Required but for an assistant's message (OpenAI's rule: one that made tool calls may have none)."""
    name: str | None = None
    """The participant's name: handed to the chat template, which renders it or not (as a model's
    own format says)."""
    tool_calls: list | None = None
    """An assistant's calls, [{id, type: "function", function: {name, arguments}}] (tool_calls.py checks
    them and hands them to the template with their arguments parsed)."""
    function_call: dict | None = None
    """tool_calls' deprecated form: refused (send tool_calls)."""
    tool_call_id: str | None = None
    """A tool message's: the id of the call it answers (required there, refused on any other message)."""
    reasoning: str | None = None
    """An assistant's thinking before its answer, as a server with a reasoning parser returns it (vLLM's
    field), sent back in the conversation: handed to the template, which renders it or drops it (Qwen3's
    keeps only the last turn's)."""
    reasoning_content: str | None = None
    """reasoning's older name (vLLM takes it, `reasoning` winning when both are sent)."""
    refusal: str | None = None
    """An assistant's refusal, as OpenAI's answers carry it and a replayed conversation sends back:
    the assistant's text where its content is null or empty (text())."""
    annotations: list | None = None
    """OpenAI's citations on an assistant's answer: its own answers carry `"annotations": []`, which a
    conversation recorded there sends back (refused, it failed such a replay); an empty list is taken
    as none, any citation refused (check)."""
    _template_calls = PrivateAttr(None)
    """tool_calls as the chat template takes them, made by check()."""

    def check(self, index: int) -> None:
        """ProtocolError for a message the API refuses; `index` is its place in `messages`."""
        if self.role == "tool" and self.tool_call_id is None:  # the template could not say which call it answers
            raise ProtocolError(f"messages.{index}.tool_call_id is required in a tool message: the id of the "
                                f"assistant's tool call it answers", param=f"messages.{index}.tool_call_id")
        if self.content is None and self.role != "assistant":
            raise ProtocolError(f"messages.{index}.content is required in a {self.role} message (a string or a "
                                f"list of text parts)", param=f"messages.{index}.content")
        if isinstance(self.content, list) and not self.content:
            raise ProtocolError(f"messages.{index}.content is an empty list; send a string or at least one text "
                                f"part", param=f"messages.{index}.content")
        if self.tool_call_id is not None and self.role != "tool":
            raise ProtocolError(f"messages.{index}.tool_call_id belongs to a tool message, and a {self.role} "
                                f"message has none; leave it out", param=f"messages.{index}.tool_call_id")
        if self.tool_call_id is not None:
            check_utf8(self.tool_call_id, f"messages.{index}.tool_call_id")
        if self.function_call is not None:  # {} too: it was dropped without a word
            raise ProtocolError(f"messages.{index}.function_call: the deprecated function_call is not supported; send "
                                f"the assistant's calls as tool_calls", param=f"messages.{index}.function_call")
        if self.refusal is not None and self.role != "assistant":
            raise ProtocolError(f"messages.{index}.refusal belongs to an assistant message (its refusal to answer), "
                                f"and a {self.role} message has none; leave it out", param=f"messages.{index}.refusal")
        if self.refusal is not None:
            check_utf8(self.refusal, f"messages.{index}.refusal")
        if (self.role == "assistant" and self.content is None and not self.tool_calls and self.reasoning is None
                and self.reasoning_content is None and not self.refusal):
            # an empty assistant turn the client never meant (OpenAI refuses it); thinking alone is a turn
            raise ProtocolError(f"messages.{index}.content: an assistant message needs content or tool_calls (this "
                                f"one has neither); send its text as content", param=f"messages.{index}.content")
        if self.annotations:
            raise ProtocolError(f"messages.{index}.annotations: citations are not supported (no model here makes "
                                f"them); send an empty list or leave them out", param=f"messages.{index}.annotations")
        if self.tool_calls and self.role != "assistant":
            raise ProtocolError(f"messages.{index}.tool_calls: only an assistant message makes tool calls, not a "
                                f"{self.role} message", param=f"messages.{index}.tool_calls")
        if self.tool_calls:  # an empty list is no call, as vLLM drops it
            self._template_calls = function_calling.template_tool_calls(self.tool_calls, index)
        for field in ("reasoning", "reasoning_content"):
            if getattr(self, field) is not None and self.role != "assistant":
                raise ProtocolError(f"messages.{index}.{field} belongs to an assistant message (its thinking), and a "
                                    f"{self.role} message has none; leave it out", param=f"messages.{index}.{field}")
            if getattr(self, field) is not None:
                check_utf8(getattr(self, field), f"messages.{index}.{field}")
        self.text(index)

    def template_form(self, index: int, role: str) -> dict:
        """The message as chat templates take it (vLLM's form): text content, its name, an assistant's
        tool calls (arguments as objects), a tool message's tool_call_id."""
        form = {"role": role, "content": self.text(index)}
        if self.name is not None:
            form["name"] = self.name
        if self._template_calls:
            form["tool_calls"] = self._template_calls
        if self.role == "tool":
            form["tool_call_id"] = self.tool_call_id
        thinking = self.reasoning if self.reasoning is not None else self.reasoning_content
        if thinking is not None:  # under both names, as vLLM hands it: templates read one or the other
            form["reasoning"] = form["reasoning_content"] = thinking
        return form

    def text(self, index: int = 0) -> str:
        """The content as one string: text parts joined by a newline, as vLLM joins them (its
        chat_utils, "string" content format), so a client moving from vLLM gets the same prompt
        (joined with nothing, "Question:" and "What" became "Question:What"); an assistant's refusal
        parts ({"type": "refusal", "refusal": ...}, as OpenAI's message type has them) are its text
        too; other part types are refused."""
        if not self.content and self.refusal is not None:
            # an assistant that refused: the refusal is what it said. Both set, the content wins: it
            # is the answer the client kept, and one turn has one text
            return self.refusal
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for j, part in enumerate(self.content):
            param = f"messages.{index}.content.{j}"
            if "type" not in part:
                raise ProtocolError(f"{param} has no \"type\"; send text parts as {{\"type\": \"text\", "
                                    f"\"text\": ...}}", param=f"{param}.type")
            key = _TEXT_PART_KEYS.get((self.role == "assistant", part.get("type")))
            if key is None:
                raise ProtocolError(f"{param}: content part type {_short(part.get('type'))} is not supported; only "
                                    f"text parts ({{\"type\": \"text\", \"text\": ...}}) are, and an "
                                    f"assistant's refusal parts", param=param)
            if not isinstance(part.get(key), str):
                raise ProtocolError(f"{param}.{key} ({_short(part.get(key))}) must be a string", param=f"{param}.{key}")
            extra = next((name for name, value in part.items() if name not in ("type", key) and value is not None),
                         None)
            if extra is not None:  # an image beside the text, say: dropped without a word before
                raise ProtocolError(f"unknown key {clip(str(extra))!r} in {part['type']} part {param}; such a part "
                                    f"is {{\"type\": \"{part['type']}\", \"{key}\": ...}}",
                                    param=f"{param}.{clip(str(extra))}")
            check_utf8(part[key], f"{param}.{key}")  # named by its part, not the joined content
            texts.append(part[key])
        return "\n".join(texts)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    """OpenAI's newer name for max_tokens; wins when both are given."""
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Function calling: launcher/serving/tool_calls.py. The deprecated functions/function_call and
    # stored completions are not supported: accepted at the values that ask for neither (clients that
    # send every parameter send these), refused by name otherwise.
    tools: list | None = None
    """Functions the model may call (tool_calls.py checks them): shown to the chat template, and with
    a forced tool_choice the output is a call of one of them."""
    tool_choice: str | dict | None = None
    """"none", "required" or a named function; "auto" (vLLM's default with tools) only on a server with
    a tool-call parser, refused otherwise; None: the default. tool_calls.check_tool_request checks it
    with tools."""
    parallel_tool_calls: bool = True
    """false: tool_choice "required" makes exactly one call, and "auto" keeps the first it reads."""
    functions: list = Field(default_factory=list, max_length=0)
    function_call: Literal["none", "auto"] = "none"
    store: bool = False
    """Refused when true (_check_combinations): a Literal[False] would take the number 0 too."""
    metadata: dict = Field(default_factory=dict, max_length=0)
    modalities: list[Literal["text"]] | None = None
    """OpenAI's output kinds: text only here (audio refused)."""
    verbosity: Literal["medium"] | None = None
    """OpenAI's answer length hint for its reasoning models: only the default, which asks nothing."""
    # How the chat template renders the messages (vLLM's extensions; /tokenize's chat form takes them too)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """True: the last message (the assistant's start of an answer, say) is left open and the model
    continues it; only with add_generation_prompt false (check_template_options)."""
    chat_template: str | None = None
    """A Jinja template this request's messages are rendered with (vLLM's), taken only by a server that
    trusts request templates (check_request_template); None: the server's."""
    chat_template_kwargs: dict | None = None
    """Extra variables for the chat template (check_template_options refuses the names the server
    sets itself)."""
    include_reasoning: bool = True
    """vLLM's: false leaves the reasoning out of the answer (on a server with a reasoning parser)."""
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None
    """OpenAI's, as vLLM 0.32 takes it: the chat template's reasoning_effort variable, and its
    enable_thinking (false for "none") unless the request's chat_template_kwargs set that
    (effort_template_kwargs)."""

    _tool_use = PrivateAttr(None)
    """launcher/serving/tool_calls.py's ToolUse: the tools and tool_choice checked, made once by
    _check_combinations."""
    _reasoning = PrivateAttr(None)
    """reasoning()'s answer, set by _check_combinations."""

    def chat_messages(self, template: object = None) -> list[dict]:
        """The messages as the chat template takes them (template_messages)."""
        return template_messages(self.messages, template)

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template takes them (apply_chat_template's tools), None without any."""
        return (self._tool_use.tools or None) if self._tool_use is not None else None

    def settle_thinking(self, think_end: int | None, think_start: int | None = None,
                          prompt: Sequence[int] = (), turn_ends: Collection[int] = ()) -> None:
        """Settle a thinking request once its prompt is known. Its structured output (response_format,
        structured_outputs, a forced tool call) starts after the thinking, as vLLM's does: the
        constraint waits for `think_end`, the id of the model's `</think>` token. All of the text is
        the content, constrained from its first token, where there is no thinking to wait for: a
        prompt that already closed it (its last `</think>` after its last `<think>` and after the
        last of `turn_ends`, the ids that end a message: Qwen3's template with thinking off, or
        continuing a final message), no such token (None), or a
        structured output whose reasoning is not wanted (include_reasoning false, vLLM's rule).
        Thinking turned off (qwen3's enable_thinking): constrained at once, all content."""
        if self._reasoning is None:
            return
        if _thinking_closed(prompt, think_start, think_end, turn_ends, self.continue_final_message) or (
                self._structure is not None and (
                think_end is None or not self.include_reasoning)):
            self._reasoning = None
            return
        if self._structure is not None and self._reasoning[1]:
            self._structure, self._sampling = replace(self._structure, after_token=think_end), None
            if self._reasoning[0] == "qwen3":  # its free split also ends at <tool_call>: not here
                self._reasoning = (*self._reasoning[:2], True)

    def reasoning(self) -> tuple[str, bool] | tuple[str, bool, bool] | None:
        """(the server's reasoning parser, whether the request leaves thinking on) when the answer's
        thinking is split from its content; None when the text is all content. A third item, True,
        where a qwen3 answer is `constrained` (launcher/serving/reasoning.py): its structured output
        starts after the `</think>` token, so the split ends the thinking there alone, as the
        constraint does, and keeps the answer as the grammar wrote it (deepseek_r1's split already
        reads every answer so)."""
        return self._reasoning

    def tool_call_reader(self) -> "function_calling.ToolCallReader | None":
        """A new reader of one choice's text as tool calls; None when no call is forced (plain text)."""
        return self._tool_use.reader() if self._tool_use is not None else None

    def logprobs_count(self) -> int | None:
        """The engine's logprobs argument: None (off) or the number of alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None


def _thinking_closed(prompt: Sequence[int], think_start: int | None, think_end: int | None,
                     turn_ends: Collection[int] = (), continuing: bool = False) -> bool:
    """Whether the prompt's last `</think>` comes after its last `<think>` (the thinking is over
    before the output starts), as vLLM reads a prompt's token ids, within the turn the output goes
    on: after the last of `turn_ends` (the ids that end a message, `<|im_end|>` in Qwen3's
    template). An earlier turn's thinking, which Qwen3's template writes back for the assistant's
    messages after the last user message (a tool call and its result), closed the new answer's
    thinking too, and the model's new thinking went to the content, tags and all.
    `continuing` (continue_final_message): the output goes on with the last message's text, which
    is answer unless that turn opened a `<think>` left open; DeepSeek-R1's and QwQ's templates write
    neither tag for it, and the whole continuation was read as thinking."""
    if think_end is None:
        return False
    for token in reversed(prompt):
        if token == think_end:
            return True
        if token == think_start:
            return False
        if token in turn_ends:
            return continuing
    return continuing


RESERVED_TEMPLATE_NAMES = {
    "add_generation_prompt": "send it as the request's own add_generation_prompt",
    "continue_final_message": "send it as the request's own continue_final_message",
    "tools": "send the functions as the request's tools",
    "messages": "send them as the request's messages", "conversation": "send it as the request's messages",
    "documents": "documents are not supported",
    "chat_template": "send a template as the request's own chat_template field (taken where the server trusts "
                     "request templates, --trust-request-chat-template; otherwise the server uses the model's own "
                     "template, or its --chat-template)",
    "tokenize": "the server tokenizes the rendered chat itself", "return_dict": "the server sets it",
    "return_tensors": "the server sets it", "padding": "the server sets it", "truncation": "the server sets it",
    "max_length": "use truncate_prompt_tokens, or max_tokens", "tokenizer_kwargs": "the server sets them",
    "return_assistant_tokens_mask": "the server sets it", "sanitize_control_tokens": "the server sets it",
    "self": "the renderer's own argument", "conversations": "send them as the request's messages",
}
"""apply_chat_template's own arguments, which chat_template_kwargs must not name (vLLM refuses
chat_template and tokenize, and lets the others through): each with where its meaning lives instead."""


def check_template_options(request) -> None:
    """chat_template_kwargs and the rendering flags of a chat request or /tokenize's chat form:
    ProtocolError naming the field."""
    if request.continue_final_message and request.add_generation_prompt:
        raise ProtocolError("continue_final_message (true) leaves the last message open, and add_generation_prompt "
                            "(true, its default) opens a new assistant turn after it; send add_generation_prompt: "
                            "false with it", param="continue_final_message")
    problem = template_kwargs_problem(request.chat_template_kwargs or {}, "chat_template_kwargs")
    if problem is not None:
        raise ProtocolError(*problem)


TRUSTING = "--trust-request-chat-template (builder argument trust_request_chat_template)"
"""How a server is told to take a request's own chat_template, for refusals."""


def check_request_template(request, trusted: bool) -> None:
    """A chat request's own chat_template (vLLM's field): refused unless the server trusts request
    templates (a template is code the server runs; vLLM's --trust-request-chat-template), and where
    trusted refused when empty or when it does not compile as transformers compiles chat templates
    (the Jinja error's line): ProtocolError naming chat_template."""
    template = request.chat_template
    if template is None:
        return
    if not trusted:
        raise ProtocolError(f"chat_template: this server takes no chat template from a request (a template is code "
                            f"the server runs; vLLM's rule): leave chat_template out, and the server's template "
                            f"renders the messages; its operator may allow it with {TRUSTING}", param="chat_template")
    check_utf8(template, "chat_template")
    if not template.strip():
        raise ProtocolError("chat_template is an empty template; send a Jinja chat template, or leave chat_template "
                            "out for the server's", param="chat_template")
    from launcher.serving.chat_template import jinja_problem

    problem = jinja_problem(template)
    if problem is not None:
        raise ProtocolError(f"chat_template does not compile as a Jinja chat template: {problem}",
                            param="chat_template")


def template_kwargs_problem(kwargs: dict, where: str) -> tuple[str, str] | None:
    """(message, param) of the first thing wrong in template variables (a request's
    chat_template_kwargs, or a server's defaults, checked at start with the same rules), or None:
    one of apply_chat_template's own names, nesting past call_json.MAX_DEPTH (json.dumps and the
    template recurse per level; near Python's limit that was a 500), text that is no valid UTF-8."""
    for name in kwargs:
        if name in RESERVED_TEMPLATE_NAMES:
            return (f"{where}.{name} names one of apply_chat_template's own arguments, which the server sets: "
                    f"{RESERVED_TEMPLATE_NAMES[name]}", f"{where}.{clip(name)}")
    if nesting_depth(kwargs) > MAX_DEPTH:
        return f"{where} nests more than {MAX_DEPTH} levels of lists and objects; send flatter values", where
    try:
        check_utf8(json.dumps(kwargs, ensure_ascii=False), where)
    except ProtocolError as err:
        return err.message, where
    return None


def nesting_depth(value) -> int:
    """How deep lists and dicts nest in `value` (0 for a scalar), without recursing."""
    deepest, pending = 0, [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth + 1)
            pending.extend((inner, depth + 1) for inner in (item.values() if isinstance(item, dict) else item))
    return deepest


def template_messages(messages: list[ChatMessage], template: object = None) -> list[dict]:
    """[{role, content[, name]}] with content as plain text, as chat templates take it. A developer
    message is OpenAI's newer system message: it goes to a `template` that never mentions the
    developer role as a system message (SmolLM2's, say, would otherwise add its default system
    turn and then a turn of a role the model never saw). `template` is the template's text
    (openai_app's _template_text picks it from a tokenizer's dict of named templates)."""
    template = str(template or "")
    # a template that compares roles with 'developer' or "developer" knows the role
    developer = "developer" if "'developer'" in template or '"developer"' in template else "system"
    return [m.template_form(i, developer if m.role == "developer" else m.role) for i, m in enumerate(messages)]


# ---- vLLM's /tokenize and /detokenize -----------------------------------------------------------
# Not OpenAI's API: vLLM's server has them, and clients use them to count a prompt's tokens against
# the context (max_model_len) before sending it, and to read token ids back as text. The model is
# required, as on the other routes (vLLM lets it be left out).
class _TokenizationRequest(NullMeansDefault):
    """Fields both routes share; unknown fields refused and values not converted, as on the others."""

    model_config = ConfigDict(extra="forbid", strict=True)
    field_rules: ClassVar[dict[str, str]] = {}
    """This route's own rules where a field of the same name means something else on another route."""

    model: str

    def check(self) -> None:
        """Rules pydantic's per-field constraints cannot say (parse_request calls it)."""


class TokenizeCompletionRequest(_TokenizationRequest):
    """/tokenize of a text: its ids as /v1/completions tokenizes a prompt."""

    field_rules: ClassVar[dict[str, str]] = {
        "prompt": "a string (the text to tokenize; send messages instead of prompt to tokenize a chat)"}
    prompt: str
    add_special_tokens: bool = True
    """vLLM's default for a text: the tokenizer's own additions (a BOS), as a completions prompt gets."""
    return_token_strs: bool = False


class TokenizeChatRequest(_TokenizationRequest):
    """/tokenize of a chat: its prompt as /v1/chat/completions renders and tokenizes the messages (the
    same message checks, the model's chat template, control tokens inside message text encoded as text)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    """As a chat request's (check_request_template)."""
    chat_template_kwargs: dict | None = None
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None
    """As a chat request's: the template variables it sets are counted as the chat route renders them."""
    add_special_tokens: bool = False
    """vLLM's default for a chat: the template writes the special tokens it wants."""
    return_token_strs: bool = False
    tools: list | None = None
    """As a chat request's (tool_calls.py checks them): shown to the chat template, so the count is
    the prompt's a chat request with these tools gets."""

    _template_tools = PrivateAttr(None)

    def check(self) -> None:
        if self.tools is not None:
            self._template_tools = function_calling.template_tools(self.tools)
        check_template_options(self)
        for i, message in enumerate(self.messages):
            message.check(i)  # as a chat request's: tool calls, missing content, non-text parts

    def chat_messages(self, template: object = None) -> list[dict]:
        """The messages as the chat template takes them (template_messages)."""
        return template_messages(self.messages, template)

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template takes them, None without any."""
        return self._template_tools


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest
"""/tokenize's body, in either of vLLM's forms: parse_request takes it as the chat form when it has
messages, else as the text form."""


class DetokenizeRequest(_TokenizationRequest):
    """/detokenize: token ids back to text (the server checks them against its vocabulary)."""

    tokens: list[int]
    """An empty list is text too (""), as vLLM answers it."""

    def check(self) -> None:
        if any(t < 0 for t in self.tokens):
            raise ProtocolError("tokens: token ids must be integers >= 0", param="tokens")


def _tokenize_form(body: dict) -> type[_TokenizationRequest]:
    """The /tokenize form a body is in: with messages, a chat; else a text (one with neither is told
    that prompt is required, and that rule names messages)."""
    if body.get("messages") is None:
        return TokenizeCompletionRequest
    if body.get("prompt") is not None:
        raise ProtocolError("send either prompt (a text) or messages (a chat) to /tokenize, not both",
                            param="prompt")
    return TokenizeChatRequest


def is_generation_request(model: object) -> bool:
    """Whether bodies of `model` ask for generation, and so count in corelaunch_requests_total (whose
    help counts generation requests): /tokenize's and /detokenize's do not."""
    return isinstance(model, type) and issubclass(model, _GenerationRequest)


def parse_request(model: type[_GenerationRequest] | type[_TokenizationRequest], body: object,
                  tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                  template_defaults: dict | None = None, trusts_templates: bool = False):
    """`body` (the decoded JSON) as `model` (or TokenizeRequest: as its form); ProtocolError naming the
    first bad field and its rule. tool_call_parser: the server's (a chat's tool_choice "auto" needs one);
    reasoning_parser: the server's (a chat's thinking is split from its answer); template_defaults:
    the server's default chat_template_kwargs, under the request's own (vLLM's merge); trusts_templates:
    the server takes a request's own chat_template (vLLM's --trust-request-chat-template)."""
    if not isinstance(body, dict):
        raise ProtocolError(f"the request body must be a JSON object, not {_json_kind(body)}")
    if model is TokenizeRequest:
        model = _tokenize_form(body)
    try:
        request = model.model_validate(body)
    except ValidationError as err:
        raise _field_error(err.errors()[0], model) from None
    if isinstance(request, (ChatCompletionRequest, TokenizeChatRequest)):
        check_request_template(request, trusts_templates)
        own = request.chat_template_kwargs or {}
        if template_defaults:
            request.chat_template_kwargs = {**template_defaults, **own}
        if request.reasoning_effort is not None:
            request.chat_template_kwargs = {**(request.chat_template_kwargs or {}),
                                            **effort_template_kwargs(request.reasoning_effort, own)}
    if isinstance(request, _TokenizationRequest):
        request.check()
    else:
        _check_combinations(request, tool_call_parser, reasoning_parser)
    return request


_UNION_BRANCH_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_error(error: dict, model: type[BaseModel]) -> ProtocolError:
    rules = {**FIELD_RULES, **getattr(model, "field_rules", {})}
    # pydantic names the union branch it tried ("messages.0.content.str"): not a field of the request
    loc = [str(part) for part in error["loc"] if str(part) not in _UNION_BRANCH_TAGS and "[" not in str(part)]
    field = loc[0] if loc else None
    param = ".".join(loc) if loc else None
    if not loc and error["type"] == "string_unicode":  # a key JSON can carry but no text holds ("\ud800")
        return ProtocolError("a key of the request body is not valid UTF-8 text (a lone surrogate); send the "
                             "fields by their names")
    if not loc:  # about the body as a whole
        return ProtocolError(f"the request body: {error['msg']}")
    if error["type"] == "missing" and param in rules and len(loc) > 1:  # response_format.json_schema.name
        return ProtocolError(f"{param} is required: {rules[param]}", param=param)
    if param in rules and len(loc) > 1:  # a bad value inside an object field: name it, not the object
        return ProtocolError(f"{param} ({_short(error.get('input'))}) must be {rules[param]}", param=param)
    if error["type"] == "extra_forbidden" and field == "messages" and len(loc) == 3:
        return ProtocolError(f"unknown key {clip(loc[2])!r} in messages.{loc[1]}; a message takes role, content, "
                             f"name, and tool_calls, reasoning and refusal (assistant) or tool_call_id (tool) (OpenAI's "
                             f"audio is not supported)", param=clip(param))
    if error["type"] == "extra_forbidden" and len(loc) > 1:  # inside an object field (stream_options)
        return ProtocolError(f"unknown parameter {clip(param)!r}; {field} must be "
                             f"{rules.get(field, 'as the OpenAI API reference says')}", param=clip(param))
    if error["type"] == "extra_forbidden":
        return ProtocolError(f"unknown parameter {clip(field)!r}; {_takes(model)}", param=clip(field))
    if error["type"] == "missing" and len(loc) == 1:
        return ProtocolError(f"{field!r} is required: {rules.get(field, 'see the OpenAI API reference')}",
                             param=field)
    value = error.get("input")
    expected = (error.get("ctx") or {}).get("expected")
    if field == "messages" and error["type"] == "literal_error" and expected:
        # a value outside a message's fixed set (its role "bot"): quoted, with the set, as the table's rules say it
        return ProtocolError(f"{param} ({_short(value)}) must be one of {expected}", param=param)
    if field == "messages" and loc[-1] == "content" and isinstance(value, list):
        # pydantic reports the union's string branch first; a list is the parts branch's business
        j = next((j for j, part in enumerate(value) if not isinstance(part, dict)), None)
        if j is not None:
            return ProtocolError(f"{param}.{j} ({_short(value[j])}) must be a content part, "
                                 f"{{\"type\": \"text\", \"text\": ...}}", param=f"{param}.{j}")
    if field == "messages" and len(loc) == 2 and error["type"] == "model_type":  # not an object at all
        return ProtocolError(f"{param} ({_short(value)}) must be a message, an object {{role: system|user|assistant|"
                             f"tool|developer, content: string or text parts}}", param=param)
    if field == "messages" and len(loc) == 3 and loc[-1] == "content":  # a number, an object: neither branch
        return ProtocolError(f"{param}: must be a string or a list of text parts ({{\"type\": \"text\", "
                             f"\"text\": ...}}), not {_short(value)}", param=param)
    if field == "messages" and len(loc) > 1:  # inside one message: say which and what is wrong
        return ProtocolError(f"{param}: {error['msg']} (a message is {{role: system|user|assistant|tool|"
                             f"developer, content: string or text parts}})", param=param)
    rule = rules.get(field)
    if rule is None:
        return ProtocolError(f"{param}: {error['msg']}", param=param)
    return ProtocolError(f"{field} ({_short(error.get('input'))}) must be {rule}", param=field)


def _takes(model: type[BaseModel]) -> str:
    """The fields the endpoint of `model` takes, as an unknown parameter's refusal lists them: both of
    /tokenize's forms for either (a chat's field sent with a prompt is refused by the text form)."""
    if model in (TokenizeCompletionRequest, TokenizeChatRequest):
        return "; ".join(f"/tokenize with {form} takes: {', '.join(sorted(form_model.model_fields))}"
                         for form, form_model in (("prompt", TokenizeCompletionRequest),
                                                  ("messages", TokenizeChatRequest)))
    return f"this endpoint takes: {', '.join(sorted(model.model_fields))}"


def _json_kind(value: object) -> str:
    """What a decoded JSON value is, in JSON's words (not Python's NoneType, list, int)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    kinds = {list: "an array", str: "a string", int: "a number", float: "a number"}
    return next((kind for cls, kind in kinds.items() if isinstance(value, cls)), type(value).__name__)


def clip(text: str, limit: int = 200) -> str:
    """A client's string as an error message quotes it (a model name, an unknown parameter's name):
    a 100 kB model name, or a 500 kB key, is not sent back whole."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _short(value: object) -> str:
    try:
        text = json.dumps(value) if not isinstance(value, str) else repr(value)
    except (RecursionError, ValueError, TypeError):
        # nested just under the parser's depth limit: encoding it again went one frame deeper (a
        # plain-text 500 where a shallower or deeper value got the 400)
        text = f"a nested {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def check_utf8(text: str, param: str) -> None:
    """ProtocolError 400 for text that is not valid Unicode: JSON can carry lone surrogates ("\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ProtocolError(f"{param} is not valid UTF-8 text ({err.reason} at position {err.start})",
                            param=param) from None


def _check_combinations(request: _GenerationRequest, tool_call_parser: str | None = None,
                        reasoning_parser: str | None = None) -> None:
    """Rules that span fields, or that pydantic's per-field constraints cannot say."""
    stops = request.stop_strings()
    if len(stops) > MAX_STOP_STRINGS:
        raise ProtocolError(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed", param="stop")
    if "" in stops:  # which one, in a list: the other stop errors quote the value
        where = "stop" if isinstance(request.stop, str) else f"stop[{stops.index('')}]"
        raise ProtocolError(f"{where} is empty: stop strings must not be empty; remove it", param="stop")
    for stop in stops:  # a lone surrogate could never match the text (it was accepted, and never stopped)
        check_utf8(stop, "stop")
    if len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ProtocolError(f"stop_token_ids has {len(request.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} "
                            f"are allowed", param="stop_token_ids")
    if any(t < 0 for t in request.stop_token_ids):
        raise ProtocolError(f"stop_token_ids ({_short(request.stop_token_ids)}) must be "
                            f"{FIELD_RULES['stop_token_ids']}", param="stop_token_ids")
    _check_allowed_token_ids(request.allowed_token_ids)
    _check_bad_words(request.bad_words)
    _check_logit_bias(request.logit_bias)
    if request.truncate_prompt_tokens == 0:  # pydantic's ge=-1 lets it through: no prompt is left
        raise ProtocolError(f"truncate_prompt_tokens (0) must be {FIELD_RULES['truncate_prompt_tokens']}; 0 would "
                            f"leave no prompt (leave it out, or null, to keep the whole prompt)",
                            param="truncate_prompt_tokens")
    request._structure = requested_structure(request.response_format, request.structured_outputs)
    if request.stream_options is not None and not request.stream:
        raise ProtocolError("stream_options is only allowed with stream: true", param="stream_options")
    if request.prompt_logprobs is not None and request.stream:  # as vLLM: they come with the whole response
        raise ProtocolError(f"prompt_logprobs ({request.prompt_logprobs}) is not available with stream: true; ask "
                            f"without streaming (or, on /v1/completions, use echo with logprobs, which streams)",
                            param="prompt_logprobs")
    if isinstance(request, CompletionRequest):
        if "best_of" in request.model_fields_set and request.best_of < request.n:
            # vLLM's and OpenAI's rule: best_of completions are generated and the best n of them
            # returned, so fewer than n cannot be; taking it served n, which is not what was asked
            raise ProtocolError(f"best_of ({request.best_of}) must be at least n ({request.n}): best_of "
                                f"completions are generated and the best n of them returned; leave best_of out "
                                f"(this server generates exactly n)", param="best_of")
        if request.max_tokens == 0 and not request.echo:
            raise ProtocolError("max_tokens (0) must be an integer >= 1; 0 is taken only with echo: true (the prompt "
                                "back, scored with logprobs, and nothing generated)", param="max_tokens")
        if request.max_tokens == 0 and request.min_tokens:
            raise ProtocolError(f"min_tokens ({request.min_tokens}) must be at most max_tokens (0); leave it out",
                                param="min_tokens")
        if isinstance(request.prompt, list) and not request.prompt:  # no prompt at all: not "a list of 0 strings"
            raise ProtocolError(f"prompt must be {FIELD_RULES['prompt']}: it is an empty list", param="prompt")
        prompts = request.prompt_inputs()
        for i, prompt in enumerate(prompts):
            which = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
            if isinstance(prompt, list) and not prompt:
                raise ProtocolError(f"{which} must be {FIELD_RULES['prompt']}: its token-id list is empty",
                                    param="prompt")
            if isinstance(prompt, list) and any(t < 0 for t in prompt):
                raise ProtocolError(f"{which}: token ids must be integers >= 0", param="prompt")
    if isinstance(request, ChatCompletionRequest):
        if request.store:
            raise ProtocolError(f"store (true) must be {FIELD_RULES['store']}", param="store")
        if request.top_logprobs and not request.logprobs:  # 0 asks for nothing (clients that send every default)
            raise ProtocolError(f"top_logprobs ({request.top_logprobs}) needs logprobs: true", param="top_logprobs")
        check_template_options(request)
        for i, message in enumerate(request.messages):
            message.check(i)  # refuses missing content, bad tool calls and non-text parts now, before any work
        request._tool_use = function_calling.check_tool_request(request, tool_call_parser)
        if request._tool_use.parser is not None:
            # vLLM's rule for a parsed "auto": a model's <tool_call> may be a special token, which
            # decoding would drop before the parser could see it
            request.skip_special_tokens = False
        if request._tool_use.structure is not None:  # a forced call: its schema constrains the output
            request._structure = request._tool_use.structure
        if reasoning_parser is not None:
            # with a structured output, the app starts its constraint after the thinking (settle_thinking)
            request._reasoning = (reasoning_parser, thinking_requested(reasoning_parser, request.chat_template_kwargs))
            if reasoning_parser == "qwen3":  # vLLM's rule for Qwen3: a tag that is a special token survives
                request.skip_special_tokens = False


def effort_template_kwargs(effort: str, own_template_kwargs: dict) -> dict:
    """The template variables a chat's reasoning_effort sets, as vLLM 0.32 sets them: reasoning_effort
    itself (the request's field wins over a chat_template_kwargs entry of that name), and
    enable_thinking, false for "none" and true otherwise (Qwen3's and Gemma's templates think by it),
    unless the request's own chat_template_kwargs set it (a server default is overridden: the
    request asked for this effort)."""
    variables = {"reasoning_effort": effort}
    if "enable_thinking" not in own_template_kwargs:
        variables["enable_thinking"] = effort != "none"
    return variables


def _check_allowed_token_ids(ids: list[int] | None) -> None:
    """An empty list is refused, as vLLM refuses it (no token would be left to generate)."""
    if ids is None:
        return
    if len(ids) > MAX_ALLOWED_TOKEN_IDS:
        raise ProtocolError(f"allowed_token_ids has {len(ids)} ids; at most {MAX_ALLOWED_TOKEN_IDS} are allowed",
                            param="allowed_token_ids")
    if not ids:
        raise ProtocolError(f"allowed_token_ids ([]) must be {FIELD_RULES['allowed_token_ids']}: an empty list "
                            f"leaves no token to generate (leave it out for every token)", param="allowed_token_ids")
    if any(t < 0 for t in ids):
        raise ProtocolError(f"allowed_token_ids ({_short(ids)}) must be {FIELD_RULES['allowed_token_ids']}",
                            param="allowed_token_ids")


def _check_bad_words(words: list[str] | None) -> None:
    """The bounds SamplingParams holds bad_words to, refused as a 400 naming the word; a lone surrogate
    is refused as a stop string's is (it could not be tokenized)."""
    if not words:  # null and [] ban nothing
        return
    if len(words) > MAX_BAD_WORDS:
        raise ProtocolError(f"bad_words has {len(words)} words; at most {MAX_BAD_WORDS} are allowed",
                            param="bad_words")
    for i, word in enumerate(words):
        if not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
            raise ProtocolError(f"bad_words[{i}] ({clip(word)!r}) must be a non-empty word (not only spaces) of at "
                                f"most {MAX_BAD_WORD_CHARS} characters", param="bad_words")
        check_utf8(word, "bad_words")


def _check_logit_bias(bias: dict[str, float]) -> None:
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ProtocolError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed",
                            param="logit_bias")
    spellings: dict[int, str] = {}
    for token, value in bias.items():
        # digits alone (str.isdigit takes "²" and other digits int() refuses); no leading "+" or spaces;
        # at most 18 of them (any vocabulary's ids; int() refuses more than 4300 in Python's words)
        if not (token.isascii() and token.isdigit() and len(token) <= 18):
            raise ProtocolError(f"logit_bias key {clip(token)!r} is not a token id: its keys must be token ids "
                                f"written as strings of digits, e.g. \"50256\"", param="logit_bias")
        if int(token) in spellings:  # "5" and "05": one would silently replace the other's bias
            raise ProtocolError(f"logit_bias names token {int(token)} twice (as {clip(spellings[int(token)])!r} and "
                                f"{clip(token)!r}); give each token one bias", param="logit_bias")
        spellings[int(token)] = token
        if not math.isfinite(value):  # a finite bias past +-100 is clamped (clamped_bias); these have no size
            raise ProtocolError(f"logit_bias[\"{clip(token)}\"] ({_short(value)}) must be a finite number (one past "
                                f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] is taken as -{MAX_LOGIT_BIAS:g} or "
                                f"{MAX_LOGIT_BIAS:g}); send -{MAX_LOGIT_BIAS:g} to all but ban the token, "
                                f"{MAX_LOGIT_BIAS:g} to all but force it", param="logit_bias")


def max_new_tokens(request: _GenerationRequest, prompt_tokens: int, context_tokens: int) -> int:
    """The tokens to generate at most: the request's limit, else OpenAI's default (16 for
    completions; for chat the rest of the context, at least 1 so an overlong prompt is refused by the
    engine's length check naming both lengths)."""
    if isinstance(request, ChatCompletionRequest):
        asked = request.max_completion_tokens or request.max_tokens
        return asked if asked is not None else max(context_tokens - prompt_tokens, 1)
    return request.max_tokens if request.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS


# ---- responses --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResponseMeta:
    """What every object of one response shares."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> "ResponseMeta":
        return cls(id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time()), model=model)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          reasoning_tokens: int | None = None) -> dict:
    """cached_tokens: of the prompt tokens, those the engine did not prefill (prefix caching).
    reasoning_tokens: of the completion tokens, the thinking's (a chat on a server with a reasoning
    parser: launcher/serving/reasoning.py); None leaves completion_tokens_details out, as vLLM does
    without a parser."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}, **_completion_details(reasoning_tokens)}


def _completion_details(reasoning_tokens: int | None) -> dict:
    return {} if reasoning_tokens is None else {"completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}


def response(meta: ResponseMeta, obj: str, choices: list[dict], usage_: dict) -> dict:
    """A whole response of `choices` (each from completion_choice or chat_choice), in index order."""
    return {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model, "choices": choices,
            "usage": usage_}


def completion_choice(text: str, finish_reason: str | None, logprobs: dict | None = None, index: int = 0) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(meta: ResponseMeta, text: str, finish_reason: str | None, usage_: dict,
                        logprobs: dict | None = None) -> dict:
    return response(meta, "text_completion", [completion_choice(text, finish_reason, logprobs)], usage_)


def completion_chunk(meta: ResponseMeta, text: str, finish_reason: str | None = None,
                     logprobs: dict | None = None, index: int = 0) -> dict:
    return {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "choices": [completion_choice(text, finish_reason, logprobs, index)]}


def chat_choice(text: str, finish_reason: str | None, logprobs: dict | None = None, index: int = 0) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason}


def chat_response(meta: ResponseMeta, text: str, finish_reason: str | None, usage_: dict,
                  logprobs: dict | None = None) -> dict:
    return response(meta, "chat.completion", [chat_choice(text, finish_reason, logprobs)], usage_)


def chat_chunk(meta: ResponseMeta, delta: dict, finish_reason: str | None = None,
               logprobs: dict | None = None, index: int = 0) -> dict:
    """`delta`: {"role": "assistant"} on the first chunk, then {"content": text}."""
    return {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def chunk_usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> dict:
    """The usage one chunk carries with stream_options.continuous_usage_stats, as vLLM's: its choice's
    prompt's tokens and that choice's completion tokens so far (per choice, not the request's sum;
    the last chunk, usage_chunk, has the request's), and with a reasoning parser that choice's
    reasoning tokens so far (usage). No prompt_tokens_details: a chat's opening chunks go out before
    the engine says how many prompt tokens were cached (vLLM leaves it out too)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, **_completion_details(reasoning_tokens)}


def usage_chunk(meta: ResponseMeta, obj: str, usage_: dict) -> dict:
    """The extra last chunk of stream_options.include_usage: no choices, the request's usage."""
    return {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model, "choices": [],
            "usage": usage_}


def models_list(name: str, created: int, max_model_len: int) -> dict:
    """GET /v1/models: the one served model's card, with vLLM's fields beside OpenAI's: max_model_len
    (the tokens a request's prompt and output may take together, which clients read to size their
    context), root (the served name; vLLM gives the model's path, which names the server's files)
    and parent (null: no adapter)."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "corelaunch",
                                        "root": name, "parent": None, "max_model_len": max_model_len}]}


# ---- log-probabilities ------------------------------------------------------------------------
# `pieces` is a launcher.serving.token_pieces.TokenPieces: each token's text and bytes (a token that
# is part of a character has its own bytes and a `bytes:\xNN` text; see that module).


LOGPROB_FLOOR = -9999.0
"""The least log-probability a response reports (vLLM's floor): the model's own can underflow to -inf
(they are taken before the sampling rules, so a masked token keeps its own), which JSON cannot hold
(json.dumps writes -Infinity, which no JSON parser reads)."""


def finite_logprob(logprob: float) -> float:
    """`logprob` as a response reports it: -inf (and NaN, which is no probability) at LOGPROB_FLOOR,
    +inf (no log-probability is above 0) at 0."""
    if logprob == float("inf"):
        return 0.0
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN compares False: the floor


def completion_logprobs(entries: list, pieces) -> dict:
    """Completions' logprobs object for `entries`: (workers.serving.requests.TokenLogprob, the
    chosen token's offset into the generated text) pairs, in order."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry, offset in entries:
        tokens.append(pieces.text(entry.token_id))
        token_logprobs.append(finite_logprob(entry.logprob))
        # Keyed by text, so two tokens that read the same (a SentencePiece vocabulary can spell one
        # word twice) share a key: the more likely keeps it (entry.top is most likely first), as a
        # client reading the most likely alternative (lm-evaluation-harness's is_greedy) needs; the
        # last used to overwrite it.
        listed: dict[str, float] = {}
        for token_id, logprob in entry.top:
            listed.setdefault(pieces.text(token_id), finite_logprob(logprob))
        # OpenAI's completions always list the chosen token too: up to logprobs + 1 entries
        listed.setdefault(pieces.text(entry.token_id), finite_logprob(entry.logprob))
        top.append(listed)
        offsets.append(offset)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def vllm_prompt_logprobs(entries: list, pieces, top_n: int) -> list:
    """vLLM's prompt_logprobs: null for the first prompt token, then per token {token id (a string,
    as JSON keys are): {logprob, rank, decoded_token}} holding the prompt's own token first, then its
    top_n most likely (ranks 1 .. top_n) where they are other tokens."""
    def item(token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": finite_logprob(logprob), "rank": rank, "decoded_token": pieces.text(token_id)}

    out: list = [None]
    for entry in entries:
        listed = {str(entry.token_id): item(entry.token_id, entry.logprob, entry.rank)}
        for place, (token_id, logprob) in enumerate(entry.top[:top_n], 1):
            listed.setdefault(str(token_id), item(token_id, logprob, place))
        out.append(listed)
    return out


def chat_logprobs(entries: list, pieces) -> dict:
    """Chat's logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def item(token_id: int, logprob: float) -> dict:
        return {"token": pieces.text(token_id), "logprob": finite_logprob(logprob),
                "bytes": list(pieces.bytes(token_id))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


def merge_completion_logprobs(parts: list[dict]) -> dict:
    """One completions logprobs object from the per-delta ones (non-streaming responses); empty lists
    when no token reached the text (a stop string at the very start)."""
    return {key: [v for part in parts for v in part[key]] for key in completion_logprobs([], None)}


# ---- server-sent events -----------------------------------------------------------------------
SSE_DONE = "data: [DONE]\n\n"


def sse_event(obj: dict) -> str:
    """One server-sent event carrying `obj` as JSON (compact, on one line as SSE requires)."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
