"""The leader's choice of each row's next token, and the log-probabilities a request asked for."""

from __future__ import annotations

import random

import torch

from workers.penalties import penalized
from workers.sampling import hashed_seed, sample, sampling_device
from workers.serving.requests import TokenLogprob
from workers.serving.scheduler import Sequence
from workers.structured.token_masks import allowed_tokens, mask_rows


def request_generator(sequence: Sequence, device: torch.device) -> torch.Generator | None:
    """A generator of the request's own (None: greedy), reseeded before each of its draws by
    seed_draws(): a sampled request's tokens then depend neither on which other requests share its
    batch nor on whether its stream was resumed after a fault. Its base seed is the request's seed,
    or a random one (kept in sequence.seed)."""
    params = sequence.request.sampling
    if params.is_greedy:
        return None
    sequence.seed = params.seed if params.seed is not None else random.randrange(2**62)
    return torch.Generator(device=sampling_device(device))


def draw_seed(seed: int, draw: int) -> int:
    """The generator's seed for a request's draw number `draw` (0 for its first token): a hash of
    both, so neighbouring draws and neighbouring seeds give unrelated streams."""
    return hashed_seed(f"{seed}:{draw}")


def seed_draws(sequences: list[Sequence]) -> None:
    """Seed each sampled sequence's generator for the draw it is about to make."""
    for s in sequences:
        if s.generator is not None:
            s.generator.manual_seed(draw_seed(s.seed, s.request.draws_before + s.generated))


def choose(logits: torch.Tensor, sequences: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
    """Token per row of logits (rows, vocab) for sequences[i], and logprobs where asked for."""
    seed_draws(sequences)  # again for a choice redone (the leader's row by row retry): the same draw
    params = [s.request.sampling for s in sequences]
    scores = logits
    if any(s.request.sampling.adjusts_logits(s.request.draws_before + s.generated) for s in sequences):
        prompts, outputs = zip(*(_history(s) for s in sequences))
        scores = penalized(logits, params, prompts, outputs, [s.request.stop_token_ids for s in sequences])
    structured = [i for i, s in enumerate(sequences) if s.grammar is not None and s.grammar.active]
    if structured:  # after the penalties: min_tokens' held-back stop tokens stay held back
        allowed = allowed_tokens([sequences[i].grammar for i in structured], scores.shape[-1],
                                 [sequences[i].request.stop_token_ids for i in structured],
                                 [_grammar_ends_held(sequences[i]) for i in structured])
        scores = mask_rows(scores, structured, allowed)
    tokens = sample(scores, params, [s.generator for s in sequences]).tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(sequences)
    wanted = [i for i, s in enumerate(sequences) if s.request.logprobs is not None]
    if wanted:
        table = torch.log_softmax(logits[wanted].float(), dim=-1)
        widest = max(sequences[i].request.logprobs for i in wanted)
        top_values, top_ids = table.topk(widest, dim=-1) if widest else (None, None)
        for j, i in enumerate(wanted):
            n = sequences[i].request.logprobs
            top = ranked(table[j], top_ids[j, :n], top_values[j, :n]) if n else []
            logprobs[i] = TokenLogprob(tokens[i], float(table[j, tokens[i]]), top)
    return tokens, logprobs


def _grammar_ends_held(sequence: Sequence) -> tuple[int, ...]:
    """The grammar tokenizer's EOS ids while the request has fewer than min_tokens tokens: the
    penalties hold back only its stop_token_ids, which under ignore_eos leave EOS out, and the mask
    allows EOS wherever the grammar accepts, so a request ended before its min_tokens. With the
    request's stop ids too: held back together, and let through together where the grammar allows
    nothing else (EOS held alone left only the stop ids the penalties had put at -inf, and the row
    failed where the request used to end)."""
    request = sequence.request
    if request.sampling.min_tokens <= request.draws_before + sequence.generated:
        return ()
    return tuple(dict.fromkeys((*getattr(sequence.grammar, "ends", ()), *request.stop_token_ids)))


def _history(sequence: Sequence) -> tuple[torch.Tensor, list[int]]:
    """The request's prompt (an int64 tensor made once per request: converting a long prompt every
    step cost most of the penalties' time) and the tokens it generated so far: a resumed request's
    prompt ends with the tokens delivered before its group restarted, which are output, not prompt
    (frequency and presence penalties count them)."""
    prompt, before = sequence.prompt, sequence.request.draws_before
    cut = len(prompt) - before
    if sequence.prompt_ids is None:
        sequence.prompt_ids = torch.tensor(prompt[:cut], dtype=torch.int64)
    return sequence.prompt_ids, list(prompt[cut:]) + sequence.output_ids


def ranked(row: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> list[tuple[int, float]]:
    """The row's n most likely (id, logprob), equal ones by id as greedy choice takes them (the
    lowest first): topk orders ties as it likes, so a greedy token could be listed after its equals,
    and with ties at the cut it could keep any of them."""
    n = len(ids)
    if int((row >= values[-1]).sum()) > n:  # ties at the cut: a stable sort keeps the lowest ids
        values, ids = torch.sort(row, descending=True, stable=True)
    return sorted(zip(ids[:n].tolist(), values[:n].tolist()), key=lambda pair: (-pair[1], pair[0]))
