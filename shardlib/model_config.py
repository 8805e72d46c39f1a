"""The model facts corelaunch needs, read from a Hugging Face config.json.

One frozen dataclass for every architecture of the Llama family (Llama, Mistral, Qwen2, Qwen3,
Gemma 3 text; what sets each apart: shardlib/families.py) and its mixture-of-experts relatives
(Mixtral, Qwen3-MoE, DBRX; their config dialects: shardlib/moe_configs.py):
the planner, the sharding math, the checkpoint reader and the workers all read the same object, so
a field is derived (head_dim, KV heads) in exactly one place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from shardlib.config_fields import (MAX_CONFIG_INT, MAX_LAYERS, count, field_error, finite, flag, mapping,
                                    positive_number, show, token_id, token_ids)
from shardlib.families import (LAYER_TYPES, SLIDING, FamilyTraits, check_activation, family_fields,
                                layer_norm_elements, per_kind_rope, traits)
from shardlib.moe_configs import MOE_MODEL_TYPES, flatten_moe_config
from shardlib.quantization import Quantization

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text") + MOE_MODEL_TYPES

# Rope scaling types workers/rope.py implements (None: plain rotary embeddings).
EXECUTABLE_ROPE_TYPES = (None, "llama3", "linear", "dynamic", "yarn", "longrope")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3": 1, "float8_e5m2": 1, "int8": 1}

# Hugging Face spells dtypes several ways across versions ("torch_dtype" or "dtype", "fp32"...).
_DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


# What each count of config.json looks like (Llama-3.1-8B's values), quoted in error messages.
_EXAMPLES = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 8192,
    "sliding_window": 4096, "num_local_experts": 8, "num_experts_per_tok": 2,
    "original_max_position_embeddings": 8192, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
}
_SIZE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")
_SIZE_RANGES = {
    "max_position_embeddings": (2, MAX_CONFIG_INT),  # one position holds a prompt token but no generated one
    "num_hidden_layers": (1, MAX_LAYERS),
}
"""Sizes whose range is not [1, MAX_CONFIG_INT]."""


def _size(name: str, value: Any) -> int:
    low, high = _SIZE_RANGES.get(name, (1, MAX_CONFIG_INT))
    return count(name, value, _EXAMPLES[name], minimum=low, maximum=high)


_FLAG_FIELDS = ("tie_word_embeddings", "attention_bias", "output_bias", "mlp_bias")
# What llama3 rope scaling needs (workers/rope.py reads them; checked here before any start-up).
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_ROPE_EXAMPLE = ('{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, '
                 '"original_max_position_embeddings": 8192}')


# The optional numbers of a yarn or longrope block that workers/rope_scaling.py computes with, and a
# value each may take (transformers' defaults). Unchecked, a string among them passed here and failed
# in every worker (a TypeError building RotaryTables) after each rank had loaded its weights.
_POSITIVE_SCALING_OPTIONS = {"yarn": ("attention_factor", "beta_fast", "beta_slow"), "longrope": ("attention_factor",)}
_UNSET_AT_ZERO_SCALING_OPTIONS = {"yarn": ("mscale", "mscale_all_dim")}
"""0 is allowed: yarn then takes its default attention factor, as transformers does."""
_SCALING_OPTION_EXAMPLES = {"attention_factor": 1.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                            "mscale_all_dim": 1.0}


def _check_scaling_options(name: str, params: dict, rope_type: Any) -> None:
    """The optional yarn / longrope keys the workers read: finite numbers (> 0, or >= 0 for mscale
    and mscale_all_dim, which 0 leaves unset), and yarn's truncate true or false. JSON null stands
    for an absent key (the default), except truncate, whose null transformers reads as false."""
    for key in _POSITIVE_SCALING_OPTIONS.get(rope_type, ()):
        if params.get(key) is not None:
            positive_number(f"{name}.{key}", params[key], _SCALING_OPTION_EXAMPLES[key])
    for key in _UNSET_AT_ZERO_SCALING_OPTIONS.get(rope_type, ()):
        value = params.get(key)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or not finite(value) or value < 0):
            raise field_error(f"{name}.{key}", value, "must be a finite number >= 0 (0 leaves it unset)",
                              f"write a bare JSON number such as {_SCALING_OPTION_EXAMPLES[key]}, or remove "
                              f"the key for transformers' default")
    if rope_type == "yarn" and "truncate" in params:
        flag(f"{name}.truncate", params["truncate"], nullable=False)


def _check_rope(name: str, params: Any, *, needs_type: bool) -> dict | None:
    """A rope_scaling / rope_parameters object: its type a string, its numbers in range, and a
    llama3 scaling complete (the workers read factor, low/high_freq_factor and the original context)."""
    mapping(name, params, _ROPE_EXAMPLE)
    if params is None:
        return None
    for key in ("rope_type", "type"):
        if key in params and not isinstance(params[key], str):
            raise field_error(f"{name}.{key}", params[key], "must be a string",
                              'write e.g. "llama3" or "default"')
    if needs_type and "rope_type" not in params and "type" not in params:
        raise field_error(name, params, "names no rope_type",
                          'add "rope_type" (e.g. "llama3"), or write null for plain rotary embeddings')
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if params.get(key) is not None:
            positive_number(f"{name}.{key}", params[key], _EXAMPLES[key])
    if params.get("original_max_position_embeddings") is not None:
        count(f"{name}.original_max_position_embeddings", params["original_max_position_embeddings"],
              _EXAMPLES["original_max_position_embeddings"])
    if params.get("rope_theta") is not None:
        positive_number(f"{name}.rope_theta", params["rope_theta"], 500000.0)
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type in ("linear", "dynamic", "yarn") and params.get("factor") is None:
        raise field_error(name, params, f"lacks factor, which {rope_type} scaling needs",
                          f'write e.g. {{"rope_type": "{rope_type}", "factor": 4.0}}')
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            value = params.get(key)
            if not isinstance(value, list) or not value or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and finite(v) and v > 0 for v in value):
                raise field_error(f"{name}.{key}", value, "must be a list of finite positive numbers, one per "
                                  "rotated pair (head_dim / 2)", "copy it from the checkpoint's config")
    _check_scaling_options(name, params, rope_type)
    if rope_type == "llama3":
        missing = [key for key in LLAMA3_ROPE_KEYS if params.get(key) is None]
        if missing:
            raise field_error(name, params, f"lacks {', '.join(missing)}, which llama3 scaling needs",
                              f"write e.g. {_ROPE_EXAMPLE}")
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        if high <= low:
            raise field_error(f"{name}.high_freq_factor", high, f"must exceed low_freq_factor ({show(low)})",
                              "llama3 interpolates between the two (Llama 3.1: 1.0 and 4.0)")
    return params


WIDER_THAN_COMPUTED = ("float64", "double", "fp64")
"""Checkpoint dtypes no rank computes in: such a checkpoint runs in float32 unless --dtype says otherwise."""


def _dtype_field(raw: dict[str, Any]) -> str:
    """The checkpoint dtype from dtype (transformers 5) or torch_dtype (4), float32 when neither
    (load_model_config then reads it from the weights, as transformers does). With both, dtype, as
    transformers 5 takes it (torch_dtype was taken: a config saved by 5 after a cast kept the old
    torch_dtype beside the new dtype)."""
    for key in ("dtype", "torch_dtype"):
        value = raw.get(key)
        if value is not None:
            if isinstance(value, str) and value.replace("torch.", "").lower() in WIDER_THAN_COMPUTED:
                # transformers would compute in float64; corelaunch computes in float32 at most. It was
                # refused, --dtype float32 included, though every weight casts to float32 as it loads
                return "float32"
            if isinstance(value, str):
                try:
                    return normalize_dtype(value)
                except ValueError:
                    pass
            raise field_error(key, value, "must name a dtype: float32, bfloat16 or float16 "
                              "(or fp32, bf16, fp16, float, half)", 'write e.g. "bfloat16"')
    return "float32"


def normalize_dtype(name: str) -> str:
    """Map a user's or a config's dtype spelling to one of float32/bfloat16/float16."""
    key = str(name).replace("torch.", "").lower()
    if key not in _DTYPE_ALIASES:
        raise ValueError(
            f"unknown dtype {name!r}; use one of float32, bfloat16, float16"
        ) from None
    return _DTYPE_ALIASES[key]


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one decoder-only checkpoint."""

    model_type: str
    """One of SUPPORTED_MODEL_TYPES."""
    hidden_size: int
    intermediate_size: int
    """Per expert for Mixtral."""
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    """From the config when present (Mistral, Qwen3-style configs), else hidden_size // heads."""
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    """The config's rope scaling dict (e.g. {"rope_type": "llama3", "factor": 8.0, ...}) or None."""
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Bias on q/k/v projections (Qwen2 always; Llama/Mistral when config.attention_bias)."""
    output_bias: bool = False
    """Bias on o_proj (Llama configs with attention_bias set it too; Qwen2 has none)."""
    mlp_bias: bool = False
    """Bias on gate/up/down projections (Llama's mlp_bias)."""
    sliding_window: int | None = None
    """Attention window when the model uses one (Mistral v0.1: 4096; Qwen2 with use_sliding_window;
    Gemma 3's local layers): a token attends to itself and the window - 1 tokens before it."""
    layer_types: tuple[str, ...] | None = None
    """Per layer "sliding_attention" or "full_attention" when some layer uses the window; None: none does."""
    local_rope_theta: float | None = None
    """Gemma 3: rope base of the sliding-window layers (rope_theta and rope_scaling are the global layers')."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by query_pre_attn_scalar ** -0.5 (Gemma 3); None: head_dim ** -0.5."""
    final_logit_softcapping: float | None = None
    """Logits become cap * tanh(logits / cap)."""
    hidden_act: str = "silu"
    """The MLP's gate activation: silu, or gelu_pytorch_tanh (Gemma 3)."""
    torch_dtype: str = "float32"
    """The checkpoint's own dtype; the default compute dtype."""
    num_local_experts: int = 0
    """Experts per layer (0 for dense models)."""
    num_experts_per_tok: int = 0
    moe_topk_norm: float | None = None
    """The top-k routing weights are divided by their L-p norm for this p (1.0: by their sum, as
    Mixtral, Qwen3-MoE with norm_topk_prob and DBRX's moe_normalize_expert_weights do); None: used
    as the softmax gave them."""
    clip_qkv: float | None = None
    """DBRX: q, k and v are clamped to [-clip_qkv, clip_qkv] after the projection."""
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    quantization: Quantization | None = None
    """Quantized weights (config.json's quantization_config, shardlib/quantization.py); None: none."""

    def __post_init__(self) -> None:
        """Every field in type and range (a one-line ValueError naming the field, value and fix)."""
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture model_type={show(self.model_type)}; corelaunch supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in _SIZE_FIELDS:
            _size(name, getattr(self, name))
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        if heads % kv_heads:
            raise field_error("num_key_value_heads", kv_heads,
                              f"does not divide num_attention_heads ({heads}): not a valid GQA config",
                              f"use a divisor of {heads} (e.g. {heads} for no grouping, or 1)")
        if self.head_dim % 2:
            raise field_error("head_dim", self.head_dim, "must be even (rotary embeddings turn pairs of "
                              "dimensions)", "set head_dim, or hidden_size / num_attention_heads, to an even size")
        positive_number("rms_norm_eps", self.rms_norm_eps, 1e-05)
        positive_number("rope_theta", self.rope_theta, 500000.0)
        _check_rope("rope_scaling", self.rope_scaling, needs_type=True)
        if self.rope_scaling and self.rope_scaling.get("rope_type", self.rope_scaling.get("type")) == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(self.rope_scaling[key]) != self.head_dim // 2:
                    raise field_error(f"rope_scaling.{key}", f"<{len(self.rope_scaling[key])} numbers>",
                                      f"must hold head_dim / 2 = {self.head_dim // 2} numbers",
                                      "copy it from the checkpoint's config")
        for name in _FLAG_FIELDS:
            flag(name, getattr(self, name), nullable=False)
        if self.sliding_window is not None:
            count("sliding_window", self.sliding_window, _EXAMPLES["sliding_window"])
        if self.layer_types is not None and (
                len(self.layer_types) != self.num_hidden_layers or any(t not in LAYER_TYPES for t in self.layer_types)
                or self.sliding_window is None):
            raise field_error("layer_types", self.layer_types, f"must name one of {', '.join(LAYER_TYPES)} per "
                              f"layer ({self.num_hidden_layers}), with a sliding_window set",
                              "build ModelConfig with from_dict")
        check_activation("hidden_act", self.hidden_act)
        if self.torch_dtype not in ("float32", "bfloat16", "float16"):
            raise field_error("torch_dtype", self.torch_dtype, "must be float32, bfloat16 or float16",
                              "normalize it with normalize_dtype()")
        experts = count("num_local_experts", self.num_local_experts, 8, minimum=0)
        per_token = count("num_experts_per_tok", self.num_experts_per_tok, 2, minimum=0)
        for name in ("moe_topk_norm", "clip_qkv"):
            if getattr(self, name) is not None:
                positive_number(name, getattr(self, name), 1.0)
        if self.model_type in MOE_MODEL_TYPES and not experts:
            raise field_error("num_local_experts", experts, f"must be at least 1 for a {self.model_type} model "
                              f"(a mixture of experts)", "write the experts per layer (Mixtral: 8)")
        if self.model_type not in MOE_MODEL_TYPES and (experts or per_token):  # is_moe means an MoE family
            raise field_error("num_local_experts" if experts else "num_experts_per_tok", experts or per_token,
                              f"is set for a {self.model_type} model, which has no experts",
                              "leave it 0 (from_dict ignores a dense config.json's expert fields, as "
                              "transformers does)")
        if experts and not 1 <= per_token <= experts:
            raise field_error("num_experts_per_tok", per_token,
                              f"must be between 1 and num_local_experts ({experts}) for a mixture-of-experts model",
                              "write the experts each token is routed to (Mixtral: 2)")
        token_id("bos_token_id", self.bos_token_id)
        token_id("pad_token_id", self.pad_token_id)
        if not isinstance(self.eos_token_id, tuple):
            raise field_error("eos_token_id", self.eos_token_id, "must be a tuple of token ids",
                              "build ModelConfig with from_dict, or pass a tuple")
        token_ids("eos_token_id", self.eos_token_id)

    def executor_gaps(self, seq_len: int | None = None) -> list[str]:
        """Why corelaunch's workers cannot run this model (empty when they can).

        The planner sizes any config (NxD Inference may run what corelaunch cannot); the launcher
        refuses these before starting any process, instead of failing after every rank has loaded.
        """
        gaps = []
        rope_type = None if self.rope_scaling is None else self.rope_scaling.get(
            "rope_type", self.rope_scaling.get("type"))
        if rope_type not in EXECUTABLE_ROPE_TYPES:
            gaps.append(f"rope scaling type {rope_type!r} is not implemented by corelaunch's workers "
                        f"(supported: default, {', '.join(t for t in EXECUTABLE_ROPE_TYPES if t)})")
        return gaps

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, or None when it attends over the whole history."""
        if self.layer_types is None or self.layer_types[layer] != SLIDING:
            return None
        return self.sliding_window

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 0

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def layer_param_count(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        mlp = 3 * h * i
        if self.is_moe:
            mlp = self.num_local_experts * mlp + h * self.num_local_experts  # experts + router
        if self.output_bias:
            attn += h
        if self.mlp_bias:
            mlp += 2 * i + h
        return attn + mlp + layer_norm_elements(self)

    def param_count(self) -> int:
        embed = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else embed
        return embed + lm_head + self.num_hidden_layers * self.layer_param_count() + self.hidden_size

    def config_hash(self) -> str:
        """Stable hash of every field that changes tensor shapes or numerics (not token ids)."""
        fields = dataclasses.asdict(self)
        for ignored in UNHASHED_FIELDS:
            fields.pop(ignored)
        for name in _HASHED_WHEN_SET:  # fields added later: absent at their default, so older hashes hold
            if fields[name] == _DEFAULTS[name]:
                fields.pop(name)
        blob = json.dumps(fields, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: Path | None = None) -> "ModelConfig":
        """Build from a parsed config.json of any supported architecture (transformers 4.x or 5.x).
        source: the file it was read from, named where a refusal says which file to edit."""
        try:
            return cls._from_dict(raw, source)
        except ValueError as err:
            if isinstance(raw, dict) and raw.get("model_type") == "dbrx":  # its fields were renamed to Llama's
                from shardlib.moe_configs import in_dbrx_names

                raise ValueError(in_dbrx_names(str(err))) from None
            raise

    @classmethod
    def _from_dict(cls, raw: dict[str, Any], source: Path | None) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ValueError(f"config.json must hold a JSON object, not {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type is None:  # transformers' AutoConfig needs it too
            raise ValueError(
                f"config.json names no model_type (architectures={show(raw.get('architectures'))}); add the one "
                f"these weights were saved as, e.g. \"model_type\": \"llama\" (corelaunch supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)})")
        if model_type not in SUPPORTED_MODEL_TYPES:
            hint = ("; a Gemma 3 image-text checkpoint nests its text model in text_config: corelaunch runs "
                    "text-only Gemma 3 checkpoints (model_type gemma3_text)" if model_type == "gemma3" else "")
            raise ValueError(
                f"unsupported architecture model_type={show(model_type)} (architectures="
                f"{show(raw.get('architectures'))}); corelaunch supports {', '.join(SUPPORTED_MODEL_TYPES)}{hint}"
            )
        raw, moe_fields = flatten_moe_config(raw)
        family = traits(model_type)
        if model_type != "gemma3_text":  # transformers merges Gemma 3's rope_scaling into its per-kind blocks
            raw = _with_top_level_original_context(raw)
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads", "vocab_size") if k not in raw]
        if missing:
            raise ValueError(missing_fields(missing, model_type, source))
        # Fields derived from others are checked here, under their config.json names; the rest
        # (and these again) by __post_init__. JSON null stands for an absent optional field.
        hidden = count("hidden_size", raw["hidden_size"], _EXAMPLES["hidden_size"])
        heads = count("num_attention_heads", raw["num_attention_heads"], _EXAMPLES["num_attention_heads"])
        # A missing key takes the family's default (Qwen3: head_dim 128; Mistral: 8 KV heads), as
        # transformers' config classes fill it in; JSON null takes the derived value.
        head_dim = raw.get("head_dim", family.head_dim)
        if head_dim is None:
            if hidden % heads:
                raise field_error("hidden_size", hidden, f"is not divisible by num_attention_heads ({heads}) "
                                  f"and config.json has no head_dim", "add head_dim (the size of one attention "
                                  "head), or correct hidden_size or num_attention_heads")
            head_dim = hidden // heads
        kv_heads = raw.get("num_key_value_heads", family.num_key_value_heads)
        if "num_key_value_heads" not in raw and kv_heads is not None and heads % kv_heads:
            raise field_error("num_attention_heads", heads, f"is not a multiple of {kv_heads}, the "
                              f"num_key_value_heads a {model_type} config has when it leaves that key out "
                              f"(as transformers reads it)", "add num_key_value_heads to config.json (the "
                              "checkpoint's k_proj rows / head_dim)")
        extra = family_fields(model_type, raw, _size("num_hidden_layers", raw["num_hidden_layers"]), head_dim)
        # transformers 5 nests rope settings in "rope_parameters"; 4.x has rope_theta + rope_scaling.
        # (Gemma 3 keeps one block per layer kind; family_fields has read it.)
        if "local_rope_theta" in extra:
            _check_rope("rope_scaling", raw.get("rope_scaling"), needs_type=True)
            name = "rope_parameters.full_attention" if per_kind_rope(raw) else "rope_scaling"
            rope_theta, rope_scaling = extra.pop("rope_theta"), _check_rope(name, extra.pop("rope_scaling"), needs_type=True)
            _refuse_partial_rotary_with_scaling(raw, name, rope_scaling or {})  # as the one-block families
        else:
            rope_theta, rope_scaling = _rope_as_transformers_reads_it(raw, family.rope_theta)
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        # Qwen2 always biases q/k/v and never o_proj; Llama's attention_bias biases all four. A flag
        # the family's modules do not read is checked, then ignored, as transformers ignores it.
        biased = flag("attention_bias", raw.get("attention_bias")) and family.reads_attention_bias
        mlp_biased = flag("mlp_bias", raw.get("mlp_bias")) and family.reads_mlp_bias

        def default(key: str, value: Any) -> Any:
            return value if raw.get(key) is None else raw[key]

        return cls(
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=heads if kv_heads is None else kv_heads,
            head_dim=head_dim,
            vocab_size=raw["vocab_size"],
            rms_norm_eps=default("rms_norm_eps", family.rms_norm_eps),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=default("max_position_embeddings", family.max_position_embeddings),
            tie_word_embeddings=flag("tie_word_embeddings", raw.get("tie_word_embeddings"), family.tied_by_default),
            attention_bias=model_type == "qwen2" or biased,
            output_bias=biased,
            mlp_bias=mlp_biased,
            **extra,
            torch_dtype=_dtype_field(raw),
            **_expert_fields(model_type, default, family),
            bos_token_id=token_id("bos_token_id", raw.get("bos_token_id")),
            eos_token_id=token_ids("eos_token_id", raw.get("eos_token_id")),
            pad_token_id=token_id("pad_token_id", raw.get("pad_token_id")),
            quantization=Quantization.from_json(raw.get("quantization_config")),
            **moe_fields,
        )


def _expert_fields(model_type: str, default: Callable[[str, Any], Any],
                   family: FamilyTraits) -> dict[str, Any]:
    """num_local_experts and num_experts_per_tok: read for the mixture-of-experts families only. A
    dense family's config.json may carry them (copied from another config); transformers' dense
    models never read them, so neither does corelaunch: read, they made a Llama an MoE model whose
    dense MLP tensors check_checkpoint then refused."""
    if model_type not in MOE_MODEL_TYPES:
        return {"num_local_experts": 0, "num_experts_per_tok": 0}
    return {"num_local_experts": default("num_local_experts", family.num_local_experts),
            "num_experts_per_tok": default("num_experts_per_tok", family.num_experts_per_tok)}


def _rope_as_transformers_reads_it(raw: dict[str, Any], family_theta: float) -> tuple[Any, dict | None]:
    """(rope_theta, scaling block) of a one-block config. transformers takes rope_scaling, when set,
    wholesale and ignores rope_parameters, its rope_theta included; the block's own rope_theta, else
    the top-level one, else the family's, is the base. Both set and disagreeing is refused: a
    rope_parameters block that silently does not count would surprise whoever wrote it."""
    top_theta = raw.get("rope_theta")
    top_theta = family_theta if top_theta is None else positive_number("rope_theta", top_theta, 500000.0)
    rope_params = _check_rope("rope_parameters", raw.get("rope_parameters"), needs_type=False)
    rope_scaling = _check_rope("rope_scaling", raw.get("rope_scaling"), needs_type=True)
    if rope_scaling is not None and rope_params:
        _refuse_disagreeing_rope_blocks(rope_scaling, rope_params, top_theta)
    name, block = ("rope_scaling", rope_scaling) if rope_scaling is not None else ("rope_parameters", rope_params or {})
    theta = block["rope_theta"] if block.get("rope_theta") is not None else top_theta  # checked by _check_rope
    rope_type = block.get("rope_type", block.get("type", "default"))
    _refuse_partial_rotary_with_scaling(raw, name, block)
    if rope_scaling is None and rope_type != "default":
        rope_scaling = {k: v for k, v in block.items() if k != "rope_theta"}
    return theta, rope_scaling


def _rotation_of(block: dict, top_theta: float) -> tuple[float, dict | None]:
    """(base, scaling) a rope block describes, spelled one way (rope_type, not type; None: no scaling)."""
    theta = float(block["rope_theta"] if block.get("rope_theta") is not None else top_theta)
    rope_type = block.get("rope_type", block.get("type", "default"))
    scaling = {k: v for k, v in block.items() if k not in ("rope_theta", "rope_type", "type")}
    return theta, None if rope_type == "default" and not scaling else {**scaling, "rope_type": rope_type}


def _refuse_disagreeing_rope_blocks(rope_scaling: dict, rope_params: dict, top_theta: float) -> None:
    """Both blocks run only where rope_parameters says nothing transformers' reading loses: the same
    base, and no scaling or rope_scaling's (a transformers 5 config keeps its base in a default-type
    rope_parameters; a rope_scaling added beside it, as 4.x model cards say, keeps that base only when
    a top-level rope_theta repeats it)."""
    read_theta, read_scaling = _rotation_of(rope_scaling, top_theta)
    written_theta, written_scaling = _rotation_of(rope_params, top_theta)
    if written_theta == read_theta and written_scaling in (None, read_scaling):
        return
    raise field_error("rope_parameters", rope_params,
                      f"disagrees with rope_scaling={show(rope_scaling)}: transformers reads rope_scaling alone "
                      f"and ignores rope_parameters, its rope_theta included (it would run rope_type "
                      f"{read_scaling['rope_type'] if read_scaling else 'default'} with rope_theta "
                      f"{show(read_theta)})", "move rope_scaling's settings into rope_parameters and remove "
                      "rope_scaling, or remove rope_parameters to run what transformers runs")


def _refuse_partial_rotary_with_scaling(raw: dict[str, Any], name: str, block: dict) -> None:
    """partial_rotary_factor below 1 with the scaled rope `block` says (the types corelaunch runs;
    others are left to executor_gaps): the workers rotate every dimension, and
    transformers' model fails with a shape error (its scaled frequencies cover only the partial
    dimensions, which its Llama-family attention rotates in full; checked on tiny Llama and Qwen2
    models with linear, dynamic, yarn, llama3 and longrope scaling). As there, the block's own factor
    takes precedence over a top-level one. With default rope those families ignore the factor, as
    corelaunch does, so it is accepted there."""
    rope_type = block.get("rope_type", block.get("type", "default"))
    if rope_type == "default" or rope_type not in EXECUTABLE_ROPE_TYPES:
        return
    name, value = f"{name}.partial_rotary_factor", block.get("partial_rotary_factor")
    if value is None:
        name, value = "partial_rotary_factor", raw.get("partial_rotary_factor")
    if value is not None and value != 1:
        raise field_error(name, value, f"is not supported with {rope_type} rope scaling: corelaunch rotates every "
                          f"dimension of a head, and transformers' model cannot run it either (a shape error)",
                          "remove partial_rotary_factor (or set it to 1.0) to rotate whole heads")


_READ_FROM_THE_WEIGHTS = {
    "hidden_size": "the columns of model.embed_tokens.weight",
    "intermediate_size": "the rows of an MLP's gate_proj.weight (Mixtral: of an expert's w1.weight)",
    "num_hidden_layers": "the count of model.layers.N in the weights",
    "num_attention_heads": "the rows of q_proj.weight divided by the head size",
    "vocab_size": "the rows of model.embed_tokens.weight",
}
"""Where a checkpoint's own tensors give each required field's value (Llama-family names)."""

_READ_FROM_DBRX_WEIGHTS = {
    "hidden_size": "the columns of transformer.wte.weight",
    "num_hidden_layers": "the count of transformer.blocks.N in the weights",
    "num_attention_heads": "2 x attn_config.kv_n_heads x d_model / (the rows of a block's "
                           "norm_attn_norm.attn.Wqkv.weight - d_model)",
    "vocab_size": "the rows of transformer.wte.weight",
}
"""The same for DBRX's tensor names (its ffn_hidden_size has a default, so it is never missing);
from_dict then renames the fields to the config.json's (in_dbrx_names)."""


def missing_fields(missing: list[str], model_type: str, source: Path | None) -> str:
    """The refusal of a config.json without fields every model needs: which file to edit, and where
    the values come from (it named neither)."""
    read_from = _READ_FROM_DBRX_WEIGHTS if model_type == "dbrx" else _READ_FROM_THE_WEIGHTS
    where = "; ".join(f"{name}: {read_from[name]}" for name in missing)
    return (f"{source or 'config.json'} lacks required field(s) {missing} for a {model_type} model; add each with "
            f"the value in the original model's config.json (the checkpoint's shapes give them too: {where})")


def _with_top_level_original_context(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers' rule for llama3, yarn and longrope scaling given as one block: a top-level
    original_max_position_embeddings (Phi-3's layout) takes precedence over the block's own (not for
    Gemma 3, whose blocks are per layer kind). Applied before the blocks are checked, so a llama3
    block completed by it is complete. Without either, yarn and longrope take max_position_embeddings
    when they compute (workers/rope_scaling.py)."""
    top = raw.get("original_max_position_embeddings")
    if top is None:
        return raw
    moved = {}
    for key in ("rope_scaling", "rope_parameters"):
        block = raw.get(key)
        if isinstance(block, dict) and block.get("rope_type", block.get("type")) in ("llama3", "yarn", "longrope"):
            moved[key] = {**block, "original_max_position_embeddings": count("original_max_position_embeddings",
                                                                             top, 8192)}
    return {**raw, **moved}


UNHASHED_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype")
"""Fields config_hash leaves out: token ids and the stored dtype change no tensor's shape or numerics."""
# The mixture-of-experts family whose weights a dense family's config.json most likely belongs to,
# when it carries an expert count: Qwen3-MoE for the Qwen families, Mixtral for the others.
_LIKELY_MOE_FAMILY = {"qwen2": ("Qwen3-MoE", "qwen3_moe"), "qwen3": ("Qwen3-MoE", "qwen3_moe")}


def ignored_expert_fields(raw: Any) -> str | None:
    """A warning when a dense family's config.json carries an expert count (num_local_experts, or
    its alias num_experts) above 0: the count is ignored, as transformers ignores it, so a Mixtral
    checkpoint saved with "model_type": "mistral" plans as a dense 7B model. None otherwise.
    (Not a ModelConfig field: it would change the config hash of every checkpoint that carries it.)"""
    if not isinstance(raw, dict) or raw.get("model_type") not in SUPPORTED_MODEL_TYPES \
            or raw["model_type"] in MOE_MODEL_TYPES:
        return None
    name = next((n for n in ("num_local_experts", "num_experts") if _positive_count(raw.get(n))), None)
    if name is None:
        return None
    model_type = raw["model_type"]
    family, moe_type = _LIKELY_MOE_FAMILY.get(model_type, ("Mixtral", "mixtral"))
    return (f"{name} ({raw[name]}) is ignored for a {model_type} model, as transformers ignores it; if these "
            f"are {family} weights, set model_type to {moe_type}")


def _positive_count(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


_HASHED_WHEN_SET = ("moe_topk_norm", "clip_qkv")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}


def load_model_config(path: str | Path) -> ModelConfig:
    """Read a model directory (containing config.json) or a config.json file."""
    typed, path = path, Path(path)  # typed: as given, its `./` kept (a Path drops it) for the hint below
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.exists():
        from shardlib.model_path_hints import cache_repo_hint, dangling_link, missing_model_hint

        dangling = dangling_link(config_file)
        if dangling is not None:
            raise FileNotFoundError(dangling) from None
        if (path / "manifest.json").is_file():  # what corelaunch compile or preshard wrote
            raise FileNotFoundError(
                f"{path} is a corelaunch compiled or pre-sharded directory (it holds manifest.json), not a Hugging "
                f"Face model: pass the model it was made from as --model (generate and serve take the directory "
                f"itself as --compiled or --presharded)") from None
        raise FileNotFoundError(
            f"no Hugging Face config at {os.path.abspath(config_file)}; pass a model directory containing "
            f"config.json (`corelaunch plan` also takes the config.json file itself){missing_model_hint(typed)}"
            f"{cache_repo_hint(path)}"
        ) from None
    raw = read_config_json(config_file)
    config = ModelConfig.from_dict(raw, source=config_file)
    if raw.get("torch_dtype") is None and raw.get("dtype") is None:
        from shardlib.weights_dtype import stored_weights_dtype

        # transformers' rule when config.json names no dtype; its folder's weights too where the
        # file itself was given (`plan --model DIR/config.json` planned float32 beside bf16 weights),
        # not beside another JSON file, which may sit among another model's weights
        stored = stored_weights_dtype(config_file.parent) if config_file.name == "config.json" else None
        if stored is not None and stored != config.torch_dtype:
            config = dataclasses.replace(config, torch_dtype=stored)
    return config


def read_config_json(config_file: Path) -> Any:
    """The parsed JSON of an existing config.json; ValueError naming the file when it cannot be."""
    if not config_file.is_file():  # a directory fails to read; a FIFO would block the read forever
        raise ValueError(f"{config_file} is not a regular file; the model directory needs its config.json as a file")
    try:
        return json.loads(config_file.read_text())
    except (ValueError, RecursionError) as err:  # JSONDecodeError, bad UTF-8, a too-long integer, nesting
        hint = ("" if config_file.name.endswith(".json") else
                f"; pass the model directory ({config_file.parent}) or its config.json, not another file in it")
        raise ValueError(f"{config_file} is not valid JSON: {err}{hint}") from None
    except OSError as err:  # unreadable (permissions)
        raise ValueError(f"cannot read {config_file}: {err.strerror or err}; make it readable") from None
