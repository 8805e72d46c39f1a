"""How long planning takes: Llama-3.1-405B on every target, in a fresh process. Prints JSON.

    python benchmarks/plan_speed.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    # no options: --help says so, and a typo is refused instead of running the benchmark
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    start = time.perf_counter()
    from shardlib.model_config import load_model_config
    from shardlib.planner import plan

    import_s = time.perf_counter() - start
    config = load_model_config(REPO / "tests/data/configs/llama-3.1-405b.json")
    timings = {}
    for instance in ("trn2.48xlarge", "trn1.32xlarge", "inf2.48xlarge", "cpu"):
        t0 = time.perf_counter()
        result = plan(config, instance=instance)  # refused targets include the ways-out search
        timings[instance] = {"seconds": round(time.perf_counter() - t0, 5), "valid": result.valid,
                             "tp_degree": result.tp_degree}
    print(json.dumps({"model": "Llama-3.1-405B", "import_s": round(import_s, 4), "plans": timings,
                      "heavy_modules_imported": sorted(m for m in ("torch", "ray", "transformers")
                                                       if m in sys.modules)}, indent=2))


if __name__ == "__main__":
    main()
