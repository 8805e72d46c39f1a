"""The model facts corelaunch needs, read from a Hugging Face config.json.

One frozen dataclass for every architecture of the Llama family (Llama, Mistral, Qwen2, Mixtral):
the planner, the sharding math, the checkpoint reader and the workers all read the same object, so
a field is derived (head_dim, KV heads) in exactly one place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardlib.positive_int import is_positive_int

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral")

# Rope scaling types workers/rope.py implements (None: plain rotary embeddings).
EXECUTABLE_ROPE_TYPES = (None, "llama3")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3": 1, "float8_e5m2": 1, "int8": 1}

# Hugging Face spells dtypes several ways across versions ("torch_dtype" or "dtype", "fp32"...).
_DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


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
    """Attention window when the model uses one (Mistral v0.1: 4096; Qwen2 with use_sliding_window)."""
    torch_dtype: str = "float32"
    """The checkpoint's own dtype; the default compute dtype."""
    num_local_experts: int = 0
    """Mixtral: experts per layer (0 for dense models)."""
    num_experts_per_tok: int = 0
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture model_type={self.model_type!r}; corelaunch supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size"):
            value = getattr(self, name)
            if not is_positive_int(value):
                raise ValueError(f"config field {name}={value!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}): not a valid GQA config"
            )

    def executor_gaps(self, seq_len: int | None = None) -> list[str]:
        """Why corelaunch's workers cannot run this model (empty when they can).

        The planner sizes any config (NxD Inference may run what corelaunch cannot); the launcher
        refuses these before starting any process, instead of failing after every rank has loaded.
        """
        gaps = []
        if self.is_moe:
            gaps.append(f"{self.model_type} is a mixture-of-experts model ({self.num_local_experts} experts); "
                        f"corelaunch plans it but its workers run dense models only")
        rope_type = None if self.rope_scaling is None else self.rope_scaling.get(
            "rope_type", self.rope_scaling.get("type"))
        if rope_type not in EXECUTABLE_ROPE_TYPES:
            gaps.append(f"rope scaling type {rope_type!r} is not implemented by corelaunch's workers "
                        f"(supported: default, llama3)")
        if self.output_bias or self.mlp_bias:
            which = [n for n, on in (("o_proj (attention_bias)", self.output_bias), ("mlp (mlp_bias)", self.mlp_bias)) if on]
            gaps.append(f"biases on {' and '.join(which)} are not implemented by corelaunch's workers")
        if self.sliding_window is not None and seq_len is not None and seq_len > self.sliding_window:
            gaps.append(f"seq_len ({seq_len}) exceeds the model's sliding_window ({self.sliding_window}), which "
                        f"corelaunch's attention does not apply; use --seq-len {self.sliding_window} or less")
        return gaps

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
        return attn + mlp + 2 * h  # two RMSNorm weights

    def param_count(self) -> int:
        embed = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else embed
        return embed + lm_head + self.num_hidden_layers * self.layer_param_count() + self.hidden_size

    def config_hash(self) -> str:
        """Stable hash of every field that changes tensor shapes or numerics (not token ids)."""
        fields = dataclasses.asdict(self)
        for ignored in ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype"):
            fields.pop(ignored)
        blob = json.dumps(fields, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed config.json of any supported architecture (transformers 4.x or 5.x)."""
        if not isinstance(raw, dict):
            raise ValueError(f"config.json must hold a JSON object, not {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = raw.get("architectures")
            raise ValueError(
                f"unsupported architecture model_type={model_type!r} (architectures={archs}); "
                f"corelaunch supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads", "vocab_size") if k not in raw]
        if missing:
            raise ValueError(f"config.json lacks required field(s) {missing} for a {model_type} model")
        heads = raw["num_attention_heads"]
        if not is_positive_int(heads):
            raise ValueError(f"config field num_attention_heads={heads!r} must be a positive integer")
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        # transformers 5 nests rope settings in "rope_parameters"; 4.x has rope_theta + rope_scaling.
        rope_params = raw.get("rope_parameters") or {}
        rope_theta = rope_params.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_scaling = raw.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        # Qwen2 always biases q/k/v and never o_proj; Llama's attention_bias biases all four.
        attention_bias = model_type == "qwen2" or bool(raw.get("attention_bias", False))
        output_bias = model_type != "qwen2" and bool(raw.get("attention_bias", False))
        window = raw.get("sliding_window")
        uses_window = model_type == "mistral" or (model_type == "qwen2" and raw.get("use_sliding_window"))
        return cls(
            model_type=model_type,
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            vocab_size=raw["vocab_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            output_bias=output_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=window if uses_window and window else None,
            torch_dtype=normalize_dtype(dtype),
            num_local_experts=raw.get("num_local_experts", 0) or 0,
            num_experts_per_tok=raw.get("num_experts_per_tok", 0) or 0,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_ids,
            pad_token_id=raw.get("pad_token_id"),
        )


def load_model_config(path: str | Path) -> ModelConfig:
    """Read a model directory (containing config.json) or a config.json file."""
    path = Path(path)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.exists():
        raise FileNotFoundError(
            f"no Hugging Face config at {config_file}; pass a model directory containing "
            f"config.json, or the config.json file itself"
        ) from None
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file} is not valid JSON: {err}") from None
    return ModelConfig.from_dict(raw)
