"""The checks of one generate request (prompts as token ids, sampling params, max_new_tokens).

One copy, so a request refused by the driver API, the CLI or a rank's engine is refused with the
same message. Pure: token ids and counts only (SamplingParams objects are counted here, and their
logit bias's token ids held against the vocabulary; they check their own fields when built).
"""

from __future__ import annotations

import operator
from typing import Sequence

from shardlib.positive_int import integer_of_any_kind, positive_int


def check_request(prompts: Sequence[Sequence[int]], params: Sequence, max_new_tokens: int,
                  vocab_size: int) -> None:
    """ValueError unless: at least one prompt, each a non-empty list of token ids in
    [0, vocab_size), one SamplingParams per prompt, max_new_tokens a positive int (not a bool), and
    each SamplingParams' min_tokens at most max_new_tokens and logit bias, allowed token ids and bad
    words' token ids naming tokens of the vocabulary (bad words tokenized: their ids filled)."""
    check_prompts(prompts, vocab_size)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams; pass one per prompt")
    positive_int("max_new_tokens", max_new_tokens)
    for p in params:
        if getattr(p, "min_tokens", 0) > max_new_tokens:  # the request would end at max_new_tokens all the same
            raise ValueError(f"min_tokens ({p.min_tokens}) must be at most max_new_tokens ({max_new_tokens}); "
                             f"lower min_tokens or raise max_new_tokens")
        # indexing the logits with any of these failed the leader's step (vLLM refuses them too)
        _refuse_outside("logit_bias", [token for token, _ in getattr(p, "logit_bias", ())], vocab_size)
        _refuse_outside("allowed_token_ids", getattr(p, "allowed_token_ids", None) or (), vocab_size)
        _check_bad_words(p, vocab_size)


def _refuse_outside(name: str, ids, vocab_size: int) -> None:
    """ValueError naming the first ids (in their order) of `name` outside [0, vocab_size)."""
    outside = [token for token in ids if token >= vocab_size]
    if outside:
        raise ValueError(f"{name} names token ids {outside[:5]} outside the vocabulary [0, {vocab_size}); "
                         f"were they taken from another model's tokenizer?")


def _check_bad_words(p, vocab_size: int) -> None:
    """ValueError for bad_words the driver has not tokenized (nothing would be banned: the ranks see
    token ids only) or bad-word token ids outside the vocabulary (indexing the logits would fail)."""
    sequences = getattr(p, "bad_words_token_ids", ())
    if getattr(p, "bad_words", ()) and not sequences:
        raise ValueError(f"bad_words {list(p.bad_words[:5])!r} have no token ids (bad_words_token_ids): the "
                         f"driver API (launcher/api.py) tokenizes them; submit the request through it")
    _refuse_outside("bad_words_token_ids", sorted({token for sequence in sequences for token in sequence}),
                    vocab_size)


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> None:
    """ValueError unless there is at least one prompt and each is a non-empty list of token ids
    in [0, vocab_size)."""
    if len(prompts) == 0:
        raise ValueError("generate needs at least one prompt; got an empty list")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        not_ids = [t for t in prompt if not is_token_index(t)]
        if not_ids:
            raise ValueError(f"prompt {i} holds {not_ids[:5]!r}, which are not token ids; pass integers "
                             f"(not bools or floats)")
        bad = [t for t in prompt if not 0 <= operator.index(t) < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} holds token ids {bad[:5]} outside the vocabulary [0, {vocab_size}); "
                             f"were they tokenized for another model?")


def check_stop_token_ids(stop_token_ids: Sequence[int] | None, vocab_size: int) -> tuple[int, ...]:
    """The stop token ids as a tuple of ints (None: none, vLLM's default); ValueError unless each is
    an integer (numpy's and torch's included) in [0, vocab_size): one outside could never be
    generated, and the request would silently run to its length."""
    if stop_token_ids is None:
        return ()
    if isinstance(stop_token_ids, (str, bytes)) or not hasattr(stop_token_ids, "__iter__"):
        raise ValueError(f"stop_token_ids ({stop_token_ids!r}) must be a list of token ids")
    ids = tuple(stop_token_ids)
    bad = [t for t in ids if not is_token_index(t) or not 0 <= operator.index(t) < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids {bad[:5]!r} must be integers in [0, {vocab_size}) (the vocabulary)")
    return tuple(operator.index(t) for t in ids)


def is_token_index(value) -> bool:
    """An integer of any kind (numpy's and torch's included), but not a bool (a 0-d torch bool
    tensor indexes as 0 or 1)."""
    return integer_of_any_kind(value) is not None


def check_fits(prompts: Sequence[Sequence[int]], max_new_tokens: int, limit: int, limit_name: str, *,
               new_tokens_name: str = "max_new_tokens", fix: str | None = None) -> None:
    """ValueError naming the first prompt whose tokens plus max_new_tokens exceed `limit` positions.

    limit_name: what the limit is, e.g. "seq_len" or "the model's max_position_embeddings".
    new_tokens_name: how the caller spells max_new_tokens (the CLI's check says --num-tokens).
    fix: the way out; default: shorten the prompt or lower new_tokens_name.
    """
    for i, ids in enumerate(prompts):
        needed = len(ids) + max_new_tokens
        if needed > limit:
            which = "the prompt" if len(prompts) == 1 else f"prompt {i}"
            raise ValueError(
                f"{which} has {len(ids)} tokens; with {new_tokens_name} {max_new_tokens} that needs {needed} "
                f"positions but {limit_name} is {limit}: "
                f"{fix or f'shorten the prompt or lower {new_tokens_name}'}")
