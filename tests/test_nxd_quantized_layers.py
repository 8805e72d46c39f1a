"""workers/nxd_quantized.py, the Neuron side of quantized checkpoints, without a Neuron SDK.

What can be checked here: it imports nothing Neuron; without the SDK it fails with the backend's
install message; a checkpoint NxD cannot take is refused before anything is imported; and, against
a stand-in written from NxD's source (constructor arguments, meta-device allocation, the forward
(x q^T) * scale^T), every quantized weight is swapped and the model's greedy tokens do not change.
The stand-in proves only corelaunch's side: whether the real neuronx-distributed accepts these
layers is unverified.
"""

from __future__ import annotations

import enum
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

from shardlib.model_config import ModelConfig
from shardlib.quantization import Quantization, quantize_state_dict
from tests.model_factory import build_random_model
from tests.tp_harness import build_rank_model, hf_state_dict
from workers.backends.neuron import import_neuron_module
from workers.collectives import SingleRank
from workers.engine import generate
from workers.nxd_quantized import NxDQuantizedWeight, use_nxd_quantized_layers
from workers.quantized_linear import QuantizedWeight
from workers.sampling import SamplingParams

PROMPT = [5, 9, 33, 17, 80, 3]


def quantized_model(modules: str = "linear+lm_head", fmt: str = "int8"):
    hf = build_random_model(seed=7, vocab_size=128)
    quant = Quantization(fmt, "per_channel_symmetric", modules)
    state = quantize_state_dict(hf_state_dict(hf), quant)
    config = ModelConfig.from_dict({**hf.config.to_dict(), "quantization_config": quant.to_json()})
    return build_rank_model(config, state, 0, 1, SingleRank())


def test_importing_the_neuron_side_imports_nothing_neuron():
    code = ("import sys, workers.nxd_quantized, workers.backends.neuron; "
            "print([m for m in sys.modules if m.split('.')[0] in ('torch_neuronx', 'neuronx_distributed', 'torch_xla')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_without_the_sdk_it_fails_with_the_backends_install_message():
    model = quantized_model()
    with pytest.raises(RuntimeError, match=r"needs 'neuronx_distributed\.quantization\..*--backend cpu"):
        use_nxd_quantized_layers(model, import_neuron_module)


def test_a_checkpoint_nxd_cannot_take_is_refused_before_any_import():
    def must_not_import(name):
        raise AssertionError(f"imported {name} before refusing")

    with pytest.raises(ValueError, match="no quantized embedding"):
        use_nxd_quantized_layers(quantized_model("linear+embed"), must_not_import)


class StandInNxD:
    """neuronx_distributed.quantization's config and layers modules, as far as corelaunch uses them."""

    def __init__(self, fp8: bool = True) -> None:
        self.built: list[dict] = []
        dtypes = {"INT8": torch.int8, **({"F8E4M3": torch.float8_e4m3fn} if fp8 else {})}
        self.config = types.SimpleNamespace(
            QuantizationType=enum.Enum("QuantizationType", {"PER_TENSOR_SYMMETRIC": "per_tensor_symmetric",
                                                            "PER_CHANNEL_SYMMETRIC": "per_channel_symmetric"}),
            QuantizedDtype=enum.Enum("QuantizedDtype", dtypes))
        self.layers = types.SimpleNamespace(QuantizedColumnParallel=self._layer(column=True),
                                            QuantizedRowParallel=self._layer(column=False))

    def _layer(self, column: bool):
        standin, per_channel = self, self.config.QuantizationType.PER_CHANNEL_SYMMETRIC

        class Layer(nn.Module):
            def __init__(self, input_size, output_size, quantization_type, quantized_dtype, device, dtype, **rest):
                super().__init__()
                standin.built.append(dict(rest, quantization_type=quantization_type, column=column))
                assert isinstance(quantization_type, standin.config.QuantizationType)  # NxD compares the member
                shape = (output_size, input_size)  # TP 1: the whole matrix is this rank's
                self.weight = nn.Parameter(torch.empty(shape, dtype=quantized_dtype.value, device=device),
                                           requires_grad=False)
                self.weight.partition_dim = 0 if column else 1  # an attribute NxD sets; must survive
                scale = (output_size, 1) if quantization_type is per_channel else (1,)
                self.scale = nn.Parameter(torch.ones(scale, device=device), requires_grad=False)

            def forward(self, x):  # NxD: direct cast, product, then scale_dequantize in float32
                y = x @ self.weight.to(x.dtype).T
                return (y.to(torch.float32) * self.scale.T).to(y.dtype)

        return Layer

    def import_module(self, name):
        return {"neuronx_distributed.quantization.quantization_layers": self.layers,
                "neuronx_distributed.quantization.quantization_config": self.config}[name]


def test_every_quantized_weight_is_swapped_and_the_tokens_stay_the_same():
    model = quantized_model()
    before = generate(model, [PROMPT], [SamplingParams()], 8, [])[0].token_ids
    standin = StandInNxD()
    assert use_nxd_quantized_layers(model, standin.import_module) == 7 * 2 + 1
    swapped = [m for m in model.modules() if isinstance(m, QuantizedWeight)]
    assert len(swapped) == 15 and all(isinstance(m, NxDQuantizedWeight) for m in swapped)
    assert all(b["bias"] is False and b.get("reduce_output", False) is False for b in standin.built)
    assert model.layers[0].mlp.down_weight.q.partition_dim == 1
    assert model.layers[0].mlp.down_weight.q.element_size() == 1
    assert generate(model, [PROMPT], [SamplingParams()], 8, [])[0].token_ids == before


def test_an_nxd_without_fp8_layers_is_named():
    with pytest.raises(RuntimeError, match=r"no F8E4M3 member \(it has INT8\).*--dtype int8"):
        use_nxd_quantized_layers(quantized_model(fmt="f8e4m3"), StandInNxD(fp8=False).import_module)
