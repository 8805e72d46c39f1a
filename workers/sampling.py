"""Per-request token selection: greedy, temperature, top-k, top-p.

Each request carries its own `SamplingParams`; a batch is turned into one (batch, 3) table of
(top_k, top_p, temperature), the layout NxD Inference uses, and every row is filtered by its own
values in one vectorised pass. Filters apply in the order temperature, top-k, top-p.

How tensor-parallel ranks agree on tokens without communicating: the LM head all-gathers the
logits, so every rank holds bit-identical (batch, vocab) logits; every rank builds its generators
from the same seeds; sampling is then the same deterministic computation on the same inputs, and
all ranks draw the same token. This holds only if no rank ever draws from an unseeded (global)
generator while the others draw from a seeded one: the engine gives every sampled row a seed that
all ranks agree on before the first step.
"""

from __future__ import annotations

import hashlib

import torch

from shardlib.sampling_params import SamplingParams  # re-exported: the ranks' code imports it from here


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded from params.seed, or None (draw from torch's global generator)."""
    if params.seed is None:
        return None
    # a hash of the whole seed: torch's CPU generator (mt19937) keeps only a seed's low 32 bits, so
    # seeds 1 and 2**32 + 1 drew the same tokens, as did -2**63 and 0 (read modulo 2**64)
    return torch.Generator(device=device).manual_seed(hashed_seed(str(params.seed)))


def hashed_seed(key: str) -> int:
    """A generator seed from `key` (a request's seed, or its seed and draw number): a hash, so
    neighbouring keys give unrelated streams and every bit of the key counts."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # torch takes seeds below 2**63


TOP_K_CAP = 2**24
"""top_k as the table holds it: at most this, the largest range of integers float32 holds exactly
and more than any vocabulary (a larger k keeps every token all the same; 1e39 would be infinite)."""


def sampling_table(params: list[SamplingParams], device: torch.device | str = "cpu") -> torch.Tensor:
    """(batch, 3) float32 rows of (top_k, top_p, temperature); top_k capped at TOP_K_CAP."""
    return torch.tensor([[min(p.top_k, TOP_K_CAP), p.top_p, p.temperature] for p in params], dtype=torch.float32,
                        device=device)


def filtered_probs(logits: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities after temperature, top-k and top-p, in descending-logit order.

    logits (batch, vocab), table (batch, 3). Returns probs (batch, width) sorted by logit and the
    token id of each sorted column (batch, width); width is the largest top_k when every row has
    one, else the vocabulary. Rows with temperature 0 are returned unscaled
    (the caller takes their argmax).
    """
    top_k, top_p, temperature = table[:, 0:1], table[:, 1:2], table[:, 2:3]  # (batch, 1) each
    vocab = logits.shape[-1]
    scaled = logits.float() / torch.where(temperature > 0, temperature, 1.0)
    # When every row limits itself to its top k, only the max-k best columns can ever be kept:
    # topk over them is ~40x cheaper than sorting a 49k-128k vocabulary every decode step, and the
    # kept set and its probabilities are the same as with the full sort.
    width = vocab if bool((top_k <= 0).any()) else min(vocab, int(top_k.max()))
    if width < vocab:
        sorted_logits, sorted_ids = scaled.topk(width, dim=-1)  # (batch, width), descending
    else:
        sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)  # (batch, vocab)
    rank = torch.arange(width, device=logits.device)[None, :]  # (1, width)
    keep = rank < torch.where(top_k > 0, top_k, width)
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # A token stays when the mass strictly before it is below top_p; the most likely always stays.
    mass_before = probs.cumsum(dim=-1) - probs
    keep &= (mass_before < top_p) | (rank == 0)
    probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    return probs, sorted_ids


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token id per row (batch,) int64 from logits (batch, vocab), each row by its own params."""
    batch = logits.shape[0]
    if len(params) != batch or len(generators) != batch:
        raise ValueError(
            f"logits have {batch} rows but {len(params)} SamplingParams and {len(generators)} "
            f"generators were given; pass one of each per row"
        )
    # (batch,) greedy answer for every row. max's indices are argmax's (the first of equal maxima,
    # a NaN where there is one), but on CPU it runs about 3x faster, every decode step (README,
    # Measured: the leader's token choice).
    tokens = logits.max(dim=-1).indices
    sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if not sampled_rows:
        return tokens
    rows = torch.tensor(sampled_rows, device=logits.device)
    probs, sorted_ids = filtered_probs(logits[rows], sampling_table([params[i] for i in sampled_rows],
                                                                     logits.device))
    for j, i in enumerate(sampled_rows):
        # Row by row: each request draws from its own generator, so its tokens do not depend on
        # which other requests share the batch.
        choice = torch.multinomial(probs[j], 1, generator=generators[i])
        tokens[i] = sorted_ids[j, choice[0]]
    return tokens
