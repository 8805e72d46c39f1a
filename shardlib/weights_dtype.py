"""The dtype a checkpoint's weights are stored in, for a config.json that names none.

transformers (dtype "auto", its default since 5.0) takes the dtype from config.json and, when
config.json names none, from the weights: the first floating-point tensor, by name, of the first
weight file (float8 tensors skipped). Planning such a model as float32 instead doubled a bf16
checkpoint's weights and cache per rank in the plan and in every rank's memory. Read from the
safetensors headers alone, or from a pickled checkpoint's record of its storages' types (the
data.pkl of torch.save's zip): no torch, no weight bytes, and nothing of the pickle is run.
"""

from __future__ import annotations

from pathlib import Path

# safetensors' dtype names -> corelaunch's compute dtypes (float8 and float64 tensors are not a
# compute dtype: skipped, as transformers skips float8)
_COMPUTE_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# What names a tensor's dtype in a pickled checkpoint: torch.save's storage classes, or, for
# dtypes without one (float8: an UntypedStorage), the dtype itself -> compute dtypes
_PICKLED_DTYPES = {"FloatStorage": "float32", "BFloat16Storage": "bfloat16", "HalfStorage": "float16",
                   "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
_FLOAT64 = ("DoubleStorage", "float64")  # floating (transformers would take it), not a compute dtype
MAX_PICKLE_RECORD_BYTES = 256 * 1024 * 1024
"""A data.pkl larger than this is not read (a checkpoint's is a few hundred bytes per tensor)."""


def stored_weights_dtype(model_dir: Path) -> str | None:
    """float32, bfloat16 or float16 as transformers would pick it from the weights of `model_dir`;
    None when there are no weights to read it from, or they cannot be read (the checkpoint checks
    before start-up name what is wrong with them)."""
    from shardlib.checkpoint_files import find_checkpoint, preferred_file, safetensors_header

    preferred = preferred_file(model_dir)
    if preferred is None:
        return None
    fmt, path = preferred
    try:
        if not fmt.startswith("safetensors") and not path.name.endswith(".index.json"):
            return pickled_weights_dtype(path)  # one pickle (listing its tensors would take torch)
        first = find_checkpoint(model_dir).files[0]  # sorted by name, as transformers sorts shards
        if not fmt.startswith("safetensors"):
            return pickled_weights_dtype(first)
        header = safetensors_header(first)
    except (OSError, ValueError):
        return None
    for name in sorted(header):
        dtype = _COMPUTE_DTYPES.get(header[name].dtype)
        if dtype is not None:
            return dtype
    return None


def pickled_weights_dtype(path: Path) -> str | None:
    """The compute dtype of the first floating-point tensor of a torch.save zip (transformers takes
    a pickled state dict's first floating tensor, in its order), from the storage classes its
    data.pkl names, read with pickletools (nothing is unpickled); None for another format, or when
    the first floating tensor is float64 (float8 ones are skipped, as for safetensors)."""
    import pickletools
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            records = [info for info in archive.infolist() if info.filename.rsplit("/", 1)[-1] == "data.pkl"]
            if len(records) != 1 or records[0].file_size > MAX_PICKLE_RECORD_BYTES:
                return None
            record = archive.read(records[0])
    except (OSError, zipfile.BadZipFile, RuntimeError):  # the legacy (pre-zip) format, or unreadable
        return None
    strings: list[str] = []
    try:
        for opcode, arg, _ in pickletools.genops(record):
            if opcode.name == "GLOBAL":  # protocol 2, torch.save's default: "module name"
                module, _, name = str(arg).partition(" ")
            elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:  # protocol 4: the two strings pushed before
                module, name = strings[-2:]
            else:
                if isinstance(arg, str):
                    strings.append(arg)
                continue
            if module == "torch" and name in _PICKLED_DTYPES:
                return _PICKLED_DTYPES[name]
            if module == "torch" and name in _FLOAT64:
                return None
    except ValueError:  # a truncated or malformed record
        return None
    return None
