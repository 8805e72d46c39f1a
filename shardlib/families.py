"""What sets each supported family apart from Llama, in one place (the mixture-of-experts families'
config dialects and expert facts: shardlib/moe_configs.py).

Two kinds of facts:
- `FamilyTraits`: fixed by the model_type (which extra weights exist, how norms and embeddings
  compute). Llama, Mistral and Qwen2 have none of them; Qwen3 adds per-head q/k RMSNorm; Gemma 3
  adds those plus its (1 + w) norms, a norm after attention and around the MLP, and embeddings
  scaled by sqrt(hidden_size); Qwen3-MoE has Qwen3's q/k norms; DBRX normalises with LayerNorm.
- `family_fields(model_type, raw)`: the config.json values ModelConfig needs beyond Llama's (which
  layers use a sliding window, Gemma 3's local rope base, query scaling, final logit soft-capping,
  activation),
  with transformers' own defaults where config.json leaves them out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardlib.config_fields import count, field_error, flag, mapping, positive_number

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
ACTIVATION_ALIASES = {"swish": "silu"}
"""Other names transformers gives the same function (its ACT2FN maps "swish" to SiLU)."""
GEMMA3_WINDOW_PATTERN = 6
"""transformers' default for Gemma 3 configs without layer_types: every 6th layer is global."""


@dataclass(frozen=True)
class FamilyTraits:
    qk_norm: bool = False
    """Per-head RMSNorm of q and k before rotary (self_attn.q_norm / k_norm, weight (head_dim,))."""
    norm_offset: float = 0.0
    """RMSNorm scales by (norm_offset + w): Gemma stores w around 0 and multiplies by 1 + w."""
    sandwich_norms: bool = False
    """Gemma 3: post_attention_layernorm normalises the attention output (before the residual), and
    pre_/post_feedforward_layernorm wrap the MLP; otherwise post_attention_layernorm is the MLP's input norm."""
    scaled_embeddings: bool = False
    """Embeddings multiplied by sqrt(hidden_size) (in the weight dtype), as Gemma does."""
    tied_by_default: bool = False
    """tie_word_embeddings when config.json leaves it out (transformers' default for the family)."""
    layer_norm: bool = False
    """Norms are LayerNorm without bias instead of RMSNorm (DBRX's norm_1, norm_2 and norm_f)."""
    # transformers' config class defaults for fields config.json may leave out
    # (tests/test_family_defaults.py compares them with the installed transformers' classes)
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    head_dim: int | None = None
    """head_dim when config.json has no head_dim key (None: hidden_size / num_attention_heads; JSON
    null also means that)."""
    num_key_value_heads: int | None = None
    """num_key_value_heads when config.json has no such key (None: the head count; JSON null also
    means the head count, as transformers' Llama and Qwen config classes read null)."""
    max_position_embeddings: int = 2048
    sliding_window: int | None = None
    """The window when config.json has no sliding_window key at all (JSON null: no window); the Qwen
    families apply it only with use_sliding_window."""
    # Which of config.json's bias flags the family's modules read: transformers' Mistral, Mixtral and
    # Qwen2 build their projections with fixed biases (Qwen2: q, k and v always, o never) and ignore both flags.
    reads_attention_bias: bool = False
    reads_mlp_bias: bool = False
    # The mixture-of-experts families' expert counts and width (Qwen3-MoE's moe_intermediate_size)
    # when config.json leaves them out; 0 for the dense families.
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None


TRAITS = {
    "llama": FamilyTraits(reads_attention_bias=True, reads_mlp_bias=True),
    "mistral": FamilyTraits(max_position_embeddings=131_072, sliding_window=4096, num_key_value_heads=8),
    "qwen2": FamilyTraits(max_position_embeddings=32_768, sliding_window=4096, num_key_value_heads=32),
    "mixtral": FamilyTraits(rope_theta=1_000_000.0, rms_norm_eps=1e-5, max_position_embeddings=131_072,
                            num_local_experts=8, num_experts_per_tok=2, num_key_value_heads=8),
    "qwen3": FamilyTraits(qk_norm=True, max_position_embeddings=32_768, sliding_window=4096,
                          reads_attention_bias=True, head_dim=128, num_key_value_heads=32),
    "qwen3_moe": FamilyTraits(qk_norm=True, max_position_embeddings=32_768, sliding_window=4096,
                              reads_attention_bias=True, num_local_experts=128, num_experts_per_tok=8,
                              moe_intermediate_size=768, num_key_value_heads=4),
    "dbrx": FamilyTraits(layer_norm=True),  # its nested config: shardlib/moe_configs.py
    "gemma3_text": FamilyTraits(qk_norm=True, norm_offset=1.0, sandwich_norms=True, scaled_embeddings=True,
                                tied_by_default=True, max_position_embeddings=131_072, sliding_window=4096,
                                reads_attention_bias=True, head_dim=256, num_key_value_heads=4),
}


def traits(model_type: str) -> FamilyTraits:
    return TRAITS.get(model_type, FamilyTraits())


def layer_norm_elements(config) -> int:
    """Norm weights of one decoder layer (a ModelConfig's), whole on every rank: two hidden-size
    norms (Gemma 3: four), plus the per-head q/k norms of Qwen3 and Gemma 3."""
    family = traits(config.model_type)
    return (4 if family.sandwich_norms else 2) * config.hidden_size + (2 * config.head_dim if family.qk_norm else 0)


# transformers' models of these families put the window on every layer and never read layer_types:
# a config.json carrying one ran windowed on alternate layers here and on every layer there. Not
# Mistral: transformers' AutoConfig reads a "mistral" config.json with layer_types as Ministral,
# which honours them, and so does this reader.
WINDOW_ON_EVERY_LAYER = ("mixtral", "qwen3_moe")


def ignored_layer_types(raw: Any) -> str | None:
    """A warning when a config.json of a WINDOW_ON_EVERY_LAYER family lists a layer that does not
    slide in its layer_types: it is ignored, as transformers ignores it. None otherwise."""
    if not isinstance(raw, dict) or raw.get("model_type") not in WINDOW_ON_EVERY_LAYER:
        return None
    given = raw.get("layer_types")
    if not isinstance(given, list) or all(kind == SLIDING for kind in given):
        return None  # nothing that would change: every layer slides either way
    try:
        if sliding_window(raw["model_type"], raw) is None:
            return None  # no window: every layer attends over the whole history either way
    except ValueError:
        return None  # a bad window field: the plan's own check names it
    return (f"layer_types is ignored for a {raw['model_type']} model, as transformers ignores it: the sliding "
            f"window, where the config sets one, applies to every layer")


def _layer_types(model_type: str, raw: dict[str, Any], window: int | None, layers: int) -> tuple[str, ...] | None:
    """Per-layer attention kind, or None when every layer attends over the whole history."""
    given = None if model_type in WINDOW_ON_EVERY_LAYER else raw.get("layer_types")
    if given is not None:
        if not isinstance(given, list) or len(given) != layers or any(t not in LAYER_TYPES for t in given):
            raise field_error("layer_types", given, f"must list one of {', '.join(LAYER_TYPES)} per layer "
                              f"({layers} layers)", "write e.g. [\"sliding_attention\", \"full_attention\"]")
        kinds = tuple(given)
    elif model_type == "gemma3_text":
        pattern = raw.get("sliding_window_pattern")
        pattern = GEMMA3_WINDOW_PATTERN if pattern is None else count("sliding_window_pattern", pattern, 6)
        kinds = tuple(SLIDING if (i + 1) % pattern else FULL for i in range(layers))
    elif model_type in ("mistral", *WINDOW_ON_EVERY_LAYER):  # Qwen3-MoE: every layer, no max_window_layers
        kinds = tuple([SLIDING] * layers)
    elif model_type in ("qwen2", "qwen3"):
        first = raw.get("max_window_layers")
        first = 28 if first is None else count("max_window_layers", first, 28, minimum=0)
        kinds = tuple(SLIDING if i >= first else FULL for i in range(layers))
    else:
        kinds = tuple([FULL] * layers)
    if window is None and SLIDING in kinds and model_type == "gemma3_text":
        # Gemma 3's sliding layers differ in their rope too (the local base), so reading them as
        # global layers would be wrong even without a window; transformers' model cannot be built from it.
        raise field_error("sliding_window", None, "leaves Gemma 3's sliding_attention layers without a window",
                          "write the model's window (Gemma 3's configs use 512 or 1024)")
    if window is None or SLIDING not in kinds:
        return None
    return kinds


def sliding_window(model_type: str, raw: dict[str, Any]) -> int | None:
    """The window when the model applies one (transformers' rule per family), else None."""
    window = raw.get("sliding_window", traits(model_type).sliding_window)
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not flag("use_sliding_window", raw.get("use_sliding_window")):
        return None
    if model_type == "llama":  # Llama's attention has no window, whatever config.json says
        return None
    # checked only where it applies: a window of 0 in a config whose family never reads it ran in
    # transformers and was refused here
    return None if window is None else count("sliding_window", window, 4096)


def per_kind_rope(raw: dict[str, Any]) -> bool:
    """Whether Gemma 3's rope settings are one block per layer kind (transformers 5's rope_parameters)."""
    params = raw.get("rope_parameters")
    return isinstance(params, dict) and (FULL in params or SLIDING in params)


def check_activation(name: str, act: Any) -> None:
    """ValueError naming the config field `name` unless `act` is an activation the workers run."""
    if act not in ACTIVATIONS:
        raise field_error(name, act, f"is not implemented (corelaunch runs {', '.join(ACTIVATIONS)})",
                          "use a checkpoint with one of those activations")


def _gemma_rope(raw: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 keeps one rope block per layer kind (transformers 5) or rope_theta /
    rope_local_base_freq / rope_scaling (4.x): the global layers' theta and scaling, the local base."""
    params = mapping("rope_parameters", raw.get("rope_parameters"), '{"full_attention": {...}, "sliding_attention": {...}}')
    if per_kind_rope(raw):
        full = mapping("rope_parameters.full_attention", params.get(FULL), '{"rope_type": "default"}') or {}
        local = mapping("rope_parameters.sliding_attention", params.get(SLIDING), '{"rope_type": "default"}') or {}
        if local.get("rope_type", "default") != "default":
            raise field_error("rope_parameters.sliding_attention.rope_type", local.get("rope_type"),
                              "is not supported for Gemma 3's local layers", "corelaunch runs default rope there")
        theta = full.get("rope_theta", 1_000_000.0)
        local_theta = local.get("rope_theta", 10_000.0)
        scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    else:
        theta = raw.get("rope_theta")  # null: the default, as for every family
        theta = 1_000_000.0 if theta is None else theta
        local_theta = raw.get("rope_local_base_freq")
        local_theta = 10_000.0 if local_theta is None else local_theta
        scaling = mapping("rope_scaling", raw.get("rope_scaling"), '{"rope_type": "linear", "factor": 8.0}') or {}
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return {"rope_theta": positive_number("rope_theta", theta, 1_000_000.0),
            "local_rope_theta": positive_number("rope_local_base_freq", local_theta, 10_000.0),
            "rope_scaling": scaling}


def family_fields(model_type: str, raw: dict[str, Any], layers: int, head_dim: int) -> dict[str, Any]:
    """ModelConfig keyword arguments particular to the family (see the module docstring)."""
    window = sliding_window(model_type, raw)
    fields: dict[str, Any] = {"sliding_window": window,
                              "layer_types": _layer_types(model_type, raw, window, layers)}
    if fields["layer_types"] is None:
        fields["sliding_window"] = None
    if model_type == "gemma3_text":
        if flag("use_bidirectional_attention", raw.get("use_bidirectional_attention")):
            raise field_error("use_bidirectional_attention", True, "makes a bidirectional encoder (EmbeddingGemma's "
                              "setting), not a causal language model", "corelaunch generates with causal attention "
                              "only: serve a Gemma 3 text model without it")
        fields.update(_gemma_rope(raw))
        # transformers' Gemma 3 reads hidden_activation alone (a hidden_act beside it, as older Gemma
        # configs write, is ignored there: reading it ran SiLU where transformers runs its default)
        act = raw.get("hidden_activation") or "gelu_pytorch_tanh"  # null: the default
        act = ACTIVATION_ALIASES.get(act, act) if isinstance(act, str) else act
        check_activation("hidden_activation", act)  # named as this family's field (ModelConfig's says hidden_act)
        scalar = raw.get("query_pre_attn_scalar")
        # attn_logit_softcapping is not read: transformers' Gemma 3 attention never applies it
        # (5.23 passes no softcap to its attention functions; Gemma 3's own configs set it null).
        fields.update(
            hidden_act=act,
            query_pre_attn_scalar=positive_number("query_pre_attn_scalar", 256 if scalar is None else scalar, 256),
            final_logit_softcapping=_optional_positive(raw, "final_logit_softcapping", 30.0),
        )
    elif raw.get("hidden_act") is not None:
        act = raw["hidden_act"]
        fields["hidden_act"] = ACTIVATION_ALIASES.get(act, act) if isinstance(act, str) else act
    return fields


def _optional_positive(raw: dict[str, Any], key: str, example: float) -> float | None:
    value = raw.get(key)
    return None if value is None else positive_number(key, value, example)
