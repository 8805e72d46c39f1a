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

ROPE_TYPES = ("default", "llama3")


def inverse_frequencies(head_dim: int, theta: float, rope_scaling: dict | None = None) -> torch.Tensor:
    """(head_dim // 2,) float32 angular frequency of each rotated pair."""
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    rope_type = _rope_type(rope_scaling)
    if rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope_scaling)
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


class RotaryTables:
    """Precomputed cos/sin for positions 0 .. max_positions - 1.

    Built once per KV cache size (the largest position a cache can hold), never per decode step.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 rope_scaling: dict | None = None, device: torch.device | str | None = None) -> None:
        self.head_dim = head_dim
        self.max_positions = max_positions
        inv_freq = inverse_frequencies(head_dim, theta, rope_scaling).to(device)
        positions = torch.arange(max_positions, device=device, dtype=torch.int64).to(torch.float32)
        angles = positions[:, None] * inv_freq[None, :]  # (max_positions, head_dim // 2)
        angles = torch.cat((angles, angles), dim=-1)  # (max_positions, head_dim)
        self.cos = angles.cos()  # (max_positions, head_dim) float32
        self.sin = angles.sin()

    def lookup(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (batch, seq, head_dim) in `dtype` for position_ids (batch, seq)."""
        return self.cos[position_ids].to(dtype), self.sin[position_ids].to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (batch, heads, seq, head_dim) by cos/sin (batch, seq, head_dim)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    return x * cos + rotate_half(x) * sin
