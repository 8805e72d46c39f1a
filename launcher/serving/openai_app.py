"""The OpenAI-compatible HTTP server: a FastAPI app inside a Ray Serve deployment, one Launcher (one
TP group) per Serve replica.

    serve run launcher.serving.openai_app:build_app model=/path/to/model tp=2
    corelaunch serve --model /path/to/model --tp 2             # the same, with Ray and Serve managed

Routes: POST /v1/completions, POST /v1/chat/completions (streaming as server-sent events, or one
JSON object), POST /v1/responses (OpenAI's Responses API, answered through the chat route:
responses/) with GET and DELETE /v1/responses/{id} (and its input_items) for kept responses, GET
/v1/models, GET /health, GET /metrics, and vLLM's GET /version, POST /tokenize and POST /detokenize
(answered by the replica's own tokenizer, never the engine), and SageMaker's /ping and POST
/invocations (a body answered by the route its kind names). The wire format lives in
openai_protocol.py; this file only moves requests between it and the engine.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' parameter annotations (Request)
# as objects, and Serve ships this class to its replicas by value, where string annotations would be
# resolved against a copy of this module's globals that lacks them.
import asyncio
import dataclasses
import functools
import hmac
import inspect
import json
import logging
import math
import re
import sys
import threading
import time
from contextlib import aclosing, contextmanager, nullcontext

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from launcher.errors import LaunchError, NoReplicaAvailable, ReplicaFailed, RequestTimeout
from launcher.serving import openai_protocol as proto
from launcher.serving import responses as responses_api
from launcher.serving import tool_calls as function_calling  # not `tool_calls`: a message's field
from launcher.serving.chat_template import (chat_template_warning, control_tokens_for, has_default_chat_template,
                                            use_chat_template)
from launcher.serving.choice_streams import ChoiceStreams
from launcher.serving.echoed_prompt import echoed_prompt
from launcher.serving.metrics import CONTENT_TYPE_LATEST, ServerMetrics, TokenTimer
from launcher.serving.openai_protocol import CONTEXT_LENGTH_EXCEEDED, ProtocolError
from launcher.serving.openai_render import ChatRender, CompletionRender
from launcher.serving.prompt_probe import (head_overfills, length_overfills, longest_token_chars,
                                            too_long_message, too_many_characters_message)
from launcher.serving.reasoning import CALL_START, THINK_END, THINK_START, ThinkTokens
from launcher.serving.response_store_server import (LocalResponses, ResponseStoreServer, SharedResponses,
                                                     StoreUnavailable)
from launcher.serving.responses.request import (START_ANEW, STILL_GENERATING, conversation_too_long,
                                                kept_message_count)
from launcher.serving.server_settings import ServerSettings, api_key_from_environment, settings_from_args
from launcher.serving.token_pieces import TokenPieces
from shardlib.generation_config import generation_eos_ids
from workers.serving.prefix_reuse import common_prefix_length

# No documentation routes: /openapi.json, /docs and /redoc would answer without the API key. No
# redirects from a path with a trailing slash either: their 307 told anyone which routes exist.
app = FastAPI(title="corelaunch OpenAI-compatible server", docs_url=None, redoc_url=None, openapi_url=None,
              redirect_slashes=False)


def error_response(err: ProtocolError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


@app.exception_handler(ProtocolError)
async def _protocol_error(request: Request, err: ProtocolError) -> JSONResponse:
    return error_response(err)


# A client gone while its body is read: Starlette's ClientDisconnect (direct ingress), Ray's
# TaskCancelledError (Serve's proxy cancels the request and its receive raises it), or the task
# cancelled.
CLIENT_GONE = (ClientDisconnect, TaskCancelledError, asyncio.CancelledError)


@app.exception_handler(ClientDisconnect)
@app.exception_handler(TaskCancelledError)
async def _client_gone(request: Request, err: Exception) -> Response:
    # The client left while its body was being read: no one reads this answer. Unhandled, each such
    # client put a 65-line traceback in the replica's log ("Future exception was never retrieved").
    return Response(status_code=499)


def failure_reason(status: int) -> str:
    """The requests counter's finish_reason for a request that failed while generating: 503 (its
    model failed for good, or is stopping) is `unavailable` as at admission; it was `error`, which
    the metric's help reserves for 500 and 504."""
    return "unavailable" if status == 503 else "error"


_key_check = None
"""The replica's API-key check, for _http_error (one replica per process)."""


def install_key_check(check) -> None:
    """Set _key_check. A function of this module, called by the replica's constructor: Ray pickles
    the deployment class by value, with its own copies of the module globals it reads (`app`
    included), so the constructor cannot set them directly; this function is pickled by reference."""
    global _key_check
    _key_check = check


KEYED_ROUTES_OUTSIDE_V1 = ("/tokenize", "/detokenize", "/invocations")
"""The routes outside /v1/ that need the API key, as every route under /v1/ does (vLLM leaves these
open: its key guards only paths under /v1 and a few others)."""


def _behind_the_key(path: str) -> bool:
    """Whether `path` is one the API key guards, for _http_error: under /v1/, or one of
    KEYED_ROUTES_OUTSIDE_V1 (with or without a trailing slash)."""
    return path.startswith("/v1/") or path.rstrip("/") in KEYED_ROUTES_OUTSIDE_V1


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    # Under /v1/ (and on /tokenize, /detokenize) the key is checked first: without it, a 404 or 405
    # told which routes and methods exist.
    if _key_check is not None and _behind_the_key(request.url.path):
        try:
            _key_check(request)
        except ProtocolError as refused:
            return error_response(refused)
    # Unknown routes and wrong methods get the OpenAI error shape too, so clients can read them.
    message = f"{request.method} {request.url.path}: {err.detail}"
    return JSONResponse(proto.error_body(message), status_code=err.status_code, headers=err.headers)


def queue_full_type() -> type[BaseException] | tuple:
    """launcher.errors.QueueFull, or () (an except clause that catches nothing) on an engine that
    has no admission queue."""
    import launcher.errors

    return getattr(launcher.errors, "QueueFull", ())


def _at_capacity(err, retry_s: int, one_of_several: bool = False) -> str:
    """A queue-full answer in the API's words: the engine's names the operator's flags, which no
    client can change, and said "retry later" before the server's own "retry after". With several
    Serve replicas the counts are the one replica's that took the request (they read as the server's)."""
    slots, limit = getattr(err, "slots", None), getattr(err, "queue_limit", None)
    if slots is None or limit is None:  # an engine whose QueueFull carries no counts
        return f"the server is at capacity; retry after {retry_s} s"
    whose = " of the replica that took this request" if one_of_several else ""
    queue = f"its queue of {limit} is full" if limit else "it queues no requests"
    return (f"the server is at capacity: all {slots} sequence slots{whose} are busy and {queue}; "
            f"retry after {retry_s} s")


class _Uncounted:
    """ServerMetrics' counting calls, counting nothing: for requests that are not generation requests
    (/tokenize, /detokenize), which corelaunch_requests_total (its help: generation requests by
    outcome) leaves out, as it does GET /v1/models."""

    def rejected(self, status: int, reason: str = "rejected") -> None:
        pass

    def finished(self, finish_reason: str, status: int = 200) -> None:
        pass


_UNCOUNTED = _Uncounted()


def _outside_vocabulary(ids: list[int], vocab: int, param: str) -> ProtocolError | None:
    """The 400 for token ids outside the vocabulary [0, vocab) (the first five named), None when all
    are in it: a completions prompt of ids, /detokenize's tokens."""
    outside = [t for t in ids if t >= vocab]
    if not outside:
        return None
    return ProtocolError(f"{param} holds token ids {outside[:5]} outside the vocabulary [0, {vocab}); send ids of "
                         f"this model's tokenizer", param=param)


def _empty_render_refusal(own_template: bool, server_template: bool) -> ProtocolError:
    """The 400 for a chat its template rendered to no tokens (`{% for m in messages %}{% endfor %}`):
    the engine's refusal spoke of a prompt "([])" the client never sent, naming no template."""
    whose = ("the request's own chat_template" if own_template
             else "the server's chat template (--chat-template)" if server_template else "the model's chat template")
    return ProtocolError(f"messages: {whose} rendered the messages to no tokens, so there is no prompt to "
                         f"complete; use a template that writes the messages out", param="messages")


def _template_text(template: object, tools: list | None) -> str:
    """A chat template as text, for reading which roles it knows: a tokenizer's dict of named templates
    gives the one apply_chat_template renders (tokenizer.get_chat_template's choice: "tool_use" for
    a request with tools where there is one, else "default"), whose str() was a repr that escaped
    its quotes (so `'developer'` was never found in it)."""
    if not isinstance(template, dict):
        return template or ""
    if tools and "tool_use" in template:
        return template["tool_use"]
    return template.get("default") or ""


def _special_tokens_around(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer adds before and after a text's own when it adds special tokens (a BOS,
    an EOS), read off a one-character text once, when the replica starts (OpenAIServer._text_specials):
    /tokenize's chat form with add_special_tokens, whose ids apply_chat_template tokenizes without
    them (it has no switch for them), and a text prompt cut by truncate_prompt_tokens."""
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    full = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start], full[start + len(plain):]
    # additions that change the text's own tokens (no tokenizer known does): taken as a prefix
    return full[:max(len(full) - len(plain), 0)], []


def _sanitizing(tokenizer) -> dict:
    """apply_chat_template's option that encodes control tokens written inside message text as that
    text (transformers 5.20 and later); {} where the installed transformers lacks it."""
    parameters = inspect.signature(tokenizer.apply_chat_template).parameters
    return {"sanitize_control_tokens": True} if "sanitize_control_tokens" in parameters else {}


def _cpus_per_rank(launch: dict, serve_replicas: int) -> float | None:
    """An even share of the cluster's CPUs for each rank of every Serve replica there can be, so
    that all of their TP groups fit at once, as the nodes hold them (the Serve replica actors
    themselves take no CPU); the driver API's own rule for its replicas (cpu_rank_resources). None
    for a device backend, whose ranks take one device and one CPU each (cpus_per_rank is refused)."""
    from launcher.api import LaunchConfig
    from launcher.cluster.placement import alive_nodes
    from launcher.cluster.resources import cpu_rank_resources
    from launcher.launch_plan import plan_launch, with_artifact_settings
    from launcher.progress import Progress
    from launcher.serving.serve_deployment import own_cpus, without_replica_cpus
    from workers.backends import backend_entry

    config = with_artifact_settings(LaunchConfig(**launch))  # the TP degree the replica's Launcher runs
    planned = plan_launch(config, Progress(False))
    if backend_entry(planned.backend).ray_resource is not None:
        return None
    tp = planned.plan.tp_degree
    node_cpus = without_replica_cpus([n.total.get("CPU", 0.0) for n in alive_nodes()], own_cpus(), serve_replicas)
    return cpu_rank_resources(tp, node_cpus, nodes=config.nodes, replicas=serve_replicas).num_cpus


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body generator and the engine stream under it.
    Starlette leaves a generator suspended at `yield` open when the client disconnects (or Serve
    cancels the request), and one never started is not run at all by aclose(); either way the engine
    request would keep its slot until garbage collection. `on_close` runs last, once, even when the
    body never started (the request's outcome is counted there)."""

    def __init__(self, content, engine_stream, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.engine_stream, self.on_close = engine_stream, on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, TaskCancelledError):
            # The client left mid-stream (behind Serve's proxy the request is cancelled, and the
            # body's next await raises): its 200 has gone out, so the 499 handler cannot answer
            # and Starlette logged a traceback per stream. No one reads what would follow.
            pass
        finally:
            try:
                await asyncio.shield(self.body_iterator.aclose())
                await asyncio.shield(self.engine_stream.aclose())  # closing twice is harmless
            finally:
                self.on_close()


REQUEST_BYTES_FLOOR = 1 << 20
"""The least a request body may hold (1 MiB), whatever the context (see request_bytes_limit)."""


UNBOUNDED_TOKEN_CHARS = 64
"""Characters a token is taken to stand for, for the body limit alone, where the tokenizer gives no
bound (longest_token_chars is None: a word-level vocabulary with an unknown token, say)."""


def request_bytes_limit(context_tokens: int, longest_token_chars: int | None) -> int:
    """The largest request body read: a prompt longer than context x the vocabulary's longest piece
    is refused anyway (prompt_probe.py), and JSON spells a character in at most 12 bytes (a
    surrogate pair's escapes); 1 MiB for the rest of the body. Above it, 413 before the body is
    parsed: it was read whole and parsed first (200 MB took over a second and its memory twice over).
    A tokenizer with no bound counts UNBOUNDED_TOKEN_CHARS a token (its None crashed every replica)."""
    chars = UNBOUNDED_TOKEN_CHARS if longest_token_chars is None else longest_token_chars
    return REQUEST_BYTES_FLOOR + 12 * context_tokens * chars


PARSED_ON_A_THREAD = 64 * 1024
"""Bodies larger than this are parsed off the event loop (and smaller ones that asks_for_structure)."""

_STRUCTURE_FORMATS = ("json_schema", "json_object")
_UNFORCED_TOOL_CHOICES = ("none", "auto")


def asks_for_structure(body) -> bool:
    """Whether a parsed request body (chat, completions, or /v1/responses) asks for structured output,
    whose grammar llguidance checks as the body is parsed: parsed off the event loop then, whatever
    its size (a 1.6 KB allOf of 6 anyOfs took 0.6 s to check; 8 such requests held /v1/models 3.7 s).
    Read from the parsed body, not its bytes: a key may be written with JSON escapes. Erring towards
    yes costs a thread hop."""
    if not isinstance(body, dict):
        return False
    formats = [body.get("response_format")]
    text = body.get("text")  # /v1/responses: text.format
    if isinstance(text, dict):
        formats.append(text.get("format"))
    if any(isinstance(f, dict) and f.get("type") in _STRUCTURE_FORMATS for f in formats):
        return True
    if body.get("structured_outputs") is not None:
        return True
    choice = body.get("tool_choice")  # "required" or a named function: the calls' schema is checked
    forced = choice is not None and (not isinstance(choice, str) or choice not in _UNFORCED_TOOL_CHOICES)
    return forced and body.get("tools") is not None


BODY_READ_S = 60.0
"""How long a request's body of more than PARSED_ON_A_THREAD bytes may take to arrive, whole."""
SMALL_BODY_READ_S = 10.0
"""How long one of at most PARSED_ON_A_THREAD bytes may take (a client sends it at once). At 60 s,
16 connections sending half a small body each held every place Serve lets through to a replica
(max_num_seqs + max_queued_requests + ROUTE_HEADROOM), and /health and /metrics waited behind them."""
BODY_BYTES_AT_ONCE = 64 * 2 ** 20
"""The bytes of bodies larger than PARSED_ON_A_THREAD that may be read at once (BodyBudget; at least
four of the largest allowed): 250 clients each holding a body of nearly 5 MB unfinished took the
replica's memory from 1.1 to 2.0 GB. Smaller bodies, every usual request, are not counted."""


class BodyBudget:
    """The bytes of request bodies this replica reads at once, bounded (used on its event loop only):
    a request whose body does not fit now gets 503 with Retry-After rather than memory."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def take(self, size: int) -> bool:
        if self.used + size > self.limit:
            return False
        self.used += size
        return True

    def give(self, size: int) -> None:
        self.used -= size


def _check_encoding(request: Request) -> None:
    """ProtocolError 415 for a body with a Content-Encoding other than identity: the server decodes
    none, so a gzip body was parsed as JSON and refused as "not valid JSON", with advice that could
    not help, and the header on a plain body was ignored."""
    encodings = [e.strip() for value in request.headers.getlist("content-encoding") for e in value.split(",")]
    refused = [e for e in encodings if e and e.lower() != "identity"]
    if refused:
        raise ProtocolError(f"the request body's Content-Encoding {proto.clip(', '.join(refused))!r} is not "
                            f"supported; send the body uncompressed, without a Content-Encoding header",
                            status=415, code="unsupported_content_encoding")


async def _read_body(request: Request, limit: int, budget: BodyBudget) -> tuple[bytes, int]:
    """The request's body and the bytes of `budget` it holds, which the caller gives back once the
    body is parsed (a body read whole still waits for, and takes memory in, its parse). Refused (413)
    past `limit` bytes: by its Content-Length before reading, else as soon as what arrives passes it;
    503 when the large bodies already held fill the budget; 408 when it has not arrived within
    SMALL_BODY_READ_S, or BODY_READ_S once it is (declared or found) larger than PARSED_ON_A_THREAD;
    415 before reading for a Content-Encoding other than identity (see _check_encoding). On a refusal
    the budget is given back here."""
    _check_encoding(request)
    declared = request.headers.get("content-length", "")
    too_large = ProtocolError(f"the request body is larger than this server reads ({limit} bytes, from its context "
                              f"of tokens); send a shorter prompt", status=413, code="request_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    busy = ProtocolError("the server is reading as many large request bodies as it takes at once; retry after 1 s",
                         status=503, type="server_error", code="server_busy", headers={"Retry-After": "1"})
    chunks, size, held = [], 0, 0
    large = declared.isdigit() and int(declared) > PARSED_ON_A_THREAD
    allowed = BODY_READ_S if large else SMALL_BODY_READ_S
    try:
        if large:
            if not budget.take(int(declared)):
                raise busy
            held = int(declared)
        started = asyncio.get_running_loop().time()
        async with asyncio.timeout(allowed) as deadline:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                if size > max(held, PARSED_ON_A_THREAD):  # chunked, or past its declared length: as it arrives
                    if not budget.take(size - held):
                        raise busy
                    held = size
                if size > PARSED_ON_A_THREAD and allowed < BODY_READ_S:  # a large chunked body: its time
                    allowed = BODY_READ_S
                    deadline.reschedule(started + allowed)
                chunks.append(chunk)
    except BaseException as err:  # refused, too slow, the client gone, or the request cancelled
        budget.give(held)
        if isinstance(err, TimeoutError):
            raise ProtocolError(f"the request body did not arrive within {allowed:g} s", status=408,
                                code="request_timeout") from None
        raise
    return b"".join(chunks), held


def parse_json_body(raw: bytes):
    try:
        return json.loads(raw)
    # ValueError: JSONDecodeError, UnicodeDecodeError, and a number past Python's 4300-digit limit;
    # RecursionError: arrays or objects nested thousands deep
    except (ValueError, RecursionError) as err:
        if "integer string conversion" in str(err):  # Python's text advises a setting of the server's
            raise ProtocolError(f"the request body holds an integer of more than {sys.get_int_max_str_digits()} "
                                f"digits, longer than any field takes; send numbers in their fields' "
                                f"ranges") from None
        raise ProtocolError(f"the request body is not valid JSON ({str(err)[:200]}); send a JSON object with "
                            f"Content-Type: application/json") from None


def _context_tokens(launcher) -> int:
    """Prompt + generated tokens one request may hold: the serving cache's row (seq_len, else the
    plan's), never past the model's maximum."""
    return min(launcher.model_config.max_position_embeddings, launcher.serving_seq_len)


def _longest_prompt(launcher) -> int | None:
    """The longest prompt the launch's prefill shapes take (its largest context-encoding bucket), or
    None where prompts are bounded only by the context (eager)."""
    return launcher.buckets.context[-1] if launcher.buckets is not None else None


@contextmanager
def _naming_prompt(index: int, count: int):
    """A refusal about one of a request's several prompts says which (prompt[1]: ...)."""
    try:
        yield
    except ProtocolError as err:
        # a full queue, or an option of the whole request (logit_bias), is not this prompt's doing
        if count == 1 or err.status != 400 or err.param in _REQUEST_WIDE:
            raise
        raise ProtocolError(f"prompt[{index}]: {err.message}", err.param, err.status, err.type, err.code,
                            err.headers) from None


_REQUEST_WIDE = ("logit_bias", "stop_token_ids", "min_tokens", "allowed_token_ids", "bad_words",
                 "structured_outputs", "response_format", "response_format.json_schema.schema")
"""Params of refusals about the request as a whole, which no prompt of several is named in."""

_ECHO_ONLY_NEEDS_ONE = (" (max_tokens 0 still needs one position: the engine generates one token for it, which "
                        "the answer leaves out)")


def _refused_param(message: str, req, prompt_param: str) -> str:
    """The request field an engine refusal is about: the sampling field it names first, the
    structured output's own field, or else the prompt (most refusals are about its length or ids)."""
    named = next((name for name in ("stop_token_ids", "logit_bias", "min_tokens", "allowed_token_ids", "bad_words")
                  if message.startswith(name)), None)
    if named is not None:
        return named
    return req.structure_param() if message.startswith(("structured_output", "structured output")) else prompt_param


def _as_one_prompt(message: str) -> str:
    """An engine refusal in the words of a request that has one prompt: the driver API numbers its
    prompts ("prompt 0 holds token ids ..."), which an HTTP client never sent."""
    for numbered, single in (("prompt 0: ", ""), ("prompt 0 ", "the prompt ")):
        if message.startswith(numbered):
            return single + message[len(numbered):]
    return message


HEALTH_CHECK_PERIOD_S = 2.0
"""How often Serve calls check_health. Serve marks a replica unhealthy after three failures in a row,
so its default period (10 s) kept a replica whose TP group failed for good answering 503 for about
30 s before Serve started replacing it; this takes 7-9 s (README). The check only reads the replica
pool's state (no Ray call), and a private cluster's controller ticks once a second (ingress.py)."""


UNAVAILABLE_RETRY_S = 10
"""Retry-After (seconds) on a 503 model_unavailable: a little past the time Serve takes to mark a
replica whose TP group failed for good unhealthy and stop routing to it (7-9 s after the fault on
machine I with HEALTH_CHECK_PERIOD_S; its replacement answered after 25 s, README). A client that
honours the header (the openai client does on its retries) then reaches another replica, or its
request waits in Serve's proxy for the replacement, instead of spending its retries on the failed
replica; on its own port (direct ingress) it may find nothing listening until the replacement binds."""


_RETRY_UNAVAILABLE = {"Retry-After": str(UNAVAILABLE_RETRY_S)}

SERVER_LOG = logging.getLogger("ray.serve")
"""Serve's logger: in a replica its records go to the replica's log file (`ray logs`, the Serve log
directory), where the causes that clients are not told end up."""


_FAILED_FOR_GOOD = (ReplicaFailed, NoReplicaAvailable)
"""A replica's model that failed and could not be restarted: Serve replaces the replica."""

_last_logged = [""]


def _unavailable(err: LaunchError) -> str:
    """What a client is told when the replica's model cannot take or finish its request. The
    errors' own messages are for the operator: they name the driver API's settings
    (max_restarts=...), the Launcher's own replica index (0 in every Serve replica) and each
    failed rank's node address and pid, which went to any client of the API before."""
    if str(err) != _last_logged[0]:  # once, not for each request refused behind it
        _last_logged[0] = str(err)
        SERVER_LOG.error("corelaunch: the model is not serving: %s", err)
    if isinstance(err, _FAILED_FOR_GOOD):
        return ("this server replica's model failed and could not be restarted (Serve replaces the replica; "
                "the cause is in the server's log)")
    return "this server replica's model is not serving (it is stopping)"


def _refused_unavailable(metrics, err: LaunchError) -> ProtocolError:
    """The 503 model_unavailable (with Retry-After) for a request refused because no replica of this
    server's launcher is serving (Serve replaces this one) or it is shutting down, counted as refused.
    One helper for every step that reaches the launcher before a stream starts: the structured-output
    check answered this with an uncounted plain 500."""
    metrics.rejected(503, reason="unavailable")
    return ProtocolError(f"the model cannot take requests now: {_unavailable(err)}; retry after "
                         f"{UNAVAILABLE_RETRY_S} s", status=503, type="server_error", code="model_unavailable",
                         headers=_RETRY_UNAVAILABLE)


_NO_RETRY = {"x-should-retry": "false"}
"""On a failure a retry only repeats: the official openai client retries every 5xx twice unless told
not to, so a 504 generation_timeout ran the whole generation three times (about 30 minutes at the
default --request-timeout) before the user saw it."""


def _min_tokens_past_the_limit(req, max_tokens: int, prompt_tokens: int) -> str:
    """Why min_tokens is refused, naming the limit the request really has: the one it sent, OpenAI's
    default for completions, or what the context leaves a chat request that sent none."""
    sent = req.limit_sent()
    said = f"min_tokens ({req.min_tokens}) must be at most"
    if sent:
        return f"{said} {sent} ({max_tokens}); lower min_tokens or raise {sent}"
    if isinstance(req, proto.ChatCompletionRequest):
        return (f"{said} the {max_tokens} tokens the context leaves after the {prompt_tokens}-token prompt (no "
                f"max_tokens was sent); lower min_tokens or shorten the messages")
    return (f"{said} max_tokens, {max_tokens} when not sent (OpenAI's default for completions); send max_tokens "
            f"of at least {req.min_tokens}")


CHAT_TOKEN_LIMITS = "max_tokens (max_completion_tokens)"
"""How completions and chat requests bound their tokens, as a timeout's message names them."""
RESPONSES_TOKEN_LIMIT = "max_output_tokens"
"""How a /v1/responses request bounds its tokens (it refuses the chat route's names)."""


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _overdue(response_id: str | None, timeout_s: float, delivered: list[int], ended: list,
             waited_for_a_slot: bool = False) -> str:
    """What a client is told of its request past the request timeout: the response id a stream gave
    it (None: the request, whose answer not streamed carries its id only when it comes; the
    engine's own request id, which the timeout's error names, means nothing to a client) and the
    tokens streamed so far, choice by choice where it asked for several (`delivered[i]` and
    `ended[i]`, choice i's: its `index`), naming those that had not ended (the timeout's error spoke
    of one of them only). An answer not streamed delivered nothing, and gathers a choice's tokens
    into one piece at its end: its count said "1 token" however far the choice had come, so none is
    given. One that waited the whole time for a sequence slot (waited_for_a_slot) delivered nothing,
    which _generation_failure says in its own words."""
    streamed = response_id is not None
    said = f"{f'response {response_id}' if streamed else 'the request'} did not finish within the request " \
           f"timeout ({timeout_s:g} s)"
    if waited_for_a_slot:
        return said
    if len(delivered) == 1:
        return f"{said}; it had delivered {_plural(delivered[0], 'token')}" if streamed else said
    cut = [f"choice {i}" + (f" ({_plural(count, 'token')} delivered)" if streamed else "")
           for i, (count, end) in enumerate(zip(delivered, ended)) if not end]
    return f"{said}; of its {len(delivered)} choices, {', '.join(cut) or 'none'} had not ended"


def _generation_failure(err: Exception, token_limit: str = CHAT_TOKEN_LIMITS, overdue: str | None = None,
                        waited_for_a_slot: bool | None = None) -> tuple[int, dict, dict]:
    """(HTTP status, OpenAI error body, headers) for a request that failed while generating. A
    request past the request timeout is a 504 told as `overdue` (_overdue: in the client's terms,
    the error's own text being the driver API's; None: the error's text, a hung group's say) naming both ways out (token_limit: the route's own
    field): a chat request without it may generate up to the rest of the model's context, which on
    a slow host outlasts the default timeout (it was a 500, "generation failed"). A request whose
    replica's model failed for good is a 503 as a new request there would be, told nothing of nodes
    or processes. A request that waited the whole time for a sequence slot (waited_for_a_slot; None:
    the error's say) is told so, not to ask for fewer tokens, of which it had none; one whose group's
    restart outlasted its time is told to retry, and its 504 lets the client do so."""
    if waited_for_a_slot is None:
        waited_for_a_slot = getattr(err, "waited_for_a_slot", False)
    if isinstance(err, RequestTimeout) and err.lost_to_a_restart:  # a retry is served: the client may retry it
        return 504, proto.error_body(
            f"{overdue}: its model failed meanwhile, and restarting it outlasted the request's time; retry it"
            if overdue else str(err), type="server_error", code="generation_timeout"), {}
    if isinstance(err, RequestTimeout) and waited_for_a_slot:
        return 504, proto.error_body(
            f"{overdue}: it waited all that time for a sequence slot, every one busy with other requests; retry it "
            f"later, or have the server's operator raise its --max-num-seqs or --request-timeout" if overdue else
            str(err), type="server_error", code="generation_timeout"), _NO_RETRY
    if isinstance(err, RequestTimeout):
        return 504, proto.error_body(
            f"{overdue or err}; ask for fewer tokens with {token_limit}: a request without it may generate up to the "
            f"rest of the model's context; or have the server's operator raise its --request-timeout for long "
            f"generations", type="server_error", code="generation_timeout"), _NO_RETRY
    if isinstance(err, _FAILED_FOR_GOOD) or type(err) is LaunchError:  # failed for good, or stopping
        return 503, proto.error_body(
            f"generation failed: {_unavailable(err)}; the request was not finished: retry it after "
            f"{UNAVAILABLE_RETRY_S} s", type="server_error", code="model_unavailable"), _RETRY_UNAVAILABLE
    return 500, proto.error_body(f"generation failed: {err}", type="server_error"), _NO_RETRY


def _generation_failed(err: Exception, response_id: str | None, delivered: list[int], ended: list,
                       token_limit: str = CHAT_TOKEN_LIMITS) -> tuple[int, dict, dict]:
    """_generation_failure's answer, a timeout told in the client's terms (_overdue: its response's
    id, each choice's delivered tokens and whether it had ended)."""
    timeout_s = err.timeout_s if isinstance(err, RequestTimeout) else None
    # None: not one request's own timeout (a hung group's), whose text says what happened
    # several choices: one that waited for a slot speaks for one of them only
    waited = isinstance(err, RequestTimeout) and err.waited_for_a_slot and len(delivered) == 1
    return _generation_failure(err, token_limit, None if timeout_s is None
                               else _overdue(response_id, timeout_s, delivered, ended, waited), waited)


def _responses_usage(stream: ChoiceStreams, completion_tokens: int, render: ChatRender) -> dict:
    """The Responses usage of a request's one choice (the chat usage in the Responses form)."""
    return responses_api.usage(proto.usage(stream.prompt_tokens, completion_tokens, stream.cached_tokens,
                                           render.reasoning_tokens()))


def _whole_output(choice: dict) -> tuple[list[dict], str, str | None]:
    """A whole chat choice as the Response's output items, status and incomplete reason."""
    return responses_api.output_items(choice["message"], choice["finish_reason"],
                                      (choice.get("logprobs") or {}).get("content"))


def _as_responses_error(err: ProtocolError, echo) -> ProtocolError:
    """A chat-route refusal of a /v1/responses request, told in the Responses request's terms: the
    param the client sent (responses_api.responses_param), named so in the message too."""
    param = responses_api.responses_param(err.param, echo)
    message = err.message if not err.param or param == err.param else err.message.replace(err.param, param)
    if err.param == "min_tokens":  # its refusal names the request's token limit and prompt (_min_tokens_past_the_limit)
        for chat, responses in _CHAT_WORDS_IN_A_MIN_TOKENS_REFUSAL:
            message = message.replace(chat, responses)
    if err.code == CONTEXT_LENGTH_EXCEEDED and echo is not None and echo.previous_response_id:
        # most of the prompt may be the kept conversation, which the client does not send
        message = message.replace("shorten the prompt", f"shorten the input (the prompt holds the conversation "
                                                        f"previous_response_id continues too: to drop turns of it, "
                                                        f"{START_ANEW})")
    return ProtocolError(message, param=param, status=err.status, type=err.type, code=err.code, headers=err.headers)


_CHAT_WORDS_IN_A_MIN_TOKENS_REFUSAL = (("max_completion_tokens", "max_output_tokens"),
                                       ("no max_tokens was sent", "no max_output_tokens was sent"),
                                       ("shorten the messages", "shorten the input"))
"""_min_tokens_past_the_limit's chat fields, as a /v1/responses request names them."""


IN_FLIGHT_MARGIN_S = 60.0
"""How long past the request timeout a streamed response's in-flight record lives (responses/store.py):
the stream's reader waits 30 s past it for a silent replica (request_streams._GRACE_S), and its put
up to STORE_WAIT_S; a record older than that is of a replica that died mid-stream."""


def _in_flight_life_s(launcher) -> float:
    """How long a streamed response may stay in flight: its request's timeout (the route asks for no
    other) and IN_FLIGHT_MARGIN_S."""
    return launcher.config.request_timeout_s + IN_FLIGHT_MARGIN_S


STAND_IN_KEYS = ("role", "name", "tool_call_id")
"""What a message of the new input keeps where _kept_conversation_too_long stands its text in: its
place in the conversation (templates check roles, and a tool message's id), not its text, calls or
thinking."""

STAND_IN_TEXTS = ("x", "y")
"""Two texts for the new input, each rendered in its place: where the two renders part is where the
new input's text starts (not empty text, which some templates refuse for a user turn)."""


def _with_the_new_input_as(messages: list[dict], kept_count: int, text: str) -> list[dict]:
    """The messages with those after the first kept_count (the new input) standing in as `text`: no
    tool calls or thinking. The template renders the kept turns as it does in the whole prompt, new
    input following them (Qwen3's drops the thinking of turns before the last user message, and the
    stand-in user message is still the last)."""
    stand_ins = [{**{key: m[key] for key in STAND_IN_KEYS if key in m}, "content": text} for m in messages[kept_count:]]
    return [*messages[:kept_count], *stand_ins]


async def _rendered_or_none(render, messages: list[dict], *opening) -> list[int] | None:
    """render(messages, *opening) unmeasured, on a thread (what _kept_conversation_too_long renders
    beside the prompt is the kept part, which fitted once, and bare turns); None where the template
    refuses it (empty turns, or turns without their calls)."""
    try:
        return await asyncio.to_thread(render, messages, *opening, False, False)
    except ProtocolError:
        return None


class _KeptTurn:
    """One response of a server that keeps responses (responses/store.py), on its way into the store:
    begun where it is streamed (its id is the client's from response.created on: GET reads it back in
    progress, DELETE forgets it, continuing it is refused as still being generated), kept once
    answered, and abandoned where it fails or the client leaves. A store that fails costs the
    keeping, not the answer: it goes out saying store: false, and the replica's log says why. Begun
    and abandoned without waiting (response_store_server.py: begin_soon, abandon_soon): the first
    event does not wait for a slow store, and a stream whose task is cancelled cannot await."""

    def __init__(self, store, turn: list, previous_id: str | None, life_s: float) -> None:
        self.store, self.turn, self.previous_id, self.life_s = store, turn, previous_id, life_s
        self.open: str | None = None
        """The id begun and neither kept nor abandoned yet."""

    def begin(self, response: dict) -> None:
        self.open = response["id"]
        self.store.begin_soon(response, self.turn, self.previous_id, self.life_s)

    async def keep(self, response: dict) -> None:
        """Put, then no longer open, however the put ends: a shared store that fails it, or whose
        caller is cancelled meanwhile, forgets the response itself (response_store_server.py); a local
        put never waits, so it cannot be cut off. Either way not kept, the response's last event says
        store: false (the put comes before that event is written)."""
        try:
            if not await self.store.put(response, self.turn, self.previous_id):
                response["store"] = False
                SERVER_LOG.info("corelaunch serve: response %s was deleted, forgotten or abandoned before it was kept: "
                                "not kept", response["id"])
        except StoreUnavailable as err:
            response["store"] = False
            SERVER_LOG.warning("corelaunch serve: response %s was answered but not kept: %s", response["id"], err)
        finally:
            self.open = None

    def abandon(self) -> None:
        """Its in-flight record dropped where it was begun and will not be kept (failed, or cut off)."""
        if self.open is not None:
            response_id, self.open = self.open, None
            self.store.abandon_soon(response_id)


INVOCATION_ROUTES = (("messages", "chat_completions"), ("prompt", "completions"), ("input", "responses"))
"""SageMaker's POST /invocations: the route a body goes to, by the first of these keys it holds (vLLM
tries the chat request first too, then the completion; the Responses API is corelaunch's addition)."""


def _invocation_route(raw: bytes) -> str:
    """The route method a POST /invocations body is answered by; a body that is no JSON object goes
    to the chat route, whose parser refuses it in its own words. Only the name is returned: the
    parsed body is not kept while the route answers (the route parses the bytes itself)."""
    try:
        body = parse_json_body(raw)
    except ProtocolError:
        return "chat_completions"
    if not isinstance(body, dict):
        return "chat_completions"
    for key, route in INVOCATION_ROUTES:
        if key in body:
            return route
    raise ProtocolError("an /invocations body must hold messages (a chat completion), prompt (a text completion) "
                        "or input (a response); it holds none of them")


def _replayed(request: Request, raw: bytes) -> Request:
    """`request` again, its body `raw` (already read): the route /invocations hands it to reads it as
    its own; what the client sends later (its disconnect) still arrives."""
    body = [raw]  # handed over once, then not held (the route keeps what it needs)

    async def receive():
        if body:
            return {"type": "http.request", "body": body.pop(), "more_body": False}
        return await request.receive()

    return Request(request.scope, receive)


SANITIZING_MARKS = ("\U000F0000", "\U000F0001")
"""The two code points transformers' sanitize_control_tokens marks text with (dropped from message
text and its measure; refused inside lists and objects of chat_template_kwargs, and where a render
writes them escaped: ESCAPED_MARKS)."""


def _control_pattern(tokenizer, marks: bool = False) -> re.Pattern | None:
    """A pattern of the tokenizer's control tokens (longest first), and of the sanitizing marks with
    `marks`; None when there is nothing to find."""
    parts = [re.escape(token) for token in sorted(tokenizer.added_tokens_encoder, key=len, reverse=True)]
    parts += list(SANITIZING_MARKS) if marks else []
    return re.compile("|".join(parts)) if parts else None


def _refuse_control_tokens_in_nested_values(tokenizer, template_kwargs: dict | None,
                                            where: str = "chat_template_kwargs") -> None:
    """ProtocolError naming a string inside a list or object of chat_template_kwargs that holds a
    control token (or one of the two code points sanitizing marks text with): sanitize_control_tokens
    marks such strings, but a template printing the list or object itself (`{{ value }}`) writes its
    repr, in which the marks become escapes and the control token is encoded as the token itself.
    A top-level string value stays marked, and is taken. `where`: how the refusal names the variables
    (the request's field, or the server's defaults' flag)."""
    nested = [(value, f"{where}.{name}") for name, value in (template_kwargs or {}).items()
              if isinstance(value, (list, dict))]
    if not nested:
        return
    control = _control_pattern(tokenizer, marks=True)
    while nested:
        item, path = nested.pop()
        found = control.search(item) if isinstance(item, str) else None
        if found is not None:
            raise ProtocolError(f"{path} holds {found.group()!r} inside a list or object, which a template printing "
                                f"the value whole would write as the control token itself; send such text as a plain "
                                f"string value, or leave it out", param=path)
        if isinstance(item, dict):
            nested.extend((inner, f"{path}.{key}") for key, inner in item.items())
        elif isinstance(item, list):
            nested.extend((inner, f"{path}.{i}") for i, inner in enumerate(item))


ESCAPED_MARKS = ((r"\U000f0000", r"\udb80\udc00", r"\xf3\xb0\x80\x80"),
                 (r"\U000f0001", r"\udb80\udc01", r"\xf3\xb0\x80\x81"))
"""How the two sanitizing marks (SANITIZING_MARKS: start, end) are spelt once a template prints the
list or object holding a marked string: Python's repr (`{{ tools }}`, `{{ message }}`, `| string`,
`| pprint`), JSON with ensure_ascii (`tojson(ensure_ascii=True)`: a surrogate pair) and the repr of
its UTF-8 bytes. Spelt so, a mark is text, and the control token between two of them reaches the
model as the token itself."""


ESCAPED_START, ESCAPED_END = (re.compile("(?i:" + "|".join(re.escape(spelling) for spelling in spellings) + ")")
                               for spellings in ESCAPED_MARKS)
"""Any spelling of the escaped start mark, and of the end mark."""


def _escaped_marks_pattern(tokenizer) -> re.Pattern | None:
    """A pattern of a control token between an escaped start mark and an escaped end mark (group 1:
    the token), exactly as a printed container writes a marked string's token; None without control
    tokens. Only a token directly between them matches: text a client wrote that merely looks like an
    escape (`\\U000f0000`) is refused only where it would bring a real token about."""
    control = _control_pattern(tokenizer)
    if control is None:
        return None
    return re.compile(f"{ESCAPED_START.pattern}({control.pattern}){ESCAPED_END.pattern}")


def _refuse_control_tokens_written_escaped(tokenizer, marked_prompt: str) -> None:
    """ProtocolError where the marked render (_render_marked) holds a control token between escaped
    marks: the template printed a list or object (the tools, a tool call's arguments, which the
    server hands over as an object, a whole message) without tojson, so a control token inside one
    of its strings would be encoded as the token itself, and the text could forge a turn."""
    if not ESCAPED_START.search(marked_prompt):  # the common case, found without the control tokens' pattern
        return
    pattern = _escaped_marks_pattern(tokenizer)
    found = pattern.search(marked_prompt) if pattern is not None else None
    if found is not None:
        raise ProtocolError(f"messages: the chat template prints a list or object (the tools, a tool call's "
                            f"arguments or a whole message) without tojson, and a string inside it holds the control "
                            f"token {found.group(1)!r}, which the model would read as the token itself, not as "
                            f"text; leave control tokens out of those fields, or use a chat template that prints "
                            f"such values with tojson", param="messages")


RENDER_FLAGS = ("tools", "chat_template", "add_generation_prompt", "continue_final_message")
"""apply_chat_template's own arguments among a render's keyword arguments: the rest are the
template's variables (chat_template_kwargs), which sanitizing marks as it marks messages."""


MARKING_PARAMETERS = ("chat_template", "conversations", "tools", "documents", "template_kwargs", "tokenize",
                      "assistant_mask")
"""The parameters of transformers' _mark_chat_inputs (5.25's) as _render_marked passes them."""


def _marks_chat_inputs(tokenizer) -> bool:
    """Whether the tokenizer's own marking (_mark_chat_inputs: a method of transformers', not its
    public API, which pyproject leaves unpinned) takes what _render_marked passes. Where it does not,
    chats render unmarked as before, and the server says at start that a template printing a list or
    object without tojson can let a control token through."""
    marking = getattr(tokenizer, "_mark_chat_inputs", None)
    if marking is None:
        return False
    try:
        return tuple(inspect.signature(marking).parameters) == MARKING_PARAMETERS
    except (TypeError, ValueError):
        return False


def _render_marked(tokenizer, messages: list[dict], rendering: dict) -> str:
    """The chat's text as the sanitized tokenizing renders it (control tokens inside the messages,
    tools and template variables wrapped in the sanitizing marks), by transformers' own marking
    (where _marks_chat_inputs), so that what the template does with marked text (print it inside a
    container) can be seen. Called
    under the replica's encoding lock and control_tokens_for, as the tokenizing render is."""
    tools = rendering.get("tools")
    template = tokenizer.get_chat_template(rendering.get("chat_template"), tools)
    variables = {name: value for name, value in rendering.items() if name not in RENDER_FLAGS}
    chats, tools, _, variables = tokenizer._mark_chat_inputs(template, [messages], tools, None, variables,
                                                             True, False)
    flags = {name: value for name, value in rendering.items() if name in RENDER_FLAGS}
    return tokenizer.apply_chat_template(chats[0], tokenize=False, **{**flags, **variables,
                                                                       **({"tools": tools} if tools else {})})


def _thinking_split_off(messages: list[dict]) -> list[dict]:
    """The messages with an assistant's thinking, sent inside its content (`<think>...</think>answer`)
    and in no reasoning field, handed to the template as its reasoning, split as Qwen3-style templates
    split it (the thinking before the first `</think>`, after its last `<think>`; the answer after the
    last `</think>`; newlines at the seams dropped). Sanitizing marks those tags as text, and the
    template's own split of the marked content then left the marks' newlines in place
    (`<|im_start|>assistant\n\n\nIt is 4.` where an unsanitized render has one newline)."""
    split = []
    for message in messages:
        content = message.get("content")
        if (message.get("role") != "assistant" or not isinstance(content, str) or THINK_END not in content
                or message.get("reasoning") is not None or message.get("reasoning_content") is not None):
            split.append(message)
            continue
        thinking = content.split(THINK_END)[0].rstrip("\n").split(THINK_START)[-1].lstrip("\n")
        answer = content.split(THINK_END)[-1].lstrip("\n")
        split.append({**message, "content": answer, "reasoning": thinking, "reasoning_content": thinking})
    return split


def _splits_thinking(tokenizer, template: str | None, tools: list[dict] | None) -> bool:
    """Whether sanitizing would mark the `</think>` a template splits assistant content at, its
    thinking then read from reasoning_content (Qwen3's): the tokenizer has it as an added token, and
    the rendering template splits at it and reads reasoning_content. Other templates get messages
    unchanged: one that splits but reads no reasoning_content (DeepSeek-R1's keeps the newlines its
    split leaves) or prints content whole (its thinking would be lost) renders as transformers does."""
    if THINK_END not in tokenizer.added_tokens_encoder:
        return False
    try:
        text = tokenizer.get_chat_template(template, tools)
    except ValueError:  # no template to render with: refused where it renders
        return False
    splits = f"split('{THINK_END}')" in text or f'split("{THINK_END}")' in text
    return splits and "reasoning_content" in text


def _template_defaults_problem(tokenizer, defaults: dict | None, flag: str) -> str | None:
    """Why the server's default template variables (`flag`: --default-chat-template-kwargs, or the
    app's argument) would refuse every chat request, or None: a control token in a key, or inside a
    list or object (the request's own chat_template_kwargs are refused so). Checked at start, where
    the tokenizer is known: the settings' own check has none."""
    if not defaults:
        return None
    try:
        _refuse_control_token_keys(tokenizer, [], None, defaults, where=flag)
        _refuse_control_tokens_in_nested_values(tokenizer, defaults, where=flag)
    except ProtocolError as err:
        return f"{err.message} (as it stands, every chat request would be refused)"
    return None


def _installed_version() -> str:
    """corelaunch's version as installed ("unknown" when run from a tree that was never installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("corelaunch")
    except PackageNotFoundError:
        return "unknown"


SERVER_VERSION = _installed_version()
"""What GET /version answers."""


def _turn_ends(tokenizer, model_config, model_dir) -> frozenset[int]:
    """The ids that end a message in the model's chat: its end-of-sequence ids (config.json's,
    generation_config.json's in model_dir and the tokenizer's, as the Launcher stops at them), which
    chat templates end each turn with (`<|im_end|>`, `<|eot_id|>`: Llama 3 Instruct names its
    <|eot_id|> only in generation_config.json)."""
    ids = set(getattr(model_config, "eos_token_id", None) or ())
    ids.update(generation_eos_ids(model_dir))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _generated_tags(tokenizer, vocab_size: int, tags: tuple[str, ...]) -> tuple[int | None, ...]:
    """Each tag's id where the tokenizer has it as one token the model can generate, else None."""
    vocab = tokenizer.get_vocab()
    return tuple(vocab.get(tag) if vocab.get(tag, vocab_size) < vocab_size else None for tag in tags)


def _reasoning_total(renders: list) -> int | None:
    """The request's reasoning tokens, every choice's summed (as completion_tokens is); None where the
    renders count none (no reasoning parser, or /v1/completions): the usage then has no such field."""
    counts = [render.reasoning_tokens() for render in renders]
    return None if counts[0] is None else sum(counts)


def _refuse_control_token_keys(tokenizer, messages: list[dict], tools: list[dict] | None,
                               template_kwargs: dict | None = None, where: str = "chat_template_kwargs") -> None:
    """ProtocolError naming the object whose key holds one of the tokenizer's control tokens, in the tools,
    a message's tool call arguments or chat_template_kwargs: sanitize_control_tokens marks only strings
    that are values, so a key would be encoded as the control token itself (launcher/serving/tool_calls.py).
    `where`: how the refusal names the template variables (the request's field, or the server's defaults' flag)."""
    holders = [(tool, f"tools.{i}") for i, tool in enumerate(tools or ())]
    holders += [(template_kwargs, where)] if template_kwargs else []
    holders += [(call["function"]["arguments"], f"messages.{i}.tool_calls.{j}.function.arguments")
                for i, message in enumerate(messages) for j, call in enumerate(message.get("tool_calls") or ())]
    control = _control_pattern(tokenizer) if holders else None
    if control is None:
        return
    for value, path in holders:
        found = function_calling.control_token_key(value, path, control)
        if found is not None:
            where, key = found
            raise ProtocolError(f"{where}: the key {proto.clip(key)!r} holds the control token "
                                f"{control.search(key).group()!r}, which the model would read as its own; "
                                f"rename the key", param=where)


async def _from_store(call):
    """The store call's answer; a store that does not answer is a 503 saying so."""
    try:
        return await call
    except StoreUnavailable as err:
        raise ProtocolError(f"{err}; retry later", status=503, type="server_error",
                            code="response_store_unavailable", headers=_RETRY_UNAVAILABLE) from None


def _kept_responses(settings: ServerSettings, shared, most_replicas: int):
    """Where a replica keeps responses (response_store_server.py): the application's shared store
    where build_app bound one, else this process's own; None where none are kept."""
    if not settings.responses_store:
        return None
    if shared is not None:
        return SharedResponses(shared)
    if most_replicas > 1:  # a config file's deployments: entry raised the builder's count
        raise ValueError(f"responses_store ({settings.responses_store}) keeps responses in the replica's own "
                         f"process in an application built for one replica, and this deployment runs up to "
                         f"{most_replicas} (its deployments: entry): a conversation's next turn could reach "
                         f"another replica; set replicas (or max_replicas) to {most_replicas} in the application's "
                         f"args, so that the replicas share one store")
    return LocalResponses(settings.responses_store)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_constructor_retry_count=1,
                  health_check_period_s=HEALTH_CHECK_PERIOD_S)
@serve.ingress(app)
class OpenAIServer:
    """One Serve replica: starts its Launcher in the constructor (so Serve routes to it only once the
    model is loaded) and serves the routes below."""

    tool_call_parser: str | None = None
    """tool_choice "auto" reads calls in this format (tool_calls.PARSER_READERS); None: refused.
    The constructor sets the settings' (ServerSettings.tool_call_parser)."""
    reasoning_parser: str | None = None
    """Chat answers' thinking read in this format (launcher/serving/reasoning.py); None: all content.
    The constructor sets the settings' (ServerSettings.reasoning_parser)."""
    default_chat_template_kwargs: dict | None = None
    """Template variables a chat request gets unless it sends its own (ServerSettings')."""
    trust_request_chat_template: bool = False
    """A request's own chat_template is taken (vLLM's --trust-request-chat-template); False: refused.
    The constructor sets the settings' (ServerSettings.trust_request_chat_template)."""
    server_template: bool = False
    """Chats render with the server's template (--chat-template) in place of the model's, so a
    template's refusal names the server's. The constructor sets it (ServerSettings.chat_template)."""
    think_end: int | None = None
    """With a reasoning parser: the id of the tokenizer's `</think>` token, after which a thinking
    request's structured output starts (None: no such token)."""
    think_start: int | None = None
    """The id of its `<think>` (a prompt whose last `</think>` comes after it has ended the thinking)."""
    call_start: int | None = None
    """The id of its `<tool_call>`, which ends qwen3's thinking too (the usage's reasoning count)."""
    turn_ends: frozenset[int] = frozenset()
    """With a reasoning parser: the ids that end a message (_turn_ends), where a prompt's look for
    a closed thinking stops (openai_protocol._thinking_closed)."""
    stream_interval: int = 1
    """Tokens the engine gathers into each delta of a stream (vLLM's --stream-interval), unless the
    request's own stream_interval asks for more (engine_stream_interval; a whole answer gathers
    WHOLE_ANSWER_INTERVAL). The constructor sets the settings' (ServerSettings.stream_interval)."""
    responses_kept = None
    """The kept responses (launcher/serving/response_store_server.py: put, history, get, input_items, delete), or
    None: the server keeps none (ServerSettings.responses_store 0)."""

    def __init__(self, settings: ServerSettings, shared_responses=None):
        """shared_responses: the handle of the application's ResponseStoreServer, which build_app
        binds where several replicas must share kept responses."""
        from launcher.api import LaunchConfig, Launcher, load_tokenizer, server_tokenizer_problem
        from launcher.background_load import BackgroundLoad
        from launcher.serving.builder_terms import refusals_in_builder_terms
        from launcher.serving.port_rebind import allow_port_rebinding
        from launcher.serving.request_heads import bound_request_heads
        from launcher.serving.serve_deployment import placement_wait_s, this_replicas_facts

        allow_port_rebinding()  # before Serve binds this replica's own server (direct ingress)
        bound_request_heads()  # its connections' heads bounded in size and time
        # Checked first, before the model loads: `serve run` and `serve deploy` read the environment
        # only here, in the replica.
        self.api_key = settings.api_key or api_key_from_environment()
        install_key_check(self._authorize)  # for the routes that do not exist (_http_error)

        # Refusals in the terms the settings came in: `corelaunch serve`'s options, or the builder's
        # arguments (`serve run` / `serve deploy`); the plan below (a CPU share) refuses a layout or
        # a backend's missing devices first
        terms = nullcontext if settings.from_command_line else refusals_in_builder_terms
        launch = dict(settings.launch)
        # Serve's effective options: a config file's deployments: entry may override the builder's
        deployed = this_replicas_facts()
        most_replicas = settings.most_replicas if deployed is None else deployed.most_replicas
        self.responses_kept = _kept_responses(settings, shared_responses, most_replicas)
        if launch.get("cpus_per_rank") is None:
            with terms():
                launch["cpus_per_rank"] = _cpus_per_rank(launch, most_replicas)
        configured_wait = launch.get("placement_timeout_s")
        launch["placement_timeout_s"] = placement_wait_s(
            LaunchConfig.placement_timeout_s if configured_wait is None else configured_wait, deployed)
        with terms():
            self.launcher = Launcher(LaunchConfig(**launch)).prepare()
        no_tokenizer = server_tokenizer_problem(self.launcher.model_dir)
        if no_tokenizer:  # `serve run` or a config file (the CLI refuses it first): before any rank starts
            self.launcher.shutdown()
            raise ValueError(no_tokenizer)
        # This replica's own tokenizer (the same files), never used by the engine's detokenizing of
        # the Launcher's copy: prompts and chat templates (on threads, one at a time) and the
        # logprobs' token texts and offsets (on the request loop). Both copies load on threads while
        # the TP group starts.
        own_tokenizer = BackgroundLoad(load_tokenizer, self.launcher.model_dir, name="corelaunch-serve-tokenizer")
        with terms():
            self.launcher.start()
        if self.launcher.thread_count_note:  # the Launcher's progress notes are off here
            print(f"corelaunch serve: {self.launcher.thread_count_note}", file=sys.stderr)
        # The server's template (--chat-template) in place of the tokenizer's, before anything reads
        # it. The Launcher's copy keeps the files' own: it detokenizes and builds grammars, and never
        # renders a chat.
        self.tokenizer = use_chat_template(own_tokenizer.result(), settings.chat_template)
        self.server_template = settings.chat_template is not None
        defaults_flag = ("--default-chat-template-kwargs" if settings.from_command_line
                         else "default_chat_template_kwargs")
        bad_defaults = _template_defaults_problem(self.tokenizer, settings.default_chat_template_kwargs, defaults_flag)
        if bad_defaults:  # the settings' check knows no tokenizer: refused here, not in every chat's 400
            self.launcher.shutdown()
            raise ValueError(bad_defaults)
        if self.server_template and not settings.from_command_line:  # `corelaunch serve` tried it before Ray
            warning = chat_template_warning(self.tokenizer, settings.chat_template, "the chat_template argument")
            if warning is not None:
                print(f"corelaunch serve: {warning}", file=sys.stderr)
        self.pieces = TokenPieces(self.tokenizer)
        self._longest_token = longest_token_chars(self.tokenizer)  # bounds a prompt by its length
        self._chat_options = _sanitizing(self.tokenizer)  # the installed transformers' own, once
        self._marks_chat_inputs = bool(self._chat_options) and _marks_chat_inputs(self.tokenizer)
        if self._chat_options and not self._marks_chat_inputs:
            print("corelaunch serve: this transformers marks chat inputs otherwise than corelaunch reads them, so a "
                  "chat template that prints a list or object without tojson (the tools, a tool call's arguments) "
                  "can let a control token written inside it through; use transformers 5.25, or templates that "
                  "print such values with tojson", file=sys.stderr)
        if not has_default_chat_template(self.tokenizer):
            print(f"corelaunch serve: the tokenizer of {self.launcher.model_dir} has no chat template: "
                  f"/v1/chat/completions refuses every request (400), and so does /v1/responses; /v1/completions "
                  f"serves prompts; to serve chat, add one to the model (chat_template.jinja, or chat_template "
                  f"in tokenizer_config.json), or give the server one "
                  f"({'--chat-template' if settings.from_command_line else 'the chat_template argument'})",
                  file=sys.stderr)
        if not self._chat_options:
            print("corelaunch serve: this transformers cannot encode control tokens inside chat messages as "
                  "text (apply_chat_template's sanitize_control_tokens, transformers 5.20 and later), so a "
                  "message can write a turn of its own; upgrade transformers to close that", file=sys.stderr)
        # Prompts are tokenized on threads (a long one takes seconds, which on the request loop would
        # stall every stream and /health), one at a time: a tokenizer's settings are not safe to
        # change from two threads at once, and encoding may set them.
        self._encoding = threading.Lock()
        self._text_specials = _special_tokens_around(self.tokenizer)
        """The ids the tokenizer adds before and after a text's own (a BOS): a text prompt cut by
        truncate_prompt_tokens keeps them, as vLLM's truncation inside the tokenizer does."""
        self.name = settings.served_model_name
        self.tool_call_parser = settings.tool_call_parser
        self.reasoning_parser = settings.reasoning_parser
        self.default_chat_template_kwargs = settings.default_chat_template_kwargs
        self.trust_request_chat_template = settings.trust_request_chat_template
        self.stream_interval = settings.stream_interval
        if self.reasoning_parser:
            self.think_start, self.think_end, self.call_start = _generated_tags(  # one look at the vocabulary
                self.tokenizer, self.launcher.model_config.vocab_size, (THINK_START, THINK_END, CALL_START))
            self.turn_ends = _turn_ends(self.tokenizer, self.launcher.model_config, self.launcher.model_dir)
        self.context_tokens = _context_tokens(self.launcher)
        self.longest_prompt = _longest_prompt(self.launcher)
        self.metrics = ServerMetrics(self.launcher.load)
        self.several_replicas = most_replicas > 1
        self.board = None
        if self.several_replicas:  # each scrape shows every replica's series (metrics_board.py)
            from launcher.serving.metrics_board import BoardPoster, board_for

            context = serve.get_replica_context()
            self.board = BoardPoster(board_for(context.app_name), context.replica_tag, self.metrics.render)
        self.body_limit = request_bytes_limit(self.context_tokens, self._longest_token)
        self.bodies = BodyBudget(max(BODY_BYTES_AT_ONCE, 4 * self.body_limit))
        self.created = int(time.time())

    def __del__(self):  # Serve calls it when the replica is stopped
        # Stopped while its constructor still ran (Ctrl-C during the model's load), Serve calls this
        # as the constructor returns and then makes its first health check: the groups are gone by
        # then because they were asked to go, which is no failure to report (it logged a traceback
        # saying every TP group had failed).
        self.stopping = True
        if getattr(self, "board", None) is not None:
            self.board.close()
        launcher = getattr(self, "launcher", None)
        if launcher is not None:
            launcher.shutdown()

    def check_health(self) -> None:
        """Serve's periodic health check: a replica whose TP group is gone for good is replaced."""
        if not getattr(self, "stopping", False) and not self._serving():
            # the failure named here, in Serve's log: it reached only the HTTP clients' 503 bodies
            failures = "; ".join(f"group {r['index']}: {r['failure']}" for r in self.launcher.replica_status()
                                 if r.get("failure"))
            raise RuntimeError(f"every TP group of this replica has failed ({failures or 'no failure recorded'}); "
                               f"Serve will replace the replica")

    def _serving(self) -> bool:
        return any(r.get("state") in ("serving", "restarting") for r in self.launcher.replica_status())

    # ---- routes -------------------------------------------------------------------------------
    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes
    def health(self) -> Response:
        """Open to anyone (probes send no key): with an API key set, the body leaves the model's name
        out, which /v1/models and a model_not_found refusal tell only to a client with the key."""
        named = {} if self.api_key is not None else {"model": self.name}
        if self._serving():
            return JSONResponse({"status": "ok", **named})
        return JSONResponse({"status": "failed", **named}, status_code=503)

    @app.api_route("/ping", methods=["GET", "POST", "HEAD"])  # HEAD: probes, as /health
    def ping(self) -> Response:
        """SageMaker's health probe (vLLM answers it too): /health's answer."""
        return self.health()

    @app.post("/invocations")
    async def invocations(self, request: Request) -> Response:
        """SageMaker's inference route (vLLM's): the body answered by the route its kind names
        (INVOCATION_ROUTES), as if it had been sent there."""
        self._authorize(request)
        raw, held = await self._read_counted(request, self.metrics)
        try:
            route = await self._parsed(raw, held, self.metrics, _invocation_route)
        except ProtocolError:
            self.metrics.rejected(400)
            raise
        replayed = _replayed(request, raw)
        del raw  # the replayed request holds the bytes until the route has read them
        return await getattr(self, route)(replayed)

    @app.get("/version")
    def version(self) -> dict:
        """vLLM's GET /version: the server's own version (no key needed, as /health)."""
        return {"version": SERVER_VERSION}

    @app.get("/metrics")
    def metrics(self) -> Response:
        text = self.board.exposition() if self.board is not None else self.metrics.render()
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    def models(self, request: Request) -> dict:
        self._authorize(request)
        return proto.models_list(self.name, self.created, self.context_tokens)

    @app.get("/v1/models/{model_id:path}")
    def model(self, model_id: str, request: Request) -> dict:
        self._authorize(request)
        if model_id != self.name:
            raise ProtocolError(f"model {proto.clip(model_id)!r} does not exist; this server serves {self.name!r}",
                                param="model", status=404, code="model_not_found")
        return proto.models_list(self.name, self.created, self.context_tokens)["data"][0]

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        arrived = time.perf_counter()
        self._authorize(request)
        req = await self._request(proto.CompletionRequest, request)
        sent = req.prompt_inputs()
        self._refuse_more_sequences_than_rows(req, len(sent), "prompt")  # before tokenizing any of them
        prompts = []
        measured = req.truncate_prompt_tokens is None  # a prompt to truncate may be longer than the context
        if not measured:
            self._truncated(req, [])  # a length the context cannot hold: refused before any tokenizing
        for i, text in enumerate(sent):
            with _naming_prompt(i, len(sent)):
                prompts.append(await self._tokenized(self._encode, text, measured) if isinstance(text, str)
                               else self._known_ids(text))
        whole = [len(prompt) for prompt in prompts]
        prompts = [self._truncated(req, prompt, isinstance(text, str)) for prompt, text in zip(prompts, sent)]
        # echo with logprobs (or vLLM's prompt_logprobs): the prompt scored too, as it is prefilled. A
        # truncated prompt echoes what the model read: its kept tokens, decoded
        scored = req.engine_prompt_logprobs()
        echoes = [await self._tokenized(echoed_prompt, self.pieces, text if len(prompt) == length else prompt, prompt,
                                        req.logprobs is not None)
                  if req.echo else None for text, prompt, length in zip(sent, prompts, whole)]
        # max_tokens 0 (echo only): the engine generates one token, which the render drops
        limits = [max(proto.max_new_tokens(req, len(prompt), self.context_tokens), 1) for prompt in prompts]
        stream = await self._start_choices(req, prompts, limits, req.logprobs, "prompt", scored)
        renders = [CompletionRender(self.pieces, req.logprobs is not None, p * req.n + i, echo,
                                    echo_only=req.max_tokens == 0, prompt_top=req.prompt_logprobs, top_n=req.logprobs,
                                    skip_special_tokens=req.skip_special_tokens,
                                    prompt_ids=stream.prompt_context(p * req.n + i))
                   for p, echo in enumerate(echoes) for i in range(req.n)]
        return await self._respond(req, stream, renders, arrived)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        arrived = time.perf_counter()
        self._authorize(request)
        req = await self._request(proto.ChatCompletionRequest, request)
        stream = await self._chat_choices(req)
        return await self._respond(req, stream, [ChatRender(self.pieces, req.logprobs, i, req.prompt_logprobs,
                                                            req.skip_special_tokens, req.tool_call_reader(),
                                                            req.reasoning(), req.include_reasoning,
                                                            self._usage_think_tokens(),
                                                            prompt_ids=stream.prompt_context(i))
                                                 for i in range(req.n)], arrived)

    @app.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API: the request becomes the chat request it asks for
        (responses_api.chat_body), answered by the chat route's machinery, and the answer is told as
        a Response object, or as the Responses stream's events."""
        arrived = time.perf_counter()
        self._authorize(request)
        req, echo, turn = await self._responses_request(request)
        try:
            stream = await self._chat_choices(req)
        except ProtocolError as err:
            if err.code == CONTEXT_LENGTH_EXCEEDED and err.param == "messages" and echo.previous_response_id:
                raise await self._kept_conversation_too_long(req, echo, err) from None
            raise _as_responses_error(err, echo) from None
        # kept before the client sees it, so its next turn finds it
        keep = None if turn is None else _KeptTurn(self.responses_kept, turn, echo.previous_response_id,
                                                   _in_flight_life_s(self.launcher))
        return await self._respond_responses(req, echo, stream, self._responses_render(req, stream), arrived, keep)

    async def _kept_conversation_too_long(self, req, echo, err: ProtocolError) -> ProtocolError:
        """A continued conversation's prompt that does not fit (`err`, the chat route's refusal, which
        says "shorten the prompt", though most of it may be kept history the client never sends),
        refused naming the kept conversation's tokens and the new input's (request.py:
        conversation_too_long); `err` in the Responses terms where they cannot be counted. Counted
        as rejected already, by the refusal."""
        messages = req.chat_messages(self._template_of(req))
        render = functools.partial(self._apply_chat_template, tools=req.template_tools(),
                                   template_kwargs=req.chat_template_kwargs, template=req.chat_template)
        kept_count = kept_message_count(echo)
        # the kept part fitted the context once (each turn did), so it is rendered unmeasured
        kept_ids = await _rendered_or_none(render, messages[:kept_count], False, False)
        if kept_ids is None:  # a template that refuses the conversation cut there
            return _as_responses_error(err, echo)
        try:
            whole_ids = await asyncio.to_thread(render, messages, req.add_generation_prompt,
                                                req.continue_final_message, False, True)
        except ProtocolError:  # far too long to count (prompt_probe.py)
            whole_ids = None
        opening = (req.add_generation_prompt, req.continue_final_message)

        async def stand_in_renders() -> list[list[int] | None]:  # None where the template refuses one
            return [await _rendered_or_none(render, _with_the_new_input_as(messages, kept_count, text), *opening)
                    for text in STAND_IN_TEXTS]

        prompt, stand_ins = whole_ids, None
        if prompt is None:  # too long to render: the first stand-in takes its place
            stand_ins = await stand_in_renders()
            prompt = stand_ins[0]
        if prompt is not None and common_prefix_length(kept_ids, prompt) >= len(kept_ids) - 1:
            kept = len(kept_ids)  # the prompt starts with the kept render (its last token may merge at the seam)
        else:  # the template renders the kept turns otherwise once input follows (Qwen3's drops their
            # thinking): the kept part ends where the two stand-in renders part
            stand_ins = stand_ins or await stand_in_renders()
            kept = None if None in stand_ins else common_prefix_length(*stand_ins)
        if kept is None:  # the kept part and the new input cannot be told apart: no counts to give
            return _as_responses_error(err, echo)
        whole = None if whole_ids is None else len(whole_ids)
        most, why = self.context_tokens - 1, f"the context holds {self.context_tokens}, one left for the answer"
        if self.longest_prompt is not None and self.longest_prompt < most:
            most, why = self.longest_prompt, "this server's longest prefill shape"
        return conversation_too_long(kept, whole, most, why, bool(echo.instructions))

    def _responses_render(self, req, stream: ChoiceStreams) -> ChatRender:
        """A render of the Responses request's one choice, with a tool-call reader of its own."""
        return ChatRender(self.pieces, logprobs=req.logprobs, index=0, prompt_top=None,
                          skip_special_tokens=req.skip_special_tokens, tool_calls=req.tool_call_reader(),
                          reasoning=req.reasoning(), include_reasoning=req.include_reasoning,
                          think_tokens=self._usage_think_tokens(), prompt_ids=stream.prompt_context(0))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(self, response_id: str, request: Request) -> dict:
        """A kept response, as it was answered (OpenAI's GET /v1/responses/{id}), or one still streaming
        as it started (status in_progress: store.py); 404 for one not kept."""
        self._authorize(request)
        streamed = request.query_params.get("stream", "false").lower() not in ("false", "0")
        if streamed or "starting_after" in request.query_params:
            raise ProtocolError("stream and starting_after are not supported: no response runs in the background, "
                                "so there are no events to replay; GET the response without them",
                                param="stream" if streamed else "starting_after")
        response = await self._ask_kept("get", response_id)
        if response is None:
            raise self._not_kept(response_id)
        return response

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(self, response_id: str, request: Request) -> dict:
        """A page of the items a kept response's request sent as input (OpenAI's GET
        /v1/responses/{id}/input_items: `after`, `limit`, `order`; `include` is taken, the items
        coming back as kept); 404 for a response not kept."""
        self._authorize(request)
        query = request.query_params
        items = await self._ask_kept("input_items", response_id)
        if items is None:
            raise self._not_kept(response_id)
        return responses_api.page(items, query.get("after"), query.get("limit", responses_api.DEFAULT_PAGE),
                                  query.get("order", "desc"))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(self, response_id: str, request: Request) -> dict:
        """OpenAI's POST /v1/responses/{id}/cancel cancels a background response; none runs here."""
        self._authorize(request)
        raise ProtocolError(f"response {proto.clip(response_id)!r} cannot be cancelled: only background responses can "
                            f"be cancelled, and this server runs none in the background (background: true is "
                            f"refused); a streamed response stops when the client closes the stream",
                            param="response_id")

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request) -> dict:
        """Forget a kept response (OpenAI's DELETE /v1/responses/{id}), or one still streaming, which its
        end then does not keep; 404 for one not kept."""
        self._authorize(request)
        if not await self._ask_kept("delete", response_id):
            raise self._not_kept(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def _ask_kept(self, method: str, response_id: str):
        """The kept responses' answer to method(response_id) (get, input_items, delete); None where
        the server keeps none; a 503 where the store does not answer."""
        if self.responses_kept is None:
            return None
        return await _from_store(getattr(self.responses_kept, method)(response_id))

    def _not_kept(self, response_id: str) -> ProtocolError:
        why = responses_api.KEEPS_NONE if self.responses_kept is None else responses_api.NOT_KEPT_WHY
        return ProtocolError(f"no response {proto.clip(response_id)!r} is kept here: {why}", param="response_id",
                             status=404, code="response_not_found")

    async def _chat_choices(self, req) -> ChoiceStreams:
        """A chat request's prompt rendered by the template, measured and truncated, its thinking
        settled, and its choices started (the chat route's and the Responses route's)."""
        self._refuse_more_sequences_than_rows(req, 1, "messages")  # before the template renders a long chat
        if req.truncate_prompt_tokens is not None:
            self._truncated(req, [])  # a length the context cannot hold: refused before any tokenizing
        prompt = await self._tokenized(self._apply_chat_template, req.chat_messages(self._template_of(req)),
                                       req.add_generation_prompt, req.continue_final_message, False,
                                       req.truncate_prompt_tokens is None, req.template_tools(), req.chat_template_kwargs,
                                       req.chat_template)
        if not prompt:
            self.metrics.rejected(400)
            raise _empty_render_refusal(req.chat_template is not None, self.server_template)
        prompt = self._truncated(req, prompt)
        req.settle_thinking(self.think_end, self.think_start, prompt, self.turn_ends)
        return await self._start_choices(req, [prompt], [proto.max_new_tokens(req, len(prompt), self.context_tokens)],
                                         req.logprobs_count(), "messages", req.engine_prompt_logprobs())

    def _usage_think_tokens(self) -> ThinkTokens | None:
        """With a reasoning parser, the tag ids the usage counts the thinking's tokens by (where the
        tokenizer has them); None without one (the usage has no reasoning count)."""
        return ThinkTokens(self.think_start, self.think_end, self.call_start) if self.reasoning_parser else None

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a text's token ids as /v1/completions tokenizes a prompt, or a chat's as
        /v1/chat/completions renders and tokenizes its messages, with the context the count is held
        against. This replica's tokenizer answers on a thread: the engine is never asked (no slot, no
        queue), and it counts in no metric (corelaunch_requests_total counts generation requests)."""
        self._authorize(request)
        req = await self._request(proto.TokenizeRequest, request)
        if isinstance(req, proto.TokenizeChatRequest):
            ids = await asyncio.to_thread(self._apply_chat_template, req.chat_messages(self._template_of(req)),
                                          req.add_generation_prompt, req.continue_final_message,
                                          req.add_special_tokens, True, req.template_tools(), req.chat_template_kwargs,
                                          req.chat_template)
        else:
            ids = await asyncio.to_thread(self._tokenize_text, req.prompt, req.add_special_tokens)
        answer = {"count": len(ids), "max_model_len": self.context_tokens, "tokens": ids}
        if req.return_token_strs:
            answer["token_strs"] = await asyncio.to_thread(self._token_strings, ids)
        return JSONResponse(answer)

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: token ids as text, decoded as vLLM decodes them (special tokens kept);
        ids outside the vocabulary are refused (400) as a completions prompt's are. No engine, no
        metric (see tokenize)."""
        self._authorize(request)
        req = await self._request(proto.DetokenizeRequest, request)
        return JSONResponse({"prompt": await asyncio.to_thread(self._decode, req.tokens)})

    # ---- request plumbing ---------------------------------------------------------------------
    async def _tokenized(self, tokenize, *args) -> list[int]:
        """tokenize(*args) on a thread; its refusal counted as a rejected request, a client that
        left meanwhile as an abort."""
        try:
            return await asyncio.to_thread(tokenize, *args)
        except ProtocolError:
            self.metrics.rejected(400)
            raise
        except asyncio.CancelledError:
            self.metrics.finished("abort", 499)
            raise

    def _truncated(self, req, prompt: list[int], text: bool = False) -> list[int]:
        """The prompt cut to the request's truncate_prompt_tokens (vLLM's: its last k tokens), before
        any length check; a refusal (k past the context) counted as a rejected request. text: a text
        prompt, whose special tokens added around it (a BOS) stay and whose own tokens fill the rest,
        as vLLM's tokenizer-side truncation keeps them (a token-id prompt is cut as sent)."""
        before, after = self._text_specials if text else ([], [])
        wrapped = (len(prompt) >= len(before) + len(after) and prompt[:len(before)] == before
                   and prompt[len(prompt) - len(after):] == after)
        if not wrapped:
            before, after = [], []
        try:
            own = req.truncated(prompt[len(before):len(prompt) - len(after)], self.context_tokens,
                                reserved=len(before) + len(after))
        except ProtocolError:
            self.metrics.rejected(400)
            raise
        return before + own + after

    def _known_ids(self, prompt: list[int]) -> list[int]:
        """A token-id prompt whose ids are all in the vocabulary (400 naming the others), checked before
        anything decodes them (an echo's decoder overflowed on an id of 2**32)."""
        refusal = _outside_vocabulary(prompt, self.launcher.model_config.vocab_size, "prompt")
        if refusal is not None:
            self.metrics.rejected(400)
            raise refusal
        return prompt

    def _encode(self, text: str, measured: bool = True) -> list[int]:
        """A completions prompt's token ids (on a thread), as the Launcher tokenizes text. measured
        False (truncate_prompt_tokens): a text longer than the context is tokenized whole, not refused
        (the body limit bounds it), since only its last tokens are kept."""
        ids = self._tokenize_text(text, measured=measured)
        if not ids:
            raise ProtocolError("prompt is empty (it has no tokens); send at least one character", param="prompt")
        return ids

    def _tokenize_text(self, text: str, special_tokens: bool = True, measured: bool = True) -> list[int]:
        """A text's token ids (on a thread): a completions prompt's, and /tokenize's (which takes an
        empty text, and add_special_tokens: `special_tokens`). A text that cannot fit the context is
        refused from its head or its length (_refuse_if_it_cannot_fit) on /tokenize too (vLLM's own
        check refuses anything past its context): tokenizing megabytes whole would hold every other
        prompt's tokenizing (the lock) for seconds (README: 15.7 s for 10 MB). One that merely exceeds
        the context is counted, so a client can compare the count with max_model_len. measured False:
        no such refusal (a prompt to be truncated, _encode)."""
        proto.check_utf8(text, "prompt")
        if measured:
            self._refuse_if_it_cannot_fit(text, "the prompt", "prompt", special_tokens)
        with self._encoding:
            return list(self.tokenizer(text, add_special_tokens=special_tokens)["input_ids"])

    def _decode(self, ids: list[int]) -> str:
        """/detokenize's text (on a thread): the ids checked against the vocabulary first."""
        refusal = _outside_vocabulary(ids, self.launcher.model_config.vocab_size, "tokens")
        if refusal is not None:
            raise refusal
        with self._encoding:  # the tokenizer is not to be read while another thread changes its settings
            return self.tokenizer.decode(ids)

    def _token_strings(self, ids: list[int]) -> list[str]:
        """/tokenize's token_strs (on a thread): each id's vocabulary entry, as vLLM lists them."""
        with self._encoding:
            return list(self.tokenizer.convert_ids_to_tokens(ids))

    def _refuse_if_it_cannot_fit(self, text: str, what: str, param: str, special_tokens: bool = True) -> None:
        """400 for a text that cannot fit the context, told without tokenizing it whole
        (prompt_probe.py): by its length, then by its head's tokens. special_tokens: whether the text
        is tokenized with the tokenizer's own additions (a BOS token), as a completions prompt is."""
        if length_overfills(text, self.context_tokens, self._longest_token):
            raise ProtocolError(too_many_characters_message(what, text, self.context_tokens, self._longest_token),
                                param=param, code=CONTEXT_LENGTH_EXCEEDED)
        with self._encoding:
            head = head_overfills(lambda head_text: self._count_tokens(head_text, special_tokens), text,
                                  self.context_tokens)
        if head is not None:
            raise ProtocolError(too_long_message(what, head, self.context_tokens), param=param,
                                code=CONTEXT_LENGTH_EXCEEDED)

    def _count_tokens(self, text: str, special_tokens: bool = True) -> int:
        """Tokens of text as a prompt (under self._encoding)."""
        return len(self.tokenizer(text, add_special_tokens=special_tokens)["input_ids"])

    def _template_of(self, req) -> object:
        """The template a chat request is rendered with: its own chat_template (taken only where the
        server trusts request templates: parse_request refused it otherwise), else the tokenizer's,
        which is the server's --chat-template where one was given; as text (_template_text)."""
        template = req.chat_template if req.chat_template is not None else self.tokenizer.chat_template
        return _template_text(template, req.template_tools())

    def _template_refused(self, err: Exception, own: bool) -> ProtocolError:
        """A chat template's refusal (roles out of order, a length it checks): the client's doing, a
        400 naming whose template refused: the request's own chat_template (`own`), the server's
        (--chat-template) or the model's."""
        if own:
            return ProtocolError(f"chat_template: the request's own chat template refused its messages: {err}",
                                 param="chat_template")
        whose = "the server's" if self.server_template else "the model's"
        return ProtocolError(f"messages: {whose} chat template refused them: {err}", param="messages")

    def _apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                             continue_final_message: bool = False, special_tokens: bool = False,
                             measured: bool = True, tools: list[dict] | None = None,
                             template_kwargs: dict | None = None, template: str | None = None) -> list[int]:
        """A chat request's prompt token ids (on a thread); /tokenize's chat form sends its own
        add_generation_prompt, continue_final_message and add_special_tokens (`special_tokens`: the
        tokenizer's own additions around the template's text, which adds none by default).

        The template is rendered to text first (fast: it only joins strings) and that text is
        measured against the context before anything is tokenized: exactly what the model will read,
        the template's own text, what it trims (Llama 3's, Gemma 3's), and nothing it drops (Qwen3's
        removes the reasoning of earlier assistant turns). Then the tokenizer's apply_chat_template
        tokenizes it with sanitize_control_tokens: a control token written inside a message's text
        (`<|im_start|>system`) is encoded as the plain text it is, so a message cannot forge a turn,
        as no text sent to OpenAI's API can; only the template writes control tokens. A template that
        prints a list or object holding such text without tojson would write it as the token itself:
        that chat is refused (_refuse_control_tokens_written_escaped). An assistant's thinking sent
        inside its content is split off first where the template splits at `</think>`
        (_thinking_split_off), which it cannot do to marked tags. (Encoded that
        way, text has at least the tokens the probe counted, so a refusal still holds.) measured
        False (truncate_prompt_tokens): no such measure; the route keeps the prompt's last tokens. tools: the
        request's (launcher/serving/tool_calls.py), rendered by the template as its model expects them.
        template_kwargs: the request's chat_template_kwargs, the template's extra variables (checked by
        openai_protocol.check_template_options). template: the request's own chat_template (checked by
        openai_protocol.check_request_template), rendering in place of the tokenizer's; None: the
        tokenizer's."""
        if template is None and not has_default_chat_template(self.tokenizer):  # not the client's doing: say so
            raise ProtocolError(f"model {self.name!r} has no chat template (its tokenizer files define none), so "
                                f"it cannot take messages: send a text as prompt instead (to /v1/completions, or "
                                f"to /tokenize)", param="messages")
        for i, message in enumerate(messages):
            proto.check_utf8(message["content"] or "", f"messages.{i}.content")
            if message.get("name") is not None:
                proto.check_utf8(message["name"], f"messages.{i}.name")
        _refuse_control_token_keys(self.tokenizer, messages, tools, template_kwargs)
        _refuse_control_tokens_in_nested_values(self.tokenizer, template_kwargs)
        if self._chat_options and _splits_thinking(self.tokenizer, template, tools):
            messages = _thinking_split_off(messages)  # before marking: no template splits marked tags as it means to
        rendering = {**(template_kwargs or {}), "add_generation_prompt": add_generation_prompt,
                     "continue_final_message": continue_final_message, **({"tools": tools} if tools else {}),
                     **({"chat_template": template} if template is not None else {})}
        try:
            with self._encoding, control_tokens_for(self.tokenizer, template):
                # sanitizing: rendered marked, as it will be tokenized, to see where the template printed marks
                prompt = (_render_marked(self.tokenizer, messages, rendering) if self._marks_chat_inputs
                          else self.tokenizer.apply_chat_template(messages, tokenize=False, **rendering))
        except Exception as err:  # noqa: BLE001 - a template's refusal (e.g. roles out of order) is the client's
            raise self._template_refused(err, template is not None) from None
        if self._chat_options:
            _refuse_control_tokens_written_escaped(self.tokenizer, prompt)
            # the marks are no text the model reads: the measure drops them (9000 refused a short chat)
            prompt = prompt.translate(dict.fromkeys(map(ord, SANITIZING_MARKS)))
        if measured:
            self._refuse_if_it_cannot_fit(prompt, "the chat prompt (the messages in the model's chat template)",
                                          "messages", special_tokens=False)
        # Rendered again to tokenize: sanitizing needs apply_chat_template to tokenize itself, and
        # rendering only joins strings (0.05 s for 10 MB).
        try:
            with self._encoding, control_tokens_for(self.tokenizer, template):
                ids = list(self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **rendering,
                                                              **self._chat_options))
                if not special_tokens:
                    return ids
                before, after = self._text_specials
                return before + ids + after
        except ValueError as err:  # sanitizing refuses text that would encode to a control token anyway
            raise ProtocolError(f"messages: their text cannot be encoded without control tokens: {err}",
                                param="messages") from None
        except Exception as err:  # noqa: BLE001 - the template refused the marked text (a length it checks)
            raise self._template_refused(err, template is not None) from None

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ProtocolError("missing or wrong API key: send the header `Authorization: Bearer <key>` with the "
                                "key the server was started with (`corelaunch serve --api-key`, the app's `api_key` "
                                "argument, or CORELAUNCH_API_KEY)",
                                status=401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _counts(self, model):
        """Where refusals and aborts of a request parsed as `model` are counted: the server's metrics
        for a generation request, nowhere for /tokenize's and /detokenize's."""
        return self.metrics if proto.is_generation_request(model) else _UNCOUNTED

    async def _request(self, model, request: Request):
        """The request's body read, parsed as JSON and checked as `model`; a body of more than
        PARSED_ON_A_THREAD bytes is parsed and checked on a thread (a 5 MB one held the event loop,
        and with it every stream and /health, for seconds), and so is one whose own chat_template a
        trusting server compiles (a 62 KB template took 0.65 s), or one that asks_for_structure
        (llguidance checks its grammar); a client gone meanwhile counted as an abort."""
        counts = self._counts(model)
        raw, held = await self._read_counted(request, counts)
        # a request's own template is compiled as it is checked: a 62 KB one took 0.65 s
        compiles = self.trust_request_chat_template and b'"chat_template"' in raw
        large = len(raw) > PARSED_ON_A_THREAD
        try:  # the body's budget held until the request is parsed whole
            body = await self._off_loop(large, counts, self._json, raw, counts)
            return await self._off_loop(large or compiles or asks_for_structure(body), counts, self._parse, model,
                                        body)
        finally:
            self.bodies.give(held)

    async def _parsed(self, raw: bytes, held: int, counts, parse):
        """parse(raw), on a thread for a body of more than PARSED_ON_A_THREAD bytes (a 5 MB one held
        the event loop, and with it every stream and /health, for seconds); a client gone while it was
        parsed on a thread counted as an abort (uncounted otherwise); the body's budget (`held`) given
        back either way."""
        try:
            return await self._off_loop(len(raw) > PARSED_ON_A_THREAD, counts, parse, raw)
        finally:
            self.bodies.give(held)

    @staticmethod
    async def _off_loop(on_thread: bool, counts, work, *args):
        """work(*args), on a thread where on_thread; a client gone meanwhile counted in `counts` as an
        abort."""
        try:
            if not on_thread:
                return work(*args)
            return await asyncio.to_thread(work, *args)
        except asyncio.CancelledError:
            counts.finished("abort", 499)
            raise

    async def _read_counted(self, request: Request, counts) -> tuple[bytes, int]:
        """_read_body's (body, budget held), a refusal counted in `counts` (_counts), and a client gone
        before its body came whole (Serve cancels the request, or the read sees the disconnect)
        counted as every client that leaves."""
        try:
            return await _read_body(request, self.body_limit, self.bodies)
        except ProtocolError as err:
            counts.rejected(err.status)
            raise
        except CLIENT_GONE:
            counts.finished("abort", 499)
            raise

    async def _responses_request(self, request: Request):
        """A /v1/responses body read as _request reads a body, the conversation its
        previous_response_id continues read from the kept responses, then turned into the chat
        request it asks for (responses_api.chat_body), which the chat parser checks; (that request,
        the echo, the request's own input items where its response is to be kept, else None)."""
        raw, held = await self._read_counted(request, self.metrics)
        large = len(raw) > PARSED_ON_A_THREAD
        try:  # the body's budget held until the request is parsed whole
            body = await self._off_loop(large, self.metrics, self._json, raw, self.metrics)
            history = await self._kept_history(body)
            # a long kept history is parsed off the event loop too, as a large body is
            return await self._off_loop(large or history is not None or asks_for_structure(body), self.metrics,
                                        self._parse_responses, body, history)
        finally:
            self.bodies.give(held)

    async def _kept_history(self, body) -> list | None:
        """The items of the conversation body's previous_response_id continues, first turn first;
        None without one (or where the server keeps no responses: chat_body refuses it then)."""
        if self.responses_kept is None or not isinstance(body, dict) or body.get("previous_response_id") is None:
            return None
        try:
            response_id = responses_api.previous_response_id(body, keeping=True)
        except ProtocolError:
            self.metrics.rejected(400)
            raise
        try:
            items, missing = await _from_store(self.responses_kept.history(response_id))
            # not kept yet, or not at all: asked only then (one round trip more to a shared store)
            in_flight = items is None and missing == response_id and \
                await _from_store(self.responses_kept.generating(response_id))
        except asyncio.CancelledError:  # the client left meanwhile
            self.metrics.finished("abort", 499)
            raise
        except ProtocolError:  # the shared store did not answer (503): no fault of the request's
            self.metrics.rejected(503, reason="unavailable")
            raise
        if in_flight:
            self.metrics.rejected(400)
            raise ProtocolError(f"previous_response_id: the response {proto.clip(response_id)!r} cannot be continued "
                                f"yet: {STILL_GENERATING}", param="previous_response_id",
                                code="previous_response_in_progress")
        if items is None:
            self.metrics.rejected(400)
            earlier = "" if missing == response_id else f" (it continued {proto.clip(missing)!r}, which is not)"
            raise ProtocolError(f"previous_response_id: the response {proto.clip(response_id)!r} is not kept here"
                                f"{earlier}: {responses_api.NOT_KEPT_WHY}; send the conversation's turns in input "
                                f"instead", param="previous_response_id", code="previous_response_not_found")
        return items

    def _parse_responses(self, body, history: list | None):
        """(the chat request, the echo, the turn's input items in the listed shape where the response
        is to be kept, else None)."""
        try:
            chat, echo = responses_api.chat_body(body, history, keeping=self.responses_kept is not None)
        except ProtocolError:
            self.metrics.rejected(400)
            raise
        try:
            req = self._parse(proto.ChatCompletionRequest, chat)
        except ProtocolError as err:  # counted by _parse
            raise _as_responses_error(err, echo) from None
        return req, echo, responses_api.listed(responses_api.turn_items(body)) if echo.store else None

    def _json(self, raw: bytes, counts):
        """The body's JSON; a refusal counted in `counts` (_counts)."""
        try:
            return parse_json_body(raw)
        except ProtocolError as err:
            counts.rejected(err.status)
            raise

    def _parse(self, model, body):
        counts = self._counts(model)
        try:
            req = proto.parse_request(model, body, self.tool_call_parser, self.reasoning_parser,
                                      self.default_chat_template_kwargs, self.trust_request_chat_template)
        except ProtocolError:
            counts.rejected(400)
            raise
        if req.model != self.name:
            counts.rejected(404)
            raise ProtocolError(f"model {proto.clip(req.model)!r} does not exist; this server serves {self.name!r} "
                                f"(GET /v1/models lists it)", param="model", status=404, code="model_not_found")
        return req

    def _refuse_more_sequences_than_rows(self, req, prompt_count: int, prompt_param: str) -> None:
        """400 (counted) for a request of more sequences (prompt_count prompts of `n` choices each)
        than the engine runs at once: they could never run together, and a queue of them only delays
        the others. Checked as soon as the body is parsed, before any prompt is tokenized or any
        template rendered (200,000 one-character prompts were tokenized for 117 s, and 1.5 million
        token-id prompts held the event loop for 11 s, before this refusal): the completions route
        checks its prompts, and _chat_choices (chat and Responses) its one, before _start_choices; a
        new route calls it too."""
        rows = self.launcher.config.max_num_seqs
        if prompt_count * req.n <= rows:
            return
        self.metrics.rejected(400)
        if prompt_count == 1:
            raise ProtocolError(f"n ({req.n}) is more than this server runs at once (max_num_seqs {rows}): each "
                                f"choice takes a sequence slot; ask for at most {rows} choices per request",
                                param="n")
        raise ProtocolError(f"{prompt_count} prompts of n ({req.n}) choices each are {prompt_count * req.n} "
                            f"sequences, more than this server runs at once (max_num_seqs {rows}): each takes a "
                            f"sequence slot; send at most {rows} prompts x n per request (the rest in another)",
                            param=prompt_param)

    async def _start_choices(self, req, prompts: list[list[int]], max_tokens: list[int], logprobs: int | None,
                             prompt_param: str, prompt_logprobs: int | None = None) -> ChoiceStreams:
        """The engine's streams of the request's `n` choices of each prompt (prompt by prompt), all
        admitted or none: one refused (a full queue) closes those started before it, which cancels them."""
        for prompt, limit in zip(prompts, max_tokens):  # one limit for every prompt of a completions request
            if req.min_tokens > limit:  # said in the API's words (the engine says max_new_tokens)
                self.metrics.rejected(400)
                raise ProtocolError(_min_tokens_past_the_limit(req, limit, len(prompt)), param="min_tokens")
        sampling = req.sampling()
        try:  # off the event loop: llguidance compiling a large schema to check it takes seconds, and
            # tokenizing a long bad_words list a tenth of one
            if sampling.structured_output is not None or sampling.bad_words:
                await self.launcher.acheck_structured(sampling)
        except ValueError as err:
            self.metrics.rejected(400)
            raise ProtocolError(str(err), param=_refused_param(str(err), req, prompt_param)) from None
        except LaunchError as err:  # not running: the check reaches the launcher before any stream does
            raise _refused_unavailable(self.metrics, err) from None
        except asyncio.CancelledError:  # the client left while a large grammar compiled: counted as every abort
            self.metrics.finished("abort", 499)
            raise
        streams = []
        try:
            for i, (prompt, limit) in enumerate(zip(prompts, max_tokens)):
                with _naming_prompt(i, len(prompts)):
                    for index in range(req.n):
                        streams.append(self._start(req, prompt, limit, logprobs, prompt_param,
                                                   req.choice_sampling(index), prompt_logprobs,
                                                   req.engine_stream_interval(self.stream_interval, limit)))
        except BaseException:
            await ChoiceStreams(streams).aclose()
            raise
        choices = ChoiceStreams(streams, [len(prompt) for prompt in prompts], req.n,
                                self.metrics.cached_prompt_tokens.inc)
        # admitted: counted whatever happens next, once for all choices
        self.metrics.prompt_tokens.inc(choices.prompt_tokens)
        return choices

    def _start(self, req, prompt: list[int], max_tokens: int, logprobs: int | None, prompt_param: str, sampling,
               prompt_logprobs: int | None = None, stream_interval: int = 1):
        """The engine's stream for one choice of this request, each delta gathering up to
        stream_interval tokens (req.engine_stream_interval); ProtocolError 400 for input the engine
        refuses (its message names the lengths or values; nearly always the prompt's, so
        `prompt_param` is the error's param), 503 with Retry-After when its queue is full."""
        from shardlib.request_checks import check_fits

        # The engine checks this too, in its own words (max_new_tokens): here it is said in the API's.
        limit = req.limit_sent() or "max_tokens"
        if len(prompt) >= self.context_tokens:  # no room left whatever the limit (which may not have been sent)
            self.metrics.rejected(400)
            raise ProtocolError(f"the prompt has {len(prompt)} tokens and the context holds {self.context_tokens}, "
                                f"leaving no room for a generated token{_ECHO_ONLY_NEEDS_ONE if req.max_tokens == 0 else ''}; "
                                f"shorten the prompt", param=prompt_param,
                                code=CONTEXT_LENGTH_EXCEEDED)
        if self.longest_prompt is not None and len(prompt) > self.longest_prompt:
            # the engine refused it too, as a 400 without a code, and with an operator's fix
            # (compile again with larger buckets) that no API client can apply
            self.metrics.rejected(400)
            raise ProtocolError(f"the prompt has {len(prompt)} tokens and this server takes prompts of at most "
                                f"{self.longest_prompt} (its longest prefill shape; the context holds "
                                f"{self.context_tokens}); shorten the prompt", param=prompt_param,
                                code=CONTEXT_LENGTH_EXCEEDED)
        try:
            check_fits([prompt], max_tokens, self.context_tokens, "the context", new_tokens_name=limit)
        except ValueError as err:
            self.metrics.rejected(400)
            raise ProtocolError(str(err), param=limit, code=CONTEXT_LENGTH_EXCEEDED) from None

        try:
            stream = self.launcher.astream(prompt, sampling, max_new_tokens=max_tokens,
                                           stop_token_ids=tuple(req.stop_token_ids), stop=tuple(req.stop_strings()),
                                           ignore_eos=req.ignore_eos, logprobs=logprobs,
                                           prompt_logprobs=prompt_logprobs, cache_salt=req.cache_salt,
                                           include_stop_str_in_output=req.include_stop_str_in_output,
                                           skip_special_tokens=req.skip_special_tokens,
                                           stream_interval=stream_interval)
            return stream
        except ValueError as err:
            self.metrics.rejected(400)
            raise ProtocolError(_as_one_prompt(str(err)), param=_refused_param(str(err), req, prompt_param)) from None
        except queue_full_type() as err:
            self.metrics.rejected(503)
            retry = max(1, math.ceil(getattr(err, "retry_after_s", 1.0)))
            raise ProtocolError(_at_capacity(err, retry, self.several_replicas), status=503,
                                type="server_error", code="queue_full", headers={"Retry-After": str(retry)}) from None
        except LaunchError as err:  # no replica left serving (Serve replaces this one), or shutting down
            raise _refused_unavailable(self.metrics, err) from None

    async def _respond(self, req, stream: ChoiceStreams, renders: list, arrived: float) -> Response:
        """The response of the request's choices (renders[i] renders choice i; each choice's tokens
        are timed as a stream of their own)."""
        meta = proto.ResponseMeta.new(renders[0].id_prefix, self.name)
        timers = [TokenTimer(self.metrics, arrived) for _ in renders]
        if req.stream:
            outcome = {"finish_reason": "abort"}  # a client that leaves before the end, even before the first event
            events = self._events(stream, renders, meta, timers, req.include_usage(), outcome,
                                  req.continuous_usage())
            return self._event_stream(events, stream, outcome)
        collected = await self._collected(stream, renders, timers)
        if isinstance(collected, JSONResponse):
            return collected
        finish, completion_tokens = collected
        choices = [render.choice(reason) for render, reason in zip(renders, finish)]
        return JSONResponse({**proto.response(meta, renders[0].response_object, choices,
                                              proto.usage(stream.prompt_tokens, sum(completion_tokens),
                                                          stream.cached_tokens, _reasoning_total(renders))),
                             **renders[0].response_extras()})

    async def _collected(self, stream: ChoiceStreams, renders: list, timers: list[TokenTimer],
                         token_limit: str = CHAT_TOKEN_LIMITS):
        """Every choice's deltas collected by its render, for an answer not streamed: (each choice's
        finish reason, each choice's completion tokens), the request counted by its first choice's
        ending; or, where generating failed, the error's response (counted too)."""
        finish, completion_tokens = [None] * len(renders), [0] * len(renders)
        try:
            async with aclosing(stream):
                async for index, delta in stream:
                    timers[index].tokens(renders[index].new_tokens(delta), time.perf_counter())
                    renders[index].collect(delta)
                    finish[index] = delta.finish_reason or finish[index]
                    completion_tokens[index] = renders[index].completion_tokens(delta)
        except asyncio.CancelledError:  # the client went away: aclosing has cancelled the request
            self.metrics.finished("abort", 499)
            raise
        except Exception as err:  # noqa: BLE001 - reported to the client in the OpenAI shape
            # no response id: the client of an answer not streamed never learns it
            status, body, headers = _generation_failed(err, None, completion_tokens, finish, token_limit)
            self.metrics.finished(failure_reason(status), status)
            return JSONResponse(body, status_code=status, headers=headers)
        # one request, counted by its first choice's finish reason as the engine gave it (stop or length;
        # an echo-only completion's is length): a chat client told "tool_calls" is counted by the engine's
        # (openai_render.py, ChatRender._sent_finish)
        self.metrics.finished(renders[0].finish_reason(finish[0]) or "stop")
        return finish, completion_tokens

    async def _respond_responses(self, req, echo, stream: ChoiceStreams, render: ChatRender, arrived: float,
                                 keep) -> Response:
        """A Response object, or the Responses stream's events (responses_api.ResponseEvents), for the
        chat request's one choice; its tokens timed and its ending counted as a chat request's.
        keep: the response's _KeptTurn (None: not kept); a streamed one is begun as it starts."""
        response_id, created, timer = responses_api.item_id("resp"), int(time.time()), TokenTimer(self.metrics, arrived)
        if req.stream:
            outcome = {"finish_reason": "abort"}  # a client that leaves before the end
            # a second render reads the whole answer at its end, as an answer not streamed is read
            events = self._response_events(stream, render, timer, outcome,
                                           responses_api.ResponseEvents(response_id, created, self.name, echo), keep,
                                           self._responses_render(req, stream))
            return self._event_stream(events, stream, outcome)
        collected = await self._collected(stream, [render], [timer], RESPONSES_TOKEN_LIMIT)
        if isinstance(collected, JSONResponse):
            return collected
        [finish], [completion_tokens] = collected
        choice = render.choice(finish)
        items, status, incomplete = _whole_output(choice)
        usage = _responses_usage(stream, completion_tokens, render)
        response = responses_api.response_object(response_id, created, self.name, echo, items, status, usage,
                                                 incomplete)
        if keep is not None:  # no gap to close: the client learns its id from this answer, once kept
            await keep.keep(response)
        return JSONResponse(response)

    async def _response_events(self, stream: ChoiceStreams, render: ChatRender, timer: TokenTimer, outcome: dict,
                               events, keep, whole: ChatRender):
        """The Responses stream of one request: the chat route's chunks for its one choice, told as
        `events` (a ResponseEvents) tells them, ending with response.completed (or .incomplete, or an
        error event and response.failed); outcome["finish_reason"] as _events sets it. keep (a
        _KeptTurn, or None) is begun with the response as created before its event goes out, kept
        with the final Response object before its event goes out (failing, the stream ends with
        response.failed instead), and abandoned where it ends otherwise. `whole` collects every delta
        too: the final response's items are the whole answer's, read at the end as an answer not
        streamed is (a reader that reads pieces cannot take back what it streamed: a call the length
        limit cut turns the calls before it to text in the whole answer too), so the final event and
        the kept turn equal that answer."""
        completion_tokens, sent_finish, engine_finish = 0, None, None
        try:
            async with aclosing(stream):
                opening = events.opening()
                if keep is not None:
                    keep.begin(opening[0]["response"])
                for event in opening:
                    yield responses_api.sse(event)
                async for _, delta in stream:
                    timer.tokens(render.new_tokens(delta), time.perf_counter())
                    completion_tokens = render.completion_tokens(delta)
                    whole.collect(delta)
                    for message, logprobs in render.messages(delta):
                        for event in events.delta(message, logprobs):
                            yield responses_api.sse(event)
                    if delta.finish_reason:
                        engine_finish = delta.finish_reason
                        sent_finish = outcome["finish_reason"] = render.finish_reason(delta.finish_reason)
            items, _, _ = _whole_output(whole.choice(engine_finish))
            finished = events.finish(sent_finish, _responses_usage(stream, completion_tokens, render), items)
            if keep is not None:
                await keep.keep(finished[-1]["response"])
            for event in finished:
                yield responses_api.sse(event)
        except Exception as err:  # noqa: BLE001 - headers are sent: the error can only be an event
            outcome["status"], body, _ = _generation_failed(err, events.response_id, [completion_tokens],
                                                            [sent_finish], RESPONSES_TOKEN_LIMIT)
            outcome["finish_reason"] = failure_reason(outcome["status"])
            for event in events.failed(body["error"]):
                yield responses_api.sse(event)
        finally:  # failed, or the client left (its task maybe cancelled: nothing awaited here)
            if keep is not None:
                keep.abandon()

    def _event_stream(self, events, stream: ChoiceStreams, outcome: dict) -> Response:
        """The server-sent events of a streamed answer; closing it closes the engine's streams and
        counts the request by outcome["finish_reason"]."""
        return _ClosingStreamingResponse(events, stream, lambda: self._count_stream(outcome),
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def _count_stream(self, outcome: dict) -> None:
        reason = outcome["finish_reason"]  # an error's status is set with it (_generation_failure)
        self.metrics.finished(reason, outcome.get("status") or (499 if reason == "abort" else 200))

    async def _events(self, stream: ChoiceStreams, renders: list, meta, timers: list[TokenTimer],
                      include_usage: bool, outcome: dict, continuous_usage: bool = False):
        """The server-sent events of one streamed request, its choices' chunks in the order their
        tokens come, ending with [DONE]; outcome["finish_reason"] is set to how it ended (choice 0's
        ending, once every choice has ended; the response counts it once closed)."""
        completion_tokens, endings = [0] * len(renders), [None] * len(renders)

        # with include_usage every chunk carries "usage": null but the last, which has the counts;
        # with continuous_usage_stats too, each carries its choice's counts so far (vLLM's)
        plain_usage = {"usage": None} if include_usage else {}

        def usage_field(index: int) -> dict:
            if continuous_usage:
                return {"usage": proto.chunk_usage(stream.choice_prompt_tokens(index), completion_tokens[index],
                                                   renders[index].reasoning_tokens())}
            return plain_usage

        try:
            async with aclosing(stream):
                for index, render in enumerate(renders):
                    for chunk in render.opening(meta):
                        yield proto.sse_event({**chunk, **usage_field(index)})
                async for index, delta in stream:
                    timers[index].tokens(renders[index].new_tokens(delta), time.perf_counter())
                    completion_tokens[index] = renders[index].completion_tokens(delta)
                    chunk = renders[index].chunk(meta, delta)
                    if chunk is not None:
                        yield proto.sse_event({**chunk, **usage_field(index)})
                    if delta.finish_reason:
                        endings[index] = renders[index].finish_reason(delta.finish_reason)
                        if all(endings):  # a client gone before the last choice ended is an abort
                            outcome["finish_reason"] = endings[0]
            if include_usage:
                yield proto.sse_event(proto.usage_chunk(meta, renders[0].chunk_object,
                                                        proto.usage(stream.prompt_tokens, sum(completion_tokens),
                                                                    stream.cached_tokens,
                                                                    _reasoning_total(renders))))
            yield proto.SSE_DONE
        except Exception as err:  # noqa: BLE001 - headers are sent: the error can only be an event
            outcome["status"], body, _ = _generation_failed(err, meta.id, completion_tokens,
                                                            endings)  # headers are sent already
            outcome["finish_reason"] = failure_reason(outcome["status"])
            yield proto.sse_event(body)
            yield proto.SSE_DONE


def build_app(args: dict) -> serve.Application:
    """Serve's application builder: `serve run launcher.serving.openai_app:build_app model=DIR tp=2`,
    or `import_path: launcher.serving.openai_app:build_app` with `args:` in a `serve deploy` config.
    The arguments are the server's (served_model_name, api_key, replicas, min_replicas, max_replicas,
    target_ongoing_requests, tool_call_parser, reasoning_parser, chat_template, trust_request_chat_template,
    default_chat_template_kwargs, responses_store, stream_interval) and
    LaunchConfig's fields (model, tp, dtype, seq_len, max_num_seqs,
    max_queued_requests, ...); see launcher/serving/server_settings.py."""
    return application(builder_settings(args))


def builder_settings(args: dict) -> ServerSettings:
    """The settings build_app deploys. Without api_key in args, CORELAUNCH_API_KEY is read here,
    where the app is built (the shell of `serve run IMPORT_PATH`; for a config file, the cluster),
    as `corelaunch serve` reads it: the replicas' own environments, inherited from `ray start`,
    rarely hold it, and a key exported for `serve run` was silently ignored, leaving the server
    open. Each replica still reads its own environment (a runtime_env's env_vars) when neither
    holds one."""
    settings = settings_from_args(args)
    if settings.api_key is None:
        settings = dataclasses.replace(settings, api_key=api_key_from_environment())
    return settings


def application(settings: ServerSettings) -> serve.Application:
    options = {"max_ongoing_requests": settings.max_ongoing_requests}
    if settings.autoscaling is not None:
        options["autoscaling_config"] = settings.autoscaling
    else:
        options["num_replicas"] = settings.num_replicas
    if settings.responses_store and settings.most_replicas > 1:  # one store the replicas share
        return OpenAIServer.options(**options).bind(settings, ResponseStoreServer.bind(settings.responses_store))
    return OpenAIServer.options(**options).bind(settings)
