"""Random Llama-family checkpoints for tests, built with transformers from a fixed seed.

The initializer range is raised well above the 0.02 default so logits are peaked: greedy choices
then never tie, and cannot flip with the summation order of a sharded computation.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FORMATS = ("safetensors", "safetensors_sharded", "bin", "bin_sharded")


def build_random_model(model_type: str = "llama", *, hidden_size: int = 64, intermediate_size: int = 96,
                       num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, vocab_size: int = 128,
                       tie_word_embeddings: bool = False, seed: int = 0, initializer_range: float = 0.25,
                       max_position_embeddings: int = 512, rope_scaling: dict | None = None, **extra):
    """A transformers model (eval mode, float32) of the given shape with seeded random weights.

    extra: further config fields (head_dim, sliding_window, layer_types, attention_bias, ...)."""
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                  "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
                  "gemma3_text": transformers.Gemma3TextConfig}[model_type]
    kwargs = dict(hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, vocab_size=vocab_size,
                  tie_word_embeddings=tie_word_embeddings, initializer_range=initializer_range,
                  max_position_embeddings=max_position_embeddings, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, **extra)
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Norms start at one (Gemma's at zero, meaning one) and biases at zero; randomise them so
        # their sharding and the (1 + w) form are tested.
        for name, tensor in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                tensor.normal_(1.0 if model_type != "gemma3_text" and "norm" in name else 0.0, 0.1
                               if "norm" in name else initializer_range)
    if model_type == "qwen2":
        # Qwen2 initialises q/k/v biases to zero; make them non-zero so their sharding is tested.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, initializer_range)
    return model.eval()


def save_model(model, path: Path, fmt: str = "safetensors") -> Path:
    """Save `model` in one of FORMATS: single or sharded safetensors, single or sharded pickle."""
    path = Path(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; use one of {FORMATS}")
    if fmt == "safetensors":
        model.save_pretrained(path)
    elif fmt == "safetensors_sharded":
        model.save_pretrained(path, max_shard_size="100KB")
    else:
        model.config.save_pretrained(path)
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        if fmt == "bin":
            torch.save(state, path / "pytorch_model.bin")
        else:
            names = sorted(state)
            halves = [names[: len(names) // 2], names[len(names) // 2:]]
            weight_map = {}
            for i, part in enumerate(halves, 1):
                file = f"pytorch_model-{i:05d}-of-{len(halves):05d}.bin"
                torch.save({n: state[n] for n in part}, path / file)
                weight_map.update({n: file for n in part})
            (path / "pytorch_model.bin.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return path


def save_random_model(path: Path, model_type: str = "llama", fmt: str = "safetensors", **shape) -> Path:
    """Build a seeded random model and save it; returns the model directory."""
    return save_model(build_random_model(model_type, **shape), path, fmt)
