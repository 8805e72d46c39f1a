"""Float32 linear weights held as column panels on the cpu backend (workers/kernels/packed_linear.py).

After a rank builds its model, the cpu backend repacks every float32 (out, in) weight that the
layers only ever multiply through `workers.layers.linear` into a PackedWeight, in place: the same
bytes (plus zero padding to a whole panel), in the order the kernel streams them, and the checkpoint
layout is freed. `linear` routes a PackedWeight to the kernel for every row count, prefill and
decode alike, compiled or eager. A tied embedding table that is also the LM head is packed once
and read back by rows (`rows`), so tying still holds one copy.

What is packed: 2-D float32 Parameters held directly by a module under a name ending in `weight`
that is not a norm's or an embedding's own `weight` (attention, MLP, router and LM head matrices,
fused ones too). Quantized weights (QuantizedWeight), mixture-of-experts expert stacks, and every
other backend are left alone. CORELAUNCH_PACKED_WEIGHTS=0 turns packing off (the layers then use
the small-batch kernel and F.linear as before).
"""

from __future__ import annotations

import torch
from torch import nn

from workers.kernels import packed_linear as kernel
from workers.kernels.prefill_gemm import chosen_gemm


class PackedWeight(nn.Module):
    """One (out_features, in_features) float32 weight as panels (count, in_features, width)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("panels", kernel.pack(weight.detach()))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def dtype(self) -> torch.dtype:
        return self.panels.dtype

    @property
    def device(self) -> torch.device:
        return self.panels.device

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return kernel.packed_linear(x, self.panels, self.out_features, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup: rows `ids` (...,) of the weight -> (..., in_features)."""
        width = self.panels.shape[2]
        return self.panels[ids // width, :, ids % width]

    def unpacked(self) -> torch.Tensor:
        """The weight in its (out, in) layout (a copy)."""
        return kernel.unpack(self.panels, self.out_features)


def _packable(name: str, value: object, module: nn.Module) -> bool:
    from workers.layers import LayerNorm, RMSNorm

    return (not isinstance(module, (RMSNorm, LayerNorm)) and name.endswith("weight")
            and isinstance(value, nn.Parameter) and value.dim() == 2 and value.dtype == torch.float32
            and value.device.type == "cpu")


def pack_linear_weights(model: nn.Module) -> int:
    """Replace the model's float32 linear weights by PackedWeights, in place; returns how many were
    packed (0 when the kernel is unavailable or turned off). One weight object shared by several
    places (a tied LM head and embedding) becomes one PackedWeight shared the same way; an embedding
    table held nowhere else is only ever looked up, and stays as it is.

    Weights are packed one at a time and each original is dropped as soon as its last place holds
    the packed copy, so loading peaks at one extra matrix, not a second copy of the model (the
    caller must not hold the shard's tensors itself)."""
    if not kernel.available():
        return 0
    chosen_gemm()  # a bad CORELAUNCH_PREFILL_GEMM is named at load, not at the first long prefill
    from workers.layers import VocabParallelEmbedding

    groups: dict[int, list[tuple[nn.Module, str]]] = {}  # one weight object -> every place holding it
    for module in model.modules():  # grouped while every original is alive (ids are unique only then)
        for name, value in module._parameters.items():
            if _packable(name, value, module):
                groups.setdefault(id(value), []).append((module, name))
    groups = {key: places for key, places in groups.items()
              if not all(isinstance(module, VocabParallelEmbedding) for module, _ in places)}
    for places in groups.values():
        packed = PackedWeight(places[0][0]._parameters[places[0][1]])
        for module, name in places:
            del module._parameters[name]
            setattr(module, name, packed)
    return len(groups)
