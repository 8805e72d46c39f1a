"""Judging runs: accuracy against a reference (accuracy) and the benchmark report (bench_report).
Arithmetic on tokens, logits and timings; nothing here starts a model or a process."""
