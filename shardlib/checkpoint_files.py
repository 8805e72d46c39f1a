"""Where a Hugging Face checkpoint's tensors are and whether they are the ones its config needs,
from file names and headers alone: no torch, no weight bytes (shardlib/checkpoint.py reads them).

The driver checks a checkpoint with `check_checkpoint` before any worker starts: a missing file, a
truncated or corrupt safetensors header, an unknown, missing or misshapen tensor is named in a
fraction of a second instead of after Ray and every rank have started. Each rank's loader runs
the same checks again on what it opens.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from safetensors import SafetensorError, safe_open

from shardlib.model_config import ModelConfig
from shardlib.moe_configs import MOE_MODEL_TYPES
from shardlib.moe_params import model_names
from shardlib.param_shapes import LM_HEAD, expected_shapes
from shardlib.sharding import Style, style_for

CHECKPOINT_FILES = (
    ("safetensors", "model.safetensors"),
    ("safetensors_sharded", "model.safetensors.index.json"),
    ("bin", "pytorch_model.bin"),
    ("bin_sharded", "pytorch_model.bin.index.json"),
)

# ---- locating the files -----------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointFiles:
    """The files of one checkpoint and where each tensor lives."""

    directory: Path
    format: str
    """One of the first elements of CHECKPOINT_FILES."""
    files: tuple[Path, ...]
    """Weight files, sorted by name (one file for the unsharded formats)."""
    weight_map: dict[str, Path] = field(compare=False)
    """Tensor name -> the file holding it."""
    index_file: Path | None = None

    def describe(self) -> str:
        """The file set, for error messages."""
        names = ", ".join(f.name for f in self.files)
        if self.index_file is None:
            return str(self.files[0])
        return f"{self.index_file} (files: {names})"


def preferred_file(model_dir: str | Path) -> tuple[str, Path] | None:
    """(format, file) of the checkpoint find_checkpoint takes from `model_dir`, from file names alone
    (nothing opened: listing a pickle's tensors takes torch); None when it holds none."""
    for fmt, name in CHECKPOINT_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            return fmt, path
    return None


def find_checkpoint(model_dir: str | Path) -> CheckpointFiles:
    """Find the checkpoint in `model_dir`, preferring formats in CHECKPOINT_FILES order."""
    directory = Path(model_dir)
    if directory.is_file():
        from shardlib.model_path_hints import file_given_for_directory

        raise ValueError(file_given_for_directory(directory))
    if not directory.is_dir():
        raise FileNotFoundError(f"model directory {directory} does not exist or is not a directory")
    found = preferred_file(directory)
    if found is not None:
        fmt, path = found
        if path.name.endswith(".index.json"):
            return _from_index(directory, fmt, path)
        if fmt == "safetensors":
            names = safetensors_header(path)
        else:  # a pickle's table of contents is the whole file: torch reads it
            from shardlib.checkpoint import _PickleFile

            names = _PickleFile(path).tensors
        return CheckpointFiles(directory, fmt, (path,), {n: path for n in names})
    from shardlib.model_path_hints import dangling_links

    dangling = dangling_links(directory, [name for _, name in CHECKPOINT_FILES])
    if dangling:
        raise FileNotFoundError(dangling[0])
    present = sorted(p.name + (" (a symlink to nothing)" if p.is_symlink() and not p.exists() else "")
                     for p in directory.iterdir())
    shown = ", ".join(present[:12]) + (f" and {len(present) - 12} more" if len(present) > 12 else "")
    raise FileNotFoundError(
        f"no Hugging Face checkpoint in {directory}: looked for "
        f"{', '.join(n for _, n in CHECKPOINT_FILES)}; the directory holds: {shown or 'nothing'}"
    )


def _from_index(directory: Path, fmt: str, index: Path) -> CheckpointFiles:
    try:
        raw = json.loads(index.read_text(), object_pairs_hook=_JsonObject.of)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"checkpoint index {index} is not valid JSON ({err}); re-download or re-save it") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ValueError(
            f"checkpoint index {index} has no \"weight_map\" object of tensor name -> file name; "
            f"re-download or re-save it"
        )
    _refuse_repeated_tensors(index, weight_map)
    if not weight_map:  # a cut download: read as no files at all, a traceback came later
        raise ValueError(f"checkpoint index {index} lists no tensors (its \"weight_map\" is empty); the download is "
                         f"incomplete: fetch the index again")
    files: dict[str, Path] = {}
    for file_name in weight_map.values():
        if file_name not in files:
            if Path(file_name).is_absolute() or ".." in Path(file_name).parts:
                raise ValueError(f"checkpoint index {index} names {file_name!r}, outside {directory}")
            files[file_name] = directory / file_name
    _refuse_other_format(index, fmt, list(files))
    missing = [name for name, path in files.items() if not path.is_file()]
    from shardlib.model_path_hints import dangling_links

    dangling = dangling_links(directory, missing)
    if dangling:
        raise FileNotFoundError(f"checkpoint index {index} names a shard file that cannot be read: {dangling[0]}")
    if missing:
        raise FileNotFoundError(
            f"checkpoint index {index} names shard file(s) missing from {directory}: {', '.join(missing)}; "
            f"the download is incomplete: fetch the missing files again"
        )
    return CheckpointFiles(directory, fmt, tuple(sorted(files.values())),
                           {name: files[f] for name, f in weight_map.items()}, index)


class _JsonObject(dict):
    """A parsed JSON object (the last value of a repeated key, as json.loads keeps) that remembers
    each key it holds more than once, with every value given for it."""

    repeated: dict[str, list]

    @classmethod
    def of(cls, pairs: list[tuple[str, object]]) -> "_JsonObject":
        parsed = cls(pairs)
        values: dict[str, list] = {}
        for key, value in pairs:
            values.setdefault(key, []).append(value)
        parsed.repeated = {key: found for key, found in values.items() if len(found) > 1}
        return parsed


def _refuse_repeated_tensors(index: Path, weight_map: _JsonObject) -> None:
    """ValueError when the index maps one tensor to two files: json.loads kept the last, so which
    copy loaded (and which the weights' fingerprint hashed) was the parser's choice. The same file
    listed twice is harmless and passes."""
    for name, file_names in weight_map.repeated.items():
        distinct = list(dict.fromkeys(Path(str(f)) for f in file_names))  # "./a" is "a"
        if len(distinct) > 1:
            raise ValueError(
                f"checkpoint index {index} maps tensor {name!r} to {len(distinct)} files in its \"weight_map\" "
                f"({' and '.join(map(str, distinct))}): which copy loads was the JSON parser's choice; remove all "
                f"but the entry naming the file that holds the right weights, or download the index again")


def _refuse_other_format(index: Path, fmt: str, file_names: list[str]) -> None:
    """ValueError when a safetensors index names a PyTorch pickle (.bin): it was read as safetensors
    and called "not a valid safetensors file (header too large) ... probably truncated or corrupt:
    download it again", while the file was whole and the index of the other format. (The reverse, a
    pytorch_model.bin.index.json naming .safetensors files, loads: torch.load reads safetensors.)"""
    wrong = sorted(name for name in file_names if name.endswith(".bin"))
    if fmt != "safetensors_sharded" or not wrong:
        return
    raise ValueError(
        f"checkpoint index {index} indexes safetensors files but names {wrong[0]!r}"
        f"{f' (and {len(wrong) - 1} more)' if len(wrong) > 1 else ''}, a PyTorch pickle: the index belongs "
        f"to the other format; download {index.name} again, or, to load the .bin files as they are, replace "
        f"it with their own index (pytorch_model.bin.index.json)")


# ---- safetensors headers ---------------------------------------------------------------------
@dataclass(frozen=True)
class HeaderEntry:
    shape: tuple[int, ...]
    dtype: str
    """safetensors' name for it: F32, BF16, ..."""
    begin: int
    """Absolute file offset of the first byte."""
    end: int
    """Absolute file offset just past the last byte."""


def safetensors_header(path: Path) -> dict[str, HeaderEntry]:
    """A safetensors file's tensors, from its header, after safetensors itself has validated it
    (JSON, dtypes, offsets contiguous and inside the file); ValueError naming the file otherwise."""
    try:
        with safe_open(path, framework="numpy"):  # numpy: the check needs no torch
            pass
    except SafetensorError as err:
        raise ValueError(
            f"{path} is not a valid safetensors file ({err}); it is probably truncated or "
            f"corrupt: download or save it again"
        ) from None
    with open(path, "rb") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(header_len))
    data_start = 8 + header_len
    return {name: HeaderEntry(tuple(info["shape"]), info["dtype"], data_start + info["data_offsets"][0],
                              data_start + info["data_offsets"][1])
            for name, info in header.items() if name != "__metadata__"}


def sample_starts(length: int, count: int, size: int) -> list[int] | None:
    """Where `count` samples of `size` bytes spread evenly over `length` bytes start; None where the
    span is shorter than their total (it is taken whole). One rule for a file's bytes and a mapped
    tensor's, so that both sample the same places."""
    if length <= count * size:
        return None
    step = (length - size) / (count - 1)
    return [round(i * step) for i in range(count)]


def sampled_bytes(path: Path, begin: int, end: int, count: int, size: int) -> bytes:
    """`count` samples of `size` bytes spread evenly over the file's [begin, end) (the whole span when
    it is shorter than their total: sample_starts)."""
    starts = sample_starts(end - begin, count, size)
    fd = os.open(path, os.O_RDONLY)
    try:
        if starts is None:
            return os.pread(fd, end - begin, begin)
        return b"".join(os.pread(fd, size, begin + start) for start in starts)
    finally:
        os.close(fd)


# ---- the config's tensors ----------------------------------------------------------------------
def check_checkpoint(model_dir: str | Path, config: ModelConfig, ranks_read: bool = True) -> None:
    """What a rank's loader checks before it reads a weight byte (ValueError or FileNotFoundError
    naming the problem): names, shapes and dtypes. From safetensors headers alone; a pickled (.bin)
    checkpoint's table of contents is the whole file, which only torch can read: it is mapped, not
    read, as the ranks map it. ranks_read False: only transformers reads it (`check --reference`),
    so a stored tensor of a dtype the ranks cannot read is not refused."""
    ckpt = find_checkpoint(model_dir)
    if not ckpt.format.startswith("safetensors"):
        from shardlib.checkpoint import check_opened_checkpoint

        check_opened_checkpoint(ckpt, config)
        return
    headers = {path: safetensors_header(path) for path in ckpt.files}
    if ranks_read:
        _refuse_unreadable_dtypes(headers)
    names = checked_names(ckpt, {path: {n: e.shape for n, e in entries.items()} for path, entries in headers.items()},
                          config)
    check_dtypes(ckpt, {n: headers[ckpt.weight_map[n]][n].dtype for n in names}, config)
    stored = {path: {name: _stored_safetensor(path, entry) for name, entry in entries.items()}
              for path, entries in headers.items()}
    check_stored_copies(ckpt, stored, names, config)


@dataclass(frozen=True)
class StoredTensor:
    """One stored copy of a tensor, as much as comparing two copies needs."""

    shape: tuple[int, ...]
    dtype: str
    """safetensors' name for it (F32, BF16, ...)."""
    samples: Callable[[], bytes]
    """COPY_SAMPLES samples of COPY_SAMPLE_BYTES spread over its bytes, read when called."""

    def same_as(self, other: "StoredTensor") -> bool:
        """Whether the two hold the same values, by their samples (a copy matches them exactly; copies
        that differ only between the samples pass). A copy in another dtype is not the same: the
        bytes cannot say."""
        return (self.shape, self.dtype) == (other.shape, other.dtype) and self.samples() == other.samples()


COPY_SAMPLES = 16
COPY_SAMPLE_BYTES = 4096


def _stored_safetensor(path: Path, entry: HeaderEntry) -> StoredTensor:
    return StoredTensor(entry.shape, entry.dtype,
                        lambda: sampled_bytes(path, entry.begin, entry.end, COPY_SAMPLES, COPY_SAMPLE_BYTES))


def check_stored_copies(ckpt: CheckpointFiles, stored: dict[Path, dict[str, StoredTensor]], names: list[str],
                        config: ModelConfig) -> None:
    """ValueError where the checkpoint stores two different matrices where the model reads one: a needed
    tensor in two files, or a tied LM head that is not the embedding. `stored`: each file's tensors;
    `names`: the tensors the model reads (checked_names')."""
    _refuse_differing_copies(ckpt, stored, names)
    _check_tied_head(ckpt, stored, config)


READABLE_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "I64", "I32", "I16", "I8", "U8", "BOOL")
"""safetensors' names of the dtypes a rank's loader reads (shardlib.checkpoint maps each to torch's)."""


def _refuse_unreadable_dtypes(headers: dict[Path, dict[str, HeaderEntry]]) -> None:
    """ValueError for any stored tensor of a dtype the ranks' loader cannot read, used or not: each
    rank refuses the whole file for it (shardlib.checkpoint.SafetensorsFile), so a checkpoint with an
    extra U16 buffer passed this check and failed on every rank once Ray had started."""
    for path, entries in headers.items():
        for name, entry in entries.items():
            if entry.dtype not in READABLE_DTYPES:
                raise ValueError(unreadable_dtype(name, path, entry.dtype))


def unreadable_dtype(name: str, path: Path, dtype: str) -> str:
    """The refusal of a stored tensor whose dtype is not one of READABLE_DTYPES."""
    return (f"tensor {name!r} in {path} has dtype {dtype}, which corelaunch cannot read (it reads "
            f"{', '.join(READABLE_DTYPES)}), even where the model does not use the tensor; save the checkpoint "
            f"again without it, or with it cast to one of those")


FLOAT_DTYPES = ("F32", "BF16", "F16", "F64", "F8_E4M3", "F8_E5M2")
"""safetensors' names of the dtypes a weight, norm, bias or scale may be stored in (cast on load)."""
CODE_DTYPES = {"int8": "I8", "f8e4m3": "F8_E4M3", "f8e5m2": "F8_E5M2"}
"""The dtype of a quantized config's 8-bit codes, by its quantization_dtype (shardlib/quantization.py)."""


def check_dtypes(ckpt: CheckpointFiles, dtypes: dict[str, str], config: ModelConfig) -> None:
    """ValueError for a tensor the model reads whose dtype cannot hold it. `dtypes`: name -> safetensors'
    dtype name. Integer or boolean weights were cast to floating point and ran, giving garbage;
    only a quantized config's codes are integers."""
    quant = config.quantization
    wrong = []
    for name, dtype in dtypes.items():
        codes = quant is not None and quant.is_quantized(name, config.tie_word_embeddings)
        # a code of another 8-bit format loaded by its stored dtype while the plan, check's
        # tolerances and compiled directories went by config.json's
        allowed = (CODE_DTYPES[quant.dtype],) if codes else FLOAT_DTYPES
        if dtype not in allowed:
            what = f"config.json's quantization_dtype {quant.dtype!r} stores" if codes else "expected one of"
            wrong.append(f"{name!r} in {ckpt.weight_map[name].name} is {dtype} ({what} {', '.join(allowed)})")
    if wrong:
        raise ValueError(
            f"{len(wrong)} tensor(s) of {ckpt.describe()} have a dtype the model cannot use: {'; '.join(wrong[:4])}"
            f"{' ...' if len(wrong) > 4 else ''}; "
            + ("the checkpoint is not one `corelaunch quantize` writes: quantize the original checkpoint again"
               if quant is not None else
               "config.json has no quantization_config, so its weights must be floating point: this checkpoint "
               "was saved quantized by another tool or is corrupt; use the original floating-point checkpoint"))


def _refuse_differing_copies(ckpt: CheckpointFiles, stored: dict[Path, dict[str, StoredTensor]],
                             names: list[str]) -> None:
    """ValueError when a tensor the model reads is stored again, with other values, in a file other
    than the one the index maps it to: corelaunch read the index's copy while other loaders (transformers
    among them) may read the other, so the check's reference and the served model differed silently.
    A second copy of the same values is harmless and passes. Walked file by file, each file's names
    against the needed ones (every needed name against every file took 2-3 s a launch for an index
    of 37,000 tensors in 118 files)."""
    needed = set(names)
    for path, tensors in stored.items():
        for name in [name for name in tensors if name in needed]:  # the file's order: the same tensor named each time
            mapped = ckpt.weight_map[name]
            if path != mapped and not tensors[name].same_as(stored[mapped][name]):
                raise ValueError(
                    f"tensor {name!r} is stored in both {mapped.name} and {path.name} of {ckpt.directory}, with "
                    f"different values: the index ({ckpt.index_file.name}) maps it to {mapped.name}, but another "
                    f"loader may read the copy in {path.name}; remove the stray copy from {path.name}, or point the "
                    f"index at the copy you want")


def _check_tied_head(ckpt: CheckpointFiles, stored: dict[Path, dict[str, StoredTensor]], config: ModelConfig) -> None:
    """With tie_word_embeddings the LM head is the embedding and a stored lm_head.weight is ignored:
    fine for a saved copy of it, not for another matrix, which transformers 5 would use where 4.x
    ties. The two are compared by StoredTensor.same_as: sixteen samples of their bytes, spread over
    them, and a head of another dtype or shape is refused (a copy in another dtype too)."""
    embed = model_names(config).embed
    where = ckpt.weight_map
    if not config.tie_word_embeddings or LM_HEAD not in where or embed not in where:
        return
    head, table = stored[where[LM_HEAD]][LM_HEAD], stored[where[embed]][embed]
    if head.same_as(table):
        return
    raise ValueError(
        f"config.json has tie_word_embeddings=true, but {ckpt.describe()} stores a {LM_HEAD} ({head.dtype} "
        f"{list(head.shape)}) that is not a copy of {embed} ({table.dtype} {list(table.shape)}): tied, it would "
        f"be ignored (transformers 4 ties them; transformers 5 uses the stored head). Set tie_word_embeddings "
        f"to false to use the stored head, or remove {LM_HEAD} from the checkpoint to tie")


def checked_names(ckpt: CheckpointFiles, shapes_by_file: dict[Path, dict[str, tuple[int, ...]]],
                  config: ModelConfig) -> list[str]:
    """The names to read, given each file's tensor shapes; ValueError when the index names a tensor
    its file lacks, or a tensor is unknown, missing or misshapen."""
    absent = [n for n, path in ckpt.weight_map.items() if n not in shapes_by_file[path]]
    if absent:
        raise ValueError(f"checkpoint index {ckpt.index_file} maps tensor {absent[0]!r} to "
                         f"{ckpt.weight_map[absent[0]].name}, which does not contain it"
                         f"{f' (and {len(absent) - 1} more like it)' if len(absent) > 1 else ''}; "
                         f"the index and the files disagree: re-download or re-save the checkpoint")
    _refuse_index_omissions(ckpt, shapes_by_file, config)
    return validated_names(ckpt, {n: shapes_by_file[path][n] for n, path in ckpt.weight_map.items()}, config)


def _refuse_index_omissions(ckpt: CheckpointFiles, shapes_by_file: dict[Path, dict[str, tuple[int, ...]]],
                            config: ModelConfig) -> None:
    """ValueError when a tensor the config needs is absent from the index but held by one of its files
    (from the headers already read): it was called missing, "the checkpoint is incomplete", while
    only the index was."""
    if ckpt.index_file is None:
        return
    omitted = {}
    for name in expected_shapes(config):
        if name not in ckpt.weight_map:
            holder = next((path for path, shapes in shapes_by_file.items() if name in shapes), None)
            if holder is not None:
                omitted[name] = holder
    if omitted:
        name, holder = next(iter(omitted.items()))
        raise ValueError(
            f"checkpoint index {ckpt.index_file} omits tensor {name!r}, which {holder.name} holds"
            f"{f' (and {len(omitted) - 1} more like it)' if len(omitted) > 1 else ''}; the index is incomplete "
            f"or from another download: download {ckpt.index_file.name} again")


def validated_names(ckpt: CheckpointFiles, shapes: dict[str, tuple[int, ...]], config: ModelConfig) -> list[str]:
    """The names to read; ValueError for unknown, missing or misshapen tensors."""
    expected = expected_shapes(config)
    unknown = [n for n in shapes if n not in expected and not _ignorable(n, config)]
    if unknown:
        listed = ", ".join(f"{n!r} (in {ckpt.weight_map[n].name})" for n in unknown[:6])
        fix = _unknown_tensors_fix(unknown, expected, config)
        raise ValueError(
            f"{ckpt.describe()} holds {len(unknown)} tensor(s) that the {config.model_type} config does not "
            f"describe: {listed}{' ...' if len(unknown) > 6 else ''}; {fix}"
        )
    missing = [n for n in expected if n not in shapes]
    if missing:
        embed = model_names(config).embed
        if LM_HEAD in missing:
            hint = (f"; tie_word_embeddings is false (config.json's value, or the {config.model_type} default where "
                    f"it names none), so {LM_HEAD} must be stored: if this model ties its LM head to the "
                    f"embedding, set tie_word_embeddings to true in config.json")
        elif missing == [embed] and config.tie_word_embeddings and LM_HEAD in shapes:
            # transformers loads the tied matrix from either name; corelaunch reads it by the embedding's
            hint = (f"; the tied embedding is stored only as {LM_HEAD}, which transformers takes as the "
                    f"embedding but corelaunch does not: re-save the checkpoint (transformers' "
                    f"save_pretrained writes {embed}), or rename the tensor to {embed}")
        else:
            hint = "; the checkpoint is incomplete or was saved for another config"
        raise ValueError(
            f"{ckpt.describe()} is missing {len(missing)} tensor(s) the config needs: "
            f"{', '.join(repr(n) for n in missing[:6])}{' ...' if len(missing) > 6 else ''}{hint}"
        )
    wrong = [n for n in expected if shapes[n] != expected[n]]
    if wrong:
        listed = "; ".join(f"{n!r} in {ckpt.weight_map[n].name}: config.json gives {expected[n]}, "
                           f"found {shapes[n]}" for n in wrong[:4])
        raise ValueError(
            f"{len(wrong)} tensor(s) of {ckpt.describe()} have the wrong shape: {listed}"
            f"{' ...' if len(wrong) > 4 else ''}; config.json does not match these weights"
        )
    return list(expected)


# transformers 5 holds an MoE layer's experts fused in memory (one tensor for all experts' gate and
# up projections, one for their down projections); save_pretrained splits them into one tensor per
# expert, but a raw torch.save(model.state_dict()) keeps the fused ones.
FUSED_EXPERT_SUFFIXES = (".experts.gate_up_proj", ".experts.down_proj")


def _unknown_tensors_fix(unknown: list[str], expected: dict[str, tuple[int, ...]], config: ModelConfig) -> str:
    """What to do about tensors the config does not describe, from what their names suggest."""
    mislabelled = None if config.is_moe else _expert_tensor_family(unknown)
    if mislabelled is not None:
        name, families = mislabelled
        if any(".shared_expert." in n for n in unknown):  # Qwen2-MoE's: qwen3_moe would refuse them in turn
            return (f"{name!r} and a shared expert are Qwen2-MoE's tensors while config.json's model_type is "
                    f"{config.model_type} (a dense family): corelaunch does not run Qwen2-MoE (supported: "
                    f"{', '.join(MOE_MODEL_TYPES)} and the dense families)")
        return (f"{name!r} is a mixture-of-experts tensor while config.json's model_type is {config.model_type} "
                f"(a dense family, read without experts as transformers reads it): set model_type in config.json "
                f"to the family these weights were saved as ({families}){_stored_experts_hint(unknown)}")
    fused = next((n for n in unknown if n.endswith(FUSED_EXPERT_SUFFIXES)), None)
    if fused is not None:
        return (f"{fused!r} is one of transformers' fused in-memory experts (all experts in one tensor), as "
                f"a state_dict saved directly holds them: load the model in transformers and save it with "
                f"model.save_pretrained(dir), which writes one tensor per expert")
    prefixed = sum(f"model.{n}" in expected for n in unknown)
    if prefixed * 2 > len(unknown):
        return (f"the names lack the 'model.' prefix of a causal LM's checkpoint ({prefixed} of them are "
                f"expected as model.NAME): the weights were saved from the base model, not the "
                f"ForCausalLM one; save them from the ForCausalLM model, or add the prefix")
    return (f"check that config.json belongs to these weights (num_hidden_layers={config.num_hidden_layers}, "
            f"attention_bias={config.attention_bias}, tie_word_embeddings={config.tie_word_embeddings})")


# where each mixture-of-experts family's checkpoint keeps its experts: a Mixtral or Qwen3-MoE whose
# config.json says mistral, llama or qwen3 reads as that dense model (as transformers reads it)
_EXPERT_TENSOR_FAMILIES = {".block_sparse_moe.": "mixtral",
                           ".mlp.experts.": "qwen3_moe or mixtral"}


def _stored_experts_hint(names: list[str]) -> str:
    """", and num_local_experts to N" where the names number their experts (experts.N.): with the
    model_type alone the family's default count (Mixtral: 8) met the 4 stored, refused again."""
    numbers = [int(m.group(1)) for n in names if (m := re.search(r"\.experts\.(\d+)\.", n))]
    return f", and num_local_experts to {max(numbers) + 1}" if numbers else ""


def _expert_tensor_family(unknown: list[str]) -> tuple[str, str] | None:
    """(the first unknown tensor named as an expert layer's, the model_type(s) that store it so)."""
    return next(((name, family) for name in unknown for part, family in _EXPERT_TENSOR_FAMILIES.items()
                 if part in name), None)


def _ignorable(name: str, config: ModelConfig) -> bool:
    """A stored tensor the model does not use: a tied LM head's copy, rotary buffers."""
    if name == LM_HEAD and config.tie_word_embeddings:
        return True
    try:
        return style_for(config.model_type, name) is Style.SKIP
    except ValueError:
        return False
