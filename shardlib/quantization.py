"""Weight quantization formats as pure maths: int8 and fp8 (e4m3, e5m2), symmetric, per tensor or
per output channel, and how a quantized checkpoint names, shapes and shards its scales.

Formats (names follow NxD Inference's `quantization_dtype`):
- "int8":   q = clamp(round(w / s), -127, 127), s = absmax / 127 (NxD's MinMax observer, symmetric).
            Rounding is round-half-to-even (torch.round), as torch's own quantize_per_tensor does.
- "f8e4m3": q = fp8_e4m3(clamp(w / s, -240, 240)), s = absmax / 240. 240 is the largest finite
            value of Neuron's e4m3 (IEEE-like, with infinities); torch's float8_e4m3fn reaches 448,
            so values clamped to 240 are stored exactly alike in both. The cast to fp8 rounds to
            nearest, ties to even.
- "f8e5m2": the same with max 57344 (e5m2's largest finite value, identical in every variant).
Dequantization is w' = q * s in float32; every format's error is bounded (tests/test_quantization.py).

Granularity (NxD's `quantization_type`):
- "per_channel_symmetric": one scale per output row of a weight (out, in); scale shape (out, 1),
  broadcastable against the weight as NxD stores it.
- "per_tensor_symmetric": one scale; shape (1,).

Checkpoint layout (NxD's quantized state dicts: `<module>.weight` holds the 8-bit values, and
`<module>.scale` the float32 scale beside it): `model.layers.0.mlp.up_proj.weight` (int8 or fp8)
and `model.layers.0.mlp.up_proj.scale` (float32). Every linear layer of a decoder layer is quantized
(q/k/v/o, gate/up/down); embedding, LM head, norms and biases stay in the source dtype unless the
embedding (`+embed`: one scale per token row; a tied LM head is the same tensor) or an untied LM
head (`+lm_head`) is asked for. config.json records it as:

    "quantization_config": {"quant_method": "corelaunch", "quantization_dtype": "int8",
                            "quantization_type": "per_channel_symmetric", "modules": "linear"}

Sharding a scale: a per-channel scale is cut along dim 0 exactly as its weight's output dim when
the weight is column-parallel (q/k/v by heads, gate/up by rows, a vocab-parallel LM head), and
kept whole for a row-parallel weight (o_proj, down_proj: every rank holds all output rows); a
per-tensor scale is replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch

QUANT_DTYPES = ("int8", "f8e4m3", "f8e5m2")
QUANT_TYPES = ("per_channel_symmetric", "per_tensor_symmetric")
QUANT_MODULES = ("linear", "linear+lm_head", "linear+embed", "linear+embed+lm_head")
QUANT_METHOD = "corelaunch"

FORMAT_MAX = {"int8": 127.0, "f8e4m3": 240.0, "f8e5m2": 57344.0}
"""The largest magnitude each format stores (absmax maps onto it)."""

# The planner's spelling (shardlib.model_config.DTYPE_BYTES) for each format.
PLANNER_DTYPE = {"int8": "int8", "f8e4m3": "float8_e4m3", "f8e5m2": "float8_e5m2"}
_ALIASES = {"int8": "int8", "f8e4m3": "f8e4m3", "fp8_e4m3": "f8e4m3", "float8_e4m3": "f8e4m3",
            "f8e5m2": "f8e5m2", "fp8_e5m2": "f8e5m2", "float8_e5m2": "f8e5m2"}

SCALE_SUFFIX = ".scale"
_MIN_SCALE = 1e-12
"""An all-zero row gets this scale instead of 0 (its values quantize to 0 either way, and no
division by zero happens)."""

# Which checkpoint tensors are quantized: every linear weight of a decoder layer (dense MLPs,
# Mixtral's experts, Qwen3-MoE's experts; the routers stay unquantized).
_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj|"
                     r"block_sparse_moe\.experts\.\d+\.w[123])\.weight")
UNQUANTIZABLE_MODEL_TYPES = ("dbrx",)
"""Families whose linear weights _LINEAR does not name (DBRX: fused Wqkv and fused expert matrices
under transformer.blocks): `corelaunch quantize` and the planner's 8-bit dtypes refuse them."""
_LM_HEAD = "lm_head.weight"
_EMBED = "model.embed_tokens.weight"


def normalize_quant_dtype(name: str) -> str:
    """"int8", "f8e4m3" or "f8e5m2" from any accepted spelling; ValueError naming the choices."""
    key = str(name).lower()
    if key not in _ALIASES:
        raise ValueError(f"unknown quantization dtype {name!r}; use one of {', '.join(QUANT_DTYPES)}")
    return _ALIASES[key]


@dataclass(frozen=True)
class Quantization:
    """How a checkpoint's weights are quantized (the config.json block, parsed and checked)."""

    dtype: str
    """One of QUANT_DTYPES."""
    granularity: str = "per_channel_symmetric"
    """One of QUANT_TYPES."""
    modules: str = "linear"
    """"linear" (every decoder linear layer), plus "+embed" (the embedding table, one scale per
    token row; with tied embeddings that is the LM head too) and/or "+lm_head" (an untied LM head)."""

    def __post_init__(self) -> None:
        if self.dtype not in QUANT_DTYPES:
            raise ValueError(f"quantization_config.quantization_dtype {self.dtype!r} is not one of "
                             f"{', '.join(QUANT_DTYPES)}; re-run `corelaunch quantize`")
        if self.granularity not in QUANT_TYPES:
            raise ValueError(f"quantization_config.quantization_type {self.granularity!r} is not one of "
                             f"{', '.join(QUANT_TYPES)}; re-run `corelaunch quantize`")
        if self.modules not in QUANT_MODULES:
            raise ValueError(f"quantization_config.modules {self.modules!r} is not one of "
                             f"{', '.join(QUANT_MODULES)}; re-run `corelaunch quantize`")

    @property
    def per_channel(self) -> bool:
        return self.granularity == "per_channel_symmetric"

    def is_quantized(self, name: str, tie_word_embeddings: bool = False) -> bool:
        """Whether checkpoint tensor `name` is stored quantized (with a scale beside it)."""
        if _LINEAR.fullmatch(name):
            return True
        if name == _EMBED:
            return "+embed" in self.modules
        return name == _LM_HEAD and "+lm_head" in self.modules and not tie_word_embeddings

    def scale_shape(self, weight_shape: Sequence[int]) -> tuple[int, ...]:
        return (weight_shape[0], 1) if self.per_channel else (1,)

    def to_json(self) -> dict:
        return {"quant_method": QUANT_METHOD, "quantization_dtype": self.dtype,
                "quantization_type": self.granularity, "modules": self.modules}

    @classmethod
    def from_json(cls, raw: object) -> "Quantization | None":
        """The config.json block; None when absent; ValueError for another tool's quantization."""
        if raw is None:
            return None
        if not isinstance(raw, dict) or raw.get("quant_method") != QUANT_METHOD:
            method = raw.get("quant_method") if isinstance(raw, dict) else raw
            raise ValueError(f"config.json has a quantization_config with quant_method={method!r}, which "
                             f"corelaunch cannot load; use the unquantized checkpoint, and quantize it with "
                             f"`corelaunch quantize`")
        return cls(dtype=raw.get("quantization_dtype"), granularity=raw.get("quantization_type"),
                   modules=raw.get("modules", "linear"))


def scale_name(weight_name: str) -> str:
    """`a.b.weight` -> `a.b.scale` (NxD's naming)."""
    assert weight_name.endswith(".weight"), weight_name
    return weight_name[: -len(".weight")] + SCALE_SUFFIX


def weight_name_of(scale: str) -> str:
    return scale[: -len(SCALE_SUFFIX)] + ".weight"


def storage_dtype(fmt: str) -> "torch.dtype":
    import torch

    return {"int8": torch.int8, "f8e4m3": torch.float8_e4m3fn, "f8e5m2": torch.float8_e5m2}[fmt]


def is_quantized_storage(dtype: "torch.dtype") -> bool:
    import torch

    return dtype in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def absmax_scale(weight: "torch.Tensor", fmt: str, per_channel: bool) -> "torch.Tensor":
    """float32 scale of a 2-D weight: absmax / FORMAT_MAX, (out, 1) per channel or (1,) per tensor."""
    import torch

    absmax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().amax().reshape(1)
    return (absmax.to(torch.float32) / FORMAT_MAX[fmt]).clamp_min(_MIN_SCALE)


def quantize_with_scale(weight: "torch.Tensor", scale: "torch.Tensor", fmt: str) -> "torch.Tensor":
    """The stored values of `weight` (rows x in) under `scale` ((rows, 1) or (1,)), in the format's
    storage dtype: w / s clamped to the format's range, rounded half to even (int8) or cast to
    the nearest fp8 value (ties to even)."""
    import torch

    scaled = (weight.to(torch.float32) / scale).clamp_(-FORMAT_MAX[fmt], FORMAT_MAX[fmt])
    if fmt == "int8":
        scaled = torch.round(scaled)
    return scaled.to(storage_dtype(fmt))


def quantize(weight: "torch.Tensor", fmt: str, per_channel: bool) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(q, scale) of a 2-D weight (out, in): q in the format's storage dtype, scale float32 of shape
    (out, 1) per channel or (1,) per tensor. Computed in float32 whatever the input dtype."""
    scale = absmax_scale(weight, fmt, per_channel)
    return quantize_with_scale(weight, scale, fmt), scale


def dequantize(q: "torch.Tensor", scale: "torch.Tensor", dtype: "torch.dtype | None" = None) -> "torch.Tensor":
    """q * scale in float32 (then cast to `dtype` when given); scale (out, 1) or (1,)."""
    import torch

    w = q.to(torch.float32) * scale.to(torch.float32)
    return w if dtype is None else w.to(dtype)


def keeps_dtype(name: str, tensor: "torch.Tensor") -> bool:
    """Tensors a compute-dtype cast must leave alone: 8-bit quantized weights and their float32
    scales (dequantization happens in the layer, shardlib/quantization.py's maths)."""
    return keeps_dtype_of(name, tensor.dtype)


def keeps_dtype_of(name: str, dtype: "torch.dtype | None") -> bool:
    """keeps_dtype from a tensor's name and dtype (a manifest's record holds no tensor)."""
    return name.endswith(SCALE_SUFFIX) or is_quantized_storage(dtype)


def quantize_state_dict(state_dict: dict[str, "torch.Tensor"], quant: Quantization,
                        tie_word_embeddings: bool = False) -> dict[str, "torch.Tensor"]:
    """A whole in-memory state_dict quantized as `corelaunch quantize` stores it (tests, checks).
    A tied LM head's copy is dropped: the embedding (quantized or not) is the LM head."""
    out = {}
    for name, tensor in state_dict.items():
        if name == _LM_HEAD and tie_word_embeddings:
            continue
        if quant.is_quantized(name, tie_word_embeddings):
            out[name], out[scale_name(name)] = quantize(tensor, quant.dtype, quant.per_channel)
        else:
            out[name] = tensor
    return out


def dequantize_state_dict(state_dict: dict[str, "torch.Tensor"], dtype: "torch.dtype") -> dict[str, "torch.Tensor"]:
    """The plain state_dict a quantized one stands for (each weight dequantized, scales dropped):
    what an unquantized reference model (transformers) loads to run the same numbers."""
    out = {}
    for name, tensor in state_dict.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = state_dict.get(scale_name(name)) if name.endswith(".weight") else None
        out[name] = tensor if scale is None else dequantize(tensor, scale, dtype)
    return out
