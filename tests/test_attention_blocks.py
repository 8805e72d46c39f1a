"""Long eager prefills attend by query blocks over the slots each block may read
(workers/attention_blocks.py): the same result as one call under the whole mask, for causal
prefills, chunks continuing a history, sliding windows and padded batch rows; one call where blocks
would not skip enough; never inside a traced graph; and a whole model's logits still equal
transformers' for a prompt long enough to be cut into blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardlib.model_config import ModelConfig
from tests.model_factory import build_random_model
from tests.test_families import last_logits
from tests.tp_harness import hf_state_dict
from workers import attention_blocks
from workers.attention_blocks import QUERY_BLOCK, blocked_attention, key_ranges
from workers.layers import attention
from workers.step import attention_bias_mask


def mask_for(positions: torch.Tensor, slots: int, window: int | None = None) -> torch.Tensor:
    """The model's own mask (workers/step.py) for queries at `positions` (batch, seq), every slot real."""
    return attention_bias_mask(slots, positions, torch.ones(positions.shape[0], slots, dtype=torch.bool), window)


def qkv(batch: int, seq: int, slots: int, q_heads: int = 6, kv_heads: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, q_heads, seq, 16, generator=g), torch.randn(batch, kv_heads, slots, 16, generator=g),
            torch.randn(batch, kv_heads, slots, 16, generator=g))


def one_call(q, keys, values, mask):
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != keys.shape[1])


def test_a_prefill_from_slot_0_reads_up_to_each_blocks_last_query():
    mask = mask_for(torch.arange(600)[None], 600)
    assert key_ranges(mask) == [(0, 256, 0, 256), (256, 512, 0, 512), (512, 600, 0, 600)]


def test_a_continuing_chunk_reads_its_history_and_a_window_drops_what_lies_before_it():
    after_100 = mask_for(torch.arange(100, 700)[None], 700)
    assert key_ranges(after_100) == [(0, 256, 0, 356), (256, 512, 0, 612), (512, 600, 0, 700)]
    windowed = mask_for(torch.arange(600)[None], 600, window=64)
    assert key_ranges(windowed) == [(0, 256, 0, 256), (256, 512, 256 - 63, 512), (512, 600, 512 - 63, 600)]


def test_a_padded_row_widens_nothing():
    """The shorter row's padding queries sit at slot 0 (workers/serving/step_inputs.py): they read
    only it, so the blocks read what the longer row needs."""
    positions = torch.stack([torch.arange(600), torch.where(torch.arange(600) < 300, torch.arange(600), 0)])
    assert key_ranges(mask_for(positions, 600)) == [(0, 256, 0, 256), (256, 512, 0, 512), (512, 600, 0, 600)]


@pytest.mark.parametrize("case", ["causal", "continuing", "window", "padded_batch", "no_gqa"])
def test_blocks_give_the_one_calls_result(case):
    seq = 700
    positions, slots, window, heads = torch.arange(seq)[None], seq, None, (6, 2)
    if case == "continuing":
        positions, slots = torch.arange(150, 150 + seq)[None], 150 + seq
    elif case == "window":
        window = 100
    elif case == "padded_batch":
        positions = torch.stack([torch.arange(seq), torch.where(torch.arange(seq) < 410, torch.arange(seq), 0)])
    elif case == "no_gqa":
        heads = (4, 4)
    mask = mask_for(positions, slots, window)
    q, keys, values = qkv(positions.shape[0], seq, slots, *heads)
    blocked = blocked_attention(q, keys, values, mask, 16 ** -0.5, heads[0] != heads[1])
    assert blocked is not None, "these masks skip enough to go by blocks"
    expected = one_call(q, keys, values, mask)
    assert torch.allclose(blocked, expected, atol=1e-5), (blocked - expected).abs().max()
    assert torch.allclose(attention(q, keys, values, mask), expected, atol=1e-5)


def test_a_chunk_after_a_long_history_makes_one_call():
    """Every block of 512 queries after 3000 cached tokens reads nearly every slot: no gain."""
    mask = mask_for(torch.arange(3000, 3512)[None], 3512)
    q, keys, values = qkv(1, 512, 3512)
    assert blocked_attention(q, keys, values, mask, 0.25, True) is None
    assert torch.allclose(attention(q, keys, values, mask), one_call(q, keys, values, mask), atol=1e-6)


def test_short_calls_and_traced_graphs_do_not_go_by_blocks():
    q, keys, values = qkv(1, 2 * QUERY_BLOCK, 2 * QUERY_BLOCK)
    mask = mask_for(torch.arange(2 * QUERY_BLOCK)[None], 2 * QUERY_BLOCK)
    assert attention_blocks.worth_blocking(q)
    assert not attention_blocks.worth_blocking(q[:, :, :2 * QUERY_BLOCK - 1])
    torch._dynamo.reset()
    # fullgraph: the blocks' slot ranges are read from the mask's data, which would break the graph
    compiled = torch.compile(attention, fullgraph=True, dynamic=False)
    assert torch.allclose(compiled(q, keys, values, mask), one_call(q, keys, values, mask), atol=1e-5)


def test_a_windowed_models_long_prompt_equals_transformers(monkeypatch):
    """A 700-token prompt through a random Mistral with a 200-token window: every layer's attention
    goes by blocks (counted), and the last logits equal transformers'. Its head_dim (8) is one the
    prefill attention kernel tiles on no build, so the blocks are what runs (16, an AVX2 build's
    panel width, took the kernel there)."""
    hf = build_random_model(model_type="mistral", sliding_window=200, max_position_embeddings=1024, vocab_size=256,
                            initializer_range=0.05, seed=3, num_heads=8, num_kv_heads=2)
    prompt = [(7 * i + 3) % 250 + 3 for i in range(700)]
    expected, got, calls = logits_counting_calls(monkeypatch, attention_blocks, "blocked_attention", hf, prompt)
    assert calls == hf.config.num_hidden_layers
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()


def logits_counting_calls(monkeypatch, module, name: str, hf, prompt: list[int]):
    """(transformers' last logits for the prompt, corelaunch's, how many times module.name ran)."""
    config = ModelConfig.from_dict(hf.config.to_dict())
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(1) or real(*a))
    return expected, last_logits(config, hf_state_dict(hf), prompt), len(calls)


def test_a_block_that_reads_no_slot_keeps_every_slot_as_the_one_call_does():
    """No mask the model builds has such a block (every query reads its own slot), but a mask with one
    is read as the one call reads it rather than failing (review of 3030a82: it raised IndexError)."""
    mask = mask_for(torch.arange(600)[None], 600)
    mask[:, :, 256:512] = False
    assert key_ranges(mask)[1] == (256, 512, 0, 600)
    q, keys, values = qkv(1, 600, 600)
    blocked = blocked_attention(q, keys, values, mask, 0.25, True)
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True, scale=0.25)
    assert blocked is not None and torch.allclose(blocked, expected, atol=1e-5, equal_nan=True)
