"""Bytes of a quantized model's weights and of an fp8 KV cache, for the planner (pure arithmetic).

A quantized rank holds, per linear weight, its 8-bit slice plus float32 scales: per channel one per
output row it holds (column-parallel q/k/v/gate/up and a vocab-parallel LM head: its own rows;
row-parallel o/down: every output row, the scale is kept whole), per tensor one. Everything else
(embedding, norms, biases, an unquantized LM head) stays in the compute dtype. The counts here equal
the bytes `load_rank_shard` returns for a quantized checkpoint (tests/test_quantization.py checks it).
"""

from __future__ import annotations

import math

from shardlib.model_config import DTYPE_BYTES, ModelConfig
from shardlib.quantization import PLANNER_DTYPE, Quantization

SCALE_BYTES = 4  # float32
KV_CACHE_DTYPES = {"f8e4m3": "float8_e4m3", "float8_e4m3": "float8_e4m3"}
"""--kv-cache-dtype spellings -> the planner's name (fp8 e4m3 with a scale, workers/kv_cache.py)."""


def planned_quantization(config: ModelConfig, dtype: str, on_neuron: bool) -> tuple[Quantization | None, str]:
    """(the quantization the plan counts, the compute dtype of the unquantized tensors).

    A quantized checkpoint's own quantization wins; otherwise a 1-byte plan dtype (int8,
    float8_e4m3, float8_e5m2) stands for `corelaunch quantize` per channel. A 1-byte dtype puts the
    other tensors (and the KV cache) in bfloat16 on Neuron, as NxD Inference runs quantized models,
    and elsewhere in the checkpoint's dtype, which the quantized checkpoint keeps and the cpu backend
    runs by default (SmolLM2: float32, twice bfloat16's bytes); the same rule before and after
    quantizing, so `plan --dtype int8` counts the same bytes for a checkpoint and for what
    `corelaunch quantize` makes of it. A float dtype is the compute dtype as given (a launch's
    `--dtype`). ValueError for a 1-byte dtype other than a quantized checkpoint's own."""
    compute = dtype if DTYPE_BYTES[dtype] >= 2 else "bfloat16" if on_neuron else config.torch_dtype
    if config.quantization is not None:
        own = PLANNER_DTYPE[config.quantization.dtype]
        if DTYPE_BYTES[dtype] == 1 and dtype != own:
            raise ValueError(f"dtype {dtype}: this checkpoint is quantized as {own}; plan --dtype {own} "
                             f"(or a float dtype for the other tensors), or quantize the original checkpoint "
                             f"as {dtype} with `corelaunch quantize`")
        return config.quantization, compute
    if DTYPE_BYTES[dtype] == 1:
        fmt = {v: k for k, v in PLANNER_DTYPE.items()}[dtype]
        return Quantization(fmt), compute
    return None, dtype


def quantized_elements(config: ModelConfig, quant: Quantization, tp: int, q_per_rank: int,
                       kv_per_rank: int, expert_parallel: bool = False) -> tuple[int, int]:
    """(8-bit weight elements, float32 scale elements) one rank holds. expert_parallel: the rank
    holds num_local_experts / tp whole experts (each with its whole scales), not a slice of each."""
    h, d = config.hidden_size, config.head_dim
    experts = max(1, config.num_local_experts)
    if expert_parallel:
        inter, experts = config.intermediate_size, experts // tp  # the layout checked experts % tp == 0
    else:
        inter = math.ceil(config.intermediate_size / tp)
    per_channel = quant.per_channel
    # (elements, scale count) per quantized weight of one layer
    weights = [(q_per_rank * d * h, q_per_rank * d), (kv_per_rank * d * h, kv_per_rank * d),
               (kv_per_rank * d * h, kv_per_rank * d), (h * q_per_rank * d, h)]
    weights += [(inter * h, inter), (inter * h, inter), (h * inter, h)] * experts
    elements = config.num_hidden_layers * sum(e for e, _ in weights)
    scales = config.num_hidden_layers * sum(s if per_channel else 1 for _, s in weights)
    vocab_rows = math.ceil(config.vocab_size / tp)
    tables = ("+embed" in quant.modules) + ("+lm_head" in quant.modules and not config.tie_word_embeddings)
    elements += tables * vocab_rows * h
    scales += tables * (vocab_rows if per_channel else 1)
    return elements, scales


def weight_bytes(config: ModelConfig, dtype: str, all_elements: int, tp: int, q_per_rank: int,
                 kv_per_rank: int, on_neuron: bool, expert_parallel: bool = False) -> int:
    """Bytes of one rank's weights whose parameter count is `all_elements` (quantized or not)."""
    quant, compute = planned_quantization(config, dtype, on_neuron)
    if quant is None:
        return all_elements * DTYPE_BYTES[dtype]
    elements, scales = quantized_elements(config, quant, tp, q_per_rank, kv_per_rank, expert_parallel)
    return (all_elements - elements) * DTYPE_BYTES[compute] + elements + scales * SCALE_BYTES


def kv_dtype_name(kv_cache_dtype: str | None) -> str | None:
    """The planner's name of a --kv-cache-dtype, None for the default; ValueError naming the choices."""
    if kv_cache_dtype is None:
        return None
    key = str(kv_cache_dtype).lower()
    if key not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv cache dtype {kv_cache_dtype!r}; use f8e4m3, or omit it for the compute dtype")
    return KV_CACHE_DTYPES[key]
