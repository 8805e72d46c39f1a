"""Prefix caching over HTTP: requests that share a long prefix, prefilled whole or from the cache; JSON.

Three workloads, with SmolLM2-135M-Instruct's tokenizer, greedy, EOS ignored, --max-tokens new
tokens, streamed with the official `openai` client; the first two one request at a time (each time
to first token is that request's own prefill):
1. shared: --requests completions (token-id prompts), each one --prefix-tokens document followed by
   a --suffix-tokens question of its own. The first request of the run brings the document; the
   others can reuse it.
2. chat: a --turns-turn conversation on /v1/chat/completions whose system message is a document
   (about --prefix-tokens tokens); each turn sends the whole history (the earlier questions and the
   server's answers) plus a new question.
3. burst: --burst completions sent at once, each a question of its own after one new document:
   the time to the last one's first token, and to the end of all.
Before each workload an unmeasured request of the same shape with another document builds what
graphs it needs (without sharing anything with the measured ones).

Without --base-url the script starts `corelaunch serve` twice, one after the other, with the same
flags (--serve-args): --no-prefix-caching first, then with prefix caching (the default); it reports
each server's figures and the ratios of the first's time-to-first-token medians (after the first
request) to the second's. With --base-url URL --model NAME it measures that one server (vLLM's CPU
engine caches prefixes by default); `cached_tokens` is what its usage says (null when it says nothing).

    python benchmarks/prefix_caching.py [--prefix-tokens 1024] [--suffix-tokens 32] [--requests 8] [--turns 6] [--burst 4]
    python benchmarks/prefix_caching.py --base-url http://127.0.0.1:8011/v1 --model smollm2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.arguments import model_folder, positive_seconds  # noqa: E402
from benchmarks.serving_client import exit_unless_served, served_models  # noqa: E402
from launcher.cli.options import int_at_least  # noqa: E402

SERVE_ARGS = "--tp 1 --max-num-seqs 4"
SERVER_TIMEOUT_S = 900.0
"""Seconds to wait for each server's GET /health, unless --server-timeout says otherwise."""
DOCUMENT = ("Entry {k}. The harbour records list each ship that came in, its cargo of salt, timber or wool, the "
            "warehouse on the quay where the cargo was kept, and the merchant who paid the dues that season. ")
QUESTION = "Question {i}: which warehouse held the wool of the ship that came in during season {s}, and why?"


def document_ids(tokenizer, k: int, tokens: int) -> list[int]:
    """Exactly `tokens` ids of document k (documents differ from their second token on)."""
    text, ids = "", []
    while len(ids) < tokens:
        text += DOCUMENT.format(k=f"{k}.{len(text)}")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[:tokens]


def question_ids(tokenizer, i: int, tokens: int) -> list[int]:
    text, ids = "", []
    while len(ids) < tokens:
        text += " " + QUESTION.format(i=i, s=len(text) + i)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[:tokens]


def system_message(tokenizer, k: int, prefix_tokens: int) -> dict:
    """The chat workload's system message: document k."""
    return {"role": "system", "content": tokenizer.decode(document_ids(tokenizer, k, prefix_tokens))}


def question_message(tokenizer, i: int, suffix_tokens: int) -> dict:
    return {"role": "user", "content": tokenizer.decode(question_ids(tokenizer, i, suffix_tokens))}


# ---- the longest request against the servers' context, before any server starts ----------------------
def last_chat_prompt_tokens(tokenizer, args) -> int | None:
    """About how many tokens the chat workload's last prompt has: the measured conversation's whole
    history in the chat template, each earlier answer taken as --max-tokens tokens of text (the
    server's own answers are that many tokens; their text encoded again may differ by a few). None
    when the tokenizer has no chat template (the server's own rendering then decides)."""
    messages = [system_message(tokenizer, 2, args.prefix_tokens)]
    for t in range(args.turns):
        if t:
            answer = tokenizer.decode(question_ids(tokenizer, 1000 + t, args.max_tokens))
            messages.append({"role": "assistant", "content": answer})
        messages.append(question_message(tokenizer, t, args.suffix_tokens))
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except ValueError:  # transformers' refusal for a tokenizer without a template
        return None
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def served_context(serve_args: list[str], model_dir: str) -> dict | None:
    """What each request to the servers started here may hold, read from --serve-args as `corelaunch
    serve` reads them: "tokens" (prompt plus new tokens: --seq-len, else serve's default of
    min(max_position_embeddings, DEFAULT_MAX_SEQ_LEN), never past the model's "positions"),
    "prompt" (compiled with --max-context-length: the longest prompt its graphs take, else None) and
    "source" (how "tokens" was found, for messages). None where --serve-args set the context in a way
    not read here (a --compiled directory, custom buckets) or the model's config cannot be read (the
    server then says why)."""
    from shardlib.model_config import load_model_config
    from shardlib.planner import DEFAULT_MAX_SEQ_LEN

    options = serve_options(serve_args)
    if options.compiled or options.buckets or options.token_buckets or options.context_buckets:
        return None
    try:
        positions = load_model_config(options.model or model_dir).max_position_embeddings
    except (OSError, ValueError):
        return None
    if options.seq_len is not None:
        tokens, source = min(options.seq_len, positions), f"--seq-len {options.seq_len} in --serve-args"
    else:
        tokens = min(positions, DEFAULT_MAX_SEQ_LEN)
        source = f"serve's default --seq-len: min(the model's {positions} positions, {DEFAULT_MAX_SEQ_LEN})"
    prompt = options.max_context_length if options.compile else None  # eager prompts run at their lengths
    # the chat prompt is counted with --model-dir's tokenizer and its own template: another model's
    # tokenizer or a --chat-template renders the same messages to another length (a count past the
    # context refused a run each request of which fitted); the server's 400 says so then
    same_rendering = options.chat_template is None and (
        options.model is None or Path(options.model).resolve() == Path(model_dir).resolve())
    return {"tokens": tokens, "positions": positions, "prompt": prompt, "source": source,
            "seq_len_given": options.seq_len is not None, "chat_counted": same_rendering}


def serve_options(serve_args: list[str]) -> argparse.Namespace:
    """--serve-args read by `corelaunch serve`'s own parser (`--model=PATH` as well as `--model PATH`)."""
    from launcher.cli import build_parser

    options, _ = build_parser().subcommand_parsers["serve"].parse_known_args(serve_args)
    return options


def _one_of(flags: list[str]) -> str:
    return f"{', '.join(flags[:-1])} or {flags[-1]}"


def context_problem(args, context: dict, chat_prompt: int | None) -> str | None:
    """Why a workload's longest request does not fit the servers' context, naming the flags to lower;
    None when every one fits. Each server refused it with a 400, after minutes of start-up, and the
    run ended in the openai client's traceback with no report."""
    workloads = [(args.prefix_tokens + args.suffix_tokens,
                  f"the shared-prefix and burst prompts (--prefix-tokens {args.prefix_tokens} plus --suffix-tokens "
                  f"{args.suffix_tokens})", ["--prefix-tokens", "--suffix-tokens"])]
    if chat_prompt is not None:  # the history grows each turn: the last one is the longest
        workloads.append((chat_prompt, f"the chat workload's last prompt (about {chat_prompt} tokens: the "
                                       f"--prefix-tokens document, then --turns {args.turns} questions of "
                                       f"--suffix-tokens with the answers of --max-tokens before it)",
                          ["--turns", "--prefix-tokens", "--suffix-tokens"]))
    for prompt, what, flags in workloads:
        if context["prompt"] is not None and prompt > context["prompt"]:
            return (f"{what} are {prompt} tokens, past --max-context-length ({context['prompt']}) in --serve-args, "
                    f"the longest prompt the servers' graphs take; lower {_one_of(flags)}, or raise "
                    f"--max-context-length")
        needed = prompt + args.max_tokens
        if needed > context["tokens"]:
            way = (f"raise --seq-len in --serve-args to {needed}" if context["seq_len_given"] else
                   f"add --seq-len {needed} to --serve-args")
            longer = (f", or {way}" if needed <= context["positions"] else
                      f" (the model holds {context['positions']} positions at most)")
            return (f"{what} with --max-tokens {args.max_tokens} new tokens need {needed} positions, past the "
                    f"{context['tokens']} each request to the servers may hold ({context['source']}); lower "
                    f"{_one_of([*flags, '--max-tokens'])}{longer}")
    return None


# ---- a request the server refused, said in one line ----------------------------------------------------
class RequestRefused(Exception):
    """A workload's request drew a 400 (its message names the flags to lower)."""


_ONE_DOCUMENT = ("its prompt is --prefix-tokens ({prefix_tokens}) plus --suffix-tokens ({suffix_tokens}) tokens, with "
                 "--max-tokens ({max_tokens}) new ones: lower them")
REFUSED_PROMPTS = {
    "shared-prefix": _ONE_DOCUMENT, "burst": _ONE_DOCUMENT,
    "chat": "its prompt is the conversation so far (the --prefix-tokens ({prefix_tokens}) document, up to --turns "
            "({turns}) questions of --suffix-tokens ({suffix_tokens}) and the answers of --max-tokens ({max_tokens})): "
            "lower --turns (or the others)",
}
"""What sizes each workload's prompts, by the name refused_as is given, as a fix for a 400."""


def _error_object(err) -> dict:
    """The OpenAI error object of an openai.BadRequestError's body ({} where it has none)."""
    body = getattr(err, "body", None)
    inner = body.get("error", body) if isinstance(body, dict) else None
    return inner if isinstance(inner, dict) else {}


def refusal_text(err) -> str:
    """The server's own message from an openai.BadRequestError, on one line."""
    message = _error_object(err).get("message")
    return " ".join((message if isinstance(message, str) else str(err)).split())


async def refused_as(workload: str, args, request):
    """Await a workload's requests; a 400 becomes RequestRefused naming the flags that size them
    (the server's context is unknown here with --base-url; with the servers started here,
    --serve-args may set it in ways context_problem does not read)."""
    from openai import BadRequestError

    try:
        return await request
    except BadRequestError as err:
        said = refusal_text(err)
        # the flags size the prompts: advice for a refusal of their length alone (a model without a
        # chat template was told to lower --turns)
        fix = (f"; {REFUSED_PROMPTS[workload].format(**vars(args))} to fit the server's context"
               if past_the_context(err, said) else "")
        raise RequestRefused(f"the server refused a {workload} request (HTTP 400: {said}){fix}") from None


def past_the_context(err, said: str) -> bool:
    """Whether a 400 refused a request for its length: corelaunch's code for it, or another
    server's message naming the context."""
    return _error_object(err).get("code") == "context_length_exceeded" or "context" in said.lower()


def _text(choice) -> str:
    """A streamed chunk's new text: a completion's `text`, a chat's `delta.content`."""
    delta = getattr(choice, "delta", None)
    return (delta.content if delta is not None else choice.text) or ""


async def timed(create, **request) -> dict:
    """One streamed request: seconds to its first text and to its end, its text, its completion
    tokens and usage's cached tokens (None when the server's usage has no prompt_tokens_details)."""
    start = time.perf_counter()
    first, cached, tokens, text = None, None, 0, ""
    stream = await create(stream=True, stream_options={"include_usage": True}, temperature=0,
                          extra_body={"ignore_eos": True}, **request)
    async for chunk in stream:
        if chunk.choices and (piece := _text(chunk.choices[0])):
            first = first if first is not None else time.perf_counter() - start
            text += piece
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
            details = getattr(chunk.usage, "prompt_tokens_details", None)
            cached = getattr(details, "cached_tokens", None) if details is not None else None
    return {"ttft_s": first, "e2e_s": time.perf_counter() - start, "cached_tokens": cached, "tokens": tokens,
            "text": text}


def complete_records(records: list[dict], max_tokens: int) -> list[dict]:
    """The records, once each streamed its max_tokens tokens (RuntimeError otherwise)."""
    if any(r["tokens"] != max_tokens or r["ttft_s"] is None for r in records):
        raise RuntimeError(f"a request did not stream its {max_tokens} tokens: {records}")
    return records


def cached_counts(records: list[dict]) -> list[int] | None:
    """Each request's cached prompt tokens, or None when the server's usage said none."""
    cached = [r["cached_tokens"] for r in records]
    return None if None in cached else cached


def summary(records: list[dict], max_tokens: int) -> dict:
    later = complete_records(records, max_tokens)[1:]
    return {"requests": len(records), "first_ttft_s": round(records[0]["ttft_s"], 4),
            "later_ttft_s_median": round(statistics.median(r["ttft_s"] for r in later), 4),
            "later_ttft_s_max": round(max(r["ttft_s"] for r in later), 4),
            "e2e_s_total": round(sum(r["e2e_s"] for r in records), 3),
            "cached_tokens": cached_counts(records)}


async def measure(base_url: str, model: str, api_key: str, tokenizer, args) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=args.request_timeout, max_retries=0)
    complete, chat = client.completions.create, client.chat.completions.create

    async def shared_document(k: int, requests: int) -> list[dict]:
        document = document_ids(tokenizer, k, args.prefix_tokens)
        return [await timed(complete, model=model, prompt=document + question_ids(tokenizer, i, args.suffix_tokens),
                            max_tokens=args.max_tokens) for i in range(requests)]

    async def conversation(k: int, turns: int) -> list[dict]:
        messages = [system_message(tokenizer, k, args.prefix_tokens)]  # as last_chat_prompt_tokens counts it
        records = []
        for t in range(turns):
            messages.append(question_message(tokenizer, t, args.suffix_tokens))
            records.append(await timed(chat, model=model, messages=messages, max_tokens=args.max_tokens))
            messages.append({"role": "assistant", "content": records[-1]["text"]})
        return records

    async def burst(k: int) -> dict:
        document = document_ids(tokenizer, k, args.prefix_tokens)
        start = time.perf_counter()
        records = await asyncio.gather(*(timed(complete, model=model, max_tokens=args.max_tokens,
                                               prompt=document + question_ids(tokenizer, i, args.suffix_tokens))
                                         for i in range(args.burst)))
        complete_records(records, args.max_tokens)
        return {"requests": args.burst, "last_ttft_s": round(max(r["ttft_s"] for r in records), 4),
                "ttft_s_median": round(statistics.median(r["ttft_s"] for r in records), 4),
                "wall_s": round(time.perf_counter() - start, 3),
                "cached_tokens": None if (cached := cached_counts(records)) is None else sorted(cached)}

    # warm-ups: other documents, two requests each (a start and a continuation: their graphs built)
    await refused_as("shared-prefix", args, shared_document(999, 2))
    shared = await refused_as("shared-prefix", args, shared_document(1, args.requests))
    await refused_as("chat", args, conversation(998, 2))
    turns = await refused_as("chat", args, conversation(2, args.turns))
    await refused_as("burst", args, burst(997))
    return {"shared_prefix": summary(shared, args.max_tokens), "chat_turns": summary(turns, args.max_tokens),
            "burst": await refused_as("burst", args, burst(3))}


def served_name(base_url: str) -> str:
    """The model name the server at base_url serves, from its GET /v1/models: whatever --serve-args
    made it (--served-model-name, another --model); the model folder's name, which was sent, drew a
    404 for every request then."""
    ids, why = served_models(base_url)
    if not ids:
        raise RuntimeError(f"the server at {base_url} lists no model at /models ({why or 'an empty or unreadable list'})")
    return ids[0]


def check_model_dir(parser: argparse.ArgumentParser, model_dir: str | None, served: bool) -> None:
    """--model-dir before any work: always a tokenizer (the prompts are built with it), and a whole model
    where the servers started here are given it (`corelaunch serve --model`). Checked as a tokenizer
    folder alone, a tokenizer's folder (no config.json) was given to the first server, which failed in its start-up."""
    if model_dir is None:
        return
    try:
        if served:
            model_folder("--model-dir")(model_dir)
        model_folder("--model-dir", tokenizer_only=True)(model_dir)
    except argparse.ArgumentTypeError as err:
        parser.error(str(err))


def main(out=None) -> dict:
    out = out or sys.stdout
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-tokens", type=int_at_least("--prefix-tokens", 16), default=1024)
    parser.add_argument("--suffix-tokens", type=int_at_least("--suffix-tokens", 1), default=32)
    parser.add_argument("--max-tokens", type=int_at_least("--max-tokens", 1), default=16)
    parser.add_argument("--requests", type=int_at_least("--requests", 2), default=8)
    parser.add_argument("--turns", type=int_at_least("--turns", 2), default=6)
    parser.add_argument("--burst", type=int_at_least("--burst", 2), default=4,
                        help="requests sent at once in the third workload (default 4, the default rows)")
    parser.add_argument("--model-dir", default=None,
                        help="the model the servers serve (its tokenizer builds the prompts); with --base-url, or a "
                             "--model in --serve-args, only its tokenizer (default: the built-in model)")
    parser.add_argument("--serve-args", help=f"corelaunch serve's flags for both servers (default {SERVE_ARGS!r})")
    parser.add_argument("--server-timeout", type=positive_seconds("--server-timeout"),
                        help=f"seconds to wait for each server's GET /health (default {SERVER_TIMEOUT_S:g})")
    parser.add_argument("--request-timeout", type=positive_seconds("--request-timeout"), default=600.0)
    parser.add_argument("--base-url", help="an OpenAI-compatible server's /v1 URL: measure it alone")
    parser.add_argument("--model", help="with --base-url: the served model's name")
    parser.add_argument("--api-key", default="none", help="with --base-url: the server's API key")
    args = parser.parse_args()
    if args.base_url is not None:
        if not args.model:
            parser.error("--base-url needs --model (the name the server serves the model under)")
        given = [flag for flag, value in (("--serve-args", args.serve_args), ("--server-timeout", args.server_timeout))
                 if value is not None]
        if given:  # they were ignored: the run measured the other server as if they had been applied
            parser.error(f"{', '.join(given)} concern the corelaunch servers this benchmark starts; with --base-url "
                         f"the server is someone else's, running throughout (drop them)")
        # before the tokenizer's seconds: a URL with no server (or no scheme) or a --model the server does not
        # serve ended in the openai client's traceback once they had passed
        exit_unless_served("prefix_caching.py", args.base_url, args.api_key, args.model)
    serve_args = shlex.split(SERVE_ARGS if args.serve_args is None else args.serve_args)
    args.server_timeout = SERVER_TIMEOUT_S if args.server_timeout is None else args.server_timeout
    if "--no-prefix-caching" in serve_args:
        parser.error("--serve-args: leave --no-prefix-caching out (the first server gets it, the second not)")
    own_model = args.base_url is None and serve_options(serve_args).model is None
    check_model_dir(parser, args.model_dir, served=own_model)

    from transformers import AutoTokenizer

    from shardlib.demo_model import ensure_demo_model

    # absolute: the servers start in the repository's root, not in this folder
    model_dir = str(Path(args.model_dir).resolve()) if args.model_dir else str(ensure_demo_model())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    context = served_context(serve_args, model_dir) if args.base_url is None else None  # another's: unknown
    chat_prompt = last_chat_prompt_tokens(tokenizer, args) if context and context["chat_counted"] else None
    problem = context and context_problem(args, context, chat_prompt)
    if problem:  # before either server's minutes of start-up
        parser.error(problem)
    try:
        report = measured_report(args, serve_args, model_dir if own_model else None, tokenizer)
    except RequestRefused as err:  # a one-line reason, not the openai client's traceback
        print(f"prefix_caching.py: {err}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(report, indent=1), file=out)
    return report


def measured_report(args, serve_args: list[str], model_dir: str | None, tokenizer) -> dict:
    """The report: the server at --base-url measured, or the two servers started here one after the
    other (each stopped on leaving, a RequestRefused included), given `model_dir` where --serve-args
    names no --model."""
    from benchmarks.serving_server import corelaunch_server

    report: dict = {"prefix_tokens": args.prefix_tokens, "suffix_tokens": args.suffix_tokens,
                    "max_tokens": args.max_tokens, "requests": args.requests, "turns": args.turns}
    if args.base_url is not None:
        report["server"] = {"base_url": args.base_url, "model": args.model,
                            **asyncio.run(measure(args.base_url, args.model, args.api_key, tokenizer, args))}
    else:
        for name, extra in (("no_prefix_caching", ["--no-prefix-caching"]), ("prefix_caching", [])):
            command = [*serve_args, *extra] + ([] if model_dir is None else ["--model", model_dir])
            with corelaunch_server(command, args.server_timeout) as (base_url, _):
                served = served_name(base_url)
                report[name] = {"serve_args": command, "model": served, **asyncio.run(
                    measure(base_url, served, "none", tokenizer, args))}
        report["ttft_ratio_without_over_with"] = {
            workload: round(report["no_prefix_caching"][workload]["later_ttft_s_median"]
                            / report["prefix_caching"][workload]["later_ttft_s_median"], 2)
            for workload in ("shared_prefix", "chat_turns")}
        report["ttft_ratio_without_over_with"]["burst_last"] = round(
            report["no_prefix_caching"]["burst"]["last_ttft_s"] / report["prefix_caching"]["burst"]["last_ttft_s"], 2)
    return report


if __name__ == "__main__":
    from launcher.cli.command_stdout import run_reporting

    run_reporting(main)
