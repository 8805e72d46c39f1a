"""argparse types the benchmark scripts share, beside launcher.cli.options.int_at_least: a bad value
is refused before any work, with a message naming the flag, the value and what it must be (a count
of 0 otherwise ended in a division by zero, an empty median or a report of Infinity)."""

from __future__ import annotations

import argparse
import math


def int_list(name: str, example: str, minimum: int = 1):
    """Comma-separated integers, each >= minimum (e.g. --rows 1024,2048)."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            values = []
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"{name} ({text!r}) must be comma-separated integers of at least "
                                             f"{minimum}, e.g. {example}")
        return values
    return parse


def positive_seconds(name: str):
    """A number of seconds above 0 (a timeout of 0 or less fails every wait at once)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number of seconds, not {text!r}") from None
        if not (value > 0 and math.isfinite(value)):  # also refuses nan
            raise argparse.ArgumentTypeError(f"{name} ({text}) must be a finite number of seconds above 0")
        return value
    return parse


def finite_number(name: str, minimum: float, *, above: bool = False):
    """A finite number >= minimum (> minimum with above=True): nan passed every `< minimum` check
    and inf overflowed the first sleep or thread count that used it, after the work had started."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, not {text!r}") from None
        if not math.isfinite(value) or value < minimum or (above and value == minimum):
            raise argparse.ArgumentTypeError(
                f"{name} ({text}) must be a finite number {'above' if above else 'of at least'} {minimum:g}")
        return value
    return parse


def model_folder(name: str, tokenizer_only: bool = False):
    """A Hugging Face model folder (one with a config.json; with tokenizer_only, one with a
    tokenizer), checked before any work: a missing one was a traceback after the start-up, or
    transformers' message about Hub repository ids."""
    def parse(text: str) -> str:
        from pathlib import Path

        needed = ("tokenizer.json", "tokenizer_config.json") if tokenizer_only else ("config.json",)
        if not any((Path(text) / file).is_file() for file in needed):
            what = "does not exist" if not Path(text).exists() else f"has no {' or '.join(needed)}"
            kind = "with the tokenizer the prompts are built with" if tokenizer_only else \
                "(config.json, tokenizer and safetensors weights)"
            raise argparse.ArgumentTypeError(f"{name} ({text}) {what}: pass a Hugging Face model folder {kind}")
        return text
    return parse


BENCH_CONTEXT = 8192
"""The longest prompt plus new tokens the benchmarks' buckets (auto_buckets up to this) hold."""


def smallest_buckets(prompt_tokens: int, new_tokens: int) -> dict:
    """The smallest buckets that hold one request: the KV-cache length and the context bucket."""
    from shardlib.buckets import auto_buckets

    buckets = auto_buckets(BENCH_CONTEXT)
    return {"seq_len": next(b for b in buckets if b >= prompt_tokens + new_tokens),
            "max_context_length": next(b for b in buckets if b >= prompt_tokens)}


def check_context(parser: argparse.ArgumentParser, prompt_tokens: int, new_tokens: int,
                  prompt_flag: str, new_flag: str) -> None:
    """parser.error unless the prompt and the new tokens fit BENCH_CONTEXT (a bare StopIteration
    after the tokenizer or the model had loaded)."""
    if prompt_tokens + new_tokens > BENCH_CONTEXT:
        parser.error(f"{prompt_flag} ({prompt_tokens}) plus {new_flag} ({new_tokens}) is "
                     f"{prompt_tokens + new_tokens}: the benchmark's buckets hold at most {BENCH_CONTEXT} "
                     f"tokens; lower one of them")
