"""The dtype a checkpoint's weights are stored in, for a config.json that names none.

transformers (dtype "auto", its default since 5.0) takes the dtype from config.json and, when
config.json names none, from the weights: the first floating-point tensor, by name, of the first
weight file (float8 tensors skipped). Planning such a model as float32 instead doubled a bf16
checkpoint's weights and cache per rank in the plan and in every rank's memory. Read from the
safetensors headers alone: no torch, no weight bytes.
"""

from __future__ import annotations

from pathlib import Path

# safetensors' dtype names -> corelaunch's compute dtypes (float8 and float64 tensors are not a
# compute dtype: skipped, as transformers skips float8)
_COMPUTE_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def stored_weights_dtype(model_dir: Path) -> str | None:
    """float32, bfloat16 or float16 as transformers would pick it from the weights of `model_dir`;
    None when there are no safetensors weights to read it from, or they cannot be read (the
    checkpoint checks before start-up name what is wrong with them)."""
    from shardlib.checkpoint_files import find_checkpoint, preferred_file, safetensors_header

    preferred = preferred_file(model_dir)  # a pickle is not opened: listing its tensors takes torch
    if preferred is None or not preferred[0].startswith("safetensors"):
        return None
    try:
        checkpoint = find_checkpoint(model_dir)
        header = safetensors_header(checkpoint.files[0])  # files are sorted by name, as transformers sorts shards
    except (OSError, ValueError):
        return None
    for name in sorted(header):
        dtype = _COMPUTE_DTYPES.get(header[name].dtype)
        if dtype is not None:
            return dtype
    return None
