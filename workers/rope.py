"""Rotary position embeddings: inverse frequencies, cos/sin tables, and their application.

Numerics follow the Hugging Face Llama implementation so greedy tokens match it exactly:
- frequencies and angles are computed in float32 whatever the model dtype, and the angle of
  position p is the float32 product p * inv_freq (a table lookup gives the same bits as computing
  it on the fly);
- the rotation pairs dimension i with i + head_dim/2 ("rotate half"), not adjacent dimensions;
- cos/sin are cast to the activation dtype before they multiply q and k.

Tables are indexed by position ids rather than by sequence index, so in a left-padded batch each
row rotates by its own positions.
"""

from __future__ import annotations

import math

import torch

from shardlib.model_config import LLAMA3_ROPE_KEYS
from workers.rope_scaling import (base_exponents, dynamic_frequencies, linear_frequencies, longrope_frequencies,
                                  original_context, yarn_frequencies)

ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "yarn", "longrope")


def inverse_frequencies(head_dim: int, theta: float, rope_scaling: dict | None = None,
                        max_position_embeddings: int = 2048) -> torch.Tensor:
    """(head_dim // 2,) float32 angular frequency of each rotated pair (for longrope, the short
    factors' and for dynamic the original ones: those of a sequence within the original context)."""
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    inv_freq = 1.0 / (theta ** base_exponents(head_dim))
    rope_type = _rope_type(rope_scaling)
    if rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope_scaling)
    elif rope_type == "linear":
        inv_freq = linear_frequencies(inv_freq, rope_scaling)
    elif rope_type == "yarn":
        inv_freq = yarn_frequencies(head_dim, theta, rope_scaling, max_position_embeddings)[0]
    elif rope_type == "longrope":
        inv_freq = longrope_frequencies(head_dim, theta, rope_scaling, max_position_embeddings)[0]
    return inv_freq


def _rope_type(rope_scaling: dict | None) -> str:
    if not rope_scaling:
        return "default"
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_scaling rope_type {rope_type!r} is not supported; corelaunch implements "
            f"{', '.join(ROPE_TYPES)}"
        )
    return rope_type


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: slow waves are stretched by `factor`, fast ones are kept,
    and the band between is interpolated smoothly (wavelengths measured against the original
    training context)."""
    missing = [key for key in LLAMA3_ROPE_KEYS if key not in scaling]
    if missing:
        raise ValueError(f"llama3 rope_scaling {scaling} lacks {', '.join(missing)}")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = context / low, context / high

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotation_follows_length(rope_scaling: dict | None, max_position_embeddings: int, positions: int) -> bool:
    """Whether a key's rotation, for sequences of up to `positions` tokens, depends on how long the
    sequence was in the forward that wrote it (RotaryTables.lookup): longrope switches to its long
    factors once a sequence outgrows its original context, dynamic scaling changes past
    max_position_embeddings. Keys cached by one forward may then differ from what a forward of the
    same tokens in a longer or shorter sequence writes."""
    rope_type = _rope_type(rope_scaling)
    if rope_type == "longrope":
        return positions > original_context(rope_scaling, max_position_embeddings)
    return rope_type == "dynamic" and positions > max_position_embeddings


class RotaryTables:
    """Precomputed cos/sin for positions 0 .. max_positions - 1.

    Built once per KV cache size (the largest position a cache can hold), never per decode step.
    longrope keeps a second table (its long factors) and dynamic scaling computes a row's angles
    from the row's largest position once that passes max_position_embeddings (workers/rope_scaling.py);
    each row of a step chooses by its own largest position.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 rope_scaling: dict | None = None, device: torch.device | str | None = None,
                 max_position_embeddings: int = 2048) -> None:
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.rope_type = _rope_type(rope_scaling)
        self.theta, self.scaling, self.max_position_embeddings = theta, rope_scaling, max_position_embeddings
        inv_freq = inverse_frequencies(head_dim, theta, rope_scaling, max_position_embeddings).to(device)
        attention_factor = 1.0
        if self.rope_type == "yarn":
            attention_factor = yarn_frequencies(head_dim, theta, rope_scaling, max_position_embeddings)[1]
        self.positions = torch.arange(max_positions, device=device, dtype=torch.int64).to(torch.float32)
        self.cos, self.sin = self._tables(inv_freq, attention_factor)
        if self.rope_type == "longrope":
            _, long, attention_factor, self.context = longrope_frequencies(head_dim, theta, rope_scaling,
                                                                           max_position_embeddings)
            self.cos, self.sin = self._tables(inv_freq, attention_factor)
            self.long_cos, self.long_sin = self._tables(long.to(device), attention_factor)

    def _tables(self, inv_freq: torch.Tensor, attention_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
        angles = self.positions[:, None] * inv_freq[None, :]  # (max_positions, head_dim // 2)
        angles = torch.cat((angles, angles), dim=-1)  # (max_positions, head_dim)
        return angles.cos() * attention_factor, angles.sin() * attention_factor  # float32

    def lookup(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (batch, seq, head_dim) in `dtype` for position_ids (batch, seq)."""
        cos, sin = self.cos[position_ids], self.sin[position_ids]
        if self.rope_type not in ("longrope", "dynamic"):
            return cos.to(dtype), sin.to(dtype)
        # Each row's sequence length is its own largest position plus one (batch, 1, 1): rows of one
        # step never change each other's frequencies, and a row's padding columns carry positions no
        # greater than its last real one (workers/engine.py, workers/serving/step_inputs.py).
        seq_len = position_ids.amax(dim=-1, keepdim=True)[..., None] + 1
        if self.rope_type == "longrope":
            long = seq_len > self.context  # the row's sequence outgrew the original context
            cos = torch.where(long, self.long_cos[position_ids], cos)
            sin = torch.where(long, self.long_sin[position_ids], sin)
        elif self.rope_type == "dynamic":
            inv_freq = dynamic_frequencies(self.head_dim, self.theta, self.scaling["factor"],
                                           self.max_position_embeddings, seq_len)  # (batch, 1, head_dim // 2)
            angles = position_ids[..., None].to(torch.float32) * inv_freq
            angles = torch.cat((angles, angles), dim=-1)
            grown = seq_len > self.max_position_embeddings
            cos, sin = torch.where(grown, angles.cos(), cos), torch.where(grown, angles.sin(), sin)
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (batch, heads, seq, head_dim) by cos/sin (batch, seq, head_dim)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    return x * cos + rotate_half(x) * sin
