"""Repetition, frequency and presence penalties: a request's logits changed by what it has seen.

Applied before temperature, top-k and top-p, and before a greedy row's argmax (penalties change
which token is most likely), with the meanings OpenAI's API and vLLM give them:
- repetition_penalty r (transformers' and vLLM's): every token of the prompt or of the output so
  far has its logit divided by r when positive, multiplied by r otherwise (r > 1 discourages);
- frequency_penalty f: subtracts f times the number of times the token was generated so far;
- presence_penalty p: subtracts p once from every token generated at least once.
Frequency and presence count the generated tokens only, never the prompt. Returned log-probabilities
stay the model's own (before any penalty), as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardlib.sampling_params import SamplingParams
from workers.sampling import sampling_device

FLOAT32_MAX = torch.finfo(torch.float32).max


def penalized(logits: torch.Tensor, params: list[SamplingParams], prompts: Sequence[Sequence[int]],
              outputs: Sequence[Sequence[int]]) -> torch.Tensor:
    """logits (batch, vocab) with each row's penalties applied, given row i's prompt token ids and
    the tokens it has generated so far; the same tensor when no row asks for a penalty (the common
    case costs one pass over the params), else a float32 copy. Penalised values are kept finite: a
    tiny repetition penalty dividing a large logit (or a large one multiplying a negative logit)
    would overflow float32, and an infinite logit fails the row's token choice."""
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    # float32 throughout, as the sampling that follows computes; on the host for a device without
    # generators (XLA: sampling draws there too), and never the caller's tensor (log-probabilities
    # are taken from it)
    out = logits.to(sampling_device(logits.device), torch.float32, copy=True)
    vocab = out.shape[-1]
    for i in rows:
        p, row = params[i], out[i]
        finite = row.isfinite()  # a broken forward's NaN or inf stays for the token choice to report
        generated = torch.tensor(list(outputs[i]), dtype=torch.int64, device=out.device)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(list(prompts[i]), dtype=torch.int64, device=out.device)
            seen = torch.cat((seen, generated)).unique()
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and generated.numel():
            counts = torch.bincount(generated, minlength=vocab)[:vocab].to(out.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(out.dtype)
        row.copy_(torch.where(finite, row.clamp(-FLOAT32_MAX, FLOAT32_MAX), row))
    return out.to(logits.device)
