"""shardlib/nxd_quantization.py: the mapping of quantized weights onto neuronx-distributed's quantized
layers, checked against the CPU path's slices (shardlib.sharding.slice_for) and against the shapes
NxD allocates, written out here from its source (quantization_layers.py) rather than imported: no
Neuron SDK exists here, so whether the real library agrees is unverified."""

from __future__ import annotations

import pytest
import torch

from shardlib.model_config import ModelConfig
from shardlib.nxd_quantization import COLUMN_LAYER, ROW_LAYER, nxd_layer, nxd_quantized_layers
from shardlib.quantization import Quantization, quantize, scale_name
from shardlib.sharding import ShardLayout, apply_slice, slice_for
from workers.quantized_linear import QuantizedWeight


def config_for(quant: Quantization | None, model_type: str = "llama", **fields) -> ModelConfig:
    """A small config: 6 heads over 2 KV heads and an intermediate of 100 (padded at TP 3 and 4)."""
    raw = {"model_type": model_type, "hidden_size": 48, "intermediate_size": 100, "num_hidden_layers": 2,
           "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 130, **fields}
    if quant is not None:
        raw["quantization_config"] = quant.to_json()
    return ModelConfig.from_dict(raw)


def nxd_allocation(spec, tp: int) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """(weight shape, scale shape, scale split) as NxD's layers allocate them from their arguments."""
    k = spec.kwargs
    if spec.layer_class == COLUMN_LAYER:
        assert k["output_size"] % tp == 0  # NxD's divide() would refuse otherwise
        weight, split_dim = (k["output_size"] // tp, k["input_size"]), 0
    else:
        assert k["input_size"] % tp == 0
        weight, split_dim = (k["output_size"], k["input_size"] // tp), 1
    if k["quantization_type"] == "per_tensor_symmetric":
        return weight, (1,), False
    axis = k["quantization_per_channel_axis"]
    scale = tuple(weight[d] if d == axis else 1 for d in range(2))
    return weight, scale, axis == split_dim


LAYOUTS = [  # (tp, pad_q_heads, untied LM head quantized)
    (1, False, False), (2, False, True), (3, False, False), (4, True, True), (6, False, False)]


@pytest.mark.parametrize("tp,pad,lm_head", LAYOUTS)
@pytest.mark.parametrize("granularity", ["per_channel_symmetric", "per_tensor_symmetric"])
def test_every_rank_gets_the_cpu_paths_slices_as_nxd_allocates_them(tp, pad, lm_head, granularity):
    quant = Quantization("int8", granularity, "linear+lm_head" if lm_head else "linear")
    config = config_for(quant)
    layout = ShardLayout.for_model(config, tp, pad_q_heads=pad)
    for rank in range(tp):
        specs = nxd_quantized_layers(config, layout, rank)
        assert len(specs) == 7 * 2 + lm_head
        for name, spec in specs.items():
            full = (130, 48) if name == "lm_head.weight" else None
            full = full or {"q": (48, 48), "k": (16, 48), "v": (16, 48), "o": (48, 48), "gate": (100, 48),
                            "up": (100, 48), "down": (48, 100)}[name.split(".")[-2].split("_")[0]]
            weight_slice = slice_for("llama", name, full, rank, layout)
            full_scale = quant.scale_shape(full)
            assert spec.scale_name == scale_name(name)
            assert spec.scale_slice == slice_for("llama", scale_name(name), full_scale, rank, layout)
            assert spec.weight_shape == weight_slice.shape(full)
            assert spec.scale_shape == spec.scale_slice.shape(full_scale)
            assert nxd_allocation(spec, tp) == (spec.weight_shape, spec.scale_shape, spec.scale_split)
            assert spec.scale_split == (not spec.scale_slice.is_whole)
            if spec.scale_split:  # a per-channel scale follows its column-parallel weight's rows
                assert spec.scale_slice == weight_slice


def test_layer_classes_and_arguments():
    config = config_for(Quantization("f8e4m3", "per_channel_symmetric", "linear+lm_head"))
    specs = nxd_quantized_layers(config, ShardLayout.for_model(config, 2), 1)
    classes = {name.split(".")[-2]: spec.layer_class for name, spec in specs.items()}
    assert {k for k, c in classes.items() if c == ROW_LAYER} == {"o_proj", "down_proj"}
    assert {k for k, c in classes.items() if c == COLUMN_LAYER} == {"q_proj", "k_proj", "v_proj", "gate_proj",
                                                                      "up_proj", "lm_head"}
    down, q = specs["model.layers.1.mlp.down_proj.weight"], specs["model.layers.0.self_attn.q_proj.weight"]
    # corelaunch's layers keep the collectives and the biases; NxD's only multiply.
    assert down.kwargs["input_is_parallel"] and not down.kwargs["reduce_output"] and not down.kwargs["bias"]
    assert not q.kwargs["gather_output"] and not q.kwargs["bias"] and q.kwargs["quantization_per_channel_axis"] == 0
    assert q.quantized_dtype == "F8E4M3"
    for fmt, member in (("int8", "INT8"), ("f8e5m2", "F8E5M2")):
        assert nxd_layer(Quantization(fmt, "per_tensor_symmetric"), "llama", q.weight_name, (48, 48), 0,
                         ShardLayout.for_model(config, 2)).quantized_dtype == member


@pytest.mark.parametrize("name,full", [("model.layers.0.self_attn.k_proj.weight", (16, 48)),
                                       ("model.layers.0.mlp.down_proj.weight", (48, 100))])
def test_nxd_product_on_the_cpu_shards_equals_the_quantized_weights(name, full):
    """NxD's forward, (x q^T) * scale^T, on the shard and scale the checkpoint reader cuts gives
    corelaunch's product for every rank: the scale layout means the same to both."""
    torch.manual_seed(1)
    config = config_for(Quantization("int8"))
    layout = ShardLayout.for_model(config, 6)  # k_proj: KV heads replicated; down_proj: padded columns
    q_full, s_full = quantize(torch.randn(full), "int8", per_channel=True)
    for rank in range(6):
        spec = nxd_layer(config.quantization, "llama", name, full, rank, layout)
        q = apply_slice(q_full, slice_for("llama", name, full, rank, layout))
        scale = apply_slice(s_full, spec.scale_slice)
        assert (tuple(q.shape), tuple(scale.shape)) == (spec.weight_shape, spec.scale_shape)
        x = torch.randn(3, q.shape[1])
        nxd = (x @ q.to(torch.float32).T) * scale.T
        assert torch.allclose(nxd, QuantizedWeight(q, scale).linear(x, None, gemv=False), atol=1e-5)


def test_refusals_name_the_value_and_the_fix():
    embed = config_for(Quantization("int8", modules="linear+embed"))
    with pytest.raises(ValueError, match=r"'linear\+embed'.*no quantized embedding.*without --embedding"):
        nxd_quantized_layers(embed, ShardLayout.for_model(embed, 2), 0)
    plain = config_for(Quantization("int8"))
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight.*no quantized embedding"):
        nxd_layer(plain.quantization, "llama", "model.embed_tokens.weight", (130, 48), 0,
                  ShardLayout.for_model(plain, 2))
    mixtral = config_for(Quantization("int8"), "mixtral", num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"block_sparse_moe\.experts\.0\.w1\.weight is a quantized expert.*--backend cpu"):
        nxd_quantized_layers(mixtral, ShardLayout.for_model(mixtral, 2), 0)
    assert nxd_quantized_layers(config_for(None), ShardLayout.for_model(config_for(None), 2), 0) == {}


def test_qwen3_moe_quantized_experts_are_refused_like_mixtrals():
    """`quantize` now quantizes Qwen3-MoE's experts too (it left them in full precision), and they
    have no neuronx-distributed mapping, as Mixtral's have none."""
    config = config_for(Quantization("int8"), "qwen3_moe", moe_intermediate_size=32, head_dim=8, num_experts=4,
                        num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"mlp\.experts\.0\.gate_proj\.weight is a quantized expert weight.*--backend cpu"):
        nxd_quantized_layers(config, ShardLayout.for_model(config, 2), 0)
