"""The leader's choice of each row's next token, and the log-probabilities a request asked for."""

from __future__ import annotations

import random

import torch

from workers.sampling import make_generator, sample
from workers.serving.requests import TokenLogprob
from workers.serving.scheduler import Sequence


def request_generator(sequence: Sequence, device: torch.device) -> torch.Generator | None:
    """A generator of the request's own (its seed, or a fresh random one): a sampled request's tokens
    then do not depend on which other requests share its batch."""
    params = sequence.request.sampling
    if params.is_greedy:
        return None
    if params.seed is not None:
        return make_generator(params, device)
    return torch.Generator(device=device).manual_seed(random.randrange(2**62))


def choose(logits: torch.Tensor, sequences: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
    """Token per row of logits (rows, vocab) for sequences[i], and logprobs where asked for."""
    tokens = sample(logits, [s.request.sampling for s in sequences], [s.generator for s in sequences]).tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(sequences)
    wanted = [i for i, s in enumerate(sequences) if s.request.logprobs is not None]
    if wanted:
        table = torch.log_softmax(logits[wanted].float(), dim=-1)
        widest = max(sequences[i].request.logprobs for i in wanted)
        top_values, top_ids = table.topk(widest, dim=-1) if widest else (None, None)
        for j, i in enumerate(wanted):
            n = sequences[i].request.logprobs
            top = list(zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist())) if n else []
            logprobs[i] = TokenLogprob(tokens[i], float(table[j, tokens[i]]), top)
    return tokens, logprobs
