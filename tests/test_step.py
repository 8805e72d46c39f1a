"""The decoder step's building blocks under torch.compile: collectives as operators inside one graph,
graph breaks only where asked for, and the compiled decode attention against the eager kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.collectives import Collectives
from workers.layers import attention


class SummingTwin(Collectives):
    """A group of two whose other rank holds the same tensor: the sum doubles it, the gather repeats
    it. Real arithmetic, so a wrong call shows in the numbers, and it counts its calls."""

    rank, world_size = 0, 2

    def __init__(self) -> None:
        self.reduces = self.gathers = 0

    def all_reduce_sum_(self, tensor):
        self.reduces += 1
        return tensor.mul_(2)

    def all_gather_last_dim(self, tensor):
        self.gathers += 1
        return torch.cat((tensor, tensor), dim=-1)


def block(collectives: Collectives, x: torch.Tensor) -> torch.Tensor:
    h = collectives.all_reduce(torch.tanh(x) * 3)
    h = collectives.all_reduce(h + 1)
    return collectives.all_gather(h.sin())


def graphs_and_breaks(fn, *args):
    explained = torch._dynamo.explain(fn)(*args)
    return explained.graph_count, explained.graph_break_count


def test_collectives_are_operators_inside_one_graph():
    torch._dynamo.reset()
    twin, x = SummingTwin(), torch.randn(2, 5)
    twin.handle  # registered before tracing, as CompiledCausalLM does (an eager call never registers it)
    expected = block(twin, x)
    assert expected.shape == (2, 10) and (twin.reduces, twin.gathers) == (2, 1)  # eager: plain calls
    assert graphs_and_breaks(block, twin, x) == (1, 0)
    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    twin.reduces = twin.gathers = 0
    assert torch.allclose(compiled(twin, x), expected, atol=1e-6)
    assert (twin.reduces, twin.gathers) == (2, 1)  # the operators really ran the collectives


def test_collectives_outside_the_graph_cut_it_at_each_call():
    torch._dynamo.reset()
    twin, x = SummingTwin(), torch.randn(2, 5)
    twin.in_graph = False
    graphs, _ = graphs_and_breaks(block, twin, x)
    assert graphs == 3  # one graph before each of the three calls: none is traced through
    compiled = torch.compile(block, dynamic=False)
    twin.in_graph = True
    expected = block(twin, x)
    twin.in_graph = False
    assert torch.allclose(compiled(twin, x), expected, atol=1e-6)


def test_a_closed_group_is_refused_by_the_operator():
    twin = SummingTwin()
    handle = twin.handle
    twin.close()
    with pytest.raises(RuntimeError, match=f"handle {handle} is not registered"):
        torch.ops.corelaunch.all_reduce_sum(torch.ones(3), handle)


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_compiled_decode_attention_equals_the_eager_kernel(q_heads, kv_heads):
    torch.manual_seed(q_heads * 10 + kv_heads)
    batch, slots, head_dim = 2, 24, 16
    q = torch.randn(batch, q_heads, 1, head_dim)
    keys = torch.randn(batch, kv_heads, slots, head_dim)
    values = torch.randn(batch, kv_heads, slots, head_dim)
    mask = torch.rand(batch, 1, 1, slots) > 0.3
    mask[..., 0] = True  # every row reads at least one slot
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q_heads != kv_heads)
    assert torch.equal(attention(q, keys, values, mask), expected)  # eager: the kernel itself
    compiled = torch.compile(attention, fullgraph=True, dynamic=False)
    got = compiled(q, keys, values, mask)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
