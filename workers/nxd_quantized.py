"""A quantized checkpoint's weights as neuronx-distributed's quantized layers, on a Neuron host —
UNVERIFIED: no Neuron device or SDK exists where corelaunch is developed, so none of this has run
against the real library; it follows NxD's source as read (shardlib/nxd_quantization.py lists what
was read and what the mapping rests on).

The Neuron backend calls use_nxd_quantized_layers on a ShardedCausalLM built from a quantized
checkpoint, before moving it to the device or compiling it: every QuantizedWeight of a decoder layer
(and an untied quantized LM head) is replaced by an NxDQuantizedWeight, which runs the product
through NxD's QuantizedColumnParallel / QuantizedRowParallel holding the same 8-bit shard and scale.
corelaunch's layers are unchanged: `workers.layers.linear` sees a QuantizedWeight and calls its
`linear`, and the layers keep doing their collectives and adding their biases themselves.

Nothing Neuron is imported until use_nxd_quantized_layers runs, and then only through the import
function the backend passes (workers.backends.neuron.import_neuron_module, which explains a missing
SDK). The cpu backend never imports this module.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from shardlib.nxd_quantization import NxDQuantizedLayer, nxd_quantized_layers
from workers.quantized_linear import QuantizedWeight

NXD_LAYERS = "neuronx_distributed.quantization.quantization_layers"
NXD_CONFIG = "neuronx_distributed.quantization.quantization_config"

# Where ShardedCausalLM's layers keep each quantized weight, and the checkpoint module it comes from.
ATTENTION_WEIGHTS = {"q_weight": "self_attn.q_proj", "k_weight": "self_attn.k_proj",
                     "v_weight": "self_attn.v_proj", "o_weight": "self_attn.o_proj"}
MLP_WEIGHTS = {"gate_weight": "mlp.gate_proj", "up_weight": "mlp.up_proj", "down_weight": "mlp.down_proj"}


class NxDQuantizedWeight(QuantizedWeight):
    """A QuantizedWeight whose product is an NxD quantized layer's forward: x W_q^T, then each output
    times its scale (NxD's order; corelaunch's CPU path scales the weight first: the same formula,
    rounded differently in bf16). `q` and `scale` are the layer's own parameters, not copies."""

    def __init__(self, layer: nn.Module) -> None:
        # QuantizedWeight.__init__ would register its own q/scale buffers: the layer holds them here.
        nn.Module.__init__(self)
        self.layer = layer
        self.compute_dtype = torch.float32

    @property
    def q(self) -> torch.Tensor:
        return self.layer.weight

    @property
    def scale(self) -> torch.Tensor:
        return self.layer.scale

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, gemv: bool) -> torch.Tensor:
        y = self.layer(x)  # gemv does not apply: the Neuron compiler chooses how to run the product
        return y if bias is None else y + bias


def _install(layer: nn.Module, name: str, value: torch.Tensor, spec: NxDQuantizedLayer) -> None:
    """Put this rank's tensor into the layer's parameter `name` (allocated on the meta device), keeping
    the attributes NxD set on it (tensor-parallel split, state-dict hooks)."""
    placeholder = getattr(layer, name)
    if tuple(value.shape) != tuple(placeholder.shape) or value.dtype != placeholder.dtype:
        raise ValueError(f"{spec.weight_name}: rank's {name} is {tuple(value.shape)} {value.dtype} but "
                         f"{spec.layer_class} allocated {tuple(placeholder.shape)} {placeholder.dtype}; this "
                         f"neuronx-distributed lays out its quantized layers differently from the one "
                         f"shardlib/nxd_quantization.py was written against")
    param = nn.Parameter(value, requires_grad=False)
    param.__dict__.update(placeholder.__dict__)
    setattr(layer, name, param)


def build_nxd_layer(spec: NxDQuantizedLayer, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                    import_module: Callable) -> nn.Module:
    """NxD's quantized layer for `spec`, holding this rank's q and scale (float32)."""
    layers, config = import_module(NXD_LAYERS), import_module(NXD_CONFIG)
    quantized_dtype = getattr(config.QuantizedDtype, spec.quantized_dtype, None)
    if quantized_dtype is None:
        raise RuntimeError(
            f"this neuronx-distributed's QuantizedDtype has no {spec.quantized_dtype} member (it has "
            f"{', '.join(config.QuantizedDtype.__members__)}), so it cannot hold {spec.weight_name}; install a "
            f"neuronx-distributed with fp8 quantized layers, or re-quantize with `corelaunch quantize --dtype int8`")
    kwargs = dict(spec.kwargs)
    # The enum member, not the string: the layers compare the argument itself against
    # QuantizationType.PER_CHANNEL_SYMMETRIC when choosing the per-channel axis.
    kwargs["quantization_type"] = config.QuantizationType(kwargs["quantization_type"])
    layer = getattr(layers, spec.layer_class)(**kwargs, dtype=dtype, quantized_dtype=quantized_dtype,
                                               device=torch.device("meta"))
    _install(layer, "weight", q, spec)
    _install(layer, "scale", scale.to(torch.float32), spec)
    return layer


def _swap(owner: nn.Module, attribute: str, name: str, specs: dict[str, NxDQuantizedLayer], dtype: torch.dtype,
          import_module: Callable) -> None:
    weight = getattr(owner, attribute, None)
    if not isinstance(weight, QuantizedWeight) or isinstance(weight, NxDQuantizedWeight):
        return
    if name not in specs:
        raise RuntimeError(f"{name} is quantized in the model but not in its checkpoint's quantization "
                           f"(shardlib/nxd_quantization.py found no layer for it)")
    swapped = NxDQuantizedWeight(build_nxd_layer(specs.pop(name), weight.q, weight.scale, dtype, import_module))
    swapped.compute_dtype = weight.compute_dtype
    setattr(owner, attribute, swapped)


def use_nxd_quantized_layers(model, import_module: Callable) -> int:
    """Replace every quantized weight of `model` (a ShardedCausalLM) by NxD's quantized layer; returns
    how many. Refuses (ValueError) a checkpoint NxD cannot take before changing anything."""
    specs = nxd_quantized_layers(model.config, model.layout, model.rank)
    total = len(specs)
    for i, block in enumerate(model.layers):
        for owner, table in ((block.attention, ATTENTION_WEIGHTS), (block.mlp, MLP_WEIGHTS)):
            for attribute, module in table.items():
                _swap(owner, attribute, f"model.layers.{i}.{module}.weight", specs, model.dtype, import_module)
    if not model.config.tie_word_embeddings:
        _swap(model, "lm_head_weight", "lm_head.weight", specs, model.dtype, import_module)
    if specs:
        raise RuntimeError(f"{len(specs)} quantized weight(s) of the checkpoint were not found in the model, e.g. "
                           f"{sorted(specs)[0]}; workers/nxd_quantized.py does not know where this model keeps them")
    return total
