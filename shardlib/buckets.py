"""Bucketing: the few fixed shapes compiled graphs are built for, and which one a request uses.

A compiled graph has static shapes, so inputs are padded up to one of a few lengths (buckets) and
one graph exists per bucket. The rules follow NxD Inference:

- automatic buckets are the powers of two from 128 up to the maximum, with the maximum itself as
  the last bucket (maximum 300 -> 128, 256, 300; maximum 100 -> 100);
- context-encoding (prefill) buckets go up to the maximum context length: the prompt is padded to
  one; token-generation (decode) buckets go up to the maximum sequence length: the KV cache is
  allocated with one of them as its number of slots;
- a custom list replaces the automatic one;
- the smallest bucket that fits is used; an input longer than the largest bucket is an error that
  names both lengths.

Batch sizes are bucketed the same way from 1 (1, 2, 4, ..., max_batch_size): a batch is padded with
filler rows up to the next batch bucket, so a lone request does not pay for max_batch_size rows.

Pure functions and one frozen dataclass: no torch, nothing to import but the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from shardlib.positive_int import is_positive_int, positive_int

MIN_AUTO_BUCKET = 128
"""The smallest automatic sequence bucket (unless the maximum itself is smaller)."""


def auto_buckets(maximum: int, minimum: int = MIN_AUTO_BUCKET) -> tuple[int, ...]:
    """Powers of two p with minimum <= p < maximum, then maximum: auto_buckets(300) == (128, 256, 300)."""
    positive_int("maximum", maximum)
    positive_int("minimum", minimum)
    buckets, p = [], 1
    while p < minimum:
        p *= 2
    while p < maximum:
        buckets.append(p)
        p *= 2
    buckets.append(maximum)
    return tuple(buckets)


def normalize_buckets(buckets: Iterable[int], what: str, limit: int | None = None,
                      limit_name: str = "the limit") -> tuple[int, ...]:
    """A custom bucket list sorted and de-duplicated; ValueError naming any bad value.

    limit: the largest value allowed (for example the model's max_position_embeddings)."""
    if isinstance(buckets, (str, bytes)) or not hasattr(buckets, "__iter__"):  # "128" gave buckets 1, 2, 8
        raise ValueError(f"{what} buckets ({buckets!r}) must be a list of lengths, e.g. [128, 256]")
    values = list(buckets)
    if not values:
        raise ValueError(f"{what} buckets are empty; give at least one length, or none for the automatic ones")
    for value in values:
        if not is_positive_int(value):
            raise ValueError(f"{what} bucket {value!r} must be a positive integer")
    out = tuple(sorted(set(values)))
    if limit is not None and out[-1] > limit:
        raise ValueError(f"{what} bucket {out[-1]} exceeds {limit_name} ({limit}); drop it or lower it to {limit}")
    return out


def parse_buckets(text: str) -> tuple[int, ...]:
    """Parse a command-line list like "128,256,512" (spaces allowed); ValueError on anything else."""
    try:
        values = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise ValueError(f"bucket list {text!r} must be comma-separated integers, e.g. 128,256,512") from None
    if not values:
        raise ValueError(f"bucket list {text!r} is empty; give comma-separated integers, e.g. 128,256,512")
    return tuple(values)


def select_bucket(length: int, buckets: tuple[int, ...], what: str = "length", kind: str = "",
                  fix: str = "") -> int:
    """The smallest bucket >= length; ValueError naming the length and the largest bucket.

    what: the input's name ("prompt length"); kind: the buckets' ("context-encoding"); fix: the way out."""
    for bucket in buckets:
        if bucket >= length:
            return bucket
    raise ValueError(f"{what} ({length}) is longer than the largest {kind + ' ' if kind else ''}bucket "
                     f"({buckets[-1]}){'; ' + fix if fix else ''}")


@dataclass(frozen=True)
class Buckets:
    """The context-encoding, token-generation and batch buckets of one compiled model."""

    context: tuple[int, ...]
    """Context-encoding (prefill) lengths: a batch's prompts are padded to the smallest that fits."""
    token: tuple[int, ...]
    """Token-generation KV-cache lengths: a request's cache gets the smallest that holds the longest
    prompt plus max_new_tokens."""
    batch: tuple[int, ...] = (1,)
    """Batch sizes: a batch is padded with filler rows to the smallest that fits."""

    def __post_init__(self) -> None:
        for name in ("context", "token", "batch"):
            values = getattr(self, name)
            if not values or list(values) != sorted(set(values)) or not all(map(is_positive_int, values)):
                raise ValueError(f"{name} buckets {values!r} must be a non-empty, increasing tuple of positive "
                                 f"integers; build them with Buckets.build")
        if self.context[-1] > self.token[-1]:
            raise ValueError(
                f"the largest context-encoding bucket ({self.context[-1]}) exceeds the largest "
                f"token-generation bucket ({self.token[-1]}): a padded prompt must fit the KV cache; "
                f"raise the maximum sequence length or lower the context buckets"
            )

    @classmethod
    def build(cls, max_context_length: int | None = None, max_seq_len: int | None = None,
              max_batch_size: int = 1, *, context: Iterable[int] | None = None,
              token: Iterable[int] | None = None, batch: Iterable[int] | None = None,
              max_positions: int | None = None) -> "Buckets":
        """Automatic buckets from the maxima, or the custom lists given (which then set the maxima).

        max_context_length defaults to max_seq_len (and is capped by it); max_positions, the
        model's max_position_embeddings, bounds every sequence bucket.
        """
        limit_name = "the model's max_position_embeddings"
        if token is not None:
            token = normalize_buckets(token, "token-generation", max_positions, limit_name)
        else:
            if max_seq_len is None:
                raise ValueError("give max_seq_len or a list of token-generation buckets")
            positive_int("max_seq_len", max_seq_len)
            if max_positions is not None and max_seq_len > max_positions:
                raise ValueError(f"seq_len ({max_seq_len}) exceeds {limit_name} ({max_positions}); lower it")
            token = auto_buckets(max_seq_len)
        if context is not None:
            context = normalize_buckets(context, "context-encoding", token[-1],
                                        "the largest token-generation bucket")
        else:
            max_context = min(max_context_length or token[-1], token[-1])
            positive_int("max_context_length", max_context)
            context = auto_buckets(max_context)
        if batch is not None:
            batch = normalize_buckets(batch, "batch")
        else:
            positive_int("max_batch_size", max_batch_size)
            batch = auto_buckets(max_batch_size, minimum=1)
        return cls(context=context, token=token, batch=batch)

    @property
    def max_context_length(self) -> int:
        return self.context[-1]

    @property
    def max_seq_len(self) -> int:
        return self.token[-1]

    @property
    def max_batch_size(self) -> int:
        return self.batch[-1]

    def context_bucket(self, prompt_length: int) -> int:
        return select_bucket(prompt_length, self.context, "prompt length", "context-encoding",
                             "shorten the prompt or use larger context-encoding buckets (--max-context-length or "
                             "--context-buckets)")

    def token_bucket(self, total_length: int) -> int:
        return select_bucket(total_length, self.token, "sequence length", "token-generation",
                             "lower max_new_tokens, shorten the prompt, or use larger token-generation "
                             "buckets (a longer --seq-len)")

    def batch_bucket(self, batch: int) -> int:
        return select_bucket(batch, self.batch, "batch size", "batch",
                             "send fewer prompts per call or use a larger --max-batch-size")

    def shapes(self) -> list[tuple[str, int, int]]:
        """Every (phase, batch, length) graph these buckets describe, smallest first."""
        return ([("context", b, n) for b in self.batch for n in self.context]
                + [("token", b, n) for b in self.batch for n in self.token])

    def to_dict(self) -> dict:
        return {"context": list(self.context), "token": list(self.token), "batch": list(self.batch)}

    @classmethod
    def from_dict(cls, raw: dict) -> "Buckets":
        try:
            return cls(context=tuple(raw["context"]), token=tuple(raw["token"]), batch=tuple(raw["batch"]))
        except (KeyError, TypeError):
            raise ValueError(f"bucket record {raw!r} needs lists 'context', 'token' and 'batch'") from None


@dataclass(frozen=True)
class RequestShape:
    """The padded shapes one request runs at: which graphs it uses."""

    batch: int
    """Rows after padding to a batch bucket."""
    context: int
    """Prefill length: the prompts (left-padded to the longest) padded on the right to this bucket."""
    cache: int
    """KV-cache slots: the token-generation bucket."""


def request_shape(buckets: Buckets, prompt_lengths: list[int], max_new_tokens: int) -> RequestShape:
    """The bucketed shapes for a batch of prompts; ValueError naming the lengths when one does not fit.

    The cache must hold the padded prefill (context slots) and every decoded token (the longest
    prompt plus max_new_tokens slots), so it is the smallest token bucket >= both.
    """
    if not prompt_lengths:
        raise ValueError("a request needs at least one prompt")
    longest = max(prompt_lengths)
    context = buckets.context_bucket(longest)
    needed = longest + max_new_tokens
    if needed > buckets.max_seq_len:
        raise ValueError(
            f"longest prompt ({longest}) + max_new_tokens ({max_new_tokens}) = {needed} is longer than the "
            f"largest token-generation bucket ({buckets.max_seq_len}); lower max_new_tokens, shorten the "
            f"prompt, or use larger token-generation buckets (a longer --seq-len)"
        )
    cache = buckets.token_bucket(max(context, needed))  # fits: context <= max_context_length <= max_seq_len
    return RequestShape(batch=buckets.batch_bucket(len(prompt_lengths)), context=context, cache=cache)
