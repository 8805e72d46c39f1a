"""Per-request token selection: greedy, temperature, top-k, top-p, min-p.

Each request carries its own `SamplingParams`; a batch is turned into one (batch, 4) table of
(top_k, top_p, temperature, min_p), NxD Inference's layout with min_p added, and every row is
filtered by its own values in one vectorised pass. Filters apply in the order temperature, top-k,
top-p, min-p, as transformers' generate() applies them (penalties come before all of them:
workers/penalties.py).

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


GENERATOR_DEVICES = ("cpu", "cuda")
"""Device types whose tensors are drawn from where they are: torch.Generator exists for these; an
XLA device (Neuron's eager path) has none, so its logits are drawn from on the host."""


def sampling_device(device: torch.device | str) -> torch.device:
    """Where a model on `device` draws its tokens (and keeps their generators)."""
    device = torch.device(device)
    return device if device.type in GENERATOR_DEVICES else torch.device("cpu")


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded from params.seed, or None (draw from torch's global generator)."""
    if params.seed is None:
        return None
    # a hash of the whole seed: torch's CPU generator (mt19937) keeps only a seed's low 32 bits, so
    # seeds 1 and 2**32 + 1 drew the same tokens, as did -2**63 and 0 (read modulo 2**64)
    return torch.Generator(device=sampling_device(device)).manual_seed(hashed_seed(str(params.seed)))


def hashed_seed(key: str) -> int:
    """A generator seed from `key` (a request's seed, or its seed and draw number): a hash, so
    neighbouring keys give unrelated streams and every bit of the key counts."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # torch takes seeds below 2**63


TOP_K_CAP = 2**24
"""top_k as the table holds it: at most this, the largest range of integers float32 holds exactly
and more than any vocabulary (a larger k keeps every token all the same; 1e39 would be infinite)."""


def sampling_table(params: list[SamplingParams], device: torch.device | str = "cpu") -> torch.Tensor:
    """(batch, 4) float32 rows of (top_k, top_p, temperature, min_p); top_k capped at TOP_K_CAP."""
    return torch.tensor([[min(p.top_k, TOP_K_CAP), p.top_p, p.temperature, p.min_p] for p in params],
                        dtype=torch.float32, device=device)


def filtered_probs(logits: torch.Tensor, table: torch.Tensor,
                   largest: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities after temperature, top-k, top-p and min-p, in descending-logit order.

    logits (batch, vocab), table (batch, 4). Returns probs (batch, width) sorted by logit, equal
    logits by token id, and the token id of each sorted column (batch, width); a row's kept tokens
    are a prefix of its columns, the same tokens in the same order whatever the other rows ask for.
    width is the vocabulary, or fewer columns when every row's kept tokens lie among fewer (every
    row has a top_k, or its top-p keeps tokens only among its TOP_P_WIDTHS most likely). As in transformers and vLLM, top-k keeps every token whose logit equals the k-th
    largest (ties at the cut included), top_p 1 keeps every token, and min-p keeps the tokens at
    least min_p times as likely as the most likely (which always stays). Rows with temperature 0
    are not divided, only shifted by their largest (the caller takes their argmax).

    Rows with top-p, no top-k and a temperature of at most 1 first try the TOP_P_WIDTHS most likely
    columns (topk, no sort of the vocabulary), each row by itself; a row whose kept tokens reach
    past them, or into a tie there, is filtered over the whole sorted vocabulary, as is every other
    row. The tokens, their order and their probabilities are the same either way, up to float
    rounding at the top-p cut (the full sort takes softmax's probabilities, this exp(v - logsumexp):
    a few tokens where the running total crosses top_p can be kept by one and not the other).
    largest (batch, 1): each row's largest logit, where the caller has it (sample's greedy pass).
    """
    vocab = logits.shape[-1]
    scaled = _scaled(logits, table[:, 2:3], largest)
    # Above temperature 1 a real model's distribution is flat enough that top-p keeps thousands of
    # tokens (SmolLM2 at 1.5: up to 14,000 for 0.95): such rows go straight to the full sort.
    pending = (((table[:, 0] <= 0) | (table[:, 0] >= vocab)) & (table[:, 1] < 1) & (table[:, 2] <= 1)).nonzero().flatten()
    parts = []  # (rows, probs, ids)
    for width, wider in zip(TOP_P_WIDTHS, TOP_P_WIDTHS[1:] + (vocab,)):
        if not len(pending) or width >= vocab:
            break
        probs, ids, fits, mass, smallest = _top_p_prefix(scaled[pending], table[pending], width)
        parts.append((pending[fits], probs[fits], ids[fits]))
        # Each column past these is at most as likely as the last of them: a row whose top_p exceeds
        # what the next width could hold at best goes to the full sort (flat rows skip the wider topk).
        beyond = mass + (min(wider, vocab) - width) * smallest < table[pending, 1]
        pending = pending[~fits & ~beyond]
    done = torch.cat([rows for rows, _, _ in parts]) if parts else pending[:0]
    rest = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    rest[done] = False
    if bool(rest.all()):
        return _sorted_probs(scaled, table)
    if bool(rest.any()):
        rows = rest.nonzero().flatten()
        parts.append((rows, *_sorted_probs(scaled[rows], table[rows])))
    width = max(probs.shape[-1] for _, probs, _ in parts)
    out_probs = scaled.new_zeros(logits.shape[0], width)
    out_ids = torch.zeros(logits.shape[0], width, dtype=torch.long, device=logits.device)
    for rows, probs, ids in parts:  # a row's columns past its own width: probability 0, never drawn
        out_probs[rows, :probs.shape[-1]] = probs
        out_ids[rows, :ids.shape[-1]] = ids
    return out_probs, out_ids


TOP_P_WIDTHS = (256, 2048)
"""Columns a top-p row tries before the whole sorted vocabulary. SmolLM2 on prose: top_p 0.9 kept a
median of 6 tokens at temperature 0.7 (at most 356) and 90 at temperature 1 (a tenth of positions
past 921, at most 3409). topk of 257 columns of 16 rows x 49152 took 2.6 ms, of 2049 about 11, a
stable sort of them 62 (machine Q, one thread): a row that fits neither pays both topk before
its sort."""


def _top_p_prefix(scaled: torch.Tensor, table: torch.Tensor, width: int):
    """filtered_probs of rows with top-p and no top-k over their `width` most likely columns:
    (probs, ids, fits, mass, smallest), fits (rows,) saying whose kept tokens all lie among columns strictly more
    likely than the (width + 1)-th, where the cut is certain (the others' probs are to be ignored).
    Probabilities are of the whole vocabulary's softmax, as the full sort has them; mass and
    smallest (rows,) are the columns' total and their last (least likely) column's, in it."""
    top_p, min_p = table[:, 1:2], table[:, 3:4]
    values, ids = scaled.topk(width + 1, dim=-1)
    above = (values > values[:, width:]).sum(dim=-1)  # columns strictly above the (width + 1)-th
    # a (width + 1)-th of -inf (structured output's masks leave few tokens finite): every token that
    # can be kept is among the first width, whatever the cut
    nothing_beyond = values[:, width] == float("-inf")
    values, ids = values[:, :width], ids[:, :width]
    by_id = ids.argsort(dim=-1)  # equal values in token-id order, as the stable full sort has them
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    order = values.sort(dim=-1, descending=True, stable=True).indices
    values, ids = values.gather(-1, order), ids.gather(-1, order)
    probs = (values - scaled.logsumexp(dim=-1, keepdim=True)).exp()
    rank = torch.arange(width, device=scaled.device)[None, :]
    keep = ((probs.cumsum(dim=-1) - probs) < top_p) | (rank == 0)
    if bool((min_p > 0).any()):
        keep &= probs >= min_p * probs[:, :1]
    fits = (keep.sum(dim=-1) < above) | nothing_beyond  # the first dropped column is among the certain ones
    return values.masked_fill(~keep, float("-inf")).softmax(dim=-1), ids, fits, probs.sum(dim=-1), probs[:, -1]


def _sorted_probs(scaled: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """filtered_probs over the sorted vocabulary (or the top-k columns when every row has a top_k)."""
    top_k, top_p, min_p = table[:, 0:1], table[:, 1:2], table[:, 3:4]  # (batch, 1) each
    sorted_logits, sorted_ids = _sorted(scaled, top_k)
    width = sorted_logits.shape[-1]
    rank = torch.arange(width, device=scaled.device)[None, :]  # (1, width)
    # the k-th largest logit of each row with a top_k: every column at or above it stays
    kth = sorted_logits.gather(-1, (top_k.clamp(min=1, max=width) - 1).long())
    keep = (top_k <= 0) | (sorted_logits >= kth)
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # A token stays when the mass strictly before it is below top_p; the most likely always stays.
    # top_p 1 keeps all: float32 sums of a long tail reach 1.0 before its end, and cut it off.
    mass_before = probs.cumsum(dim=-1) - probs
    keep &= (mass_before < top_p) | (rank == 0) | (top_p >= 1)
    # min-p after top-p, as transformers applies it: a ratio to the most likely token, which the
    # top-k renormalisation (and top-p's, in transformers) leaves as it is
    if bool((min_p > 0).any()):  # a (rows, width) pass only where some row asks for it
        keep &= probs >= min_p * probs[:, :1]
    probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    return probs, sorted_ids


def _scaled(logits: torch.Tensor, temperature: torch.Tensor, largest: torch.Tensor | None = None) -> torch.Tensor:
    """logits (batch, vocab) in float32 less each row's largest, over each row's temperature (batch, 1);
    temperature 0 divides by 1 (greedy: its argmax is taken).

    A per-row constant changes neither the softmax nor the order top-k, top-p and min-p keep, and
    with it every scaled value is at most 0: logits at float32's edge (a repetition penalty near its
    smallest puts them there) divided by a temperature below 1 no longer overflow to inf / inf (NaN).
    A row with no finite largest (all -inf) is left unshifted (-inf - -inf would be NaN). largest
    (batch, 1): each row's largest logit where the caller has it already (sample's greedy pass)."""
    logits = logits.float()
    top = (logits.max(dim=-1, keepdim=True).values if largest is None else largest).float()
    shifted = logits - torch.where(top.isfinite(), top, 0.0)  # a new tensor: divided in place
    return shifted.div_(torch.where(temperature > 0, temperature, 1.0))


def _sorted(scaled: torch.Tensor, top_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, width) logits in descending order, equal ones by ascending token id, and their ids.

    When every row limits itself to its top k, only the max-k best columns can be kept, plus any
    tied with a row's k-th: topk over them is ~40x cheaper than sorting a 49k-128k vocabulary every
    decode step. A tie crossing some row's cut (bfloat16 logits tie often) widens the topk to the
    columns that row keeps. topk orders equal values as it pleases, so they are put back in id order."""
    vocab = scaled.shape[-1]
    width = vocab if bool((top_k <= 0).any()) else min(vocab, int(top_k.max()))
    if width < vocab:
        # one column more than any row keeps: below every row's k-th, no tie crosses a cut
        values, ids = scaled.topk(width + 1, dim=-1)
        kth = values.gather(-1, (top_k.clamp(max=width) - 1).long())  # (batch, 1)
        # a row whose k-th is -inf (fewer allowed tokens than its k) ties nothing: -inf is never drawn
        can_tie = kth > float("-inf")
        if bool(((values[:, width:] < kth) | ~can_tie).all()):
            values, ids = values[:, :width], ids[:, :width]
        else:  # a tie at some row's cut: as many columns as the row keeping the most needs
            width = max(width, int(((scaled >= kth) & can_tie).sum(dim=-1).max()))
            if width < vocab:
                values, ids = scaled.topk(width, dim=-1)
    if width >= vocab:
        return scaled.sort(dim=-1, descending=True, stable=True)
    by_id = ids.argsort(dim=-1)
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    order = values.sort(dim=-1, descending=True, stable=True).indices
    return values.gather(-1, order), ids.gather(-1, order)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token id per row (batch,) int64 from logits (batch, vocab), each row by its own params.
    ValueError for a row whose logits hold a NaN or whose largest is infinite (a broken forward:
    greedy and sampled rows alike, rather than token 0 for one and a multinomial error for the other)."""
    batch = logits.shape[0]
    model_device = logits.device
    on_host = model_device.type not in GENERATOR_DEVICES  # checked, not moved, every decode step
    if on_host:
        logits = logits.cpu()
    if len(params) != batch or len(generators) != batch:
        raise ValueError(
            f"logits have {batch} rows but {len(params)} SamplingParams and {len(generators)} "
            f"generators were given; pass one of each per row"
        )
    # (batch,) greedy answer for every row. max's indices are argmax's (the first of equal maxima),
    # but on CPU it runs about 3x faster, every decode step (README, Measured: the leader's token
    # choice). Its values carry any NaN of the row, and say whether the row has a finite maximum.
    best = logits.max(dim=-1)
    finite = best.values.isfinite()
    if not bool(finite.all()):
        rows = (~finite).nonzero().flatten().tolist()
        raise ValueError(f"the model's logits in row(s) {rows} hold NaN or +inf, or no finite value, so no token "
                         f"can be chosen: the forward overflowed or the weights are broken (float16 overflows where "
                         f"bfloat16 does not; check the checkpoint and --dtype)")
    tokens = best.indices
    # Rows without top-k or top-p (OpenAI's defaults: top_p 1, no top_k) draw from the softmax in
    # token-id order, with no sort of the vocabulary (min-p, a ratio to the most likely token, needs
    # none); the others from their filtered, sorted columns.
    vocab = logits.shape[-1]
    whole, filtered = [], []
    for i, p in enumerate(params):
        if not p.is_greedy:
            (whole if (p.top_k <= 0 or p.top_k >= vocab) and p.top_p >= 1 else filtered).append(i)
    # Each request draws one number from its own generator per token, so its tokens do not depend on
    # which other requests share the batch (nor on how wide the others' filters made the columns).
    if whole:
        temperatures = torch.tensor([[params[i].temperature] for i in whole], device=logits.device)
        # every row (the usual batch): the logits as they are, not a gathered copy of them
        picked, largest = logits, best.values
        if len(whole) < batch:
            rows = torch.tensor(whole, device=logits.device)
            picked, largest = logits[rows], largest[rows]
        probs = _scaled(picked, temperatures, largest[:, None]).softmax(dim=-1)
        if any(params[i].min_p > 0 for i in whole):  # the draw is in proportion to what is left
            min_p = torch.tensor([[params[i].min_p] for i in whole], device=logits.device)
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        tokens[whole] = inverse_cdf(probs, uniforms([generators[i] for i in whole], logits.device))
    if filtered:
        rows = torch.tensor(filtered, device=logits.device)
        probs, sorted_ids = filtered_probs(logits[rows], sampling_table([params[i] for i in filtered], logits.device),
                                           best.values[rows][:, None])  # found once, for every row
        columns = inverse_cdf(probs, uniforms([generators[i] for i in filtered], logits.device))
        tokens[filtered] = sorted_ids.gather(-1, columns[:, None])[:, 0]
    return tokens.to(model_device) if on_host else tokens  # the next step's input


def uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One uniform number in [0, 1) per row, float64, each from its row's generator (None: torch's
    global one)."""
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=device) for g in generators])


INVERSE_CDF_BLOCK = 256
"""Columns per block in inverse_cdf's two-level running totals."""


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The column of each row of probs (rows, width) where its running total first passes u times
    the row's total: a draw in proportion to each column's probability from one number per row.
    torch.multinomial drew a random number per column (the draws of 16 rows of 49,152 took 16.6 ms
    on machine Q, against 0.8 ms here; the whole token choice: README, Measured). A column of probability 0 is never drawn: it adds nothing to the running total.

    The running totals are float64, in two levels: the sums of blocks of INVERSE_CDF_BLOCK columns,
    then the columns of the one block each row lands in: float32 running totals over a whole vocabulary step
    in units of their last place (6e-8 past 0.5), so each token of a model's long tail, thousands
    of them below that, got an interval of nothing or of a whole unit."""
    rows, width = probs.shape
    pad = (-width) % INVERSE_CDF_BLOCK
    blocks = torch.nn.functional.pad(probs, (0, pad)) if pad else probs
    blocks = blocks.reshape(rows, -1, INVERSE_CDF_BLOCK)
    # a block's own sum in float32 is exact to its last place; summing in float64 copied the rows first
    running = blocks.sum(dim=-1).to(torch.float64).cumsum(dim=-1)  # (rows, blocks)
    target = u[:, None].to(torch.float64) * running[:, -1:]
    block = _first_past(running, target)
    before = torch.where(block > 0, running.gather(-1, (block - 1).clamp(min=0)), 0.0)
    inside = blocks.gather(1, block[:, :, None].expand(rows, 1, INVERSE_CDF_BLOCK))[:, 0].to(torch.float64)
    column = _first_past(inside.cumsum(dim=-1), target - before)
    return (block * INVERSE_CDF_BLOCK + column)[:, 0]


def _first_past(running: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(rows, 1): the first column whose running total is above target, or, where rounding left
    the target at or past the total, the column that reached the total (the last one above 0)."""
    found = torch.searchsorted(running, target, right=True)
    last = (running < running[:, -1:]).sum(dim=-1, keepdim=True)
    return torch.minimum(found, last)
