"""Launch refusals inside a Serve replica, told in the builder's argument names.

The planner's and the launcher's messages name `corelaunch serve`'s options (`--cpus-per-rank`),
which is what most users type. A replica that `serve run` or `serve deploy` started got its settings
as builder arguments (`cpus_per_rank: 3` in a config file), so its refusal names those instead:
`--cpus-per-rank` becomes `cpus_per_rank`, `--no-compile` becomes `compile: false`. `--ray-address`
has no builder argument (a replica runs in the cluster Serve runs in): its advice is said so.
"""

from __future__ import annotations

import re
from contextlib import contextmanager

from launcher.cli.options import FLAG_OF_FIELD

_OTHER_FLAGS = {"--no-compile": "compile: false", "--presharded-cache": "presharded_cache",
                "--pad-q-heads": "pad_q_heads", "--fused-projections": "fused_projections",
                "--sequence-parallel": "sequence_parallel", "--warm-up": "warm_up",
                "--burst-wait-ms": "burst_wait_s (in seconds)"}
_ARGUMENT_OF_FLAG = {flag: field for field, flag in FLAG_OF_FIELD.items()} | _OTHER_FLAGS | {
    "--ray-address": "RAY_ADDRESS where `serve run`/`serve deploy` runs (the cluster Serve and its replicas run "
                     "in; the builder takes no ray_address)"}
_FLAG = re.compile(r"(?<![\w-])(" + "|".join(sorted(map(re.escape, _ARGUMENT_OF_FLAG), key=len, reverse=True))
                   + r")(?![\w-])")
_BOTH_NAMES = re.compile(r"\b(" + "|".join(sorted(map(re.escape, set(_ARGUMENT_OF_FLAG.values())), key=len, reverse=True))
                         + r"), \1(?![\w-])")
"""An argument named twice in a row: what "(pad_q_heads, --pad-q-heads)", the field and its option, becomes."""


def in_builder_terms(message: str) -> str:
    """`message` with every launch option named by the builder argument that sets it."""
    return _BOTH_NAMES.sub(r"\1", _FLAG.sub(lambda match: _ARGUMENT_OF_FLAG[match.group(1)], message))


@contextmanager
def refusals_in_builder_terms():
    """Re-raise an error whose one argument is its message with that message in builder terms
    (same type, same traceback); any other error as it is."""
    try:
        yield
    except Exception as err:
        if len(err.args) == 1 and isinstance(err.args[0], str):
            err.args = (in_builder_terms(err.args[0]),)
        raise
