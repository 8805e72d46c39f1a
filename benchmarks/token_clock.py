"""Timing transformers' generate() as corelaunch's engine times itself: one call, a clock reading as
each token is chosen; decode tokens/s = (n - 1) / (last - first). Two calls (the first token's time
from a 1-token one, the total from another) mixed two runs' noise into one rate, which came out
negative at a few tokens on a loaded host. Shared by benchmarks/decode.py and tp_scaling.py."""

from __future__ import annotations

import time


def token_clock():
    """A transformers StoppingCriteria that records when each token is chosen (generate() calls it
    once per token) and never stops the call; its readings are in .times."""
    import torch
    from transformers import StoppingCriteria

    class TokenClock(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return TokenClock()


def decode_rate(token_times: list[float], new_tokens: int) -> float:
    """Decode tokens/s of one generate() call from its clock readings: (n - 1) / (last - first)."""
    if len(token_times) != new_tokens or new_tokens < 2:
        raise ValueError(f"{len(token_times)} clock readings for {new_tokens} new tokens: the decode rate needs "
                         f"one reading per token and at least 2 tokens")
    return (new_tokens - 1) / (token_times[-1] - token_times[0])
