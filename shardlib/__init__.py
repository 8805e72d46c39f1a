"""Pure sharding math, planner rules, checkpoint slicing and quantization, and
evaluation/ (accuracy checks, benchmark reports); no Ray, no processes."""
