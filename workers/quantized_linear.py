"""A quantized linear weight on one rank: 8-bit values plus their scale, dequantized where used.

The values stay int8 / fp8 in memory for the model's whole life (buffers of a QuantizedWeight);
a product dequantizes inside the computation (shardlib/quantization.py gives the maths):
- traced by torch.compile for a decode step (workers.layers.linear's multiply-and-sum), the
  8-bit weight is converted inside the fused reduction loop, and a per-channel scale multiplies
  each output once after the sum (sum_j x_j q_ij s_i = s_i sum_j x_j q_ij), so no float copy of the
  weight is ever written;
- eagerly, and for prefills, the weight is dequantized to a temporary in the compute dtype and
  F.linear runs on it: the temporary lives for one product.

The layers (workers/layers.py) see a QuantizedWeight where they would see a weight Parameter:
`as_param` passes it through and `linear` routes it here, so no layer changes with quantization.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardlib.quantization import SCALE_SUFFIX, is_quantized_storage, scale_name
from workers.kernels import small_linear as small


def _non_finite_fp8_codes(q: torch.Tensor) -> int:
    """How many of an fp8 weight's bytes code NaN or an infinity (0 for other dtypes), read as bytes:
    e4m3fn has only NaN there (S.1111.111), e5m2 its whole top exponent (S.11111.xx)."""
    if q.dtype == torch.float8_e4m3fn:
        return int(((q.view(torch.uint8) & 0x7F) == 0x7F).sum())
    if q.dtype == torch.float8_e5m2:
        return int(((q.view(torch.uint8) & 0x7C) == 0x7C).sum())
    return 0


class QuantizedWeight(nn.Module):
    """One quantized (out, in) weight shard: `q` (int8 or fp8) and `scale` float32, (out, 1) per
    channel or (1,) per tensor."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        # (0,): the per-tensor scale of another rank's expert (expert parallelism), as empty as its weight
        if q.dim() != 2 or scale.shape not in ((q.shape[0], 1), (1,), *(((0,),) if q.shape[0] == 0 else ())):
            raise ValueError(f"a quantized weight needs q (out, in) and scale (out, 1) or (1,); got "
                             f"{tuple(q.shape)} and {tuple(scale.shape)}")
        bad = _non_finite_fp8_codes(q)
        if bad:
            # The small-batch kernel widens such codes to finite numbers (e4m3fn's NaN to 480), where
            # every other path gives NaN: one weight would answer differently with the batch size.
            raise ValueError(f"a quantized weight ({tuple(q.shape)}, {q.dtype}) holds {bad} NaN or infinite fp8 "
                             f"code(s); quantize the checkpoint again from finite weights (`corelaunch quantize` "
                             f"refuses NaN or infinite weights and clamps every value it writes)")
        self.register_buffer("q", q)
        self.register_buffer("scale", scale.to(torch.float32))
        self.compute_dtype = torch.float32
        """Set by workers.layers.as_param: the dtype embedding rows come out in."""

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.q.to(torch.float32) * self.scale).to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup: the dequantized rows `ids` (..., in), in the compute dtype."""
        scale = self.scale[ids] if self.scale.dim() == 2 else self.scale  # (..., 1) per row, or (1,)
        return (F.embedding(ids, self.q).to(torch.float32) * scale).to(self.compute_dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, gemv: bool) -> torch.Tensor:
        """x W^T + b with W = q * scale. gemv (one row in a compiled graph): a multiply-and-sum the
        compiler fuses, which measured faster there than the kernel's call; other products of up to
        small.max_rows() float32 rows: the small-batch kernel (8-bit weights widened in registers);
        larger ones: F.linear on a dequantized temporary."""
        if not gemv and small.usable(x, self.q):
            return small.small_linear(x, self.q, self.scale, bias)
        if gemv:
            # Summed and scaled in float32: the sum before its scale is the output over the scale,
            # about 127 / absmax times larger, and in float16 it overflowed where the output did not
            # (at absmax 0.05, outputs near 30 became inf).
            y = (x.float().unsqueeze(-2) * self.q.float()).sum(-1)  # (..., out), scale not yet applied
            y = (y * self.scale.view(-1)).to(x.dtype)  # (out,) per channel, (1,) per tensor
        else:
            y = F.linear(x, self.dequantized(x.dtype))
        return y if bias is None else y + bias


def pack_quantized(shard: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | QuantizedWeight]:
    """The shard with every `<m>.weight` that has a `<m>.scale` beside it replaced by one
    QuantizedWeight, and the scales removed (an unquantized shard comes back unchanged)."""
    packed = {name: t for name, t in shard.items() if not name.endswith(SCALE_SUFFIX)}
    for name, tensor in packed.items():
        scale = shard.get(scale_name(name)) if name.endswith(".weight") else None
        if scale is not None:
            if not is_quantized_storage(tensor.dtype):
                # Multiplied by its scale as if it held codes, a full-precision weight would shrink
                # by absmax / 127 without a word.
                raise ValueError(f"{name} has a scale ({scale_name(name)}) but is stored as {tensor.dtype}, not "
                                 f"as 8-bit codes; the checkpoint is not one `corelaunch quantize` writes: quantize "
                                 f"the original checkpoint again")
            packed[name] = QuantizedWeight(tensor, scale)
    return packed
