"""Random Llama-family and mixture-of-experts checkpoints for tests, built with transformers from a
fixed seed.

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
                       max_position_embeddings: int = 512, rope_scaling: dict | None = None,
                       num_experts: int = 4, experts_per_token: int = 2, moe_options: dict | None = None, **extra):
    """A transformers model (eval mode, float32) of the given shape with seeded random weights.

    extra: further config fields (head_dim, sliding_window, layer_types, attention_bias, ...).
    Mixture-of-experts types (mixtral, qwen3_moe, dbrx) have num_experts experts of width
    intermediate_size, experts_per_token routed per token; moe_options adds family settings
    (e.g. norm_topk_prob, clip_qkv), extra the fields their config class shares (sliding_window, ...)."""
    import transformers

    if model_type in MOE_CONFIGS:
        if rope_scaling is not None and model_type == "dbrx":
            raise ValueError("the factory's dbrx takes no rope_scaling (its rope sits in attn_config)")
        scaling = {} if rope_scaling is None else {"rope_scaling": rope_scaling}  # it was dropped, unseen
        config = MOE_CONFIGS[model_type](hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads,
                                         vocab_size, num_experts, experts_per_token, initializer_range,
                                         max_position_embeddings, {**extra, **scaling, **(moe_options or {})})
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
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


def _mixtral(h, i, layers, heads, kv_heads, vocab, experts, top_k, init, positions, options):
    import transformers

    return transformers.MixtralConfig(
        hidden_size=h, intermediate_size=i, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=vocab, num_local_experts=experts, num_experts_per_tok=top_k,
        initializer_range=init, max_position_embeddings=positions, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, **options)


def _qwen3_moe(h, i, layers, heads, kv_heads, vocab, experts, top_k, init, positions, options):
    import transformers

    return transformers.Qwen3MoeConfig(
        hidden_size=h, intermediate_size=2 * i, moe_intermediate_size=i, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=h // heads, vocab_size=vocab,
        num_experts=experts, num_experts_per_tok=top_k, initializer_range=init,
        max_position_embeddings=positions, bos_token_id=1, eos_token_id=2, pad_token_id=0, **options)


def _dbrx(h, i, layers, heads, kv_heads, vocab, experts, top_k, init, positions, options):
    import transformers

    options = dict(options)
    # transformers 5's DbrxAttention reads attn_config.rope_theta (the sub-config lacks it unless given)
    # but never uses it: its rotary takes the base from rope_parameters (default 10000), so the
    # comparisons hold at 10000 only, where corelaunch (which reads attn_config's) agrees.
    attn = dict(kv_n_heads=kv_heads, rope_theta=10000.0, clip_qkv=options.pop("clip_qkv", None))
    ffn = dict(ffn_hidden_size=i, moe_num_experts=experts, moe_top_k=top_k,
               moe_normalize_expert_weights=options.pop("moe_normalize_expert_weights", 1.0))
    return transformers.DbrxConfig(
        d_model=h, n_heads=heads, n_layers=layers, vocab_size=vocab, max_seq_len=positions, attn_config=attn,
        ffn_config=ffn, initializer_range=init, bos_token_id=1, eos_token_id=2, pad_token_id=0, **options)


MOE_CONFIGS = {"mixtral": _mixtral, "qwen3_moe": _qwen3_moe, "dbrx": _dbrx}


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


def checkpoint_state_dict(model) -> dict[str, torch.Tensor]:
    """The tensors save_pretrained writes for `model`, by their checkpoint names.

    transformers 5 holds Mixtral's and Qwen3-MoE's experts as fused 3-D tensors in memory but saves
    them per expert (experts.{e}.w1...), the names corelaunch reads; this is what a checkpoint holds."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        return load_file(f"{directory}/model.safetensors")


def random_model_with_smollm2_tokenizer(path: Path) -> str:
    """A small random Llama as wide as SmolLM2's vocabulary, saved in `path` with SmolLM2's tokenizer
    and chat template: the real tokenizer's special tokens and words, a model that loads in seconds."""
    import shutil

    from shardlib.demo_model import ensure_demo_model

    path = save_model(build_random_model("llama", seed=3, vocab_size=49152), path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(ensure_demo_model() / name, path / name)
    return str(path)
