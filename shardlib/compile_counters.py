"""Which compile-cache counters mean a graph was really compiled.

Read by the driver (launcher/compile_report.py, from rank 0's stats) and by each rank
(workers/compiled.py, saying whether a graph was built or taken from the cache), so both call the
same graphs compiled.
"""

COMPILING_COUNTERS = ("fxgraph_cache_miss", "autograd_cache_miss", "compiled_by_peer")
"""Counters that grow when inductor really compiles (a graph found in the cache counts a hit), here
or, for compiled_by_peer, in another rank of the host while this one waited for it
(workers/compile_once.py)."""
