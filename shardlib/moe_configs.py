"""The config.json dialects of the mixture-of-experts families, read into Llama-style fields.

ModelConfig.from_dict reads Llama's field names (hidden_size, num_attention_heads, ...). Mixtral
uses them already; Qwen3-MoE keeps its experts' width in moe_intermediate_size; DBRX names
everything its own way and nests attention and FFN settings (d_model, n_heads, n_layers,
max_seq_len, attn_config.kv_n_heads / clip_qkv / rope_theta, ffn_config.ffn_hidden_size /
moe_num_experts / moe_top_k / moe_normalize_expert_weights). `flatten_moe_config` returns the
Llama-named dict plus the ModelConfig fields only these families set.
"""

from __future__ import annotations

import re
from typing import Any

from shardlib.config_fields import field_error, flag, mapping, positive_number, show
from shardlib.families import ACTIVATION_ALIASES, traits

MOE_MODEL_TYPES = ("mixtral", "qwen3_moe", "dbrx")
_ACTIVATIONS = ("silu",)  # what workers/moe.py's experts compute


def _check_activation(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or ACTIVATION_ALIASES.get(value, value) not in _ACTIVATIONS):
        raise field_error(name, value, f"is not implemented by corelaunch's experts (they run {', '.join(_ACTIVATIONS)})",
                          "only checkpoints with SiLU-gated experts run")


def _sub_config(raw: dict, name: str) -> dict:
    return mapping(name, raw.get(name), '{"kv_n_heads": 8}') or {}


def flatten_moe_config(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(raw with Llama field names, extra ModelConfig fields) for a MoE family's config.json; other
    families pass through unchanged with no extras."""
    model_type = raw.get("model_type")
    if model_type == "mixtral":
        _check_activation("hidden_act", raw.get("hidden_act"))
        # transformers 5's MixtralConfig reads num_experts as num_local_experts (its attribute_map),
        # and where both are set num_experts wins
        out = {**raw, "num_local_experts": _first_set(raw, "num_experts", "num_local_experts")}
        return out, {"moe_topk_norm": 1.0}  # Mixtral always renormalises its top-k
    if model_type == "qwen3_moe":
        return _qwen3_moe(raw)
    if model_type == "dbrx":
        return _dbrx(raw)
    return raw, {}


def _qwen3_moe(raw: dict) -> tuple[dict, dict]:
    """Its nulls follow transformers 4.x (a null num_local_experts takes num_experts, a null
    norm_topk_prob is false): transformers 5.25 refuses a null norm_topk_prob and leaves a null
    expert count None, which no checkpoint runs with."""
    _check_activation("hidden_act", raw.get("hidden_act"))
    out = dict(raw)
    out["num_local_experts"] = _first_set(raw, "num_local_experts", "num_experts")  # transformers 5 / 4 spelling
    # The experts' width (transformers' default where it is missing); no dense layer uses the other.
    width = raw.get("moe_intermediate_size")
    out["intermediate_size"] = traits("qwen3_moe").moe_intermediate_size if width is None else width
    dense_layers = _dense_layers_reached(raw.get("mlp_only_layers"), raw.get("num_hidden_layers"))
    step = raw.get("decoder_sparse_step", 1)
    if dense_layers or step not in (1, None):
        raise field_error("mlp_only_layers" if dense_layers else "decoder_sparse_step",
                          raw["mlp_only_layers"] if dense_layers else step,
                          f"puts dense MLP layers{f' (layers {dense_layers})' if dense_layers else ''} between "
                          "the MoE layers, which corelaunch does not run", "only Qwen3-MoE checkpoints whose every "
                          "layer is MoE (mlp_only_layers [] and decoder_sparse_step 1) are supported")
    # null reads as false (transformers 4.x): the router renormalises only when the flag is truthy
    norm = flag("norm_topk_prob", raw.get("norm_topk_prob"))
    return out, {"moe_topk_norm": 1.0 if norm else None}  # q/k norms: families.TRAITS


def _first_set(raw: dict, *names: str) -> Any:
    """The first of `names` whose value is not null: an explicit `"num_local_experts": null` beside
    `"num_experts": 4` means 4 experts, not the family default."""
    return next((raw[name] for name in names if raw.get(name) is not None), None)


def _dense_layers_reached(listed: Any, num_layers: Any) -> list[int]:
    """The layers of mlp_only_layers that exist. An index outside 0..num_hidden_layers-1 names no layer
    (transformers' layers never reach it), so it does not make the model partly dense."""
    if listed is None:
        return []
    if not isinstance(listed, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in listed):
        raise field_error("mlp_only_layers", listed, "must be a list of layer indices",
                          "write a JSON list of integers, or [] when every layer is MoE")
    if not isinstance(num_layers, int) or isinstance(num_layers, bool):
        return []  # ModelConfig refuses num_hidden_layers itself
    return sorted({i for i in listed if 0 <= i < num_layers})


# Llama's name -> DBRX's config.json path, for the fields _dbrx renames
_DBRX_NAMES = {"hidden_size": "d_model", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers",
               "max_position_embeddings": "max_seq_len", "num_key_value_heads": "attn_config.kv_n_heads",
               "intermediate_size": "ffn_config.ffn_hidden_size", "num_local_experts": "ffn_config.moe_num_experts",
               "num_experts_per_tok": "ffn_config.moe_top_k", "rope_theta": "attn_config.rope_theta"}
_LLAMA_NAME = re.compile(r"(?<![\w.])(" + "|".join(_DBRX_NAMES) + r")(?![\w])")


def in_dbrx_names(message: str) -> str:
    """A refusal of a DBRX config with the fields named as its config.json has them: checked after
    _dbrx renamed them, it said `num_local_experts='4'` of a file that holds ffn_config.moe_num_experts."""
    return _LLAMA_NAME.sub(lambda m: _DBRX_NAMES[m.group(1)], message)


def _dbrx(raw: dict) -> tuple[dict, dict]:
    attn, ffn = _sub_config(raw, "attn_config"), _sub_config(raw, "ffn_config")
    act = ffn.get("ffn_act_fn") or {"name": "silu"}
    _check_activation("ffn_config.ffn_act_fn.name", act.get("name", "silu") if isinstance(act, dict) else act)
    out = {k: v for k, v in raw.items() if k not in ("attn_config", "ffn_config")}
    renamed = {"hidden_size": raw.get("d_model"), "num_attention_heads": raw.get("n_heads"),
               "num_hidden_layers": raw.get("n_layers"), "max_position_embeddings": raw.get("max_seq_len"),
               "num_key_value_heads": attn.get("kv_n_heads", 1), "intermediate_size": ffn.get("ffn_hidden_size", 3584),
               "num_local_experts": ffn.get("moe_num_experts", 4), "num_experts_per_tok": ffn.get("moe_top_k", 1),
               "rms_norm_eps": 1e-5}  # nn.LayerNorm's default eps, which DBRX's norms use
    # a missing d_model, n_heads or n_layers stays missing: the required-field refusal names the file
    # and where the weights give the value (model_config.missing_fields), in DBRX's names
    out.update({k: v for k, v in renamed.items() if v is not None})
    if raw.get("rope_parameters") is None and attn.get("rope_theta") is not None:
        out["rope_theta"] = attn["rope_theta"]
    clip = attn.get("clip_qkv")
    if clip is not None:
        clip = positive_number("attn_config.clip_qkv", clip, 8.0)
    norm_p = ffn.get("moe_normalize_expert_weights", 1.0)
    if norm_p is not None:
        norm_p = positive_number("ffn_config.moe_normalize_expert_weights", norm_p, 1.0)
    if raw.get("tie_word_embeddings"):
        raise field_error("tie_word_embeddings", raw["tie_word_embeddings"], "is not supported by DBRX",
                          f"set it to false (got {show(raw['tie_word_embeddings'])})")
    return out, {"clip_qkv": clip, "moe_topk_norm": norm_p}  # LayerNorm: families.TRAITS
