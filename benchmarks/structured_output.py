"""Structured output's cost: the leader's masks per decode step, and a batch of requests generating
JSON against the same batch generating freely, through the driver API on one TP group (the
built-in model by default).

1. Masks alone (in this process, one torch thread, as a rank's leader step has it): --clients
   matchers of SCHEMA (an array of objects, so the matchers pass through keys, strings, numbers and
   separators) advanced together for --tokens steps, each step's allowed_tokens + mask_rows timed
   (workers/structured/token_masks.py) over random logits of the model's vocabulary width. Also the
   leader's one-off llguidance tokenizer build from the model's tokenizer.
2. End to end, alternated round by round in one Launcher (so a drifting machine moves both alike):
   --clients concurrent requests of --tokens new tokens each, sampled (temperature 1, seeded),
   once plainly (ignore_eos) and once with SCHEMA, whose minItems keeps every request going to
   --tokens. Reports the median wall time of each batch and their ratio; every structured output
   is replayed through a fresh matcher, which refuses any token the schema does not allow there.
3. With --base-url, (2) over HTTP against any OpenAI-compatible server (`corelaunch serve`, or a
   peer such as vLLM's): --clients concurrent /v1/completions requests, plain (`ignore_eos`) and with
   vLLM's `structured_outputs` {"json": SCHEMA}, which both servers take, alternated round by round.
   Each structured text is checked by a matcher of SCHEMA that allows free whitespace (a peer may
   put newlines between the items) fed the text's own tokens.
Prints JSON.

    python benchmarks/structured_output.py [--clients 16] [--tokens 64] [--rounds 3] [--compile] [--model-dir DIR]
    python benchmarks/structured_output.py --base-url http://127.0.0.1:8000/v1 --model NAME [--api-key KEY] ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.arguments import model_folder  # noqa: E402
from benchmarks.serving_client import exit_unless_served  # noqa: E402
from benchmarks.serving_stats import percentile  # noqa: E402
from launcher.cli.options import int_at_least  # noqa: E402

SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                     "city": {"type": "string", "maxLength": 16}},
    "required": ["name", "age", "city"], "additionalProperties": False}}


def mask_step_times(tokenizer, vocab: int, rows: int, steps: int) -> dict:
    """Per-step seconds of the leader's mask work for `rows` matchers over `steps` greedy steps."""
    import torch

    from shardlib.structured_output import StructuredOutput
    from workers.structured.matchers import GrammarTokenizer, start_matcher
    from workers.structured.token_masks import allowed_tokens, mask_rows

    start = time.perf_counter()
    grammar_tokenizer = GrammarTokenizer(lambda: tokenizer, vocab)
    grammar_tokenizer.get()
    built_s = time.perf_counter() - start
    spec = StructuredOutput(json=SCHEMA)
    grammars = [start_matcher(grammar_tokenizer, spec) for _ in range(rows)]
    generator = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        logits = torch.randn(rows, vocab, generator=generator) * 3
        begin = time.perf_counter()
        allowed = allowed_tokens(grammars, vocab, [(tokenizer.eos_token_id,)] * rows)
        scores = mask_rows(logits, list(range(rows)), allowed)
        times.append(time.perf_counter() - begin)
        for grammar, token in zip(grammars, scores.argmax(dim=-1).tolist()):
            grammar.advance(token)
    return {"grammar_tokenizer_build_s": round(built_s, 3), "rows": rows, "steps": steps,
            "median_ms": round(statistics.median(times) * 1e3, 3),
            "p90_ms": round(percentile(times, 90) * 1e3, 3)}


def over_http(args) -> dict:
    """Part 3 of the module docstring."""
    import asyncio

    import openai
    from llguidance import LLMatcher
    from transformers import AutoTokenizer

    from shardlib.demo_model import ensure_demo_model
    from workers.structured.matchers import GrammarTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.model_dir or ensure_demo_model()))
    checker = GrammarTokenizer(lambda: tokenizer, len(tokenizer)).get()
    flexible = LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, timeout=600, max_retries=0)
    prompt = "List people as JSON objects with name, age and city:"

    async def batch(structured: bool, seed: int) -> tuple[float, list]:
        extra = {"structured_outputs": {"json": SCHEMA}} if structured else {"ignore_eos": True}
        start = time.perf_counter()
        answers = await asyncio.gather(*(client.completions.create(
            model=args.model, prompt=prompt, max_tokens=args.tokens, temperature=1.0, seed=seed + i,
            extra_body=extra) for i in range(args.clients)))
        return time.perf_counter() - start, [a.choices[0] for a in answers]

    async def run() -> dict:
        times: dict[str, list[float]] = {"plain": [], "structured": []}
        counted, checked = {"plain": 0, "structured": 0}, 0
        for r in range(args.rounds + 1):  # the first round warms up
            for way in ("plain", "structured"):
                seconds, choices = await batch(way == "structured", 1000 * r)
                if not r:
                    continue
                times[way].append(seconds)
                counted[way] += len(choices)
                for choice in choices:
                    if choice.finish_reason != "length":
                        raise RuntimeError(f"a {way} request ended with {choice.finish_reason!r} before "
                                           f"{args.tokens} tokens; the workload needs every one to run to the limit")
                    if way == "structured":
                        matcher = LLMatcher(checker, flexible)
                        if not matcher.consume_tokens(tokenizer.encode(choice.text)):
                            raise RuntimeError(f"structured output {choice.text[:80]!r}... breaks the schema: "
                                               f"{matcher.get_error()}")
                        checked += 1
        medians = {way: statistics.median(v) for way, v in times.items()}
        return {"base_url": args.base_url, "model": args.model, "clients": args.clients, "tokens": args.tokens,
                "rounds": args.rounds, "median_batch_s": {way: round(v, 3) for way, v in medians.items()},
                "tokens_per_s": {way: round(args.clients * args.tokens / v, 2) for way, v in medians.items()},
                "structured_over_plain_time": round(medians["structured"] / medians["plain"], 3),
                "structured_outputs_checked": checked}

    return asyncio.run(run())


def main(out=None) -> dict:
    """out: where the JSON report goes (stdout when None)."""
    out = out or sys.stdout
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int_at_least("--clients", 1), default=16)
    parser.add_argument("--tokens", type=int_at_least("--tokens", 2), default=64)
    parser.add_argument("--rounds", type=int_at_least("--rounds", 1), default=3)
    parser.add_argument("--model-dir", type=model_folder("--model-dir"), default=None,
                        help="a Hugging Face model folder (default: the built-in model)")
    parser.add_argument("--compile", action="store_true", help="the compiled serving graphs (default: eager)")
    parser.add_argument("--base-url", help="an OpenAI-compatible server's /v1 URL: measure it over HTTP instead")
    parser.add_argument("--model", help="with --base-url: the served model's name")
    parser.add_argument("--api-key", default="none", help="with --base-url: the server's API key")
    args = parser.parse_args()
    if args.base_url is not None:
        if not args.model:
            parser.error("--base-url needs --model (the name the server serves the model under)")
        # before the tokenizer's seconds: a URL with no server (or no scheme) or a --model the server does not
        # serve ended in the openai client's traceback once they had passed
        exit_unless_served("structured_output.py", args.base_url, args.api_key, args.model)
        report = over_http(args)
        print(json.dumps(report, indent=1), file=out)
        return report

    import torch
    from transformers import AutoTokenizer

    from launcher.api import Launcher
    from shardlib.demo_model import ensure_demo_model
    from shardlib.sampling_params import SamplingParams
    from shardlib.structured_output import StructuredOutput
    from workers.structured.matchers import GrammarTokenizer, start_matcher

    model_dir = str(args.model_dir or ensure_demo_model())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    report: dict = {"clients": args.clients, "tokens": args.tokens, "rounds": args.rounds, "compile": args.compile,
                    "model": model_dir}
    report["masks"] = mask_step_times(tokenizer, len(tokenizer), args.clients, args.tokens)
    torch.set_num_threads(threads)
    spec = StructuredOutput(json=SCHEMA)
    prompt = "List people as JSON objects with name, age and city:"
    times: dict[str, list[float]] = {"plain": [], "structured": []}
    checker, checked = GrammarTokenizer(lambda: tokenizer, len(tokenizer)), 0
    # prefix_caching off: every round prefills its prompts whole (a round's repeated prompt would hit)
    with Launcher(model=model_dir, tp=1, compile=args.compile, warm_up=args.compile, max_num_seqs=args.clients,
                  progress=False, prefix_caching=False) as llm:
        for r in range(args.rounds + 1):  # the first round warms up (and builds the leader's tokenizer)
            for way in ("plain", "structured"):
                params = [SamplingParams(temperature=1.0, seed=1000 * r + i,
                                         structured_output=spec if way == "structured" else None)
                          for i in range(args.clients)]
                start = time.perf_counter()
                results = llm.generate([prompt] * args.clients, params, max_new_tokens=args.tokens, ignore_eos=True)
                if r:
                    times[way].append(time.perf_counter() - start)
                if way == "structured":
                    for result in results:
                        if len(result.token_ids) != args.tokens:
                            raise RuntimeError(f"a structured request ended after {len(result.token_ids)} tokens "
                                               f"({result.finish_reason}); the schema should keep it going")
                        start_matcher(checker, spec, result.token_ids)  # raises at a token the schema refuses
                        checked += 1
    medians = {way: statistics.median(v) for way, v in times.items()}
    report["end_to_end"] = {
        "median_batch_s": {way: round(v, 3) for way, v in medians.items()},
        "tokens_per_s": {way: round(args.clients * args.tokens / v, 2) for way, v in medians.items()},
        "structured_over_plain_time": round(medians["structured"] / medians["plain"], 3),
        "structured_outputs_checked": checked}
    print(json.dumps(report, indent=1), file=out)
    return report


if __name__ == "__main__":
    from launcher.cli.command_stdout import run_reporting

    run_reporting(main)
