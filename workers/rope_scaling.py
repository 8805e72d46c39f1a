"""Rope scaling types beyond Llama 3's, with transformers' definitions (modeling_rope_utils):

- linear: every frequency divided by `factor` (positions interpolated).
- yarn: frequencies blended between the original (fast dimensions, extrapolated) and divided by
  `factor` (slow ones, interpolated) over a linear ramp between beta_fast and beta_slow rotations
  of the original context; cos and sin multiplied by an attention factor (0.1 ln(factor) + 1 by default).
- longrope: per-frequency divisors, `short_factor` while the sequence fits the original context and
  `long_factor` once it does not; cos and sin multiplied by sqrt(1 + ln(factor) / ln(original context)).
- dynamic (NTK): the base grows with the sequence once it passes max_position_embeddings:
  base * (factor * len / max_pos - (factor - 1)) ** (dim / (dim - 2)).

Like transformers, longrope and dynamic pick their frequencies per forward step from the step's
largest position (a prefill rotates every prompt token with the prompt length's frequencies, each
decode step its token with its own); tokens already in the KV cache keep the rotation they got.
"""

from __future__ import annotations

import math

import torch


def base_exponents(head_dim: int) -> torch.Tensor:
    """(head_dim // 2,) float32 i / head_dim for i = 0, 2, 4, ..."""
    return torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim


def original_context(scaling: dict, max_position_embeddings: int) -> int:
    return scaling.get("original_max_position_embeddings") or max_position_embeddings


def linear_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    return inv_freq / scaling["factor"]


def yarn_frequencies(head_dim: int, theta: float, scaling: dict,
                     max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention factor) of yarn scaling."""
    context = original_context(scaling, max_position_embeddings)
    factor = scaling.get("factor") or max_position_embeddings / context

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over the context
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(torch.float32) / head_dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of the original (extrapolated) frequency
    return interpolated * (1 - keep) + extrapolated * keep, attention_factor


def longrope_frequencies(head_dim: int, theta: float, scaling: dict,
                         max_position_embeddings: int) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """(short inv_freq, long inv_freq, attention factor, original context) of longrope scaling."""
    context = original_context(scaling, max_position_embeddings)
    factor = scaling.get("factor") or max_position_embeddings / context
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(context))
    shape = base_exponents(head_dim)
    short, long = (1.0 / (torch.tensor(scaling[key], dtype=torch.float32) * theta ** shape)
                   for key in ("short_factor", "long_factor"))
    return short, long, attention_factor, context


def dynamic_frequencies(head_dim: int, theta: float, factor: float, max_position_embeddings: int,
                        seq_len: torch.Tensor) -> torch.Tensor:
    """inv_freq for sequences seq_len long, once they exceed max_position_embeddings (the caller
    keeps the original frequencies below that). seq_len: an int64 tensor, 0-d (gives (head_dim // 2,))
    or with a last dimension of 1 (one length per row: (batch, 1, 1) gives (batch, 1, head_dim // 2)),
    so the frequencies broadcast along that last dimension."""
    seq_len = torch.maximum(seq_len, torch.tensor(max_position_embeddings, dtype=seq_len.dtype, device=seq_len.device))
    base = theta * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=seq_len.device).to(torch.float32) / head_dim
    return 1.0 / (base ** exponents)
