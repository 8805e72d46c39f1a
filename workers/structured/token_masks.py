"""Each structured row's allowed tokens, applied to its scores before the token is drawn."""

from __future__ import annotations

import numpy as np
import torch


def allowed_tokens(grammars: list, width: int, ending_ids: list[tuple[int, ...]]) -> torch.Tensor:
    """(rows, width) bool: the tokens each RequestGrammar (workers/structured/matchers.py) allows
    next. A grammar that would accept the output as it stands allows its tokenizer's EOS; the row's
    other ending ids (the model's other EOS ids, the request's stop tokens) are allowed then too,
    since ending there leaves a whole match."""
    words = max(max(g.words for g in grammars), (width + 31) // 32)
    bits = np.zeros((len(grammars), words), dtype=np.int32)
    for i, grammar in enumerate(grammars):
        grammar.write_mask(bits[i, :grammar.words])
    # Little-endian words read as bytes, each byte's bits from the lowest: token t at position t.
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :width]
    for i, grammar in enumerate(grammars):
        if ending_ids[i] and grammar.accepting():
            allowed[i, [t for t in ending_ids[i] if t < width]] = 1
    return torch.from_numpy(allowed).bool()


def mask_rows(scores: torch.Tensor, rows: list[int], allowed: torch.Tensor) -> torch.Tensor:
    """scores with every token the rows' grammars forbid at -inf (a copy: the raw logits stay as they
    were for the log-probabilities). ValueError when a row has no token left (the grammar allows only
    the end of the output, which min_tokens still holds back)."""
    index = torch.tensor(rows, device=scores.device)
    picked = scores.index_select(0, index).masked_fill(~allowed.to(scores.device), float("-inf"))
    alive = (picked > float("-inf")).any(dim=-1)
    if not bool(alive.all()):
        raise ValueError("no token is left that continues the structured output: the grammar allows only tokens "
                         "that the request's other settings remove (min_tokens holds back the end of text until "
                         "that many tokens; lower it, or give the output room to go on)")
    out = scores.clone()
    out.index_copy_(0, index, picked)
    return out
