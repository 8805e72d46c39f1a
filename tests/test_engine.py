"""engine.generate at TP 1: batching, stopping, the KV cache's fixed storage, errors, timings.

Multi-rank generation is covered in tests/test_model_tp.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

from shardlib.model_config import ModelConfig
from tests.model_factory import build_random_model
from tests.tp_harness import build_rank_model, hf_state_dict
from workers.collectives import SingleRank
from workers.engine import GenerationOutput, cache_length, generate
from workers.sampling import SamplingParams

PROMPTS = [[5, 9, 33, 17, 80, 3, 44, 12, 61], [7, 100, 21], [90, 14, 2, 66, 8, 120]]
NEW = 10
GREEDY = SamplingParams()


@functools.lru_cache(maxsize=None)
def hf_model():
    return build_random_model("llama", seed=3)


def fresh_model():
    hf = hf_model()
    return build_rank_model(ModelConfig.from_dict(hf.config.to_dict()), hf_state_dict(hf), 0, 1, SingleRank())


@pytest.fixture(scope="module")
def model():
    return fresh_model()


@functools.lru_cache(maxsize=None)
def alone(prompt: tuple[int, ...], new: int = NEW) -> list[int]:
    """Greedy tokens of one prompt on its own, with no stop token."""
    [out] = generate(fresh_model(), [list(prompt)], [GREEDY], new, [])
    return out.token_ids


def test_left_padded_batch_equals_each_prompt_alone_and_hf(model):
    outs = generate(model, PROMPTS, [GREEDY] * len(PROMPTS), NEW, [])
    hf = hf_model()
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == alone(tuple(prompt)) == ref
        assert out.finish_reason == "length" and out.prompt_length == len(prompt)


def test_stop_token_ends_the_sequence_and_is_kept(model):
    full = alone(tuple(PROMPTS[0]))
    stop_token = full[3]
    first = full.index(stop_token)
    [out] = generate(model, [PROMPTS[0]], [GREEDY], NEW, {stop_token})
    assert out.token_ids == full[: first + 1]
    assert out.finish_reason == "stop"


def test_finished_rows_stop_contributing_while_others_continue(model):
    a, b = alone(tuple(PROMPTS[0])), alone(tuple(PROMPTS[1]))
    stop_token = next(t for t in a[1:] if t not in b)  # ends row a early, never row b
    outs = generate(model, PROMPTS[:2], [GREEDY] * 2, NEW, [stop_token])
    assert outs[0].token_ids == a[: a.index(stop_token) + 1] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == b and outs[1].finish_reason == "length"


class CacheSpy:
    """Wraps a model's forward to record the KV cache's storage and shapes at every step."""

    def __init__(self, model) -> None:
        self.model, self.seen = model, []
        self.original = model.forward

    def __enter__(self):
        def forward(input_ids, position_ids, cache, *rest):
            self.seen.append([(t.data_ptr(), tuple(t.shape)) for t in cache.k + cache.v])
            return self.original(input_ids, position_ids, cache, *rest)

        self.model.forward = forward
        return self

    def __exit__(self, *exc) -> None:
        del self.model.forward  # back to the class's method


def test_kv_cache_keeps_its_storage_and_shape_across_decode_steps(model):
    with CacheSpy(model) as spy:
        [out] = generate(model, [PROMPTS[0]], [GREEDY], NEW, [])
    assert len(out.token_ids) == NEW
    assert len(spy.seen) == NEW  # one prefill, then one forward per further token
    assert all(step == spy.seen[0] for step in spy.seen)
    # default length: 9 prompt tokens + 10 new, rounded up to a multiple of 64
    assert {shape for _, shape in spy.seen[0]} == {(1, 2, 64, 16)}  # (batch, kv_heads, slots, head_dim)


def test_max_seq_len_sets_the_cache_length(model):
    with CacheSpy(model) as spy:
        generate(model, [PROMPTS[1]], [GREEDY], 4, [], max_seq_len=20)
    assert spy.seen[0][0][1] == (1, 2, 20, 16)


def test_a_given_cache_is_reused_and_reset(model):
    cache = model.new_cache(2, 32)
    ptrs = [t.data_ptr() for t in cache.k + cache.v]
    first = generate(model, PROMPTS[:2], [GREEDY] * 2, NEW, [], cache=cache)
    again = generate(model, PROMPTS[:2], [GREEDY] * 2, NEW, [], cache=cache)
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == [alone(tuple(p)) for p in PROMPTS[:2]]
    assert [t.data_ptr() for t in cache.k + cache.v] == ptrs
    with pytest.raises(ValueError, match=r"holds batch 2 x 32 slots but this request needs batch 1 x 32"):
        generate(model, PROMPTS[:1], [GREEDY], NEW, [], cache=cache)


def test_default_cache_length_rounds_up_and_never_uses_max_positions():
    assert cache_length([9, 3], 10, 512) == 64
    assert cache_length([60], 10, 512) == 128
    assert cache_length([60], 10, 100) == 100  # rounding stops at the model's limit
    assert cache_length([5], 5, 512, max_seq_len=300) == 300


def test_request_longer_than_max_seq_len_names_both_numbers(model):
    with pytest.raises(ValueError, match=r"\(9\) \+ max_new_tokens \(10\) = 19 exceeds max_seq_len \(16\)"):
        generate(model, [PROMPTS[0]], [GREEDY], NEW, [], max_seq_len=16)


def test_request_longer_than_max_position_embeddings_names_both_numbers(model):
    with pytest.raises(ValueError, match=r"= 519 exceeds the model's max_position_embeddings \(512\)"):
        generate(model, [PROMPTS[0]], [GREEDY], 510, [])


@pytest.mark.parametrize("prompts, params, new, message", [
    ([[1, 2]], [GREEDY, GREEDY], 4, "got 1 prompts but 2 SamplingParams"),
    ([[1, 2], []], [GREEDY, GREEDY], 4, "prompt 1 is empty"),
    ([[1, 128]], [GREEDY], 4, r"prompt 0 holds token ids \[128\] outside the vocabulary \[0, 128\)"),
    ([[1, True]], [GREEDY], 4, r"prompt 0 holds \[True\], which are not token ids"),  # was taken as 1
    ([[1, 2.7]], [GREEDY], 4, r"prompt 0 holds \[2.7\], which are not token ids"),  # was taken as 2
    ([[1, 2]], [GREEDY], 0, r"max_new_tokens \(0\) must be a positive integer"),
    ([], [], 4, "at least one prompt"),
])
def test_bad_requests_are_refused(model, prompts, params, new, message):
    with pytest.raises(ValueError, match=message):
        generate(model, prompts, params, new, [])


def test_outputs_carry_timings(model):
    outs = generate(model, PROMPTS[:2], [GREEDY] * 2, NEW, [])
    for out in outs:
        assert isinstance(out, GenerationOutput)
        assert out.time_to_first_token_s > 0
        assert out.decode_tokens_per_s > 0


def test_seeded_sampling_is_reproducible_and_seed_dependent(model):
    def run(seed: int) -> list[int]:
        params = [SamplingParams(temperature=1.5, top_k=50, seed=seed)]
        return generate(model, [PROMPTS[1]], params, NEW, [])[0].token_ids

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_returned_logits_are_those_each_token_came_from(model):
    outs = generate(model, PROMPTS, [GREEDY] * len(PROMPTS), NEW, [], return_logits=True)
    hf = hf_model()
    for prompt, out in zip(PROMPTS, outs):
        assert out.logits.shape == (NEW, hf.config.vocab_size) and out.logits.dtype == torch.float32
        assert out.logits.argmax(dim=-1).tolist() == out.token_ids
        # teacher-forced reference: HF's logits at each position of prompt + generated tokens
        ids = torch.tensor([prompt + out.token_ids[:-1]])
        with torch.inference_mode():
            ref = hf(ids).logits[0, len(prompt) - 1:].float()
        torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=1e-4)
        assert len(out.decode_step_latencies_s) == NEW - 1
        assert all(t > 0 for t in out.decode_step_latencies_s)
    assert generate(model, PROMPTS[:1], [GREEDY], 2, [])[0].logits is None


def _resident_bytes() -> int:
    import os

    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_a_cpu_cache_is_zero_and_takes_memory_only_where_written():
    """The serving cache is sized for max_num_seqs full-length rows; on the CPU its pages are
    mapped, zero-filled, when first touched, so a fresh cache costs neither start-up time nor
    resident memory, and reads as zeros."""
    from workers.kv_cache import KVCache

    before = _resident_bytes()
    cache = KVCache(num_layers=4, batch=16, kv_heads=4, max_seq_len=4096, head_dim=64, long_lived=True)  # 512 MiB
    assert cache.nbytes() == 512 * 2 ** 20
    assert _resident_bytes() - before < 64 * 2 ** 20  # torch.zeros would have written all 512 MiB
    cache.k[3][5, 1, 4000] = 2.5
    assert cache.k[3][5, 1, 4000].eq(2.5).all() and cache.k[3].sum() == 2.5 * 64
    assert all(t.count_nonzero() == 0 for t in cache.k[:3] + cache.v)
    assert cache.k[0].is_contiguous() and cache.k[0].shape == (16, 4, 4096, 64)
