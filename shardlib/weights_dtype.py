"""The dtype a checkpoint's weights are stored in, for a config.json that names none.

transformers (dtype "auto", its default since 5.0) takes the dtype from config.json and, when
config.json names none, from the weights: the first floating-point tensor, by name, of the first
weight file (float8 tensors skipped). Planning such a model as float32 instead doubled a bf16
checkpoint's weights and cache per rank in the plan and in every rank's memory. Read from the
safetensors headers alone, or from a pickled checkpoint's record of its storages' types (the
data.pkl of torch.save's zip): no torch, no weight bytes, and nothing of the pickle is run.
The float32 scales of a quantized checkpoint's 8-bit weights are skipped, as its 8-bit weights are:
they say nothing of the dtype of its other tensors.
"""

from __future__ import annotations

from pathlib import Path

from shardlib.quantization import SCALE_SUFFIX, weight_name_of

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
        if dtype is not None and not _is_quantization_scale(name, header):
            return dtype
    return None


_QUANTIZED_STORAGE = ("I8", "F8_E4M3", "F8_E5M2")
"""safetensors' names of the 8-bit dtypes a quantized weight is stored in (shardlib/quantization.py)."""


def _is_quantization_scale(name: str, header: dict) -> bool:
    """Whether `name` is the float32 scale of a weight stored in 8 bits beside it (`<m>.scale` next to
    an int8 or fp8 `<m>.weight`): in a checkpoint `corelaunch quantize --embedding` or `--lm-head`
    wrote, 'scale' sorts before 'weight', and a bf16 model was read as float32. A `.scale` of no
    8-bit weight (some models name a parameter so) is the model's own, and counts."""
    if not name.endswith(SCALE_SUFFIX):
        return False
    weight = header.get(weight_name_of(name))
    return weight is not None and weight.dtype in _QUANTIZED_STORAGE


def pickled_weights_dtype(path: Path) -> str | None:
    """The compute dtype of the first floating-point tensor of a torch.save zip (transformers takes
    a pickled state dict's first floating tensor, in its order), from the storage classes its
    data.pkl names, read with pickletools (nothing is unpickled); None for another format, or when
    the first floating tensor is float64 (float8 ones are skipped, as for safetensors)."""
    import zipfile
    import zlib

    try:
        with zipfile.ZipFile(path) as archive:
            records = [info for info in archive.infolist() if info.filename.rsplit("/", 1)[-1] == "data.pkl"]
            if len(records) != 1 or records[0].file_size > MAX_PICKLE_RECORD_BYTES:
                return None
            record = archive.read(records[0])
    # the legacy (pre-zip) format, or unreadable: a bad CRC, a corrupt or unknown compression
    except (OSError, zipfile.BadZipFile, RuntimeError, zlib.error, EOFError, NotImplementedError, ValueError):
        return None
    for module, name in _pickled_globals(record):
        if module == "torch" and name in _PICKLED_DTYPES:
            return _PICKLED_DTYPES[name]
        if module == "torch" and name in _FLOAT64:
            return None
    return None


_STRING_PUSHES = ("UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "STRING", "BINSTRING",
                  "SHORT_BINSTRING")
_MEMO_GETS = ("GET", "BINGET", "LONG_BINGET")
_MEMO_PUTS = ("PUT", "BINPUT", "LONG_BINPUT")


def _pickled_globals(record: bytes):
    """The (module, name) of each global a pickle names, in order, read with pickletools: GLOBAL's
    text (protocol 2), or STACK_GLOBAL's two strings, which protocol 4 pushes before it, a repeated
    one fetched from the memo ('torch' is written once). Stops at a truncated or malformed record."""
    import pickletools

    memo: dict[int, str | None] = {}
    recent: list[str | None] = [None, None]  # the last two values pushed (None: not a string)
    try:
        for opcode, arg, _ in pickletools.genops(record):
            name = opcode.name
            if name == "GLOBAL":
                module, _, attr = str(arg).partition(" ")
                yield module, attr
                recent.append(None)
            elif name == "STACK_GLOBAL":
                if recent[-2] is not None and recent[-1] is not None:
                    yield recent[-2], recent[-1]
                recent.append(None)
            elif name in _STRING_PUSHES:
                recent.append(arg if isinstance(arg, str) else None)
            elif name in _MEMO_GETS:
                recent.append(memo.get(arg))
            elif name in _MEMO_PUTS:
                memo[arg] = recent[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = recent[-1]
            elif name not in ("FRAME", "PROTO", "MARK"):  # these push nothing a global could take
                recent.append(None)
            del recent[:-2]
    except ValueError:
        return
