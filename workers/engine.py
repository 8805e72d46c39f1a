"""The generation loop one rank runs: left-pad a batch, prefill once, decode one token per step.

Every rank of a tensor-parallel group runs this same loop on the same prompts; the model's
collectives keep the ranks in step and the all-gathered logits plus shared seeds make every rank
pick the same tokens (see workers/sampling.py). Rank 0's outputs are the ones returned to the user.

Batching: prompts of different lengths are left-padded to the longest, so all rows share cache
slots and the last column is every row's newest token. A row's padding slots are masked out of
attention and its rotary positions start at 0 at its first real token, so each row's tokens are
those the prompt would get alone. Rows that finish keep flowing through the (fixed-shape) batch,
but their tokens are no longer recorded nor chosen (their logits, which may have overflowed since,
must not fail the rows still running); the loop ends when every row has finished.

Buckets (shardlib/buckets.py): compiled graphs have static shapes, so with buckets every forward
runs at one of a few shapes. The batch gets filler rows up to a batch bucket; the left-padded prompts
get filler columns on the right up to a context-encoding bucket, and the logits are read at the
last real column; the KV cache gets a token-generation bucket's slots (enough for the padded
prefill and every new token). Decode then writes slot longest + step, as without buckets: each
decode step overwrites a filler column's slot before any query can read it.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace
from typing import Iterable

import torch

from shardlib.buckets import Buckets, request_shape
from shardlib.request_checks import check_request
from workers.kv_cache import KVCache
from workers.penalties import penalized
from workers.sampling import SamplingParams, make_generator, sample, sampling_device

CACHE_LEN_MULTIPLE = 64
"""Default KV cache lengths are rounded up to this, so nearby request sizes share one shape."""


@dataclass
class GenerationOutput:
    token_ids: list[int]
    """Generated tokens only (not the prompt); ends with the stop token when one was produced."""
    finish_reason: str
    """"stop" when a stop token was generated, "length" when max_new_tokens ran out."""
    prompt_length: int
    """Number of prompt tokens (without padding)."""
    time_to_first_token_s: float
    """From the call to generate until the first token was chosen (includes prefill)."""
    decode_tokens_per_s: float
    """Tokens after the first, divided by the time from the first token to this row's last one;
    0.0 when only one token was generated."""
    decode_step_latencies_s: list[float] = field(default_factory=list)
    """Wall time of each decode step that produced one of this row's tokens after the first."""
    logits: torch.Tensor | None = None
    """With return_logits: (len(token_ids), vocab) float32, the model's logits at each generated
    token's step (before penalties, bias and the sampling filters that chose it)."""
    token_times_s: list[float] = field(default_factory=list)
    """time.perf_counter() of this process when each of the row's tokens was taken."""


def cache_length(prompt_lengths: list[int], max_new_tokens: int, max_position_embeddings: int,
                 max_seq_len: int | None = None) -> int:
    """KV cache slots for a batch: max_seq_len if given, else the longest prompt plus
    max_new_tokens rounded up to CACHE_LEN_MULTIPLE (capped at max_position_embeddings).
    ValueError when the request cannot fit."""
    needed = max(prompt_lengths) + max_new_tokens
    if needed > max_position_embeddings:
        raise ValueError(
            f"longest prompt ({max(prompt_lengths)}) + max_new_tokens ({max_new_tokens}) = {needed} "
            f"exceeds the model's max_position_embeddings ({max_position_embeddings}); shorten the "
            f"prompt or lower max_new_tokens"
        )
    if max_seq_len is not None:
        if needed > max_seq_len:
            raise ValueError(
                f"longest prompt ({max(prompt_lengths)}) + max_new_tokens ({max_new_tokens}) = {needed} "
                f"exceeds max_seq_len ({max_seq_len}); raise max_seq_len or lower max_new_tokens"
            )
        return max_seq_len
    rounded = -(-needed // CACHE_LEN_MULTIPLE) * CACHE_LEN_MULTIPLE
    return max(needed, min(rounded, max_position_embeddings))


def _shared_seeds(model, params: list[SamplingParams]) -> list[SamplingParams]:
    """Give every sampled request without a seed one that all ranks share.

    Rank 0 draws the seeds and one all-reduce (the other ranks add zeros) hands them to everyone;
    every rank sees the same params, so all ranks take this branch together or none does.
    """
    unseeded = [i for i, p in enumerate(params) if not p.is_greedy and p.seed is None]
    if not unseeded:
        return params
    collectives = model.collectives
    device = getattr(model, "device", torch.device("cpu"))  # NCCL reduces device tensors only
    seeds = torch.zeros(len(unseeded), dtype=torch.int64, device=device)
    if collectives.rank == 0:
        seeds = torch.tensor([random.randrange(2**62) for _ in unseeded], dtype=torch.int64, device=device)
    collectives.all_reduce_sum_(seeds)
    params = list(params)
    for i, seed in zip(unseeded, seeds.tolist()):
        params[i] = replace(params[i], seed=seed)
    return params


def generate(model, prompts: list[list[int]], params: list[SamplingParams], max_new_tokens: int,
             stop_token_ids: Iterable[int], max_seq_len: int | None = None, *,
             cache: KVCache | None = None, pad_token_id: int = 0,
             return_logits: bool = False, buckets: Buckets | None = None) -> list[GenerationOutput]:
    """Generate up to max_new_tokens for each prompt; one GenerationOutput per prompt, in order.

    model: a ShardedCausalLM or a CompiledCausalLM (anything with its forward, new_cache, config
        and collectives; a compiled model also carries the buckets its graphs were built for).
    stop_token_ids: a row finishes (reason "stop") once it generates one of these.
    max_seq_len: without buckets, the KV cache length (default: longest prompt + max_new_tokens
        rounded up to 64); with buckets, only a limit the request must fit.
    cache: reuse a preallocated KVCache (batch = len(prompts)) instead of allocating one; it is
        reset first and must hold max_seq_len slots when max_seq_len is given.
    pad_token_id: id fed in padding positions (never attended to, so any valid id works).
    return_logits: keep, per row, the model's logits at each generated token's step, before
        penalties, bias and sampling filters (for logit matching against a reference model); off by
        default since it costs vocab floats per token.
    buckets: run at bucketed shapes (default: the model's own buckets, if it has any). The batch
        is padded with filler rows to a batch bucket, the prefill on the right to a context-encoding
        bucket, and the KV cache gets a token-generation bucket's slots (see _bucketed_shape).
    """
    start = time.perf_counter()
    config = model.config
    device = getattr(model, "device", torch.device("cpu"))
    check_request(prompts, params, max_new_tokens, config.vocab_size)
    stop = {int(t) for t in stop_token_ids}
    lengths = [len(p) for p in prompts]
    batch, longest = len(prompts), max(lengths)
    if buckets is None:
        buckets = getattr(model, "buckets", None)
    if cache is not None and max_seq_len is None and buckets is None:
        max_seq_len = cache.max_seq_len
    if buckets is None:
        rows, width = batch, longest
        slots = cache_length(lengths, max_new_tokens, config.max_position_embeddings, max_seq_len)
    else:
        cache_length(lengths, max_new_tokens, config.max_position_embeddings, max_seq_len)  # limits only
        shape = request_shape(buckets, lengths, max_new_tokens)
        rows, width, slots = shape.batch, shape.context, shape.cache

    with torch.inference_mode():
        if cache is None:
            cache = model.new_cache(rows, slots)
        else:
            if cache.batch != rows or cache.max_seq_len != slots:
                raise ValueError(
                    f"the given KV cache holds batch {cache.batch} x {cache.max_seq_len} slots but this "
                    f"request needs batch {rows} x {slots}"
                )
            cache.reset()
        params = _shared_seeds(model, params)
        generators = [make_generator(p, device) for p in params]

        # Left padding: row i's real tokens occupy slots pad[i] .. longest - 1. Filler rows (batch
        # bucket padding) hold no real token: pad = longest. Columns longest .. width - 1 (context
        # bucket padding) are filler too: they write cache slots that decode overwrites before any
        # query may read them (a query reads only slots <= its own), and their logits are not used.
        # Every padding column takes a position between 0 and its row's last real one, so a row's
        # largest position is its real one (longrope chooses its factors by it: workers/rope.py).
        pad = torch.tensor([longest - n for n in lengths] + [longest] * (rows - batch))  # (rows,)
        last = torch.tensor([n - 1 for n in lengths] + [0] * (rows - batch))  # (rows,) last real position
        input_ids = torch.full((rows, width), pad_token_id, dtype=torch.int64)
        for i, prompt in enumerate(prompts):
            input_ids[i, pad[i]:longest] = torch.tensor(prompt, dtype=torch.int64)
        slot_ids = torch.arange(slots)
        attention_mask = slot_ids[None, :] >= pad[:, None]  # (rows, slots): false on left padding
        position_ids = torch.minimum(torch.arange(width)[None, :] - pad[:, None], last[:, None]).clamp(min=0)
        # The last real column's logits; bucketed runs always pass it, so one graph serves a bucket.
        logit_index = None if buckets is None else torch.tensor([longest - 1], device=device)
        # Everything the model reads lives on its device (built on the host once per request).
        input_ids, slot_ids, attention_mask, position_ids = (
            t.to(device) for t in (input_ids, slot_ids, attention_mask, position_ids))

        logits = model(input_ids, position_ids, cache, slot_ids[:width], attention_mask, logit_index)[:batch]
        stops = [stop] * batch  # held back from rows short of their min_tokens
        tokens = sample(penalized(logits, params, prompts, [()] * batch, stops), params, generators)  # (batch,)
        first_token_time = time.perf_counter()

        outputs = [GenerationOutput([], "length", n, first_token_time - start, 0.0) for n in lengths]
        finish_time = [first_token_time] * batch
        done = [False] * batch
        row_logits: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        step_latency = 0.0
        positions = torch.tensor(lengths + [0] * (rows - batch), dtype=torch.int64, device=device)[:, None]  # (rows, 1)
        filler = (torch.full((rows - batch,), pad_token_id, dtype=torch.int64, device=device)
                  if rows > batch else None)
        for step in range(max_new_tokens):
            now = time.perf_counter()
            for i, token in enumerate(tokens.tolist()):
                if done[i]:
                    continue
                outputs[i].token_ids.append(token)
                outputs[i].token_times_s.append(now)
                if return_logits:
                    row_logits[i].append(logits[i].float().cpu())
                if len(outputs[i].token_ids) > 1:
                    outputs[i].decode_step_latencies_s.append(step_latency)
                finish_time[i] = now
                if token in stop:
                    outputs[i].finish_reason, done[i] = "stop", True
                elif len(outputs[i].token_ids) == max_new_tokens:
                    done[i] = True
            if all(done):
                break
            slot = longest + step
            step_start = time.perf_counter()
            step_ids = (tokens if filler is None else torch.cat((tokens, filler)))[:, None]  # (rows, 1)
            logits = model(step_ids, positions + step, cache, slot_ids[slot:slot + 1], attention_mask)[:batch]
            tokens = _sample_running(logits, tokens, done, params, prompts, outputs, stops, generators)
            step_latency = time.perf_counter() - step_start

    for i, out in enumerate(outputs):
        decoded = len(out.token_ids) - 1
        elapsed = finish_time[i] - first_token_time
        out.decode_tokens_per_s = decoded / elapsed if decoded > 0 and elapsed > 0 else 0.0
        if return_logits:
            out.logits = torch.stack(row_logits[i])
    return outputs


def _sample_running(logits: torch.Tensor, tokens: torch.Tensor, done: list[bool], params: list[SamplingParams],
                    prompts: list[list[int]], outputs: list[GenerationOutput], stops: list[set[int]],
                    generators: list) -> torch.Tensor:
    """The next token of each row (batch,): chosen for the rows still running; a finished row feeds
    its last token again. Its logits stay out of the penalties and of sample's check, which refuses a
    batch with any row's logits NaN or infinite: a finished row that keeps decoding can overflow
    (float16), and must not fail the others. Each running row draws from its own generator, so its
    tokens are those it gets when every row runs."""
    running = [i for i, finished in enumerate(done) if not finished]
    if len(running) == len(done):  # the usual step: the logits as they are, no gathered copy
        return sample(penalized(logits, params, prompts, [o.token_ids for o in outputs], stops), params,
                      generators)

    def pick(per_row: list) -> list:
        return [per_row[i] for i in running]

    # on the device that samples: an XLA device's logits are still lazy here, and an index of each new
    # count of running rows would be another graph to compile (sample moves them there itself)
    host = sampling_device(logits.device)
    rows = torch.tensor(running, device=host)
    chosen = sample(penalized(logits.to(host)[rows], pick(params), pick(prompts), pick([o.token_ids for o in outputs]),
                              pick(stops)), pick(params), pick(generators))
    tokens = tokens.clone()
    tokens[rows.to(tokens.device)] = chosen.to(tokens.device)
    return tokens
