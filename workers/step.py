"""One forward step of the decoder, the single implementation every path runs.

Eager runs, the CPU's compiled graphs and the Neuron builder all call `run_step`. It is cut into
three parts a compiler can take whole or one at a time (`StepParts`):

- prologue: rotary cos/sin of each token's position, the attention mask, the embedding;
- layer: one decoder layer, the same function for every layer (weights are its inputs, so one
  compiled graph serves all of them);
- epilogue: the final norm and the LM head at one column, logits gathered over ranks.

A step either starts a sequence or continues it (`kv_caches`):
- None: the tokens are the whole history from slot 0 (a prefill). They attend over their own keys
  and values, and each layer's k and v come back for the caller to store. Nothing in the step
  depends on how long the cache is, so a compiled prefill graph serves every cache length.
- ([k per layer], [v per layer]): the new keys and values are written into the caches at
  `cache_positions`, and the tokens attend over the whole cache (decode, or any step after slot 0).

Collectives are calls of the model's Collectives object inside the layers (workers/collectives.py);
at TP 1 they are identities, so nothing here knows the TP degree.

Sequence parallelism (`model.sequence_parallel`, workers/sequence_parallel.py) changes only what a
multi-token step keeps between the parts: the prologue hands each layer this rank's block of the
tokens, every layer returns its block, and the whole sequence is gathered once before the epilogue.
Each part rebuilds the split from the sequence length it sees, so the parts stay separately compilable.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from workers.layers import DecoderLayer, KVSlots
from workers.sequence_parallel import split_for


def attention_bias_mask(max_seq_len: int, cache_positions: torch.Tensor,
                        attention_mask: torch.Tensor | None, window: int | None = None) -> torch.Tensor:
    """Boolean (batch, 1, seq, max_seq_len): query i may read slot j when j <= its own slot and
    slot j holds a real token (and, with a sliding window, j > its slot - window). A query always
    reads its own slot: padding queries would otherwise have no slot to read, and their softmax over
    nothing would be NaN, poisoning the cache.

    Slot distance is token distance on both cache layouts (workers/kv_cache.py): a static batch is
    padded on the left, so a row's tokens fill consecutive slots; a serving row starts at slot 0.

    cache_positions: (seq,) shared by the rows, or (batch, seq), each row at its own slots."""
    slots = torch.arange(max_seq_len, device=cache_positions.device)  # (max_seq_len,)
    positions = cache_positions if cache_positions.dim() == 2 else cache_positions[None]  # (batch or 1, seq)
    causal = slots[None, None, :] <= positions[:, :, None]  # (batch or 1, seq, max_seq_len)
    if window is not None:
        causal = causal & (slots[None, None, :] > positions[:, :, None] - window)
    own = slots[None, None, :] == positions[:, :, None]
    if attention_mask is None:
        return causal.unsqueeze(1)
    return ((causal & attention_mask[:, None, :].bool()) | own).unsqueeze(1)


def prologue(model, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
             cache_positions: torch.Tensor, sequence_parallel: bool = False):
    """(x (batch, seq, hidden), cos, sin (batch, seq, head_dim), mask (batch, 1, seq, slots)), the
    last three a tuple with one entry per attention kind of the model (workers/family_layers.py).

    attention_mask (batch, slots): true where a slot holds a real token; slots is the prompt's own
    length for a prefill from slot 0, the cache length otherwise. sequence_parallel: x is this rank's
    block of the tokens (the embedding's sum reduce-scattered), for a step of more than one token."""
    rope = [tables.lookup(position_ids, model.dtype) for tables in model.rotary]
    masks = tuple(attention_bias_mask(attention_mask.shape[1], cache_positions, attention_mask, kind.window)
                  for kind in model.attention_kinds)
    split = split_for(model.collectives, sequence_parallel, input_ids.shape[1])
    x = model.embed(input_ids, None if split is None else split.scatter_sum)
    return x, tuple(c for c, _ in rope), tuple(s for _, s in rope), masks


def layer(block: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
          k_cache: torch.Tensor | None, v_cache: torch.Tensor | None, cache_positions: torch.Tensor,
          rows: torch.Tensor | None = None, sequence_parallel: bool = False):
    """(x, k, v) after one decoder layer; caches None for a prefill from slot 0. sequence_parallel:
    x in and out is this rank's block of the tokens (cos holds the whole sequence's positions)."""
    kv = None if k_cache is None else KVSlots(k_cache, v_cache, cache_positions, rows)
    return block(x, cos, sin, mask, kv, split_for(block.attention.collectives, sequence_parallel, cos.shape[-2]))


def epilogue(model, x: torch.Tensor, logit_index: torch.Tensor | None) -> torch.Tensor:
    """Logits (batch, vocab_size) float32 at one column of each row of x: logit_index (1,) shared by
    the rows, (batch,) one per row, or None for the last."""
    if logit_index is None:
        last = x[:, -1, :]
    elif logit_index.numel() == 1:
        last = x.index_select(1, logit_index).squeeze(1)
    else:
        last = x[torch.arange(x.shape[0], device=x.device), logit_index]
    local = model.lm_head(model.norm(last))  # (batch, vocab_per_rank)
    logits = model.collectives.all_gather(local)[:, : model.config.vocab_size]
    cap = model.config.final_logit_softcapping
    return (logits if cap is None else torch.tanh(logits / cap) * cap).float()


class StepParts(NamedTuple):
    prologue: Callable = prologue
    layer: Callable = layer
    epilogue: Callable = epilogue


EAGER = StepParts()


def run_step(model, parts: StepParts, input_ids: torch.Tensor, position_ids: torch.Tensor,
             attention_mask: torch.Tensor, cache_positions: torch.Tensor,
             kv_caches: tuple[list[torch.Tensor], list[torch.Tensor]] | None,
             logit_index: torch.Tensor | None = None, rows: torch.Tensor | None = None):
    """(logits (batch, vocab) float32, [k per layer], [v per layer]); the lists are empty when
    kv_caches is given (the caches were written in place). See the module docstring.

    rows (batch, seq): the cache row of every token, with cache_positions (batch, seq) its slot
    (the serving engine's indexing, workers/kv_cache.py); attention then reads each batch row's
    own cache row over attention_mask's width of slots."""
    split = split_for(model.collectives, model.sequence_parallel, input_ids.shape[1])
    sp = split is not None
    x, cos, sin, mask = parts.prologue(model, input_ids, position_ids, attention_mask, cache_positions, sp)
    ks, vs = [], []
    for i, block in enumerate(model.layers):
        kind = block.kind
        if kv_caches is None:
            x, k, v = parts.layer(block, x, cos[kind], sin[kind], mask[kind], None, None, cache_positions, None, sp)
            ks.append(k)
            vs.append(v)
        else:
            x, _, _ = parts.layer(block, x, cos[kind], sin[kind], mask[kind], kv_caches[0][i], kv_caches[1][i],
                                  cache_positions, rows, sp)
    if sp:
        x = split.gather(x)
    return parts.epilogue(model, x, logit_index), ks, vs
