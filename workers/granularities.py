"""The names of the compile granularities, importable without torch.

The CLI offers them as --granularity choices and LaunchConfig checks them before anything starts;
both must stay light, and workers/compiled.py (which implements them) imports torch. What each one
means is in workers/compiled.py's docstring.
"""

GRANULARITIES = ("model", "layer", "model-decode", "collective")
"""What one compiled graph covers: the whole step, one decoder layer, whole-step decode graphs with
per-layer prefill graphs, or the code between two collectives."""
DEFAULT_GRANULARITY = "layer"
"""The README's Measured table (benchmarks/decode.py) has the figures behind this choice."""
