"""Each structured row's allowed tokens, applied to its scores before the token is drawn."""

from __future__ import annotations

import numpy as np
import torch


def allowed_tokens(grammars: list, width: int, ending_ids: list[tuple[int, ...]],
                   held_ends: list[tuple[int, ...]] | None = None) -> torch.Tensor:
    """(rows, width) bool: the tokens each RequestGrammar (workers/structured/matchers.py) allows
    next. A grammar that would accept the output as it stands allows its tokenizer's EOS; the row's
    other ending ids (the model's other EOS ids, the request's stop tokens) are allowed then too,
    since ending there leaves a whole match. held_ends[i]: the ids row i's min_tokens holds back
    beyond its ending ids (its grammar tokenizer's EOS, which the mask allows even under ignore_eos),
    removed where the grammar allows anything else (min_tokens holds the end back only where the
    output can go on)."""
    words = max(max(g.words for g in grammars), (width + 31) // 32)
    bits = np.zeros((len(grammars), words), dtype=np.int32)
    for i, grammar in enumerate(grammars):
        grammar.write_mask(bits[i, :grammar.words])
    # Little-endian words read as bytes, each byte's bits from the lowest: token t at position t.
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :width]
    for i, grammar in enumerate(grammars):
        if ending_ids[i] and grammar.accepting():
            allowed[i, [t for t in ending_ids[i] if t < width]] = 1
    for i, held in enumerate(held_ends or ()):
        _hold_back(allowed[i], [t for t in held if t < width])
    return torch.from_numpy(allowed.view(np.bool_))  # 0 and 1 bytes are bools as they are: no copy


def _hold_back(row: np.ndarray, ends: list[int]) -> None:
    """Clear `ends` in the row's allowed tokens, unless they are all it allows."""
    if ends:
        kept = row[ends]  # fancy indexing: a copy already
        row[ends] = 0
        if not row.any():  # only the end is left: the grammar cannot go on, so it may end
            row[ends] = kept


def mask_rows(scores: torch.Tensor, rows: list[int], allowed: torch.Tensor) -> torch.Tensor:
    """scores (a new tensor: the raw logits stay as they were for the log-probabilities) with every
    token the grammars of `rows` (ascending) forbid at -inf: with allowed_token_ids (already -inf
    outside them) the tokens both allow. ValueError when such a row has no token left (none the
    grammar allows is among its allowed_token_ids, or the grammar allows only the end of the output,
    which min_tokens still holds back)."""
    allowed = allowed.to(scores.device)
    if len(rows) == scores.shape[0]:  # every row structured: one pass, no copy of the others
        out = picked = torch.where(allowed, scores, float("-inf"))
    else:
        index = torch.tensor(rows, device=scores.device)
        picked = torch.where(allowed, scores.index_select(0, index), float("-inf"))
        out = scores.index_copy(0, index, picked)
    if not bool((picked.amax(dim=-1) > float("-inf")).all()):
        raise ValueError("no token is left that continues the structured output: the grammar allows only tokens "
                         "that the request's other settings remove (allowed_token_ids leaves out every token the "
                         "grammar allows next: allow them too; bad_words of one token ban each of them: remove those; "
                         "or min_tokens holds back the end of text, EOS and the request's stop_token_ids, until that "
                         "many tokens: lower it, take out of stop_token_ids a token the output needs, or give the "
                         "output room to go on)")
    return out
