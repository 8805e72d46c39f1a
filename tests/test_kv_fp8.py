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
from workers.kv_quant import KV_FP8, from_cache, kv_storage_dtype, to_cache
from workers.sampling import SamplingParams

PROMPTS = [[5, 9, 33, 17, 80], [7, 100, 21, 4, 66, 8, 120, 3, 44, 12, 61]]
NEW = 6


def test_fp8_cache_is_a_quarter_of_fp32_per_token():
    full = KVCache(2, 1, 2, 16, 64, dtype=torch.float32)
    small = KVCache(2, 1, 2, 16, 64, dtype=KV_FP8)
    assert small.nbytes() * 4 == full.nbytes()
    with pytest.raises(ValueError, match="unknown kv cache dtype 'int4'; use f8e4m3"):
        kv_storage_dtype("int4", torch.float32)


def test_every_spelling_the_plan_takes_reaches_the_ranks_as_theirs():
    """LaunchConfig(kv_cache_dtype="float8_e4m3") (or "F8E4M3") passed the config's check and the
    plan, which counted an fp8 cache, then failed every rank's load ("unknown kv cache dtype
    'float8_e4m3'; use f8e4m3") after Ray and the ranks had started."""
    from launcher.api import LaunchConfig

    for spelling in ("f8e4m3", "F8E4M3", "float8_e4m3", "FLOAT8_E4M3"):
        config = LaunchConfig(kv_cache_dtype=spelling)
        assert config.kv_cache_dtype == "f8e4m3"
        assert kv_storage_dtype(config.kv_cache_dtype, torch.float32) == KV_FP8  # what each rank does with it
    assert LaunchConfig().kv_cache_dtype is None
    with pytest.raises(ValueError, match="unknown kv cache dtype 'fp8'"):
        LaunchConfig(kv_cache_dtype="fp8")


def test_a_neuron_plan_with_an_fp8_kv_cache_warns_that_a_compiled_launch_refuses_it():
    """`plan --instance trn1.32xlarge --kv-cache-dtype f8e4m3` said VALID and nothing more, while a
    default (compiled) neuron generate refuses the option."""
    from shardlib.demo_model import ensure_demo_model
    from shardlib.model_config import load_model_config
    from shardlib.planner import plan
    from workers.backends import backend_entry

    config = load_model_config(ensure_demo_model())
    warned = plan(config, instance="trn1.32xlarge", tp=1, kv_cache_dtype="f8e4m3")
    assert warned.valid
    assert not backend_entry("neuron").compiled_fp8_kv_cache  # the fact the warning states
    assert any("launch refuses --kv-cache-dtype unless it runs eagerly (--no-compile)" in w for w in warned.warnings)
    for quiet in (plan(config, instance="trn1.32xlarge", tp=1), plan(config, instance="cpu", tp=1, kv_cache_dtype="f8e4m3")):
        assert not any("kv_cache_dtype" in w for w in quiet.warnings), quiet.warnings


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


def test_an_infinite_key_or_value_is_stored_as_nan_and_a_large_finite_one_clamped():
    """Clamped, an overflowed (infinite) key or value was stored as a finite 240 that nothing downstream
    could tell from a real one."""
    values = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e6, -300.0, 3.0])
    stored = to_cache(values, torch.empty(0, dtype=KV_FP8))
    read = from_cache(stored.view(KV_FP8), torch.float32)
    assert read[:3].isnan().all(), read
    assert read[3:].tolist() == [240.0, -240.0, 3.0]


def test_an_overflowed_value_fails_its_request_with_an_fp8_cache_as_with_a_float_one():
    """One infinite weight of layer 0's v_proj makes a value infinite: a float cache turns it into NaN
    logits, which fail the request; an fp8 cache clamped it to 240, and the request went on
    generating tokens from a broken forward, reported as a normal end ("length")."""
    from tests.serving_driver import collect, request, run_loops, stop
    from tests.test_engine import hf_model
    from workers.serving.loop import ServingConfig, ServingLoop

    hf = hf_model()
    state = hf_state_dict(hf)
    name = next(k for k in state if "layers.0." in k and "v_proj.weight" in k)
    state[name] = state[name].clone()
    state[name][0, 0] = float("inf")
    for kv_dtype in (None, KV_FP8):
        model = build_rank_model(ModelConfig.from_dict(hf.config.to_dict()), state, 0, 1, SingleRank())
        if kv_dtype is not None:
            model.kv_cache_dtype = kv_dtype
        loop = ServingLoop(model, ServingConfig(1, 8, 32))
        threads = run_loops([loop])
        loop.submit([request("overflowed", PROMPTS[1], 4)])
        got = collect(loop, {"overflowed"})
        stop([loop], threads)
        assert got.finish["overflowed"] == "error", (kv_dtype, got.events)
        assert "logits in row(s) [0] hold NaN or +inf" in got.events[-1].error, (kv_dtype, got.events)


@functools.lru_cache(maxsize=None)
def models():
    # A model whose greedy choices on PROMPTS win by at least MIN_MARGIN in full precision (checked
    # below): fp8 rounding of the cache moves these logits by a few hundredths, so a nearer tie could
    # flip without anything being wrong.
    hf = build_random_model(seed=6, initializer_range=0.5)
    config = ModelConfig.from_dict(hf.config.to_dict())
    quant = Quantization("int8")
    qconfig = ModelConfig.from_dict({**hf.config.to_dict(), "quantization_config": quant.to_json()})
    return config, hf_state_dict(hf), qconfig, quantize_state_dict(hf_state_dict(hf), quant)


def tokens(model, prompts):
    return [o.token_ids for o in generate(model, prompts, [SamplingParams()] * len(prompts), NEW, [])]


MIN_MARGIN = 0.2


def test_fp8_cache_keeps_greedy_tokens():
    config, state, _, _ = models()
    full = build_rank_model(config, state, 0, 1, SingleRank())
    outputs = generate(full, PROMPTS, [SamplingParams()] * len(PROMPTS), NEW, [], return_logits=True)
    top2 = torch.cat([o.logits for o in outputs]).topk(2).values
    assert float((top2[:, 0] - top2[:, 1]).min()) >= MIN_MARGIN  # no near tie for fp8 to flip
    small = build_rank_model(config, state, 0, 1, SingleRank())
    small.kv_cache_dtype = KV_FP8
    assert small.new_cache(1, 8).k[0].dtype == KV_FP8
    assert tokens(small, PROMPTS) == tokens(full, PROMPTS)
    assert tokens(small, [PROMPTS[0]]) == tokens(full, [PROMPTS[0]])


def test_compiled_int8_weights_equal_eager():
    """Dequantization inside inductor's graphs gives the eager tokens, and the weights stay 8-bit."""
    from workers.compiled import CompiledCausalLM

    _, _, qconfig, qstate = models()
    eager, compiled_model = (build_rank_model(qconfig, qstate, 0, 1, SingleRank()) for _ in range(2))
    compiled = CompiledCausalLM(compiled_model, Buckets.build(context=[16], token=[32], batch=[2]))
    assert tokens(compiled, PROMPTS) == tokens(eager, PROMPTS)
    assert compiled_model.layers[0].attention.q_weight.q.dtype == torch.int8


def test_compiled_decode_reads_the_fp8_cache_as_eager_does():
    """From one fp8 cache, compiled decode steps give eager's logits and store the same bytes.

    (Whole generations are not compared: a compiled prefill attends over the prompt's own
    full-precision keys, as NxD's context encoding does, while an eager prefill reads them back from
    the cache, so later layers' keys differ by fp8 rounding: workers/kv_quant.py.)"""
    from workers.compiled import CompiledCausalLM

    config, state, _, _ = models()
    eager, compiled_model = (build_rank_model(config, state, 0, 1, SingleRank()) for _ in range(2))
    eager.kv_cache_dtype = compiled_model.kv_cache_dtype = KV_FP8
    compiled = CompiledCausalLM(compiled_model, Buckets.build(context=[16], token=[32], batch=[1]))
    prompt = torch.tensor([PROMPTS[1]])
    n = prompt.shape[1]
    ours = eager.new_cache(1, 32)
    with torch.no_grad():
        logits = eager(prompt, torch.arange(n)[None], ours, torch.arange(n))
    theirs = eager.new_cache(1, 32)
    for mine, other in zip(ours.k + ours.v, theirs.k + theirs.v):
        other.view(torch.uint8).copy_(mine.view(torch.uint8))
    for step in range(4):
        token = logits.argmax(-1, keepdim=True)
        position = torch.tensor([[n + step]])
        with torch.no_grad():
            logits = eager(token, position, ours, position[0])
            graph_logits = compiled(token, position, theirs, position[0])
        torch.testing.assert_close(graph_logits, logits, rtol=1e-4, atol=1e-4)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ours.k + ours.v, theirs.k + theirs.v))


def test_a_compiled_directory_records_and_holds_its_kv_cache_dtype(tmp_path):
    """`compile --kv-cache-dtype` is recorded; a launch from the directory takes it, and asking for
    another cache dtype than the graphs were built with is refused naming both."""
    from launcher.api import LaunchConfig
    from launcher.artifacts.compiled_dir import apply_compiled_dir
    from launcher.cli import build_parser
    from tests.model_factory import save_random_model
    from tests.test_compile_cli import fake_compiled_dir

    assert build_parser().parse_args(["compile", "--out", "x", "--kv-cache-dtype", "f8e4m3"]).kv_cache_dtype == "f8e4m3"
    model = save_random_model(tmp_path / "m")
    fp8 = fake_compiled_dir(tmp_path / "fp8", model, kv_cache_dtype="f8e4m3")
    assert apply_compiled_dir(LaunchConfig(compiled_dir=str(fp8))).kv_cache_dtype == "f8e4m3"
    plain = fake_compiled_dir(tmp_path / "plain", model)
    assert apply_compiled_dir(LaunchConfig(compiled_dir=str(plain))).kv_cache_dtype is None
    with pytest.raises(ValueError, match=r"launch: kv_cache_dtype: expected none \(compiled\), found 'f8e4m3' \(asked\)"):
        apply_compiled_dir(LaunchConfig(compiled_dir=str(plain), kv_cache_dtype="f8e4m3"))
