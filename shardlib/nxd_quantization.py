"""Which neuronx-distributed (NxD) quantized layer each quantized weight of a corelaunch checkpoint
becomes on a Neuron host, with its constructor arguments and per-rank shapes: pure maths, no Neuron
import (the Neuron side, workers/nxd_quantized.py, builds the layers from this).

What NxD expects, as read in its source (aws-neuron/neuronx-distributed,
src/neuronx_distributed/quantization/: quantization_layers.py, quantization_config.py,
quantization_mappings.py, dequantize.py; several versions, the exact release of each not pinned):
- QuantizedColumnParallel(input_size, output_size, bias, quantization_type, gather_output, dtype,
  quantized_dtype, device, ..., quantization_per_channel_axis): weight (output_size / tp, input_size)
  in the 8-bit dtype, split along dim 0; a per-channel scale is (output_size / tp, 1) float32 and
  split with the weight; a per-tensor scale is (1,), whole on every rank.
- QuantizedRowParallel(..., input_is_parallel, ..., reduce_output): weight (output_size,
  input_size / tp), split along dim 1; a per-channel scale is (output_size, 1), whole on every rank.
- Both dequantize after the product: y = (x W_q^T) * scale^T, so each output row is scaled by its
  scale, the formula of corelaunch's scales (q * scale per output row); quantization_per_channel_axis
  must be 0 (the output dimension). Parameter names are `weight` and `scale`, corelaunch's too.
- quantization_type: "per_tensor_symmetric" or "per_channel_symmetric" (QuantizationType).
- QuantizedDtype: INT8 in every version read; F8E4M3 (torch.float8_e4m3fn, bounded to +-240, as
  corelaunch's f8e4m3) and F8E5M2 only in newer ones. NxD Inference's NeuronConfig.quantization_dtype
  ("int8", "f8e4m3", "f8e5m2") picks the member by upper-casing the string: corelaunch's names.
- Only ColumnParallelLinear, RowParallelLinear and the fused expert linears have quantized versions
  (quantization_mappings.py): there is no quantized embedding.
- NxD Inference describes the same with NeuronConfig(quantized=True, quantization_type=...,
  quantization_dtype=..., quantized_checkpoints_path=<a state dict its own quantizer writes>);
  corelaunch passes none of these: it builds the layers itself from its own checkpoint.

How corelaunch's shards map onto them: each rank already holds its own rows (or columns), cut by
shardlib/sharding.py with zero-padded heads, replicated KV heads and padded rows where the layout
needs them. NxD splits `output_size` (column) or `input_size` (row) evenly over the TP ranks, so the
size passed is tp x this rank's rows (columns): NxD then allocates exactly the rank's shard, which is
loaded as it is. The layers are built with gather_output=False / input_is_parallel=True and
reduce_output=False and without bias: corelaunch's own layers keep doing the all-reduce (or the
sequence-parallel reduce-scatter) and add the biases, as they do for every other weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from shardlib.model_config import ModelConfig
from shardlib.param_shapes import EMBED, expected_shapes
from shardlib.quantization import Quantization, scale_name
from shardlib.sharding import ShardLayout, Style, TensorSlice, slice_for, style_for

COLUMN_LAYER = "QuantizedColumnParallel"
ROW_LAYER = "QuantizedRowParallel"

NXD_QUANTIZED_DTYPE = {"int8": "INT8", "f8e4m3": "F8E4M3", "f8e5m2": "F8E5M2"}
"""corelaunch's format -> the member of NxD's QuantizedDtype enum that stores it."""

_COLUMN_STYLES = (Style.COLUMN, Style.Q_HEADS, Style.KV_HEADS, Style.VOCAB)
_ROW_STYLES = (Style.ROW, Style.ROW_HEADS)
_EXPERT_STYLES = (Style.EXPERT_COLUMN, Style.EXPERT_ROW, Style.EXPERTS_FUSED)


@dataclass(frozen=True)
class NxDQuantizedLayer:
    """One quantized weight of one rank as an NxD quantized layer."""

    weight_name: str
    """The checkpoint tensor (`<module>.weight`); NxD's parameter `weight` holds its shard."""
    scale_name: str
    """Its scale (`<module>.scale`); NxD's parameter `scale`."""
    layer_class: str
    """COLUMN_LAYER or ROW_LAYER (in neuronx_distributed.quantization.quantization_layers)."""
    quantized_dtype: str
    """The QuantizedDtype member's name (NXD_QUANTIZED_DTYPE)."""
    weight_shape: tuple[int, ...]
    """This rank's weight as NxD allocates it: equal to the shard slice_for cuts."""
    scale_shape: tuple[int, ...]
    """This rank's scale as NxD allocates it: equal to the scale slice_for cuts."""
    scale_slice: TensorSlice
    """What the checkpoint reader cuts of the scale for this rank (shardlib.sharding.slice_for)."""
    scale_split: bool
    """Whether NxD marks the scale as split over the ranks (per-channel scale of a column layer)."""
    kwargs: dict = field(default_factory=dict)
    """Constructor arguments, plain values; the Neuron side adds dtype (the compute dtype),
    quantized_dtype and quantization_type as NxD's enum members, and device."""


def refuse_unsupported(quant: Quantization) -> None:
    """ValueError for a quantized checkpoint NxD has no layers for, naming the value and the fix."""
    if "+embed" in quant.modules:
        raise ValueError(
            f"quantization_config.modules is {quant.modules!r}: neuronx-distributed has no quantized "
            f"embedding layer (only column- and row-parallel linears), so the neuron backend cannot run a "
            f"quantized embedding table; re-quantize without --embedding (`corelaunch quantize` quantizes the "
            f"decoder's linear layers by default), or run this checkpoint with --backend cpu")


def nxd_layer(quant: Quantization, model_type: str, name: str, full_shape: Sequence[int], rank: int,
              layout: ShardLayout) -> NxDQuantizedLayer:
    """The NxD quantized layer rank `rank` builds for quantized weight `name` of full shape (out, in)."""
    refuse_unsupported(quant)
    if name == EMBED:
        raise ValueError(f"{name} is quantized but neuronx-distributed has no quantized embedding; re-quantize "
                         f"without --embedding, or run this checkpoint with --backend cpu")
    style = style_for(model_type, name)
    if style in _EXPERT_STYLES:
        raise ValueError(
            f"{name} is a quantized expert weight: neuronx-distributed's quantized expert layers "
            f"(QuantizedExpertFusedColumnParallel / RowParallel) take every expert fused in one (experts, in, out) "
            f"tensor with its scale along the last axis, and corelaunch keeps one (out, in) matrix per expert, so "
            f"they are not mapped; run this checkpoint with --backend cpu, or the unquantized one on neuron")
    if style not in _COLUMN_STYLES + _ROW_STYLES:
        raise ValueError(f"{name} (sharding style {style.value}) is not a column- or row-parallel linear weight, "
                         f"which is all neuronx-distributed has quantized layers for; run it with --backend cpu")
    tp = layout.tp_degree
    local = slice_for(model_type, name, full_shape, rank, layout).shape(full_shape)
    full_scale = quant.scale_shape(full_shape)
    s_slice = slice_for(model_type, scale_name(name), full_scale, rank, layout)
    kwargs: dict = {"bias": False, "quantization_type": quant.granularity,
                    "quantization_per_channel_axis": 0 if quant.per_channel else None,
                    "sequence_parallel_enabled": False, "keep_master_weight": False}
    if style in _COLUMN_STYLES:  # split along out: NxD's output_size / tp must be this rank's rows
        kwargs.update(input_size=local[1], output_size=local[0] * tp, gather_output=False)
        layer_class, split = COLUMN_LAYER, quant.per_channel
    else:  # split along in: NxD's input_size / tp must be this rank's columns
        kwargs.update(input_size=local[1] * tp, output_size=local[0], input_is_parallel=True, reduce_output=False)
        layer_class, split = ROW_LAYER, False
    return NxDQuantizedLayer(
        weight_name=name, scale_name=scale_name(name), layer_class=layer_class,
        quantized_dtype=NXD_QUANTIZED_DTYPE[quant.dtype], weight_shape=tuple(local),
        scale_shape=(local[0], 1) if quant.per_channel else (1,), scale_slice=s_slice, scale_split=split,
        kwargs=kwargs)


def nxd_quantized_layers(config: ModelConfig, layout: ShardLayout, rank: int) -> dict[str, NxDQuantizedLayer]:
    """weight name -> its NxD layer, for every quantized weight of the model on `rank`; {} for an
    unquantized model. Refuses (ValueError) at the first weight NxD cannot take, before any is built."""
    quant = config.quantization
    if quant is None:
        return {}
    refuse_unsupported(quant)
    return {name: nxd_layer(quant, config.model_type, name, shape, rank, layout)
            for name, shape in expected_shapes(config).items()
            if quant.is_quantized(name, config.tie_word_embeddings)}

