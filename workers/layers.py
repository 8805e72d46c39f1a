"""The layers of one rank's slice of a Llama-family decoder, built directly from shard tensors.

Each layer receives tensors already cut by `shardlib.sharding.apply_slice` and wraps them without
copying (unless a dtype conversion is asked for): a rank never holds more than its own slice.
Parallelism shows up only as the collective a layer calls after a partial result; which slice a
tensor is, and why the math is exact, is written down in shardlib/sharding.py.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from workers import attention_blocks
from workers.collectives import Collectives
from workers.kernels import decode_attention, prefill_attention
from workers.kernels import small_linear as small
from workers.kv_cache import store_kv, write_kv
from workers.packed_weight import PackedWeight
from workers.quantized_linear import QuantizedWeight
from workers.rope import apply_rotary


GEMV_MAX_ROWS = 1
"""Inside a compiled graph, products with at most this many rows (decode) use multiply-and-sum."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b, as F.linear, by the fastest path for the weight's form and the row count.

    - A PackedWeight (the cpu backend's float32 weights, workers/packed_weight.py): the packed-panel
      kernel for every row count, compiled or eager (prefill-sized products: MKL on the unpacked
      weight).
    - A QuantizedWeight (8-bit): QuantizedWeight.linear (the small-batch kernel, a compiled one-row
      multiply-and-sum, or F.linear on a dequantized temporary).
    - A plain float32 tensor (packing off, or another backend's weight on the CPU): products of 2
      to small.max_rows() rows go to the small-batch C kernel (workers/kernels/small_linear.py);
      traced by torch.compile with at most GEMV_MAX_ROWS rows (a decode step), the product is
      written as a multiply-and-sum over the input dimension, which inductor turns into one fused,
      vectorised reduction that streams the weight at memory bandwidth (F.linear there becomes the
      BLAS GEMV, measured at about a third of that); eager mode and larger products keep F.linear
      (eagerly the multiply would materialise a (rows, out, in) tensor).
    """
    if isinstance(weight, PackedWeight):  # float32 panels (cpu backend): one kernel for every row count
        return weight.linear(x, bias)
    rows = x.numel() // x.shape[-1]
    gemv = torch.compiler.is_compiling() and rows <= GEMV_MAX_ROWS
    if isinstance(weight, QuantizedWeight):  # 8-bit weight, dequantized inside the product
        return weight.linear(x, bias, gemv)
    if rows >= 2 and small.usable(x, weight):
        return small.small_linear(x, weight, None, bias)
    if gemv:
        y = (x.unsqueeze(-2) * weight).sum(-1)  # (..., 1, in) * (out, in) -> (..., out)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
              scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v: q (batch, q_heads, seq, head_dim), keys/values
    (batch, kv_heads, slots, head_dim) shared by q_heads // kv_heads query heads each, boolean mask
    (batch, 1, seq, slots); returns (batch, q_heads, seq, head_dim). scale None: head_dim ** -0.5
    (Gemma 3: query_pre_attn_scalar ** -0.5).

    For prefills (several queries per row) of float32 on the CPU, eager or traced, this is the prefill
    attention kernel (workers/kernels/prefill_attention.py), which computes only the tiles of slots
    each block of queries may read. Otherwise, eager, and for prefills, it is
    F.scaled_dot_product_attention (a long eager one on the CPU by query blocks, each over the slots
    it may read: workers/attention_blocks.py). Traced by torch.compile
    for a decode step (one query per row), it is written out as products and sums, which inductor fuses
    into the graph's own loops: the CPU flash-attention kernel it would otherwise call is a separate,
    un-fused call that spends most of its time on set-up for a single query. On the cpu backend with a
    float32 cache, Attention.forward takes the decode attention kernel
    (workers/kernels/decode_attention.py) instead of this.
    """
    batch, q_heads, seq, head_dim = q.shape
    kv_heads = keys.shape[1]
    scale = head_dim ** -0.5 if scale is None else scale
    if not (torch.compiler.is_compiling() and seq == 1):
        if prefill_attention.usable(q, keys, values, mask):  # the CPU kernel: skips the slots a query cannot read
            return prefill_attention.prefill_attention(q, keys, values, mask, scale)
        if attention_blocks.worth_blocking(q):  # a long eager prefill: skip the slots each block cannot see
            out = attention_blocks.blocked_attention(q, keys, values, mask, scale, q_heads != kv_heads)
            if out is not None:
                return out
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q_heads != kv_heads,
                                              scale=scale)
    group = q_heads // kv_heads
    qg = q.view(batch, kv_heads, group, 1, head_dim)  # query heads grouped by the KV head they read
    scores = (qg * keys.unsqueeze(2)).sum(-1) * scale  # (batch, kv_heads, group, slots)
    scores = scores.masked_fill(~mask.view(batch, 1, 1, -1), float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    out = (weights.unsqueeze(-1) * values.unsqueeze(2)).sum(-2)  # (batch, kv_heads, group, head_dim)
    return out.view(batch, q_heads, 1, head_dim)


def as_param(tensor: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
    """Wrap a shard tensor as a frozen parameter; no copy when it already has `dtype`. A quantized
    weight stays as it is (8-bit; `linear` dequantizes it in the compute dtype)."""
    if isinstance(tensor, QuantizedWeight):
        tensor.compute_dtype = dtype
        return tensor
    return nn.Parameter(tensor.to(dtype), requires_grad=False)


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), the statistics taken in float32.

    offset 1 is Gemma's norm, y = (1 + w) * x / ..., computed wholly in float32 before the cast
    (Llama casts the normalised x first and multiplies in the activation dtype)."""

    def __init__(self, weight: torch.Tensor, eps: float, dtype: torch.dtype, offset: float = 0.0) -> None:
        super().__init__()
        self.offset = offset
        self.weight = as_param(weight, torch.float32 if offset else dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x32 * (self.offset + self.weight)).to(x.dtype)
        return self.weight * x32.to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with a weight and no bias (DBRX's norm_1, norm_2 and norm_f)."""

    def __init__(self, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = as_param(weight, dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, None, self.eps)


Reduce = Callable[[torch.Tensor], torch.Tensor]
"""How a block's partial sums (batch, seq, hidden) are completed: the all-reduce by default, or
under sequence parallelism a reduce-scatter to this rank's tokens (workers/sequence_parallel.py)."""


class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of the embedding table; other ids give zeros, the all-reduce fills them."""

    def __init__(self, weight: torch.Tensor, vocab_range: tuple[int, int], dtype: torch.dtype,
                 collectives: Collectives, scale: torch.Tensor | None = None) -> None:
        """scale: a 0-d tensor the embeddings are multiplied by (Gemma's sqrt(hidden_size)), or None."""
        super().__init__()
        self.weight = as_param(weight, dtype)  # (vocab_per_rank, hidden), zero rows past the vocab
        # [start, stop) as a tensor, so compiled graphs take it as an input: every rank's graph is
        # then the same graph, compiled once per host (workers/compile_once.py); as Python ints
        # they were constants, and each rank compiled a graph of its own. A buffer, so it moves with
        # the module; persistent: the Neuron path hands the module's state_dict to the device as
        # its weights (workers/compiled_neuron.py).
        self.register_buffer("vocab_range", torch.tensor(vocab_range, dtype=torch.int64))
        self.collectives = collectives
        self.scale = scale

    def forward(self, input_ids: torch.Tensor, reduce: Reduce | None = None) -> torch.Tensor:
        """(batch, seq) ids -> (batch, seq, hidden): this rank's rows, zeros elsewhere, summed over
        ranks (by `reduce`, default the all-reduce; see Reduce)."""
        start, stop = self.vocab_range
        owned = (input_ids >= start) & (input_ids < stop)  # (batch, seq)
        local_ids = torch.where(owned, input_ids - start, 0)
        hidden = self.weight.rows(local_ids) if isinstance(self.weight, (QuantizedWeight, PackedWeight)) else (
            F.embedding(local_ids, self.weight))  # (batch, seq, hidden)
        hidden = (reduce or self.collectives.all_reduce)(hidden * owned.unsqueeze(-1).to(hidden.dtype))
        return hidden if self.scale is None else hidden * self.scale.to(hidden.device)


class KVSlots(NamedTuple):
    """Where one layer's new keys and values go (see workers/kv_cache.py for both ways)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache_positions: torch.Tensor
    """(seq,) slots shared by the batch's rows, or (batch, seq) with rows."""
    rows: torch.Tensor | None = None
    """(batch, seq) cache row of each token (the serving engine); None: batch row i is cache row i."""


class Attention(nn.Module):
    """Self-attention over this rank's Q heads and the KV heads they read.

    q/k/v are column-parallel by whole heads, so each rank attends independently; o_proj is
    row-parallel over the same heads and its partial outputs are summed by one all-reduce. Within a
    rank, local Q head j reads local KV head j // (q_heads // kv_heads) for every KV strategy.
    """

    def __init__(self, weights: dict[str, torch.Tensor], q_heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, collectives: Collectives, *, eps: float = 1e-6, norm_offset: float = 0.0,
                 scale: float | None = None) -> None:
        """weights: this rank's q/k/v/o_proj tensors (and biases), plus q_norm.weight and
        k_norm.weight when the family normalises each head (Qwen3, Gemma 3). scale: of the scores
        (None: head_dim ** -0.5)."""
        super().__init__()
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        self.collectives = collectives
        self.scale = scale
        # Per-head RMSNorm over head_dim, before rotary: replicated, the same on every head and rank.
        self.q_norm, self.k_norm = (
            RMSNorm(weights[f"{n}_norm.weight"], eps, dtype, norm_offset) if f"{n}_norm.weight" in weights else None
            for n in "qk")
        o_bias = weights.get("o_proj.bias")
        self.o_bias = None if o_bias is None else as_param(o_bias, dtype)  # full (hidden,), added after the sum
        self.q_weight = as_param(weights["q_proj.weight"], dtype)  # (q_heads * head_dim, hidden)
        self.k_weight = as_param(weights["k_proj.weight"], dtype)  # (kv_heads * head_dim, hidden)
        self.v_weight = as_param(weights["v_proj.weight"], dtype)
        self.o_weight = as_param(weights["o_proj.weight"], dtype)  # (hidden, q_heads * head_dim)
        biases = [weights.get(f"{p}_proj.bias") for p in "qkv"]
        self.q_bias, self.k_bias, self.v_bias = (None if b is None else as_param(b, dtype) for b in biases)

    def project(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (batch, q_heads, seq, head_dim) and k, v (batch, kv_heads, seq, head_dim), rotated."""
        q, k, v = (linear(x, w, b) for w, b in ((self.q_weight, self.q_bias), (self.k_weight, self.k_bias),
                                                 (self.v_weight, self.v_bias)))
        return self.heads(q, k, v, cos, sin)

    def heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections (batch, seq, heads * head_dim) split into heads, q/k normalised, rotated."""
        batch, seq, _ = q.shape
        q = q.reshape(batch, seq, self.q_heads, self.head_dim)
        k = k.reshape(batch, seq, self.kv_heads, self.head_dim)
        v = v.reshape(batch, seq, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                kv: KVSlots | None = None, reduce: Reduce | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output (batch, seq, hidden) summed over ranks by `reduce`, k, v of the new tokens).

        kv None: the tokens are the whole history (a prefill from slot 0); they attend over their
        own keys and values under mask (batch, 1, seq, seq), and the caller stores k and v.
        kv given: k and v are written into the caches at their slots first, and the tokens attend
        over the whole cache under mask (batch, 1, seq, slots).
        """
        batch, seq, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        if kv is not None and decode_attention.usable(q, kv.k_cache):
            # A decode step on the CPU, traced or eager: the C kernel reads the cache rows itself, so
            # only the new keys and values are written. Eager steps too: torch's CPU attention splits
            # a lone row's work over threads unlike a batch's, so a request decoded alone and beside
            # others differed in the last bits (4e-05 in SmolLM2's logits at 2 threads), where the
            # kernel's sums for a row do not depend on the batch.
            store_kv(kv.k_cache, kv.v_cache, kv.cache_positions, k, v, kv.rows)
            scale = self.head_dim ** -0.5 if self.scale is None else self.scale
            out = decode_attention.decode_attention(q, kv.k_cache, kv.v_cache,
                                                    None if kv.rows is None else kv.rows[:, 0], mask,
                                                    mask.shape[-1], scale)
        else:
            keys, values = (k, v) if kv is None else write_kv(kv.k_cache, kv.v_cache, kv.cache_positions, k, v,
                                                              kv.rows, mask.shape[-1])
            out = attention(q, keys, values, mask, self.scale)
        out = out.transpose(1, 2).reshape(batch, seq, self.q_heads * self.head_dim)
        out = (reduce or self.collectives.all_reduce)(linear(out, self.o_weight))
        return (out if self.o_bias is None else out + self.o_bias), k, v


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)): gate/up column-parallel, down row-parallel, one all-reduce.

    Padded intermediate rows are zero in gate and up (and their biases), so they contribute
    act(0) * 0 = 0. A down_proj bias is whole on every rank and added once, after the sum.
    """

    def __init__(self, weights: dict[str, torch.Tensor], dtype: torch.dtype, collectives: Collectives,
                 activation: str = "silu") -> None:
        super().__init__()
        self.gate_weight = as_param(weights["gate_proj.weight"], dtype)  # (intermediate_per_rank, hidden)
        self.up_weight = as_param(weights["up_proj.weight"], dtype)
        self.down_weight = as_param(weights["down_proj.weight"], dtype)  # (hidden, intermediate_per_rank)
        self.gate_bias, self.up_bias, self.down_bias = (
            None if weights.get(f"{n}_proj.bias") is None else as_param(weights[f"{n}_proj.bias"], dtype)
            for n in ("gate", "up", "down"))
        self.act = ACTIVATIONS[activation]
        self.collectives = collectives

    def forward(self, x: torch.Tensor, reduce: Reduce | None = None) -> torch.Tensor:
        h = self.act(linear(x, self.gate_weight, self.gate_bias)) * linear(x, self.up_weight, self.up_bias)
        out = (reduce or self.collectives.all_reduce)(linear(h, self.down_weight))
        return out if self.down_bias is None else out + self.down_bias


class DecoderLayer(nn.Module):
    """Pre-norm residual blocks: x + attn(norm(x)), then x + mlp(norm(x)).

    With pre_/post_feedforward norms (Gemma 3's "sandwich"), post_attention_norm normalises the
    attention output before the residual add and the MLP is wrapped in its own pair:
    x + post_attn(attn(norm(x))), then x + post_ff(mlp(pre_ff(x))).

    kind: which of the model's attention kinds (rotary table and mask, workers/step.py) the layer reads.

    With a sequence split (workers/sequence_parallel.py) x is this rank's block of the tokens: each
    norm runs on the block, its output is gathered to the whole sequence for the block that follows,
    and that block's partial sums are reduce-scattered back to the rank's tokens.
    """

    def __init__(self, attention: Attention, mlp: MLP, input_norm: RMSNorm, post_attention_norm: RMSNorm,
                 pre_ff_norm: RMSNorm | None = None, post_ff_norm: RMSNorm | None = None, kind: int = 0) -> None:
        super().__init__()
        self.attention, self.mlp = attention, mlp
        self.input_norm, self.post_attention_norm = input_norm, post_attention_norm
        self.pre_ff_norm, self.post_ff_norm = pre_ff_norm, post_ff_norm
        self.kind = kind

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                kv: KVSlots | None = None, split=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x after the layer, the new tokens' k, v); see Attention.forward for kv and mask, and the
        class docstring for split (a workers.sequence_parallel.SequenceSplit, or None)."""
        gather, reduce = (_whole, None) if split is None else (split.gather, split.scatter_sum)
        attended, k, v = self.attention(gather(self.input_norm(x)), cos, sin, mask, kv, reduce)
        if self.pre_ff_norm is None:
            x = x + attended
            return x + self.mlp(gather(self.post_attention_norm(x)), reduce), k, v
        x = x + self.post_attention_norm(attended)
        return x + self.post_ff_norm(self.mlp(gather(self.pre_ff_norm(x)), reduce)), k, v


def _whole(x: torch.Tensor) -> torch.Tensor:
    return x
