"""Pure sharding math, planner rules, checkpoint slicing and quantization (no Ray, no processes)."""
