"""`ShardedCausalLM`: one rank's slice of a Llama-family causal LM (Llama, Mistral, Qwen2, Qwen3,
Gemma 3 text: workers/family_layers.py) or of a mixture-of-experts one (Mixtral, Qwen3-MoE, DBRX:
workers/moe_layers.py).

Built from a ModelConfig, a ShardLayout, the rank, and that rank's shard: a dict of Hugging Face
parameter names to tensors cut exactly as `apply_slice(full, slice_for(model_type, name, shape,
rank, layout))` cuts them. The model never sees a full-size weight and contains no rank-dependent
branches: the sizes come from the layout, the communication from a `Collectives` object (for TP 1,
`SingleRank`, which does nothing).

Communication per forward: one all-reduce after the embedding, one after each attention block's
o_proj and one after each MLP's down_proj (2 per layer), and one all-gather of the last positions'
logits along the vocabulary. The forward itself is workers/step.py's, shared with every compiled path.
"""

from __future__ import annotations

import torch
from torch import nn

from shardlib.model_config import ModelConfig, normalize_dtype
from shardlib.moe_configs import MOE_MODEL_TYPES
from shardlib.moe_params import model_names
from shardlib.param_shapes import expected_shapes
from shardlib.sharding import ShardLayout, Style, slice_for, style_for
from workers.collectives import Collectives
from workers.kv_cache import KVCache
from workers.family_layers import build_layer, embedding_scale, family_norm, layer_kinds
from workers.layers import VocabParallelEmbedding, as_param, linear
from workers.moe_layers import moe_decoder_layer
from workers.quantized_linear import pack_quantized
from workers.rope import RotaryTables
from workers.step import EAGER, StepParts, epilogue, run_step


def _last_hidden(model, x: torch.Tensor, logit_index: torch.Tensor | None) -> torch.Tensor:
    """An epilogue that keeps every column's hidden state (before the final norm)."""
    return x


HIDDEN = StepParts(epilogue=_last_hidden)
"""The step's parts with no LM head: a scoring step's (ShardedCausalLM.score_step)."""

DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
RUNNABLE_MODEL_TYPES = DENSE_MODEL_TYPES + MOE_MODEL_TYPES


def resolve_dtype(dtype: torch.dtype | str | None, config: ModelConfig) -> torch.dtype:
    """A torch dtype from a torch dtype, a spelling like "bf16", or None (the checkpoint's own)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, normalize_dtype(dtype if dtype is not None else config.torch_dtype))


def check_layout(config: ModelConfig, layout: ShardLayout, rank: int, collectives: Collectives) -> None:
    """ValueError when the layout, rank or collectives do not describe this model's TP group."""
    if config.model_type not in RUNNABLE_MODEL_TYPES:
        raise ValueError(
            f"ShardedCausalLM supports model_type {', '.join(RUNNABLE_MODEL_TYPES)}; got {config.model_type!r}"
        )
    for field, model_value in (("num_heads", config.num_attention_heads),
                               ("num_kv_heads", config.num_key_value_heads), ("head_dim", config.head_dim),
                               ("hidden_size", config.hidden_size),
                               ("intermediate_size", config.intermediate_size),
                               ("vocab_size", config.vocab_size), ("num_experts", config.num_local_experts)):
        if getattr(layout, field) != model_value:
            raise ValueError(
                f"layout.{field} ({getattr(layout, field)}) differs from the model config's "
                f"({model_value}); build the layout with ShardLayout.for_model(config, tp_degree)"
            )
    if not 0 <= rank < layout.tp_degree:
        raise ValueError(f"rank ({rank}) must be in 0 .. tp_degree - 1 ({layout.tp_degree - 1})")
    if collectives.world_size != layout.tp_degree or collectives.rank != rank:
        raise ValueError(
            f"collectives report rank {collectives.rank} of world_size {collectives.world_size} but "
            f"the model is built as rank {rank} of tp_degree {layout.tp_degree}; pass SingleRank() "
            f"only for TP 1 and a process group of exactly tp_degree ranks otherwise"
        )


def check_shard(config: ModelConfig, layout: ShardLayout, rank: int,
                shard: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The shard's tensors the model reads, after checking every name and per-rank shape."""
    expected = expected_shapes(config)
    missing = sorted(name for name in expected if name not in shard)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"rank {rank}'s shard lacks {len(missing)} tensor(s): {shown}")
    for name in shard:
        if name in expected or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        try:
            skipped = style_for(config.model_type, name) is Style.SKIP
        except ValueError:
            skipped = False
        if not skipped:
            raise ValueError(f"rank {rank}'s shard holds {name!r}, which this {config.model_type} model does not use")
    for name, full in expected.items():
        tslice = slice_for(config.model_type, name, full, rank, layout)
        want = tslice.shape(full)
        if tuple(shard[name].shape) != want:
            raise ValueError(
                f"shard tensor {name!r} has shape {tuple(shard[name].shape)} but rank {rank} of "
                f"tp_degree {layout.tp_degree} should hold {want} (full shape {full}); cut it with "
                f"apply_slice(full, slice_for(...)) for this rank and layout"
            )
    return {name: shard[name] for name in expected}


class ShardedCausalLM(nn.Module):
    kv_cache_dtype: torch.dtype | None = None
    """The KV cache's storage dtype (workers/kv_quant.py: fp8); None: the compute dtype."""
    sequence_parallel: bool = False
    """Split the residual stream of multi-token steps along the sequence (workers/sequence_parallel.py)."""

    def __init__(self, config: ModelConfig, layout: ShardLayout, rank: int, shard: dict[str, torch.Tensor],
                 collectives: Collectives, dtype: torch.dtype | str | None = None) -> None:
        super().__init__()
        check_layout(config, layout, rank, collectives)
        shard = pack_quantized(check_shard(config, layout, rank, shard))
        self.config, self.layout, self.rank, self.collectives = config, layout, rank, collectives
        self.dtype = resolve_dtype(dtype, config)

        names = model_names(config)
        self.embed = VocabParallelEmbedding(shard[names.embed], layout.vocab_range(rank), self.dtype, collectives,
                                            embedding_scale(config, self.dtype))
        self.attention_kinds, kind_of = layer_kinds(config)
        self.layers = nn.ModuleList(
            moe_decoder_layer(config, layout, rank, shard, i, kind_of[i], self.dtype, collectives) if config.is_moe
            else build_layer(config, layout, shard, i, kind_of[i], self.dtype, collectives)
            for i in range(config.num_hidden_layers))
        self.norm = family_norm(config, shard[names.final_norm], self.dtype)
        if config.tie_word_embeddings:
            self.lm_head_weight = self.embed.weight  # same vocab slice, same storage
        else:
            self.lm_head_weight = as_param(shard["lm_head.weight"], self.dtype)  # (vocab_per_rank, hidden)
        self.rotary: tuple[RotaryTables, ...] = ()  # one per attention kind

    @property
    def device(self) -> torch.device:
        return self.lm_head_weight.device

    # ---- cache ---------------------------------------------------------------------------------
    def new_cache(self, batch: int, max_seq_len: int, long_lived: bool = False) -> KVCache:
        """A zeroed KV cache for `batch` sequences of up to `max_seq_len` tokens (prompt included);
        long_lived: the serving engine's (see KVCache)."""
        cache = KVCache(self.config.num_hidden_layers, batch, self.layout.kv_heads_per_rank, max_seq_len,
                        self.config.head_dim, dtype=self.kv_cache_dtype or self.dtype, device=self.device,
                        long_lived=long_lived)
        self._ensure_rotary(max_seq_len)
        return cache

    def _ensure_rotary(self, max_positions: int) -> None:
        # Rebuilt only when a larger cache is allocated; never inside the decode loop.
        if not self.rotary or self.rotary[0].max_positions < max_positions:
            self.rotary = tuple(RotaryTables(self.config.head_dim, max_positions, kind.rope_theta, kind.rope_scaling,
                                             device=self.device,
                                             max_position_embeddings=self.config.max_position_embeddings)
                                for kind in self.attention_kinds)

    # ---- forward -------------------------------------------------------------------------------
    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits: (batch, hidden) -> (batch, vocab_per_rank)."""
        return linear(hidden, self.lm_head_weight)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
                cache_positions: torch.Tensor, attention_mask: torch.Tensor | None = None,
                logit_index: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, vocab_size) float32 of one position of each row (by default the last),
        run eagerly; the new tokens' keys and values are written into `cache`.

        input_ids, position_ids: (batch, seq). position_ids are the rotary positions of each token
            (in a left-padded batch they start at 0 at each row's first real token).
        cache_positions: (seq,) cache slots the new tokens occupy, shared by all rows.
        attention_mask: (batch, max_seq_len) over cache slots, true where the slot holds a real
            token (or will); None means every slot. Causality comes from cache_positions.
        logit_index: (1,) int64, the input column whose logits are returned (a prefill padded on
            the right to a bucket wants its last real column); None means the last column.
        """
        batch, seq = input_ids.shape
        if seq > cache.max_seq_len or batch != cache.batch:
            raise ValueError(
                f"input of batch {batch} x seq {seq} does not fit a KV cache of batch {cache.batch} x "
                f"max_seq_len {cache.max_seq_len}"
            )
        self._ensure_rotary(cache.max_seq_len)
        if attention_mask is None:
            attention_mask = torch.ones(batch, cache.max_seq_len, dtype=torch.bool, device=input_ids.device)
        logits, _, _ = run_step(self, EAGER, input_ids, position_ids, attention_mask, cache_positions,
                                (cache.k, cache.v), logit_index)
        return logits

    def serve_step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
                   cache_positions: torch.Tensor, rows: torch.Tensor, read_slots: int,
                   logit_index: torch.Tensor | None = None) -> torch.Tensor:
        """The serving engine's step, eagerly: token (i, j) is written to cache row rows[i, j] at slot
        cache_positions[i, j], and batch row i attends over slots 0 .. read_slots - 1 of cache row
        rows[i, 0] (workers/kv_cache.py). Logits (batch, vocab_size) float32 at logit_index (1,), or
        the last column."""
        return self._serving_step(EAGER, input_ids, position_ids, cache, cache_positions, rows, read_slots,
                                  logit_index)

    def score_step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
                   cache_positions: torch.Tensor, rows: torch.Tensor, read_slots: int) -> torch.Tensor:
        """serve_step's forward (same cache writes and reads), eagerly, returning every column's hidden
        state (batch, seq, hidden) instead of one column's logits: column_logits takes them a block
        at a time, so a long chunk's logits (seq x vocab) are never all held at once."""
        return self._serving_step(HIDDEN, input_ids, position_ids, cache, cache_positions, rows, read_slots)

    def _serving_step(self, parts: StepParts, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
                      cache_positions: torch.Tensor, rows: torch.Tensor, read_slots: int,
                      logit_index: torch.Tensor | None = None) -> torch.Tensor:
        """One eager step on the serving cache's indexing (serve_step's docstring), through `parts`."""
        self._ensure_rotary(cache.max_seq_len)
        mask = torch.ones(input_ids.shape[0], read_slots, dtype=torch.bool, device=input_ids.device)
        out, _, _ = run_step(self, parts, input_ids, position_ids, mask, cache_positions, (cache.k, cache.v),
                             logit_index, rows)
        return out

    def column_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (n, vocab_size) float32 of hidden states (n, hidden) from score_step: the final
        norm, the LM head and the gather over ranks, as every step's last column gets them."""
        return epilogue(self, hidden[:, None, :], None)
