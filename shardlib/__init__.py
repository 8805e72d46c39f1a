"""Pure maths, no Ray and no processes: model configs, the planner and its instance table, sharding
rules, checkpoint slicing, buckets, request checks, and evaluation/ (accuracy checks, benchmark
reports)."""
