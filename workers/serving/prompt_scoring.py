"""Prompt log-probabilities: each prompt token's log-probability given the tokens before it, and the
most likely tokens at its place (what OpenAI's completions `echo` with `logprobs` returns, and what
evaluation harnesses sum to score a continuation).

A scored chunk is prefilled alone, eagerly, at its exact length (model.score_step): the forward
writes the cache as any prefill does, and keeps every column's hidden state. Column j's logits
give the probabilities of the prompt's token after it. They are taken a block of columns at a time
(model.column_logits), so a chunk of 2048 tokens over a vocabulary of 150,000 never holds its
1.2 GB of logits at once; every rank takes each block (the LM head's gather over ranks is a
collective), and only the leader, which knows the prompt, reads them. The chunk's last column
gives the logits of the next token: the next chunk's first, or the first generated one.
"""

from __future__ import annotations

import torch

from workers.serving.requests import TokenLogprob
from workers.serving.step_inputs import prefill_inputs
from workers.serving.step_plan import PrefillChunk
from workers.serving.token_choice import ranked

SCORE_BLOCK = 128
"""Columns whose logits are held at once (128 x 49152 float32: 25 MB)."""


def prompt_targets(prompt: tuple[int, ...], chunk: PrefillChunk) -> tuple[int, ...]:
    """The prompt tokens the chunk's columns predict: column j's is the token after it (the last
    chunk's last column predicts the first generated token, no prompt token)."""
    start = chunk.start + 1
    return tuple(prompt[start: start + len(chunk.token_ids)])


def score_chunk(model, cache, chunk: PrefillChunk, scratch_row: int, cache_slots: int, device: torch.device,
                targets: tuple[int, ...] | None = None,
                top_n: int = 0) -> tuple[list[TokenLogprob], torch.Tensor]:
    """Prefill one scored chunk (every rank runs it alike). Returns (the entries of `targets`, one per
    target, each with its top_n most likely; [] where targets is None, as on a follower), and the
    last column's logits (vocab,)."""
    inputs = prefill_inputs([chunk], None, scratch_row, cache_slots).to(device)
    hidden = model.score_step(inputs.input_ids, inputs.position_ids, cache, inputs.cache_positions,
                              inputs.rows, inputs.read_slots)[0]  # (chunk length, hidden)
    length = hidden.shape[0]
    entries: list[TokenLogprob] = []
    last = None
    for a in range(0, length, SCORE_BLOCK):
        b = min(a + SCORE_BLOCK, length)
        logits = model.column_logits(hidden[a:b])
        if b == length:
            last = logits[-1].clone()  # its own storage: the block's goes
        if targets is not None and a < len(targets):
            k = min(b, len(targets)) - a
            entries.extend(token_entries(logits[:k], targets[a:a + k], top_n))
    return entries, last


def token_entries(logits: torch.Tensor, tokens: tuple[int, ...], top_n: int) -> list[TokenLogprob]:
    """TokenLogprob of tokens[i] under logits[i] (rows, vocab), with its rank and its top_n most likely."""
    table = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(tokens, dtype=torch.int64, device=table.device)
    chosen = table.gather(1, ids[:, None])  # (rows, 1)
    ranks = ((table > chosen).sum(dim=-1) + 1).tolist()
    chosen = chosen[:, 0].tolist()
    if not top_n:
        return [TokenLogprob(t, lp, rank=k) for t, lp, k in zip(tokens, chosen, ranks)]
    values, top_ids = table.topk(top_n, dim=-1)
    return [TokenLogprob(t, lp, ranked(table[i], top_ids[i], values[i]), k)
            for i, (t, lp, k) in enumerate(zip(tokens, chosen, ranks))]
