"""A request's logits changed before its token choice: every token but its allowed token ids
removed, its bad words' tokens banned, its stop tokens held back until min_tokens, its logit bias,
then repetition, frequency and presence penalties (what it has seen).

Applied before temperature, top-k, top-p and min-p, and before a greedy row's argmax (they change
which token is most likely), in vLLM's order, with the meanings OpenAI's API and vLLM give them:
- allowed_token_ids (vLLM's): every other token is -inf (one masked fill of the row, with a mask
  made once per set of ids), so none of the rest can lift it back;
- bad_words (vLLM's, after allowed_token_ids as vLLM's sampler applies them): each word's token
  sequence (tokenized by the driver) bans its last token, -inf, when the tokens generated just before
  equal the rest of it (a one-token word: at every step); the prompt does not count;
- min_tokens: until that many tokens are generated, the stop tokens (EOS included) are -inf;
- logit_bias: a fixed number added to the logit of each token it names;
- repetition_penalty r (transformers' and vLLM's): every token of the prompt or of the output so
  far has its logit divided by r when positive, multiplied by r otherwise (r > 1 discourages);
- frequency_penalty f: subtracts f times the number of times the token was generated so far;
- presence_penalty p: subtracts p once from every token generated at least once.
Frequency and presence count the generated tokens only, never the prompt. Returned log-probabilities
stay the model's own (before any of these), as vLLM reports them by default.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence

import torch

from shardlib.sampling_params import AllowedIds, SamplingParams, no_token_left
from workers.sampling import sampling_device

FLOAT32_MAX = torch.finfo(torch.float32).max
ALLOWED_MASKS_KEPT = 16
"""Masks of allowed_token_ids kept (one bool per vocabulary entry each: 150 KB for 150k tokens): a
request's mask is made at its first step and found again at every other (clients sending one fixed
set, a label list say, make it once). The cache also keeps each set's ids as its key: about 9 MB for
the largest set a request may send (262144 ids), so at most about 150 MB for 16 such sets. A
request's set holds its entry (AllowedIds.mask_entry), which lets go of both the mask and the key
when it leaves the cache: no mask or key outlives its place there."""


def penalized(logits: torch.Tensor, params: list[SamplingParams], prompts: Sequence[Sequence[int] | torch.Tensor],
              outputs: Sequence[Sequence[int]], stops: Sequence[Collection[int]] = ()) -> torch.Tensor:
    """logits (batch, vocab) with each row's logit bias and penalties applied, given row i's prompt
    token ids (a sequence, or an int64 tensor the caller keeps: a long prompt converted every decode
    step cost most of the pass), the tokens it has generated so far and its stop token ids stops[i]
    (held back while it has generated fewer than its min_tokens); the same tensor when no row asks for any of these
    (the common case costs one pass over the params), else a float32 copy. Penalised values are
    kept finite: a tiny repetition penalty dividing a large logit (or a large one multiplying a
    negative logit) would overflow float32, and an infinite logit fails the row's token choice.
    ValueError for a row with allowed_token_ids left with none to choose by its bad words and held
    stop tokens (_check_tokens_left)."""
    if not any(p.adjusts_logits(len(generated)) for p, generated in zip(params, outputs)):
        return logits
    # float32 throughout, as the sampling that follows computes; on the host for a device without
    # generators (XLA: sampling draws there too), and never the caller's tensor (log-probabilities
    # are taken from it)
    out = logits.to(sampling_device(logits.device), torch.float32, copy=True)
    device = out.device
    banned = [_bad_tokens_due(p, generated) for p, generated in zip(params, outputs)]
    held = [_stops_held(p, generated, stops[i] if stops else ()) for i, (p, generated)
            in enumerate(zip(params, outputs))]
    _check_tokens_left(params, outputs, banned, held)
    _keep_allowed(out, params)
    _ban_bad_words(out, banned)
    _hold_stops(out, held)
    _add_bias(out, params)
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return out.to(logits.device)
    # Only the tokens a row has seen change, a few hundred of a vocabulary of tens of thousands:
    # those columns are gathered, penalised and written back for all rows at once (a row at a time
    # cost about 0.35 ms each, whole-vocabulary passes for 16 rows about 20 ms: README, Measured).
    generated = [_ids(outputs[i]) for i in rows]  # each converted once: the counts and the history use it
    histories = [torch.cat((_ids(prompts[i]), tokens)) for i, tokens in zip(rows, generated)]
    seen = [j for j, h in enumerate(histories) if len(h)]  # nothing seen: nothing to penalise
    if not seen:
        return out.to(logits.device)
    rows, histories, generated = [rows[j] for j in seen], [histories[j] for j in seen], [generated[j] for j in seen]
    # a row's columns filled out with its own first token: writing one column twice writes one value
    columns = torch.nn.utils.rnn.pad_sequence(histories, batch_first=True, padding_value=-1)
    columns = torch.where(columns < 0, columns[:, :1], columns).to(device)
    # times each column's token was generated: counted over the vocabulary (one pass, whatever the
    # history's length), read at the columns; the padding's counts land past the vocabulary
    vocab = out.shape[-1]
    generated = torch.nn.utils.rnn.pad_sequence(generated, batch_first=True, padding_value=vocab).to(device)
    counts = torch.zeros(len(rows), vocab + 1, device=device).scatter_add_(
        1, generated, torch.ones(generated.shape, device=device)).gather(1, columns)
    r, f, p = (torch.tensor([[getattr(params[i], name)] for i in rows], device=device)
               for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"))
    at = (torch.tensor(rows, device=device)[:, None], columns)
    values = out[at]
    finite = values.isfinite()  # a broken forward's NaN or inf stays for the token choice to report
    # a penalty of 1 or 0 leaves a value exactly as it was: x / 1, x * 1 and x - 0 are x
    penalised = torch.where(values > 0, values / r, values * r) - (f * counts + p * (counts > 0))
    out[at] = torch.where(finite, penalised.clamp(-FLOAT32_MAX, FLOAT32_MAX), values)
    return out.to(logits.device)


def _bad_tokens_due(p: SamplingParams, generated: Sequence[int]) -> list[int]:
    """The row's bad-word tokens banned at this step: a sequence's last token where the generated
    tokens end with the sequence's other tokens (vLLM's rule: the prompt is not looked at, and a
    sequence longer than the output plus one never matches; a one-token word: at every step)."""
    if not p.bad_words_token_ids:
        return []
    tail = list(generated[-max(len(seq) for seq in p.bad_words_token_ids):])  # the tail that matters
    due = []
    for sequence in p.bad_words_token_ids:
        before = len(sequence) - 1
        if before <= len(tail) and (before == 0 or tail[len(tail) - before:] == list(sequence[:-1])):
            due.append(sequence[-1])
    return due


def _stops_held(p: SamplingParams, generated: Sequence[int], stops: Collection[int]) -> Collection[int]:
    """The row's stop tokens held back at this step: all of them while it has generated fewer than
    its min_tokens, else none."""
    return stops if p.min_tokens > len(generated) else ()


def _check_tokens_left(params: list[SamplingParams], outputs: Sequence[Sequence[int]],
                       banned: Sequence[Sequence[int]], held: Sequence[Collection[int]]) -> None:
    """ValueError for a row whose allowed_token_ids are each banned now by its bad words or held
    back by its min_tokens: every logit would be -inf, which the token choice reports as a broken
    forward (the row fails alone in the serving loop, with this error naming its fields instead).
    Checked on the ids before any ban: no pass over the logits, no wait for the device, and as
    cheap as len() where the allowed ids outnumber the removed ones."""
    for i, p in enumerate(params):
        allowed = p.allowed_token_ids
        if allowed is None or not (banned[i] or held[i]):
            continue
        removed = set(banned[i]).union(held[i])
        if no_token_left(allowed, removed):
            raise ValueError(_nothing_left(p, len(outputs[i]), set(banned[i]), held[i]))


def _nothing_left(p: SamplingParams, generated: int, banned: set[int], held: Collection[int]) -> str:
    """Why no allowed token is left at this step, naming the fields that removed them and the fix."""
    allowed, to_go = p.allowed_token_ids, p.min_tokens - generated
    shown = list(allowed[:5])
    if no_token_left(allowed, held):
        return (f"no token is left to choose: allowed_token_ids {shown} are all stop tokens, which min_tokens "
                f"({p.min_tokens}) holds back for {to_go} more tokens; allow other tokens too, or lower min_tokens")
    if no_token_left(allowed, banned):
        return (f"no token is left to choose: bad_words ban every one of allowed_token_ids {shown} here; allow "
                f"other tokens too, or ban fewer words")
    return (f"no token is left to choose: allowed_token_ids {shown} are each banned here by bad_words (token ids "
            f"{sorted(banned.intersection(allowed))[:5]}) or a stop token, which min_tokens ({p.min_tokens}) holds "
            f"back for {to_go} more tokens; allow other tokens too, ban fewer words, or lower min_tokens")


def _keep_allowed(out: torch.Tensor, params: list[SamplingParams]) -> None:
    """-inf in place for every token outside each row's allowed_token_ids (rows without them are
    not touched)."""
    for i, p in enumerate(params):
        if p.allowed_token_ids is not None:
            out[i].masked_fill_(_forbidden(p.allowed_token_ids, out.shape[-1], out.device), float("-inf"))


def _ban_bad_words(out: torch.Tensor, banned: Sequence[Sequence[int]]) -> None:
    """-inf in place for each row's bad-word tokens due now (_bad_tokens_due): one index_put for all rows."""
    at_rows = [i for i, tokens in enumerate(banned) for _ in tokens]
    if not at_rows:
        return
    device = out.device
    at_tokens = [token for tokens in banned for token in tokens]
    out.index_put_((torch.tensor(at_rows, device=device), torch.tensor(at_tokens, device=device)),
                   torch.tensor(float("-inf"), device=device))


class _MaskEntry:
    """One set's mask in the cache and the key it is kept under, both let go of when it leaves the
    cache (the sets still holding the entry then look themselves up again)."""

    __slots__ = ("key", "forbidden")

    def __init__(self, key: tuple[AllowedIds, int, torch.device], forbidden: torch.Tensor) -> None:
        self.key: tuple[AllowedIds, int, torch.device] | None = key
        self.forbidden: torch.Tensor | None = forbidden


_masks: OrderedDict[tuple[AllowedIds, int, torch.device], _MaskEntry] = OrderedDict()
"""The masks kept, by (set, logits' width, device), least recently used first."""
_masks_lock = threading.Lock()
"""One look-up at a time, as functools.lru_cache kept it before: the leader chooses tokens on one
thread, but one process may run several serving loops (the tests', the in-process benchmark's)."""


def _forbidden(allowed: AllowedIds, vocab: int, device: torch.device) -> torch.Tensor:
    """(vocab,) bool: True for every token outside `allowed` (sorted ids), on `device`; made once per
    set while it stays among the ALLOWED_MASKS_KEPT most recently used. A set's later steps go
    straight to its entry, and its hash is computed once (AllowedIds): the look-up costs a set of
    262144 ids what it costs one of 10 (a plain tuple hashed every step cost 0.64 ms a row). A
    request sending a set another made compares the two once, at its first step. ValueError for ids
    past the logits' width (the driver checks them against the vocabulary first)."""
    if not isinstance(allowed, AllowedIds):  # SamplingParams makes them so; anything else is looked up
        allowed = AllowedIds(allowed)
    with _masks_lock:
        entry = allowed.mask_entry
        if entry is None or entry.key is None or entry.key[1:] != (vocab, device):
            key = (allowed, vocab, device)
            entry = _masks.get(key)  # another request's equal set: compared once, here
            if entry is None:
                entry = _kept(_MaskEntry(key, _mask(allowed, vocab, device)))
            allowed.mask_entry = entry
        _masks.move_to_end(entry.key)  # hashes the set's stored hash, compares it by identity
        return entry.forbidden


def _kept(entry: _MaskEntry) -> _MaskEntry:
    """entry, now in the cache; the least recently used one out past ALLOWED_MASKS_KEPT."""
    _masks[entry.key] = entry
    while len(_masks) > ALLOWED_MASKS_KEPT:
        _, gone = _masks.popitem(last=False)
        gone.key = gone.forbidden = None
    return entry


def _mask(allowed: tuple[int, ...], vocab: int, device: torch.device) -> torch.Tensor:
    """(vocab,) bool, True outside `allowed`; ValueError for ids past the logits' width."""
    if allowed[-1] >= vocab:
        raise ValueError(f"allowed_token_ids names token ids {[t for t in allowed if t >= vocab][:5]} outside the "
                         f"logits' {vocab} columns; send ids of this model's tokenizer")
    forbidden = torch.ones(vocab, dtype=torch.bool)
    forbidden[torch.tensor(allowed, dtype=torch.int64)] = False
    return forbidden.to(device)


def _hold_stops(out: torch.Tensor, held: Sequence[Collection[int]]) -> None:
    """-inf for each row's stop tokens held back (_stops_held). An id outside the logits' width (an
    end-of-sequence id a checkpoint's files name past its vocabulary) can never be chosen, so there
    is nothing to hold: it raised an IndexError that failed the request, and a static batch's ended
    the serving loop (a negative one held the last column)."""
    vocab = out.shape[-1]
    for i, stops in enumerate(held):
        inside = sorted(t for t in stops if 0 <= t < vocab)
        if inside:
            out[i, torch.tensor(inside, dtype=torch.int64, device=out.device)] = float("-inf")


def _add_bias(out: torch.Tensor, params: list[SamplingParams]) -> None:
    """Each row's logit bias added in place (a few entries each: one index_put for all rows). A
    biased value stays finite: float32 logits are far from its range's edge."""
    at_rows, at_tokens, biases = [], [], []
    for i, p in enumerate(params):
        for token, bias in p.logit_bias:
            at_rows.append(i)
            at_tokens.append(token)
            biases.append(bias)
    if biases:
        device = out.device
        out.index_put_((torch.tensor(at_rows, device=device), torch.tensor(at_tokens, device=device)),
                       torch.tensor(biases, device=device), accumulate=True)


def _ids(tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Token ids as an int64 tensor on the host (a tensor passes as it is)."""
    if isinstance(tokens, torch.Tensor):
        return tokens
    return torch.tensor(tokens, dtype=torch.int64) if len(tokens) else torch.empty(0, dtype=torch.int64)

