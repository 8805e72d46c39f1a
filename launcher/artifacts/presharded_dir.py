"""A launch from pre-sharded weights (`--presharded DIR`) takes the layout they were cut for.

Each rank's load checks the directory's manifest against the launch (shardlib/presharded.py), but
only once Ray and every rank have started, and with `--tp auto` the planner's own choice (TP 1 on a
small host) was then refused with advice to write the directory again, where passing the degree it
was written for was the fix. As `--compiled` does, the settings a launch leaves to the planner are
taken from the manifest now, and the ones it sets against the manifest are refused before anything
starts, each named with its flag.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

# LaunchConfig field -> (its flag, the manifest's field)
_LAYOUT_FIELDS = {"tp": ("--tp", "tp_degree"), "kv_strategy": ("--kv-strategy", "kv_strategy"),
                  "moe_sharding": ("--moe-sharding", "moe_sharding"), "dtype": ("--dtype", "dtype")}
_DTYPES = ("float32", "bfloat16", "float16")


def _pads_at_written_degree(config, manifest: dict) -> bool:
    """Whether --pad-q-heads adds zero heads to config's model at the manifest's TP degree: a copy
    written with the flag at a degree dividing the heads records false (the padding applied)."""
    from launcher.artifacts.compiled_dir import pads_q_heads_at
    from launcher.launch_plan import resolve_model_dir

    try:  # read_manifest has refused a tp_degree below 1
        return pads_q_heads_at(resolve_model_dir(config.model), manifest["tp_degree"])
    except (OSError, ValueError):
        return True


def apply_presharded_dir(config):
    """config with config.presharded_dir's TP degree, KV strategy, expert sharding, query-head
    padding and dtype where it leaves them open (tp "auto", None, False); ValueError naming each
    option it sets otherwise. A manifest that cannot be read is left to the ranks' load and the
    checks before it, which say what is wrong with it."""
    from shardlib.model_config import normalize_dtype
    from shardlib.presharded import read_manifest

    directory = Path(config.presharded_dir)
    try:
        manifest = read_manifest(directory)
    except (OSError, ValueError):
        return config
    taken, differ = {}, []
    for field, (flag, key) in _LAYOUT_FIELDS.items():
        written, asked = manifest.get(key), getattr(config, field)
        if written is None or (key == "dtype" and written not in _DTYPES):
            continue  # not recorded (moe_sharding of a dense model), or "mixed"
        if asked in (None, "auto"):
            taken[field] = written
        elif (normalize_dtype(asked) if field == "dtype" else asked) != written:
            differ.append(f"{flag} {asked} (it was written for {written})")
    written_padding = bool(manifest.get("pad_q_heads", False))
    if config.pad_q_heads != written_padding:
        if config.pad_q_heads:
            if _pads_at_written_degree(config, manifest):  # else the flag adds nothing there, as when written
                differ.append("--pad-q-heads (it was written without padded query heads)")
        else:
            taken["pad_q_heads"] = True
    if differ:
        raise ValueError(f"pre-sharded checkpoint {directory} was cut for another layout than this launch asks: "
                         f"{'; '.join(differ)}; drop those options to load it as written, or write it again for "
                         f"this layout (shardlib.presharded.save_presharded; `--presharded-cache` writes its own copy in "
                         f"the cache, not into {directory})")
    return dataclasses.replace(config, **taken)
