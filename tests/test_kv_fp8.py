"""fp8 KV cache (workers/kv_quant.py) and quantized weights inside compiled graphs.

The cache stores float8 e4m3 bytes and attention reads them dequantized; greedy tokens of the
random models (peaked logits, tests/model_factory.py) stay those of a full-precision cache. One
compiled model with int8 weights, and one with an fp8 cache, run against the same models run
eagerly: the dequantization inside inductor's graphs must give the eager tokens.
"""

from __future__ import annotations

import functools

import pytest
import torch

from shardlib.buckets import Buckets
from shardlib.model_config import ModelConfig
from shardlib.quantization import Quantization, quantize_state_dict
from tests.model_factory import build_random_model
from tests.tp_harness import build_rank_model, hf_state_dict
from workers.collectives import SingleRank
from workers.engine import generate
from workers.kv_cache import KVCache, write_kv
from workers.kv_quant import KV_FP8, kv_storage_dtype
from workers.sampling import SamplingParams

PROMPTS = [[5, 9, 33, 17, 80], [7, 100, 21, 4, 66, 8, 120, 3, 44, 12, 61]]
NEW = 6


def test_fp8_cache_is_a_quarter_of_fp32_per_token():
    full = KVCache(2, 1, 2, 16, 64, dtype=torch.float32)
    small = KVCache(2, 1, 2, 16, 64, dtype=KV_FP8)
    assert small.nbytes() * 4 == full.nbytes()
    with pytest.raises(ValueError, match="unknown kv cache dtype 'int4'; use f8e4m3"):
        kv_storage_dtype("int4", torch.float32)


@pytest.mark.parametrize("served", [False, True], ids=["static-batch", "serving-rows"])
def test_write_kv_stores_fp8_and_reads_dequantized(served):
    torch.manual_seed(0)
    k, v = torch.randn(2, 2, 3, 8) * 4, torch.randn(2, 2, 3, 8) * 300  # v beyond 240: clamped
    k_cache, v_cache = (torch.zeros(2, 2, 5, 8, dtype=KV_FP8) for _ in range(2))
    if served:
        rows = torch.tensor([[0, 0, 0], [1, 1, 1]])
        keys, values = write_kv(k_cache, v_cache, torch.tensor([[1, 2, 3], [0, 1, 2]]), k, v, rows, 5)
        k_stored, v_stored = k_cache[0, :, 1:4], v_cache[0, :, 1:4]
        k0, v0 = k[0], v[0]
    else:
        keys, values = write_kv(k_cache, v_cache, torch.tensor([1, 2, 3]), k, v)
        k_stored, v_stored, k0, v0 = k_cache[:, :, 1:4], v_cache[:, :, 1:4], k, v
    assert keys.dtype == torch.float32 and k_cache.dtype == KV_FP8
    assert torch.equal(k_stored.float(), k0.to(KV_FP8).float())  # plain torch cast, scale 1
    assert torch.equal(v_stored.float(), v0.clamp(-240, 240).to(KV_FP8).float())
    assert torch.equal(keys[0, :, 1:4], k_cache[0, :, 1:4].float())  # read back dequantized


@functools.lru_cache(maxsize=None)
def models():
    hf = build_random_model(seed=3)
    config = ModelConfig.from_dict(hf.config.to_dict())
    quant = Quantization("int8")
    qconfig = ModelConfig.from_dict({**hf.config.to_dict(), "quantization_config": quant.to_json()})
    return config, hf_state_dict(hf), qconfig, quantize_state_dict(hf_state_dict(hf), quant)


def tokens(model, prompts):
    return [o.token_ids for o in generate(model, prompts, [SamplingParams()] * len(prompts), NEW, [])]


def test_fp8_cache_keeps_greedy_tokens():
    config, state, _, _ = models()
    full = build_rank_model(config, state, 0, 1, SingleRank())
    small = build_rank_model(config, state, 0, 1, SingleRank())
    small.kv_cache_dtype = KV_FP8
    assert small.new_cache(1, 8).k[0].dtype == KV_FP8
    assert tokens(small, PROMPTS) == tokens(full, PROMPTS)
    assert tokens(small, [PROMPTS[0]]) == tokens(full, [PROMPTS[0]])


@pytest.mark.parametrize("case", ["int8-weights", "fp8-cache"])
def test_compiled_equals_eager(case):
    """Dequantization inside inductor's graphs gives the eager tokens. (The two are tested apart:
    with an fp8 cache a compiled prefill attends over the prompt's own full-precision keys, as
    NxD's context encoding does, while an eager prefill reads them back from the cache, so
    together they may differ where the model nearly ties: workers/kv_quant.py.)"""
    from workers.compiled import CompiledCausalLM

    config, state, qconfig, qstate = models()
    config, state, kv = (qconfig, qstate, None) if case == "int8-weights" else (config, state, KV_FP8)
    eager, compiled_model = (build_rank_model(config, state, 0, 1, SingleRank()) for _ in range(2))
    eager.kv_cache_dtype = compiled_model.kv_cache_dtype = kv
    compiled = CompiledCausalLM(compiled_model, Buckets.build(context=[16], token=[32], batch=[2]))
    assert tokens(compiled, PROMPTS) == tokens(eager, PROMPTS)
    if case == "int8-weights":  # the weights stayed 8-bit in the compiled model
        assert compiled_model.layers[0].attention.q_weight.q.dtype == torch.int8
